"""File-system helpers: one lock, one way to replace a file (data, configs, checkpoints, logs), one
way to read a text or JSON file a user gave (one line naming what is wrong with it), and the check
that a directory can be written before any work starts."""

from __future__ import annotations

import errno
import fcntl
import json
import math
import os
import re
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import yaml

from ds_train.errors import UserError


def hold_lock(path: Path) -> tuple[int | None, str]:
    """Take an exclusive lock on `path` for as long as this process lives, without waiting:
    (its file descriptor, "") or (None, what the holder wrote: "pid P on HOST since TIME")."""
    import socket
    import time

    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 200, 0).decode(errors="replace").strip()
        os.close(fd)
        return None, holder or "another process"
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}".encode(), 0)
    return fd, ""


@contextmanager
def file_lock(path: Path):
    """An exclusive lock on `path`: the first process does the work, the others wait for it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


@contextmanager
def replacing(path: Path) -> Iterator[Path]:
    """Yield a temporary sibling to write; when the block succeeds, fsync it and rename it over
    `path`. Readers see the old file or the whole new one, never a part; a failed write leaves
    `path` as it was and removes the temporary file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # per process: ranks never share one
    try:
        yield tmp
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def fsync_dir(path: Path) -> None:
    """Make the directory's entries (created, renamed, removed files) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, text: str) -> None:
    """Replace `path` with `text` through `replacing`."""
    with replacing(path) as tmp:
        tmp.write_text(text)


NAME_MAX, PATH_MAX = 255, 4096  # bytes, Linux's limits (the file system may say less: pathconf)
_OS_REASONS = {errno.ENAMETOOLONG: "a name in it is too long for the file system",
               errno.ENOTDIR: "a part of it is not a directory",
               errno.ELOOP: "it goes through a symbolic link loop",
               errno.EACCES: "permission denied on a directory in it",
               errno.EROFS: "it is on a read-only file system"}


def path_problem(path: str | os.PathLike, key: str) -> str | None:
    """Why the operating system would refuse `path` (the value of `key`), as one line naming the key,
    the path and the reason; None when it would take it (a path that does not exist yet is taken).
    Reads no file: the form (NUL bytes, UTF-8, NAME_MAX per component, PATH_MAX) and one stat."""
    text = os.fspath(path)
    shown = repr(text) if len(text) <= 120 else repr(text[:60] + "..." + text[-40:])
    if "\0" in text:
        return f"{key}: {shown} holds a null byte, which no file name may hold; remove it"
    try:
        raw = os.fsencode(text)
    except UnicodeEncodeError:
        return f"{key}: {shown} is not valid UTF-8 text; give it in UTF-8"
    for part in raw.split(b"/"):
        if len(part) > NAME_MAX:
            return (f"{key}: {shown}: the name {part[:24].decode(errors='replace')!r}... is {len(part)} bytes, "
                    f"longer than {NAME_MAX} bytes (the file system's limit on one name); shorten it")
    if len(raw) >= PATH_MAX:
        return (f"{key}: {shown} is {len(raw)} bytes, longer than {PATH_MAX} bytes (the operating system's "
                f"limit on a path); use a shorter path")
    try:
        os.stat(raw)
    except FileNotFoundError:
        return None
    except OSError as e:
        reason = _OS_REASONS.get(e.errno, "the operating system refuses it")
        if e.errno == errno.ENOTDIR:
            return f"{key}: {shown} cannot be a directory: {_file_in(raw)!r} is a file; choose another {key}"
        if e.errno == errno.ELOOP:
            reason = f"{reason} (too many levels of symbolic link)"
        return f"{key}: {shown}: {reason} ({e.strerror}); choose another {key} or fix the path"
    return None


def _file_in(raw: bytes) -> str:
    """The first part of `raw` that exists and is not a directory."""
    probe = b"/" if raw.startswith(b"/") else b""
    for part in raw.split(b"/"):
        if not part:
            continue
        probe = os.path.join(probe, part)
        if os.path.lexists(probe) and not os.path.isdir(probe):
            return os.fsdecode(probe)
    return os.fsdecode(raw)


def check_path(path: str | os.PathLike, key: str) -> None:
    """UserError with path_problem's line when the operating system would refuse `path`."""
    problem = path_problem(path, key)
    if problem:
        raise UserError(problem)


