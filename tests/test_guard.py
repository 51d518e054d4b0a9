"""ds_train.guard: the non-finite guard (pure) and the gradient norm it computes where DeepSpeed
does not (fp32 ZeRO-0). Skipped steps through the real launcher: test_checkpoint.py (training) and
test_ript_trainer.py (RIPT)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from ds_train.errors import NonFiniteStop
from ds_train.guard import NonFiniteGuard, grad_norm


def test_skipped_steps_are_counted_and_stop_after_the_patience_in_a_row():
    guard = NonFiniteGuard("stop", 2, logging.getLogger("test"))
    guard.observe("step 1", True)
    guard.observe("step 2", False)  # an applied step in between: the count starts again
    guard.observe("step 3", True)
    assert (guard.skipped, guard.in_a_row) == (2, 1)
    with pytest.raises(NonFiniteStop) as e:
        guard.observe("iteration 4", True)
    assert str(e.value).startswith("iteration 4: 2 consecutive steps with non-finite gradients")
    assert e.value.exit_code == 3
    skip = NonFiniteGuard("skip", 2, logging.getLogger("test"))
    for s in range(5):
        skip.observe(f"step {s}", True)
    assert skip.skipped == 5  # skip never stops


def test_the_gradient_norm_is_accumulated_in_fp64():
    """torch's fp32 norm on the CPU drifts with the tensor's size; DeepSpeed's ZeRO accumulates in
    fp64, and so does ds_train's own (fp32 ZeRO-0): the two must agree for `ds-train parity`."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.zeros(4_000_000)), torch.nn.Parameter(torch.zeros(3))]
    params[0].grad, params[1].grad = torch.randn(4_000_000) * 1e-3, torch.tensor([3.0, 4.0, 0.0])
    engine = SimpleNamespace(module=SimpleNamespace(parameters=lambda: iter(params)), autotp_size=lambda: 1)
    exact = float(torch.cat([p.grad.double() for p in params]).norm())
    assert abs(grad_norm(engine) - exact) / exact < 1e-12
    assert abs(float(params[0].grad.norm()) - float(params[0].grad.double().norm())) > 1e-6 * exact  # the drift
