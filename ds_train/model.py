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
    new_weights: tuple[str, ...] = ()  # initialised, not loaded: missing from model.path (allow_new_weights)


def _some(keys, limit: int = 5) -> str:
    """`a, b, c` or `a, ..., e and 3 more`: enough keys to recognise the problem on one line."""
    keys = sorted(keys)
    shown = ", ".join(keys[:limit])
    return f"{shown} and {len(keys) - limit} more" if len(keys) > limit else shown


def _tensors(n: int) -> str:
    return f"{n} tensor{'' if n == 1 else 's'}"


def check_loading_info(path: str, model_type: str, info: dict, allow_new_weights: bool) -> tuple[str, ...]:
    """The tensors to report as newly initialised, or a UserError when model.path's weights do not fit.

    `info` is what `from_pretrained(..., output_loading_info=True)` returns. Missing tensors are
    initialised at random and unexpected ones dropped, with only a logged warning; here both are
    errors, except missing tensors under model.allow_new_weights (a new head). Tied weights (an
    lm_head sharing the embeddings) are already taken off `missing_keys` by transformers.
    """
    arch = f"the {model_type} architecture" if model_type else "the architecture"
    problems = []
    if info.get("mismatched_keys"):
        shapes = [f"{key} {list(ckpt)} vs {list(model)}" for key, ckpt, model in info["mismatched_keys"]]
        problems.append(f"the weights hold {_tensors(len(shapes))} of other shapes than {arch} needs "
                        f"(saved vs needed: {_some(shapes)}); "
                        f"the weights do not match config.json: fix config.json or the directory "
                        f"(model.allow_new_weights does not cover changed shapes)")
    if info.get("unexpected_keys"):
        unexpected = info["unexpected_keys"]
        problems.append(f"the weights hold {_tensors(len(unexpected))} {arch} does not use "
                        f"({_some(unexpected)}): config.json does not describe these weights; "
                        f"fix config.json or remove them from the directory")
    missing = info.get("missing_keys") or ()
    if missing and not allow_new_weights:
        problems.append(f"the weights lack {_tensors(len(missing))} {arch} needs ({_some(missing)}); "
                        f"the weights do not match config.json: fix the directory, or set "
                        f"model.allow_new_weights=true to initialise them (a new head)")
    if problems:
        raise UserError(f"model.path {path!r}: " + "; also ".join(problems))
    return tuple(sorted(missing))


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
    new_weights: tuple[str, ...] = ()
    if model_cfg.path:
        # ignore_mismatched_sizes: without it transformers raises a multi-line RuntimeError on a
        # shape mismatch before returning the loading info; check_loading_info rejects them anyway.
        model, info = AutoModelForCausalLM.from_pretrained(
            model_cfg.path, config=hf_config, output_loading_info=True, ignore_mismatched_sizes=True,
            **kwargs)
        # Under ZeRO-3 (transformers 5.x, _load_pretrained_model) only missing_keys is filled in:
        # unexpected and mismatched come back empty, and a shape mismatch raises on rank 0 alone.
        new_weights = check_loading_info(model_cfg.path, getattr(hf_config, "model_type", ""), info,
                                         model_cfg.allow_new_weights)
    else:
        model = AutoModelForCausalLM.from_config(hf_config, **kwargs)
        seeded_init(model, seed, zero3)
    if model_cfg.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return BuiltModel(model, hf_config, keep_alive, new_weights)


def count_params(model) -> int:
    """Parameter count, also when ZeRO-3 has partitioned the tensors away (ds_numel)."""
    return sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())


def flops_per_token(n_params: int, n_layers: int, hidden: int, seq_len: int) -> float:
    """Training FLOPs per token: 6N for the matmuls plus 12 L h s for attention (PaLM, App. B)."""
    return 6 * n_params + 12 * n_layers * hidden * seq_len
