"""One rank's rollouts: the episodes of a list of (task, context, index) jobs (`run_episodes`), and dynamic
rollout sampling (`sample`): contexts drawn until the rank has its quota of accepted groups (0 < successes < K),
the accepted groups of its side reach early_stop_fraction of the side's quota, or it has checked its cap. The
same on a colocated rank and on a rollout rank (ds_train/ript/rollout_ranks.py); counts summed over the ranks of
this side's world."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable

from ds_train import dist
from ds_train.config import RiptConfig
from ds_train.ript.algorithms import keep_mask
from ds_train.ript.batches import batch_seed
from ds_train.ript.rollout import Episode, rollout
from ds_train.ript.sampler import ContextSampler, Tally


@dataclass(frozen=True)
class Generating:
    """What a rank generates with: the ript section, the tokenizer, every task, whether every rank of its side
    makes the same number of policy calls (ZeRO-3 and expert parallelism's collective forward, vLLM's lockstep),
    the heartbeat, the ranks of its side that own tasks, and its seed."""

    r: RiptConfig
    tokenizer: Any
    tasks: dict
    lockstep: bool
    beat: Callable[[int, str], None]
    ranks_with_tasks: int
    seed: int
    rank: int  # this rank's place among its side's samplers (the batch seed's)
    quota: int  # the accepted groups it gathers a batch


def run_episodes(g: Generating, act, jobs: list) -> list[Episode]:
    """Rollouts of this rank's jobs. In lockstep every rank makes the same number of policy calls (batches x
    turns), with dummy rows where it has nothing to do."""
    r = g.r
    size = r.rollout_contexts * r.rloo_batch_size
    if not g.lockstep or r.policy:  # generation of this rank's own
        return rollout(act, g.tokenizer, jobs, size, max_new_tokens=r.max_new_tokens)
    batches = int(dist.all_reduce_max([float(math.ceil(len(jobs) / size))])[0])
    turns = max(t.max_turns for t in g.tasks.values())
    episodes = []
    for b in range(batches):
        episodes += rollout(act, g.tokenizer, jobs[b * size:(b + 1) * size], size, turns=turns,
                            max_new_tokens=r.max_new_tokens)
    return episodes


def sample(g: Generating, sampler: ContextSampler, owns_tasks: bool, act, tally: Tally, batch: int,
           completions) -> list[list[Episode]]:
    """Dynamic rollout sampling of batch `batch`: this rank's accepted groups (each K episodes of one context),
    its generator seeded for the batch (batches.batch_seed)."""
    import torch

    r = g.r
    k, quota = r.rloo_batch_size, g.quota
    target = math.ceil(r.early_stop_fraction * quota * g.ranks_with_tasks)
    torch.manual_seed(batch_seed(g.seed, g.rank, batch))
    groups: list[list[Episode]] = []
    checked = rounds = 0
    while True:
        g.beat(batch, "rollout")  # a round: every rank all-reduces its progress
        done = not owns_tasks or len(groups) >= quota or checked >= r.max_contexts_checked
        accepted, busy = dist.all_reduce_sum([float(min(len(groups), quota)), float(not done)])
        if busy == 0 or accepted >= target or rounds == r.max_sampling_rounds > 0:
            break
        rounds += 1
        picked = [] if done else sampler.next(min(r.rollout_contexts, r.max_contexts_checked - checked), tally)
        checked += len(picked)
        episodes = run_episodes(g, act, [(task, ctx, i) for task, _, ctx in picked for i in range(k)])
        completions.add(batch, "train", episodes)
        rewards = torch.tensor([[e.reward for e in episodes[n * k:(n + 1) * k]] for n in range(len(picked))])
        keep_groups = keep_mask(rewards).tolist() if picked else []
        for n, (task, index, _) in enumerate(picked):
            group, keep = episodes[n * k:(n + 1) * k], keep_groups[n]
            wins = sum(e.success for e in group)
            tally.add(task.name, successes=wins, rollouts=k, checked=1, accepted=int(keep), rejected=int(not keep),
                      truncated=sum(e.truncated for e in group), reward=sum(e.reward for e in group),
                      reward_sq=sum(e.reward ** 2 for e in group), turns=sum(e.turns for e in group),
                      tool_calls=sum(e.tool_calls for e in group), env_s=sum(e.env_seconds for e in group),
                      **Counter(f"failed_{e.reason}" for e in group if e.reason))
            sampler.record(task.name, index, wins, k)
            if keep and len(groups) < quota:
                groups.append(group)
    return groups
