"""The checkpointer: at each step boundary it decides whether the step is its (every
checkpoint.every steps, the last step, or a stop every rank agreed on), checks the free space, saves
(ds_train/checkpoint/commit.py; periodic saves in the background with checkpoint.async_save,
ds_train/checkpoint/asyncsave.py) and turns a failed write into one line; checkpoint.debug_fault injects a
crash or a full disk at a phase of a save (ds_train/faults.py)."""

from __future__ import annotations

import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ds_train import dist
from ds_train.checkpoint.asyncsave import Abandoned, BackgroundSave
from ds_train.checkpoint.commit import latest_complete, save, tag_for, weights_finite
from ds_train.config import CheckpointConfig
from ds_train.errors import AgreedError, Preempted, UserError
from ds_train.faults import save_fault


# A save that takes more than this share of the launcher's grace period would not fit with the step in progress.
GRACE_SHARE = 0.5


def grace_warning(save_s: float, grace: tuple[str, float] | None) -> str | None:
    """What to say when a save of `save_s` seconds would not fit the launcher's grace period
    (`grace`: who, and its seconds between SIGTERM and SIGKILL); None when it fits or is unknown."""
    if grace is None or save_s <= GRACE_SHARE * grace[1]:
        return None
    who, grace_s = grace
    return (f"checkpoint: a save takes {save_s:.0f} s; {who} kills the ranks {grace_s:g} s after a SIGTERM, so a "
            f"save on SIGTERM (after the step in progress) may be cut off and lost (the last whole save stays "
            f"latest). Stop jobs with SIGUSR1 instead, which starts the save before any clock (SLURM: ds-train "
            f"slurm --signal-lead; ds-train launch passes it to every rank), or save a smaller state")


@dataclass(frozen=True)
class SaveSite:
    """Where and as whom this rank saves: the run's checkpoint directory, its rank of `world`, whether
    it writes what a tag shares (the marker, `latest`; None: rank 0), how a failed save's line names
    it (" (node 0, host)"), the rendezvous store where background saves meet (None: one process), and
    how long a peer's heartbeat may stand still there before its process counts as gone."""

    ckpt_dir: Path
    rank: int = 0
    world: int = 1
    writer: bool | None = None
    where: str = ""
    channel: Any = None
    peer_gone_s: float = 10.0


@dataclass(frozen=True)
class SaveHooks:
    """What the checkpointer uses of the run: the stop every rank agreed on (`stop.agreed()`), the
    rank's log, the heartbeat (the stop agreement is a collective, a save is long I/O), rank 0's
    `say`, and the launcher's grace between a stop's SIGTERM and its SIGKILL (who, seconds)."""

    stop: Any
    log: Any
    beat: Callable[[int, str], None] = lambda step, phase: None
    say: Callable[[str], None] = lambda line: None
    grace: tuple[str, float] | None = None


