"""The launcher processes above a rank, and whether they are still there.

A scheduler or a container runtime stops a job by signalling the process it started: the plain
`deepspeed` runner, `ds-train launch`, torchrun. Not every one of them passes the signal on (the
single-node `deepspeed` runner dies of SIGTERM and leaves DeepSpeed's per-node launcher and the
ranks training on), and none can when it is SIGKILLed. So each rank watches the launchers above
it: the unbroken chain of known launcher processes from its parent up (DeepSpeed's per-node
launcher, its runner, torchrun, `ds-train launch`). When one of them is gone (exited, killed,
a zombie nobody reaped), the rank asks for a stop as if it had SIGTERM: every rank saves at the
next step and exits, and nothing of the job is left running. A rank whose parent is not a
launcher (a shell, `nohup`, srun's step daemon) watches nothing: its parent may come and go.

Across pdsh nodes no launcher is above the remote ranks (sshd started them), so `ds-train launch`
beats: it bumps a counter in the rendezvous store every BEAT_S seconds and tells the ranks so
(DS_TRAIN_LAUNCHER_BEAT_S, which also sets the beat where `ds-train launch` runs); a counter that
stops for GONE_AFTER beats is a launcher gone.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass

BEAT_S = 5.0  # `ds-train launch`'s beat
GONE_AFTER = 6  # beats missed before the ranks call it gone (30 s)
BEAT_ENV = "DS_TRAIN_LAUNCHER_BEAT_S"


def launch_beat_s(environ) -> float:
    """`ds-train launch`'s beat: BEAT_S, or DS_TRAIN_LAUNCHER_BEAT_S where set in its environment."""
    from ds_train.errors import UserError

    text = environ.get(BEAT_ENV, "").strip()
    try:
        beat = float(text) if text else BEAT_S
    except ValueError:
        beat = -1.0
    if not 0 < beat < 3600:
        raise UserError(f"{BEAT_ENV}={text!r}: not a number of seconds between 0 and 3600; unset it "
                        f"(default {BEAT_S:g}) or give e.g. 2")
    return beat

# How a launcher's command line reads (python -m MODULE, a console script, or `ds-train launch`).
_LAUNCHERS = [
    ("deepspeed launcher", re.compile(r"(^|\s)(-m\s+)?deepspeed\.launcher\.launch(\s|$)")),
    ("deepspeed runner", re.compile(r"(^|[\s/])(deepspeed|ds)(\s|$)|deepspeed\.launcher\.runner")),
    ("torchrun", re.compile(r"(^|[\s/])torchrun(\s|$)|torch\.distributed\.(run|launch)(\s|$)")),
    ("ds-train launch", re.compile(r"((^|[\s/])ds-train|-m\s+ds_train)\s+(--debug\s+)?launch(\s|$)")),
]


def launcher_kind(cmdline: list[str]) -> str | None:
    """`deepspeed runner` / `torchrun` / ... when a command line is a launcher's, else None."""
    text = " ".join(cmdline)
    return next((name for name, pattern in _LAUNCHERS if pattern.search(text)), None)


@dataclass(frozen=True)
class Launcher:
    kind: str
    pid: int
    started: float  # its create time: a reused pid is another process

    def describe(self) -> str:
        return f"{self.kind} (pid {self.pid})" if self.pid else self.kind


# Seconds between the SIGTERM a stopping launcher sends its ranks and its SIGKILL: DeepSpeed's
# launcher (terminate_process_tree), torchrun's agent and SLURM's KillWait (its default) all wait 30 s.
GRACE_S = {"deepspeed launcher": 30.0, "torchrun": 30.0}


def kill_grace(watch: "LauncherWatch", environ) -> tuple[str, float] | None:
    """(who, seconds) a stopping job's ranks get between SIGTERM and SIGKILL, where known."""
    for launcher in watch.launchers:
        if launcher.kind in GRACE_S:
            return f"the {launcher.kind}", GRACE_S[launcher.kind]
    if environ.get("SLURM_JOB_ID"):
        return "SLURM (KillWait, 30 s by default)", 30.0
    return None


class LauncherWatch:
    """The launchers above this process, found once at start; `gone()` names the first one missing."""

    def __init__(self, pid: int | None = None, environ=None):
        import psutil

        beat = (os.environ if environ is None else environ).get(BEAT_ENV)
        self.beat_s = float(beat) if beat else 0.0  # `ds-train launch` beats in the store
        self._beats, self._beat_seen = -1, time.monotonic()
        self.launchers: list[Launcher] = []
        try:
            proc = psutil.Process(pid or os.getpid()).parent()
            while proc is not None and proc.pid > 1:
                kind = launcher_kind(proc.cmdline())
                if kind is None:
                    break
                self.launchers.append(Launcher(kind, proc.pid, proc.create_time()))
                proc = proc.parent()
        except psutil.Error:  # an ancestor ended while we looked, or is not ours to read: watch what we found
            pass

    def gone(self, channel=None) -> Launcher | None:
        """The first launcher found gone: a process above this one, or `ds-train launch`'s beats
        in the store (`channel`) stopped."""
        import psutil

        if self.beat_s and channel is not None:
            beats = channel.add("launcher/beats", 0)
            now = time.monotonic()
            if beats != self._beats:
                self._beats, self._beat_seen = beats, now
            elif now - self._beat_seen > GONE_AFTER * self.beat_s:
                return Launcher("ds-train launch (its beats stopped)", 0, 0.0)
        for launcher in self.launchers:
            try:
                proc = psutil.Process(launcher.pid)
                if proc.create_time() != launcher.started or proc.status() == psutil.STATUS_ZOMBIE:
                    return launcher
            except psutil.NoSuchProcess:
                return launcher
            except psutil.Error:  # not ours to read any more: it still exists
                continue
        return None
