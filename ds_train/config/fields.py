"""The parts every section of the run config is made of: a field with its help, bound and path flag
(`_f`), the bounds check, and the Section base class."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field

STDLIB_SOURCE = "python-stdlib"  # data.sources: the bundled corpus (ds_train.data.sources.STDLIB)
NOT_PATHS = ("", STDLIB_SOURCE, "auto", "none", "restart")  # values of path fields that name no path
POSITIVE, NON_NEGATIVE = "positive", ">= 0"  # a field's bound (checked for every section in one place)


@dataclass(frozen=True)
class Range:
    """A field's bound with open or closed ends (an infinite end: none), and why, said after it."""

    low: float = -math.inf
    high: float = math.inf
    low_open: bool = False
    high_open: bool = False
    note: str = ""  # "RLOO leaves one out", "0: off"

    def holds(self, value) -> bool:
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        return above and below


def range_words(bound: str | tuple | Range) -> str:
    """The one wording of a bound, wherever a value of its key is refused: `must be positive`,
    `must be >= 0`, `must be within [0, 1)`, `must be >= 2 (RLOO leaves one out)`."""
    if bound in (POSITIVE, NON_NEGATIVE):
        return f"must be {bound}"
    if isinstance(bound, tuple):
        bound = Range(*bound)
    low, high = _number(bound.low), _number(bound.high)
    if bound.high == math.inf:
        said = f"{'>' if bound.low_open else '>='} {low}"
    elif bound.low == -math.inf:
        said = f"{'<' if bound.high_open else '<='} {high}"
    else:
        said = f"within {'(' if bound.low_open else '['}{low}, {high}{')' if bound.high_open else ']'}"
    return f"must be {said}" + (f" ({bound.note})" if bound.note else "")


def _number(x: float) -> str:
    return str(int(x)) if math.isfinite(x) and float(x).is_integer() else f"{x:g}"


def in_bound(value, bound: str | tuple | Range) -> bool:
    if bound == POSITIVE:
        return value > 0
    if bound == NON_NEGATIVE:
        return value >= 0
    return (Range(*bound) if isinstance(bound, tuple) else bound).holds(value)


def out_of_range(key: str, value, bound: str | tuple | Range) -> str:
    """`key: value must be ...`: the one error of a key whose value is outside its bound (the config's
    checks and any later check of the same key say it with this)."""
    return f"{key}: {value} {range_words(bound)}"


def _f(default, help: str | Callable[[], str], bound: str | tuple | Range = "", path: bool = False, **kw):
    """A config field: its default, the help `--help-config` prints (a function: read when printed, as
    a registry's list of names, ds_train/config/registry.py), its bound (POSITIVE, NON_NEGATIVE,
    (low, high) with both included, or a Range; said by range_words, the one wording of a key's range)
    and whether it names a path (or a list of them) the operating system must take. A number (a
    float field, each number of a list of them) must be finite whatever its bound: YAML's .nan and
    .inf read as floats."""
    metadata = {"help": help, "bound": bound, "path": path}
    if isinstance(default, (dict, list)):
        return field(default_factory=lambda: type(default)(default), metadata=metadata, **kw)
    return field(default=default, metadata=metadata, **kw)


def out_of_bounds(section, prefix: str) -> list[str]:
    """One error for each field of `section` (`prefix`: its key; "" the top level) that holds a number
    that is not finite, or is outside its bound (null, where a field takes it, is inside)."""
    errs = []
    for f in dataclasses.fields(section):
        value, bound = getattr(section, f.name), f.metadata.get("bound")
        key = f"{prefix}.{f.name}" if prefix else f.name
        numbers = value if isinstance(value, list) else [value]
        if any(isinstance(x, float) and not math.isfinite(x) for x in numbers):
            errs.append(f"{key}: {value} must be a finite number")
        elif bound and value is not None and not isinstance(value, list) and not in_bound(value, bound):
            errs.append(out_of_range(key, value, bound))
    return errs


class Section:
    """A section of the run config: its fields' bounds are checked for it; check() adds the rest."""

    def check(self) -> list[str]:
        return []
