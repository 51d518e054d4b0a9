"""One run machinery for `train`, `ript` and `dry-run`: everything before the first step and after
the last, built once. Each command adds only its own loop:

    with build_run(cfg, ds_config_path, dist.detect_env(), spec, source) as run:
        start = run.maybe_resume()
        for step in ...:            # the command's loop; run.checkpointer, run.logger decide
            ...

`build_run` checks every input first (batch math at this world size, the DeepSpeed template, the
model, the resume point) and writes nothing until all of them pass. Then it converts a checkpoint
for a new world size or stage if needed, exports a ds_train run given as model.path, joins the
process group, builds the engine and writes config.yaml, ds_config.json, env.json and hf_model/.
Leaving the block restores the signal handlers and closes the sinks; after an orderly end (or a
stop every rank agreed on) it also frees DeepSpeed's shared-memory buffers and the process group.
A CUDA out-of-memory leaves it as OutOfMemory, whose message is this run's memory plan.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import signal
import socket
import time
import uuid
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any, Callable

from ds_train import checkpoint, dist
from ds_train.resume import (ResumePlan, ResumePoint, agree, check_resume, load_resume, locate, plan_resume,
                             prepare_resume)
from ds_train.batch import BatchPlan, plan_batch, scaled_lr
from ds_train.config import RunConfig
from ds_train.configfile import save_config
from ds_train.data import load_tokenizer
from ds_train.engine import initialize, read_ds_template, render_ds_config, zero_stage
from ds_train.errors import AgreedError, OutOfMemory, Preempted, RunStopped, UserError
from ds_train.export import export, locate_model, save_hf_metadata
from ds_train.fs import check_writable, file_lock, hold_lock, write_atomic
from ds_train.logs import build_rank_log, capture_console, release_console
from ds_train.metrics import Logger, build_logger, build_progress, peak_flops, rewind_jsonl
from ds_train.memory import checkpoint_bytes
from ds_train.model import (build_hf_config, build_model, count_params, flops_per_token, lookup_params,
                            resolve_dtype)
from ds_train.plan import oom_report
from ds_train.reports import doctor_hint
from ds_train.reports import where as rank_where
from ds_train.watchdog import Heartbeat, Watchdog, fault_at

INIT_MODEL_DIR = "init_model"  # a ds_train run given as model.path, exported once into the run dir


@dataclass(frozen=True)
class RunSpec:
    """What a command tells the machinery about itself."""

    kind: str  # "train" or "ript": recorded in every checkpoint, checked on resume
    last: int  # the loop's last step (train.max_steps, ript.iterations)
    steps: Callable[[BatchPlan], int]  # optimizer steps the LR schedule spans; UserError if impossible
    unit: str = "step"  # what the loop counts, in messages
    same_world: bool = False  # resume only at the saved world size (work sharded per rank)
    console_keys: tuple[str, ...] = ()  # what the console prints per logged step (empty: training's)

    def check(self, cfg: RunConfig, world_size: int) -> tuple[BatchPlan, int]:
        """The batch math at this world size: the plan and the schedule's length (pure; the
        launch preflight calls it for the target cluster)."""
        plan = plan_batch(cfg.train.global_batch_size, cfg.train.micro_batch_size, world_size,
                          cfg.train.seq_len)
        return plan, self.steps(plan)


@dataclass(frozen=True)
class ModelSource:
    """The model a run starts from, resolved (and checked) before anything is written."""

    hf_config: Any
    tokenizer: Any
    weights: Path | None  # a Hugging Face directory to load; None: from scratch (model.config)
    export_from: Path | None = None  # a ds_train run whose weights become <run dir>/init_model


def resolve_model(cfg: RunConfig, tokenizer_dir: str | Path = "") -> ModelSource:
    """model.path (a Hugging Face directory or a ds_train run) or model.config, with the tokenizer
    of `tokenizer_dir`, else the model directory's."""
    hf_dir, export_from = locate_model(cfg.model.path) if cfg.model.path else (None, None)
    tokenizer = load_tokenizer(tokenizer_dir or hf_dir)
    model_cfg = replace(cfg.model, path=str(hf_dir or ""))
    hf_config = build_hf_config(model_cfg, len(tokenizer), cfg.train.seq_len)
    return ModelSource(hf_config, tokenizer, hf_dir, export_from)


