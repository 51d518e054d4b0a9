"""Builds the Hugging Face causal LM (from a local directory or from an architecture). No distributed code.

Under ZeRO-3 a live `HfDeepSpeedConfig` makes transformers construct the model inside
`deepspeed.zero.Init`, so no rank ever holds the whole model (USERS.md trap 6: CPU OOM at load).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ds_train.config import ModelConfig
from ds_train.errors import UserError


def resolve_dtype(choice: str, device_type: str, bf16_supported: bool) -> str:
    """auto -> bf16 on a GPU that supports it, else fp32 (bf16 matmuls are slow on most CPUs)."""
    if choice != "auto":
        return choice
    return "bf16" if device_type == "cuda" and bf16_supported else "fp32"


def build_hf_config(model_cfg: ModelConfig, vocab_size: int, seq_len: int):
    """The transformers config, with vocab_size taken from the tokenizer unless set explicitly."""
    from transformers import AutoConfig

    if model_cfg.path:
        try:
            hf = AutoConfig.from_pretrained(model_cfg.path)
        except (OSError, ValueError) as e:
            raise UserError(f"model.path: cannot read a config from {model_cfg.path!r}: "
                            f"{str(e).splitlines()[0]}") from None
    else:
        kwargs = dict(model_cfg.config)
        model_type = kwargs.pop("model_type")
        kwargs.setdefault("vocab_size", vocab_size)
        try:
            hf = AutoConfig.for_model(model_type, **kwargs)
        except (ValueError, KeyError, TypeError) as e:
            raise UserError(f"model.config: {str(e).splitlines()[0]}") from None
    max_pos = getattr(hf, "max_position_embeddings", None)
    if max_pos is not None and seq_len > max_pos:
        raise UserError(f"train.seq_len={seq_len} exceeds the model's max_position_embeddings="
                        f"{max_pos}; lower train.seq_len or raise model.config.max_position_embeddings")
    return hf


@dataclass
class BuiltModel:
    model: Any
    hf_config: Any
    ds_hf_config: Any  # keeps HfDeepSpeedConfig alive while the engine is built (ZeRO-3)


def seeded_init(model, seed: int, zero3: bool) -> None:
    """Re-initialise each module with the model's own `_init_weights`, seeded by the module's name.

    The weights then depend on the seed alone, not on how construction consumed the RNG, so ZeRO-3
    (built inside zero.Init) starts from the same weights as ZeRO 0-2 and any world size.
    """
    import zlib
    from contextlib import nullcontext

    import deepspeed
    import torch

    for name, module in model.named_modules():
        params = list(module.parameters(recurse=False))
        if not params:
            continue
        gather = deepspeed.zero.GatheredParameters(params, modifier_rank=0) if zero3 else nullcontext()
        with gather, torch.no_grad():
            torch.manual_seed(seed + zlib.crc32(name.encode()))
            model._init_weights(module)


def build_model(model_cfg: ModelConfig, hf_config, ds_config: dict, seed: int = 0) -> BuiltModel:
    """Construct (ZeRO-3: partitioned) the model in fp32; the engine casts to bf16/fp16."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    keep_alive = None
    zero3 = ds_config.get("zero_optimization", {}).get("stage", 0) == 3
    if zero3:
        keep_alive = HfDeepSpeedConfig(ds_config)
    kwargs = dict(attn_implementation=model_cfg.attn_implementation, dtype=torch.float32)
    if model_cfg.path:
        model = AutoModelForCausalLM.from_pretrained(model_cfg.path, config=hf_config, **kwargs)
    else:
        model = AutoModelForCausalLM.from_config(hf_config, **kwargs)
        seeded_init(model, seed, zero3)
    if model_cfg.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return BuiltModel(model, hf_config, keep_alive)


def count_params(model) -> int:
    """Parameter count, also when ZeRO-3 has partitioned the tensors away (ds_numel)."""
    return sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())


def flops_per_token(n_params: int, n_layers: int, hidden: int, seq_len: int) -> float:
    """Training FLOPs per token: 6N for the matmuls plus 12 L h s for attention (PaLM, App. B)."""
    return 6 * n_params + 12 * n_layers * hidden * seq_len
