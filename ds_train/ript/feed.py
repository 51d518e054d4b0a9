"""Asynchronous RL, the trainers' side (ript.rollout_ranks_per_node): each iteration the trainers send the rollout
ranks the weights of the last update and take the batch the next update trains on (`RolloutFeed.batch`).

Every exchange is a meeting of the whole job on the bridge (ds_train/dist/bridge.py), opened by trainer 0's word
to the rollout ranks (ds_train/ript/rollout_ranks.py reads it): `batch` (weights, then episodes), `save` (their
sampler and the batches they hold, for the trainers' checkpoint), `resume` (the same, back), `stop`. Episodes and
what is held go point to point: each trainer gets its own share from the rollout ranks that give it one
(ds_train/ript/batches.py Routes), trainer 0 every rollout rank's counts, and each trainer's checkpoint keeps its
own share of the batches in flight. Between two
meetings each side works on its own: the rollout ranks generate the batches ahead that ript.max_staleness allows
while the trainers update.
"""

from __future__ import annotations

import time
from typing import Any

from ds_train.ript.batches import Routes, Staleness, from_wire, givers
from ds_train.ript.sampler import Tally, merge_states
from ds_train.model.gathered import rollout_weights


class RolloutFeed:
    """The trainers' end of the bridge. `tasks`: every task as sharded over the rollout ranks (`shards`); `routes`:
    which rollout ranks this trainer hears from (ds_train/ript/batches.py Routes)."""

    def __init__(self, run: Any, bridge: Any, tasks: dict, shards: list[list[str]], routes: Routes):
        self.run, self.bridge, self.tasks, self.shards, self.routes = run, bridge, tasks, shards, routes
        self.staleness = Staleness(run.cfg.ript.max_staleness)
        self.saved: dict | None = None  # this trainer's share of what the rollout ranks held at the last save
        self.open = True
        self.in_meeting = False  # between a word and its answer (a failure there leaves the rollout ranks waiting)
        self.side_rank = run.env.rank
        self._restart()

    def _restart(self) -> None:
        self.waited_s = self.sent_s = self.rollout_waited_s = 0.0
        self.queue_depth = self.batches = 0

    def _word(self, **word) -> None:
        self.bridge.broadcast(word)

    def start(self, held: dict | None, sampler: dict | None) -> None:
        """A resume hands the rollout ranks what they held at the checkpoint (`held`: this trainer's rank file's
        share, and on trainer 0 their counts and positions) and their samplers' positions; a fresh start, nothing
        (a checkpoint of another split was refused before anything was written: ds_train/checkpoint/resume.py
        check_resume)."""
        word = self.bridge.broadcast({"kind": "resume", "held": held is not None, "sampler": sampler})
        if not word["held"]:  # trainer 0's say: every trainer's rank file holds its share, or none does
            return
        routes, me = self.routes, self.side_rank
        back = {}
        for t in routes.sources(me):
            j = routes.rollout_jobs.index(t)
            mine = routes.keeper(me) and j in givers(routes.trainer_data[me], len(routes.rollout_jobs), routes.data)
            back[t] = {"held": held["held"].get(j, {}) if mine else None,
                       "meta": held["meta"][j] if routes.trainer_jobs[me] == routes.counter else None}
        self.bridge.exchange({t: m for t, m in back.items() if m["held"] is not None or m["meta"] is not None}, [])

    def batch(self, it: int, tally: Tally, completions: Any) -> list[list]:
        """Update `it`'s groups for this trainer: the weights of update it - 1 to the rollout ranks (every trainer
        walks them: gathered under ZeRO-3 and AutoTP, LoRA merged), then this trainer's share of batch `it`, from
        the rollout ranks that give it one (point to point), stale groups dropped. Trainer 0 counts every rollout
        rank's tally (summed exactly at the sync)."""
        run = self.run
        run.beat(it, "wait-rollouts")  # the word waits for the rollout ranks to finish what they generate ahead
        self.in_meeting = True
        t0 = time.perf_counter()
        self._word(kind="batch", batch=it)
        t1 = time.perf_counter()
        run.beat(it, "send-weights")
        self.bridge.send_weights(rollout_weights(run.engine.module), version=it - 1)
        t2 = time.perf_counter()
        run.beat(it, "wait-rollouts")
        got = self.bridge.exchange({}, self.routes.sources(self.side_rank))  # job rank order
        self.waited_s += (t1 - t0) + (time.perf_counter() - t2)
        self.sent_s += t2 - t1
        self.in_meeting = False
        mine = [[from_wire(w, self.tasks) for w in g] for t in sorted(got) if got[t]["share"] is not None
                for g in got[t]["share"]]
        metas = [m["meta"] for m in got.values() if m["meta"] is not None]
        if metas:  # trainer 0: every rollout rank's counts and waits
            for m in metas:
                for name, counts in m["tally"].items():
                    tally.add(name, **counts)
            self.rollout_waited_s += max(m["waited_s"] for m in metas)
            self.queue_depth = max(self.queue_depth, max(m["queue"] for m in metas))
        if run.env.is_main:
            completions.add(it, "train", [e for g in mine for e, _ in g], [v for g in mine for _, v in g])
        self.batches += 1
        return self.staleness.keep(mine, policy_version=it - 1)

    def metrics(self) -> dict[str, float]:
        """Since the last log: staleness, each side's wait for the other (per iteration), the rollout ranks' queue
        depth (batches generated ahead) and the weights' send time (trainer 0's, per iteration)."""
        n = max(1, self.batches)
        out = self.staleness.metrics() | {
            "async/trainer_wait_s": self.waited_s / n, "async/rollout_wait_s": self.rollout_waited_s / n,
            "async/queue_depth": float(self.queue_depth), "async/weights_send_s": self.sent_s / n}
        self.staleness.restart()
        self._restart()
        return out

    def save_state(self) -> dict:
        """For a checkpoint (every trainer): each trainer keeps its own share of the batches the rollout ranks hold
        (`rank_state`, its rank file), trainer 0 their counts, next batches and samplers, which it merges by task
        and hands to the other trainers (the checkpoint's common state)."""
        import torch  # noqa: F401 - the broadcast's tensors

        from ds_train import dist

        self.in_meeting = True
        self._word(kind="save")
        got = self.bridge.exchange({}, self.routes.sources(self.side_rank))
        self.in_meeting = False
        routes = self.routes
        self.saved = {"rollout_ranks": len(routes.rollout_jobs),
                      "held": {routes.rollout_jobs.index(t): m["held"] for t, m in got.items() if m["held"] is not None},
                      "meta": {routes.rollout_jobs.index(t): {k: v for k, v in m["meta"].items() if k != "sampler"}
                               for t, m in got.items() if m["meta"] is not None}}
        metas = sorted((routes.rollout_jobs.index(t), m["meta"]) for t, m in got.items() if m["meta"] is not None)
        merged = merge_states([m["sampler"] for _, m in metas], self.shards) if metas else None
        return dist.broadcast_object(merged)

    def rank_state(self) -> dict:
        return {"async": self.saved} if self.saved else {}

    def state(self) -> dict:
        """What the loop's checkpoint state records of the split (every trainer reads it back at a resume)."""
        return {"rollout_ranks": len(self.shards)}

    def close(self) -> None:
        """The rollout ranks leave (every trainer, once, at a meeting's boundary: the end of the run or a stop)."""
        if self.open:
            self.open = False
            self._word(kind="stop")
