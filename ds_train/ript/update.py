"""The RIPT policy update: PPO epochs of the clipped surrogate over the accepted rollouts of every
rank, aggregated as ript.loss_agg_mode says and exact across ranks and micro-batches, with an
optional KL term to a reference policy, through the DeepSpeed engine and the run's non-finite guard.

Per iteration: the rollouts' rewards (the task's, DAPO's overlong penalty, and with kl_in=reward the
KL to the reference) make the advantages (ript.advantage); every optimizer step's loss is
sum(weight x per-token loss) over its tokens on all ranks, the weights from counts all-reduced
once per epoch (ds_train/ript/algorithms.py: aggregate).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch

from ds_train import dist
from ds_train.config import RiptConfig
from ds_train.guard import backward_step
from ds_train.ript.algorithms import (ADVANTAGES, KL_ESTIMATORS, Norms, PolicyStats, advantages, aggregate,
                                      clipped_policy_loss, logp_mismatch, overlong_penalty, rollout_correction)
from ds_train.ript.rollout import Episode, max_rollout_tokens
from ds_train.ript.sampler import std_from_sums
from ds_train.run import Run
from ds_train.train.reference import Reference


def token_logp(engine, ids, temperature: float = 1.0):
    """The log-prob the policy gives each token of `ids` [rows, tokens] after its prefix: [rows, tokens - 1], at
    the sampling `temperature` (its logits divided by it, as TRL and verl train: the policy trained is the one that
    samples, and the rollout engines' log-probs are at the same temperature; 0, greedy: the logits as they are)."""
    logits = engine(input_ids=ids[:, :-1], use_cache=False).logits.float()
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    return torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)


def shaped_rewards(groups: list[list[Episode]], buffer: int, factor: float, max_new_tokens: int):
    """[groups, K]: each rollout's reward plus DAPO's soft overlong penalty on its generated tokens."""
    return torch.tensor([[e.reward + overlong_penalty(sum(e.action_mask), max_rollout_tokens(e.task, max_new_tokens),
                                                      buffer, factor) for e in g] for g in groups],
                        dtype=torch.float32)


def update(run: Run, r: RiptConfig, groups: list[list[Episode]], iteration: int, reference: Reference | None = None,
           max_tokens: int = 1, seed: int = 0, poison: bool = False) -> PolicyStats:
    """PPO epochs over the accepted rollouts (`r`: the ript section); every rank runs the same number
    of engine steps. The run gives the engine, the plan, the tokenizer, the non-finite guard and the
    heartbeat; `seed` orders the rows (with the iteration, epoch and data-parallel rank); `poison` (the
    train.debug_nonfinite_steps fault) makes every optimizer step's gradients non-finite.

    The engine averages gradients over data-parallel ranks and accumulation steps, so each
    micro-batch's share of the step's loss is scaled by data-parallel size x accumulation.
    `max_tokens`: the most tokens any rollout can generate (seq-mean-token-sum-norm's constant). An
    optimizer step whose gradients are not finite is skipped (the run's non-finite guard counts
    it, and train.nonfinite=stop ends the run). Returns the summed statistics for the log.
    """
    per_step, micro = run.plan.sequences_per_rank, run.plan.micro_batch_size
    rows = [e for g in groups for e in g]
    n_steps = int(dist.all_reduce_max([float(math.ceil(len(rows) / per_step))])[0])
    if n_steps == 0:
        return PolicyStats()
    ids, mask, sampled = _padded(run, rows, n_steps * per_step, r.mask_truncated)
    orders = [_order(len(rows), len(ids), f"{seed}:{iteration}:{epoch}:{run.data_rank}")  # a tensor group: one order
              for epoch in range(r.ppo_epochs)]
    # The policy before the update: the rows of the first optimizer step take it from that step's own
    # forward (no update has happened yet), unless the rewards need it first (kl_in=reward); the
    # others from one no-grad pass now. The reference's, once, for every row.
    first = set() if reference is not None and r.kl_in == "reward" else set(orders[0][:per_step])
    old, ref = _logp_before(run, ids, [i for i in orders[0] if i not in first], reference, iteration)
    adv = _advantages(r, groups, len(rows), old, ref, mask)
    batch = _Batch(ids, mask, old, ref, adv, first, sampled)
    stats = PolicyStats()
    for epoch, order in enumerate(orders):
        steps = [mask[order[s * per_step:(s + 1) * per_step]] for s in range(n_steps)]
        counts = dist.all_reduce_sum([v for m in steps for v in (float(m.sum()), float((m.sum(-1) > 0).sum()))],
                                     run.token_group)
        for s in range(n_steps):
            norms = Norms(counts[2 * s], counts[2 * s + 1], float(max_tokens))
            skipped_before = run.engine.skipped_steps
            for m in range(run.plan.grad_accum_steps):
                run.beat(iteration, "update")
                idx = order[s * per_step + m * micro: s * per_step + (m + 1) * micro]
                stats += _micro_step(run, r, batch, idx, epoch == 0, norms, m == 0, poison)
            run.guard.observe(f"iteration {iteration}", run.engine.skipped_steps > skipped_before)
    return stats


