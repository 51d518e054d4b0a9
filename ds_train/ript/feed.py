"""Asynchronous RL, the trainers' side (ript.rollout_ranks_per_node): each iteration the trainers send the rollout
ranks the weights of the last update and take the batch the next update trains on (`RolloutFeed.batch`).

Every exchange is a meeting of the whole job on the bridge (ds_train/dist/bridge.py), opened by trainer 0's word
to the rollout ranks (ds_train/ript/rollout_ranks.py reads it): `batch` (weights, then episodes), `save` (their
sampler and the batches they hold, for the trainers' checkpoint), `resume` (the same, back), `stop`. Between two
meetings each side works on its own: the rollout ranks generate the batches ahead that ript.max_staleness allows
while the trainers update.
"""

from __future__ import annotations

import time
from typing import Any

from ds_train.ript.batches import Staleness, deal, from_wire
from ds_train.ript.sampler import Tally, merge_states
from ds_train.model.gathered import policy_weights


class RolloutFeed:
    """The trainers' end of the bridge. `tasks`: every task as sharded over the rollout ranks (`shards`)."""

    def __init__(self, run: Any, bridge: Any, tasks: dict, shards: list[list[str]]):
        self.run, self.bridge, self.tasks, self.shards = run, bridge, tasks, shards
        self.staleness = Staleness(run.cfg.ript.max_staleness)
        self.saved: dict | None = None  # the rollout ranks' state at the last save (trainer 0's rank file)
        self.open = True
        self.in_meeting = False  # between a word and its answer (a failure there leaves the rollout ranks waiting)
        self._restart()

    def _restart(self) -> None:
        self.waited_s = self.sent_s = self.rollout_waited_s = 0.0
        self.queue_depth = self.batches = 0

    def _word(self, **word) -> None:
        self.bridge.broadcast(word)

    def start(self, held: dict | None, sampler: dict | None) -> None:
        """A resume hands the rollout ranks what they held at the checkpoint (`held`: trainer 0's rank file) and
        their samplers' positions; a fresh start, nothing (a checkpoint of another split was refused before
        anything was written: ds_train/checkpoint/resume.py check_resume)."""
        self._word(kind="resume", held=held["held"] if held else None, sampler=sampler)

    def batch(self, it: int, tally: Tally, completions: Any) -> list[list]:
        """Update `it`'s groups for this trainer: the weights of update it - 1 to the rollout ranks (every trainer
        walks them: gathered under ZeRO-3 and AutoTP, LoRA merged), then batch `it` from them, dealt over the
        trainers, stale groups dropped. Trainer 0 counts every rollout rank's tally (summed exactly at the sync)."""
        run = self.run
        run.beat(it, "wait-rollouts")  # the word waits for the rollout ranks to finish what they generate ahead
        self.in_meeting = True
        t0 = time.perf_counter()
        self._word(kind="batch", batch=it)
        t1 = time.perf_counter()
        run.beat(it, "send-weights")
        self.bridge.send_weights(policy_weights(run.engine.module, checkpoint_names=False), version=it - 1)
        t2 = time.perf_counter()
        run.beat(it, "wait-rollouts")
        sent = [m for m in self.bridge.gather(None) if m is not None]  # job rank order: the rollout ranks' own
        self.waited_s += (t1 - t0) + (time.perf_counter() - t2)
        self.sent_s += t2 - t1
        self.in_meeting = False
        groups = [[[from_wire(w, self.tasks) for w in g] for g in m["groups"]] for m in sent]
        mine = deal(groups, run.plan.data_parallel_size)[run.data_rank]
        if run.env.is_main:
            for m in sent:
                for name, counts in m["tally"].items():
                    tally.add(name, **counts)
            completions.add(it, "train", [e for by_rank in groups for g in by_rank for e, _ in g])
        self.rollout_waited_s += max(m["waited_s"] for m in sent)
        self.queue_depth = max(self.queue_depth, max(m["queue"] for m in sent))
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
        """For a checkpoint (every trainer): the rollout ranks' samplers merged by task; what each holds (the
        batches generated ahead, where its sampler is) kept for trainer 0's rank file (`rank_state`)."""
        self.in_meeting = True
        self._word(kind="save")
        held = [m for m in self.bridge.gather(None) if m is not None]
        self.in_meeting = False
        self.saved = {"rollout_ranks": len(held), "held": [{k: v for k, v in m.items() if k != "sampler"}
                                                          for m in held]}
        return merge_states([m["sampler"] for m in held], self.shards)

    def rank_state(self) -> dict:
        return {"async": self.saved} if self.run.env.is_main and self.saved else {}

    def state(self) -> dict:
        """What the loop's checkpoint state records of the split (every trainer reads it back at a resume)."""
        return {"rollout_ranks": len(self.shards)}

    def close(self) -> None:
        """The rollout ranks leave (every trainer, once, at a meeting's boundary: the end of the run or a stop)."""
        if self.open:
            self.open = False
            self._word(kind="stop")