class StopRequest:
    """SIGTERM, SIGINT and SIGUSR1 (SLURM's signal before the time limit, `--signal=USR1@T`) set a
    flag, as does a stop request `ds-train launch` sends through the store; the checkpointer agrees
    on it across ranks at step boundaries."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)

    def __init__(self):
        self.signum = 0
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
    plan: BatchPlan
    run_dir: Path
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
    checkpointer: checkpoint.Checkpointer
    stop: StopRequest
    resume: ResumePoint | None
    resume_said: str  # how the ranks decided; said once the checkpoint is loaded
    hosts: list[tuple[int, str]]  # (node rank, host name) of every rank
    heartbeat: Heartbeat  # where this rank is: the loop calls run.beat(step, phase)
    watchdog: Watchdog
    describe_run: Callable[[int], None]  # writes config.yaml ... and rewinds metrics (see maybe_resume)
    lock: int | None  # the run directory's lock (writers), held until the process ends

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

    def progress(self, initial: int, **kw):
        """The loop starts: the watchdog is armed, and rank 0 gets a progress bar (log.progress)
        that closes when its block ends."""
        self.watchdog.arm()
        return build_progress(self.env.is_main, self.cfg.log.progress, self.spec.last, initial, **kw)

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

    def write_plots(self) -> None:
        """Rank 0 plots the run's metrics into run_dir/plots (log.plots) and says where."""
        if not (self.env.is_main and self.cfg.log.plots):
            return
        from ds_train.plots import write_plots
        from ds_train.rundir import read_metrics

        self.beat(self.spec.last, "plots")
        paths = write_plots([(self.run_dir.name, read_metrics(self.run_dir / "metrics.jsonl"))],
                            self.run_dir / "plots", self.spec.kind)
        self.say(f"plots: {self.run_dir / 'plots'}/{{{','.join(p.stem for p in paths)}}}.png")

    def __enter__(self) -> "Run":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        import torch

        if isinstance(exc, torch.cuda.OutOfMemoryError):  # the memory plan of this run says what to change
            gib = torch.cuda.get_device_properties(self.engine.device).total_memory / 2**30
            exc = OutOfMemory(oom_report(self.cfg, self.ds_config, self.engine.module.config,
                                         self.env.world_size, gib))
        verdict = None
        if exc is not None and not isinstance(exc, (RunStopped, AgreedError)):  # this rank failed alone
            verdict = self.watchdog.fail(exc)
        if exc is not None and not isinstance(exc, (Preempted, UserError)) and (self.env.is_main or verdict):
            exc.add_note(doctor_hint(self.run_dir))
        if verdict:  # the reporting rank ends its output with the job's verdict
            exc.add_note(f"ds-train: error: {verdict}")
        self.stop.restore()
        self.logger.close()
        self.watchdog.stop("ended" if exc is None else "stopped" if isinstance(exc, RunStopped) else "failed")
        self.rank_log.info(_ending(exc))
        if exc is None or isinstance(exc, RunStopped):  # every rank is here: collectives cannot hang
            dist.barrier()
            dist.release_shared_memory(self.env)
            dist.shutdown()
        if self.lock is not None:
            os.close(self.lock)  # the run directory is free for the next run
        if exc is None:  # all said; after an error, what the CLI prints next belongs in the log too
            release_console()
        if isinstance(exc, OutOfMemory):
            raise exc from None


