"""The training loss: summed next-token cross-entropy and its target count per micro-batch, and the
token-weighted mean over ranks. Exact across any layout: sums and counts are reduced, never means.
"""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np

from ds_train import dist
from ds_train.data.examples import IGNORE, Batch


def token_mean(loss_sum: float, tokens: int, group=None) -> float:
    """The mean loss per token over every rank of `group` (None: all; ParallelGroups.tokens): summed
    losses over summed counts (one all-reduce), never a mean of per-rank means, which would weigh a
    rank's tokens by how few it had."""
    loss, count = dist.all_reduce_sum([loss_sum, tokens], group)
    return loss / count


def _tile_loss(project, hidden, targets):
    import torch.nn.functional as F

    return F.cross_entropy(project(hidden).float(), targets, reduction="sum", ignore_index=IGNORE)


def tiled_loss_sum(project, hidden, targets, tile_tokens: int):
    """Summed cross-entropy of `project(hidden)` (the logits: the head module and what the model does
    after it), `tile_tokens` tokens at a time: a tile's logits (and their fp32 copy) exist only while
    that tile is computed, in the forward and again, recomputed, in the backward; never the whole
    micro-batch's (DeepSpeed's TiledFusedLogitsLoss does the same). The same sums as the full
    logits, in tiles."""
    from torch.utils.checkpoint import checkpoint

    h, t = hidden.reshape(-1, hidden.size(-1)), targets.reshape(-1)
    total = None
    for i in range(0, h.size(0), tile_tokens):
        part = checkpoint(_tile_loss, project, h[i:i + tile_tokens], t[i:i + tile_tokens], use_reentrant=False)
        total = part if total is None else total + part
    return total


class _FusedLinearLoss:
    """Summed cross-entropy of `scale * hidden @ weight.T (+ bias)` whose gradients are computed in the
    forward, tile by tile (a fused linear cross-entropy, as Liger's): a tile's logits exist only while
    that tile is computed, and the backward only scales what the forward kept (the gradient of the
    hidden states and the head's weight in their dtype, its bias in fp32), so the head's matmul is never
    recomputed.
    The same sums as the full logits, in tiles."""

    @staticmethod
    def apply(hidden, weight, bias, targets, tile_tokens: int, scale: float):
        import torch

        grad = torch.is_grad_enabled()  # the forward below runs without autograd: ask now

        class Fn(torch.autograd.Function):
            @staticmethod
            def forward(ctx, hidden, weight, bias):
                wants = [grad and x is not None and x.requires_grad for x in (hidden, weight, bias)]
                return _fused_forward(ctx, hidden, weight, bias, targets, tile_tokens, scale, wants)

            @staticmethod
            def backward(ctx, grad):
                dh, dw, db = ctx.grads
                del ctx.grads  # the node outlives its backward (the loss is still referenced): free them now
                return ((dh * grad).to(hidden.dtype) if dh is not None else None,
                        (dw * grad).to(weight.dtype) if dw is not None else None,
                        (db * grad).to(bias.dtype) if db is not None else None)

        return Fn.apply(hidden, weight, bias)


def _fused_forward(ctx, hidden, weight, bias, targets, tile_tokens: int, scale: float, wants: list[bool]):
    import torch
    import torch.nn.functional as F

    h, t = hidden.reshape(-1, hidden.size(-1)), targets.reshape(-1)
    want_h, want_w, want_b = wants
    dh = torch.empty_like(h) if want_h else None
    dw = torch.zeros_like(weight) if want_w else None  # in the weight's dtype, summed by the matmul (as Liger)
    db = torch.zeros_like(bias, dtype=torch.float32) if want_b else None
    total = torch.zeros((), dtype=torch.float32, device=h.device)
    for i in range(0, h.size(0), tile_tokens):
        x, y = h[i:i + tile_tokens], t[i:i + tile_tokens]
        logits = F.linear(x, weight, bias)
        if scale != 1:
            logits = logits * scale
        logits = logits.float()
        # No host synchronisation: the ignored rows are masked, never looked up.
        keep = (y != IGNORE).to(logits.dtype)
        picked = y.clamp(min=0).unsqueeze(1)
        lse = logits.logsumexp(-1)
        total += ((lse - logits.gather(1, picked).squeeze(1)) * keep).sum()
        if not (want_h or want_w or want_b):
            continue
        # d(sum of losses)/d(logits): softmax - one-hot on the rows with a target, 0 elsewhere (in place)
        g = logits.sub_(lse.unsqueeze(1)).exp_().mul_(keep.unsqueeze(1))
        g.scatter_add_(1, picked, -keep.unsqueeze(1))
        g = (g if scale == 1 else g.mul_(scale)).to(x.dtype)  # through the scale, as autograd would
        if want_h:
            torch.mm(g, weight, out=dh[i:i + tile_tokens])
        if want_w:
            dw.addmm_(g.t(), x)
        if want_b:
            db += g.float().sum(0)
    ctx.grads = (dh.view_as(hidden) if want_h else None, dw, db)
    return total