@dataclass(frozen=True)
class _Batch:
    """This rank's rows of one update, padded to the same number of optimizer steps on every rank."""

    ids: torch.Tensor  # [n, width] token ids, right-padded with EOS, on the engine's device
    mask: torch.Tensor  # [n, width - 1] 1 on the policy's own tokens that train (the padding: 0)
    old: torch.Tensor  # [n, width - 1] the policy's log-probs before the update
    ref: torch.Tensor | None  # [n, width - 1] the reference's log-probs, with a reference
    adv: torch.Tensor  # [n] each row's advantage (the padding: 0)
    first: set[int]  # rows whose `old` the first optimizer step's own forward fills in
    sampled: torch.Tensor | None = None  # [n, width - 1] the rollout engine's log-probs (vLLM's), else None


def _padded(run: Run, rows: list[Episode], n: int, mask_truncated: bool):
    """The rows' token ids, their action mask and the rollout engine's log-probs (None when a row has
    none: the policy sampled them itself), right-padded to the longest row of every rank and to `n`
    rows (causal attention never looks at the padding); a truncated row trains nothing when
    `mask_truncated`."""
    width = int(dist.all_reduce_max([float(max((len(e.ids) for e in rows), default=2))])[0])
    ids = torch.full((n, width), run.tokenizer.eos_token_id, dtype=torch.long)
    mask = torch.zeros((n, width - 1))
    with_logprobs = bool(rows) and all(e.logprobs is not None for e in rows)
    sampled = torch.zeros((n, width - 1)) if with_logprobs else None
    for i, e in enumerate(rows):
        ids[i, :len(e.ids)] = torch.tensor(e.ids)
        if not (mask_truncated and e.truncated):
            mask[i, :len(e.ids) - 1] = torch.tensor(e.action_mask[1:], dtype=torch.float)
        if sampled is not None:
            sampled[i, :len(e.ids) - 1] = torch.tensor(e.logprobs[1:], dtype=torch.float)
    return ids.to(run.engine.device), mask, sampled


def _logp_before(run: Run, ids, later: list[int], reference: Reference | None, iteration: int):
    """One no-grad pass: the policy's log-probs of the `later` rows (the others' stay 0 until the
    first step fills them in), and the reference's of every row (None without a reference)."""
    engine, micro = run.engine, run.plan.micro_batch_size
    n, width = ids.shape
    old = torch.zeros((n, width - 1), device=engine.device)
    ref = torch.zeros((n, width - 1), device=engine.device) if reference is not None else None
    engine.eval()
    with torch.no_grad():
        for i in range(0, len(later), micro):
            run.beat(iteration, "update")
            old[later[i:i + micro]] = token_logp(engine, ids[later[i:i + micro]], run.cfg.ript.temperature)
        for i in range(0, n if ref is not None else 0, micro):
            ref[i:i + micro] = reference.token_logp(ids[i:i + micro], run.cfg.ript.temperature)
    engine.train()
    return old, ref


