"""A run, as the loops see it, for `train`, `ript`, `dry-run` and `parity`: what a command tells the
machinery about itself (RunSpec: its kind, its last step, its schedule's length, and the one check of
its layout), the stop requests the checkpointer agrees on (StopRequest), and the built run (Run) the
command's own loop asks. ds_train/start.py builds it (build_run) from inputs the check step
(ds_train/inputs.py) read and checked:

    with build_run(check_inputs(cfg, ds_config_path), detect_env(), spec) as run:
        start = run.maybe_resume()
        for step in ...:            # the command's loop; run.checkpointer, run.logger decide
            ...

Leaving the block restores the signal handlers and closes the sinks; after an orderly end (or a stop
every rank agreed on) it also frees DeepSpeed's shared-memory buffers and (unless the spec keeps it
for another run) the process group. A CUDA out-of-memory leaves it as OutOfMemory, whose message is
this run's memory plan.
"""

from __future__ import annotations

import gc
import os
import signal
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ds_train import dist, signals
from ds_train.checkpoint.checkpointer import Checkpointer
from ds_train.checkpoint.resume import ResumePoint, load_resume
from ds_train.checkpoint.rundir import RunKind, RunPaths
from ds_train.config import RunConfig
from ds_train.errors import (AgreedError, OutOfMemory, PeerFailed, Preempted, RunStopped, UserError, device_oom_said,
                             is_device_oom)
from ds_train.guard import NonFiniteGuard
from ds_train.model.speedups import Speedups
from ds_train.model.ulysses import unregister_ulysses
from ds_train.observe.logs import release_console
from ds_train.observe.metrics import Logger, build_progress
from ds_train.observe.reports import doctor_hint, is_secondary
from ds_train.observe.reports import where as rank_where
from ds_train.observe.startup import StartupClock
from ds_train.observe.watchdog import Heartbeat, Watchdog
from ds_train.plan.batch import BatchPlan
from ds_train.plan.parallel import Layout, ParallelDims, check_layout
from ds_train.plan.planner import oom_report
from ds_train.topology import DistEnv, node_hosts


@dataclass(frozen=True)
class RunSpec:
    """What a command tells the machinery about itself."""

    kind: RunKind  # what the loop counts, its results file, what the console and readers show
    last: int  # the loop's last step (train.max_steps, ript.iterations)
    steps: Callable[[BatchPlan], int]  # optimizer steps the LR schedule spans; UserError if impossible
    same_world: bool = False  # resume only at the saved world size (work sharded per rank)
    keep_group: bool = False  # the process group outlives the run (parity: several runs in one group)
    # The command's own checks of its config with the model's: (cfg, hf_config, world_size, local_world_size,
    # device: "cuda", "cpu" or None where not known); run by inputs.check_config on every rank and by the
    # launch preflight (ript: its rollout engine, ...)
    check_model: Callable[[RunConfig, Any, int, int, str | None], Any] | None = None
    # The start-up probe (train/probe.py): (cfg, hf_config, dtype, device type, dims, rank) -> the speed-ups the
    # run keeps; every rank calls it after the process group is up, before anything is written. None: as configured.
    probe: Callable[[RunConfig, Any, str, str, Any, int], Speedups] | None = None

    @property
    def unit(self) -> str:
        return self.kind.unit

    def check(self, cfg: RunConfig, template: dict, world_size: int, hf_config=None) -> tuple[Layout, int]:
        """The layout at this world size (check_layout: the one check of it) and the schedule's length
        (pure; `ds-train launch --check` / `slurm` and parity call it for their world sizes)."""
        layout = check_layout(cfg, template, world_size, hf_config)
        return layout, self.steps(layout.batch)


