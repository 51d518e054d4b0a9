"""Know before launch: `ds-train estimate` (no accelerator) and `ds-train dry-run` (one device).

    ds-train estimate --config recipes/quickstart.yaml --ds-config ds_configs/zero2.json \
        --nodes 2 --gpus-per-node 8 --gpu-memory 80
    ds-train dry-run --config recipes/quickstart.yaml --ds-config ds_configs/zero2.json \
        --hostfile hostfile.example

The estimate is the arithmetic of ds_train/plan/memory.py for the target world size; the dry run runs
real steps of one rank's share of the target global batch on this device, measures step time and
peak memory, projects them to the cluster, and checks a checkpoint save / load round trip.
"""

from __future__ import annotations

import json
import math
import shutil
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

from ds_train import dist
from ds_train.checkpoint import commit as checkpoint
from ds_train.checkpoint.rundir import RunPaths
from ds_train.config import RunConfig
from ds_train.data.datasets import eval_micro_batches, rank_micro_batches
from ds_train.data.pairs import PreferenceData
from ds_train.dsconfig import read_ds_template
from ds_train.errors import UserError
from ds_train.fs import write_atomic
from ds_train.inputs import check_inputs, plan_config
from ds_train.model.build import count_params, flops_per_token, lookup_params, resolve_dtype
from ds_train.model.lora import check_lora
from ds_train.observe.metrics import PEAK_TFLOPS, memory_gib, peak_flops
from ds_train.plan.memory import GiB, ModelShape, model_shape
from ds_train.plan.parallel import Layout, check_layout
from ds_train.plan.planner import (Target, engine_bytes, engine_weights_bytes, format_rows, format_suggestions,
                                   fused_kernels, pick_preset, plan_rows, rank_seq_len, resolved_zero, rollout_split,
                                   suggestions, trainers)
from ds_train.start import build_run
from ds_train.train.loop import run_step, train_spec
from ds_train.train.losses import forward_loss
from ds_train.train.meters import ComputeClock
from ds_train.train.reference import PairReference

def target_from_args(hostfile: str | None, nodes: int | None, gpus_per_node: int | None,
                     gpu_memory_gib: float | None) -> Target:
    """The cluster: from a hostfile (DeepSpeed format) or --nodes / --gpus-per-node."""
    if hostfile:
        from ds_train.launch.hostfile import read_hostfile

        hosts = read_hostfile(hostfile)
        slots = {h.slots for h in hosts}
        if len(slots) > 1:
            raise UserError(f"{hostfile}: hosts have different slot counts {sorted(slots)}; the "
                            f"planner assumes one GPU model per node count; give --nodes and "
                            f"--gpus-per-node instead")
        nodes, gpus_per_node = len(hosts), slots.pop()
    elif not nodes or not gpus_per_node:
        raise UserError("give the target cluster: --hostfile H, or --nodes N --gpus-per-node G")
    if gpu_memory_gib is None:
        gpu_memory_gib = _this_gpu_memory_gib() or 80.0
    if min(nodes, gpus_per_node) <= 0 or gpu_memory_gib <= 0:
        raise UserError("--nodes, --gpus-per-node and --gpu-memory must be positive")
    return Target(nodes, gpus_per_node, gpu_memory_gib)


def _this_gpu_memory_gib() -> float | None:
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory / GiB
    return None


def resolve_shape(cfg: RunConfig) -> tuple[ModelShape, object]:
    """The model's shape from its config (the vocabulary as ds_train.inputs.plan_config finds it)."""
    hf_config = plan_config(cfg)
    return model_shape(hf_config, cfg.model.lora), hf_config


def _dtype(cfg: RunConfig, on_gpu: bool) -> str:
    # Planning for GPUs: auto means bf16 there, whatever this machine is.
    return resolve_dtype(cfg.model.dtype, "cuda" if on_gpu else "cpu", True)


def run_estimate(cfg: RunConfig, ds_config_path: str, target: Target, preset: str | None) -> dict:
    return _estimate(cfg, ds_config_path, target, preset)[0]


