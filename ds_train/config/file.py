"""Reading a run config: YAML file -> `key=value` overrides -> type checks -> cross-field checks.

Every problem is collected and reported at once; unknown keys suggest the closest valid key. The
help text of each field (ds_train/config/) is what `ds-train train --help-config` prints.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

from ds_train.config import RunConfig
from ds_train.config.uses import unused_keys
from ds_train.errors import UserError
from ds_train.fs import DuplicateKey, YamlRefused, read_text, write_atomic, yaml_load


def _hints(cls) -> dict:
    return typing.get_type_hints(cls)


def all_keys() -> list[str]:
    """Every valid dotted key, for suggestions and --help-config."""
    def walk(cls, prefix: str) -> list[str]:
        out = []
        for name, tp in _hints(cls).items():
            out += walk(tp, f"{prefix}{name}.") if dataclasses.is_dataclass(tp) else [f"{prefix}{name}"]
        return out

    return walk(RunConfig, "")


def describe() -> str:
    """The config reference printed by `ds-train train --help-config`."""
    lines = []

    def walk(cls, prefix: str, indent: str) -> None:
        for f in dataclasses.fields(cls):
            tp = _hints(cls)[f.name]
            if dataclasses.is_dataclass(tp):
                lines.append(f"{indent}{prefix}{f.name}: {' '.join((tp.__doc__ or '').split())}")
                walk(tp, f"{prefix}{f.name}.", indent + "  ")
            else:
                default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
                text = f.metadata["help"]() if callable(f.metadata["help"]) else f.metadata["help"]  # a registry's
                shown = "null" if default is None else repr(default)  # as it is written in YAML
                lines.append(f"{indent}{prefix}{f.name} = {shown}\n{indent}    {text}")

    walk(RunConfig, "", "")
    return "\n".join(lines)


def _suggest(key: str) -> str:
    candidates = all_keys() if "." in key else [f.name for f in dataclasses.fields(RunConfig)]
    close = difflib.get_close_matches(key, candidates, n=1, cutoff=0.5)
    return f" (did you mean {close[0]!r}?)" if close else ""


_SCALARS = {bool: "true or false", int: "an integer", float: "a number", str: "a string",
            dict: "a mapping", list: "a list"}


def expected(tp: Any) -> str:
    """What a value of type `tp` is, in words: `a list of strings`, `one of auto, true, false`."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return "one of " + ", ".join(str(a).lower() if isinstance(a, bool) else str(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " or ".join("null" if a is type(None) else expected(a) for a in args)
    if origin is list and args:
        return f"a list of {_plural(args[0])}"
    if origin is dict and args:
        return "a mapping" if args[1] is Any else f"a mapping of {_plural(args[1])}"
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    return _SCALARS.get(origin or tp, getattr(tp, "__name__", str(tp)))


def _plural(tp: Any) -> str:
    said = expected(tp)
    return {"a string": "strings", "an integer": "integers", "a number": "numbers",
            "true or false": "booleans", "a mapping": "mappings"}.get(said, said)


def _is(value: Any, tp: Any) -> bool:
    """`value` is a plain `tp` (bool is no integer; an integer is a number)."""
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, tp)


