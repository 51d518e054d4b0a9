"""Batch arithmetic, written out once, as pure functions with loud errors.

DeepSpeed's invariant: train_batch_size = train_micro_batch_size_per_gpu
                                          x gradient_accumulation_steps x data-parallel size,
where the data-parallel size is the world size divided by the sequence- and tensor-parallel sizes
(ds_train/plan/parallel.py): the ranks of one data-parallel group read the same batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ds_train.config.fields import POSITIVE, out_of_range
from ds_train.errors import UserError


@dataclass(frozen=True)
class BatchPlan:
    micro_batch_size: int  # sequences per rank per forward (train_micro_batch_size_per_gpu)
    grad_accum_steps: int  # micro-batches per rank per optimizer step
    data_parallel_size: int  # ranks that read different batches (the world, unless sequence / tensor > 1)
    seq_len: int
    rows: int = 1  # sequences a sample is: 2 for a preference pair (sample_rows), else 1

    @property
    def global_batch_size(self) -> int:  # sequences per optimizer step (train_batch_size)
        return self.micro_batch_size * self.grad_accum_steps * self.data_parallel_size

    @property
    def sequences_per_rank(self) -> int:
        """Sequences one data-parallel rank reads per optimizer step."""
        return self.micro_batch_size * self.grad_accum_steps

    @property
    def tokens_per_step(self) -> int:
        """Token positions per optimizer step (at most seq_len each sequence: padding included)."""
        return self.global_batch_size * self.rows * self.seq_len

    def describe(self, world_size: int | None = None) -> str:
        ranks = (f"world {self.data_parallel_size}" if world_size in (None, self.data_parallel_size) else
                 f"data-parallel {self.data_parallel_size} (world {world_size})")
        unit, each = ("pairs", " (2 sequences a pair)") if self.rows == 2 else ("seqs", "")
        return (f"batch: global {self.global_batch_size} {unit} = micro {self.micro_batch_size} x "
                f"accum {self.grad_accum_steps} x {ranks}; seq_len {self.seq_len}{each}; "
                f"{self.tokens_per_step:,} tokens/step")


def sample_rows(fmt: str) -> int:
    """The sequences one sample of data.format `fmt` is: a preference pair is two."""
    return 2 if fmt == "preference" else 1


def valid_global_batch_sizes(micro: int, data_parallel: int, near: int, count: int = 2) -> list[int]:
    """The multiples of micro x data-parallel size closest to `near` (the valid global batch sizes)."""
    unit = micro * data_parallel
    below = max(unit, (near // unit) * unit)
    options = {below, below + unit} | ({below - unit} if below - unit >= unit else set())
    return sorted(sorted(options, key=lambda g: (abs(g - near), g))[:count])


def valid_micro_batch_sizes(global_batch: int, data_parallel: int) -> list[int]:
    """Micro-batch sizes that divide the per-rank share of `global_batch`."""
    if global_batch % data_parallel:
        return []
    per_rank = global_batch // data_parallel
    return [m for m in range(1, per_rank + 1) if per_rank % m == 0]


def plan_batch(global_batch_size: int, micro_batch_size: int, data_parallel: int, seq_len: int,
               ranks: str = "", rows: int = 1) -> BatchPlan:
    """gradient_accumulation_steps = global / (micro x data-parallel size), or an error naming all
    three. `ranks` says where the data-parallel size comes from when it is not the world size
    (ParallelDims.derivation); empty: every rank is a data-parallel rank."""
    what = f"data-parallel size {data_parallel} ({ranks})" if ranks else f"world size {data_parallel}"
    if min(global_batch_size, micro_batch_size, data_parallel) <= 0:  # each key said as the config says it
        bad = [out_of_range(key, value, POSITIVE) for key, value in (("train.global_batch_size", global_batch_size),
                                                                      ("train.micro_batch_size", micro_batch_size))
               if value <= 0]
        raise UserError("; ".join(bad or [f"{what}: must be positive"]))
    accum, rest = divmod(global_batch_size, micro_batch_size * data_parallel)
    if rest or accum == 0:
        globals_ = valid_global_batch_sizes(micro_batch_size, data_parallel, global_batch_size)
        micros = valid_micro_batch_sizes(global_batch_size, data_parallel)
        hint = f"train.global_batch_size={' or '.join(map(str, globals_))}"
        if micros:
            near = sorted(micros, key=lambda m: abs(m - micro_batch_size))[:2]
            hint += f", or train.micro_batch_size={' or '.join(map(str, sorted(near)))}"
        raise UserError(
            f"train.global_batch_size={global_batch_size} is not a multiple of "
            f"train.micro_batch_size={micro_batch_size} x {what} "
            f"= {micro_batch_size * data_parallel}; use {hint}")
    return BatchPlan(micro_batch_size, accum, data_parallel, seq_len, rows)


def scaled_lr(lr: float, global_batch_size: int, reference_batch_size: int, mode: str) -> float:
    """Learning rate scaled with the batch size: linear (Goyal et al. 2017) or sqrt (Krizhevsky 2014)."""
    if mode == "none":
        return lr
    ratio = global_batch_size / reference_batch_size
    return lr * (ratio if mode == "linear" else math.sqrt(ratio))


def rollout_update_steps(contexts_per_rank: int, rollouts_per_context: int, plan: BatchPlan) -> int:
    """RIPT: optimizer steps in one pass over a rank's accepted rollouts, which must fill whole
    steps of train.global_batch_size / data-parallel size sequences."""
    rows = contexts_per_rank * rollouts_per_context
    if rows % plan.sequences_per_rank:
        raise UserError(f"ript: contexts_per_rank x rloo_batch_size = {rows} rollouts per rank must be a "
                        f"multiple of train.global_batch_size / data-parallel size = {plan.sequences_per_rank}; "
                        f"set train.global_batch_size to {rows * plan.data_parallel_size} (one optimizer step per "
                        f"iteration) or that divided by the steps you want")
    return rows // plan.sequences_per_rank


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def choices(values: list[int]) -> str:
    """`values` in words: "1, 2 or 4"."""
    return ", ".join(map(str, values[:-1])) + (" or " if len(values) > 1 else "") + str(values[-1])