def _estimate(cfg: RunConfig, ds_config_path: str, target: Target, preset: str | None) -> tuple[dict, Layout]:
    """The estimate and the layout it checked (check_layout: the run's own check, at the target's world)."""
    template = read_ds_template(ds_config_path)
    shape, hf_config = resolve_shape(cfg)
    whole, target = target, trainers(cfg, target)  # with rollout ranks, the rest of each node trains
    layout = check_layout(cfg, template, target.world, hf_config)
    dims = layout.dims
    check_lora(cfg.model.lora, hf_config, library=False)  # the plan is for GPUs, not this machine
    dtype = _dtype(cfg, on_gpu=True)
    zero = resolved_zero(template, shape)
    rows = plan_rows(shape, cfg, zero, target, dtype)
    out = {"target": {"nodes": target.nodes, "gpus_per_node": target.gpus_per_node, "world": target.world,
                      "gpu_memory_gib": target.gpu_memory_gib, "parallel": dims.record()},
           "model": {"params": shape.n_params, "layers": shape.n_layers, "hidden": shape.hidden,
                     "rank_params": round(shape.rank_params(dims.tensor)),
                     "trainable": shape.trainable or shape.n_params, "experts": shape.experts},
           "dtype": dtype, "rows": rows, "seq_len": cfg.train.seq_len, "rank_seq_len": rank_seq_len(cfg),
           "kernels": kernels_said(cfg)}
    engine = engine_bytes(cfg, target)
    if engine:
        weights = engine_weights_bytes(shape, dtype, cfg.ript.vllm_tensor_parallel_size)
        out["rollout_engine"] = {"fraction": cfg.ript.vllm_gpu_memory_utilization, "gib": engine / GiB,
                                 "tensor": cfg.ript.vllm_tensor_parallel_size,
                                 "weights_gib": weights / GiB, "kv_cache_gib": (engine - weights) / GiB}
        if weights >= engine:  # vLLM cannot start: no room for a KV cache in its share
            for r in rows:
                r["fits"] = False
    if cfg.ript.rollout_ranks_per_node or engine:  # an RL plan: what a node can give to rollout ranks
        out["rollout_ranks"] = rollout_split(shape, cfg, zero, whole, dtype) | {
            "per_node": cfg.ript.rollout_ranks_per_node}
    given = next(r for r in rows if r["given"])
    if not given["fits"]:
        out["suggestions"] = suggestions(shape, cfg, zero, target, dtype)
    if preset:
        out["preset"] = pick_preset(shape, cfg, target, dtype, preset)
    return out, layout


def kernels_said(cfg: RunConfig) -> str:
    """What the plan takes the layers to run (memory.py: fused kernels keep less of each layer)."""
    fused = fused_kernels(cfg)
    return "; layers " + " with ".join(fused) if fused else "; layers eager"


