"""The parts every section of the run config is made of: a field with its help, bound and path flag
(`_f`), the bounds check, and the Section base class."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import field

STDLIB_SOURCE = "python-stdlib"  # data.sources: the bundled corpus (ds_train.data.sources.STDLIB)
NOT_PATHS = ("", STDLIB_SOURCE, "auto", "none", "restart")  # values of path fields that name no path
POSITIVE, NON_NEGATIVE = "positive", ">= 0"  # a field's bound (checked for every section in one place)


def _f(default, help: str | Callable[[], str], bound: str | tuple = "", path: bool = False, **kw):
    """A config field: its default, the help `--help-config` prints (a function: read when printed, as
    a registry's list of names, ds_train/config/registry.py), its bound (POSITIVE, NON_NEGATIVE,
    or (low, high), both included) and whether it names a path (or a list of them) the operating
    system must take. A number (a float field, each number of a list of them) must be finite whatever
    its bound: YAML's .nan and .inf read as floats."""
    metadata = {"help": help, "bound": bound, "path": path}
    if isinstance(default, (dict, list)):
        return field(default_factory=lambda: type(default)(default), metadata=metadata, **kw)
    return field(default=default, metadata=metadata, **kw)


def out_of_bounds(section, prefix: str) -> list[str]:
    """One error for each field of `section` (`prefix`: its key; "" the top level) that holds a number
    that is not finite, or is outside its bound."""
    errs = []
    for f in dataclasses.fields(section):
        value, bound = getattr(section, f.name), f.metadata.get("bound")
        key = f"{prefix}.{f.name}" if prefix else f.name
        numbers = value if isinstance(value, list) else [value]
        if any(isinstance(x, float) and not math.isfinite(x) for x in numbers):
            errs.append(f"{key}: {value} must be a finite number")
        elif isinstance(bound, tuple) and not bound[0] <= value <= bound[1]:
            errs.append(f"{key}: {value} must be within [{bound[0]}, {bound[1]}]")
        elif bound == POSITIVE and value <= 0 or bound == NON_NEGATIVE and value < 0:
            errs.append(f"{key}: {value} must be {bound}")
    return errs


class Section:
    """A section of the run config: its fields' bounds are checked for it; check() adds the rest."""

    def check(self) -> list[str]:
        return []
