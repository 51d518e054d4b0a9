"""Know before launch: `ds-train estimate` (no accelerator) and `ds-train dry-run` (one device).

    ds-train estimate --config recipes/quickstart.yaml --ds-config ds_configs/zero2.json \
        --nodes 2 --gpus-per-node 8 --gpu-memory 80
    ds-train dry-run --config recipes/quickstart.yaml --ds-config ds_configs/zero2.json \
        --hostfile hostfile.example

The estimate is the arithmetic of ds_train/memory.py for the target world size; the dry run runs
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

from ds_train.batch import plan_batch, valid_micro_batch_sizes
from ds_train.config import RunConfig
from ds_train.engine import read_ds_template
from ds_train.errors import UserError
from ds_train.memory import GiB, Estimate, ModelShape, estimate, model_shape

PRESETS = {"conservative": 0.5, "balanced": 0.7, "aggressive": 0.9}  # target fraction of GPU memory
STAGE_FILES = {0: "zero0.json", 1: "zero1.json", 2: "zero2.json", 3: "zero3.json"}


@dataclass(frozen=True)
class Target:
    nodes: int
    gpus_per_node: int
    gpu_memory_gib: float

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node


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
    """The model's shape from its config; vocab from model.config, else from the prepared data."""
    from ds_train.data import ensure_prepared, load_tokenizer
    from ds_train.model import build_hf_config

    vocab = cfg.model.config.get("vocab_size")
    if vocab is None and not cfg.model.path:
        d = cfg.data
        if not (Path(d.dir) / "meta.json").is_file() and not d.sources:
            raise UserError(f"model.config.vocab_size is not set and {d.dir!r} is not prepared; "
                            f"set model.config.vocab_size or run `ds-train prepare --config ...`")
        # Prepared on first use, exactly as `train` would (once, under a lock).
        meta = ensure_prepared(d.dir, d.sources, d.tokenizer, d.vocab_size, d.val_fraction, d.text_key)
        vocab = len(load_tokenizer(meta["tokenizer"]))
    hf_config = build_hf_config(cfg.model, vocab or 0, cfg.train.seq_len)
    return model_shape(hf_config), hf_config


def _dtype(cfg: RunConfig, on_gpu: bool) -> str:
    from ds_train.model import resolve_dtype

    # Planning for GPUs: auto means bf16 there, whatever this machine is.
    return resolve_dtype(cfg.model.dtype, "cuda" if on_gpu else "cpu", True)


def plan_rows(shape: ModelShape, cfg: RunConfig, zero: dict, target: Target, dtype: str) -> list[dict]:
    """The given config and ZeRO 0-3 (with and without activation checkpointing) side by side."""
    rows = []
    given = int(zero.get("stage", 0))
    for stage in range(4):
        z = zero if stage == given else {**_stage_defaults(stage, shape), "stage": stage}
        for ckpt in (cfg.model.activation_checkpointing, not cfg.model.activation_checkpointing):
            est = estimate(shape, stage, dtype, target.world, cfg.train.micro_batch_size,
                           cfg.train.seq_len, ckpt, z)
            rows.append(_row(est, ckpt, stage == given and ckpt == cfg.model.activation_checkpointing,
                             target, cfg.train.micro_batch_size, zero_label(z)))
    return rows


def _stage_defaults(stage: int, shape: ModelShape) -> dict:
    """Bucket sizes as the shipped ds_configs resolve them."""
    h = shape.hidden
    if stage == 3:
        return {"reduce_bucket_size": h * h, "stage3_prefetch_bucket_size": int(0.9 * h * h),
                "overlap_comm": True}
    return {"reduce_bucket_size": 2e8, "allgather_bucket_size": 2e8, "overlap_comm": stage == 2}


def zero_label(zero: dict) -> str:
    label = f"ZeRO-{int(zero.get('stage', 0))}"
    if zero.get("offload_optimizer", {}).get("device") in ("cpu", "nvme"):
        label += " +opt offload"
    if zero.get("offload_param", {}).get("device") in ("cpu", "nvme"):
        label += " +param offload"
    return label


