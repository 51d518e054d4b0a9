"""One run machinery for `train`, `ript`, `dry-run` and `parity`: everything before the first step
and after the last, built once from inputs the check step (ds_train/inputs.py) read and checked.
Each command adds only its own loop:

    with build_run(check_inputs(cfg, ds_config_path), dist.detect_env(), spec) as run:
        start = run.maybe_resume()
        for step in ...:            # the command's loop; run.checkpointer, run.logger decide
            ...

`build_run` checks what needs the world size first (the parallel layout, the batch math, the
rendered ds_config, the resume point) and writes nothing until all of them pass. Then it converts
a checkpoint for a new layout or stage if needed, exports a ds_train run given as model.path,
joins the process group, builds the engine and writes config.yaml, ds_config.json, env.json and
hf_model/. Leaving the block restores the signal handlers and closes the sinks; after an orderly
end (or a stop every rank agreed on) it also frees DeepSpeed's shared-memory buffers and (unless
the spec keeps it for another run) the process group. A CUDA out-of-memory leaves it as
OutOfMemory, whose message is this run's memory plan.
"""

from __future__ import annotations

import json
import os
import platform
import signal
import socket
import time
import traceback
from dataclasses import dataclass, replace
from functools import partial
from importlib.metadata import version
from pathlib import Path
from typing import Any, Callable

from ds_train import dist, signals
from ds_train.checkpoint.checkpointer import Checkpointer
from ds_train.checkpoint.commit import run_record
from ds_train.checkpoint.export import export, save_hf_metadata
from ds_train.checkpoint.resume import (ResumePoint, agree, check_resume, load_resume, locate_checkpoint, plan_resume,
                                        prepare_resume)
from ds_train.checkpoint.rundir import RunKind, RunPaths
from ds_train.checkpoint.storage import (NODE_LOCAL, check_run_dir, check_storage, env_record, hold_run_dir, host_table,
                                         start_over, storage_layout)
from ds_train.config import RunConfig
from ds_train.config.file import save_config
from ds_train.engine import check_op_build, fix_arch_list, initialize, render_ds_config, zero_stage
from ds_train.errors import (AgreedError, OutOfMemory, PeerFailed, Preempted, RunStopped, UserError, device_oom_said,
                             is_device_oom)
from ds_train.faults import step_fault
from ds_train.fs import check_writable, file_lock, write_atomic
from ds_train.guard import NonFiniteGuard
from ds_train.inputs import ModelSource, RunInputs
from ds_train.model.build import (build_model, count_params, flops_per_token, has_frozen_params, lookup_params,
                                  resolve_dtype)
from ds_train.model.kernels import apply_liger, compile_layers, compiles
from ds_train.model.tiled_mlp import tiled_mlps
from ds_train.model.ulysses import register_ulysses, unregister_ulysses
from ds_train.observe.launchers import LauncherWatch, kill_grace
from ds_train.observe.logs import build_rank_log, capture_console, release_console
from ds_train.observe.metrics import Logger, build_logger, build_progress, peak_flops, rewind_jsonl
from ds_train.observe.reports import doctor_hint, is_secondary
from ds_train.observe.reports import where as rank_where
from ds_train.observe.watchdog import Heartbeat, Watchdog
from ds_train.plan.batch import BatchPlan, plan_batch, sample_rows, scaled_lr
from ds_train.plan.memory import checkpoint_bytes
from ds_train.plan.parallel import ParallelDims, check_model, deepspeed_range_note, plan_dims
from ds_train.plan.planner import oom_report


@dataclass(frozen=True)
class RunSpec:
    """What a command tells the machinery about itself."""

    kind: RunKind  # what the loop counts, its results file, what the console and readers show
    last: int  # the loop's last step (train.max_steps, ript.iterations)
    steps: Callable[[BatchPlan], int]  # optimizer steps the LR schedule spans; UserError if impossible
    same_world: bool = False  # resume only at the saved world size (work sharded per rank)
    keep_group: bool = False  # the process group outlives the run (parity: several runs in one group)

    @property
    def unit(self) -> str:
        return self.kind.unit

    def check(self, cfg: RunConfig, world_size: int) -> tuple[ParallelDims, BatchPlan, int]:
        """The parallel layout and the batch math at this world size: the layout, the plan and the
        schedule's length (pure; the launch preflight calls it for the target cluster)."""
        dims = plan_dims(cfg.parallel, world_size)
        plan = plan_batch(cfg.train.global_batch_size, cfg.train.micro_batch_size, dims.data, cfg.train.seq_len,
                          dims.derivation(), sample_rows(cfg.data.format))
        return dims, plan, self.steps(plan)


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


