"""File-system helpers: one lock, and one way to replace a file (data, configs, checkpoints, logs)."""

from __future__ import annotations

import fcntl
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


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


def write_atomic(path: Path, text: str) -> None:
    """Replace `path` with `text` through `replacing`."""
    with replacing(path) as tmp:
        tmp.write_text(text)