def format_estimate(out: dict, target: Target) -> str:
    m = out["model"]
    lora = (f"; LoRA trains {m['trainable'] / 1e6:,.2f}M of them (the frozen base: no gradients, no optimizer "
            f"states)") if m.get("trainable", m["params"]) < m["params"] else ""
    lines = [f"model: {m['params'] / 1e6:,.1f}M parameters, {m['layers']} layers, hidden {m['hidden']}; "
             f"dtype {out['dtype']}{out.get('kernels', '')}{lora}", format_rows(out["rows"], target)]
    par = out["target"]["parallel"]
    if par["sequence"] > 1:
        lines.insert(1, f"parallel: data {par['data']} x sequence {par['sequence']} x tensor {par['tensor']}; each "
                        f"rank holds {out['rank_seq_len']:,} of the {out['seq_len']:,} positions of a sequence "
                        f"(activations); ZeRO partitions over data x sequence = {par['data'] * par['sequence']} ranks")
    if par["tensor"] > 1:
        lines.insert(1, f"parallel: data {par['data']} x sequence {par['sequence']} x tensor {par['tensor']}; AutoTP "
                        f"splits the layers: each rank holds {m['rank_params'] / 1e6:,.2f}M of the "
                        f"{m['params'] / 1e6:,.2f}M parameters, ZeRO partitions them over the {par['data']} data ranks")
    if par.get("expert", 1) > 1:
        ep = par["expert"]
        lines.insert(1, f"parallel: data {par['data']}, experts split over {ep} of them (AutoEP): each rank holds "
                        f"1/{ep} of the {m['experts'] / 1e6:,.1f}M expert parameters, whole below ZeRO-3; ZeRO "
                        f"partitions their gradients and optimizer states over the {par['data'] // ep} rank(s) that "
                        f"hold the same ones")
    if out.get("rollout_engine"):
        e = out["rollout_engine"]
        room = (f"KV cache up to {e['kv_cache_gib']:.2f} GiB" if e["kv_cache_gib"] > 0 else
                "no room for a KV cache: raise ript.vllm_gpu_memory_utilization")
        spread = "whole on every rank" if e.get("tensor", 1) == 1 else \
            f"1/{e['tensor']} of them on each GPU of an engine"
        lines.insert(1, f"rollouts: vLLM in each rank's process, {e['fraction']:g} of each GPU = {e['gib']:.2f} GiB "
                        f"(its weights {e['weights_gib']:.2f} GiB, {spread}; {room}); it sleeps while the "
                        f"policy trains: the peak is the larger of the update's and the model states + vLLM's")
    if out.get("rollout_ranks"):
        lines.insert(1, rollout_said(out["rollout_ranks"], out["dtype"]))
    if out.get("suggestions"):
        lines.append("does not fit; changes ranked by cost, with the predicted per-GPU peak:")
        lines += format_suggestions(out["suggestions"])
    if out.get("preset"):
        p = out["preset"]
        lines.append(f"preset {p['preset']} (<= {p['memory_fraction']:.0%} of GPU memory): "
                     f"--ds-config {p['ds_config']} {p['overrides']}  ({p['gpu_peak_gib']:.2f} GiB)")
    return "\n".join(lines)


def rollout_said(r: dict, dtype: str) -> str:
    """Rollout ranks: how a node splits (the plan's rows are the trainers' when ript.rollout_ranks_per_node is set),
    the most GPUs a node can give to generation, and what each holds."""
    holds = (f"each holds the policy whole ({r['rollout_weights_gib']:.2f} GiB in {dtype}) and its generate's KV "
             f"cache for a round of rollouts ({r['rollout_kv_gib']:.2f} GiB): "
             + ("fits" if r["rollout_fits"] else "DOES NOT FIT one GPU"))
    given = (f"ript.rollout_ranks_per_node={r['per_node']}: the rows below are the "
             f"{r['gpus_per_node'] - r['per_node']} trainers of each node (ZeRO partitions over them); "
             if r["per_node"] else "")
    if r["trainers_per_node"] is None:
        return (f"rollout ranks: {given}the update does not fit on fewer than all {r['gpus_per_node']} GPUs of a "
                f"node at this layout: none to spare for rollout ranks; {holds}")
    return (f"rollout ranks: {given}the update fits on {r['trainers_per_node']} GPU(s) of a node "
            f"({r['trainer_peak_gib']:.2f} GiB peak), so a node of {r['gpus_per_node']} can give up to "
            f"{r['rollout_max']} to rollout ranks (ript.rollout_ranks_per_node); {holds}")


def estimate_outcome(out: dict, target: Target) -> str:
    """The estimate's last line: the given layout's per-GPU peak on the target, and whether it fits."""
    given = next(r for r in out["rows"] if r["given"])
    return (f"estimate: {given['config']} micro {given['micro_batch_size']}, checkpointing "
            f"{'on' if given['activation_checkpointing'] else 'off'} (as given): peak {given['gpu_peak_gib']:.2f} of "
            f"{target.gpu_memory_gib:g} GiB per GPU on world {target.world} -> "
            + ("fits" if given["fits"] else "DOES NOT FIT (the changes above, cheapest first)"))


def dry_run(cfg: RunConfig, ds_config_path: str, target: Target, steps: int = 3, warmup: int = 1) -> dict:
    """Real steps of one rank's share of the target global batch on this device, projected."""
    estimate_out, layout = _estimate(cfg, ds_config_path, target, None)
    dims, plan = layout.dims, layout.batch
    work = tempfile.mkdtemp(prefix="ds_train_dry_run_")
    try:
        measured = _measure(_local_config(cfg, work, plan, dims.sequence), ds_config_path, plan, Path(work),
                            steps, warmup)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    projected = _project(cfg, estimate_out, plan, dims, measured)
    return _report(cfg, target, estimate_out, plan, dims, measured, projected)


