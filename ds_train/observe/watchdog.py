"""Heartbeats and the hang watchdog: where every rank is, and a named stall or failure instead of a
silent hang.

Every rank keeps a `Heartbeat` (step, phase, last progress) that its loop updates for the price of
a few attribute writes (`run.beat(step, "forward")`). A daemon thread, the `Watchdog`, publishes it
every watchdog.heartbeat_s: to RUN_DIR/heartbeats/rank_<r>.json (replaced atomically, so node-local
run directories work) and to the rendezvous store, which every rank reads without a collective
(ds_train/dist/store.py `SideChannel`). Progress is a new phase, or checkpoint I/O in a save or load phase.

A rank that makes no progress for watchdog.stall_s raises the alarm in the store. Every rank then
writes the stacks of its threads to logs/stacks_rank_<r>.txt (py-spy's native frames too, where
installed) and publishes its state; the lowest rank still answering prints the hang report
(ds_train/observe/reports.py): the ranks that wait inside a collective and the ones that never arrived,
with host, phase and step. Every rank then exits with EXIT_STALL, long before the process-group
timeout.

A rank that dies of an exception publishes its error and the end of its traceback the same way
(`Watchdog.fail`); the rank that reports names the first failure in the job's last line.

With rollout ranks (ript.rollout_ranks_per_node) every rank of the job is watched: the trainers under their ranks,
then the rollout ranks (`Heartbeat.slot`), which publish to the store only (they write no files) and print their
stacks on a hang.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ds_train.checkpoint.rundir import RunPaths
from ds_train.fs import replacing
from ds_train.observe.reports import (collective_in, collective_of, doctor_hint, failure_report, format_stacks,
                                      hang_report, is_secondary, main_frame, native_stacks, short_path, where)
from ds_train.observe.resources import io_bytes, memory_now, oom_kills

EXIT_STALL = 5
# Phases in which checkpoint I/O counts as progress (a large save writes for minutes).
IO_PHASES = ("save", "load")
# Phases the watchdog does not time: rank 0 alone writes the final export and plots while the others wait, and
# the others wait for rank 0's lm-eval scores (ds_train/train/benchmarks.py: rank 0's own phase moves with each
# forward of the scoring model).
# With rollout ranks (ds_train/ript/rollout_ranks.py) each side waits for the other's work untimed, as each side's
# ranks are watched themselves: a trainer for a batch the rollout ranks generate (their heartbeats move with every
# step of its episodes), a rollout rank for the trainers' update.
UNTIMED_PHASES = ("export", "plots", "wait-scores", "wait-rollouts", "wait-trainers")


@dataclass
class Heartbeat:
    """Where this rank is. The loop writes it (cheap: attribute writes); the watchdog thread reads it."""

    rank: int
    node: int
    host: str
    addr: str = ""  # the node's name in the hostfile or SLURM's node list, where it differs from `host`
    step: int = 0
    phase: str = "startup"
    step_beats: int = 0  # phases entered in this step: with the step, how far this rank got
    last_progress: float = field(default_factory=time.monotonic)
    status: str = "running"  # running | stalled | waiting | failed | ended
    fault: Callable[[int, str], None] | None = None  # watchdog.debug_fault, when set
    slot: int = -1  # this rank's index among the watched ranks (the store's keys): its rank, or with rollout ranks
    #                 the trainers' ranks first, then the rollout ranks' (`role` "rollout", `job_rank` as launched)
    role: str = ""
    job_rank: int = -1

    def __post_init__(self) -> None:
        if self.slot < 0:
            self.slot = self.rank

    def beat(self, step: int, phase: str) -> None:
        """Progress: this rank entered `phase` of `step`."""
        if step != self.step:
            self.step, self.step_beats = step, 0
        self.phase = phase
        self.step_beats += 1
        self.last_progress = time.monotonic()
        if self.fault is not None:
            self.fault(step, phase)

    def idle_s(self) -> float:
        return time.monotonic() - self.last_progress


# ---- the thread ------------------------------------------------------------------------------

class Watchdog:
    """This rank's heartbeat publisher, stall detector and part of the alarm protocol.

    Store keys (`channel`, None for one process): hb/<r> the heartbeats; alarm, a counter every
    event bumps (the one key each rank polls); stall; failures and failure/<n>; signal (a stop
    request from `ds-train launch`); answered/<r>; report (the verdict, once written)."""

    GRACE_S = 10.0  # how long the ranks wait for each other in the alarm protocol

    def __init__(self, hb: Heartbeat, paths: RunPaths | None, world: int, stall_s: float, heartbeat_s: float,
                 channel=None, device_index: int | None = None,
                 on_signal: Callable[[int], None] = lambda signum: None, launchers=None,
                 signalled: Callable[[], int] | None = None):
        self.hb, self.paths, self.world = hb, paths, world
        # a rank outside the trainers' step-boundary agreement (a rollout rank) passes the signal it got
        # (`signalled`: its number, 0 for none) to every rank through the store, as `ds-train launch`'s stop does
        self.signalled, self._forwarded = signalled, False
        self.launchers = launchers  # a LauncherWatch (ds_train/observe/launchers.py): one gone stops the run
        self.stall_s, self.heartbeat_s = stall_s, heartbeat_s
        self.channel, self.device_index, self.on_signal = channel, device_index, on_signal
        self.path = paths.heartbeat(hb.rank) if paths is not None else None  # None: the store only (a rollout rank
        #                                                                      writes no files)
        self.armed = False
        self.verdict: dict | None = None
        self._alarms = self._failures = 0
        self._stalled = self._main_failed = False
        self._published, self._published_step = 0.0, -1
        self._lost_primary = False
        self._oom_kills = oom_kills()
        self._unwritable = False
        self._io = io_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ds_train-watchdog", daemon=True)

    def start(self) -> "Watchdog":
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self.publish()
        self._thread.start()
        return self

    def arm(self) -> None:
        """From now on a stall ends the job (the loop starts)."""
        self.hb.last_progress = time.monotonic()
        self.armed = self.stall_s > 0

    def stop(self, status: str = "ended") -> None:
        self.armed = False
        self.hb.status = status
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=5)
        self.publish(to_store=False)  # the store may already be gone with rank 0

    # -- what this rank publishes
    def record(self) -> dict[str, Any]:
        hb = self.hb
        return {"rank": hb.rank, "node": hb.node, "host": hb.host, "addr": hb.addr, "pid": os.getpid(), "step": hb.step,
                "phase": hb.phase, "status": hb.status, "position": [hb.step, hb.step_beats],
                "idle_s": round(hb.idle_s(), 3), "time": time.time(),
                "collective": collective_of(main_frame()), **memory_now(self.device_index),
                "slot": hb.slot, **({"role": hb.role, "job_rank": hb.job_rank} if hb.role else {})}

    def publish(self, to_store: bool = True) -> dict:
        rec = self.record()
        text = json.dumps(rec)
        try:
            if self.path is not None:
                tmp = self.path.with_name(f".{self.path.name}.tmp")
                tmp.write_text(text)
                os.replace(tmp, self.path)  # atomic, no fsync: a heartbeat is current or worthless
        except OSError as e:  # a full disk: the store still has it; say so once, not as a store failure
            if not self._unwritable:
                self._unwritable = True
                sys.stderr.write(f"ds-train[rank {self.hb.rank}]: watchdog: cannot write {self.path} "
                                 f"({e.strerror or e}); heartbeats go to the rendezvous store only\n")
        if to_store and self.channel is not None:
            self.channel.mirror(f"hb/{self.hb.slot}", text)  # in both stores: it must outlive rank 0
        self._published, self._published_step = time.monotonic(), rec["step"]
        return rec

    # -- the thread's loop
    def _run(self) -> None:
        tick = min(1.0, self.heartbeat_s)
        while not self._stop.wait(tick):
            try:
                self._tick()
            except Exception as e:  # never take a run down: without the store, heartbeats stay local
                if self._fail_over():
                    continue
                if self.channel is not None and not self._stop.is_set():
                    sys.stderr.write(f"ds-train[rank {self.hb.rank}]: watchdog: the rendezvous store stopped "
                                     f"answering ({type(e).__name__}: {str(e).splitlines()[0][:120]}); rank 0 "
                                     f"ended or its host is unreachable\n")
                self.channel = None

    def _tick(self) -> None:
        if self.launchers is not None and (gone := self.launchers.gone(self.channel)) is not None:
            self.launchers = None
            _say(f"ds-train[rank {self.hb.rank}]: the {gone.describe()} that started this job is gone; "
                 f"saving and stopping as for SIGTERM")
            self.on_signal(15)
        if self.signalled is not None and not self._forwarded and self.channel is not None and (n := self.signalled()):
            self._forwarded = True
            self.channel.set("signal", str(n))
            self.channel.add("alarm", 1)
        io = io_bytes()
        if io != self._io and self.hb.phase in IO_PHASES:
            self.hb.last_progress = time.monotonic()  # a save or load that writes or reads moves
        self._io = io
        if time.monotonic() - self._published >= self.heartbeat_s or self.hb.step != self._published_step:
            self.publish()  # on every new step too: a rank that dies is named at its last step
        if self.channel is not None:
            alarms = self.channel.add("alarm", 0)
            if alarms > self._alarms:
                self._alarms = alarms
                self._on_alarm()
        if self.armed and self.hb.idle_s() > self.stall_s and self.hb.phase not in UNTIMED_PHASES:
            self.armed = False
            if self.channel is None:
                self._hang()
            else:
                self.channel.set("stall", str(self.hb.slot))
                self.channel.add("alarm", 1)

    def _on_alarm(self) -> None:
        ch = self.channel
        signum = ch.get("signal")
        if signum is not None:
            self.on_signal(int(signum))
        if ch.get("stall") is not None and not self._stalled:
            self._hang()
        if ch.get("report") is not None and self.verdict is None and not self._stalled:
            # Another rank reported a failure: the job is over. This rank's main thread ends
            # itself if it is in a collective with the dead; if not (busy elsewhere, stuck), end it.
            if not _wait(lambda: self._main_failed, self.GRACE_S):
                _exit(1)
            return
        failures = int(ch.get("failures") or 0)
        if failures > self._failures:
            self._failures = failures
            if self._reporter():
                self._report_failure()

    # -- hangs
    def _hang(self) -> None:
        """Stacks, state, then (on the reporting rank) the verdict; every rank exits EXIT_STALL."""
        self._stalled = True
        self.armed = False
        self.hb.status = "hang"
        self.write_stacks()
        rec = self.publish()
        ch = self.channel
        if ch is None:
            report = hang_report({self.hb.slot: rec}, {self.hb.slot}, self.stall_s)
            self._conclude(report, self.paths.hang_report if self.paths else None)
            _exit(EXIT_STALL)
        try:
            ch.set(f"answered/{self.hb.slot}", "1")
            if not self._reporter():
                _wait(lambda: ch.get("report") is not None, self.GRACE_S + 5)
                _exit(EXIT_STALL)
            _wait(lambda: all(ch.get(f"answered/{r}") for r in range(self.world)), self.GRACE_S / 2)
            answered = {r for r in range(self.world) if ch.get(f"answered/{r}")}
            records = {r: _loads(ch.get(f"hb/{r}")) for r in range(self.world)}
            report = hang_report(records, answered, self.stall_s)
            self._conclude(report, self.paths.hang_report if self.paths else None)
            ch.set("report", report["line"])
            time.sleep(1.0)  # the others see the verdict before this rank (and the store) goes
        finally:  # also when the store went away under us: the job is over either way
            _exit(EXIT_STALL)

    def write_stacks(self) -> Path | None:
        """logs/stacks_rank_<r>.txt: every thread's Python stack (and native frames via py-spy); a rank that writes
        no files (a rollout rank) prints them on its stderr."""
        hb = self.hb
        header = (f"{where(self.record())} pid {os.getpid()} at "
                  f"{time.strftime('%Y-%m-%d %H:%M:%S')}: step {hb.step}, phase {hb.phase}, "
                  f"{hb.idle_s():.0f} s without progress; in a collective: {collective_of(main_frame()) or 'no'}")
        text = format_stacks(header) + native_stacks(os.getpid())
        if self.paths is None:
            _say(text.rstrip())
            return None
        path = self.paths.stacks(hb.rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        return path

    def _log(self) -> str:
        """Where this rank's log is, for a failure's record (a rollout rank's: its stderr, in the launcher's output)."""
        if self.paths is None:
            return f"{self.hb.host}: the launcher's output (rollout rank {self.hb.rank})"
        return f"{self.hb.host}:{self.paths.rank_log(self.hb.rank)}"

    # -- failures
    def _reporter(self) -> bool:
        """Rank 0 reports, or, if it does not take part (gone with its store), the lowest rank that
        does: each rank answers, then waits a moment for lower ones."""
        if self.hb.slot == 0 or self.channel is None:
            return True
        ch = self.channel
        ch.set(f"answered/{self.hb.slot}", "1")
        if ch.get("gone/0") is None and _wait(
                lambda: ch.get("answered/0") or ch.get("hb/0") and _fresh(ch.get("hb/0"), 3 * self.heartbeat_s), 1.0):
            return False
        time.sleep(0.5)
        return not any(ch.get(f"answered/{r}") for r in range(self.hb.slot))

    def fail(self, exc: BaseException) -> str | None:
        """The main thread's exception: published for the report. Returns the job's verdict once a
        rank reported it (None when none did); `verdict` is set on the rank that reported."""
        self._main_failed = True
        self.armed = False
        self.hb.status = "failed"
        ch = self.channel
        if ch is None or self._stalled:
            return None
        lines = [l for l in "".join(traceback.format_exception_only(type(exc), exc)).splitlines() if l.strip()]
        frames = traceback.extract_tb(exc.__traceback__)[-2:]
        tail = [f"{short_path(f.filename)}:{f.lineno} in {f.name}" for f in frames] + lines[-2:]
        message = str(exc).strip().splitlines()  # a multi-line message (an OOM's plan) is named by its first
        error = f"{type(exc).__name__}: {message[0]}" if message else (lines[-1] if lines else type(exc).__name__)
        rec = {**self.record(), "collective": collective_in(exc),
               "error": error if len(error) < 240 else error[:240] + "...", "tail": tail,
               "primary": not is_secondary(exc), "log": self._log()}
        for _ in range(2):  # the first store may have gone with rank 0: then the second
            try:
                self._publish_failure(rec)
                _wait(lambda: self.channel.get("report") is not None, self.GRACE_S + 2 * self.heartbeat_s + 5)
                return self.channel.get("report")
            except Exception:
                if not self._fail_over():
                    return None  # no store answers: this rank's own output says what it saw
        return None

    def _publish_failure(self, rec: dict) -> None:
        ch = self.channel
        n = ch.add("failures", 1)
        ch.set(f"failure/{n}", json.dumps(rec))
        ch.add("alarm", 1)

    def _fail_over(self) -> bool:
        """The first store stopped answering, so rank 0 is gone (or its host unreachable): move to
        the second store, say rank 0 is gone there and publish this rank's loss of it as a failure
        (a consequence), so that the lowest surviving rank names what happened."""
        ch = self.channel
        if ch is None or self._stop.is_set() or not ch.fail_over():
            return False
        if ch.get("gone/0") is None:
            ch.set("gone/0", "1")
        rec = {**self.record(), "error": "the rendezvous store on rank 0 stopped answering", "tail": [],
               "primary": False, "log": self._log()}
        self.publish()
        if not self._lost_primary:
            self._lost_primary = True
            self._publish_failure(rec)
        return True

    def _report_failure(self) -> None:
        ch = self.channel
        time.sleep(2.0)  # the failures that follow the first arrive now: tell cause from consequence
        failures = self._failure_records()
        silent = []
        if not any(f["primary"] for f in failures):  # only consequences so far: who went silent?
            before = {r: ch.get(f"hb/{r}") for r in range(self.world)}
            time.sleep(2 * self.heartbeat_s + 0.5)  # every live rank publishes again meanwhile
            failures = self._failure_records()
            failed = {f.get("slot", f["rank"]) for f in failures}  # rollout ranks after the trainers
            silent = [_loads(before[r]) for r in range(self.world)
                      if r not in failed and before[r] is not None and ch.get(f"hb/{r}") == before[r]]
        if not failures or ch.get("report") is not None:
            return
        oom = ""
        if silent and silent[0]["host"] == self.hb.host and (now := oom_kills()) > self._oom_kills >= 0:
            oom = f"this host's memory cgroup counted {now - self._oom_kills} OOM kill(s) since the start"
        records = {r: _loads(ch.get(f"hb/{r}")) for r in range(self.world)}
        report = failure_report(failures, silent, oom, records)
        self._conclude(report, self.paths.failure if self.paths else None, say=False)
        ch.set("report", report["line"])
        ch.add("alarm", 1)  # the others end too
        # The main thread ends its traceback with the verdict; stuck inside a collective (NCCL waits
        # for the dead rank until its timeout), it never gets there: say it and end this rank now.
        if not _wait(lambda: self._main_failed, 3.0):
            _say(f"{self._hint()}ds-train: error: {report['line']}")
            _exit(1)

    def _failure_records(self) -> list[dict]:
        n = int(self.channel.get("failures") or 0)
        return [f for f in (_loads(self.channel.get(f"failure/{i}")) for i in range(1, n + 1)) if f]

    def _conclude(self, report: dict, path: Path | None, say: bool = True) -> None:
        self.verdict = report
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            with replacing(path) as tmp:
                tmp.write_text(json.dumps(report, indent=1, default=str))
        if say:
            _say(f"{self._hint()}ds-train: error: {report['line']}")

    def _hint(self) -> str:
        return f"{doctor_hint(self.paths.root)}\n" if self.paths is not None else ""


def _loads(text: str | None) -> dict | None:
    return json.loads(text) if text else None


def _fresh(text: str, within_s: float) -> bool:
    rec = json.loads(text)
    return time.time() - rec["time"] < within_s


def _wait(cond: Callable[[], Any], timeout_s: float, every_s: float = 0.2) -> bool:
    deadline = time.monotonic() + timeout_s
    while True:
        if cond():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(every_s)


def _say(line: str) -> None:
    sys.stdout.flush()
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def _exit(code: int) -> None:
    """End this rank now: its main thread is stuck where no exception reaches it."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
