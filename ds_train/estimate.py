"""Know before launch, without an accelerator: `ds-train estimate`.

    ds-train estimate --config recipes/quickstart.yaml --ds-config ds_configs/zero2.json \
        --nodes 2 --gpus-per-node 8 --gpu-memory 80

The arithmetic of ds_train/plan/memory.py for the target world size, with the run's own layout check at that
world: the per-GPU peak of the given layout and its neighbours, what a node can give to rollout ranks, the
cheapest changes that fit. `ds-train dry-run` (ds_train/dryrun.py) measures what this predicts.
"""

from __future__ import annotations

from ds_train.config import RunConfig
from ds_train.dsconfig import read_ds_template
from ds_train.errors import UserError
from ds_train.inputs import plan_config
from ds_train.model.build import resolve_dtype
from ds_train.model.lora import check_lora
from ds_train.plan.memory import GiB, ModelShape, model_shape, scoring_bytes
from ds_train.plan.parallel import Layout, check_layout
from ds_train.plan.planner import (USABLE, Target, engine_bytes, engine_weights_bytes, format_rows, format_suggestions,
                                   fused_kernels, pick_preset, plan_rows, rank_seq_len, resolved_zero, rollout_split,
                                   suggestions, trainers)


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
    return estimate_with_layout(cfg, ds_config_path, target, preset)[0]


def estimate_with_layout(cfg: RunConfig, ds_config_path: str, target: Target, preset: str | None) -> tuple[dict, Layout]:
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
    scoring = scoring_plan(cfg, shape, dtype, given, target)
    if scoring:
        out["scoring"] = scoring
    if not given["fits"]:
        out["suggestions"] = suggestions(shape, cfg, zero, target, dtype)
    if preset:
        out["preset"] = pick_preset(shape, cfg, target, dtype, preset)
    return out, layout


def scoring_plan(cfg: RunConfig, shape: ModelShape, dtype: str, given: dict, target: Target) -> dict | None:
    """Rank 0's lm-eval scoring inside the run (the benchmarks section; None where it scores nothing in the run):
    the scored copy on its GPU beside what the engine holds between steps (the activations are freed by then), and
    2x the model in its host memory (plan/memory.py scoring_bytes). It fits where that peak is within the usable
    share of a GPU, as the training rows do."""
    b = cfg.benchmarks
    if not b.tasks or not (b.every or b.at_start or b.at_end):
        return None
    need = scoring_bytes(shape.n_params, dtype, on_gpu=True)
    peak = given["model_states_gib"] + given["buffers_gib"] + need.device / GiB
    return {"device_gib": need.device / GiB, "host_gib": need.host / GiB, "rank0_peak_gib": peak,
            "fits": peak <= USABLE * target.gpu_memory_gib}


def scoring_said(s: dict, target: Target) -> str:
    verdict = ("fits" if s["fits"] else
               f"DOES NOT FIT {USABLE * target.gpu_memory_gib:.1f} GiB: leave benchmarks.tasks out of the run and "
               f"score a checkpoint after it (ds-train eval RUN_DIR --tag step_N --tasks ...)")
    return (f"benchmarks: rank 0 scores a whole copy of the model ({s['device_gib']:.2f} GiB on its GPU beside its "
            f"shards: peak {s['rank0_peak_gib']:.2f} GiB; {s['host_gib']:.2f} GiB of host memory, 2x the model) -> "
            f"{verdict}")


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
    if out.get("scoring"):
        lines.append(scoring_said(out["scoring"], target))
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
            + ("fits" if given["fits"] else "DOES NOT FIT (the changes above, cheapest first)")
            + ("; rank 0's in-run scoring DOES NOT FIT (the benchmarks line above)"
               if not out.get("scoring", {"fits": True})["fits"] else ""))
