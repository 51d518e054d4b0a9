"""Asynchronous RL's batches, as pure functions: which weights generate batch i (`source_version`), the seed of
a rank's batch (`batch_seed`), an episode's form between the sides (`to_wire` / `from_wire`), which trainer takes
which rollout rank's groups (`takers`, `givers`, `share_out`, `deal`), and the staleness of what a trainer received
(`Staleness`).

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


def takers(j: int, rollout_ranks: int, trainers: int) -> list[int]:
    """The trainers (data-parallel ranks) that take rollout rank j's groups: with at least as many rollout ranks as
    trainers, trainer j % trainers (one each: the colocated run's assignment); with fewer, trainers j, j + R, ..."""
    return [j % trainers] if rollout_ranks >= trainers else list(range(j, trainers, rollout_ranks))


def givers(d: int, rollout_ranks: int, trainers: int) -> list[int]:
    """The rollout ranks whose groups trainer d takes (the inverse of `takers`), in rank order."""
    return [j for j in range(rollout_ranks) if d in takers(j, rollout_ranks, trainers)]


def routes(split, dims) -> "Routes":
    """The Routes of a split job (ds_train/topology.py Split) whose trainers are laid out as `dims` (ParallelDims)."""
    trainers = split.job_ranks("trainer")
    return Routes(tuple(dims.data_rank(r) for r in range(len(trainers))), tuple(trainers),
                  tuple(split.job_ranks("rollout")))


def share_out(groups: list[Any], j: int, rollout_ranks: int, trainers: int) -> dict[int, list[Any]]:
    """Rollout rank j's groups (in its order) by the trainer that takes each: round-robin over its takers."""
    mine = takers(j, rollout_ranks, trainers)
    shares: dict[int, list[Any]] = {d: [] for d in mine}
    for n, group in enumerate(groups):
        shares[mine[n % len(mine)]].append(group)
    return shares


def deal(groups: list[list[Any]], trainers: int) -> list[list[Any]]:
    """Each trainer's share of the rollout ranks' groups (`groups[j]`: rollout rank j's, in its order), as each
    rollout rank hands them out (`share_out`) and each trainer takes them from its givers in rank order."""
    shares: list[list[Any]] = [[] for _ in range(trainers)]
    for j, mine in enumerate(groups):
        for d, share in share_out(mine, j, len(groups), trainers).items():
            shares[d] += share
    return shares


@dataclass(frozen=True)
class Routes:
    """Who sends what to whom between the sides of a split job, from each side's job ranks in side order and each
    trainer's data-parallel rank (`trainer_data[r]`, r its side rank: the ranks of a tensor group share one). Rollout
    rank j sends its groups to the trainers that take them (`takers`), and its counts to trainer 0; at a save each
    taker keeps its own share of the batches held, and at a resume the first trainer of each data rank gives it
    back."""

    trainer_data: tuple[int, ...]
    trainer_jobs: tuple[int, ...]
    rollout_jobs: tuple[int, ...]

    @property
    def data(self) -> int:
        return max(self.trainer_data) + 1

    @property
    def counter(self) -> int:
        """The job rank that counts every rollout rank's tally (trainer 0)."""
        return self.trainer_jobs[0]

    def destinations(self, j: int) -> dict[int, int]:
        """Rollout rank j's messages: job rank -> the data rank whose share it takes (-1: trainer 0, for the
        counts only)."""
        mine = takers(j, len(self.rollout_jobs), self.data)
        out = {self.trainer_jobs[r]: d for r, d in enumerate(self.trainer_data) if d in mine}
        return out if self.counter in out else {self.counter: -1, **out}

    def sources(self, r: int) -> list[int]:
        """The rollout ranks' job ranks that trainer r (side rank) hears from: its data rank's givers, and every
        rollout rank for trainer 0."""
        if self.trainer_jobs[r] == self.counter:
            return list(self.rollout_jobs)
        return [self.rollout_jobs[j] for j in givers(self.trainer_data[r], len(self.rollout_jobs), self.data)]

    def keeper(self, r: int) -> bool:
        """Trainer r gives back its share at a resume: the first of its data rank (the others hold copies)."""
        return self.trainer_data.index(self.trainer_data[r]) == r

    def givers_back(self, j: int) -> dict[int, int]:
        """At a resume, the trainers rollout rank j hears from: job rank -> data rank (-1: trainer 0's counts)."""
        return {t: d for t, d in self.destinations(j).items() if d < 0 or self.keeper(self.trainer_jobs.index(t))}


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
