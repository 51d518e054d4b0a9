"""bench/cli.py: a bench that fails says so in one line on stderr (bad input: exit 2; any other
error: exit 1, naming where it was raised), and `--debug` shows the traceback instead."""

from __future__ import annotations

import os
import subprocess
import sys

from conftest import ROOT


def bench(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"}
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def test_bad_arguments_are_one_line_and_exit_2():
    res = bench("bench/dpo.py", "--losses")
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr == "bench/dpo.py: error: argument --losses: expected one argument (see `dpo.py --help`)\n"


def test_an_error_is_one_line_naming_where_it_was_raised_and_debug_shows_the_traceback():
    res = bench("bench/tiled_loss.py", "--side", "0", "--tokens", "-1")  # a worker side: a negative tensor size
    lines = res.stderr.splitlines()
    assert res.returncode == 1 and len(lines) == 1, res.stderr
    assert lines[0].startswith("bench/tiled_loss.py: error: RuntimeError: ")
    assert "bench/tiled_loss.py, line " in lines[0]
    assert lines[0].endswith("(--debug shows the traceback)")
    res = bench("bench/tiled_loss.py", "--side", "0", "--tokens", "-1", "--debug")
    assert res.returncode == 1 and "Traceback (most recent call last)" in res.stderr
