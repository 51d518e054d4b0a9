"""Verifiers: a completion and a record's answer -> a reward in [0, 1] (success when it is 1).

Chosen by name in a data-driven task (`verifier:` of a ript.tasks entry) or given as
`module:function`, called as function(completion, answer, record) and returning a bool or a real number
(numpy's too); it runs in the task's room (ds_train/ript/env_room.py: a worker process, under
ript.env_step_timeout_s), where raising, hanging or a non-finite value ends the episode with its reason.
An answer may be a list: any of its items is right.

    exact    the completion, stripped, equals the answer (stripped)
    numeric  the last number in the completion equals the answer's within `tolerance` (relative to
             max(1, |answer|)): GSM8K's "#### 42", "= 42", "42." all read 42; 1,234 reads 1234
    regex    the first group of `pattern` (or its whole match) found in the completion equals the answer
    boxed    the last \\boxed{...} of the completion (nested braces kept) equals the answer, as text
             with spaces and $ removed, or as numbers
"""

from __future__ import annotations

import math
import numbers
import re
from typing import Any, Callable

from ds_train.errors import UserError, load_user_object

Verifier = Callable[[str, Any, dict], float]
NAMES = ("exact", "numeric", "regex", "boxed")
NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:[eE][-+]?\d+)?|-?\.\d+")


def _answers(answer: Any) -> list:
    return list(answer) if isinstance(answer, (list, tuple)) else [answer]


def parse_number(text: str) -> float | None:
    """A number as people write it: 1,234.5 -> 1234.5; a fraction a/b -> a / b; else None."""
    text = str(text).strip().rstrip(".").replace(",", "").replace("$", "")
    try:
        if "/" in text:
            num, den = text.split("/", 1)
            return float(num) / float(den)
        return float(text)
    except (ValueError, ZeroDivisionError):
        return None


def last_number(completion: str) -> float | None:
    found = NUMBER.findall(completion)
    return parse_number(found[-1]) if found else None


def close(got: float | None, want: float | None, tolerance: float) -> bool:
    if got is None or want is None or not math.isfinite(got):
        return False
    return abs(got - want) <= tolerance * max(1.0, abs(want))


def last_boxed(completion: str) -> str | None:
    """The content of the last \\boxed{...} (or \\fbox{...}), its braces balanced."""
    start = max(completion.rfind("\\boxed{"), completion.rfind("\\fbox{"))
    if start < 0:
        return None
    i = completion.index("{", start) + 1
    depth = 1
    for j in range(i, len(completion)):
        depth += {"{": 1, "}": -1}.get(completion[j], 0)
        if depth == 0:
            return completion[i:j]
    return None


def _normal(text: str) -> str:
    return re.sub(r"[\s$]", "", str(text))


def exact(completion: str, answer: Any, record: dict | None = None) -> float:
    return float(any(completion.strip() == str(a).strip() for a in _answers(answer)))


def make_numeric(tolerance: float) -> Verifier:
    def numeric(completion: str, answer: Any, record: dict | None = None) -> float:
        got = last_number(completion)
        return float(any(close(got, parse_number(a), tolerance) for a in _answers(answer)))
    return numeric


def make_regex(pattern: str) -> Verifier:
    compiled = re.compile(pattern)

    def regex(completion: str, answer: Any, record: dict | None = None) -> float:
        match = compiled.search(completion)
        if match is None:
            return 0.0
        got = (match.group(1) if compiled.groups else match.group(0)).strip()
        return float(any(got == str(a).strip() for a in _answers(answer)))
    return regex


def make_boxed(tolerance: float) -> Verifier:
    def boxed(completion: str, answer: Any, record: dict | None = None) -> float:
        got = last_boxed(completion)
        if got is None:
            return 0.0
        for a in _answers(answer):
            if _normal(got) == _normal(a) or close(parse_number(got), parse_number(a), tolerance):
                return 1.0
        return 0.0
    return boxed


def build_verifier(name: str, tolerance: float = 1e-6, pattern: str = "", where: str = "verifier") -> Verifier:
    """A verifier by name or `module:function`; one line naming `where` otherwise."""
    if name == "exact":
        return exact
    if name == "numeric":
        return make_numeric(tolerance)
    if name == "boxed":
        return make_boxed(tolerance)
    if name == "regex":
        if not pattern:
            raise UserError(f"{where}: regex needs a pattern (`pattern:`, its first group is the answer)")
        try:
            return make_regex(pattern)
        except re.error as e:
            raise UserError(f"{where}: pattern {pattern!r} is not a regular expression ({e})") from None
    if ":" not in name:
        raise UserError(f"{where}: {name!r} is not a verifier; use one of {', '.join(NAMES)} or module:function")
    fn = load_user_object(name, where)
    wrong = _not_a_verifier(fn, name, where)
    if wrong:
        raise UserError(wrong)

    def custom(completion: str, answer: Any, record: dict | None = None) -> float:
        value = fn(completion, answer, record or {})
        got = reward_value(value)
        if got is None:
            raise UserError(f"{where}: {name} returned {repr(value)[:60]}; a verifier returns a bool or a real number")
        return got  # NaN and inf as they are: the caller's reason (env_room: verifier_nonfinite)
    return custom


def reward_value(value: Any) -> float | None:
    """A verifier's value as a float: a bool (numpy's too) or any real number (numbers.Real: numpy's scalars
    included), not necessarily finite; None for anything else."""
    numpy_bool = type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_")  # numpy 2 and 1
    if not (isinstance(value, numbers.Real) or numpy_bool):
        return None
    try:
        return float(value)
    except Exception:  # noqa: BLE001 - a Real whose __float__ raises
        return None


def _not_a_verifier(fn: Any, name: str, where: str) -> str:
    """'' for a function taking (completion, answer, record); else one line saying what `fn` is."""
    import inspect

    if inspect.isclass(fn) or not callable(fn):
        what = "a class" if inspect.isclass(fn) else f"an instance of {type(fn).__name__}"
        return f"{where}: {name!r} is {what}; a verifier is function(completion, answer, record)"
    try:
        inspect.signature(fn).bind(None, None, None)
    except TypeError:
        return f"{where}: {name!r} does not take (completion, answer, record); a verifier is function(completion, answer, record)"
    except ValueError:  # no signature to read (a builtin)
        pass
    return ""
