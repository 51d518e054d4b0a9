"""ds_train.plan.batch: accumulation arithmetic, its error messages, and LR scaling (pure functions)."""

from __future__ import annotations

import math
import re

import pytest

from ds_train.errors import UserError
from ds_train.plan.batch import BatchPlan, plan_batch, scaled_lr, valid_global_batch_sizes


@pytest.mark.parametrize("global_, micro, world, accum", [
    (32, 8, 1, 4), (32, 8, 2, 2), (32, 8, 4, 1), (32, 4, 2, 4), (96, 2, 3, 16), (1, 1, 1, 1),
])
def test_plan_batch_accumulation(global_, micro, world, accum):
    plan = plan_batch(global_, micro, world, seq_len=128)
    assert plan == BatchPlan(micro, accum, world, 128)
    assert plan.grad_accum_steps == accum
    assert plan.global_batch_size == global_ == micro * accum * world
    assert plan.sequences_per_rank == micro * accum
    assert plan.tokens_per_step == global_ * 128


def test_describe_names_the_numbers():
    text = plan_batch(64, 4, 2, 256).describe()
    assert "global 64" in text and "micro 4" in text and "accum 8" in text and "world 2" in text
    assert "16,384 tokens/step" in text


def test_a_preference_pair_is_one_sample_of_two_sequences():
    from ds_train.plan.batch import sample_rows

    assert sample_rows("preference") == 2 and sample_rows("sft") == sample_rows("text") == 1
    plan = plan_batch(32, 8, 2, 128, rows=sample_rows("preference"))
    assert plan.global_batch_size == 32 and plan.grad_accum_steps == 2 and plan.tokens_per_step == 32 * 2 * 128
    assert plan.describe() == ("batch: global 32 pairs = micro 8 x accum 2 x world 2; seq_len 128 (2 sequences a "
                               "pair); 8,192 tokens/step")


def test_plan_is_frozen():
    plan = plan_batch(32, 8, 1, 128)
    with pytest.raises(Exception):
        plan.grad_accum_steps = 2  # type: ignore[misc]


def _alternatives(msg: str) -> tuple[list[int], list[int]]:
    globals_ = re.search(r"use train\.global_batch_size=([\d ]+(?:or [\d ]+)*)", msg)
    micros = re.search(r"train\.micro_batch_size=([\d ]+(?:or [\d ]+)*)$", msg)
    parse = lambda m: [int(x) for x in m.group(1).split(" or ")] if m else []
    return parse(globals_), parse(micros)


def test_error_names_all_three_numbers_and_their_product():
    with pytest.raises(UserError) as e:
        plan_batch(30, 4, 2, 128)
    msg = str(e.value)
    assert "train.global_batch_size=30" in msg
    assert "train.micro_batch_size=4" in msg
    assert "world size 2" in msg
    assert "= 8" in msg


@pytest.mark.parametrize("global_, micro, world", [
    (30, 4, 2), (30, 8, 1), (33, 4, 2), (4, 8, 1), (10, 4, 4), (100, 6, 8), (7, 2, 3), (48, 5, 3),
])
def test_proposed_alternatives_are_themselves_valid(global_, micro, world):
    with pytest.raises(UserError) as e:
        plan_batch(global_, micro, world, 64)
    globals_, micros = _alternatives(str(e.value))
    assert globals_, str(e.value)
    for g in globals_:  # feed each proposal back: it must plan without an error
        assert plan_batch(g, micro, world, 64).global_batch_size == g
    for m in micros:
        assert plan_batch(global_, m, world, 64).micro_batch_size == m
    if global_ % world == 0:
        assert micros, "a micro-batch alternative exists whenever world divides the global batch"


def test_alternatives_are_close_to_the_request():
    with pytest.raises(UserError) as e:
        plan_batch(30, 4, 2, 128)
    globals_, micros = _alternatives(str(e.value))
    assert globals_ == [24, 32]
    assert micros == [3, 5]


def test_global_smaller_than_micro_times_world():
    with pytest.raises(UserError) as e:
        plan_batch(4, 8, 1, 128)
    globals_, micros = _alternatives(str(e.value))
    assert min(globals_) >= 8
    assert micros == [2, 4]


def test_sweep_every_small_case_is_planned_or_explained():
    for world in range(1, 5):
        for micro in range(1, 7):
            for global_ in range(1, 41):
                if global_ % (micro * world) == 0:
                    plan = plan_batch(global_, micro, world, 8)
                    assert plan.micro_batch_size * plan.grad_accum_steps * plan.data_parallel_size == global_
                    continue
                with pytest.raises(UserError) as e:
                    plan_batch(global_, micro, world, 8)
                globals_, micros = _alternatives(str(e.value))
                for g in globals_:
                    plan_batch(g, micro, world, 8)
                for m in micros:
                    plan_batch(global_, m, world, 8)


def test_valid_global_batch_sizes_are_multiples_of_the_unit():
    for near in range(1, 50):
        options = valid_global_batch_sizes(4, 3, near)
        assert options == sorted(options) and len(options) == 2
        assert all(g % 12 == 0 and g > 0 for g in options)


@pytest.mark.parametrize("args", [(0, 8, 1), (32, 0, 1), (32, 8, 0), (-32, 8, 1)])
def test_non_positive_sizes_are_a_user_error(args):
    with pytest.raises(UserError, match="must be positive"):
        plan_batch(*args, seq_len=128)


def test_scaled_lr_none():
    assert scaled_lr(3e-4, 256, 64, "none") == 3e-4


def test_scaled_lr_linear():
    assert scaled_lr(3e-4, 256, 64, "linear") == pytest.approx(1.2e-3)
    assert scaled_lr(3e-4, 32, 64, "linear") == pytest.approx(1.5e-4)


def test_scaled_lr_sqrt():
    assert scaled_lr(3e-4, 256, 64, "sqrt") == pytest.approx(6e-4)
    assert scaled_lr(1e-3, 32, 64, "sqrt") == pytest.approx(1e-3 / math.sqrt(2))


@pytest.mark.parametrize("mode", ["none", "linear", "sqrt"])
def test_scaled_lr_is_identity_at_the_reference_batch(mode):
    assert scaled_lr(2e-4, 128, 128, mode) == pytest.approx(2e-4)
