"""The reference model: the starting model, frozen, for RIPT's KL term (ript.kl_coef > 0) and for
preference training (DPO), live or as log-probs precomputed once.

Built once per run, never saved (it is the model at model.path, which the checkpoint fingerprints):
a second DeepSpeed engine without an optimizer, in the run's precision, partitioned over the ranks
under ZeRO-3 as the policy is (DeepSpeed-Chat's and OpenRLHF's reference models), so no rank ever
holds it whole; under LoRA no copy at all: the policy with its adapters turned off is the base.
RIPT computes its log-probs once per rollout batch, in the micro-batches the update uses, the same
number of forwards on every rank (ZeRO-3 gathers each layer's parameters in a collective).

Preference training with dpo.reference=precomputed (TRL's precompute_ref_log_probs) runs one pass
over every pair before the first step, with the policy itself (it is still the starting model;
under LoRA with its adapters off), and stores each sequence's summed log-prob in
data.dir/reference/<key>.npz, the key a hash of the starting weights, the prepared data, seq_len
and the precision: a run that finds it (a resume, another run of the same model and data) reads
it; a resume that does not (a node with its own disk) computes it with a frozen copy of the
starting weights, never with the trained ones.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from dataclasses import dataclass, replace
from importlib.metadata import version
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ds_train import dist
from ds_train.config.model import ModelConfig
from ds_train.data.datasets import Datasets
from ds_train.data.meta import read_meta_json
from ds_train.data.pairs import PairBatch
from ds_train.engine import initialize
from ds_train.fs import replacing, write_atomic
from ds_train.model.build import INIT_SCHEME, build_model
from ds_train.model.lora import enabled as lora_enabled
from ds_train.model.weights import fingerprint, weight_files
from ds_train.plan.memory import parameter_bytes_beside
from ds_train.run import Run
from ds_train.train.preference import sequence_logps


class Reference:
    """log pi_ref of the tokens of a batch (no gradient)."""

    def __init__(self, module, adapters_off: bool, describe: str):
        self.module, self.adapters_off, self.describe = module, adapters_off, describe

    def _logits(self, inputs):
        import torch

        off = self.module.disable_adapter() if self.adapters_off else contextlib.nullcontext()
        with torch.no_grad(), off:
            return self.module(input_ids=inputs, use_cache=False).logits.float()

    def token_logp(self, ids, temperature: float = 1.0):
        """The reference's log-prob of each token after its prefix, at the policy's sampling temperature (ript)."""
        import torch

        logits = self._logits(ids[:, :-1])
        if temperature > 0 and temperature != 1.0:
            logits = logits / temperature
        return torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)

    def sequence_logps(self, batch: PairBatch):
        """Each row's summed log-prob of its target tokens (a preference micro-batch)."""
        import torch

        device = next(self.module.parameters()).device
        logits = self._logits(torch.from_numpy(batch.inputs).to(device))
        return sequence_logps(logits, torch.from_numpy(batch.targets).to(device))[0]


def reference_ds_config(ds_config: dict) -> dict:
    """The run's DeepSpeed config for an engine that only runs forwards: its batch and precision,
    ZeRO-3 (parameter partitioning, its bucket settings) or nothing, no optimizer or scheduler."""
    zero = ds_config.get("zero_optimization", {})
    keep = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "bf16", "fp16",
            "steps_per_print", "wall_clock_breakdown")
    out: dict[str, Any] = {k: ds_config[k] for k in keep if k in ds_config}
    if int(zero.get("stage", 0)) == 3:
        out["zero_optimization"] = {k: v for k, v in zero.items() if k.startswith("stage3_") or k in (
            "stage", "reduce_bucket_size", "offload_param")}
    else:
        out["zero_optimization"] = {"stage": 0}
    return out


@dataclass(frozen=True)
class ReferenceSpec:
    """What the reference depends on in a run's config: the model section, the seed a from-scratch
    model was built with, the prepared data and how its sequences are cut, and dpo.reference."""
    model: ModelConfig
    seed: int
    data_dir: str
    seq_len: int
    overlong: str
    mode: str  # dpo.reference: live | precomputed

    @classmethod
    def of(cls, cfg) -> ReferenceSpec:
        return cls(cfg.model, cfg.seed, cfg.data.dir, cfg.train.seq_len, cfg.data.overlong, cfg.dpo.reference)


def build_reference(run: Run, spec: ReferenceSpec, weights) -> Reference:
    """The frozen reference of a run; `weights`: the directory the policy's starting weights were
    loaded from (None: built from model.config with the run's seed, as the policy was)."""
    if lora_enabled(spec.model.lora):
        return Reference(run.engine.module, True, "the base model (the policy with its LoRA adapters off)")
    config = reference_ds_config(run.ds_config)
    model_cfg = replace(spec.model, path=str(weights or ""), activation_checkpointing=False, compile=False)
    built = build_model(model_cfg, run.engine.module.config, config, spec.seed)
    for p in built.model.parameters():
        p.requires_grad_(False)
    engine = initialize(built.model, config)
    engine.eval()
    zero3 = config["zero_optimization"]["stage"] == 3
    return Reference(engine, False, f"a frozen copy of {spec.model.path or 'the starting model'}"
                     + (f", partitioned over {run.env.world_size} ranks (ZeRO-3)" if zero3 else ""))


def report_reference(run: Run, reference: Reference | None) -> None:
    """Where the reference lives, and (each rank's log) what the parameters beyond the policy's hold
    on the rank: measured over every live module of the process, not taken from the reference (one
    built but unused, or built twice, shows)."""
    held = parameter_bytes_beside(run.engine)
    run.rank_log.info(f"reference policy: {reference.describe if reference else 'none'}; parameters beyond the "
                      f"policy's hold {held:,} bytes on this rank (every live module's, measured)")
    run.say(f"reference policy: {reference.describe}; {held / 2**20:.1f} MiB of parameters on rank 0"
            if reference else "reference policy: none (ript.kl_coef 0: no reference model is built)")


