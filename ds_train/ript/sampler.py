"""Which contexts a rank rolls out next, and the counts kept per task. Pure bookkeeping, no torch.

Each task cycles through its training contexts in a seeded order that is reshuffled every epoch;
a rank draws from its tasks in turn. The state (how far each task has got, and the per-context
statistics) is plain JSON, keyed by task, so a checkpoint carries it and a resume continues it.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any

# why an environment's episode ended failed, other than by its own done (ds_train/ript/environments.py)
# (docs/post_training.md "Environments and tools" says each)
REASONS = ("malformed_call", "unknown_tool", "tool_error", "tool_timeout", "env_error", "env_timeout",
           "env_malformed", "env_nonfinite", "env_overlong", "env_lost", "env_template", "env_role", "env_text",
           "verifier_error", "verifier_timeout", "verifier_nonfinite", "max_turns")
COUNTS = ("successes", "rollouts", "accepted", "rejected", "skipped", "checked", "truncated", "turns", "tool_calls",
          *(f"failed_{reason}" for reason in REASONS))
SUMS = ("reward", "reward_sq", "env_s")  # the rollouts' rewards and their squares, seconds in environments


@dataclass
class TaskStream:
    task: Any
    contexts: list
    seed: int
    drawn: int = 0  # contexts drawn so far, over all epochs: the sampler position
    solved: dict[int, int] = field(default_factory=dict)  # context index -> skips since it was solved

    def _order(self, epoch: int) -> list[int]:
        order = list(range(len(self.contexts)))
        random.Random(f"{self.seed}:{self.task.name}:{epoch}").shuffle(order)
        return order

    def draw(self) -> int:
        n = len(self.contexts)
        index = self._order(self.drawn // n)[self.drawn % n]
        self.drawn += 1
        return index


DECAY = 0.95  # per context recorded: a task's accept rate is over about its last 20 contexts
FLOOR = 0.1  # the least weight a task keeps under task_weighting=accepted


class ContextSampler:
    """One rank's stream of (task, context index, context) over the tasks it owns.

    uniform: the tasks draw in turn. accepted: each task draws in proportion to its recent rate of
    accepted contexts (decayed counts; at least FLOOR, so none starves and each rate stays
    measured), by smooth weighted round-robin: deterministic, and carried by a checkpoint."""

    def __init__(self, tasks: list, train_contexts: int, seed: int, skip_solved: bool = False,
                 retest_after: int = 5, weighting: str = "uniform"):
        self.streams = {t.name: TaskStream(t, t.contexts("train", train_contexts, seed), seed) for t in tasks}
        self.names = sorted(self.streams)
        self.turn = 0  # which task draws next (uniform), draws so far (accepted)
        self.skip_solved = skip_solved
        self.retest_after = retest_after
        self.weighting = weighting
        self.rates = {n: [1.0, 2.0] for n in self.names}  # decayed (accepted, checked): a prior of 1 in 2
        self.credit = dict.fromkeys(self.names, 0.0)

    def weights(self) -> dict[str, float]:
        return {n: max(FLOOR, a / c) for n, (a, c) in self.rates.items()}

    def _next_stream(self) -> TaskStream:
        if self.weighting == "uniform":
            name = self.names[self.turn % len(self.names)]
        else:
            weights = self.weights()
            total = sum(weights.values())
            for n in self.names:
                self.credit[n] += weights[n] / total
            name = max(self.names, key=lambda n: self.credit[n])  # ties: the first name
            self.credit[name] -= 1.0
        self.turn += 1
        return self.streams[name]

    def next(self, n: int, tally: "Tally") -> list[tuple[Any, int, Any]]:
        """Up to n contexts to roll out; solved contexts are skipped (and counted) until re-tested."""
        picked: list[tuple[Any, int, Any]] = []
        if not self.names:
            return picked
        budget = n + sum(len(s.contexts) for s in self.streams.values()) * (self.retest_after + 1)
        while len(picked) < n and budget > 0:
            budget -= 1
            stream = self._next_stream()
            index = stream.draw()
            if self.skip_solved and index in stream.solved:
                if stream.solved[index] < self.retest_after:
                    stream.solved[index] += 1
                    tally.add(stream.task.name, skipped=1)
                    continue
                stream.solved[index] = 0  # re-test it now
            picked.append((stream.task, index, stream.contexts[index]))
        return picked

    def record(self, task_name: str, index: int, successes: int, k: int) -> None:
        """After a context's K rollouts: the task's accept rate; solved when all K succeeded, else
        forgotten."""
        accepted, checked = self.rates[task_name]
        self.rates[task_name] = [accepted * DECAY + float(0 < successes < k), checked * DECAY + 1.0]
        if not self.skip_solved:
            return
        stream = self.streams[task_name]
        if successes == k:
            stream.solved.setdefault(index, 0)
        else:
            stream.solved.pop(index, None)

    def state(self) -> dict:
        return {"turn": self.turn,
                "tasks": {name: {"drawn": s.drawn, "solved": {str(i): c for i, c in s.solved.items()},
                                 "rate": self.rates[name], "credit": self.credit[name]}
                          for name, s in self.streams.items()}}

    def load_state(self, state: dict) -> None:
        """This rank's tasks from a checkpoint's merged state (any earlier sharding)."""
        self.turn = int(state.get("turns", {}).get(",".join(self.names), 0))
        for name, stream in self.streams.items():
            saved = state.get("tasks", {}).get(name)
            if saved:
                stream.drawn = int(saved["drawn"])
                stream.solved = {int(i): int(c) for i, c in saved["solved"].items()}
                self.rates[name] = [float(x) for x in saved.get("rate", self.rates[name])]
                self.credit[name] = float(saved.get("credit", 0.0))


def merge_states(states: list[dict], shards: list[list[str]]) -> dict:
    """All ranks' sampler states as one: tasks by name, each rank's turn keyed by its task list."""
    merged: dict = {"tasks": {}, "turns": {}}
    for state, names in zip(states, shards):
        merged["tasks"].update(state["tasks"])
        merged["turns"][",".join(sorted(names))] = state["turn"]
    return merged


def family(name: str) -> str:
    """The task a part belongs to: `arith#1` -> `arith` (ds_train/ript/datatask.py splits a dataset
    task over the data-parallel ranks); a whole task is its own family."""
    return name.partition("#")[0]


def by_family(counts: dict[str, dict]) -> dict[str, dict]:
    """Per-task counts with the parts of a task added up under its name."""
    out: dict[str, dict] = {}
    for name, c in counts.items():
        total = out.setdefault(family(name), dict.fromkeys(c, 0))
        for key, value in c.items():
            total[key] = total.get(key, 0) + value
    return out


def std_from_sums(n: float, total: float, squares: float) -> float:
    """The unbiased std of n values from their count, sum and sum of squares: what an all-reduce of
    three numbers gives every rank (exact across ranks; GRPO's batch std, the logged reward std)."""
    if n < 2:
        return 0.0
    return math.sqrt(max(squares - total * total / n, 0.0) / (n - 1))


class Tally:
    """Per-task counts and reward sums on this rank; `vector` / `from_vector` carry them through one
    all-reduce."""

    def __init__(self, names: list[str]):
        self.names = sorted(names)
        self.counts = {name: dict.fromkeys(COUNTS + SUMS, 0) for name in self.names}

    def add(self, name: str, **counts: float) -> None:
        for key, value in counts.items():
            self.counts[name][key] += value

    def vector(self) -> list[float]:
        return [float(self.counts[n][c]) for n in self.names for c in COUNTS + SUMS]

    @classmethod
    def from_vector(cls, names: list[str], values: list[float]) -> "Tally":
        tally = cls(names)
        it = iter(values)
        for n in tally.names:
            for c in COUNTS + SUMS:
                value = next(it)
                tally.counts[n][c] = int(round(value)) if c in COUNTS else value
        return tally

    @classmethod
    def from_counts(cls, counts: dict[str, dict]) -> "Tally":
        """A tally of saved counts (as_dict's form)."""
        tally = cls(list(counts))
        for name, c in counts.items():
            tally.add(name, **c)
        return tally

    def total(self, key: str) -> float:
        return sum(c.get(key, 0) for c in self.counts.values())

    def metrics(self, prefix: str = "ript") -> dict[str, float]:
        """Success rate, reward mean and std, truncation rate over the rollouts; accepted, rejected,
        skipped and checked contexts, and the share of checked contexts whose K rewards were all equal
        (frac_reward_zero_std, TRL's name); per task its success rate and accepted contexts."""
        out: dict[str, float] = {}
        rollouts, checked = self.total("rollouts"), self.total("checked")
        out[f"{prefix}/success_rate"] = self.total("successes") / rollouts if rollouts else 0.0
        if rollouts:
            out[f"{prefix}/reward_mean"] = self.total("reward") / rollouts
            out[f"{prefix}/reward_std"] = std_from_sums(rollouts, self.total("reward"), self.total("reward_sq"))
            out[f"{prefix}/truncated_frac"] = self.total("truncated") / rollouts
        if checked:
            out[f"{prefix}/frac_reward_zero_std"] = self.total("rejected") / checked
        for key in ("accepted", "rejected", "skipped", "checked"):
            out[f"{prefix}/{key}"] = self.total(key)
        failed = {reason: self.total(f"failed_{reason}") for reason in REASONS}
        if rollouts and (self.total("turns") > rollouts or self.total("tool_calls") or any(failed.values())):
            # environments: turns and tool calls per episode, and the episodes a fault ended, by reason
            out[f"{prefix}/turns_mean"] = self.total("turns") / rollouts
            out[f"{prefix}/tool_calls_mean"] = self.total("tool_calls") / rollouts
            out[f"{prefix}/env_failed_frac"] = sum(failed.values()) / rollouts
            out |= {f"{prefix}/env_failed/{reason}": n for reason, n in failed.items() if n}
        for n, c in by_family(self.counts).items():
            if c["rollouts"] or c["skipped"]:
                out[f"task/{n}/success_rate"] = c["successes"] / c["rollouts"] if c["rollouts"] else 1.0
                out[f"task/{n}/accepted"] = c["accepted"]
        return out

    def as_dict(self) -> dict:
        return {n: dict(c) for n, c in self.counts.items()}
