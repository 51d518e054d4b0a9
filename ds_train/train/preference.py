"""Preference training (data.format preference): DPO and its variants on chosen / rejected pairs.

The losses are pure functions of per-sequence log-probs (the policy's and the reference's), as in
TRL's DPOTrainer, each registered by name (its help and properties: ds_train/config/registry.py):
with h = (log pi(c) - log ref(c)) - (log pi(r) - log ref(r)),

    sigmoid       -(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h)   (DPO; eps: cDPO)
    ipo           (h - 1 / (2 beta))^2, on per-token mean log-probs            (IPO, as TRL)
    sigmoid_norm  sigmoid's loss on per-token mean log-probs                   (length-normalised DPO)

and the rewards users know: rewards/chosen = beta (log pi(c) - log ref(c)), rewards/rejected
likewise, rewards/margins their difference, rewards/accuracies the share of pairs whose chosen
reward is the larger. A pair's two sequences are in one micro-batch on one rank, so its log-probs
are whole there; the step's loss is the mean over its pairs on every rank and micro-batch (each
micro-batch's summed pair losses over the step's all-reduced pair count, as train_step does with
tokens), and every metric a sum over pairs reduced with their count.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from ds_train import dist
from ds_train.config import DpoConfig
from ds_train.config.registry import PREFERENCE_LOSSES
from ds_train.data.examples import IGNORE
from ds_train.data.pairs import PairBatch
from ds_train.guard import backward_step

METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")


def sequence_logps(logits, targets):
    """Each row's summed log-prob of its target tokens (IGNORE: none) and their count, in fp32."""
    import torch

    mask = targets != IGNORE
    logp = torch.log_softmax(logits.float(), -1).gather(-1, targets.clamp(min=0)[..., None]).squeeze(-1)
    return (logp * mask).sum(-1), mask.sum(-1)


@PREFERENCE_LOSSES.register("sigmoid")
@PREFERENCE_LOSSES.register("sigmoid_norm")
def sigmoid_loss(h, beta: float, label_smoothing: float = 0.0):
    """DPO, and cDPO with label_smoothing eps: -(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h)."""
    import torch.nn.functional as F

    return -(1 - label_smoothing) * F.logsigmoid(beta * h) - label_smoothing * F.logsigmoid(-beta * h)


@PREFERENCE_LOSSES.register("ipo")
def ipo_loss(h, beta: float, label_smoothing: float = 0.0):
    """IPO: (h - 1 / (2 beta))^2 (no label smoothing)."""
    return (h - 1 / (2 * beta)) ** 2


def preference_loss(policy_chosen, policy_rejected, ref_chosen, ref_rejected, beta: float, loss: str,
                    label_smoothing: float = 0.0):
    """Per-pair losses of the preference loss registered as `loss` and the (detached) chosen and
    rejected rewards, from the log-probs each loss compares (summed; per-token means for a loss
    whose entry is `normalised`: the caller divides)."""
    chosen, rejected = policy_chosen - ref_chosen, policy_rejected - ref_rejected
    losses = PREFERENCE_LOSSES[loss](chosen - rejected, beta, label_smoothing)
    return losses, beta * chosen.detach(), beta * rejected.detach()


def pair_sums(losses, chosen_rewards, rejected_rewards, policy_chosen, policy_rejected) -> dict[str, float]:
    """A micro-batch's sums over its pairs of everything the metrics average."""
    return {"loss": float(losses.detach().sum()), "rewards/chosen": float(chosen_rewards.sum()),
            "rewards/rejected": float(rejected_rewards.sum()),
            "rewards/accuracies": float((chosen_rewards > rejected_rewards).float().sum()),
            "rewards/margins": float((chosen_rewards - rejected_rewards).sum()),
            "logps/chosen": float(policy_chosen.detach().sum()),
            "logps/rejected": float(policy_rejected.detach().sum())}


def pair_losses(model, batch: PairBatch, reference_logps: Callable, dpo: DpoConfig):
    """The forward of one micro-batch of pairs: per-pair losses and the sums for the metrics.
    `reference_logps(batch)`: the reference's summed log-probs of the batch's rows (a tensor)."""
    import torch

    device = getattr(model, "device", None) or next(model.parameters()).device
    inputs, targets = torch.from_numpy(batch.inputs).to(device), torch.from_numpy(batch.targets).to(device)
    logits = model(input_ids=inputs, use_cache=False).logits
    logps, counts = sequence_logps(logits, targets)
    ref = reference_logps(batch).to(logps.device, logps.dtype)
    if PREFERENCE_LOSSES.entry(dpo.loss).normalised:
        logps, ref = logps / counts, ref / counts
    m = len(batch.pairs)
    losses, chosen, rejected = preference_loss(logps[:m], logps[m:], ref[:m], ref[m:], dpo.beta, dpo.loss,
                                               dpo.label_smoothing)
    return losses, pair_sums(losses, chosen, rejected, logps[:m], logps[m:])


@dataclass
class PairStepResult:
    """One optimizer step on pairs (ds_train.train.loop.StepResult's fields, `tokens` counting pairs)."""
    loss_sum: Any
    tokens: int
    grad_norm: float | None
    skipped: bool
    sums: dict[str, float] = field(default_factory=dict)  # METRICS summed over this rank's pairs


def preference_step(engine, micro_batches: list[PairBatch], reference_logps: Callable, dpo: DpoConfig,
                    poison: bool = False, beat: Callable[[str], None] = lambda phase: None, clock=None, group=None,
                    data_parallel: int | None = None) -> PairStepResult:
    """One optimizer step on pairs: the gradient of the mean loss over the step's pairs on every
    rank (`group`: the ranks whose pairs make up the batch; `data_parallel`: the ranks DeepSpeed
    averages gradients over), whatever the micro-batches and ranks."""
    import contextlib

    skipped_before = engine.skipped_steps
    step_pairs = dist.all_reduce_sum([sum(len(b.pairs) for b in micro_batches)], group)[0]
    per_step = max(step_pairs, 1) / ((data_parallel or engine.dp_world_size) * engine.gradient_accumulation_steps())
    grad_norm, pairs, sums = None, 0, dict.fromkeys(("loss", *METRICS), 0.0)
    for batch in micro_batches:
        beat("forward")
        with clock.device() if clock else contextlib.nullcontext():
            losses, part = pair_losses(engine, batch, reference_logps, dpo)
        loss_sum = losses.sum() * (float("inf") if poison else 1.0)
        norm = backward_step(engine, loss_sum / per_step, beat)
        grad_norm = norm if norm is not None else grad_norm
        pairs += len(batch.pairs)
        sums = {k: sums[k] + part[k] for k in sums}
    loss = sums.pop("loss") * (float("inf") if poison else 1.0)
    return PairStepResult(loss, pairs, grad_norm, engine.skipped_steps > skipped_before, sums)


def mean_metrics(sums: dict[str, float], pairs: int, group=None, prefix: str = "") -> dict[str, float]:
    """Means over every rank's pairs (one all-reduce of the sums and the count)."""
    keys = list(sums)
    *totals, count = dist.all_reduce_sum([*(sums[k] for k in keys), pairs], group)
    return {f"{prefix}{k}": total / max(count, 1) for k, total in zip(keys, totals)}