def build_run(cfg: RunConfig, ds_config_path: str, env: dist.DistEnv, spec: RunSpec, source: ModelSource,
              quiet: bool = False, data: dict | None = None) -> Run:
    """Everything before the first step. Bad input fails here, before anything is written.
    `data`: what identifies the prepared data (token counts), recorded in every checkpoint.

    The signal handlers go in first: a stop asked for during start-up (SLURM's SIGUSR1 can come
    early) is kept, and the run saves and stops at its first step."""
    stop = StopRequest()
    try:
        return _build_run(cfg, ds_config_path, env, spec, source, stop, quiet, data or {})
    except BaseException:
        stop.restore()
        raise


def _build_run(cfg: RunConfig, ds_config_path: str, env: dist.DistEnv, spec: RunSpec, source: ModelSource,
               stop: StopRequest, quiet: bool, data: dict) -> Run:
    import torch
    from deepspeed.accelerator import get_accelerator

    # 1. Checks that need no peers: each rank fails fast on its own.
    run_dir = Path(cfg.output_dir)
    check_writable(run_dir, "output_dir")
    check_run_dir(run_dir)
    data = {**data, "tokenizer": vocabulary_id(source.tokenizer)}
    template = read_ds_template(ds_config_path)
    plan, total_steps = spec.check(cfg, env.world_size)
    accel = get_accelerator()
    on_gpu = accel.device_name() == "cuda"
    dtype = resolve_dtype(cfg.model.dtype, accel.device_name(), accel.is_bf16_supported())
    lr = scaled_lr(cfg.optim.lr, plan.global_batch_size, cfg.optim.reference_batch_size, cfg.optim.lr_scaling)
    render = partial(render_ds_config, template, cfg, plan, dtype=dtype, hidden_size=source.hf_config.hidden_size,
                     lr=lr, total_steps=total_steps, on_gpu=on_gpu, source=str(ds_config_path))
    render(load_universal=False)
    locate(cfg.checkpoint.resume, run_dir / "checkpoints")

    # 2. Checks every rank makes together: the file-system layout and the resume point.
    host = socket.gethostname()
    dist.init(env, cfg.dist.timeout_s, cfg.dist.join_timeout_s, host)
    try:
        layout = storage_layout(run_dir, env)
        decision = agree(cfg.checkpoint.resume, run_dir / "checkpoints", env, host, spec.unit)
        changes = check_resume(decision.point, cfg, spec.kind, env.world_size, spec.same_world, data)
        resume_plan = plan_resume(decision.point, env.world_size, zero_stage(template), dtype,
                                             cfg.checkpoint.load_universal)
        check_layout(layout, cfg, resume_plan, env)
    except UserError as e:  # every rank found the same: rank 0 says it
        raise AgreedError(str(e)) from None
    ds_config = render(load_universal=resume_plan.universal)
    if layout == NODE_LOCAL:  # each node's first rank writes the model states on its own disk
        ds_config["checkpoint"] = {**ds_config.get("checkpoint", {}), "use_node_local_storage": True}
    writer = env.local_rank == 0 if layout == NODE_LOCAL else env.is_main

    # 3. Writes: the run directory (held: one run at a time), the logs, a fresh start's clean slate,
    # a converted checkpoint, an exported initial model, then the engine. What describes the run
    # (config.yaml, ds_config.json, env.json, hf_model/, metrics rewound) is written once a resume
    # has loaded (Run.maybe_resume), so a checkpoint that fails to load leaves them as they were.
    lock = hold_run_dir(run_dir, writer, env, host)
    logs = run_dir / "logs"
    capture_console(logs / f"rank_{env.rank}.log", logs / "train.log" if env.is_main else None, host, env.rank)
    rank_log = build_rank_log(run_dir, env.rank, host)
    rank_log.info(f"pid {os.getpid()} host {host} local_rank {env.local_rank} node {env.node_rank} "
                  f"world {env.world_size} launcher {env.launcher}")
    if cfg.checkpoint.resume == "restart":
        start_over(run_dir, writer)
    resume = prepare_resume(resume_plan)
    weights = _export_initial_model(source, run_dir)
    if on_gpu:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    from transformers import set_seed

    set_seed(cfg.seed)
    model_cfg = replace(cfg.model, path=str(weights or ""))
    built = build_model(model_cfg, source.hf_config, ds_config, cfg.seed)
    n_params = count_params(built.model)
    engine = initialize(built.model, ds_config)
    if cfg.model.compile:  # torch.compile through DeepSpeed, with the accelerator's backend
        from deepspeed.accelerator import get_accelerator

        backend = get_accelerator().get_compile_backend()
        engine.compile(backend=backend)
        rank_log.info(f"engine.compile(backend={backend!r}): compiled {engine.is_compiled}")

    hosts = dist.all_gather_object((env.node_rank, host))  # node rank: loopback nodes share a name
    say = print if env.is_main and not quiet else _silent

    def describe_run(start: int) -> None:
        """config.yaml, ds_config.json, env.json, hf_model/; metrics.jsonl cut back to `start`."""
        if not env.is_main:
            return
        try:
            save_config(cfg, run_dir / "config.yaml")
            write_atomic(run_dir / "ds_config.json", json.dumps(ds_config, indent=2))
            write_atomic(run_dir / "env.json", json.dumps(env_record(env, hosts, dtype, spec.kind, layout),
                                                          indent=2))
            save_hf_metadata(source.hf_config, source.tokenizer, run_dir / "hf_model")
            # A resumed run's metrics continue from the checkpoint; a fresh run's start afresh.
            damaged = rewind_jsonl(run_dir / "metrics.jsonl", start)
        except OSError as e:
            raise UserError(f"output_dir: writing {e.filename or run_dir} failed ({e.strerror or e}); free "
                            f"space or choose another output_dir") from None
        if damaged:
            say(f"metrics.jsonl: dropped {damaged} line(s) that do not parse (a write cut short, or damage); "
                f"kept every other record")

    if decision.point is None:
        say(decision.said)
    if changes:
        say("resuming with changed settings: " + "; ".join(changes))
    for note in resume_plan.notes:
        say(note)
    if built.new_weights:
        say(f"initialised new weights (model.allow_new_weights): {', '.join(built.new_weights)}")
    say(plan.describe())
    say(f"lr {lr:.3g} (optim.lr {cfg.optim.lr:g}, scaling {cfg.optim.lr_scaling}); dtype {dtype}; "
        f"ZeRO stage {engine.zero_optimization_stage()}; {n_params / 1e6:.2f}M parameters")
    say(host_table(hosts) + ("; output_dir node-local (each node holds its own ranks' checkpoint files)"
                             if layout == NODE_LOCAL else ""))

    device_name = torch.cuda.get_device_name() if on_gpu else platform.processor() or "cpu"
    logger = build_logger(env.is_main, run_dir, cfg.log.wandb, cfg.log.wandb_project, cfg.to_dict(),
                          console_keys=spec.console_keys, tensorboard=cfg.log.tensorboard)
    rank_log.info(f"device {device_name}; {decision.said}")
    record = {"kind": spec.kind, "zero_stage": engine.zero_optimization_stage(), "dtype": dtype,
              "layout": layout, "config": cfg.to_dict(), "data": data}
    ranks_here = env.local_world_size if layout == NODE_LOCAL else env.world_size
    needed = checkpoint_bytes(n_params, engine.zero_optimization_stage(), dtype, env.world_size, ranks_here)
    names = dist.node_hosts()
    heartbeat = Heartbeat(env.rank, env.node_rank, host, names[env.node_rank] if env.node_rank < len(names) else "",
                          fault=fault_at(cfg.watchdog.debug_fault, env.rank))
    ckpt = checkpoint.Checkpointer(engine, run_dir, cfg.checkpoint, spec.last, env.rank, env.world_size,
                                   record, stop, rank_log, spec.unit, writer=writer, seq=decision.next_seq,
                                   needed_bytes=needed, where=f" (node {env.node_rank}, {host})",
                                   beat=heartbeat.beat)
    fpt = flops_per_token(n_params, source.hf_config.num_hidden_layers, source.hf_config.hidden_size,
                          cfg.train.seq_len, lookup_params(source.hf_config))
    watchdog = Watchdog(heartbeat, run_dir, env.world_size, cfg.watchdog.stall_s, cfg.watchdog.heartbeat_s,
                        dist.side_channel(env), env.local_rank if on_gpu else None, stop.request).start()
    return Run(cfg, env, spec, plan, run_dir, ds_config, dtype, lr, engine, source.tokenizer, n_params, fpt,
               peak_flops(device_name, cfg.log.peak_tflops) if on_gpu else None, logger, rank_log, say,
               ckpt, stop, resume, decision.said, hosts, heartbeat, watchdog, describe_run, lock)


