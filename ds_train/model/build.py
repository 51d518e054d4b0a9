"""Builds the Hugging Face causal LM (from a local directory or from an architecture). No distributed code.

Under ZeRO-3 a live `HfDeepSpeedConfig` makes transformers construct the model inside
`deepspeed.zero.Init`, so no rank ever holds the whole model (USERS.md trap 6: CPU OOM at load).
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

from ds_train.config.model import ModelConfig
from ds_train.errors import UserError
from ds_train.model.hfconfig import said
from ds_train.model.lora import apply_lora, quantisation_config
from ds_train.model.lora import enabled as lora_enabled
from ds_train.model.weights import REFETCH, check_loading_info


def resolve_dtype(choice: str, device_type: str, bf16_supported: bool) -> str:
    """auto -> bf16 on a GPU that supports it, else fp32 (bf16 matmuls are slow on most CPUs).
    A precision this device cannot train in is an error here, before DeepSpeed's engine says so."""
    if choice == "fp16" and device_type == "cpu":
        raise UserError("model.dtype: fp16 is not supported on the CPU (DeepSpeed's CPU accelerator has no "
                        "fp16); use model.dtype=fp32 or bf16 there (auto picks fp32)")
    if choice == "bf16" and device_type == "cuda" and not bf16_supported:  # pre-Ampere GPUs
        raise UserError("model.dtype: bf16 is not supported on this GPU; use model.dtype=fp16 or fp32 (auto "
                        "picks fp32 there)")
    if choice != "auto":
        return choice
    return "bf16" if device_type == "cuda" and bf16_supported else "fp32"

@dataclass
class BuiltModel:
    model: Any
    hf_config: Any
    ds_hf_config: Any  # keeps HfDeepSpeedConfig alive while the engine is built (ZeRO-3)
    new_weights: tuple[str, ...] = ()  # initialised, not loaded: missing from model.path (allow_new_weights)
    constructed: tuple[str, ...] = ()  # from scratch: weights the model's _init_weights leaves to its constructor


# What from-scratch weights depend on beyond model.config and the seed (the DPO reference cache keys on
# it): the model's own _init_weights, run on CPU copies, one CPU generator seed per module name.
INIT_SCHEME = "per-module crc32 seed, CPU generator"


def seed_all(seed: int) -> None:
    """What transformers.set_seed does for torch (every device), numpy and random, without importing
    transformers.trainer_utils (which imports peft and bitsandbytes: 1.5 s of every rank's start)."""
    import random

    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # the CPU generator and every CUDA device's


def seeded_init(model, seed: int, zero3: bool, only: frozenset[str] | None = None) -> list[str]:
    """Re-initialise each module with the model's own `_init_weights`, seeded by the module's name
    (`only`: just these parameters, by dotted name, e.g. the new head of model.allow_new_weights; every
    other parameter of their modules keeps its loaded value).

    The weights then depend on the seed alone, not on how construction consumed the RNG, so ZeRO-3
    (built inside zero.Init) starts from the same weights as ZeRO 0-2 and any world size. Every
    draw comes from the CPU generator, on fp32 CPU copies of the module's parameters: a ZeRO-3
    parameter gathered on a GPU would otherwise draw from the GPU's generator, another sequence for
    the same seed, and a bf16 one would draw other numbers than the fp32 draw it rounds. A parameter
    `_init_weights` leaves alone keeps the value construction gave it. The caller's RNG state is left
    as it was. Returns the parameters and buffers left NaN: built by `built_unset`, those the model's
    own initialisation does not reach.
    """
    import zlib

    import deepspeed
    import torch

    unset = []
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        for name, module in model.named_modules():
            params = list(module.parameters(recurse=False))
            if not params or only is not None and not any(_dotted(name, k) in only for k in module._parameters):
                continue
            gather = deepspeed.zero.GatheredParameters(params, modifier_rank=0) if zero3 else nullcontext()
            with gather:
                held = dict(module._parameters)
                for key, p in held.items():  # an fp32 CPU stand-in (NaN until drawn) for each other parameter
                    if p is not None and (p.device.type != "cpu" or p.dtype != torch.float32 or only is not None):
                        module._parameters[key] = torch.nn.Parameter(
                            torch.full(p.shape, float("nan"), dtype=torch.float32), requires_grad=p.requires_grad)
                torch.default_generator.manual_seed(seed + zlib.crc32(name.encode()))  # the CPU one alone
                model._init_weights(module)
                for key, p in held.items():
                    drawn = module._parameters[key]
                    if only is not None and _dotted(name, key) not in only:  # loaded: kept as it is
                        module._parameters[key] = p
                        continue
                    if drawn is p:  # drawn in place (fp32 on the CPU)
                        if p is not None and p.is_floating_point() and _has_nan(p):
                            unset.append(_dotted(name, key))
                        continue
                    if _has_nan(drawn):  # not (all) drawn: the constructor's value stays there
                        if p.device.type != "meta":
                            drawn = torch.where(drawn.isnan(), p.detach().to(device="cpu", dtype=torch.float32), drawn)
                        if p.device.type == "meta" or _has_nan(drawn):
                            unset.append(_dotted(name, key))
                    p.data.copy_(drawn.data)
                    module._parameters[key] = p
        unset += [name for name, b in model.named_buffers()
                  if only is None and b.is_floating_point() and b.device.type != "meta" and _has_nan(b)]
    return unset


