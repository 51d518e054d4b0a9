"""File-system helpers: one lock, one way to replace a file (data, configs, checkpoints, logs), one
way to read a text or JSON file a user gave (one line naming what is wrong with it), and the check
that a directory can be written before any work starts."""

from __future__ import annotations

import fcntl
import json
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

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


def check_writable(path: Path, key: str) -> None:
    """`path` is a writable directory, or can be created as one: its nearest existing ancestor is a
    writable directory where a directory can be made. Creates nothing at `path` itself, so ranks
    checking the same path at once cannot see each other's probe (the probe is a uniquely named
    directory, removed again)."""
    path = Path(path)
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
    by default: save it as UTF-8)."""
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
    return value