def path_problems(section, prefix: str, not_paths: tuple[str, ...] = ("",)) -> list[str]:
    """path_problem for every field of the dataclass `section` marked as a path (metadata "path"; a
    list's elements by index), skipping values in `not_paths` (names that are no path: auto, ...)."""
    import dataclasses

    errs = []
    for f in dataclasses.fields(section):
        if not f.metadata.get("path"):
            continue
        value, key = getattr(section, f.name), f"{prefix}{f.name}"
        items = [(f"{key}[{i}]", v) for i, v in enumerate(value)] if isinstance(value, list) else [(key, value)]
        errs += [p for k, v in items if isinstance(v, str) and v not in not_paths for p in [path_problem(v, k)] if p]
    return errs


# The command-line arguments that name a path (argparse dest -> how the user wrote it).
PATH_ARGS = {"config": "--config", "ds_config": "--ds-config", "hostfile": "--hostfile", "out": "--out",
             "source": "SOURCE", "sources": "SOURCE", "tokenizer": "--tokenizer", "chat_template": "--chat-template",
             "run_dir": "RUN_DIR", "run_dirs": "RUN_DIR", "paths": "RUN_DIR|LOGFILE"}


def check_path_args(args) -> None:
    """check_path for every path argument of a parsed command line (PATH_ARGS), before the command
    runs: a name the operating system refuses is one line naming the flag."""
    for dest, flag in PATH_ARGS.items():
        value = getattr(args, dest, None)
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, str) and item:
                check_path(item, flag)


def check_writable(path: Path, key: str) -> None:
    """`path` is a writable directory, or can be created as one: its nearest existing ancestor is a
    writable directory where a directory can be made. Creates nothing at `path` itself, so ranks
    checking the same path at once cannot see each other's probe (the probe is a uniquely named
    directory, removed again)."""
    path = Path(path)
    check_path(path, key)
    probe = path.absolute()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        raise UserError(f"{key}: {str(path)!r} cannot be a directory: {str(probe)!r} is a file; choose "
                        f"another {key}")
    if os.statvfs(probe).f_flag & os.ST_RDONLY:
        raise UserError(f"{key}: {str(path)!r} is on a read-only file system ({str(probe)!r}); choose a "
                        f"writable {key}")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise UserError(f"{key}: {str(probe)!r} is not writable by this user; choose another {key} or "
                        f"fix its permissions")
    if probe == path.absolute():
        return  # an existing directory: nothing to make, so nothing made (its mtime stays too)
    try:  # some file systems refuse what the checks above allow (/proc, /sys): try, and leave no trace
        os.rmdir(tempfile.mkdtemp(prefix=".ds_train-probe-", dir=probe))
    except OSError as e:
        raise UserError(f"{key}: cannot create {str(path)!r} ({e.strerror or e}); choose another {key}") from None


def read_text(path: Path, what: str, flag: str, fix: str = "", hint: str = "") -> str:
    """A UTF-8 text file given as `flag` (the option or key that named it); one line naming it when it
    is missing (and `hint`: where to find one), a directory, unreadable or not UTF-8 (then `fix`,
    by default: save it as UTF-8); a path the operating system refuses names `flag` and the reason."""
    check_path(path, flag)
    if path.is_dir():
        raise UserError(f"{flag}: {str(path)!r} is a directory, not a {what}; give the file itself")
    if not path.is_file():
        raise UserError(f"{path}: {what} not found" + (f" ({hint})" if hint else ""))
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        line = e.object[:e.start].count(b"\n") + 1
        raise UserError(f"{path}: not UTF-8 text (byte 0x{e.object[e.start]:02x} on line {line}); "
                        f"{fix or f'save the {what} as UTF-8'}") from None
    except OSError as e:
        raise UserError(f"{path}: cannot read the {what}: {e.strerror or e}") from None


def read_json(path: Path, what: str, flag: str, fix: str = "", hint: str = "") -> dict:
    """A JSON object in a UTF-8 file (read_text's checks); invalid JSON names its line and column."""
    try:
        value = json.loads(read_text(path, what, flag, fix, hint))
    except json.JSONDecodeError as e:
        raise UserError(f"{path}: invalid JSON at line {e.lineno}, column {e.colno}: {e.msg}"
                        + (f"; {fix}" if fix else "")) from None
    if not isinstance(value, dict):
        raise UserError(f"{path}: the top level must be a JSON object" + (f"; {fix}" if fix else ""))
    if bad := non_finite(value):  # Python's json reads NaN and Infinity, which JSON does not have
        key, number = bad
        raise UserError(f"{path}: {key}: {number} is not a finite number; give a number"
                        + (f" ({fix})" if fix else ""))
    return value


