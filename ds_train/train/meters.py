"""What the training loop measures, each component deciding when a step is its: the compute clock
(a rank's own work per step), the step meter (loss, throughput, memory, stragglers on logging
steps) and the evaluator (the held-out loss on evaluation steps). Every number is reduced across
ranks exactly: sums and counts, never means of means.
"""

from __future__ import annotations

import contextlib
import math
import time

from ds_train import dist
from ds_train.data.datasets import eval_micro_batches, sequence_shard
from ds_train.config import DpoConfig, TrainConfig
from ds_train.faults import loss_fault
from ds_train.model.routers import RouterCounts, load_metrics
from ds_train.observe.metrics import Interval, memory_gib, mfu
from ds_train.observe.reports import stragglers
from ds_train.run import Run
from ds_train.train.losses import forward_loss, token_mean
from ds_train.train.preference import mean_metrics, pair_losses


class ComputeClock:
    """The time a rank spends on its own work before a step's gradients are synchronised: loading
    its data (host time) and its forward passes (CUDA events on a GPU, whose kernels run after the
    host moves on). Compared across ranks on logging steps, it finds the straggler that everyone
    else waits for: a slow GPU, a slow disk, a busy host."""

    def __init__(self, cuda: bool):
        self.cuda, self.seconds, self.events = cuda, 0.0, []

    @contextlib.contextmanager
    def host(self):
        t0 = time.perf_counter()
        yield
        self.seconds += time.perf_counter() - t0

    @contextlib.contextmanager
    def device(self):
        if not self.cuda:
            with self.host():
                yield
            return
        import torch

        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        yield
        end.record()
        self.events.append((start, end))

    def read(self) -> float:
        """Seconds since the last read (waits for the timed kernels to finish)."""
        for start, end in self.events:
            end.synchronize()
            self.seconds += start.elapsed_time(end) / 1000
        total, self.seconds, self.events = self.seconds, 0.0, []
        return total
class StepMeter:
    """On logging steps: the step's loss (token-weighted over all ranks), throughput over the steps
    since the last logging step, memory maxima over ranks, and the slowest rank (one small gather
    of every rank's compute time per step; a rank above watchdog.straggler_ratio x the median is
    reported). Empty on other steps."""

    def __init__(self, run: Run, interval: Interval, clock: ComputeClock, straggler_ratio: float):
        self.run, self.interval, self.clock, self.straggler_ratio = run, interval, clock, straggler_ratio
        self.routers = RouterCounts(run.engine.module)  # a mixture-of-experts model's (empty for a dense one)
        config = getattr(run.engine.module, "config", None)
        self.aux_loss = bool(self.routers) and getattr(config, "output_router_logits", False) is True
        self.window_start, self.window_steps = time.perf_counter(), 0
        self.warm = False  # the first window holds one-time costs (allocations, kernel choice)

    def maybe_measure(self, step: int, result, skipped_steps: int) -> dict:
        """`result`: the step's StepResult (ds_train.train.loop); `skipped_steps`: so far, in all."""
        self.run.maybe_finish_startup()
        self.window_steps += 1
        if step not in self.interval:
            return {}
        run = self.run
        run.beat(step, "metrics")
        window_s = time.perf_counter() - self.window_start
        loss = token_mean(float(result.loss_sum), result.tokens, run.token_group)
        sums = getattr(result, "sums", None)  # a preference step's: its rewards and log-probs
        tokens_per_s = run.plan.tokens_per_step * self.window_steps / window_s
        grad_norm = result.grad_norm if result.grad_norm is not None else run.engine.get_global_grad_norm()
        metrics = {
            "train/loss": loss,
            "train/tokens": run.plan.tokens_per_step * step,
            "train/skipped_steps": skipped_steps,
            "optim/lr": float(run.engine.get_lr()[0]),
            "optim/grad_norm": float(grad_norm) if grad_norm is not None and math.isfinite(grad_norm) else None,
            "perf/tokens_per_s": tokens_per_s,
            "perf/step_time_s": window_s / self.window_steps,
            "perf/mfu": mfu(tokens_per_s / run.env.world_size, run.flops_per_token, run.peak_flops),
            "world_size": run.env.world_size,
            **(mean_metrics(sums, result.tokens, run.token_group) if sums else {}),
            **self.per_rank(step),
            **self.router_load(),
            **self.router_loss(result),
        }
        self.window_start, self.window_steps = time.perf_counter(), 0
        return metrics

    def router_loss(self, result) -> dict:
        """The router's auxiliary loss, the mean over the step's micro-batches on every rank (its own key:
        train/loss stays the language-modelling loss)."""
        if not self.aux_loss:
            return {}
        total, count = dist.all_reduce_sum([float(getattr(result, "aux_sum", 0.0)),
                                            float(getattr(result, "aux_count", 0))], self.run.token_group)
        return {"moe/aux_loss": total / count} if count else {}

    def router_load(self) -> dict:
        """Tokens per expert per layer since the last logging step, summed over the ranks (exact:
        counts; tensor-parallel ranks route the same tokens, counted once), and what they say."""
        if not self.routers:
            return {}
        run, counts = self.run, self.routers.take()
        flat = [float(n) for row in counts for n in row]
        if loss_fault(run.cfg.train.debug_loss_fault, run.zero_stage) != "router_counts_local":
            flat = [n / run.dims.tensor for n in dist.all_reduce_sum(flat)]
        it = iter(round(n) for n in flat)
        return load_metrics([[next(it) for _ in row] for row in counts], self.routers.routers)

    def per_rank(self, step: int) -> dict:
        """Every rank's compute time per step and memory (one small gather): the slowest rank, a
        straggler report, memory per rank and its maximum."""
        run = self.run
        gpu_gib, rss_gib = memory_gib(run.engine.device.type)
        ranks = dist.all_gather_floats([self.clock.read() / self.window_steps, gpu_gib, rss_gib])
        times, gpu, rss = ([r[i] for r in ranks] for i in range(3))
        slowest, ratio, median, slow = stragglers(times, self.straggler_ratio)
        if slow and self.warm:
            line = f"step {step}: straggler: " + "; ".join(
                f"{run.where(r)} takes {times[r] / median:.2f}x the median compute time per step of the other "
                f"ranks ({times[r]:.3f} s vs {median:.3f} s)" for r in slow)
            run.say(line)
            run.rank_log.warning(line)
        self.warm = True
        return {"perf/slowest_rank": slowest, "perf/straggler_ratio": ratio, "mem/max_rank_gib": max(gpu),
                "mem/max_rank_rss_gib": max(rss), "mem/rank_gpu_gib": gpu, "mem/rank_rss_gib": rss}


