"""The reference policy of a KL term (ript.kl_coef > 0): the starting model, frozen.

Built once per run, never saved (it is the model at model.path, which the checkpoint fingerprints):
a second DeepSpeed engine without an optimizer, in the run's precision, partitioned over the ranks
under ZeRO-3 as the policy is (DeepSpeed-Chat's and OpenRLHF's reference models), so no rank ever
holds it whole; under LoRA no copy at all: the policy with its adapters turned off is the base.
With kl_coef 0 nothing is built. Its log-probs are computed once per rollout batch, in the
micro-batches the update uses, the same number of forwards on every rank (ZeRO-3 gathers each
layer's parameters in a collective).
"""

from __future__ import annotations

import contextlib
from dataclasses import replace
from typing import Any

from ds_train.engine import initialize
from ds_train.model.build import build_model
from ds_train.model.lora import enabled as lora_enabled
from ds_train.run import Run


class Reference:
    """log pi_ref of the tokens of a batch (no gradient)."""

    def __init__(self, module, adapters_off: bool, held_bytes: int, describe: str):
        self.module, self.adapters_off, self.held_bytes, self.describe = module, adapters_off, held_bytes, describe

    def token_logp(self, ids):
        import torch

        off = self.module.disable_adapter() if self.adapters_off else contextlib.nullcontext()
        with torch.no_grad(), off:
            logits = self.module(input_ids=ids[:, :-1], use_cache=False).logits.float()
            return torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)


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


def held_bytes(module) -> int:
    """What the module's parameters take on this rank (ZeRO-3: this rank's partition)."""
    total = 0
    for p in module.parameters():
        t = getattr(p, "ds_tensor", None)
        t = p if t is None else t
        total += t.numel() * t.element_size()
    return total


def build_reference(run: Run, weights) -> Reference | None:
    """The frozen reference of a run with ript.kl_coef > 0 (None otherwise); `weights`: the
    directory the policy's starting weights were loaded from."""
    cfg = run.cfg
    if cfg.ript.kl_coef == 0:
        return None
    if lora_enabled(cfg.model.lora):
        return Reference(run.engine.module, True, 0, "the base model (the policy with its LoRA adapters off)")
    config = reference_ds_config(run.ds_config)
    model_cfg = replace(cfg.model, path=str(weights), activation_checkpointing=False, compile=False)
    built = build_model(model_cfg, run.engine.module.config, config, cfg.seed)
    for p in built.model.parameters():
        p.requires_grad_(False)
    engine = initialize(built.model, config)
    engine.eval()
    held = held_bytes(engine.module)
    zero3 = config["zero_optimization"]["stage"] == 3
    return Reference(engine, False, held, f"a frozen copy of {cfg.model.path}"
                     + (f", partitioned over {run.env.world_size} ranks (ZeRO-3)" if zero3 else ""))


def report_reference(run: Run, reference: Reference | None) -> None:
    """Where the reference lives, and (each rank's log) what its parameters hold on the rank."""
    held = reference.held_bytes if reference else 0
    run.rank_log.info(f"reference policy: {reference.describe if reference else 'none'}; its parameters hold "
                      f"{held:,} bytes on this rank")
    run.say(f"reference policy: {reference.describe}; {held / 2**20:.1f} MiB of parameters on rank 0"
            if reference else "reference policy: none (ript.kl_coef 0: no reference model is built)")