# What a run directory holds, and of which kind: anything else under these names is in the way.
RUN_DIR_ENTRIES = {"checkpoints": "dir", "logs": "dir", "heartbeats": "dir", "hf_model": "dir",
                   "metrics.jsonl": "file", "results.json": "file", "config.yaml": "file",
                   "ds_config.json": "file", "env.json": "file", "tensorboard": "dir", "plots": "dir"}


def check_run_dir(run_dir: Path) -> None:
    """Names the run directory uses, taken by something of another kind (a file `checkpoints`)."""
    wrong = [f"{name} is a {'file' if kind == 'dir' else 'directory'}" for name, kind in RUN_DIR_ENTRIES.items()
             if (run_dir / name).exists() and (run_dir / name).is_dir() != (kind == "dir")]
    if wrong:
        raise UserError(f"output_dir {run_dir}: {'; '.join(wrong)}, where the run keeps its own; move "
                        f"{'them' if len(wrong) > 1 else 'it'} away or choose another output_dir")


def vocabulary_id(tokenizer) -> str:
    """A short hash of the tokenizer's vocabulary: the same ids mean the same strings."""
    import hashlib

    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    return hashlib.sha256(json.dumps(vocab).encode()).hexdigest()[:16]


def hold_run_dir(run_dir: Path, writer: bool, env: dist.DistEnv, host: str) -> int | None:
    """One run at a time in a run directory: each file system's writer holds its lock (the ranks
    agree: if any writer finds it held, every rank stops)."""
    fd, holder = None, ""
    if writer:
        run_dir.mkdir(parents=True, exist_ok=True)
        fd, holder = hold_lock(run_dir / ".ds_train.lock")
    busy = [h for h in dist.all_gather_object(holder) if h]
    if busy:
        raise AgreedError(f"output_dir {run_dir} is in use by another run ({busy[0]}); wait for it to end, or "
                          f"use another output_dir")
    return fd