@dataclass
class Run:
    cfg: RunConfig
    env: dist.DistEnv
    spec: RunSpec
    dims: ParallelDims  # data x sequence x tensor: who reads which batch, who reduces what
    token_group: Any  # the ranks a token count or summed loss is reduced over (None: all)
    plan: BatchPlan
    paths: RunPaths
    ds_config: dict
    dtype: str
    lr: float
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
    stop: StopRequest
    resume: ResumePoint | None
    resume_said: str  # how the ranks decided; said once the checkpoint is loaded
    hosts: list[tuple[int, str]]  # (node rank, host name) of every rank
    heartbeat: Heartbeat  # where this rank is: the loop calls run.beat(step, phase)
    watchdog: Watchdog
    describe_run: Callable[[int], None]  # writes config.yaml ... and rewinds metrics (see maybe_resume)
    lock: int | None  # the run directory's lock (writers), held until the process ends
    weights: Path | None = None  # the directory the starting weights were loaded from (None: from scratch)

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
        self.heartbeat.beat(step, phase)

    def where(self, rank: int) -> str:
        """`rank 1 on node 1 (gpu017)`: as the watchdog's reports name a rank."""
        node, host = self.hosts[rank]
        names = dist.node_hosts()
        return rank_where({"rank": rank, "node": node, "host": host, "addr": names[node] if node < len(names) else ""})

    @property
    def zero_stage(self) -> int:
        return self.engine.zero_optimization_stage()

    def progress(self, initial: int):
        """The loop starts: the watchdog is armed, and rank 0 gets a progress bar (log.progress)
        that closes when its block ends."""
        self.watchdog.arm()
        return build_progress(self.env.is_main, self.cfg.log.progress, self.spec.last, self.spec.kind, initial)

    def maybe_resume(self) -> dict | None:
        """Load the resume point all ranks agreed on, if any: weights, optimizer, scheduler, this
        rank's RNG. Returns the saved record (step, the command's state, this rank's own loop state
        under "rank"), or None for a fresh start."""
        if self.resume is None:
            self.describe_run(-1)
            return None
        self.beat(int(self.resume.state["step"]), "load")
        t0 = time.perf_counter()
        state = load_resume(self.engine, self.resume, self.env.rank, self.env.world_size)
        self.rank_log.info(f"loaded checkpoint {self.resume.tag} in {time.perf_counter() - t0:.2f} s")
        self.describe_run(int(self.resume.state["step"]))
        self.say(self.resume_said)
        return state

    def say_outcome(self, outcome: str) -> None:
        """Rank 0's last line: `<command>: <outcome>; <its newest checkpoint>; run directory <path>`, the
        newest checkpoint being the last this run saved, else the one it resumed from."""
        c, point = self.cfg.checkpoint, self.resume
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
            verdict = self.watchdog.fail(exc)
        mine = self.watchdog.verdict is not None  # this rank wrote the job's verdict
        if verdict and is_secondary(exc):  # a consequence of another rank's end: the verdict says it
            self.rank_log.error("".join(traceback.format_exception(exc)).rstrip())
            replacement = exc = PeerFailed(verdict, say=mine)
        if exc is not None and not isinstance(exc, (Preempted, UserError)) and (self.env.is_main or mine):
            exc.add_note(doctor_hint(self.run_dir))
        if verdict and mine and replacement is None:  # the reporting rank ends its output with the verdict
            exc.add_note(f"ds-train: error: {verdict}")
        self.stop.restore()
        unregister_ulysses()
        self.logger.close()
        self.watchdog.stop("ended" if exc is None else "stopped" if isinstance(exc, RunStopped) else "failed")
        self.rank_log.info(_ending(exc))
        if exc is None or isinstance(exc, RunStopped):  # every rank is here: collectives cannot hang
            dist.barrier()
            if not self.spec.keep_group:
                dist.release_shared_memory(self.env)
                dist.shutdown()
        if self.lock is not None:
            os.close(self.lock)  # the run directory is free for the next run
        if exc is None:  # all said; after an error, what the CLI prints next belongs in the log too
            release_console()
        if isinstance(exc, OutOfMemory) or replacement is not None:
            raise exc from None


