"""The memory plan of a run for a target cluster: ZeRO 0-3 side by side, ranked fixes, presets,
and the report printed after a real out-of-memory. Pure arithmetic over ds_train/plan/memory.py: no
accelerator, no process group."""

from __future__ import annotations

from dataclasses import dataclass

from ds_train.config import RunConfig
from ds_train.config.model import eager_layers
from ds_train.dsconfig import resolve_zero, shipped_zero
from ds_train.errors import UserError
from ds_train.plan.batch import sample_rows, valid_micro_batch_sizes
from ds_train.plan.memory import GiB, Estimate, ModelShape, estimate, model_shape
from ds_train.plan.parallel import plan_dims

PRESETS = {"conservative": 0.5, "balanced": 0.7, "aggressive": 0.9}  # target fraction of GPU memory
# What a plan may fill of a GPU's memory and still say "fits": the CUDA context, the cuBLAS and NCCL
# workspaces and the caching allocator's fragmentation lie outside the allocated peak it predicts. On
# an H200 a run planned at 138.3 of 139.8 GiB (99%) ran out of memory (BENCHMARKS.md).
USABLE = PRESETS["aggressive"]
STAGE_FILES = {0: "zero0.json", 1: "zero1.json", 2: "zero2.json", 3: "zero3.json"}


@dataclass(frozen=True)
class Target:
    nodes: int
    gpus_per_node: int
    gpu_memory_gib: float

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node


def tiles(cfg: RunConfig) -> tuple[int, int, int, bool, bool, int]:
    """The loss's and the MLP's tile sizes in tokens (train.loss_tile_tokens in tokens,
    train.mlp_tile_positions in positions of a sequence), the AutoTP size that splits the
    layers, whether the loss is fused and whether the layers run fused kernels (model.compile,
    `auto` included: the plan is for GPUs; model.liger_kernels), and the AutoEP size that splits the
    experts: estimate's last arguments. The MLP's tiles save only in the layers whose MLP the run tiles
    (memory.ModelShape.tiled_mlp_layers: none of a mixture of experts' blocks), not in every layer."""
    return (cfg.train.loss_tile_tokens, cfg.train.mlp_tile_positions, cfg.parallel.tensor, cfg.train.fused_loss,
            bool(fused_kernels(cfg)), cfg.parallel.expert)


def fused_kernels(cfg: RunConfig) -> list[str]:
    """What makes the layers keep less (memory.py): compiled layers (model.compile, `auto` included: the
    plan is for GPUs; auto leaves them eager where config.model.eager_layers says, as the run does) and
    Liger's kernels, named as the estimate prints them; [] for eager layers."""
    compiled = cfg.model.compile is True or (cfg.model.compile == "auto" and not eager_layers(cfg))
    return [name for name, on in (("compiled (model.compile)", compiled),
                                  ("Liger's kernels (model.liger_kernels)", cfg.model.liger_kernels)) if on]


def stages(cfg: RunConfig, dtype: str) -> range:
    """The ZeRO stages the run may use: 0-3; under AutoTP 0-2 in fp32, 1-2 in bf16/fp16
    (parallel.check_parallel)."""
    if cfg.parallel.tensor == 1:
        return range(4)
    return range(0 if dtype == "fp32" else 1, 3)


def micro_rows(cfg: RunConfig, micro: int) -> int:
    """The sequences a micro-batch of `micro` samples runs: a preference sample is a pair (two)."""
    return micro * sample_rows(cfg.data.format)


def engine_bytes(cfg: RunConfig, target: Target) -> float:
    """What a colocated vLLM engine (ript.rollout_engine=vllm) takes of each GPU while it generates:
    ript.vllm_gpu_memory_utilization of it, its weights and KV cache within (vLLM's own cap); 0 without one."""
    return cfg.ript.vllm_gpu_memory_utilization * target.gpu_memory_gib * GiB if cfg.ript.rollout_engine == "vllm" \
        else 0.0


def engine_weights_bytes(shape: ModelShape, dtype: str, tensor: int = 1) -> float:
    """vLLM's copy of the policy on each GPU: the whole model over an engine's `tensor` GPUs
    (ript.vllm_tensor_parallel_size; it does not split with ZeRO or AutoTP)."""
    return shape.n_params * (4 if dtype == "fp32" else 2) / tensor


