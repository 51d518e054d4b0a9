"""The RIPT policy update: PPO epochs of the clipped surrogate over the accepted rollouts of every
rank, token-level and exact across ranks, through the DeepSpeed engine and the run's non-finite
guard."""

from __future__ import annotations

import math
import random

from ds_train import dist
from ds_train.guard import backward_step
from ds_train.ript.rloo import PolicyStats, clipped_policy_loss, rloo_advantages
from ds_train.ript.rollout import Episode
from ds_train.run import Run


def _token_logp(engine, ids):
    import torch

    logits = engine(input_ids=ids[:, :-1], use_cache=False).logits.float()
    return torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)


def update(run: Run, groups: list[list[Episode]], iteration: int) -> PolicyStats:
    """PPO epochs over the accepted rollouts; every rank runs the same number of engine steps.

    The loss of an optimizer step is the clipped surrogate summed over the valid tokens of all ranks
    divided by their global count (the engine averages over data-parallel ranks and accumulation
    steps, so each rank's part is scaled by data-parallel size x accumulation). An optimizer step
    whose gradients are not finite is skipped (the run's non-finite guard counts it, and
    train.nonfinite=stop ends the run). Returns the summed statistics for the log.
    """
    import torch

    r, plan, engine = run.cfg.ript, run.plan, run.engine
    rows = [e for g in groups for e in g]
    per_step = plan.sequences_per_rank
    n_steps = int(dist.all_reduce_max([float(math.ceil(len(rows) / per_step))])[0])
    if n_steps == 0:
        return PolicyStats()
    width = int(dist.all_reduce_max([float(max((len(e.ids) for e in rows), default=2))])[0])
    n = n_steps * per_step
    ids = torch.full((n, width), run.tokenizer.eos_token_id, dtype=torch.long)
    mask = torch.zeros((n, width - 1))
    adv = torch.zeros(n)
    if groups:
        adv[:len(rows)] = rloo_advantages(torch.tensor([[float(e.success) for e in g] for g in groups])).flatten()
    for i, e in enumerate(rows):  # right padding: causal attention never looks at it
        ids[i, :len(e.ids)] = torch.tensor(e.ids)
        mask[i, :len(e.ids) - 1] = torch.tensor(e.action_mask[1:], dtype=torch.float)
    ids = ids.to(engine.device)
    micro = plan.micro_batch_size
    orders = [_order(len(rows), n, f"{run.cfg.seed}:{iteration}:{epoch}:{run.env.rank}")
              for epoch in range(r.ppo_epochs)]
    # The policy before the update: the rows of the first optimizer step take it from that step's own
    # forward (no update has happened yet); the others from one no-grad pass now.
    later = orders[0][per_step:]
    old = torch.zeros((n, width - 1), device=engine.device)
    engine.eval()
    with torch.no_grad():
        for i in range(0, len(later), micro):
            old[later[i:i + micro]] = _token_logp(engine, ids[later[i:i + micro]])
    engine.train()
    stats = PolicyStats()
    poison = iteration in run.cfg.train.debug_nonfinite_steps  # fault injection: every update step skipped
    for epoch, order in enumerate(orders):
        global_counts = dist.all_reduce_sum([float(mask[order[s * per_step:(s + 1) * per_step]].sum())
                                             for s in range(n_steps)], run.token_group)
        for s in range(n_steps):
            scale = plan.data_parallel_size * plan.grad_accum_steps / max(global_counts[s], 1.0)
            skipped_before = engine.skipped_steps
            for m in range(plan.grad_accum_steps):
                run.beat(iteration, "update")
                idx = order[s * per_step + m * micro: s * per_step + (m + 1) * micro]
                logp = _token_logp(engine, ids[idx])
                if epoch == 0 and s == 0:
                    old[idx] = logp.detach()
                loss, st = clipped_policy_loss(logp, old[idx], adv[idx].to(logp.device),
                                               mask[idx].to(logp.device), r.clip_low, r.clip_high)
                scaled = loss * scale
                backward_step(engine, scaled * float("inf") if poison else scaled)
                weighted_adv = float((adv[idx][:, None] * mask[idx]).sum())
                stats += PolicyStats(float(loss.detach()), st["tokens"], st["clipped_tokens"], st["ratio_sum"],
                                     weighted_adv)
            run.guard.observe(f"iteration {iteration}", engine.skipped_steps > skipped_before)
    return stats


def _order(rows: int, n: int, seed: str) -> list[int]:
    """An epoch's order: the rollouts shuffled (seeded), then the padding rows."""
    order = list(range(rows))
    random.Random(seed).shuffle(order)
    return order + list(range(rows, n))
