"""Logs on disk: every rank's console output, warnings and tracebacks in logs/rank_<r>.log, and rank
0's console in logs/train.log.

`capture_console` points this process's stdout and stderr (file descriptors 1 and 2, so output
of C++ code, subprocesses and Python's last traceback is caught too) at pipes read by a small
child process that copies every byte to the console unchanged and every line, timestamped with
host and rank, to the rank's log. A child, not a thread: it drains the pipes after this process
dies, even of SIGKILL or a fatal signal, and it keeps running while this process is frozen. It
ignores the signals that would end it (a Ctrl-C or a scheduler's SIGTERM / SIGUSR1 reach every
process of a job) and ends when the pipes close.

DeepSpeed's launcher can write per-rank logs too (`--enable_each_rank_log DIR`), but it redirects
instead of copying (the console goes silent), adds no timestamps and names files by launch time;
it works with the deepspeed launcher only. This works under every launcher.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

# The child: copy fd IN_OUT to CONSOLE_OUT and IN_ERR to CONSOLE_ERR as they come; every line to
# the rank log (prefixed) and, for rank 0, to train.log (as the console showed it: a line redrawn
# with carriage returns, a progress bar, keeps its last state).
_TEE = r"""
import os, select, signal, sys, time
# A scheduler signals every process of a job (SLURM's SIGUSR1 before the time limit, SIGTERM on
# preemption; a Ctrl-C reaches the whole process group): this copy must outlive the rank's last words.
for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGUSR1", "SIGUSR2", "SIGQUIT", "SIGALRM", "SIGPIPE"):
    signal.signal(getattr(signal, name), signal.SIG_IGN)
in_out, in_err, con_out, con_err = map(int, sys.argv[1:5])
log = open(sys.argv[5], "ab", buffering=0)
console_log = open(sys.argv[6], "ab", buffering=0) if sys.argv[6] else None
prefix = sys.argv[7].encode()
pending = {in_out: b"", in_err: b""}
console = {in_out: con_out, in_err: con_err}
tag = {in_out: b"out", in_err: b"err"}
def stamp():
    t = time.time()
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)).encode() + b".%03d" % int(t % 1 * 1000)
def lines(fd, data, final=False):
    buf = pending[fd] + data
    *done, rest = buf.split(b"\n")
    if final and rest:
        done, rest = done + [rest], b""
    pending[fd] = rest
    out, raw = [], []
    for line in done:
        line = line.rstrip(b"\r").rsplit(b"\r", 1)[-1]
        raw.append(line + b"\n")
        out.append(stamp() + b" " + prefix + b" " + tag[fd] + b": " + line + b"\n")
    if out:
        log.write(b"".join(out))
        if console_log is not None:
            console_log.write(b"".join(raw))
open_fds = [in_out, in_err]
while open_fds:
    ready, _, _ = select.select(open_fds, [], [])
    for fd in ready:
        data = os.read(fd, 65536)
        if not data:
            open_fds.remove(fd)
            lines(fd, b"", final=True)
            continue
        try:
            os.write(console[fd], data)
        except OSError:
            pass  # the console went away (a closed terminal): keep the log
        lines(fd, data)
"""

LINE_FORMAT = "%(asctime)s.%(msecs)03d {prefix} log: %(message)s"
DATE_FORMAT = "%Y-%m-%d %H:%M:%S"


@dataclass
class Capture:
    child: subprocess.Popen
    console_fds: tuple[int, int]  # the console as it was: where the child copies to


_current: Capture | None = None  # one capture per process (fds 1 and 2 are process-wide)


def prefix(host: str, rank: int) -> str:
    return f"{host} rank{rank}"


def capture_console(log_path: Path, console_log: Path | None, host: str, rank: int) -> None:
    """From now on, stdout and stderr go to the console and to `log_path` (and `console_log`).
    Called again (a second run in one process), it moves the copy to the new files."""
    global _current
    log_path.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    if _current is None:
        console_fds = (os.dup(1), os.dup(2))
    else:
        console_fds = _current.console_fds
        release_console()
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    child = subprocess.Popen(
        [sys.executable, "-c", _TEE, str(out_r), str(err_r), *map(str, console_fds), str(log_path),
         str(console_log or ""), prefix(host, rank)],
        pass_fds=(out_r, err_r, *console_fds), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        stderr=console_fds[1])
    os.close(out_r)
    os.close(err_r)
    os.dup2(out_w, 1)
    os.dup2(err_w, 2)
    os.close(out_w)
    os.close(err_w)
    for stream in (sys.stdout, sys.stderr):  # a pipe is block-buffered: keep lines timely
        stream.reconfigure(line_buffering=True)
    _current = Capture(child, console_fds)


def release_console() -> None:
    """Stdout and stderr back to the console; the child drains what is left and ends."""
    global _current
    if _current is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(_current.console_fds[0], 1)
    os.dup2(_current.console_fds[1], 2)
    try:
        _current.child.wait(timeout=10)
    except subprocess.TimeoutExpired:
        _current.child.kill()
    _current = None


def build_rank_log(path: Path, rank: int, host: str) -> logging.Logger:
    """logs/rank_<r>.log (`path`) for this rank's own events (saves, resume, how it ended), in the
    format of the captured console lines."""
    path.parent.mkdir(parents=True, exist_ok=True)
    log = logging.getLogger(f"ds_train.rank{rank}")
    log.setLevel(logging.INFO)
    log.propagate = False
    for handler in list(log.handlers):
        log.removeHandler(handler)
        handler.close()
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter(LINE_FORMAT.format(prefix=prefix(host, rank)), DATE_FORMAT))
    log.addHandler(handler)
    return log


def say_nothing(*args, **kwargs) -> None:
    """What every rank but 0 says (and a quiet run's rank 0)."""
    return None


def console_say(*args) -> None:
    """Rank 0's print, through tqdm: a line said while the progress bar is up leaves the bar whole."""
    from tqdm import tqdm

    tqdm.write(" ".join(map(str, args)), file=sys.stdout)