def rank_peak(est: Estimate, engine: float = 0.0) -> float:
    """A rank's peak in bytes: training's (Estimate.gpu_peak), or, with a colocated vLLM engine, the
    rollouts' (the engine awake beside the model states the engine holds between steps) if higher; the
    engine sleeps while the policy trains (level 2: its weights and KV cache freed). The larger of the two,
    never their sum, because the engine wakes as vllm_engine.wake_and_load orders it: the update's cached
    blocks freed first, then the weights, their load, then the KV cache."""
    return max(est.gpu_peak, est.states.held + engine) if engine else est.gpu_peak


def trainers(cfg: RunConfig, target: Target) -> Target:
    """The GPUs that train: all of them, or with rollout ranks (ript.rollout_ranks_per_node) the rest of each node."""
    n = cfg.ript.rollout_ranks_per_node
    if n >= target.gpus_per_node:
        raise UserError(f"ript.rollout_ranks_per_node={n}: a node of {target.gpus_per_node} GPU(s) would have none "
                        f"left to train; set it below {target.gpus_per_node}")
    return Target(target.nodes, target.gpus_per_node - n, target.gpu_memory_gib)


def rollout_rank_bytes(shape: ModelShape, cfg: RunConfig, dtype: str) -> tuple[float, float]:
    """What a rollout rank holds: the policy whole in the run's dtype, and its generate's KV cache for a round of
    rollouts (ript.rollout_contexts x K rows of up to train.seq_len positions)."""
    width = 4 if dtype == "fp32" else 2
    rows = cfg.ript.rollout_contexts * cfg.ript.rloo_batch_size
    return shape.n_params * width, 2 * shape.n_layers * shape.kv_hidden * width * rows * cfg.train.seq_len


def rollout_split(shape: ModelShape, cfg: RunConfig, zero: dict, target: Target, dtype: str) -> dict:
    """How a node's GPUs split between trainer and rollout ranks: the fewest trainers per node on which the given
    layout's update fits (ZeRO over nodes x trainers), so the most GPUs a node can give to rollout ranks, and what
    a rollout rank holds."""
    stage, ckpt = int(zero.get("stage", 0)), cfg.model.activation_checkpointing
    weights, kv = rollout_rank_bytes(shape, cfg, dtype)
    out = {"gpus_per_node": target.gpus_per_node, "trainers_per_node": None, "rollout_max": 0,
           "rollout_weights_gib": weights / GiB, "rollout_kv_gib": kv / GiB,
           "rollout_fits": (weights + kv) / GiB <= USABLE * target.gpu_memory_gib}
    for t in range(1, target.gpus_per_node):
        fewer = Target(target.nodes, t, target.gpu_memory_gib)
        est = estimate(shape, stage, dtype, zero_ranks(cfg, fewer), micro_rows(cfg, cfg.train.micro_batch_size),
                       rank_seq_len(cfg), ckpt, zero, *tiles(cfg))
        if fits(est, fewer):
            return out | {"trainers_per_node": t, "rollout_max": target.gpus_per_node - t,
                          "trainer_peak_gib": est.gpu_peak / GiB}
    return out


def plan_rows(shape: ModelShape, cfg: RunConfig, zero: dict, target: Target, dtype: str) -> list[dict]:
    """The given config and ZeRO 0-3 (with and without activation checkpointing) side by side; the
    other stages as ds_configs/zero<stage>.json renders them."""
    rows, engine = [], engine_bytes(cfg, target)
    given = int(zero.get("stage", 0))
    ranks, seq = zero_ranks(cfg, target), rank_seq_len(cfg)
    for stage in stages(cfg, dtype):
        z = zero if stage == given else stage_zero(f"zero{stage}", shape)
        for ckpt in (cfg.model.activation_checkpointing, not cfg.model.activation_checkpointing):
            est = estimate(shape, stage, dtype, ranks, micro_rows(cfg, cfg.train.micro_batch_size), seq, ckpt, z,
                           *tiles(cfg))
            rows.append(_row(est, ckpt, stage == given and ckpt == cfg.model.activation_checkpointing,
                             target, cfg.train.micro_batch_size, zero_label(z), engine))
    return rows


def data_parallel(cfg: RunConfig, target: Target) -> int:
    """The data-parallel size of the run on the target cluster: what the global batch is split over."""
    return plan_dims(cfg.parallel, target.world).data


def zero_ranks(cfg: RunConfig, target: Target) -> int:
    """What ZeRO partitions over: the data-parallel ranks, times the sequence ranks (DeepSpeed's
    sequence-data-parallel group: Ulysses ranks hold the whole model, as data-parallel ones do)."""
    dims = plan_dims(cfg.parallel, target.world)
    return dims.data * dims.sequence