def _not_utf8(key: str, value: str) -> list[str]:
    """Text from a command line that is not UTF-8 arrives with surrogate escapes; it could not be
    written into config.yaml, nor shown."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return [f"{key}: {value!r} is not valid UTF-8 text; give it in UTF-8"]
    return []


def type_problems(key: str, value: Any, tp: Any) -> list[str]:
    """Every place where `value` is not a `tp`, at any depth: list elements (`key[1]`), mapping keys
    and values (`key.name`), Optional / Union, Literal choices; each naming the full key and what it
    must be. Text anywhere must be UTF-8."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if isinstance(value, str) and _not_utf8(key, value):
        return _not_utf8(key, value)
    if tp is Any:
        if isinstance(value, (list, dict)):  # free-form: still text must be text, keys names
            return type_problems(key, value, list[Any] if isinstance(value, list) else dict[str, Any])
        return []
    if origin is Literal:  # by type too: 1 == True, but `1` is not the choice `true`
        ok = any(value == a and type(value) is type(a) for a in args)
        return [] if ok else [f"{key}: {value!r} is not {expected(tp)}"]
    if origin in (typing.Union, types.UnionType):
        for a in args:
            if (value is None) if a is type(None) else not type_problems(key, value, a):
                return []
        return [f"{key}: {value!r} must be {expected(tp)}"]
    if origin is list or tp is list:
        if not isinstance(value, list):
            return [f"{key}: must be {expected(tp)}"]
        item = args[0] if args else Any
        return [p for i, v in enumerate(value) for p in type_problems(f"{key}[{i}]", v, item)]
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            return [f"{key}: must be {expected(tp)}"]
        item, errs = (args[1] if args else Any), []
        for k, v in value.items():
            if not isinstance(k, str):
                errs.append(f"{key}: key {k!r} must be a string")
            else:
                errs += type_problems(f"{key}.{k}", v, item)
        return errs
    if tp in _SCALARS:
        return [] if _is(value, tp) else [f"{key}: {value!r} must be {expected(tp)}"]
    return []


def _build(cls, raw: dict, prefix: str, errs: list[str]):
    if not isinstance(raw, dict):
        errs.append(f"{prefix.rstrip('.') or 'config'}: must be a mapping, got {type(raw).__name__}")
        raw = {}
    hints = _hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for key in raw:
        if key not in names:
            errs.append(f"{prefix}{key}: unknown key{_suggest(prefix + str(key))}")
    kwargs = {}
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            kwargs[f.name] = _build(tp, raw.get(f.name) or {}, f"{prefix}{f.name}.", errs)
        elif f.name in raw:
            value = raw[f.name]
            if tp is float and isinstance(value, int) and not isinstance(value, bool):
                value = float(value)
            if value is False and typing.get_origin(tp) is Literal and "off" in typing.get_args(tp):
                value = "off"  # YAML 1.1 reads a bare `off` as false
            problems = type_problems(prefix + f.name, value, tp)
            if problems:
                errs += problems
            else:
                kwargs[f.name] = value
    return cls(**kwargs)


def _set_dotted(raw: dict, key: str, value: Any) -> None:
    parts = key.split(".")
    node = raw
    for part in parts[:-1]:
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node = node[part]
    node[parts[-1]] = value


def _field_type(key: str):
    """The annotated type of a dotted key (None for keys inside a free-form mapping)."""
    tp = RunConfig
    for part in key.split("."):
        if not dataclasses.is_dataclass(tp):
            return None
        tp = _hints(tp).get(part)
    return tp


def parse_overrides(items: list[str]) -> list[tuple[str, Any]]:
    """`a.b=value` strings -> (key, value): text as given for string keys, else parsed as YAML."""
    out = []
    for item in items:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise UserError(f"override {item!r}: expected key=value, for example train.max_steps=20")
        if _field_type(key) is str:
            value = text
        else:
            try:
                value = yaml_load(text) if text else ""
            except yaml.YAMLError:
                value = text
        out.append((key, value))
    return out


def read_yaml(path: str | Path) -> dict:
    """Load a YAML mapping; a syntax error or a key given twice names the file and line."""
    path = Path(path)
    text = read_text(path, "config file", "--config")
    try:
        raw = yaml_load(text)
    except DuplicateKey as e:
        first, second = e.lines
        raise UserError(f"{path}: {e.key!r} is given twice, at lines {first} and {second} (YAML would keep "
                        f"only the second); remove one of them") from None
    except YamlRefused as e:
        raise UserError(f"{path}: {e}") from None
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "?"
        raise UserError(f"{path}: invalid YAML at {where}: {e.problem}") from None
    except yaml.reader.ReaderError as e:  # a control character YAML does not allow
        raise UserError(f"{path}: invalid YAML: character #x{e.character:04x} at offset {e.position} is not "
                        f"allowed in YAML; remove it") from None
    except yaml.YAMLError as e:
        raise UserError(f"{path}: invalid YAML: {' '.join(str(e).split())}") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise UserError(f"{path}: the top level must be a mapping of sections (model, data, train, ...)")
    return raw