def fused_loss_sum(head, hidden, targets, tile_tokens: int, scale: float = 1.0):
    """The summed loss of a plain Linear `head` (then `scale`) by `_FusedLinearLoss`."""
    return _FusedLinearLoss.apply(hidden, head.weight, head.bias, targets, tile_tokens, scale)


def fuses(head) -> bool:
    """Whether the head's loss can be fused: a plain torch Linear layer (a LoRA adapter, a tensor-parallel
    shard or any other module keeps its own forward, in recomputed tiles)."""
    import torch

    return type(head) is torch.nn.Linear


@contextmanager
def _head_computes_the_loss(model, targets, tile_tokens: int, fused: bool = False, factor: float = 1.0):
    """During one forward, the output head returns the tiled summed loss instead of logits. A plain
    Linear head (`fuses`), with `fused`, computes its gradients in the forward (`fused_loss_sum`); any
    other goes tile by tile through the head module's own forward (LoRA adapters, a modules_to_save
    copy: whatever the module is), recomputed in the backward. Either way the module is called, so its
    ZeRO-3 hooks still gather and release its weight around the call. `factor`: what the model's forward
    multiplies its head's output by (the start-up probe measured it: train/probe.py), applied to every
    tile, and the returned loss divided by it, so that the forward's own product makes it the loss."""
    head = model.get_output_embeddings()
    own = type(head).forward
    if fused and fuses(head):
        head.forward = lambda hidden: fused_loss_sum(head, hidden, targets, tile_tokens, factor) / factor
    else:
        head.forward = lambda hidden: tiled_loss_sum(
            lambda h: own(head, h) * factor if factor != 1 else own(head, h), hidden, targets, tile_tokens) / factor
    try:
        yield
    finally:
        del head.forward


def tiles(tokens: int, tile_tokens: int) -> bool:
    """Whether a micro-batch of `tokens` tokens gets the tiled loss: more tokens than a tile (the start-up
    probe set tile_tokens to 0 for a model whose logits are not a constant times its head's output)."""
    return bool(tile_tokens) and tokens > tile_tokens


def forward_loss(engine, batch: np.ndarray | Batch, tile_tokens: int = 0, fused: bool = False,
                 head_factor: float = 1.0):
    """Summed next-token cross-entropy and the count of target tokens of one micro-batch (forward_losses)."""
    loss_sum, count, _ = forward_losses(engine, batch, tile_tokens, fused, head_factor)
    return loss_sum, count


def forward_losses(engine, batch: np.ndarray | Batch, tile_tokens: int = 0, fused: bool = False,
                   head_factor: float = 1.0):
    """Summed next-token cross-entropy, the count of target tokens of one micro-batch, and the router's
    auxiliary loss when the model computes one (a mixture-of-experts model with output_router_logits;
    else None): windows of seq_len + 1 tokens (pretraining), or a Batch (sft: targets on the assistant's
    tokens, and position ids restarting at each packed example, which keep examples from attending across).
    `tile_tokens`: above that many tokens the loss is computed in tiles (train.loss_tile_tokens), their
    gradients in the forward where the head allows (`fused`: train.fused_loss), times `head_factor` (what
    the model multiplies its head's output by: Speedups.head_factor)."""
    import torch
    import torch.nn.functional as F

    if isinstance(batch, Batch):
        inputs, targets = torch.from_numpy(batch.inputs), torch.from_numpy(batch.targets)
        extra = {} if batch.positions is None else {"position_ids": torch.from_numpy(batch.positions).to(engine.device)}
        count = batch.n_targets
    else:
        tokens = torch.from_numpy(batch)
        inputs, targets, extra = tokens[:, :-1], tokens[:, 1:], {}
        count = targets.numel()
    model = getattr(engine, "module", engine)
    if tiles(inputs.numel(), tile_tokens):
        with _head_computes_the_loss(model, targets.to(engine.device), tile_tokens, fused, head_factor):
            out = engine(input_ids=inputs.to(engine.device), use_cache=False, **extra)
        return out.logits, count, getattr(out, "aux_loss", None)
    out = engine(input_ids=inputs.to(engine.device), use_cache=False, **extra)
    logits = out.logits
    loss_sum = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.to(engine.device).reshape(-1),
                               reduction="sum", ignore_index=IGNORE)
    return loss_sum, count, getattr(out, "aux_loss", None)