class Checkpointer:
    """Decides at each step boundary whether the step is its: every `checkpoint.every` steps, the
    last step (`checkpoint.save_final`), or a SIGTERM / SIGINT that every rank agreed on, after
    which it raises Preempted. Every rank calls `maybe_save` at every boundary: the signal
    agreement and the save are collectives, never behind a rank guard. Before each save the
    writers compare their free space with the predicted size of a tag; a save that fails for
    space or I/O ends the run with one line, `latest` still naming a whole tag."""

    def __init__(self, cfg: CheckpointConfig, engine, site: SaveSite, hooks: SaveHooks, *, last: int, record: dict,
                 unit: str = "step", seq: int = 1, needed_bytes: int = 0):
        """`last`: the last step (or iteration: `unit`); `record`: what every save's marker holds;
        `seq`: this run's first save number; `needed_bytes`: a tag's predicted size."""
        self.engine, self.cfg, self.last, self.unit, self.record = engine, cfg, last, unit, record
        self.ckpt_dir, self.rank, self.world, self.where = site.ckpt_dir, site.rank, site.world, site.where
        self.writer = site.rank == 0 if site.writer is None else site.writer
        self.channel, self.peer_gone_s = site.channel, site.peer_gone_s
        self.stop, self.log, self.beat, self.say, self.grace = hooks.stop, hooks.log, hooks.beat, hooks.say, hooks.grace
        self.seq, self.needed_bytes = seq, needed_bytes
        self.fault = save_fault(cfg.debug_fault, site.rank)
        self.inflight: BackgroundSave | None = None
        self.saved: str | None = None  # the newest tag this run saved whole (its closing line names it)

    def due(self, step: int) -> bool:
        every = self.cfg.every > 0 and step % self.cfg.every == 0
        return every or (step == self.last and self.cfg.save_final)

    def maybe_save(self, step: int, state: Callable[[], dict] = dict, rank_state: Callable[[], dict] = dict) -> None:
        """Save when due or signalled; `state()` (called on every rank, may hold collectives) adds
        the loop's own position to the record, `rank_state()` this rank's own (its rank file)."""
        self.beat(step, "agree-stop")
        signum = self.stop.agreed()
        due = bool(signum) or self.due(step)
        if due or step == self.last:
            self.wait(step)  # one save in flight at a time, and the run ends with every save whole
        if due:  # a stop's save and the last one block: the process ends right after them
            self.save(step, state(), rank_state(), background=self.cfg.async_save and not signum and step != self.last)
        if signum:
            raise Preempted(signum, step, self.unit)

    def save(self, step: int, state: dict, rank_state: dict | None = None, background: bool = False) -> str:
        """Non-finite weights are never saved: the last good checkpoint stays the latest.
        `background`: return once the state is copied; the writer thread finishes the save."""
        self.beat(step, "save")
        if not weights_finite(self.engine):
            raise UserError(f"{self.unit} {step}: the weights are not finite; no checkpoint written ("
                            f"{self._latest()}); if model.path's weights are finite, lower optim.lr and resume")
        self.check_space(step)
        t0 = time.perf_counter()
        args = (self.engine, self.ckpt_dir, step, {**self.record, **state, "step": step}, self.rank, self.world,
                self.cfg.keep, self.writer, self.seq, rank_state, self.fault)
        try:
            if background:
                self.inflight = BackgroundSave(self.channel, self.log, self.peer_gone_s)
                tag = self.inflight.start(*args)
            else:
                tag = save(*args, say=self.log.info)
        except (OSError, RuntimeError) as e:
            raise UserError(self._failed(step, e)) from None
        self.seq += 1
        if background:
            self.log.info(f"checkpoint {tag}: state copied in {self.inflight.stall_s:.2f} s, writing in the background")
        else:
            self._saved(tag, time.perf_counter() - t0)
        return tag

    def wait(self, step: int) -> None:
        """Every rank: the background save in flight (if any) is whole, or the run ends with one line
        (every rank's writer failures gathered: each rank's part of a save may fail alone)."""
        job, self.inflight = self.inflight, None
        if job is None:
            return
        error = job.join(lambda: self.beat(step, "save"))
        line = None
        if error is not None and not isinstance(error, Abandoned):
            line = self._failed(job.step, error)  # a bug is raised here, with its traceback
        lines = [r for r in dist.all_gather_object(line) if r]
        if lines:
            raise AgreedError(lines[0])
        self._saved(job.tag, job.stall_s + job.write_s, f" ({job.stall_s:.2f} s of it stopped training)")

    def _saved(self, tag: str, took: float, note: str = "") -> None:
        self.saved = tag
        self.log.info(f"saved checkpoint {tag} in {took:.2f} s{note}")
        warning = grace_warning(took, self.grace)
        if warning:  # said once, at the first save that would not fit
            self.grace = None
            self.say(warning)

    def _failed(self, step: int, e: BaseException) -> str:
        """The line for a save that failed for space or I/O; anything else is re-raised (a bug)."""
        # torch.save reports a failed write as a RuntimeError ("... file write failed", "No space left")
        if not isinstance(e, OSError) and not (isinstance(e, RuntimeError) and _IO_ERROR.search(str(e))):
            raise e
        return (f"checkpoint {tag_for(step)}: writing {getattr(e, 'filename', None) or self.ckpt_dir} "
                f"failed: {_why(e)}; {self._room()}; {self._latest()}")

    def check_space(self, step: int) -> None:
        """Every writer compares the free space of its file system with the predicted tag size
        (one all-gather: every rank stops, or none does)."""
        short = None
        if self.writer and self.needed_bytes:
            self.ckpt_dir.mkdir(parents=True, exist_ok=True)
            free = shutil.disk_usage(self.ckpt_dir).free
            if free < self.needed_bytes:
                short = f"{self.ckpt_dir}{self.where}: needs about {_gib(self.needed_bytes)}, {_gib(free)} free"
        reports = [r for r in dist.all_gather_object(short) if r]
        if reports:
            raise AgreedError(f"checkpoint {tag_for(step)} not written: {'; '.join(reports)}; free space "
                              f"or lower checkpoint.keep; {self._latest()}")

    def _latest(self) -> str:
        """Which checkpoint a resume would take now (the newest complete one; `latest` may lag it)."""
        tag = latest_complete(self.ckpt_dir) if self.ckpt_dir.is_dir() else None
        return (f"the newest complete checkpoint is {tag}, where a resume starts" if tag else
                "no checkpoint of this run was completed")

    def _room(self) -> str:
        if not self.ckpt_dir.is_dir():
            return f"a tag needs about {_gib(self.needed_bytes)}"
        usage, inodes = shutil.disk_usage(self.ckpt_dir), os.statvfs(self.ckpt_dir).f_favail
        return (f"a tag needs about {_gib(self.needed_bytes)}, {_gib(usage.free)} free" +
                (f", {inodes} inodes free (df -i)" if inodes < 1000 else ""))


# What a failed write looks like when torch.save or DeepSpeed report it as a RuntimeError.
_IO_ERROR = re.compile(r"No space left|file write failed|open file failed|Disk quota|Read-only file system|"
                       r"Input/output error|errno", re.I)


def _why(e: BaseException) -> str:
    if isinstance(e, OSError):
        return str(e.strerror or e)
    m = re.search(r"strerror: ([^\n]+)|(No space left on device|Disk quota exceeded|Read-only file system)", str(e))
    return (m.group(1) or m.group(2)).strip() if m else str(e).splitlines()[0][:160]


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"