SHARED, NODE_LOCAL = "shared", "node-local"


def storage_layout(run_dir: Path, env: dist.DistEnv) -> str:
    """Whether output_dir is one file system for every rank (SHARED) or each node's own
    (NODE_LOCAL): the first rank of each node leaves a mark, every rank says whose it sees."""
    if env.world_size == env.local_world_size:
        return SHARED  # one node
    nonce = dist.broadcast_object(uuid.uuid4().hex if env.is_main else None)
    mark = run_dir / f".ds_train_node_{nonce}_{env.rank}"
    if env.local_rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        mark.touch()
    dist.barrier()
    seen = sorted(int(p.name.rsplit("_", 1)[1]) for p in run_dir.glob(f".ds_train_node_{nonce}_*"))
    views = dist.all_gather_object(seen)
    dist.barrier()
    if env.local_rank == 0:
        mark.unlink(missing_ok=True)
    leaders = sorted({r for view in views for r in view})
    if all(view == leaders for view in views):
        return SHARED
    if all(len(view) == 1 for view in views):
        return NODE_LOCAL
    groups = sorted({tuple(view) for view in views})
    raise UserError(f"output_dir {run_dir}: some nodes share it and some do not (nodes led by ranks "
                    f"{'; '.join(','.join(map(str, g)) for g in groups)} see the same directory); give "
                    f"every node its own, or one shared by all")