@dataclass(frozen=True)
class _Measured:
    """What the steps on this device measured."""

    times: list[float]  # every step's seconds, warm-up included
    step_s: float  # the median step after the warm-up
    peak_gib: float  # torch.cuda.max_memory_allocated, or the process RSS growth on a CPU
    on_gpu: bool
    round_trip: dict  # _checkpoint_round_trip
    n_params: int
    lookups: int  # lookup_params: parameters that are looked up, not multiplied


@dataclass(frozen=True)
class _Projection:
    """The measured step projected to a rank of the target layout."""

    step_s: float
    flops_per_token: float
    share: float  # the part of the model's parameters a rank holds (AutoTP splits some layers)
    tokens_per_s_gpu: float


def _local_config(cfg: RunConfig, work: str, plan, sp: int) -> RunConfig:
    """One rank's work (micro x accumulation sequences per step) on this one device, in a scratch
    run directory; the LR schedule is the target's. Under sequence parallelism a rank holds
    seq_len / sp positions of each sequence: run that many, with every head (the same activations as
    the rank's heads / sp over the whole sequence; the attention's extra compute is projected). Under
    AutoTP a rank multiplies its share of the split layers: the whole model runs here, and the step
    time is scaled by that share."""
    return replace(cfg, output_dir=work, parallel=replace(cfg.parallel, sequence=1, tensor=1, expert=1),
                   train=replace(cfg.train, global_batch_size=plan.sequences_per_rank, eval_every=0,
                                 seq_len=cfg.train.seq_len // sp),
                   checkpoint=replace(cfg.checkpoint, resume="none", save_final=False, every=0, export_final=False),
                   log=replace(cfg.log, wandb="off", progress=False, sample_prompt=""))


def _measure(local: RunConfig, ds_config_path: str, plan, work: Path, steps: int, warmup: int) -> _Measured:
    """`warmup` + `steps` real steps of the local run, its peak memory, and a checkpoint round trip."""
    import torch

    inputs = check_inputs(local, ds_config_path)
    data = inputs.data
    with build_run(inputs, dist.detect_env(), train_spec(local), quiet=True) as run:
        engine = run.engine
        # preference pairs: the step of a precomputed reference (log-probs looked up: no model)
        zeros = lambda batch: torch.zeros(len(batch.inputs), dtype=torch.float64)  # noqa: E731
        reference = PairReference(zeros, zeros) if isinstance(data.train, PreferenceData) else None
        on_gpu = engine.device.type == "cuda"
        if on_gpu:
            torch.cuda.reset_peak_memory_stats()
        rss_before = memory_gib("cpu")[1]
        times = []
        for step in range(warmup + steps):
            t0 = time.perf_counter()
            run_step(run, rank_micro_batches(data.train, step, plan.sequences_per_rank, plan.micro_batch_size,
                                             0, 1), step + 1, ComputeClock(False), reference)
            if on_gpu:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        measured_s = sorted(times[warmup:])[len(times[warmup:]) // 2]
        gpu_gib, rss_gib = memory_gib(engine.device.type)
        measured_peak = gpu_gib if on_gpu else max(rss_gib - rss_before, 0.0)
        round_trip = _checkpoint_round_trip(run, data.val, work)
        return _Measured(times, measured_s, measured_peak, on_gpu, round_trip, count_params(engine.module),
                         lookup_params(engine.module.config))


def _project(cfg: RunConfig, estimate_out: dict, plan, dims, m: _Measured) -> _Projection:
    """The step time of a rank of the target: attention over the whole sequence (parallel.sequence),
    its share of the parameters (parallel.tensor); its tokens per second."""
    sp, tp = dims.sequence, dims.tensor
    tokens_per_rank_step = plan.sequences_per_rank * plan.rows * plan.seq_len // sp
    layers, hidden = estimate_out["model"]["layers"], estimate_out["model"]["hidden"]
    fpt = flops_per_token(m.n_params, layers, hidden, cfg.train.seq_len, m.lookups)
    # The rank's tokens attend over the whole sequence, not over the seq_len / sp measured here.
    step_s = m.step_s * fpt / flops_per_token(m.n_params, layers, hidden, cfg.train.seq_len // sp, m.lookups)
    share = estimate_out["model"]["rank_params"] / estimate_out["model"]["params"]
    step_s *= share if tp > 1 else 1
    return _Projection(step_s, fpt, share, tokens_per_rank_step / step_s)


def _notes(cfg: RunConfig, dims, m: _Measured, p: _Projection) -> list[str]:
    """What the projection leaves out, and how it scaled the measured step."""
    sp, tp = dims.sequence, dims.tensor
    notes = ["step time is one rank's compute; communication across the cluster is not included",
             "MFU needs a GPU peak (table: " + ", ".join(PEAK_TFLOPS) + "; or log.peak_tflops)"]
    if sp > 1:
        notes.append(f"parallel.sequence={sp}: ran a rank's {cfg.train.seq_len // sp:,} positions of each sequence "
                     f"with every head ({m.step_s:.3f} s a step); the step time is that scaled by the FLOPs of "
                     f"attending over all {cfg.train.seq_len:,} positions (x{p.step_s / m.step_s:.3f}); Ulysses' "
                     f"all-to-all is communication, not included")
    if tp > 1:
        notes.append(f"parallel.tensor={tp}: ran the whole model here ({m.step_s:.3f} s a step, peak memory "
                     f"included); a rank holds and multiplies {p.share:.0%} of its parameters (the layers AutoTP "
                     f"splits, 1/{tp} of each), so the step time is scaled by that; AutoTP's all-reduces (two a "
                     f"layer, each way) are communication, not included; the memory columns are a rank's share")
    if dims.expert > 1:
        notes.append(f"parallel.expert={dims.expert}: ran every expert here ({m.step_s:.3f} s a step); a rank of the "
                     f"target holds 1/{dims.expert} of each MoE layer's experts (the memory columns are its share) "
                     f"and computes the tokens routed to them; AutoEP's all-to-all is communication, not included")
    return notes


def _report(cfg: RunConfig, target: Target, estimate_out: dict, plan, dims, m: _Measured, p: _Projection) -> dict:
    """dry_run.json: the estimate, the batch, what was measured, what is predicted, the notes."""
    import torch

    given = next(r for r in estimate_out["rows"] if r["given"])
    device_name = torch.cuda.get_device_name() if m.on_gpu else "cpu"
    peak = peak_flops(device_name, cfg.log.peak_tflops) if m.on_gpu else None
    return {
        **estimate_out,
        "batch": {"global_batch_size": plan.global_batch_size, "micro_batch_size": plan.micro_batch_size,
                  "grad_accum_steps": plan.grad_accum_steps, "data_parallel_size": plan.data_parallel_size,
                  "world_size": target.world,
                  "tokens_per_step": plan.tokens_per_step},
        "measured": {"device": device_name, "step_time_s": m.step_s, "step_times_s": m.times,
                     "rank_seq_len": cfg.train.seq_len // dims.sequence,
                     "peak_memory_gib": m.peak_gib,
                     "peak_memory_kind": "torch.cuda.max_memory_allocated" if m.on_gpu else "process RSS growth"},
        "predicted": {"per_gpu_peak_gib": given["gpu_peak_gib"], "gpu_memory_gib": target.gpu_memory_gib,
                      "fits": given["fits"], "headroom_gib": target.gpu_memory_gib - given["gpu_peak_gib"],
                      "step_time_s": p.step_s, "tokens_per_s_per_gpu": p.tokens_per_s_gpu,
                      "tokens_per_s_cluster": p.tokens_per_s_gpu * target.world,
                      "mfu": p.tokens_per_s_gpu * p.flops_per_token / peak if peak else None,
                      "time_to_finish_s": p.step_s * cfg.train.max_steps,
                      "checkpoint_gib": m.round_trip["bytes"] / GiB},
        "checkpoint_round_trip": m.round_trip,
        "notes": _notes(cfg, dims, m, p),
    }


def _checkpoint_round_trip(run, val, work: Path) -> dict:
    """Save, load back, and compare the loss on a fixed batch: the checkpoint path works."""
    import torch

    batch = eval_micro_batches(val, 1, run.plan.micro_batch_size, 0, 1)[0]
    engine = run.engine
    engine.eval()
    with torch.no_grad():
        before = float(forward_loss(engine, batch)[0])
    t0 = time.perf_counter()
    state = {**checkpoint.run_record("train", run.zero_stage, run.dtype, "shared", run.dims.record(),
                                     run.cfg.to_dict(), {}), "step": 0, "samples": 0, "tokens": 0}
    ckpt_dir = RunPaths(work).checkpoints
    tag = checkpoint.save(engine, ckpt_dir, 1, state, 0, 1, keep=0)
    size = sum(p.stat().st_size for p in (ckpt_dir / tag).rglob("*") if p.is_file())
    with torch.no_grad():
        for p in engine.module.parameters():
            if p.requires_grad:  # what a checkpoint holds (a LoRA run's frozen base is not in it)
                t = getattr(p, "ds_tensor", p)
                t.data.add_(1.0)  # disturb the weights, so the load has to restore them
    engine.load_checkpoint(str(ckpt_dir), tag=tag, load_module_strict=not checkpoint.has_frozen(engine))  # LoRA
    with torch.no_grad():
        after = float(forward_loss(engine, batch)[0])
    engine.train()
    ok = math.isclose(before, after, rel_tol=1e-5)
    return {"ok": ok, "seconds": time.perf_counter() - t0, "bytes": size, "loss_before": before,
            "loss_after": after}


def format_dry_run(out: dict, target: Target) -> str:
    m, p, b = out["measured"], out["predicted"], out["batch"]
    rt = out["checkpoint_round_trip"]
    mfu = f"{p['mfu']:.1%}" if p["mfu"] is not None else "n/a (no GPU peak)"
    lines = [format_estimate(out, target), "",
             f"batch: global {b['global_batch_size']} = micro {b['micro_batch_size']} x accum "
             f"{b['grad_accum_steps']} x data-parallel {b['data_parallel_size']} (world {b['world_size']}); "
             f"{b['tokens_per_step']:,} tokens/step",
             f"measured on {m['device']}: {m['step_time_s']:.3f} s per step (one rank's share), "
             f"peak {m['peak_memory_gib']:.2f} GiB ({m['peak_memory_kind']})",
             f"predicted per GPU: peak {p['per_gpu_peak_gib']:.2f} of {p['gpu_memory_gib']:g} GiB -> "
             f"{'fits' if p['fits'] else 'DOES NOT FIT'} (headroom {p['headroom_gib']:.2f} GiB)",
             f"throughput: {p['tokens_per_s_per_gpu']:,.0f} tokens/s per GPU, "
             f"{p['tokens_per_s_cluster']:,.0f} tokens/s on {target.world}; MFU {mfu}",
             f"time to finish train.max_steps: {_duration(p['time_to_finish_s'])}; checkpoint "
             f"{p['checkpoint_gib']:.3f} GiB on disk; save/load round trip "
             f"{'ok' if rt['ok'] else 'FAILED'} ({rt['seconds']:.1f} s)"]
    return "\n".join(lines + [f"note: {n}" for n in out["notes"]])


def dry_run_outcome(out: dict, target: Target, path: Path) -> str:
    """The dry run's last line: whether the job fits, its throughput, the round trip, and where it wrote."""
    p, rt = out["predicted"], out["checkpoint_round_trip"]
    return (f"dry-run: predicted peak {p['per_gpu_peak_gib']:.2f} of {p['gpu_memory_gib']:g} GiB per GPU -> "
            f"{'fits' if p['fits'] else 'DOES NOT FIT'}, {p['tokens_per_s_cluster']:,.0f} tokens/s on world "
            f"{target.world}; checkpoint round trip {'ok' if rt['ok'] else 'FAILED'}; wrote {path}")


def _duration(seconds: float) -> str:
    h, rest = divmod(int(seconds), 3600)
    return f"{h}h {rest // 60:02d}m" if h else f"{rest // 60}m {rest % 60:02d}s"


def write_json(out: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(out, indent=2))