def _advantages(r: RiptConfig, groups: list[list[Episode]], n_rows: int, old, ref, mask):
    """[n]: the advantage of each row (ript.advantage) from its shaped reward, less kl_coef x its
    summed KL with kl_in=reward; 0 on the padding."""
    adv = torch.zeros(len(mask))
    if groups:
        rewards = shaped_rewards(groups, r.overlong_buffer, r.overlong_penalty, r.max_new_tokens)
        if ref is not None and r.kl_in == "reward":  # each rollout's summed KL, at the sampling policy
            seq_kl = (KL_ESTIMATORS[r.kl_estimator](old, ref) * mask.to(old.device)).sum(-1)[:n_rows].cpu()
            rewards = rewards - r.kl_coef * seq_kl.view(rewards.shape)
    batch_std = None
    if ADVANTAGES.entry(r.advantage).scaled and r.scale_rewards == "batch":  # over every accepted rollout of all ranks
        flat = rewards.flatten().double() if groups else torch.zeros(0, dtype=torch.float64)
        count, total, squares = dist.all_reduce_sum([float(flat.numel()), float(flat.sum()), float((flat ** 2).sum())])
        batch_std = std_from_sums(count, total, squares)
    if groups:
        adv[:n_rows] = advantages(r.advantage, rewards, r.scale_rewards, batch_std).flatten()
    return adv


def _micro_step(run: Run, r: RiptConfig, batch: _Batch, idx: list[int], first_epoch: bool, norms: Norms,
                first_micro: bool, poison: bool) -> PolicyStats:
    """One micro-batch's clipped policy loss (and KL term), backward, and the engine's step; its
    statistics."""
    plan, engine = run.plan, run.engine
    scale = plan.data_parallel_size * plan.grad_accum_steps
    logp = token_logp(engine, batch.ids[idx], r.temperature)
    if first_epoch and idx and idx[0] in batch.first:
        batch.old[idx] = logp.detach()
    mask_m = batch.mask[idx].to(logp.device)
    per_token, st = clipped_policy_loss(logp, batch.old[idx], batch.adv[idx].to(logp.device), mask_m,
                                        r.clip_low, r.clip_high)
    engine_stats = {}
    if batch.sampled is not None:  # the rollout engine's log-probs against the trainer's (pi_old)
        sampled = batch.sampled[idx].to(logp.device)
        weights = rollout_correction(r.rollout_correction, batch.old[idx], sampled, mask_m, r.tis_cap) \
            if r.tis_cap > 0 else mask_m
        per_token = per_token * weights
        if first_epoch:
            tokens, diff, over, most = logp_mismatch(batch.old[idx], sampled, mask_m)
            engine_stats = dict(rollout_tokens=tokens, rollout_diff=diff, rollout_over=over, rollout_diff_max=most,
                                rollout_weight=float((weights * mask_m).sum()))
    kl_sum = 0.0
    if batch.ref is not None:
        kl_tokens = KL_ESTIMATORS[r.kl_estimator](logp, batch.ref[idx])
        kl_sum = float((kl_tokens.detach() * mask_m).sum())
        if r.kl_in == "loss":
            per_token = per_token + r.kl_coef * kl_tokens * mask_m
    scaled = aggregate(per_token, mask_m, r.loss_agg_mode, norms, scale)
    backward_step(engine, scaled * float("inf") if poison else scaled)
    weighted_adv = float((batch.adv[idx][:, None] * batch.mask[idx]).sum())
    return PolicyStats(float(scaled.detach()) / scale, st["tokens"], st["clipped_tokens"], st["ratio_sum"],
                       weighted_adv, kl_sum, 1.0 / plan.data_parallel_size if first_micro else 0.0, **engine_stats)


def _order(rows: int, n: int, seed: str) -> list[int]:
    """An epoch's order: the rollouts shuffled (seeded), then the padding rows."""
    order = list(range(rows))
    random.Random(seed).shuffle(order)
    return order + list(range(rows, n))