def rank_seq_len(cfg: RunConfig, seq_len: int | None = None) -> int:
    """Positions of every sequence one rank holds: seq_len / parallel.sequence (the attention alone
    sees the whole sequence, on heads / parallel.sequence heads: the same number of values)."""
    return (cfg.train.seq_len if seq_len is None else seq_len) // cfg.parallel.sequence


def stage_zero(name: str, shape: ModelShape) -> dict:
    """The zero_optimization section of ds_configs/<name>.json as the run would render it."""
    return resolve_zero(shipped_zero(name), shape.hidden)


def resolved_zero(template: dict, shape: ModelShape) -> dict:
    """The template's zero_optimization section as the run renders it (dsconfig.resolve_zero)."""
    return resolve_zero(dict(template.get("zero_optimization", {"stage": 0})), shape.hidden)


def zero_label(zero: dict) -> str:
    label = f"ZeRO-{int(zero.get('stage', 0))}"
    if zero.get("offload_optimizer", {}).get("device") in ("cpu", "nvme"):
        label += " +opt offload"
    if zero.get("offload_param", {}).get("device") in ("cpu", "nvme"):
        label += " +param offload"
    return label


def _row(est: Estimate, ckpt: bool, given: bool, target: Target, micro: int, label: str, engine: float) -> dict:
    s = est.states
    return {"config": label, "activation_checkpointing": ckpt, "micro_batch_size": micro,
            "given": given, "params_gib": s.params / GiB, "grads_gib": (s.grads + s.accumulation) / GiB,
            "optimizer_gib": s.optimizer / GiB,  # the step's fp32 gradient copy comes after the activations are freed
            "model_states_gib": s.held / GiB,  # what the engine holds between steps (tests/test_memory.py)
            "activations_gib": est.activations.peak / GiB, "buffers_gib": est.buffers / GiB,
            "gpu_peak_gib": rank_peak(est, engine) / GiB, "cpu_gib": est.cpu / GiB,
            "fits": fits(est, target, engine)} | ({"rollout_peak_gib": (s.held + engine) / GiB} if engine else {})


def fits(est: Estimate, target: Target, engine: float = 0.0) -> bool:
    return rank_peak(est, engine) / GiB <= USABLE * target.gpu_memory_gib


