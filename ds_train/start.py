"""Starting a run: everything before the first step, composed from its parts, for `train`, `ript`,
`dry-run` and `parity` (what `launch --check` / `slurm` check of the command they start: inputs.check_launch).

`build_run` (each phase a function, each component built by its own function):
1. alone (each rank fails fast on its own): the run directory can be written, the config at the
   world size (inputs.check_config, which check_inputs ran before the data: the layout, the command's
   model checks, the ds_config rendered once), the resume point named;
2. together (the process group joined): the file-system layout and the resume every rank agrees
   on; the agreed checkpoint options added to the ds_config;
3. writes: the run directory held, the logs, a fresh start's clean slate, a converted checkpoint,
   the starting weights, the model and the engine; then rank 0's account of the run, and the
   sinks, heartbeat, checkpointer and watchdog, composed into a Run (ds_train/run.py).
Nothing is written until every check of phases 1 and 2 has passed.
"""

from __future__ import annotations

import gc
import json
import os
import socket
from dataclasses import dataclass, replace
from functools import partial
from importlib.metadata import version
from pathlib import Path
from typing import Any

from ds_train import dist
from ds_train.dist.store import side_channel
from ds_train.checkpoint.checkpointer import Checkpointer, SaveHooks, SaveSite
from ds_train.checkpoint.commit import run_record
from ds_train.checkpoint.consensus import agree
from ds_train.checkpoint.export import export, save_hf_metadata
from ds_train.checkpoint.resume import check_resume, locate_checkpoint, plan_resume, prepare_resume
from ds_train.checkpoint.rundir import RunPaths
from ds_train.checkpoint.storage import (NODE_LOCAL, check_run_dir, check_storage, env_record, hold_run_dir, host_table,
                                         start_over, storage_layout)
from ds_train.config import RunConfig
from ds_train.config.file import save_config
from ds_train.engine import check_op_build, fix_arch_list, initialize, with_checkpoint_options, zero_stage
from ds_train.errors import AgreedError, UserError
from ds_train.faults import step_fault
from ds_train.fs import check_writable, file_lock, write_atomic
from ds_train.guard import NonFiniteGuard
from ds_train.inputs import ModelSource, RunInputs, check_config
from ds_train.model.build import build_model, count_params, flops_per_token, has_frozen_params, lookup_params, seed_all
from ds_train.model.kernels import apply_liger, compile_layers
from ds_train.model.speedups import Speedups, configured
from ds_train.model.tiled_mlp import tiled_mlps
from ds_train.model.ulysses import register_ulysses
from ds_train.observe.launchers import LauncherWatch, kill_grace
from ds_train.observe.logs import build_rank_log, capture_console, console_say, say_nothing
from ds_train.observe.metrics import build_logger, device_name, peak_flops, rewind_jsonl
from ds_train.observe.startup import StartupClock, process_started
from ds_train.observe.watchdog import Heartbeat, Watchdog
from ds_train.plan.memory import checkpoint_bytes
from ds_train.plan.parallel import Layout, ParallelDims, deepspeed_range_note
from ds_train.run import Run, RunLifecycle, RunSpec, StopRequest
from ds_train.topology import DistEnv, node_hosts, threads_per_rank


def build_run(inputs: RunInputs, env: DistEnv, spec: RunSpec, quiet: bool = False,
              clock: StartupClock | None = None) -> Run:
    """Everything before the first step. Bad input fails here, before anything is written. `clock`:
    the start-up's phases so far (None: a clock from the process's start), marked on as they pass.

    The signal handlers go in first: a stop asked for during start-up (SLURM's SIGUSR1 can come
    early) is kept, and the run saves and stops at its first step."""
    stop = StopRequest()
    clock = clock or StartupClock(process_started())
    try:
        run = _build_run(inputs, env, spec, stop, quiet, clock)
    except BaseException as e:
        stop.restore()
        if isinstance(e, AgreedError):  # every rank is here: they leave the process group together
            dist.leave()
        raise
    gc.freeze()  # the start-up's objects (modules, the model) out of the run's collections (Run.__exit__ thaws them)
    gc.enable()  # off since the process started (ds_train.__main__.cli): the start-up is over
    return run


@dataclass(frozen=True)
class _Checked:
    """Phase 1: what each rank checks alone, knowing the world size."""

    paths: RunPaths
    layout: Layout
    ds_config: dict  # rendered once; the resume's and the storage's checkpoint options added in phase 2
    dtype: str
    lr: float
    on_gpu: bool