def _has_nan(t) -> bool:
    """Whether `t` holds a NaN: its sum is not finite (one pass, no mask), then the exact test."""
    import torch

    return not bool(torch.isfinite(t.sum(dtype=torch.float32))) and bool(t.isnan().any())


def _dotted(name: str, key: str) -> str:
    return f"{name}.{key}" if name else key


# torch.nn.init's functions that draw: built_unset makes them mark their tensor NaN instead
DRAWS = ("uniform_", "normal_", "xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_",
         "trunc_normal_", "orthogonal_", "sparse_")


@contextmanager
def built_unset():
    """Construction without its draws: what torch.nn.init would draw is set to NaN instead (a fill, not
    a draw), and transformers' initialisation pass is skipped (its weight tying is not). On a ~1B model
    those draws and that pass cost as much as the seeded initialisation that replaces them. Whatever
    the model's own `_init_weights` then does not reach stays NaN, and seeded_init names it."""
    import sys

    import torch
    from transformers.initialization import TORCH_MODULES_TO_PATCH
    from transformers.modeling_utils import PreTrainedModel

    def fill_nan(tensor, *args, **kwargs):
        with torch.no_grad():
            return tensor.fill_(float("nan"))

    originals = []
    try:
        for module in (sys.modules[m] for m in TORCH_MODULES_TO_PATCH if m in sys.modules):
            for name in DRAWS:
                if hasattr(module, name):
                    originals.append((module, name, getattr(module, name)))
                    setattr(module, name, fill_nan)
        originals.append((PreTrainedModel, "initialize_weights", PreTrainedModel.initialize_weights))
        PreTrainedModel.initialize_weights = lambda self: None
        yield
    finally:
        for module, name, original in reversed(originals):
            setattr(module, name, original)


def training_dtype(ds_config: dict):
    """The torch dtype the engine trains the model's weights in: bf16 / fp16 as the ds_config enables."""
    import torch

    for key, dtype in (("bf16", torch.bfloat16), ("bfloat16", torch.bfloat16), ("fp16", torch.float16)):
        if (ds_config.get(key) or {}).get("enabled"):
            return dtype
    return torch.float32


def build_model(model_cfg: ModelConfig, hf_config, ds_config: dict, seed: int = 0) -> BuiltModel:
    """Construct (ZeRO-3: partitioned) the model in the dtype it trains in (training_dtype), so no rank
    holds an fp32 copy of a bf16 model in host memory before the engine takes it (an 8B model: 32 GB
    per rank instead of 16, and nothing copied for a checkpoint already in that dtype); the engine's
    cast is then a no-op. Its fp32 master weights come from these, exactly as from the engine's cast."""
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config
    from transformers.utils import logging as hf_logging

    # Its "Loading weights" bar goes to stderr on every rank: an error would no longer be one line.
    hf_logging.disable_progress_bar()
    keep_alive = None
    zero3 = ds_config.get("zero_optimization", {}).get("stage", 0) == 3
    if zero3:  # zero.Init reads it without the parallel groups: its world is every rank, not the
        # data-parallel ones, so the global batch is left for it to derive (micro x accumulation x world)
        keep_alive = HfDeepSpeedConfig({k: v for k, v in ds_config.items() if k != "train_batch_size"})
    else:  # an earlier ZeRO-3 run in this process (parity runs several) must not build this one partitioned
        unset_hf_deepspeed_config()
    kwargs = dict(attn_implementation=model_cfg.attn_implementation, dtype=training_dtype(ds_config))
    new_weights: tuple[str, ...] = ()
    constructed: tuple[str, ...] = ()
    if model_cfg.path:
        # ignore_mismatched_sizes: without it transformers raises a multi-line RuntimeError on a
        # shape mismatch before returning the loading info; check_loading_info rejects them anyway.
        try:
            model, info = AutoModelForCausalLM.from_pretrained(
                model_cfg.path, config=hf_config, output_loading_info=True, ignore_mismatched_sizes=True,
                quantization_config=quantisation_config(model_cfg.lora), **kwargs)
        except (SafetensorError, OSError, EOFError) as e:  # build_hf_config checked them; changed since?
            raise UserError(f"model.path {model_cfg.path!r}: cannot load the weights ({said(e)}); "
                            f"{REFETCH}") from None
        # Under ZeRO-3 (transformers 5.x, _load_pretrained_model) only missing_keys is filled in:
        # unexpected and mismatched come back empty, and a shape mismatch raises on rank 0 alone.
        new_weights = check_loading_info(model_cfg.path, getattr(hf_config, "model_type", ""), info,
                                         model_cfg.allow_new_weights)
        if new_weights:  # transformers drew them from the generator of the device they live on (ZeRO-3: the GPU)
            seeded_init(model, seed, zero3, only=frozenset(new_weights))
    else:
        model, constructed = from_scratch(hf_config, seed, zero3, **kwargs)
    if model_cfg.activation_checkpointing:
        checkpoint_activations(model)
    if lora_enabled(model_cfg.lora):  # the adapters on the built (ZeRO-3: partitioned) base
        model = apply_lora(model, model_cfg.lora, seed)
        if zero3:
            match_partitioned_dtype(model)
    return BuiltModel(model, hf_config, keep_alive, new_weights, constructed)