def _row(est: Estimate, ckpt: bool, given: bool, target: Target, micro: int, label: str) -> dict:
    s = est.states
    return {"config": label, "activation_checkpointing": ckpt, "micro_batch_size": micro,
            "given": given, "params_gib": s.params / GiB, "grads_gib": s.grads / GiB,
            "optimizer_gib": (s.optimizer + s.step_transient) / GiB,
            "activations_gib": est.activations.peak / GiB, "buffers_gib": est.buffers / GiB,
            "gpu_peak_gib": est.gpu_peak / GiB, "cpu_gib": est.cpu / GiB,
            "fits": est.gpu_peak / GiB <= target.gpu_memory_gib}


def format_rows(rows: list[dict], target: Target) -> str:
    head = (f"per-GPU memory (GiB) for {target.nodes} node(s) x {target.gpus_per_node} GPU(s) = "
            f"world {target.world}, {target.gpu_memory_gib:g} GiB each\n"
            f"  {'config':<28} {'ckpt':>4} {'params':>7} {'grads':>7} {'optim':>7} {'activ':>7} "
            f"{'buffers':>7} {'peak':>7} {'cpu':>6}  fits")
    lines = [head]
    for r in rows:
        mark = "<- given" if r["given"] else ""
        label = f"{r['config']} micro {r['micro_batch_size']}"
        lines.append(f"  {label:<28} "
                     f"{'on' if r['activation_checkpointing'] else 'off':>4} {r['params_gib']:7.2f} "
                     f"{r['grads_gib']:7.2f} {r['optimizer_gib']:7.2f} {r['activations_gib']:7.2f} "
                     f"{r['buffers_gib']:7.2f} {r['gpu_peak_gib']:7.2f} {r['cpu_gib']:6.1f}  "
                     f"{'yes' if r['fits'] else 'NO '} {mark}")
    return "\n".join(lines)


