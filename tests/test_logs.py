"""Logs on disk: the console copied to the rank log (timestamped, with host and rank) and, for rank
0, to train.log as the console showed it; what a dying process wrote is not lost."""

from __future__ import annotations

import re
import signal
import subprocess
import sys

from conftest import ROOT

CHILD = r"""
import os, subprocess, sys, time, warnings
from pathlib import Path
from ds_train.observe.logs import build_rank_log, capture_console
run = Path(sys.argv[1])
capture_console(run / "logs" / "rank_3.log", run / "logs" / "train.log", "hostA", 3)
print("plain print")
sys.stderr.write("to stderr\n")
os.write(1, b"from C-level fd 1\n")
subprocess.run([sys.executable, "-c", "print('from a subprocess')"])
warnings.warn("a warning")
sys.stdout.write("\rbar 10%\rbar 50%\rbar 100%\n")
build_rank_log(run / "logs" / "rank_3.log", 3, "hostA").info("an event of this rank")
sys.stdout.write("no newline yet")
sys.stdout.flush()
if sys.argv[2] == "kill":
    os.kill(os.getpid(), 9)
raise ValueError("the end")
"""


def _run(tmp_path, how: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path), how], cwd=ROOT, capture_output=True,
                          timeout=60)  # bytes: text mode would turn the carriage returns into newlines
    proc.stdout, proc.stderr = proc.stdout.decode(), proc.stderr.decode()
    return proc


def test_the_console_is_copied_to_the_rank_log_and_train_log(tmp_path):
    proc = _run(tmp_path, "raise")
    assert proc.returncode == 1
    # the console is unchanged: every byte, in its stream
    assert proc.stdout == ("plain print\nfrom C-level fd 1\nfrom a subprocess\n\rbar 10%\rbar 50%\rbar 100%\n"
                           "no newline yet")
    assert proc.stderr.startswith("to stderr\n") and "UserWarning: a warning" in proc.stderr
    assert proc.stderr.rstrip().endswith("ValueError: the end")
    log = (tmp_path / "logs" / "rank_3.log").read_text().splitlines()
    stamp = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3} hostA rank3"
    for text in ("out: plain print", "err: to stderr", "out: from C-level fd 1", "out: from a subprocess",
                 "out: bar 100%", "log: an event of this rank", "out: no newline yet", "err: ValueError: the end"):
        assert any(re.fullmatch(rf"{stamp} {re.escape(text)}", line) for line in log), (text, log)
    assert any("err: Traceback (most recent call last):" in line for line in log)
    assert [line for line in log if " err: " in line][-1].endswith("err: ValueError: the end")
    assert [line for line in log if " out: " in line][-1].endswith("out: no newline yet")  # an unfinished line: last
    console = (tmp_path / "logs" / "train.log").read_text().splitlines()
    # (stdout and stderr are two pipes: lines of one stream keep their order, the two interleave freely)
    assert {"plain print", "to stderr", "from C-level fd 1", "from a subprocess"} <= set(console)
    assert "bar 100%" in console and "bar 50%" not in "\n".join(console)  # a redrawn line: its last state
    assert "an event of this rank" not in "\n".join(console)  # the rank's own events are not console
    # each stream in its order (which of the two ends the file depends on when the copier reads each pipe)
    assert console.index("bar 100%") < console.index("no newline yet")
    assert console.index("to stderr") < console.index("Traceback (most recent call last):") < \
        console.index("ValueError: the end")


def test_what_a_killed_process_wrote_reaches_its_log(tmp_path):
    proc = _run(tmp_path, "kill")
    assert proc.returncode == -signal.SIGKILL
    log = (tmp_path / "logs" / "rank_3.log").read_text()
    assert log.rstrip().endswith("out: no newline yet")  # the unterminated last line too
