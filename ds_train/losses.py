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


# What a model's forward does to its head's output before the logits are returned (transformers), by
# config key: (the op on the logits, the value the head hands back so that the op turns it into the
# loss). Granite divides by logits_scaling, Cohere multiplies by logit_scale.
POST_HEAD = {"logits_scaling": (lambda x, s: x / s, lambda loss, s: loss * s),
             "logit_scale": (lambda x, s: x * s, lambda loss, s: loss / s)}


def _post_head(config):
    for key, (apply, undo) in POST_HEAD.items():
        value = getattr(config, key, None)
        if isinstance(value, (int, float)) and value != 1:
            return value, apply, undo
    return None


@contextmanager
def _head_computes_the_loss(model, targets, tile_tokens: int):
    """During one forward, the output head returns the tiled summed loss instead of logits. Each tile
    goes through the head module's own forward (LoRA adapters, a modules_to_save copy: whatever the
    module is; its ZeRO-3 hooks still gather and release its weight around the call) and through the
    model's scaling after the head, whose op the returned value is made to survive."""
    head = model.get_output_embeddings()
    own = type(head).forward
    post = _post_head(getattr(model, "config", None))
    if post is None:
        head.forward = lambda hidden: tiled_loss_sum(lambda h: own(head, h), hidden, targets, tile_tokens)
    else:
        scale, apply, undo = post
        head.forward = lambda hidden: undo(
            tiled_loss_sum(lambda h: apply(own(head, h), scale), hidden, targets, tile_tokens), scale)
    try:
        yield
    finally:
        del head.forward


def tiles(model, tokens: int, tile_tokens: int) -> bool:
    """Whether a micro-batch of `tokens` tokens gets the tiled loss: more tokens than a tile, and a
    model whose logits are the head's output, or that scaled (POST_HEAD): a model that soft-caps
    its logits after the head keeps the full logits."""
    config = getattr(model, "config", None)
    return bool(tile_tokens) and tokens > tile_tokens and not getattr(config, "final_logit_softcapping", None)


def forward_loss(engine, batch: np.ndarray | Batch, tile_tokens: int = 0):
    """Summed next-token cross-entropy and the count of target tokens of one micro-batch: windows
    of seq_len + 1 tokens (pretraining), or a Batch (sft: targets on the assistant's tokens, and
    position ids restarting at each packed example, which keep examples from attending across).
    `tile_tokens`: above that many tokens the loss is computed in tiles (train.loss_tile_tokens)."""
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
    if tiles(model, inputs.numel(), tile_tokens):
        with _head_computes_the_loss(model, targets.to(engine.device), tile_tokens):
            loss_sum = engine(input_ids=inputs.to(engine.device), use_cache=False, **extra).logits
        return loss_sum, count
    logits = engine(input_ids=inputs.to(engine.device), use_cache=False, **extra).logits
    loss_sum = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.to(engine.device).reshape(-1),
                               reduction="sum", ignore_index=IGNORE)
    return loss_sum, count