def non_finite(value, key: str = "") -> tuple[str, float] | None:
    """The first number in `value` (nested mappings and lists) that is NaN or infinite: its dotted
    key (`optimizer.params.lr`, `betas[1]`) and the number; None when every one is finite."""
    if isinstance(value, float) and not math.isfinite(value):
        return key, value
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for k, v in items:
        if found := non_finite(v, f"{key}[{k}]" if isinstance(k, int) else f"{key}.{k}" if key else str(k)):
            return found
    return None


# --- YAML: bounded loading of every YAML file a user gives ---------------------------------------

YAML_EXPANSION_LIMIT = 100_000  # nodes that aliases may add to a document by expanding (a few anchors: tens)
YAML_DEPTH_LIMIT = 100  # nesting (a run config: under ten); PyYAML composes recursively


class YamlRefused(yaml.YAMLError):
    """A YAML document refused before it is built: aliases that expand past YAML_EXPANSION_LIMIT
    ("billion laughs"), an alias inside its own anchor, nesting past YAML_DEPTH_LIMIT."""


class DuplicateKey(yaml.YAMLError):
    """A mapping that gives one key twice: YAML keeps the last silently, we refuse it."""

    def __init__(self, key: str, first_line: int, second_line: int):
        super().__init__(f"duplicate key {key!r} at lines {first_line} and {second_line}")
        self.key, self.lines = key, (first_line, second_line)


class _Loader(yaml.SafeLoader):
    """SafeLoader that also reads YAML 1.2 floats such as 3e-4 (YAML 1.1 needs a dot: 3.0e-4), and
    refuses an alias inside its own anchor or nesting deeper than YAML_DEPTH_LIMIT while composing."""

    def __init__(self, stream):
        super().__init__(stream)
        self._open_anchors: list[str] = []

    def compose_node(self, parent, index):
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent) and event.anchor in self._open_anchors:
            raise YamlRefused(f"alias *{event.anchor} at line {event.start_mark.line + 1} is used inside its "
                              f"own anchor &{event.anchor} (an endless document); write the value out")
        if len(self._open_anchors) >= YAML_DEPTH_LIMIT:
            raise YamlRefused(f"nested deeper than {YAML_DEPTH_LIMIT} levels at line {event.start_mark.line + 1}; "
                              f"a config is a few levels deep")
        self._open_anchors.append(getattr(event, "anchor", None) or "")
        try:
            return super().compose_node(parent, index)
        finally:
            self._open_anchors.pop()


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."))


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    return list(node.value) if isinstance(node, yaml.SequenceNode) else []


def _check_expansion(root: yaml.Node) -> None:
    """YamlRefused when the aliases make the document larger by more than YAML_EXPANSION_LIMIT nodes.
    Each distinct node is visited once (its expanded size memoised), so a bomb is measured in
    linear time instead of being walked."""
    size: dict[int, int] = {}
    stack = [(root, False)]
    while stack:
        node, done = stack.pop()
        if id(node) in size:
            continue
        if done:
            size[id(node)] = 1 + sum(size[id(c)] for c in _children(node))
            continue
        stack.append((node, True))
        stack += [(c, False) for c in _children(node) if id(c) not in size]
    expanded, distinct = size[id(root)], len(size)
    if expanded - distinct > YAML_EXPANSION_LIMIT:
        raise YamlRefused(f"its aliases expand {distinct:,} nodes to more than {expanded:,} (over the "
                          f"limit of {YAML_EXPANSION_LIMIT:,} added nodes: an alias bomb); write the values "
                          f"out or use fewer aliases")


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
    """Like yaml.safe_load (plus YAML 1.2 floats), bounded: YamlRefused for an alias bomb, an alias
    inside its own anchor or nesting past YAML_DEPTH_LIMIT; DuplicateKey for a key given twice in
    a mapping. Every YAML a user gives is read through this."""
    loader = _Loader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check_expansion(node)
        _check_duplicates(node)
        return loader.construct_document(node)
    finally:
        loader.dispose()
