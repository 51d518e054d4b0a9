"""Know before launch on one device: `ds-train dry-run` (`ds-train estimate`, with no device: ds_train/estimate.py).

    ds-train dry-run --config recipes/quickstart.yaml --ds-config ds_configs/zero2.json \
        --hostfile hostfile.example

The dry run runs real steps of one rank's share of the target global batch on this device, measures step time and
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
from ds_train.estimate import estimate_with_layout, format_estimate
from ds_train.fs import write_atomic
from ds_train.inputs import check_inputs
from ds_train.model.build import count_params, flops_per_token, lookup_params
from ds_train.observe.metrics import PEAK_TFLOPS, memory_gib, peak_flops
from ds_train.plan.memory import GiB
from ds_train.plan.planner import Target
from ds_train.start import build_run
from ds_train.train.loop import run_step, train_spec
from ds_train.train.losses import forward_loss
from ds_train.train.meters import ComputeClock
from ds_train.train.reference import PairReference


def dry_run(cfg: RunConfig, ds_config_path: str, target: Target, steps: int = 3, warmup: int = 1) -> dict:
    """Real steps of one rank's share of the target global batch on this device, projected."""
    estimate_out, layout = estimate_with_layout(cfg, ds_config_path, target, None)
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