def suggestions(shape: ModelShape, cfg: RunConfig, zero: dict, target: Target, dtype: str) -> list[dict]:
    """Changes that lower the per-GPU peak, cheapest first, each with its predicted peak."""
    stage, micro, ckpt = int(zero.get("stage", 0)), cfg.train.micro_batch_size, cfg.model.activation_checkpointing
    seq = cfg.train.seq_len
    out = []

    def add(change: str, **kw):
        est = estimate(shape, kw.get("stage", stage), dtype, target.world, kw.get("micro", micro),
                       kw.get("seq", seq), kw.get("ckpt", ckpt), kw.get("zero", zero))
        out.append({"change": change, "gpu_peak_gib": est.gpu_peak / GiB,
                    "fits": est.gpu_peak / GiB <= target.gpu_memory_gib})

    per_rank = cfg.train.global_batch_size // target.world if cfg.train.global_batch_size % target.world == 0 else 0
    smaller = [m for m in valid_micro_batch_sizes(per_rank * target.world, target.world) if m < micro] if per_rank else []
    if smaller:
        m = max(smaller)
        add(f"train.micro_batch_size={m} (more accumulation, same global batch)", micro=m)
    if not ckpt:
        add("model.activation_checkpointing=true (about a third more compute)", ckpt=True)
    for s in range(stage + 1, 4):
        add(f"--ds-config ds_configs/{STAGE_FILES[s]}", stage=s, zero={**_stage_defaults(s, shape), "stage": s})
    off = {**_stage_defaults(3, shape), "stage": 3, "offload_optimizer": {"device": "cpu"}}
    add("--ds-config ds_configs/zero3_offload.json optimizer offload (slower steps)", stage=3, zero=off)
    add(f"train.seq_len={seq // 2} (changes what is learned)", seq=seq // 2)
    return out


def pick_preset(shape: ModelShape, cfg: RunConfig, target: Target, dtype: str, preset: str) -> dict:
    """Micro-batch, activation checkpointing and stage within the preset's memory fraction:
    prefer no checkpointing, then the lowest stage, then the largest micro-batch."""
    budget = PRESETS[preset] * target.gpu_memory_gib
    if cfg.train.global_batch_size % target.world:
        raise UserError(f"train.global_batch_size={cfg.train.global_batch_size} is not divisible by the "
                        f"world size {target.world}")
    micros = sorted(valid_micro_batch_sizes(cfg.train.global_batch_size, target.world), reverse=True)
    for ckpt in (False, True):
        for stage in range(4):
            z = {**_stage_defaults(stage, shape), "stage": stage}
            for m in micros:
                est = estimate(shape, stage, dtype, target.world, m, cfg.train.seq_len, ckpt, z)
                if est.gpu_peak / GiB <= budget:
                    return {"preset": preset, "memory_fraction": PRESETS[preset],
                            "micro_batch_size": m, "activation_checkpointing": ckpt, "stage": stage,
                            "gpu_peak_gib": est.gpu_peak / GiB,
                            "overrides": f"train.micro_batch_size={m} model.activation_checkpointing="
                                         f"{str(ckpt).lower()}", "ds_config": f"ds_configs/{STAGE_FILES[stage]}"}
    raise UserError(f"preset {preset}: nothing fits in {budget:.1f} GiB per GPU, even ZeRO-3 with "
                    f"micro-batch 1 and activation checkpointing; use offload or more GPUs")


def run_estimate(cfg: RunConfig, ds_config_path: str, target: Target, preset: str | None) -> dict:
    template = read_ds_template(ds_config_path)
    plan_batch(cfg.train.global_batch_size, cfg.train.micro_batch_size, target.world, cfg.train.seq_len)
    shape, _ = resolve_shape(cfg)
    dtype = _dtype(cfg, on_gpu=True)
    zero = _resolved_zero(template, shape)
    rows = plan_rows(shape, cfg, zero, target, dtype)
    out = {"target": {"nodes": target.nodes, "gpus_per_node": target.gpus_per_node, "world": target.world,
                      "gpu_memory_gib": target.gpu_memory_gib},
           "model": {"params": shape.n_params, "layers": shape.n_layers, "hidden": shape.hidden},
           "dtype": dtype, "rows": rows}
    given = next(r for r in rows if r["given"])
    if not given["fits"]:
        out["suggestions"] = suggestions(shape, cfg, zero, target, dtype)
    if preset:
        out["preset"] = pick_preset(shape, cfg, target, dtype, preset)
    return out


def _resolved_zero(template: dict, shape: ModelShape) -> dict:
    zero = dict(template.get("zero_optimization", {"stage": 0}))
    for key, value in _stage_defaults(int(zero.get("stage", 0)), shape).items():
        if zero.get(key, "auto") == "auto":
            zero[key] = value
    return zero


def format_estimate(out: dict, target: Target) -> str:
    m = out["model"]
    lines = [f"model: {m['params'] / 1e6:,.1f}M parameters, {m['layers']} layers, hidden {m['hidden']}; "
             f"dtype {out['dtype']}", format_rows(out["rows"], target)]
    if out.get("suggestions"):
        lines.append("does not fit; changes ranked by cost, with the predicted per-GPU peak:")
        lines += [f"  {s['gpu_peak_gib']:7.2f} GiB {'fits' if s['fits'] else '    '}  {s['change']}"
                  for s in out["suggestions"]]
    if out.get("preset"):
        p = out["preset"]
        lines.append(f"preset {p['preset']} (<= {p['memory_fraction']:.0%} of GPU memory): "
                     f"--ds-config {p['ds_config']} {p['overrides']}  ({p['gpu_peak_gib']:.2f} GiB)")
    return "\n".join(lines)


def dry_run(cfg: RunConfig, ds_config_path: str, target: Target, steps: int = 3, warmup: int = 1) -> dict:
    """Real steps of one rank's share of the target global batch on this device, projected."""
    import torch

    from ds_train import checkpoint, dist
    from ds_train.data import rank_micro_batches
    from ds_train.metrics import PEAK_TFLOPS, memory_gib, peak_flops
    from ds_train.model import count_params
    from ds_train.trainer import build_run, forward_loss, train_step

    plan = plan_batch(cfg.train.global_batch_size, cfg.train.micro_batch_size, target.world, cfg.train.seq_len)
    estimate_out = run_estimate(cfg, ds_config_path, target, None)
    work = tempfile.mkdtemp(prefix="ds_train_dry_run_")
    try:
        # One rank's work: micro x accumulation sequences per step, on this one device.
        local = replace(cfg, output_dir=work,
                        train=replace(cfg.train, global_batch_size=plan.sequences_per_rank,
                                      max_steps=warmup + steps, eval_every=0),
                        checkpoint=replace(cfg.checkpoint, resume="none", save_final=False, every=0,
                                           export_final=False),
                        log=replace(cfg.log, wandb="off", progress=False, sample_prompt=""))
        run = build_run(local, ds_config_path, dist.detect_env(), quiet=True)
        engine = run.engine
        on_gpu = engine.device.type == "cuda"
        if on_gpu:
            torch.cuda.reset_peak_memory_stats()
        rss_before = memory_gib("cpu")[1]
        times = []
        for step in range(warmup + steps):
            t0 = time.perf_counter()
            train_step(engine, rank_micro_batches(run.train_data, step, plan.sequences_per_rank,
                                                  plan.micro_batch_size, 0, 1))
            if on_gpu:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        step_s = sorted(times[warmup:])[len(times[warmup:]) // 2]
        gpu_gib, rss_gib = memory_gib(engine.device.type)
        measured_peak = gpu_gib if on_gpu else max(rss_gib - rss_before, 0.0)
        round_trip = _checkpoint_round_trip(run, forward_loss, checkpoint, Path(work))
        n_params = count_params(engine.module)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    given = next(r for r in estimate_out["rows"] if r["given"])
    tokens_per_rank_step = plan.sequences_per_rank * plan.seq_len
    tokens_per_s_gpu = tokens_per_rank_step / step_s
    device_name = torch.cuda.get_device_name() if on_gpu else "cpu"
    peak = peak_flops(device_name, cfg.log.peak_tflops) if on_gpu else None
    from ds_train.model import flops_per_token

    fpt = flops_per_token(n_params, estimate_out["model"]["layers"], estimate_out["model"]["hidden"],
                          cfg.train.seq_len)
    result = {
        **estimate_out,
        "batch": {"global_batch_size": plan.global_batch_size, "micro_batch_size": plan.micro_batch_size,
                  "grad_accum_steps": plan.grad_accum_steps, "world_size": plan.world_size,
                  "tokens_per_step": plan.tokens_per_step},
        "measured": {"device": device_name, "step_time_s": step_s, "step_times_s": times,
                     "peak_memory_gib": measured_peak,
                     "peak_memory_kind": "torch.cuda.max_memory_allocated" if on_gpu else "process RSS growth"},
        "predicted": {"per_gpu_peak_gib": given["gpu_peak_gib"], "gpu_memory_gib": target.gpu_memory_gib,
                      "fits": given["fits"], "headroom_gib": target.gpu_memory_gib - given["gpu_peak_gib"],
                      "tokens_per_s_per_gpu": tokens_per_s_gpu,
                      "tokens_per_s_cluster": tokens_per_s_gpu * target.world,
                      "mfu": tokens_per_s_gpu * fpt / peak if peak else None,
                      "time_to_finish_s": step_s * cfg.train.max_steps,
                      "checkpoint_gib": round_trip["bytes"] / GiB},
        "checkpoint_round_trip": round_trip,
        "notes": ["step time is one rank's compute; communication across the cluster is not included",
                  "MFU needs a GPU peak (table: " + ", ".join(PEAK_TFLOPS) + "; or log.peak_tflops)"],
    }
    return result


def _checkpoint_round_trip(run, forward_loss, checkpoint, work: Path) -> dict:
    """Save, load back, and compare the loss on a fixed batch: the checkpoint path works."""
    import torch

    from ds_train.data import eval_micro_batches

    batch = eval_micro_batches(run.val_data, 1, run.plan.micro_batch_size, 0, 1)[0]
    engine = run.engine
    engine.eval()
    with torch.no_grad():
        before = float(forward_loss(engine, batch)[0])
    t0 = time.perf_counter()
    state = {"step": 0, "samples": 0, "tokens": 0, "zero_stage": 0, "dtype": run.dtype,
             "config": run.cfg.to_dict()}
    tag = checkpoint.save(engine, work / "checkpoints", 1, state, 0, 1, keep=0)
    size = sum(p.stat().st_size for p in (work / "checkpoints" / tag).rglob("*") if p.is_file())
    with torch.no_grad():
        for p in engine.module.parameters():
            t = getattr(p, "ds_tensor", p)
            t.data.add_(1.0)  # disturb the weights, so the load has to restore them
    engine.load_checkpoint(str(work / "checkpoints"), tag=tag)
    with torch.no_grad():
        after = float(forward_loss(engine, batch)[0])
    engine.train()
    ok = math.isclose(before, after, rel_tol=1e-5)
    return {"ok": ok, "seconds": time.perf_counter() - t0, "bytes": size, "loss_before": before,
            "loss_after": after}


def oom_report(cfg: RunConfig, ds_config: dict, hf_config, world: int, gpu_memory_gib: float) -> str:
    """What to change after a real out-of-memory: the estimate for this run and the ranked fixes."""
    shape = model_shape(hf_config)
    target = Target(1, world, gpu_memory_gib)
    dtype = "bf16" if ds_config.get("bf16", {}).get("enabled") else \
        "fp16" if ds_config.get("fp16", {}).get("enabled") else "fp32"
    zero = ds_config.get("zero_optimization", {"stage": 0})
    rows = [r for r in plan_rows(shape, cfg, zero, target, dtype) if r["given"]]
    lines = ["out of GPU memory; the plan for this run:", format_rows(rows, target),
             "changes ranked by cost, with the predicted per-GPU peak:"]
    lines += [f"  {s['gpu_peak_gib']:7.2f} GiB {'fits' if s['fits'] else '    '}  {s['change']}"
              for s in suggestions(shape, cfg, zero, target, dtype)]
    return "\n".join(lines)


def format_dry_run(out: dict, target: Target) -> str:
    m, p, b = out["measured"], out["predicted"], out["batch"]
    rt = out["checkpoint_round_trip"]
    mfu = f"{p['mfu']:.1%}" if p["mfu"] is not None else "n/a (no GPU peak)"
    lines = [format_estimate(out, target), "",
             f"batch: global {b['global_batch_size']} = micro {b['micro_batch_size']} x accum "
             f"{b['grad_accum_steps']} x world {b['world_size']}; {b['tokens_per_step']:,} tokens/step",
             f"measured on {m['device']}: {m['step_time_s']:.3f} s per step (one rank's share), "
             f"peak {m['peak_memory_gib']:.2f} GiB ({m['peak_memory_kind']})",
             f"predicted per GPU: peak {p['per_gpu_peak_gib']:.2f} of {p['gpu_memory_gib']:g} GiB -> "
             f"{'fits' if p['fits'] else 'DOES NOT FIT'} (headroom {p['headroom_gib']:.2f} GiB)",
             f"throughput: {p['tokens_per_s_per_gpu']:,.0f} tokens/s per GPU, "
             f"{p['tokens_per_s_cluster']:,.0f} tokens/s on {target.world}; MFU {mfu}",
             f"time to finish train.max_steps: {_duration(p['time_to_finish_s'])}; checkpoint "
             f"{p['checkpoint_gib']:.3f} GiB on disk; save/load round trip "
             f"{'ok' if rt['ok'] else 'FAILED'} ({rt['seconds']:.1f} s)"]
    return "\n".join(lines)


def _duration(seconds: float) -> str:
    h, rest = divmod(int(seconds), 3600)
    return f"{h}h {rest // 60:02d}m" if h else f"{rest // 60}m {rest % 60:02d}s"


def write_json(out: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2))