def _check_alone(inputs: RunInputs, env: DistEnv, spec: RunSpec) -> _Checked:
    """Checks that need the world size but no peers: each rank fails fast on its own. The config's
    check (check_config) ran before the data was prepared; again here with the tokenizer's vocabulary."""
    from deepspeed.accelerator import get_accelerator

    cfg, source = inputs.cfg, inputs.source
    paths = RunPaths(cfg.output_dir)
    check_writable(paths.root, "output_dir")
    check_run_dir(paths)
    accel = get_accelerator()
    on_gpu = accel.device_name() == "cuda"
    checked = check_config(cfg, inputs.template, spec, env.world_size, source.hf_config, inputs.ds_config_path,
                           accel.device_name(), accel.is_bf16_supported(), env.local_world_size)
    if on_gpu:  # an op DeepSpeed would JIT-build: what its build needs is here, or one line says what is not
        check_op_build(checked.ds_config)
    locate_checkpoint(cfg.checkpoint.resume, paths.checkpoints)
    return _Checked(paths, checked.layout, checked.ds_config, checked.dtype, checked.lr, on_gpu)


@dataclass(frozen=True)
class _Agreed:
    """Phase 2: what every rank decided together."""

    storage: str  # shared or node-local
    decision: Any  # the resume decision (agree)
    changes: list[str]  # settings a resume changes
    resume_plan: Any  # how the agreed checkpoint loads (plan_resume)
    writer: bool  # this rank writes the run directory's files (rank 0, or each node's first under node-local)
    speedups: Speedups  # what the start-up probe kept of the speed-ups the config asks for


def _agree_together(inputs: RunInputs, env: DistEnv, spec: RunSpec, checked: _Checked, host: str) -> _Agreed:
    """Checks every rank makes together: the file-system layout, the resume point and the start-up probe of
    the speed-ups (the process group joined first). What every rank found alike, rank 0 says."""
    cfg, paths = inputs.cfg, checked.paths
    dist.init(env, cfg.dist.timeout_s, cfg.dist.join_timeout_s, host)
    try:
        storage = storage_layout(paths, env)
        decision = agree(cfg.checkpoint.resume, paths.checkpoints, env, host, spec.unit)
        changes = check_resume(decision.point, cfg, spec.kind.name, env.world_size, spec.same_world,
                               inputs.data_id(), env.split.world("rollout").world_size if env.split else 0)
        resume_plan = plan_resume(decision.point, checked.layout.dims, zero_stage(inputs.template), checked.dtype,
                                  cfg.checkpoint.load_universal)
        check_storage(storage, str(resume_plan.point.load_dir / resume_plan.point.tag) if resume_plan.convert
                      else "", cfg.checkpoint.export_final)
        speedups = _probe(inputs, env, spec, checked)
    except UserError as e:  # every rank found the same: rank 0 says it
        raise AgreedError(str(e)) from None
    writer = env.local_rank == 0 if storage == NODE_LOCAL else env.is_main
    return _Agreed(storage, decision, changes, resume_plan, writer, speedups)


def _probe(inputs: RunInputs, env: DistEnv, spec: RunSpec, checked: _Checked) -> Speedups:
    """The speed-ups the run keeps: the command's start-up probe of each against the model's own forward
    (RunSpec.probe; the same verdict on every rank), or as configured."""
    from deepspeed.accelerator import get_accelerator

    device = get_accelerator().device_name()
    if spec.probe is None:
        return configured(inputs.cfg, device)
    return spec.probe(inputs.cfg, inputs.source.hf_config, checked.dtype, device, checked.layout.dims, env.rank)


@dataclass(frozen=True)
class _Model:
    """Phase 3's model: the engine and what the run says and measures of it."""

    engine: Any
    weights: Path | None  # where the starting weights were loaded from (None: from scratch)
    n_params: int
    trainable: int | None  # None: every parameter trains
    new_weights: list[str]
    tiled: list[str]
    whole: list[str]