def load_config(path: str | Path | None, overrides: list[str] = (), command: str | None = None) -> RunConfig:
    """YAML file (optional) + `key=value` overrides -> validated, frozen RunConfig for `command`
    (a key it would not read is refused: ds_train/config/uses.py). A problem with a value given on the
    command line names the override, not the file."""
    raw = read_yaml(path) if path else {}
    unknown, given = [], {}
    for item, (key, value) in zip(overrides, parse_overrides(list(overrides))):
        if not key.startswith("model.config.") and key not in all_keys():
            unknown.append(f"override {key!r}: unknown key{_suggest(key)}")
        _set_dotted(raw, key, value)
        given[key] = (item.partition("=")[2], value)
    if unknown:
        raise UserError("; ".join(unknown))
    _read_template(raw, "override data.chat_template" if "data.chat_template" in given
                   else f"{path}'s data.chat_template")
    return build_config(raw, source=str(path) if path else "overrides", overrides=given, command=command)


def _read_template(raw: dict, where: str) -> None:
    """data.chat_template given as a path to a .jinja file: the template's text in its place (so the run's
    saved config holds the template it rendered with)."""
    data = raw.get("data")
    value = data.get("chat_template") if isinstance(data, dict) else None
    if not (isinstance(value, str) and value.endswith(".jinja") and "\n" not in value and "{" not in value):
        return
    data["chat_template"] = read_text(Path(value), "chat template", where,
                                      hint=f"{where} names it; give a path from the directory you run in, or "
                                           f"the template's text")


def _blame(err: str, overrides: dict[str, tuple[str, Any]]) -> str | None:
    """`override KEY=TEXT: problem` when `err` ("KEY: VALUE problem") is about an override's value,
    else None (the value came from the file or is a default)."""
    for key, (text, value) in overrides.items():
        if err.startswith((f"{key}[", f"{key}.")) and ": " in err:  # an element or a key inside it
            return f"override {key}={text}: {err}"
        if err.startswith(f"{key}: "):
            problem = err[len(key) + 2:]
            as_float = [repr(float(value))] if type(value) is int else []  # an int given for a float field
            for shown in dict.fromkeys((repr(value), str(value), text, *as_float)):
                if shown and problem.startswith(f"{shown} "):
                    problem = problem[len(shown) + 1:]
                    break
            return f"override {key}={text}: {problem}"
    return None


def build_config(raw: dict, source: str = "config", overrides: dict[str, tuple[str, Any]] | None = None,
                 command: str | None = None) -> RunConfig:
    """`raw` -> RunConfig, every problem reported at once, keys `command` would not read included
    (None: a train or a ript run). A problem with one of `overrides` (key -> (text as given, value))
    is blamed on the override, the others on `source`."""
    errs: list[str] = []
    cfg = _build(RunConfig, raw, "", errs)
    errs += cfg.check()  # fields with a type error kept their default, so these checks still run
    said = {e.split(":")[0].split("=")[0] for e in errs}  # a key already refused for its value: not again
    errs += [e for e in unused_keys(cfg, raw, command) if e.split(":")[0] not in said]
    if not errs:
        return cfg
    blamed = [_blame(err, overrides or {}) for err in errs]
    if len(errs) == 1:
        raise UserError(blamed[0] or f"{source}: {errs[0]}")
    on_source, on_overrides = None in blamed, any(blamed)
    header = (f"{source} and overrides" if on_source and on_overrides and source != "overrides"
              else source if on_source else "overrides")
    raise UserError(f"{header}: {len(errs)} problems: " + "; ".join(b or e for e, b in zip(errs, blamed)))


def save_config(cfg: RunConfig, path: Path) -> None:
    write_atomic(path, yaml.safe_dump(cfg.to_dict(), sort_keys=False))
