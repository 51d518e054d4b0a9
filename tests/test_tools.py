"""The built-in code tool (ds_train/ript/tools.py): a program's output, or the limit that stopped it, as the
tool's result; through an environment task's worker process as a model's call would run it."""

from __future__ import annotations

import time

import pytest


@pytest.mark.parametrize("code,said", [
    ("print(6 * 7)", "42\n"),
    ("print('partial'); raise ValueError('bad')", "partial\n\nerror: ValueError: bad"),
    ("x = bytearray(3 << 30)", "error: the program ran out of memory (its limit is 256 MiB)"),
    ("while True: pass", "error: the program ran past 2 s and was stopped"),
    ("import subprocess, time; subprocess.Popen(['sleep', '60']); time.sleep(60)",
     "error: the program ran past 2 s and was stopped"),
    ("import os; print(sorted(os.environ))", "['LANG', 'PATH']\n"),  # none of the trainer's variables
])
def test_a_program_runs_within_its_limits(code, said):
    from ds_train.ript.tools import run_limited

    start = time.monotonic()
    assert run_limited(code, 2, 256) == said
    assert time.monotonic() - start < 30  # stopped at its 2 s limit, not after the program's 60 s


def test_the_sleep_a_stopped_program_started_is_stopped_with_it():
    import subprocess

    from ds_train.ript.tools import run_limited

    marker = "import subprocess, time; subprocess.Popen(['sleep', '61.5']); time.sleep(60)"
    run_limited(marker, 1, 256)
    time.sleep(0.2)
    assert "sleep 61.5" not in subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
