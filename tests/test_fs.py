"""fs: the one way a file is replaced, and the lock."""

from __future__ import annotations

import pytest

from ds_train.fs import replacing, write_atomic


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
