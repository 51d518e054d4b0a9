"""SLURM's SIGUSR1 before the time limit (`--signal=USR1@T`) can reach a rank at any moment of its
life, not only while it trains: during start-up (a requeued job that starts late), or after the
last step while the rank tears down. Python's default for SIGUSR1 is to die of it, which srun
reports as exit 138, the code that says "saved; requeue me": a job that had finished would be
queued again. From the first line of `main` a SIGUSR1 is therefore kept, never fatal: the run's
stop handler (ds_train/run.py StopRequest) takes one that came before it and saves at the first
step; one after the run's end is ignored and the rank exits as the run ended (0). Python puts the
default (fatal) disposition back while the interpreter finalizes, after `main` returned; an exit
hook therefore ignores SIGUSR1 at the C level before that (a finished rank died of it there)."""

from __future__ import annotations

import atexit
import signal

_kept: list[int] = []


def keep_usr1() -> None:
    """Keep SIGUSR1 from now on instead of dying of it (the main thread of a run command)."""
    signal.signal(signal.SIGUSR1, _keep)
    atexit.register(signal.signal, signal.SIGUSR1, signal.SIG_IGN)  # survives finalization


def _keep(signum, frame) -> None:
    _kept.append(signum)


def take_kept() -> int:
    """The signal kept before the run's handlers went in (0: none); taken once."""
    signum = _kept[0] if _kept else 0
    _kept.clear()
    return signum