class Evaluator:
    """Token-weighted validation loss over a fixed set of the val split, exact across ranks; for
    preference data (`reference_logps`: the reference's, for val batches) the mean pair loss and
    the rewards of held-out pairs. `train`: the train section (eval_batches); `dpo`:
    the dpo section (preference data)."""

    def __init__(self, run: Run, val, interval: Interval, train: TrainConfig, dpo: DpoConfig,
                 reference_logps=None):
        self.run, self.val, self.interval, self.reference_logps = run, val, interval, reference_logps
        self.batches, self.dpo = train.eval_batches, dpo
        fast = run.speedups  # the loss's tiles as the start-up probe kept them
        self.tile_tokens, self.head_factor = (fast.loss_tile_tokens, fast.head_factor) if fast else (0, 1.0)

    def maybe_evaluate(self, step: int) -> dict[str, float]:
        return self.evaluate(step) if step in self.interval else {}

    def evaluate(self, step: int) -> dict[str, float]:
        import torch

        run, engine = self.run, self.run.engine
        engine.eval()
        if self.reference_logps is not None:
            return self.evaluate_pairs(step)
        loss, count = 0.0, 0
        with torch.no_grad():
            for batch in eval_micro_batches(self.val, self.batches, run.plan.micro_batch_size,
                                            run.data_rank, run.dims.data):
                run.beat(step, "eval")
                loss_sum, n = forward_loss(engine, sequence_shard(batch, run.sequence_rank, run.dims.sequence),
                                           self.tile_tokens, head_factor=self.head_factor)
                loss, count = loss + float(loss_sum), count + n
        engine.train()
        mean = token_mean(loss, count, run.token_group)
        return {"eval/loss": mean, "eval/ppl": math.exp(min(mean, 50.0))}

    def evaluate_pairs(self, step: int) -> dict[str, float]:
        import torch

        run, engine = self.run, self.run.engine
        sums, pairs = {}, 0
        with torch.no_grad():
            for batch in eval_micro_batches(self.val, self.batches, run.plan.micro_batch_size,
                                            run.data_rank, run.dims.data):
                run.beat(step, "eval")
                _, part = pair_losses(engine, batch, self.reference_logps, self.dpo)
                sums = {k: sums.get(k, 0.0) + v for k, v in part.items()}
                pairs += len(batch.pairs)
        engine.train()
        return mean_metrics(sums, pairs, run.token_group, prefix="eval/")


