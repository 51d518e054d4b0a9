"""The model's weights whole, under the names of its own checkpoint, one module at a time: what a rollout engine
loads (ds_train/ript/weight_sync.py) and what lm-evaluation-harness scores in a run (ds_train/train/benchmarks.py).

`policy_weights` walks the model's modules: each module's parameters gathered under ZeRO-3
(deepspeed.zero.GatheredParameters) and AutoTP (GatherReplacedLayerParams) only while it is read, each LoRA layer
merged (W + the adapters' delta, the trained adapters untouched), and transformers' in-memory layouts written back
to the checkpoint's (its own `revert_weight_conversion`, as save_pretrained does: fused experts
`experts.gate_up_proj` go as `experts.{e}.gate_proj.weight` and so on).
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any, Iterator

from ds_train.model.lora import base_model


def hf_name(name: str) -> str:
    """A parameter's name in the model's own checkpoint: without PEFT's wrappers."""
    return name.removeprefix("base_model.model.").replace(".base_layer.", ".").replace(".modules_to_save.default.", ".")


def policy_weights(module, checkpoint_names: bool = True) -> Iterator[tuple[str, Any]]:
    """The policy's weights under the checkpoint's names, one module at a time: gathered under ZeRO-3
    and AutoTP only while the module is sent, each LoRA layer merged (base + delta; the adapters are
    read, never changed), PEFT's frozen originals of modules_to_save left out. Every rank of a ZeRO-3
    or AutoTP group must walk it together (the gathers are collectives). `checkpoint_names` False: the
    names and layouts of the model in memory (transformers' own class built from the config, as a rollout
    rank holds it: a MoE's fused experts as they are), not the checkpoint's."""
    import deepspeed
    import torch
    from deepspeed.module_inject.layers import GatherReplacedLayerParams

    lora_layer = _lora_layer_class()
    to_checkpoint = checkpoint_layout(base_model(module)) if checkpoint_names else dict.items
    seen: set[int] = set()
    merged_prefixes: list[str] = []
    for name, mod in module.named_modules():
        if any(name.startswith(p) for p in merged_prefixes) or ".original_module" in f".{name}":
            continue
        merged = lora_layer is not None and isinstance(mod, lora_layer)
        params = list(mod.parameters() if merged else mod.parameters(recurse=False))
        params = [p for p in params if id(p) not in seen]
        if not params:
            continue
        seen.update(map(id, params))
        with ExitStack() as gathered, torch.no_grad():
            gathered.enter_context(deepspeed.zero.GatheredParameters(params))
            for owner in (mod.modules() if merged else [mod]):
                gathered.enter_context(GatherReplacedLayerParams(list(owner.parameters(recurse=False)), owner))
            if merged:
                merged_prefixes.append(name + ".")
                yield from to_checkpoint(dict(_merged(name, mod)))
                continue
            own = {hf_name(f"{name}.{pname}" if name else pname): p.detach().clone()
                   for pname, p in mod.named_parameters(recurse=False) if "lora_" not in pname}
            yield from to_checkpoint(own)


def rollout_weights(module) -> Iterator[tuple[str, Any]]:
    """What the trainers send a rollout rank (ript.rollout_ranks_per_node), which builds the same class from the
    config: the weights in the model's in-memory names and layouts (policy_weights, checkpoint_names False)."""
    return policy_weights(module, checkpoint_names=False)


def checkpoint_layout(model):
    """A function from {name: tensor} of one module to its (name, tensor) pairs as the model's checkpoint
    holds them: transformers' own reverse conversion (save_pretrained's), or the pairs as they are where
    the model type has none."""
    from transformers.conversion_mapping import get_model_conversion_mapping

    if not get_model_conversion_mapping(model, add_legacy=False):
        return dict.items
    from transformers.core_model_loading import revert_weight_conversion

    return lambda tensors: revert_weight_conversion(model, tensors).items()


def _merged(name: str, layer) -> Iterator[tuple[str, Any]]:
    """A LoRA layer's weight with its active adapters' deltas added (a new tensor), and its bias."""
    base = layer.get_base_layer()
    weight = base.weight.detach().clone()
    if not getattr(layer, "merged", False) and not getattr(layer, "disable_adapters", False):
        for adapter in layer.active_adapters:
            if adapter in getattr(layer, "lora_A", {}):
                weight += layer.get_delta_weight(adapter).to(weight.dtype)
    yield hf_name(f"{name}.weight"), weight
    if getattr(base, "bias", None) is not None:
        yield hf_name(f"{name}.bias"), base.bias.detach().clone()


def _lora_layer_class():
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:  # peft is optional for a run without LoRA
        return None
    return LoraLayer
