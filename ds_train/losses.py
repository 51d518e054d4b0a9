"""The training loss: summed next-token cross-entropy and its target count per micro-batch, and the
token-weighted mean over ranks. Exact across any layout: sums and counts are reduced, never means.
"""

from __future__ import annotations

import numpy as np

from ds_train import dist
from ds_train.data.datasets import IGNORE, Batch


def token_mean(loss_sum: float, tokens: int, group=None) -> float:
    """The mean loss per token over every rank of `group` (None: all; ParallelGroups.tokens): summed
    losses over summed counts (one all-reduce), never a mean of per-rank means, which would weigh a
    rank's tokens by how few it had."""
    loss, count = dist.all_reduce_sum([loss_sum, tokens], group)
    return loss / count


def forward_loss(engine, batch: np.ndarray | Batch):
    """Summed next-token cross-entropy and the count of target tokens of one micro-batch: windows
    of seq_len + 1 tokens (pretraining), or a Batch (sft: targets on the assistant's tokens, and
    position ids restarting at each packed example, which keep examples from attending across)."""
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
    logits = engine(input_ids=inputs.to(engine.device), use_cache=False, **extra).logits
    loss_sum = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.to(engine.device).reshape(-1),
                               reduction="sum", ignore_index=IGNORE)
    return loss_sum, count