def format_rows(rows: list[dict], target: Target) -> str:
    head = (f"per-GPU memory (GiB) for {target.nodes} node(s) x {target.gpus_per_node} GPU(s) = "
            f"world {target.world}, {target.gpu_memory_gib:g} GiB each (fits: a peak within {USABLE:.0%}, "
            f"{USABLE * target.gpu_memory_gib:.1f} GiB)\n"
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
    seq, data, sp = cfg.train.seq_len, data_parallel(cfg, target), cfg.parallel.sequence
    out, engine = [], engine_bytes(cfg, target)

    def add(change: str, **kw):
        est = estimate(shape, kw.get("stage", stage), dtype, kw.get("ranks", zero_ranks(cfg, target)),
                       micro_rows(cfg, kw.get("micro", micro)), kw.get("seq", seq) // kw.get("sp", sp),
                       kw.get("ckpt", ckpt), kw.get("zero", zero), *tiles(cfg)[:2], kw.get("tp", cfg.parallel.tensor),
                       *tiles(cfg)[3:5], kw.get("expert", cfg.parallel.expert))
        out.append({"change": change, "gpu_peak_gib": rank_peak(est, engine) / GiB, "fits": fits(est, target, engine)})

    per_rank = cfg.train.global_batch_size // data if cfg.train.global_batch_size % data == 0 else 0
    smaller = [m for m in valid_micro_batch_sizes(per_rank * data, data) if m < micro] if per_rank else []
    for m in sorted(smaller, reverse=True):  # the largest that fits (the fewest accumulation steps), else the smallest
        out.clear()
        add(f"train.micro_batch_size={m} (more accumulation, same global batch)", micro=m)
        if out[0]["fits"]:
            break
    if not ckpt:
        add("model.activation_checkpointing=true (about a third more compute)", ckpt=True)
    ep = max((n for n in range(2, data + 1) if data % n == 0 and shape.routed % n == 0), default=0)
    if shape.experts and sp == cfg.parallel.tensor == 1 and ep > cfg.parallel.expert:
        add(f"parallel.expert={ep} (AutoEP, an all-to-all a layer: each rank holds 1/{ep} of every MoE layer's "
            f"{shape.routed} experts; the data-parallel size stays {data})", expert=ep)
    for s in range(stage + 1, stages(cfg, dtype).stop):
        add(f"--ds-config ds_configs/{STAGE_FILES[s]}", stage=s, zero=stage_zero(f"zero{s}", shape))
    if cfg.parallel.tensor == 1:
        add("--ds-config ds_configs/zero3_offload.json optimizer and parameter offload (slower steps)", stage=3,
            zero=stage_zero("zero3_offload", shape))
    more = 2 * sp  # twice the sequence ranks, out of the data-parallel ones
    tp = cfg.parallel.tensor
    if tp == 1 and data % 2 == 0 and seq % more == 0 and shape.heads and shape.heads % more == 0:
        add(f"parallel.sequence={more} (Ulysses: each rank holds seq_len / {more} positions; the data-parallel "
            f"size halves, to {data // 2})", sp=more)
    if sp == 1 and data % 2 == 0 and shape.tensor_split and shape.heads % (2 * tp) == shape.kv_heads % (2 * tp) == 0:
        ranks = zero_ranks(cfg, target) // 2
        add(f"parallel.tensor={2 * tp} (AutoTP splits each layer across {2 * tp} ranks; the data-parallel size "
            f"halves, to {data // 2}; ZeRO-1 or 2)", tp=2 * tp, ranks=ranks, stage=min(max(stage, 1), 2),
            zero=zero if 0 < stage < 3 else stage_zero("zero2", shape))
    add(f"train.seq_len={seq // 2} (changes what is learned)", seq=seq // 2)
    return out


def format_suggestions(items: list[dict]) -> list[str]:
    return [f"  {s['gpu_peak_gib']:7.2f} GiB {'fits' if s['fits'] else '    '}  {s['change']}" for s in items]


def pick_preset(shape: ModelShape, cfg: RunConfig, target: Target, dtype: str, preset: str) -> dict:
    """Micro-batch, activation checkpointing and stage within the preset's memory fraction:
    prefer no checkpointing, then the lowest stage, then the largest micro-batch."""
    budget = PRESETS[preset] * target.gpu_memory_gib
    data = data_parallel(cfg, target)
    if cfg.train.global_batch_size % data:
        raise UserError(f"train.global_batch_size={cfg.train.global_batch_size} is not divisible by the "
                        f"data-parallel size {data}")
    micros = sorted(valid_micro_batch_sizes(cfg.train.global_batch_size, data), reverse=True)
    engine = engine_bytes(cfg, target)
    for ckpt in (False, True):
        for stage in stages(cfg, dtype):
            z = stage_zero(f"zero{stage}", shape)
            for m in micros:
                est = estimate(shape, stage, dtype, zero_ranks(cfg, target), micro_rows(cfg, m), rank_seq_len(cfg),
                               ckpt, z, *tiles(cfg))
                if rank_peak(est, engine) / GiB <= budget:
                    return {"preset": preset, "memory_fraction": PRESETS[preset],
                            "micro_batch_size": m, "activation_checkpointing": ckpt, "stage": stage,
                            "gpu_peak_gib": rank_peak(est, engine) / GiB,
                            "overrides": f"train.micro_batch_size={m} model.activation_checkpointing="
                                         f"{str(ckpt).lower()}", "ds_config": f"ds_configs/{STAGE_FILES[stage]}"}
    raise UserError(f"preset {preset}: nothing fits in {budget:.1f} GiB per GPU, even ZeRO-3 with "
                    f"micro-batch 1 and activation checkpointing; use offload or more GPUs")


def ds_config_dtype(ds_config: dict) -> str:
    """The training dtype a rendered ds_config asks for."""
    return "bf16" if ds_config.get("bf16", {}).get("enabled") else \
        "fp16" if ds_config.get("fp16", {}).get("enabled") else "fp32"


def oom_report(cfg: RunConfig, ds_config: dict, hf_config, world: int, gpu_memory_gib: float) -> str:
    """What to change after a real out-of-memory of a run on `world` GPUs: the estimate for this run
    and the ranked fixes."""
    shape = model_shape(hf_config, cfg.model.lora)
    target = Target(1, world, gpu_memory_gib)
    dtype = ds_config_dtype(ds_config)
    zero = ds_config.get("zero_optimization", {"stage": 0})
    rows = [r for r in plan_rows(shape, cfg, zero, target, dtype) if r["given"]]
    lines = ["out of GPU memory; the plan for this run:", format_rows(rows, target),
             "changes ranked by cost, with the predicted per-GPU peak:"]
    return "\n".join(lines + format_suggestions(suggestions(shape, cfg, zero, target, dtype)))
