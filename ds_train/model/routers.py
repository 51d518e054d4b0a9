"""Mixture-of-experts routers: how many tokens each layer's router sent to each expert.

The count is taken where the router decides, from its own output, so that it is the routing the
model used: Hugging Face's routers (transformers 5: the class its `_can_record_outputs["router_logits"]`
records, returning (logits, scores, indices)) and DeepSpeed AutoEP's TokenChoiceTopKRouter (returning
(scores, indices, tokens per expert)). Only training forwards count: not an evaluation (module in
eval mode), not the recompute of activation checkpointing (inside backward). The counts are this
rank's; the step meter sums them over ranks (ds_train/train/meters.py).
"""

from __future__ import annotations

from dataclasses import dataclass

AUTOEP_ROUTER = "TokenChoiceTopKRouter"  # deepspeed.moe.ep_router


@dataclass(frozen=True)
class Router:
    name: str  # the module's name in the model
    experts: int
    top_k: int
    autoep: bool


def router_class(model):
    """The class of the model's routers, as its modeling file records their logits (None: none)."""
    recorder = (getattr(type(model), "_can_record_outputs", None) or {}).get("router_logits")
    return getattr(recorder, "target_class", None)


def find_routers(model) -> list[tuple[Router, object]]:
    """Every router in `model`, in layer order, with its module (empty for a dense model)."""
    hf_class = router_class(model)
    found = []
    for name, module in model.named_modules():
        autoep = type(module).__name__ == AUTOEP_ROUTER
        if autoep or (hf_class is not None and isinstance(module, hf_class)):
            # what it routes among: the larger where a router names both (LongCat-Flash's n_routed_experts counts
            # its zero-computation experts too)
            experts = max(int(getattr(module, key, None) or 0) for key in ("num_experts", "n_routed_experts"))
            top_k = getattr(module, "top_k", None) or getattr(module, "num_experts_per_tok", 1)
            found.append((Router(name, experts or int(module.weight.shape[0]), int(top_k), autoep), module))
    return found


def expert_indices(output, top_k: int):
    """The experts a router chose, from its output: its integer tensor (top_k wide where there are
    several), wherever the model puts it (Qwen3-MoE and Mixtral: last, after the logits and scores;
    GraniteMoE, Aria, Zaya: first). None when the output holds none."""
    import torch

    items = output if isinstance(output, (tuple, list)) else (output,)
    ints = [t for t in items if torch.is_tensor(t) and not t.is_floating_point() and t.dtype != torch.bool]
    return next((t for t in ints if t.dim() and t.shape[-1] == top_k), ints[0] if ints else None)


class RouterCounts:
    """Tokens per expert per layer on this rank since the last `take`: a [layers, experts] tensor
    on the model's device, added to in the routers' forward hooks (no host sync in the step)."""

    def __init__(self, model):
        import torch

        found = find_routers(model)
        self.routers = [router for router, _ in found]
        experts = max((r.experts for r in self.routers), default=0)
        device = next(model.parameters()).device
        self.counts = torch.zeros(len(found), experts, dtype=torch.int64, device=device)
        self.handles = [module.register_forward_hook(self._hook(i, router)) for i, (router, module) in enumerate(found)]

    def __bool__(self) -> bool:
        return bool(self.routers)

    def _hook(self, layer: int, router: Router):
        import torch

        def hook(module, args, output) -> None:
            if not module.training or torch._C._current_graph_task_id() != -1:  # eval, or a recompute in backward
                return
            with torch.no_grad():
                if router.autoep:
                    per_expert = output[2].to(torch.int64)
                elif (chosen := expert_indices(output, router.top_k)) is not None:
                    per_expert = torch.bincount(chosen.reshape(-1).to(torch.int64), minlength=router.experts)
                else:  # a router that returns no expert indices: nothing to count
                    return
                self.counts[layer, :router.experts] += per_expert.to(self.counts.device)
        return hook

    def take(self) -> list[list[int]]:
        """The counts since the last take (one host sync), and a fresh start."""
        counts = self.counts.tolist()
        self.counts.zero_()
        return [row[:router.experts] for row, router in zip(counts, self.routers)]

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


def load_metrics(counts: list[list[int]], routers: list[Router]) -> dict:
    """The router metrics of counts summed over ranks: per layer, tokens per expert, the busiest
    expert's load over the mean (1: balanced) and the share of the layer's tokens that chose it; the
    largest ratio over layers; the share a uniform router would give each expert (top_k / experts).
    Routing here is dropless (Hugging Face's and AutoEP's routers keep every token): no dropped count."""
    ratios, shares = [], []
    for row, router in zip(counts, routers):
        total = sum(row)
        mean = total / len(row) if row else 0.0
        ratios.append(round(max(row) / mean, 6) if mean else 0.0)
        shares.append(round(max(row) * router.top_k / total, 6) if total else 0.0)
    uniform = max((r.top_k / r.experts for r in routers), default=0.0)
    return {"moe/load_max_mean": max(ratios, default=0.0), "moe/layer_load_max_mean": ratios,
            "moe/layer_top_share": shares, "moe/uniform_share": round(uniform, 6), "moe/tokens_per_expert": counts}