class StopRequest:
    """SIGTERM, SIGINT and SIGUSR1 (SLURM's signal before the time limit, `--signal=USR1@T`) set a
    flag, as does a stop request `ds-train launch` sends through the store; the checkpointer agrees
    on it across ranks at step boundaries."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)

    def __init__(self):
        self.signum = signals.take_kept()  # a SIGUSR1 during start-up, before these handlers
        self._previous = {sig: signal.signal(sig, self._handle) for sig in self.SIGNALS}

    def _handle(self, signum, frame) -> None:
        self.request(signum)

    def request(self, signum: int) -> None:
        # The first signal wins: Ctrl-C reaches the ranks as SIGINT, then as the SIGTERM that
        # DeepSpeed's launcher forwards; the exit code should say SIGINT (130).
        self.signum = self.signum or signum

    def agreed(self) -> int:
        """The signal number if any rank got one (a collective: every rank calls it every step)."""
        return int(dist.all_reduce_max([float(self.signum)])[0])

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


@dataclass(kw_only=True)
class RunLifecycle:
    """The run's own machinery between its start and its end, which no loop reads (Run's methods do)."""

    stop: StopRequest
    resume: ResumePoint | None
    resume_said: str  # how the ranks decided; said once the checkpoint is loaded
    hosts: list[tuple[int, str]]  # (node rank, host name) of every rank: how a report names a rank
    heartbeat: Heartbeat  # where this rank is: the loop calls run.beat(step, phase)
    watchdog: Watchdog
    describe_run: Callable[[int], None]  # writes config.yaml ... and rewinds metrics (see maybe_resume)
    lock: int | None  # the run directory's lock (writers), held until the process ends


@dataclass(kw_only=True)
class Run:
    """A built run: what the loops ask, by name (build_run composes it); `life` is its own machinery."""

    cfg: RunConfig
    env: DistEnv
    spec: RunSpec
    dims: ParallelDims  # data x sequence x tensor: who reads which batch, who reduces what
    token_group: Any  # the ranks a token count or summed loss is reduced over (None: all)
    plan: BatchPlan
    paths: RunPaths
    ds_config: dict
    dtype: str
    engine: Any
    tokenizer: Any
    n_params: int
    flops_per_token: float
    peak_flops: float | None  # None off GPUs: no MFU
    logger: Logger  # real sinks on rank 0, a null logger elsewhere
    rank_log: Any  # logs/rank_<r>.log on every rank (its own events; the console is copied there too)
    say: Callable[..., None]  # print on rank 0, nothing elsewhere
    checkpointer: Checkpointer
    guard: NonFiniteGuard  # optimizer steps whose gradients were not finite: counted, never applied
    life: RunLifecycle
    weights: Path | None = None  # the directory the starting weights were loaded from (None: from scratch)
    speedups: Speedups | None = None  # the speed-ups the start-up probe kept (the loss's tiles and head factor)
    startup: StartupClock | None = None  # the start-up's phases; the loop marks its first step (first_step)

    @property
    def run_dir(self) -> Path:
        return self.paths.root

    @property
    def data_rank(self) -> int:
        """The slice of every global batch this rank reads."""
        return self.dims.data_rank(self.env.rank)

    @property
    def sequence_rank(self) -> int:
        """Which part of every sequence this rank holds (Ulysses; 0 without sequence parallelism)."""
        return self.dims.coords(self.env.rank)[1]

    def beat(self, step: int, phase: str) -> None:
        """This rank entered `phase` of `step` (progress, for the heartbeat and the watchdog)."""
        self.life.heartbeat.beat(step, phase)

    def where(self, rank: int) -> str:
        """`rank 1 on node 1 (gpu017)`: as the watchdog's reports name a rank."""
        node, host = self.life.hosts[rank]
        names = node_hosts()
        return rank_where({"rank": rank, "node": node, "host": host, "addr": names[node] if node < len(names) else ""})

    @property
    def zero_stage(self) -> int:
        return self.engine.zero_optimization_stage()

    @property
    def collective_forward(self) -> bool:
        """Whether every forward is a collective, so that ranks must make the same number of them
        (generation included): ZeRO-3 gathers each layer's parameters, AutoEP sends tokens to experts."""
        return self.zero_stage == 3 or self.dims.expert > 1

    def watch(self) -> None:
        """From now on a rank that makes no progress for watchdog.stall_s ends the job (the start-up is not
        timed: a model build or compile beats nothing)."""
        self.life.watchdog.arm()

    def progress(self, initial: int):
        """The loop starts: the watchdog is armed, and rank 0 gets a progress bar (log.progress)
        that closes when its block ends."""
        self.watch()
        return build_progress(self.env.is_main, self.cfg.log.progress, self.spec.last, self.spec.kind, initial)

    def maybe_resume(self) -> dict | None:
        """Load the resume point all ranks agreed on, if any: weights, optimizer, scheduler, this
        rank's RNG. Returns the saved record (step, the command's state, this rank's own loop state
        under "rank"), or None for a fresh start."""
        if self.life.resume is None:
            self.life.describe_run(-1)
            self.mark_startup("resume")
            return None
        self.beat(int(self.life.resume.state["step"]), "load")
        t0 = time.perf_counter()
        state = load_resume(self.engine, self.life.resume, self.env.rank, self.env.world_size)
        self.rank_log.info(f"loaded checkpoint {self.life.resume.tag} in {time.perf_counter() - t0:.2f} s")
        self.life.describe_run(int(self.life.resume.state["step"]))
        self.say(self.life.resume_said)
        self.mark_startup("resume")
        return state

    def mark_startup(self, phase: str) -> None:
        """A phase of the start-up ended now (the loops' own: resume, a preference reference)."""
        if self.startup is not None:
            self.startup.mark(phase)

    def maybe_finish_startup(self, phase: str = "first step") -> None:
        """The first step (or iteration) of this process ended: the start-up, phase by phase, in every
        rank's log and on rank 0's console (results.json takes `startup_s`)."""
        if self.startup is not None and not self.startup.finished:
            if self.engine.device.type == "cuda":  # the step's kernels are done, not only queued
                import torch

                torch.cuda.synchronize()
            self.startup.finish(phase)
            said = self.startup.said(f"the {phase}")
            self.rank_log.info(said)
            self.say(said)

    def startup_s(self) -> dict[str, float] | None:
        """The start-up's seconds per phase (results.json's startup_s), once the first step ended."""
        return {k: round(v, 2) for k, v in self.startup.phases().items()} if self.startup and self.startup.finished \
            else None

    def say_outcome(self, outcome: str) -> None:
        """Rank 0's last line: `<command>: <outcome>; <its newest checkpoint>; run directory <path>`, the
        newest checkpoint being the last this run saved, else the one it resumed from."""
        c, point = self.cfg.checkpoint, self.life.resume
        if self.checkpointer.saved:
            newest = f"checkpoint {self.checkpointer.saved}"
        elif point is not None:  # another run's checkpoint by its path
            here = point.load_dir == self.paths.checkpoints
            newest = f"checkpoint {point.tag if here else point.load_dir / point.tag}"
        else:
            newest = f"no checkpoint (checkpoint.every={c.every}, checkpoint.save_final={str(c.save_final).lower()})"
        self.say(f"{self.spec.kind.name}: {outcome}; {newest}; run directory {self.run_dir.resolve()}")

    def write_plots(self) -> None:
        """Rank 0 plots the run's metrics into run_dir/plots (log.plots) and says where."""
        if not (self.env.is_main and self.cfg.log.plots):
            return
        from ds_train.observe.plots import write_plots
        from ds_train.checkpoint.rundir import read_metrics

        self.beat(self.spec.last, "plots")
        written = write_plots([(self.run_dir.name, read_metrics(self.paths.metrics))], self.paths.plots,
                             self.spec.kind)
        self.say(f"plots: {self.paths.plots}/{{{','.join(p.stem for p in written)}}}.png")

    def __enter__(self) -> "Run":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        import torch

        if is_device_oom(exc):  # the memory plan of this run says what to change, after what the device said
            gib = torch.cuda.get_device_properties(self.engine.device).total_memory / 2**30
            peak = torch.cuda.max_memory_allocated(self.engine.device) / 2**30
            exc = OutOfMemory(oom_report(self.cfg, self.ds_config, self.engine.module.config,
                                         self.env.world_size, gib)
                              + f"\nthe device said: {device_oom_said(exc)} (allocated peak before it: {peak:.2f} GiB)")
        verdict, replacement = None, None
        if exc is not None and not isinstance(exc, (RunStopped, AgreedError)):  # this rank failed alone
            verdict = self.life.watchdog.fail(exc)
        mine = self.life.watchdog.verdict is not None  # this rank wrote the job's verdict
        if verdict and is_secondary(exc):  # a consequence of another rank's end: the verdict says it
            self.rank_log.error("".join(traceback.format_exception(exc)).rstrip())
            replacement = exc = PeerFailed(verdict, say=mine)
        if exc is not None and not isinstance(exc, (Preempted, UserError)) and (self.env.is_main or mine):
            exc.add_note(doctor_hint(self.run_dir))
        if verdict and mine and replacement is None:  # the reporting rank ends its output with the verdict
            exc.add_note(f"ds-train: error: {verdict}")
        self.life.stop.restore()
        unregister_ulysses()
        self.logger.close()
        self.life.watchdog.stop("ended" if exc is None else "stopped" if isinstance(exc, RunStopped) else "failed")
        self.rank_log.info(_ending(exc))
        if exc is None or isinstance(exc, (RunStopped, AgreedError)):  # every rank is here: collectives cannot hang
            dist.barrier()
            if not self.spec.keep_group:
                dist.release_shared_memory(self.env)
                dist.shutdown()
        if self.life.lock is not None:
            os.close(self.life.lock)  # the run directory is free for the next run
        gc.unfreeze()  # what build_run froze can be collected again (parity builds several runs in a process)
        if exc is None:  # all said; after an error, what the CLI prints next belongs in the log too
            release_console()
        if isinstance(exc, OutOfMemory) or replacement is not None:
            raise exc from None


def _ending(exc: BaseException | None) -> str:
    """The last line of a rank's log: how this rank's run ended."""
    if exc is None:
        return "run ended"
    if hasattr(exc, "exit_code"):
        return f"exit {exc.exit_code}: {exc}"
    return f"exit 1: {type(exc).__name__}: {exc}"
