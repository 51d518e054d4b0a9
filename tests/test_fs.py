"""fs: the one way a file is replaced, and the lock."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import pytest

from ds_train.errors import UserError
from ds_train.fs import check_writable, replacing, write_atomic


def test_a_replaced_file_is_whole_and_nothing_is_left_beside_it(tmp_path):
    path = tmp_path / "state.json"
    write_atomic(path, "old")
    write_atomic(path, "new")
    assert path.read_text() == "new" and [p.name for p in tmp_path.iterdir()] == ["state.json"]


def test_a_failed_write_keeps_the_old_file(tmp_path):
    path = tmp_path / "train.bin"
    path.write_bytes(b"good")
    with pytest.raises(OSError):
        with replacing(path) as tmp:
            tmp.write_bytes(b"half")
            raise OSError("disk full")
    assert path.read_bytes() == b"good" and [p.name for p in tmp_path.iterdir()] == ["train.bin"]


def _check_many(path: str, n: int) -> list[str]:
    errors = []
    for _ in range(n):
        try:
            check_writable(Path(path), "output_dir")
        except UserError as e:
            errors.append(str(e))
    return errors


def test_ranks_checking_the_same_new_output_dir_at_once_do_not_see_each_others_probe(tmp_path):
    """Every rank checks output_dir before they meet: a probe made at the path itself (and removed)
    was seen by another rank as a path that exists and is not a directory."""
    run = tmp_path / "runs" / "run"
    with multiprocessing.get_context("spawn").Pool(4) as pool:
        errors = pool.starmap(_check_many, [(str(run), 300)] * 4)
    assert errors == [[]] * 4
    assert list(tmp_path.iterdir()) == []  # nothing made, nothing left
    run.mkdir(parents=True)
    mtime = run.stat().st_mtime_ns
    check_writable(run, "output_dir")
    assert list(run.iterdir()) == [] and run.stat().st_mtime_ns == mtime  # an existing directory: untouched
    with pytest.raises(UserError, match=r"cannot create '/proc/ds_train_run' \("):
        check_writable(Path("/proc/ds_train_run"), "output_dir")