def policy_as_reference(run: Run, spec: ReferenceSpec) -> Reference:
    """The policy before its first update (under LoRA with its adapters off): the reference itself."""
    return Reference(run.engine.module, lora_enabled(spec.model.lora), "the policy before its first step")


def reference_key(run: Run, spec: ReferenceSpec) -> dict:
    """What the precomputed log-probs depend on: the starting weights, the prepared data (its
    tokenizer included), how sequences are cut, the precision and the attention."""
    weights = fingerprint(weight_files(run.weights)) if run.weights else {
        "config": spec.model.config, "seed": spec.seed, "init": INIT_SCHEME,  # from scratch: the model's own init
        "transformers": version("transformers")}
    meta = read_meta_json(Path(spec.data_dir))
    return {"weights": weights, "data": {"fingerprint": meta.get("fingerprint"), "scan": meta.get("scan")},
            "seq_len": spec.seq_len, "overlong": spec.overlong, "dtype": run.dtype,
            "attn_implementation": spec.model.attn_implementation}


def _digest(key: dict) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]


class Precomputed:
    """The reference's summed log-prob of every sequence of both splits, looked up per batch."""

    def __init__(self, logps: dict[str, np.ndarray], path: Path):
        self.logps, self.path = logps, path

    def lookup(self, split: str):
        """reference_logps(batch) for the pairs of `split`."""
        import torch

        def logps(batch: PairBatch):
            rows = np.concatenate([2 * batch.pairs, 2 * batch.pairs + 1])
            return torch.from_numpy(self.logps[split][rows])
        return logps


def precompute(run: Run, spec: ReferenceSpec, data: Datasets, start: int) -> Precomputed:
    """The reference log-probs of data.dir's pairs: read from data.dir/reference/ when this model,
    data and settings made them, else computed in one pass (split over the data-parallel ranks, the
    same number of forwards on each) and written there (local rank 0 of each node)."""
    key = reference_key(run, spec)
    path = Path(spec.data_dir) / "reference" / f"{_digest(key)}.npz"
    logps = _read(path, data)
    if dist.all_reduce_sum([logps is not None])[0] == run.env.world_size:  # every rank can read it
        run.say(f"reference log-probs: read from {path}")
        return Precomputed(logps, path)
    # Before the first update the policy is the reference; a resumed run builds a frozen copy.
    reference = policy_as_reference(run, spec) if start == 0 else build_reference(run, spec, run.weights)
    run.say(f"reference log-probs: computing them for every pair with {reference.describe} (one pass; "
            f"dpo.reference=precomputed)")
    logps = {split: _one_pass(run, getattr(data, split), reference, start) for split in ("train", "val")}
    del reference
    if run.env.local_rank == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        with replacing(path) as tmp:
            with open(tmp, "wb") as f:
                np.savez(f, **logps)
        write_atomic(path.with_suffix(".json"), json.dumps(key, indent=2, default=str))
    dist.barrier()
    run.say(f"reference log-probs: {sum(len(v) for v in logps.values()) // 2:,} pairs in {path}")
    return Precomputed(logps, path)


def _read(path: Path, data: Datasets) -> dict[str, np.ndarray] | None:
    """The stored log-probs, if whole and of this data's pairs."""
    try:
        with np.load(path) as f:
            logps = {split: f[split] for split in ("train", "val")}
    except (OSError, ValueError, KeyError):
        return None
    return logps if all(len(logps[s]) == 2 * getattr(data, s).pairs_total for s in logps) else None


def _one_pass(run: Run, split, reference: Reference, step: int) -> np.ndarray:
    """Every kept pair's two summed log-probs (NaN for a pair left out), each data rank computing
    every dims.data-th micro-batch and the ranks gathering them."""
    micro, ranks = run.plan.micro_batch_size, run.dims.data
    batches = [split.kept[i:i + micro] for i in range(0, len(split.kept), micro)]
    mine = batches[run.data_rank::ranks]
    rounds = -(-len(batches) // ranks)  # every rank the same number of forwards (ZeRO-3 gathers in each)
    was_training = run.engine.training
    run.engine.eval()
    out: list[tuple[list[int], list[float]]] = []
    for i in range(rounds):
        run.beat(step, "reference")
        pairs = mine[i] if i < len(mine) else batches[0]
        batch = split.samples_of(pairs)
        logps = reference.sequence_logps(batch).double().cpu().numpy()
        if i < len(mine):
            out.append((pairs.tolist(), logps.tolist()))
    run.engine.train(was_training)
    result = np.full(2 * split.pairs_total, np.nan)
    for part in dist.all_gather_object(out):
        for pairs, logps in part:
            rows = np.concatenate([2 * np.asarray(pairs), 2 * np.asarray(pairs) + 1])
            result[rows] = logps
    return result


@dataclass(frozen=True)
class PairReference:
    """The reference of a preference run: reference_logps(batch) for train and for val batches."""
    train: Callable
    val: Callable


def preference_reference(run: Run, spec: ReferenceSpec, data: Datasets, start: int) -> PairReference:
    """dpo.reference: a live frozen copy (LoRA: the base), or the log-probs precomputed once."""
    if spec.mode == "live":
        reference = build_reference(run, spec, run.weights)
        report_reference(run, reference)
        return PairReference(reference.sequence_logps, reference.sequence_logps)
    stored = precompute(run, spec, data, start)
    return PairReference(stored.lookup("train"), stored.lookup("val"))
