"""The per-task counts and policy statistics of RIPT's iterations, summed exactly over the ranks every
ript.sync_every iterations (SyncedCounts), and carried across a resume in each rank's file."""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import asdict
from typing import Any

from ds_train import dist
from ds_train.observe.metrics import Interval
from ds_train.ript.algorithms import PolicyStats
from ds_train.ript.sampler import Tally


class SyncedCounts:
    """Per-task counts, policy statistics and rollout time of the iterations since the last sync,
    summed (exactly) over ranks every ript.sync_every iterations and at the last."""

    def __init__(self, job: Any, interval: Interval):
        self.job, self.interval, self.names = job, interval, sorted(job.sampled or job.tasks)
        self._restart()

    def _restart(self) -> None:
        self.window, self.policy = Tally(self.names), PolicyStats()
        self.started, self.rollout_s, self.iterations = time.perf_counter(), 0.0, 0

    def state(self) -> dict:
        """This rank's counts since the last sync (its rank file carries them across a resume)."""
        return {"window": self.window.as_dict(), "policy": asdict(self.policy), "rollout_s": self.rollout_s,
                "iterations": self.iterations, "elapsed_s": time.perf_counter() - self.started}

    def load_state(self, saved: dict) -> None:
        if not saved:
            return
        for name, counts in saved["window"].items():
            self.window.add(name, **counts)
        self.policy = PolicyStats(**saved["policy"])
        self.rollout_s, self.iterations = saved["rollout_s"], saved["iterations"]
        self.started = time.perf_counter() - saved["elapsed_s"]

    @contextlib.contextmanager
    def rollouts(self):
        t0 = time.perf_counter()
        yield
        self.rollout_s += time.perf_counter() - t0

    def maybe_sync(self, it: int, state: Any) -> dict:
        self.iterations += 1
        if it not in self.interval:
            return {}
        self.job.run.beat(it, "sync")
        self.job.run.rank_log.info(f"iteration {it} counts {json.dumps(self.window.as_dict())}")  # this rank's own
        counts = Tally.from_vector(self.names, dist.all_reduce_sum(self.window.vector()))
        rollout_s = dist.all_reduce_max([self.rollout_s])[0]
        state.totals = {n: {k: v + counts.counts[n][k] for k, v in c.items()} for n, c in state.totals.items()}
        policy = PolicyStats.from_reduced(dist.all_reduce_sum(self.policy.sums()),
                                          dist.all_reduce_max(self.policy.maxima()))
        metrics = counts.metrics() | policy.metrics(reference=self.job.reference is not None) | {
            "policy/skipped_steps": self.job.run.guard.skipped,  # so far; the same on every rank
            "perf/rollouts_per_s": counts.total("rollouts") / max(rollout_s, 1e-9),
            "perf/iteration_s": (time.perf_counter() - self.started) / self.iterations,
            "optim/lr": float(self.job.run.engine.get_lr()[0])}
        if counts.total("env_s"):  # the share of the ranks' time their rollouts waited on environments and tools
            metrics["perf/env_frac"] = counts.total("env_s") / (
                self.job.run.env.world_size * (time.perf_counter() - self.started))
        state.synced = {k: v for k, v in metrics.items() if k.startswith(("ript/", "policy/"))}
        self._restart()
        return metrics