def check_layout(layout: str, cfg: RunConfig, plan: ResumePlan, env: dist.DistEnv) -> None:
    """What a node-local output_dir cannot do: gather every rank's files in one place."""
    if layout != NODE_LOCAL:
        return
    if plan.convert:
        raise UserError(f"{plan.point.load_dir / plan.point.tag}: resuming at a new world size or ZeRO stage "
                        f"converts the checkpoint, which needs every rank's files in one place; copy the "
                        f"nodes' checkpoints/ into one shared directory and resume from it")
    if cfg.checkpoint.export_final:
        raise UserError("checkpoint.export_final: a node-local output_dir holds each node's part of the "
                        "checkpoint; set it to false and run `ds-train export` on the checkpoints "
                        "copied into one directory")


def start_over(run_dir: Path, writer: bool) -> None:
    """checkpoint.resume=restart: this file system's checkpoints and the earlier run's metrics and
    results go; everything else is rewritten by the new run."""
    if writer:
        for name in ("checkpoints", "tensorboard", "plots"):
            shutil.rmtree(run_dir / name, ignore_errors=True)
        for name in ("metrics.jsonl", "results.json", "ript_results.json"):
            (run_dir / name).unlink(missing_ok=True)
    dist.barrier()


def _ending(exc: BaseException | None) -> str:
    """The last line of a rank's log: how this rank's run ended."""
    if exc is None:
        return "run ended"
    if hasattr(exc, "exit_code"):
        return f"exit {exc.exit_code}: {exc}"
    return f"exit 1: {type(exc).__name__}: {exc}"


def _silent(*args, **kwargs) -> None:
    return None


def _export_initial_model(source: ModelSource, run_dir: Path) -> Path | None:
    """The directory to load weights from: model.path, or a ds_train run exported once (every rank
    asks; the first to take the lock exports, the others wait)."""
    if source.export_from is None:
        return source.weights
    out = run_dir / INIT_MODEL_DIR
    with file_lock(run_dir / f".{INIT_MODEL_DIR}.lock"):
        if not (out / "config.json").is_file():
            export(source.export_from, out)
    return out


def env_record(env: dist.DistEnv, hosts: list[tuple[int, str]], dtype: str, kind: str, layout: str = SHARED) -> dict:
    import deepspeed
    import psutil
    import torch
    import transformers

    return {"command": kind, "torch": torch.__version__, "deepspeed": deepspeed.__version__,
            "transformers": transformers.__version__, "python": platform.python_version(),
            "world_size": env.world_size, "launcher": env.launcher, "hosts": nodes(hosts),
            "accelerator": dist.accelerator_name(), "dtype": dtype, "output_dir": layout,
            "started": round(psutil.Process().create_time(), 3)}  # this attempt (reports older than it are history)


def nodes(hosts: list[tuple[int, str]]) -> list[dict]:
    """[{node, host, ranks}] in node order, from each rank's (node rank, hostname)."""
    by_node: dict[tuple[int, str], list[int]] = {}
    for rank, (node, host) in enumerate(hosts):
        by_node.setdefault((node, host), []).append(rank)
    return [{"node": node, "host": host, "ranks": ranks} for (node, host), ranks in sorted(by_node.items())]


def host_table(hosts: list[tuple[int, str]]) -> str:
    """`hosts: node0 vm -> ranks 0,1; node1 vm -> ranks 2,3`."""
    return "hosts: " + "; ".join(f"node{n['node']} {n['host']} -> ranks {','.join(map(str, n['ranks']))}"
                                 for n in nodes(hosts))
