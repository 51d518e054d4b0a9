"""Asynchronous RL's batches, as pure functions: which weights generate batch i (`source_version`), the seed of
a rank's batch (`batch_seed`), an episode's form between the sides (`to_wire` / `from_wire`), which trainer takes
which rollout rank's groups (`deal`), and the staleness of what a trainer received (`Staleness`).

Batch i is what update i trains on. With ript.max_staleness k it is generated from the weights after update
max(0, i - 1 - k) (version 0: the starting weights), so its staleness at update i, whose policy is version i - 1,
is min(i - 1, k): k exactly once the first k iterations have passed, whatever the environments' timing.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Any

from ds_train.ript.rollout import Episode

# Episode fields that cross between the sides (the task travels by name, its context as is).
_WIRE = ("context", "index", "ids", "action_mask", "text", "turns", "done", "success", "reward", "truncated",
         "logprobs", "reason", "tool_calls", "env_seconds")


def source_version(batch: int, max_staleness: int) -> int:
    """The weights' version (updates done) that generates batch `batch` (1-based)."""
    return max(0, batch - 1 - max_staleness)


def batch_seed(seed: int, rank: int, batch: int) -> int:
    """The generator's seed for one rank's batch: a batch is a function of its weights and this seed, so a resumed
    run regenerates what an uninterrupted one generated (the same for a colocated run's iteration)."""
    return zlib.crc32(f"{seed}:{rank}:{batch}".encode())


def to_wire(episode: Episode, version: int) -> dict:
    """An episode as plain data, its task by name, stamped with the weights' version that generated every one of
    its tokens (the weights change only between batches, never within an episode)."""
    return {"task": episode.task.name, "version": version, **{k: getattr(episode, k) for k in _WIRE}}


def from_wire(wire: dict, tasks: dict) -> tuple[Episode, int]:
    """The episode (its task looked up by name) and its version."""
    return Episode(tasks[wire["task"]], **{k: wire[k] for k in _WIRE}), wire["version"]


def deal(groups: list[list[Any]], trainers: int) -> list[list[Any]]:
    """Each trainer's share of the rollout ranks' groups (`groups[j]`: rollout rank j's, in its order): with at
    least as many rollout ranks as trainers, trainer d takes every rollout rank j with j % trainers == d (one each:
    the colocated run's assignment); with fewer, rollout rank j's groups go round-robin to trainers j, j + R, ...
    """
    shares: list[list[Any]] = [[] for _ in range(trainers)]
    rollout_ranks = len(groups)
    for j, mine in enumerate(groups):
        if rollout_ranks >= trainers:
            shares[j % trainers] += mine
            continue
        takers = list(range(j, trainers, rollout_ranks))
        for n, group in enumerate(mine):
            shares[takers[n % len(takers)]].append(group)
    return shares


@dataclass
class Staleness:
    """The staleness (updates between the weights that generated an episode and those it trains) of the episodes
    a trainer received since the last log; episodes older than `limit` are dropped and counted."""

    limit: int
    histogram: dict[int, int] = field(default_factory=dict)
    dropped: int = 0

    def keep(self, groups: list[list[tuple[Episode, int]]], policy_version: int) -> list[list[Episode]]:
        """The groups whose episodes are at most `limit` updates old at `policy_version` (a group is K episodes of
        one context, from one batch: one version); the others dropped and counted (episodes)."""
        kept = []
        for group in groups:
            age = policy_version - group[0][1]
            if age > self.limit:
                self.dropped += len(group)
                continue
            self.histogram[age] = self.histogram.get(age, 0) + len(group)
            kept.append([e for e, _ in group])
        return kept

    def metrics(self) -> dict[str, float]:
        """The drops, and where episodes were kept their staleness: mean, max and episodes by age (none kept: no
        staleness to say, rather than a 0 that would read as current episodes)."""
        n = sum(self.histogram.values())
        out = {"async/stale_dropped": float(self.dropped)}
        if n:
            out |= {"async/staleness_mean": sum(a * c for a, c in self.histogram.items()) / n,
                    "async/staleness_max": float(max(self.histogram))}
        return out | {f"async/staleness_{a}": float(c) for a, c in sorted(self.histogram.items())}

    def restart(self) -> None:
        self.histogram, self.dropped = {}, 0