def _build_model(inputs: RunInputs, env: DistEnv, checked: _Checked, ds_config: dict, paths: RunPaths,
                 rank_log, quiet: bool, clock: StartupClock, speedups: Speedups) -> _Model:
    """The starting weights (a ds_train run given as model.path exported once), the seed, Ulysses'
    attention, the model, its kernels and tiles, and the DeepSpeed engine."""
    import torch
    from deepspeed.accelerator import get_accelerator

    cfg, source, dims = inputs.cfg, inputs.source, checked.layout.dims
    device = get_accelerator().device_name()
    weights = _export_initial_model(source, paths)
    loud = env.is_main and not quiet
    if checked.on_gpu:  # set either way: parity's worker runs several runs in one process
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = cfg.model.tf32
        torch.cuda.reset_peak_memory_stats()  # mem/max_rank_gib: this run's peak, not an earlier one's in the process
        if said := fix_arch_list(ds_config):
            _log_and_say(rank_log, said, loud)
    seed_all(cfg.seed)
    mpu = register_ulysses(source.hf_config, cfg.model.attn_implementation, dims.sequence,
                           checked.layout.batch.micro_batch_size,
                           packed=inputs.data is not None and inputs.data.packed)
    built = build_model(replace(cfg.model, path=str(weights or "")), source.hf_config, ds_config, cfg.seed)
    if built.constructed:  # the model's _init_weights leaves these to its constructor: built with its draws
        rank_log.info(f"init: {', '.join(built.constructed[:5])}{' ...' if len(built.constructed) > 5 else ''} "
                      f"keep their constructor's values (the model's _init_weights leaves them)")
    if speedups.liger:
        _log_and_say(rank_log, apply_liger(built.model, device)[1], loud)
    tiled, whole = tiled_mlps(built.model, speedups.mlp_tile_positions, cfg.train.seq_len // dims.sequence)
    n_params = count_params(built.model)
    trainable = count_params(built.model, trainable_only=True) if has_frozen_params(built.model) else None
    clock.mark("model")
    engine = initialize(built.model, ds_config, mpu)
    if speedups.compile:  # each decoder layer, the device's backend
        backend = get_accelerator().get_compile_backend()
        n, kind = compile_layers(engine.module, backend)
        rank_log.info(f"model.compile: torch.compile(backend={backend!r}) on {n} {kind} module(s)")
    clock.mark("engine")
    return _Model(engine, weights, n_params, trainable, built.new_weights, tiled, whole)


def _log_and_say(rank_log, said: str, loud: bool) -> None:
    rank_log.info(said)
    if loud:
        print(said)


def _build_run(inputs: RunInputs, env: DistEnv, spec: RunSpec, stop: StopRequest, quiet: bool,
               clock: StartupClock) -> Run:
    cfg, source = inputs.cfg, inputs.source
    checked = _check_alone(inputs, env, spec)
    paths, dims, plan = checked.paths, checked.layout.dims, checked.layout.batch
    host = socket.gethostname()
    agreed = _agree_together(inputs, env, spec, checked, host)
    clock.mark("process group")
    ds_config = with_checkpoint_options(checked.ds_config, load_universal=agreed.resume_plan.universal,
                                        node_local=agreed.storage == NODE_LOCAL)

    # 3. Writes: the run directory (held: one run at a time), the logs, a fresh start's clean slate,
    # a converted checkpoint, an exported initial model, then the engine. What describes the run
    # (config.yaml, ds_config.json, env.json, hf_model/, metrics rewound) is written once a resume
    # has loaded (Run.maybe_resume), so a checkpoint that fails to load leaves them as they were.
    lock = hold_run_dir(paths, agreed.writer)
    capture_console(paths.rank_log(env.rank), paths.console_log if env.is_main else None, host, env.rank)
    rank_log = build_rank_log(paths.rank_log(env.rank), env.rank, host)
    rank_log.info(f"pid {os.getpid()} host {host} local_rank {env.local_rank} node {env.node_rank} "
                  f"world {env.world_size} launcher {env.launcher}")
    threads = _split_cores(env, rank_log)
    if cfg.checkpoint.resume == "restart":
        start_over(paths, agreed.writer)
    resume = prepare_resume(agreed.resume_plan)
    model = _build_model(inputs, env, checked, ds_config, paths, rank_log, quiet, clock, agreed.speedups)
    engine = model.engine
    hosts = dist.all_gather_object((env.node_rank, host))  # node rank: loopback nodes share a name
    say = console_say if env.is_main and not quiet else say_nothing
    _say_setup(say, rank_log, cfg, env, checked, agreed, model, hosts)
    if threads and env.local_world_size > 1:
        say(threads)

    device = device_name(checked.on_gpu)
    logger = build_logger(env.is_main, paths, cfg.log.wandb, cfg.log.wandb_project, cfg.to_dict(),
                          spec.kind.console_keys, tensorboard=cfg.log.tensorboard)
    rank_log.info(f"device {device}; {agreed.decision.said}")
    heartbeat = _build_heartbeat(cfg, env, host)
    launchers = LauncherWatch()  # a launcher above that ends stops the run, as SIGTERM does
    checkpointer = _build_checkpointer(inputs, env, spec, checked, agreed, model, stop, rank_log, heartbeat,
                                       launchers, say, host)
    watched = env.split.job.world_size if env.split else env.world_size  # with rollout ranks: theirs after ours
    watchdog = Watchdog(heartbeat, paths, watched, cfg.watchdog.stall_s, cfg.watchdog.heartbeat_s,
                        side_channel(env.split.job if env.split else env), env.local_rank if checked.on_gpu else None,
                        stop.request,
                        launchers).start()
    text = source.hf_config.get_text_config()  # a multimodal config's language model: its layers and widths
    clock.mark("run set-up")
    life = RunLifecycle(stop=stop, resume=resume, resume_said=agreed.decision.said, hosts=hosts, heartbeat=heartbeat,
                        watchdog=watchdog, lock=lock,
                        describe_run=partial(_describe_run, cfg, env, paths, ds_config, source, hosts, checked.dtype,
                                             spec, dims, agreed.storage, say))
    return Run(
        cfg=cfg, env=env, spec=spec, dims=dims, token_group=dist.subgroup(dims.token_groups(), env.rank),
        plan=plan, paths=paths, ds_config=ds_config, dtype=checked.dtype, engine=engine,
        tokenizer=source.tokenizer, n_params=model.n_params,
        flops_per_token=flops_per_token(model.n_params, text.num_hidden_layers, text.hidden_size, cfg.train.seq_len,
                                        lookup_params(text), model.trainable),
        peak_flops=peak_flops(device, cfg.log.peak_tflops) if checked.on_gpu else None,
        logger=logger, rank_log=rank_log, say=say, checkpointer=checkpointer,
        guard=NonFiniteGuard(cfg.train.nonfinite, cfg.train.nonfinite_patience, rank_log), life=life,
        weights=model.weights, startup=clock, speedups=agreed.speedups)


def _split_cores(env: DistEnv, rank_log) -> str:
    """torch's threads on this rank: this node's cores split between its ranks, unless OMP_NUM_THREADS
    is set (topology.threads_per_rank). Returns what rank 0 says ("" when OMP_NUM_THREADS decides)."""
    import torch

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    ranks = (env.split.job if env.split else env).local_world_size  # rollout ranks share the node's cores too
    threads = threads_per_rank(os.environ, cores, ranks)
    if threads is None:
        rank_log.info(f"threads: {torch.get_num_threads()} (OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']})")
        return ""
    torch.set_num_threads(threads)
    said = (f"threads: {threads} per rank ({cores} cores shared by {ranks} ranks on this node; "
            f"OMP_NUM_THREADS overrides)")
    rank_log.info(said)
    return said


def _build_heartbeat(cfg: RunConfig, env: DistEnv, host: str) -> Heartbeat:
    """Where this rank is (the loop beats it), with the watchdog's debug fault when one is set."""
    names = node_hosts()
    return Heartbeat(env.rank, env.node_rank, host, names[env.node_rank] if env.node_rank < len(names) else "",
                     fault=step_fault(cfg.watchdog.debug_fault, env.rank))


def _build_checkpointer(inputs: RunInputs, env: DistEnv, spec: RunSpec, checked: _Checked, agreed: _Agreed,
                        model: _Model, stop: StopRequest, rank_log, heartbeat: Heartbeat, launchers: LauncherWatch,
                        say, host: str) -> Checkpointer:
    """The checkpointer: when a step saves, the record each save carries, and the space a save needs."""
    cfg, engine, storage = inputs.cfg, model.engine, agreed.storage
    stage = engine.zero_optimization_stage()
    record = run_record(spec.kind.name, stage, checked.dtype, storage, checked.layout.dims.record(), cfg.to_dict(),
                        inputs.data_id())
    ranks_here = env.local_world_size if storage == NODE_LOCAL else env.world_size
    needed = checkpoint_bytes(model.n_params, stage, checked.dtype, env.world_size, ranks_here, model.trainable)
    site = SaveSite(checked.paths.checkpoints, env.rank, env.world_size, writer=agreed.writer,
                    where=f" (node {env.node_rank}, {host})",
                    channel=side_channel(env) if cfg.checkpoint.async_save else None,
                    peer_gone_s=max(5 * cfg.watchdog.heartbeat_s, 5.0))
    hooks = SaveHooks(stop, rank_log, beat=heartbeat.beat, say=say, grace=kill_grace(launchers, os.environ))
    return Checkpointer(cfg.checkpoint, engine, site, hooks, last=spec.last, record=record, unit=spec.unit,
                        seq=agreed.decision.next_seq, needed_bytes=needed)


def _say_setup(say, rank_log, cfg: RunConfig, env: DistEnv, checked: _Checked, agreed: _Agreed, model: _Model,
               hosts: list) -> None:
    """Rank 0's account of the run before its first step: the resume, the layout, the batch, the model."""
    dims, plan, engine, n_params = checked.layout.dims, checked.layout.batch, model.engine, model.n_params
    if agreed.decision.point is None:
        say(agreed.decision.said)
    if outside := deepspeed_range_note(cfg, version("deepspeed")):
        say(outside)
    if agreed.changes:
        say("resuming with changed settings: " + "; ".join(agreed.changes))
    for note in agreed.resume_plan.notes:
        say(note)
    if model.new_weights:
        say(f"initialised new weights (model.allow_new_weights): {', '.join(model.new_weights)}")
    if agreed.speedups.probed:
        rank_log.info(agreed.speedups.probed)
    for note in agreed.speedups.notes:  # a default speed-up the start-up probe turned off
        rank_log.info(note)
        say(note)
    say(plan.describe(env.world_size))
    if dims.sequence > 1:
        say(f"{dims.describe()}; each rank holds {cfg.train.seq_len // dims.sequence} positions of a sequence")
    if dims.tensor > 1:  # what AutoTP left on this rank (the layers of its plan split, the rest whole)
        held = sum(p.numel() for p in engine.module.parameters())
        rank_log.info(f"AutoTP: this rank holds {held:,} of the model's {n_params:,} parameters")
        say(f"{dims.describe()}; AutoTP splits the layers: rank 0 holds {held:,} of {n_params:,} parameters")
    if dims.expert > 1:  # what AutoEP made of the MoE blocks: this rank's share of each one's experts
        moe = [m for m in engine.module.modules() if type(m).__name__ == "AutoEPMoELayer"]
        said = (f"AutoEP: {len(moe)} MoE layer(s) split; expert rank {moe[0].ep_rank} holds {moe[0].num_local_experts} "
                f"of each one's {moe[0].num_experts} experts") if moe else "AutoEP: no MoE layer split"
        rank_log.info(said)
        say(f"{dims.describe()}; {said}")
    if model.tiled or model.whole:
        say(f"MLP in tiles of {cfg.train.mlp_tile_positions} positions (train.mlp_tile_positions): "
            f"{', '.join(model.tiled) or 'none'}"
            + (f"; left whole: {', '.join(model.whole)}" if model.whole else ""))
    lora = cfg.model.lora
    say(f"lr {checked.lr:.3g} (optim.lr {cfg.optim.lr:g}, scaling {cfg.optim.lr_scaling}); dtype {checked.dtype}; "
        f"ZeRO stage {engine.zero_optimization_stage()}; {n_params / 1e6:.2f}M parameters"
        + (f", {model.trainable / 1e6:.3g}M of them trained (LoRA rank {lora.rank}: the adapters"
           + (f" and {', '.join(lora.modules_to_save)}" if lora.modules_to_save else "")
           + "; the base frozen)" if model.trainable is not None else ""))
    say(host_table(hosts) + ("; output_dir node-local (each node holds its own ranks' checkpoint files)"
                             if agreed.storage == NODE_LOCAL else ""))


def _describe_run(cfg: RunConfig, env: DistEnv, paths: RunPaths, ds_config: dict, source: ModelSource,
                  hosts: list, dtype: str, spec: RunSpec, dims: ParallelDims, storage: str, say, start: int) -> None:
    """config.yaml, ds_config.json, env.json, hf_model/; metrics.jsonl cut back to `start` (rank 0)."""
    if not env.is_main:
        return
    try:
        save_config(cfg, paths.config)
        write_atomic(paths.ds_config, json.dumps(ds_config, indent=2))
        write_atomic(paths.env, json.dumps(env_record(env, hosts, dtype, spec.kind.name, dims.record(), storage),
                                           indent=2))
        save_hf_metadata(source.hf_config, source.tokenizer, paths.hf_model)
        # A resumed run's metrics continue from the checkpoint; a fresh run's start afresh.
        damaged = rewind_jsonl(paths.metrics, start)
    except OSError as e:
        raise UserError(f"output_dir: writing {e.filename or paths.root} failed ({e.strerror or e}); free "
                        f"space or choose another output_dir") from None
    if damaged:
        say(f"metrics.jsonl: dropped {damaged} line(s) that do not parse (a write cut short, or damage); "
            f"kept every other record")



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