def build_run(inputs: RunInputs, env: dist.DistEnv, spec: RunSpec, quiet: bool = False) -> Run:
    """Everything before the first step. Bad input fails here, before anything is written.

    The signal handlers go in first: a stop asked for during start-up (SLURM's SIGUSR1 can come
    early) is kept, and the run saves and stops at its first step."""
    stop = StopRequest()
    try:
        return _build_run(inputs, env, spec, stop, quiet)
    except BaseException:
        stop.restore()
        raise


def _build_run(inputs: RunInputs, env: dist.DistEnv, spec: RunSpec, stop: StopRequest, quiet: bool) -> Run:
    import torch
    from deepspeed.accelerator import get_accelerator

    cfg, source = inputs.cfg, inputs.source
    # 1. Checks that need the world size but no peers: each rank fails fast on its own.
    paths = RunPaths(cfg.output_dir)
    check_writable(paths.root, "output_dir")
    check_run_dir(paths)
    dims, plan, total_steps = spec.check(cfg, env.world_size)
    check_model(dims, source.hf_config, cfg.model.attn_implementation, cfg.train.seq_len)
    accel = get_accelerator()
    on_gpu = accel.device_name() == "cuda"
    dtype = resolve_dtype(cfg.model.dtype, accel.device_name(), accel.is_bf16_supported())
    lr = scaled_lr(cfg.optim.lr, plan.global_batch_size, cfg.optim.reference_batch_size, cfg.optim.lr_scaling)
    render = partial(render_ds_config, inputs.template, cfg, plan, dtype=dtype, lr=lr, total_steps=total_steps,
                     hidden_size=source.hf_config.hidden_size, on_gpu=on_gpu, source=inputs.ds_config_path)
    rendered = render()
    if on_gpu:  # an op DeepSpeed would JIT-build: what its build needs is here, or one line says what is not
        check_op_build(rendered)
    locate_checkpoint(cfg.checkpoint.resume, paths.checkpoints)

    # 2. Checks every rank makes together: the file-system layout and the resume point.
    host = socket.gethostname()
    data = inputs.data_id()
    dist.init(env, cfg.dist.timeout_s, cfg.dist.join_timeout_s, host)
    try:
        storage = storage_layout(paths, env)
        decision = agree(cfg.checkpoint.resume, paths.checkpoints, env, host, spec.unit)
        changes = check_resume(decision.point, cfg, spec.kind.name, env.world_size, spec.same_world, data)
        resume_plan = plan_resume(decision.point, dims, zero_stage(inputs.template), dtype,
                                  cfg.checkpoint.load_universal)
        check_storage(storage, str(resume_plan.point.load_dir / resume_plan.point.tag) if resume_plan.convert
                      else "", cfg.checkpoint.export_final)
    except UserError as e:  # every rank found the same: rank 0 says it
        raise AgreedError(str(e)) from None
    ds_config = render(load_universal=resume_plan.universal, node_local=storage == NODE_LOCAL)
    writer = env.local_rank == 0 if storage == NODE_LOCAL else env.is_main

    # 3. Writes: the run directory (held: one run at a time), the logs, a fresh start's clean slate,
    # a converted checkpoint, an exported initial model, then the engine. What describes the run
    # (config.yaml, ds_config.json, env.json, hf_model/, metrics rewound) is written once a resume
    # has loaded (Run.maybe_resume), so a checkpoint that fails to load leaves them as they were.
    lock = hold_run_dir(paths, writer)
    capture_console(paths.rank_log(env.rank), paths.console_log if env.is_main else None, host, env.rank)
    rank_log = build_rank_log(paths.rank_log(env.rank), env.rank, host)
    rank_log.info(f"pid {os.getpid()} host {host} local_rank {env.local_rank} node {env.node_rank} "
                  f"world {env.world_size} launcher {env.launcher}")
    if cfg.checkpoint.resume == "restart":
        start_over(paths, writer)
    resume = prepare_resume(resume_plan)
    weights = _export_initial_model(source, paths)
    if on_gpu:  # set either way: parity's worker runs several runs in one process
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = cfg.model.tf32
        if said := fix_arch_list(ds_config):
            rank_log.info(said)
            if env.is_main and not quiet:
                print(said)
    from transformers import set_seed

    set_seed(cfg.seed)
    mpu = register_ulysses(source.hf_config, cfg.model.attn_implementation, dims.sequence, plan.micro_batch_size,
                           packed=inputs.data is not None and inputs.data.packed)
    built = build_model(replace(cfg.model, path=str(weights or "")), source.hf_config, ds_config, cfg.seed)
    if cfg.model.liger_kernels:
        _, said = apply_liger(built.model, accel.device_name())
        rank_log.info(said)
        if env.is_main and not quiet:
            print(said)
    tiled, whole = tiled_mlps(built.model, cfg.train.mlp_tile_positions, cfg.train.seq_len // dims.sequence)
    n_params = count_params(built.model)
    trainable = count_params(built.model, trainable_only=True) if has_frozen_params(built.model) else None
    engine = initialize(built.model, ds_config, mpu)
    if compiles(cfg.model.compile, accel.device_name()):  # each decoder layer, with the accelerator's backend
        backend = accel.get_compile_backend()
        n, kind = compile_layers(engine.module, backend)
        rank_log.info(f"model.compile: torch.compile(backend={backend!r}) on {n} {kind} module(s)")

    hosts = dist.all_gather_object((env.node_rank, host))  # node rank: loopback nodes share a name
    say = print if env.is_main and not quiet else _silent

    def describe_run(start: int) -> None:
        """config.yaml, ds_config.json, env.json, hf_model/; metrics.jsonl cut back to `start`."""
        if not env.is_main:
            return
        try:
            save_config(cfg, paths.config)
            write_atomic(paths.ds_config, json.dumps(ds_config, indent=2))
            write_atomic(paths.env, json.dumps(env_record(env, hosts, dtype, spec.kind.name, dims.record(),
                                                          storage), indent=2))
            save_hf_metadata(source.hf_config, source.tokenizer, paths.hf_model)
            # A resumed run's metrics continue from the checkpoint; a fresh run's start afresh.
            damaged = rewind_jsonl(paths.metrics, start)
        except OSError as e:
            raise UserError(f"output_dir: writing {e.filename or paths.root} failed ({e.strerror or e}); free "
                            f"space or choose another output_dir") from None
        if damaged:
            say(f"metrics.jsonl: dropped {damaged} line(s) that do not parse (a write cut short, or damage); "
                f"kept every other record")

    if decision.point is None:
        say(decision.said)
    if outside := deepspeed_range_note(cfg, version("deepspeed")):
        say(outside)
    if changes:
        say("resuming with changed settings: " + "; ".join(changes))
    for note in resume_plan.notes:
        say(note)
    if built.new_weights:
        say(f"initialised new weights (model.allow_new_weights): {', '.join(built.new_weights)}")
    say(plan.describe(env.world_size))
    if dims.sequence > 1:
        say(f"{dims.describe()}; each rank holds {cfg.train.seq_len // dims.sequence} positions of a sequence")
    if dims.tensor > 1:  # what AutoTP left on this rank (the layers of its plan split, the rest whole)
        held = sum(p.numel() for p in engine.module.parameters())
        rank_log.info(f"AutoTP: this rank holds {held:,} of the model's {n_params:,} parameters")
        say(f"{dims.describe()}; AutoTP splits the layers: rank 0 holds {held:,} of {n_params:,} parameters")
    if tiled or whole:
        say(f"MLP in tiles of {cfg.train.mlp_tile_positions} positions (train.mlp_tile_positions): "
            f"{', '.join(tiled) or 'none'}"
            + (f"; left whole: {', '.join(whole)}" if whole else ""))
    say(f"lr {lr:.3g} (optim.lr {cfg.optim.lr:g}, scaling {cfg.optim.lr_scaling}); dtype {dtype}; "
        f"ZeRO stage {engine.zero_optimization_stage()}; {n_params / 1e6:.2f}M parameters"
        + (f", {trainable / 1e6:.3g}M of them trained (LoRA rank {cfg.model.lora.rank}: the adapters"
           + (f" and {', '.join(cfg.model.lora.modules_to_save)}" if cfg.model.lora.modules_to_save else "")
           + "; the base frozen)" if trainable is not None else ""))
    say(host_table(hosts) + ("; output_dir node-local (each node holds its own ranks' checkpoint files)"
                             if storage == NODE_LOCAL else ""))

    device_name = torch.cuda.get_device_name() if on_gpu else platform.processor() or "cpu"
    logger = build_logger(env.is_main, paths, cfg.log.wandb, cfg.log.wandb_project, cfg.to_dict(),
                          spec.kind.console_keys, tensorboard=cfg.log.tensorboard)
    rank_log.info(f"device {device_name}; {decision.said}")
    record = run_record(spec.kind.name, engine.zero_optimization_stage(), dtype, storage, dims.record(),
                        cfg.to_dict(), data)
    ranks_here = env.local_world_size if storage == NODE_LOCAL else env.world_size
    needed = checkpoint_bytes(n_params, engine.zero_optimization_stage(), dtype, env.world_size, ranks_here,
                              trainable)
    names = dist.node_hosts()
    heartbeat = Heartbeat(env.rank, env.node_rank, host, names[env.node_rank] if env.node_rank < len(names) else "",
                          fault=step_fault(cfg.watchdog.debug_fault, env.rank))
    launchers = LauncherWatch()  # a launcher above that ends stops the run, as SIGTERM does
    ckpt = Checkpointer(engine, paths.checkpoints, cfg.checkpoint, spec.last, env.rank, env.world_size, record,
                        stop, rank_log, spec.unit, writer=writer, seq=decision.next_seq, needed_bytes=needed,
                        where=f" (node {env.node_rank}, {host})", beat=heartbeat.beat,
                        grace=kill_grace(launchers, os.environ), say=say,
                        channel=dist.side_channel(env) if cfg.checkpoint.async_save else None)
    fpt = flops_per_token(n_params, source.hf_config.num_hidden_layers, source.hf_config.hidden_size,
                          cfg.train.seq_len, lookup_params(source.hf_config), trainable)
    guard = NonFiniteGuard(cfg.train.nonfinite, cfg.train.nonfinite_patience, rank_log)
    watchdog = Watchdog(heartbeat, paths, env.world_size, cfg.watchdog.stall_s, cfg.watchdog.heartbeat_s,
                        dist.side_channel(env), env.local_rank if on_gpu else None, stop.request,
                        launchers).start()
    token_group = dist.subgroup(dims.token_groups(), env.rank)
    return Run(cfg, env, spec, dims, token_group, plan, paths, ds_config, dtype, lr, engine, source.tokenizer,
               n_params, fpt, peak_flops(device_name, cfg.log.peak_tflops) if on_gpu else None, logger, rank_log,
               say, ckpt, guard, stop, resume, decision.said, hosts, heartbeat, watchdog, describe_run, lock, weights)


def _ending(exc: BaseException | None) -> str:
    """The last line of a rank's log: how this rank's run ended."""
    if exc is None:
        return "run ended"
    if hasattr(exc, "exit_code"):
        return f"exit {exc.exit_code}: {exc}"
    return f"exit 1: {type(exc).__name__}: {exc}"


def _silent(*args, **kwargs) -> None:
    return None


def _export_initial_model(source: ModelSource, paths: RunPaths) -> Path | None:
    """The directory to load weights from: model.path, or a ds_train run exported once (every rank
    asks; the first to take the lock exports, the others wait)."""
    if source.export_from is None:
        return source.weights
    out = paths.init_model
    with file_lock(paths.root / f".{out.name}.lock"):
        if not (out / "config.json").is_file():
            export(source.export_from, out)
    return out
