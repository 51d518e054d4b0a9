"""Reading a run config: YAML file -> `key=value` overrides -> type checks -> cross-field checks.

Every problem is collected and reported at once; unknown keys suggest the closest valid key. The
help text of each field (ds_train/config.py) is what `ds-train train --help-config` prints.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

from ds_train.config import RunConfig
from ds_train.errors import UserError
from ds_train.fs import read_text, write_atomic


class _Loader(yaml.SafeLoader):
    """SafeLoader that also reads YAML 1.2 floats such as 3e-4 (YAML 1.1 needs a dot: 3.0e-4)."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."))


class DuplicateKey(yaml.YAMLError):
    """A mapping that gives one key twice: YAML keeps the last silently, we refuse it."""

    def __init__(self, key: str, first_line: int, second_line: int):
        super().__init__(f"duplicate key {key!r} at lines {first_line} and {second_line}")
        self.key, self.lines = key, (first_line, second_line)


def _check_duplicates(node: yaml.Node, prefix: str = "") -> None:
    """Raise DuplicateKey for the first key given twice in one mapping, anywhere in the document
    (`<<` merge keys are YAML's own way to repeat keys and are left alone)."""
    if isinstance(node, yaml.MappingNode):
        seen: dict[str, int] = {}
        for key_node, value_node in node.value:
            if isinstance(key_node, yaml.ScalarNode) and key_node.tag != "tag:yaml.org,2002:merge":
                key, line = f"{prefix}{key_node.value}", key_node.start_mark.line + 1
                if key in seen:
                    raise DuplicateKey(key, seen[key], line)
                seen[key] = line
                _check_duplicates(value_node, f"{key}.")
            else:
                _check_duplicates(value_node, prefix)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _check_duplicates(item, f"{prefix.rstrip('.')}[{i}].")


def yaml_load(text: str):
    """Like yaml.safe_load (plus YAML 1.2 floats); a key given twice in a mapping is DuplicateKey."""
    loader = _Loader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check_duplicates(node)
        return loader.construct_document(node)
    finally:
        loader.dispose()


def _hints(cls) -> dict:
    return typing.get_type_hints(cls)


def all_keys() -> list[str]:
    """Every valid dotted key, for suggestions and --help-config."""
    keys = []
    for name, tp in _hints(RunConfig).items():
        if dataclasses.is_dataclass(tp):
            keys += [f"{name}.{f.name}" for f in dataclasses.fields(tp)]
        else:
            keys.append(name)
    return keys


def describe() -> str:
    """The config reference printed by `ds-train train --help-config`."""
    lines = []
    for f in dataclasses.fields(RunConfig):
        tp = _hints(RunConfig)[f.name]
        if dataclasses.is_dataclass(tp):
            lines.append(f"{f.name}: {' '.join((tp.__doc__ or '').split())}")
            for sub in dataclasses.fields(tp):
                default = sub.default if sub.default is not dataclasses.MISSING else sub.default_factory()
                lines.append(f"  {f.name}.{sub.name} = {default!r}\n      {sub.metadata['help']}")
        else:
            lines.append(f"{f.name} = {f.default!r}\n    {f.metadata['help']}")
    return "\n".join(lines)


def _suggest(key: str) -> str:
    candidates = all_keys() if "." in key else [f.name for f in dataclasses.fields(RunConfig)]
    close = difflib.get_close_matches(key, candidates, n=1, cutoff=0.5)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _check_type(key: str, value: Any, tp: Any) -> str | None:
    origin = typing.get_origin(tp)
    if origin is Literal:
        choices = typing.get_args(tp)
        return None if value in choices else f"{key}: {value!r} is not one of {', '.join(map(str, choices))}"
    if tp is bool:
        return None if isinstance(value, bool) else f"{key}: {value!r} must be true or false"
    if tp is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
        return None if ok else f"{key}: {value!r} must be an integer"
    if tp is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        return None if ok else f"{key}: {value!r} must be a number"
    if tp is str:
        return None if isinstance(value, str) else f"{key}: {value!r} must be a string"
    if tp is dict:
        return None if isinstance(value, dict) else f"{key}: must be a mapping"
    if tp is list:
        return None if isinstance(value, list) else f"{key}: must be a list"
    return None


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
            kwargs[f.name] = _build(tp, raw.get(f.name) or {}, f"{f.name}.", errs)
        elif f.name in raw:
            value = raw[f.name]
            if tp is float and isinstance(value, int) and not isinstance(value, bool):
                value = float(value)
            if value is False and typing.get_origin(tp) is Literal and "off" in typing.get_args(tp):
                value = "off"  # YAML 1.1 reads a bare `off` as false
            problem = _check_type(prefix + f.name, value, tp)
            if problem:
                errs.append(problem)
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
    head, _, rest = key.partition(".")
    hints = _hints(RunConfig)
    if head not in hints:
        return None
    if not rest:
        return hints[head]
    tp = hints[head]
    return _hints(tp).get(rest) if dataclasses.is_dataclass(tp) else None


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


def load_config(path: str | Path | None, overrides: list[str] = ()) -> RunConfig:
    """YAML file (optional) + `key=value` overrides -> validated, frozen RunConfig. A problem with a
    value given on the command line names the override, not the file."""
    raw = read_yaml(path) if path else {}
    unknown, given = [], {}
    for item, (key, value) in zip(overrides, parse_overrides(list(overrides))):
        if not key.startswith("model.config.") and key not in all_keys():
            unknown.append(f"override {key!r}: unknown key{_suggest(key)}")
        _set_dotted(raw, key, value)
        given[key] = (item.partition("=")[2], value)
    if unknown:
        raise UserError("; ".join(unknown))
    return build_config(raw, source=str(path) if path else "overrides", overrides=given)


def _blame(err: str, overrides: dict[str, tuple[str, Any]]) -> str | None:
    """`override KEY=TEXT: problem` when `err` ("KEY: VALUE problem") is about an override's value,
    else None (the value came from the file or is a default)."""
    for key, (text, value) in overrides.items():
        if err.startswith(f"{key}: "):
            problem = err[len(key) + 2:]
            as_float = [repr(float(value))] if type(value) is int else []  # an int given for a float field
            for shown in dict.fromkeys((repr(value), str(value), text, *as_float)):
                if shown and problem.startswith(f"{shown} "):
                    problem = problem[len(shown) + 1:]
                    break
            return f"override {key}={text}: {problem}"
    return None


def build_config(raw: dict, source: str = "config",
                 overrides: dict[str, tuple[str, Any]] | None = None) -> RunConfig:
    """`raw` -> RunConfig, every problem reported at once. A problem with one of `overrides` (key ->
    (text as given, value)) is blamed on the override, the others on `source`."""
    errs: list[str] = []
    cfg = _build(RunConfig, raw, "", errs)
    errs += cfg.check()  # fields with a type error kept their default, so these checks still run
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
