"""Which rank runs which task: a pure function, the same answer on every rank."""

from __future__ import annotations

from ds_train.errors import UserError


def shard_tasks(costs: dict[str, float], world: int, mode: str = "balanced",
                allow_idle_ranks: bool = False) -> list[list[str]]:
    """Assign each task to exactly one rank.

    round_robin: tasks in name order, task i on rank i % world (shard sizes differ by at most 1).
    balanced: longest-processing-time first (Graham 1969): tasks by estimated cost, descending,
    each to the rank with the least total cost so far (ties: lowest rank).
    """
    names = sorted(costs)
    if world > len(names) and not allow_idle_ranks:
        raise UserError(f"ript: {world} ranks but only {len(names)} tasks; use fewer ranks, more "
                        f"tasks, or ript.allow_idle_ranks: true (idle ranks still join every collective)")
    shards: list[list[str]] = [[] for _ in range(world)]
    if mode == "round_robin":
        for i, name in enumerate(names):
            shards[i % world].append(name)
        return shards
    if mode != "balanced":
        raise UserError(f"ript.sharding: {mode!r} is not round_robin or balanced")
    load = [0.0] * world
    for name in sorted(names, key=lambda n: (-costs[n], n)):
        rank = min(range(world), key=lambda r: (load[r], r))
        shards[rank].append(name)
        load[rank] += costs[name]
    return [sorted(s) for s in shards]


def format_shards(shards: list[list[str]], costs: dict[str, float]) -> str:
    lines = ["rank  tasks (estimated cost)"]
    for rank, names in enumerate(shards):
        total = sum(costs[n] for n in names)
        lines.append(f"{rank:>4}  {', '.join(names) or '(idle)'}  ({total:g})")
    return "\n".join(lines)
