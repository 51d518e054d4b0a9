"""The non-finite guard of the run machinery, for training and RIPT alike: an optimizer step whose
gradients are not finite is never applied, it is counted, and train.nonfinite=stop ends the run
after train.nonfinite_patience such steps in a row (every rank decides the same: the global norm is
the same on every rank).

DeepSpeed computes the global gradient norm and skips a non-finite step itself in every engine but
plain fp32 ZeRO-0, which steps a torch optimizer (it clips, then drops the norm): there
`backward_step` computes the norm at the accumulation boundary and skips the step the way
DeepSpeed's own optimizers skip an overflow.
"""

from __future__ import annotations

import contextlib
import math
from typing import Callable

from ds_train import dist
from ds_train.errors import NonFiniteStop


def engine_checks_grads(engine) -> bool:
    """Whether DeepSpeed itself finds and skips a non-finite step of this engine."""
    return bool(engine.zero_optimization() or engine.bfloat16_enabled() or engine.fp16_enabled())


def grad_norm(engine) -> float:
    """The global L2 norm of the gradients (after backward's all-reduce: the same on every rank),
    accumulated in fp64 as DeepSpeed's ZeRO accumulates its own: torch's fp32 norm on the CPU drifts
    with the size of the tensor (1e-6 relative at 262k elements, 8e-5 at 4M; `ds-train parity`
    found it as a gradient-norm difference from every ZeRO stage). Under AutoTP a split parameter's
    shards are summed over the tensor group; one kept whole counts once."""
    import torch
    from deepspeed.runtime.utils import is_model_parallel_parameter

    split = engine.autotp_size() > 1
    squares = [0.0, 0.0]  # whole, split
    for p in engine.module.parameters():
        if p.grad is not None:
            norm = float(torch.linalg.vector_norm(p.grad.detach(), dtype=torch.float64))
            squares[split and is_model_parallel_parameter(p)] += norm * norm
    if split:
        squares[1] = dist.all_reduce_sum([squares[1]], group=dist.tensor_parallel_group())[0]
    return math.sqrt(squares[0] + squares[1])


@contextlib.contextmanager
def _skipped_optimizer_step(optimizer):
    """Skip one step of a torch optimizer the way DeepSpeed's own optimizers skip an overflow:
    `optimizer.overflow` makes the engine count the step as skipped and hold the LR schedule."""
    optimizer.step = lambda *args, **kwargs: None  # shadows the class method for this one call
    optimizer.overflow = True
    try:
        yield
    finally:
        del optimizer.step
        optimizer.overflow = False


def backward_step(engine, loss, beat: Callable[[str], None] = lambda phase: None) -> float | None:
    """engine.backward(loss), then engine.step() (the engine owns accumulation, clipping and the
    optimizer); `beat` tells the heartbeat each phase. Returns the global gradient norm where
    ds_train computed it (fp32 ZeRO-0, at the accumulation boundary), else None: DeepSpeed's engine
    reports its own."""
    beat("backward")
    engine.backward(loss)
    norm, skip = None, contextlib.nullcontext()
    if engine.is_gradient_accumulation_boundary() and not engine_checks_grads(engine):
        norm = grad_norm(engine)
        if not math.isfinite(norm):
            skip = _skipped_optimizer_step(engine.optimizer)
    beat("step")
    with skip:
        engine.step()
    return norm


class NonFiniteGuard:
    """Counts the optimizer steps whose gradients were not finite (never applied: the engine's
    skipped_steps); train.nonfinite=stop raises NonFiniteStop after train.nonfinite_patience in a
    row."""

    def __init__(self, nonfinite: str, patience: int, rank_log):
        self.stop_after = patience if nonfinite == "stop" else 0
        self.rank_log = rank_log
        self.skipped = self.in_a_row = 0

    def observe(self, where: str, skipped: bool) -> None:
        """One optimizer step at `where` ('step 12', 'iteration 3'); `skipped`: not applied."""
        self.skipped += skipped
        self.in_a_row = self.in_a_row + 1 if skipped else 0
        if skipped:
            self.rank_log.info(f"{where}: gradients not finite, update skipped")
        if self.stop_after and self.in_a_row >= self.stop_after:
            raise NonFiniteStop(where, self.in_a_row)
