"""fs: the one way a file is replaced, and the lock."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import pytest

from conftest import ROOT, expect_error, tree_listing
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


# --- paths the operating system refuses ----------------------------------------------------------

LONG = "x" * 300  # a component over NAME_MAX (255 bytes)


def os_refusals(tmp_path) -> dict[str, tuple[Path, str]]:
    """Paths the OS refuses, each with what the one line must say."""
    (tmp_path / "file.txt").write_text("x")
    (tmp_path / "loop_a").symlink_to(tmp_path / "loop_b")
    (tmp_path / "loop_b").symlink_to(tmp_path / "loop_a")
    return {"name too long": (tmp_path / LONG / "x", "longer than 255 bytes"),
            "path too long": (tmp_path.joinpath(*["y" * 200] * 25), "longer than 4096 bytes"),
            "not a directory": (tmp_path / "file.txt" / "x", f"cannot be a directory: '{tmp_path / 'file.txt'}' is a file"),
            "link loop": (tmp_path / "loop_a" / "x", "symbolic link"),
            "null byte": (Path(f"{tmp_path}/a\0b"), "null byte")}


def test_every_os_refusal_of_a_path_is_one_line_naming_the_key_and_the_reason(tmp_path):
    from ds_train.fs import path_problem

    for case, (path, needle) in os_refusals(tmp_path).items():
        said = path_problem(str(path), "data.dir")
        assert said and said.startswith("data.dir: ") and needle in said and "\n" not in said, (case, said)
    assert path_problem(str(tmp_path / "not_yet" / "there"), "data.dir") is None  # missing is not refused here
    assert path_problem(str(tmp_path / "file.txt"), "data.dir") is None


def test_check_writable_and_read_text_say_what_the_os_refused_in_one_line(tmp_path):
    from ds_train.fs import read_json, read_text

    for case, (path, needle) in os_refusals(tmp_path).items():
        with pytest.raises(UserError, match=f"^output_dir: .*{needle}") as e:
            check_writable(path, "output_dir")
        with pytest.raises(UserError, match=f"^--ds-config: .*{needle}"):
            read_json(path, "DeepSpeed JSON file", "--ds-config")
        with pytest.raises(UserError, match=f"^--config: .*{needle}"):
            read_text(path, "config file", "--config")
        assert "\n" not in str(e.value), case


def test_every_path_given_on_the_command_line_is_checked_before_the_command_runs(tmp_path):
    """--out of prepare / export / plot, a SOURCE, RUN_DIR, --config, --hostfile: a path the OS
    refuses is one line naming the flag, exit 2, nothing written."""
    (tmp_path / "a.txt").write_text("some text\n" * 20)
    long = str(tmp_path / LONG)
    zero0 = str(ROOT / "ds_configs" / "zero0.json")
    before = tree_listing(tmp_path)
    for args, flag in ((["prepare", str(tmp_path / "a.txt"), "--out", long], "--out"),
                       (["prepare", long, "--out", str(tmp_path / "d")], "SOURCE"),
                       (["export", long, "--out", str(tmp_path / "e")], "SOURCE"),
                       (["export", str(tmp_path), "--out", long], "--out"),
                       (["convert", "--to", "universal", long], "SOURCE"),
                       (["plot", long], "RUN_DIR"),
                       (["train", "--config", long, "--ds-config", zero0], "--config"),
                       (["launch", "--hostfile", long, "--", "train", "--config", zero0, "--ds-config", zero0],
                        "--hostfile")):
        expect_error(args, f"{flag}: ", "longer than 255 bytes")
    assert tree_listing(tmp_path) == before