def from_scratch(hf_config, seed: int, zero3: bool, **kwargs):
    """The model from its config, and the weights its `_init_weights` leaves to its constructor (none:
    every weight from seeded_init). Built without construction's own draws
    (built_unset) when the model's `_init_weights` then reaches every parameter and buffer; otherwise
    (a module it leaves alone: what is left NaN shows it) built again with them, so that such a weight
    keeps its constructor's value, as transformers gives it."""
    import torch
    from transformers import AutoModelForCausalLM

    def build(fast: bool):
        with torch.random.fork_rng(devices=[]), (built_unset() if fast else nullcontext()):
            try:  # construction's own draws leave the caller's RNG as it was
                return AutoModelForCausalLM.from_config(hf_config, **kwargs)
            except (ValueError, TypeError, KeyError) as e:  # check_buildable ran without ZeRO-3's zero.Init
                raise UserError(f"model.config: Hugging Face cannot build the model ({said(e)}); "
                                f"fix model.config") from None

    model = build(fast=True)
    unset = seeded_init(model, seed, zero3)
    if not unset:
        return model, ()
    del model
    model = build(fast=False)
    seeded_init(model, seed, zero3)
    return model, tuple(unset)


def match_partitioned_dtype(model) -> None:
    """Parameters made after zero.Init (LoRA's adapters) take the dtype it gave the partitioned base
    (bf16/fp16 in mixed precision): DeepSpeed partitions them at initialize and ZeRO-3 keeps one
    low-precision dtype for all of a group's parameters."""
    import torch

    dtype = next((p.dtype for p in model.parameters() if hasattr(p, "ds_id")), None)
    if dtype is None:
        return
    with torch.no_grad():
        for p in model.parameters():
            if not hasattr(p, "ds_id") and p.dtype != dtype:
                p.data = p.data.to(dtype)


def checkpoint_activations(model) -> None:
    """Each decoder layer keeps only its input and is recomputed in the backward (non-reentrant
    torch.utils.checkpoint): transformers' activation_checkpointing_enable, or before 5.x's rename,
    gradient_checkpointing_enable."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def count_params(model, trainable_only: bool = False) -> int:
    """Parameter count, also when ZeRO-3 has partitioned the tensors away (ds_numel)."""
    return sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters() if p.requires_grad or not trainable_only)


def has_frozen_params(model) -> bool:
    return any(not p.requires_grad for p in model.parameters())


def flops_per_token(n_params: int, n_layers: int, hidden: int, seq_len: int, lookups: int = 0,
                    trainable: int | None = None) -> float:
    """Training FLOPs per token: 6N for the matmuls plus 12 L h s for attention (PaLM, App. B).
    N leaves out `lookups`, the parameters of an input embedding that is only indexed (torchtitan's
    count; see lookup_params). With a frozen base (LoRA) only the `trainable` parameters' weight
    gradients are computed: 4N + 2T."""
    matmul = n_params - lookups
    per_param = 6 * matmul if trainable is None else 4 * matmul + 2 * trainable
    return per_param + 12 * n_layers * hidden * seq_len


def lookup_params(hf_config) -> int:
    """Parameters that do no matmul: the input embedding when it is not tied to the output head (a
    tied matrix does the head's matmul, so it counts once)."""
    if getattr(hf_config, "tie_word_embeddings", False):
        return 0
    return int(getattr(hf_config, "vocab_size", 0) or 0) * int(getattr(hf_config, "hidden_size", 0) or 0)


def supports_packing(hf_config) -> bool:
    """Whether the model keeps packed examples apart given position ids that restart at each one:
    its modeling code builds its attention mask with transformers' masking_utils, which finds the
    packed sequences in position_ids (for eager, sdpa, flex and flash attention alike)."""
    import inspect
    import sys

    from transformers import AutoModelForCausalLM

    try:
        cls = AutoModelForCausalLM._model_mapping[type(hf_config)]
    except (KeyError, AttributeError):
        return False
    module = sys.modules.get(cls.__module__)
    return (hasattr(module, "create_causal_mask")
            and "position_ids" in inspect.signature(cls.forward).parameters)
