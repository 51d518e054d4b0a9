"""ds_train/ript/algorithms.py: every advantage estimator, loss aggregation mode, KL estimator, rollout
correction (truncated importance sampling) and the overlong penalty against values computed by hand on
fixed tensors (1e-7), and the aggregation's exactness when the same rollouts are split into other
micro-batches or ranks."""

from __future__ import annotations

import math

import pytest
import torch

from ds_train.ript.algorithms import (ADVANTAGES, KL_ESTIMATORS, LOSS_AGG_MODES, Norms, PolicyStats, aggregate,
                                      advantages, keep_mask, logp_mismatch, overlong_penalty, rollout_correction)
from ds_train.ript.sampler import Tally, std_from_sums

REWARDS = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 0.0]])


def close(got: torch.Tensor, want: list) -> bool:
    return torch.allclose(got.double(), torch.tensor(want, dtype=torch.float64), rtol=0, atol=1e-7)


def test_rloo_by_hand():
    # group 1: each 1 sees the others' mean (0 + 0 + 1) / 3 = 1/3; each 0 sees 2/3
    # group 2: each 1 sees (1 + 1 + 0) / 3 = 2/3; the 0 sees 1
    assert close(advantages("rloo", REWARDS, "group", None),
                 [[2 / 3, -2 / 3, -2 / 3, 2 / 3], [1 / 3, 1 / 3, 1 / 3, -1.0]])


def test_grpo_group_batch_and_none_by_hand():
    # group 1: mean 1/2, unbiased std sqrt(4 x 1/4 / 3) = sqrt(1/3); group 2: mean 3/4, std sqrt(3/16 x 4/3) = 1/2
    s1, s2 = math.sqrt(1 / 3), 0.5
    eps = 1e-6
    assert close(advantages("grpo", REWARDS, "group", None),
                 [[0.5 / (s1 + eps), -0.5 / (s1 + eps), -0.5 / (s1 + eps), 0.5 / (s1 + eps)],
                  [0.25 / (s2 + eps)] * 3 + [-0.75 / (s2 + eps)]])
    # batch: the 8 rewards (5 ones): mean 5/8, unbiased std sqrt((5 - 25/8) / 7)
    batch = math.sqrt((5 - 25 / 8) / 7)
    assert std_from_sums(8, 5, 5) == pytest.approx(batch, abs=1e-12)
    assert std_from_sums(8, 5, 5) == pytest.approx(float(REWARDS.flatten().std()), abs=1e-7)
    assert close(advantages("grpo", REWARDS, "batch", batch),
                 [[0.5 / (batch + eps), -0.5 / (batch + eps), -0.5 / (batch + eps), 0.5 / (batch + eps)],
                  [0.25 / (batch + eps)] * 3 + [-0.75 / (batch + eps)]])
    assert close(advantages("grpo", REWARDS, "none", None), [[0.5, -0.5, -0.5, 0.5], [0.25, 0.25, 0.25, -0.75]])
    assert sorted(ADVANTAGES) == ["grpo", "rloo"]


def test_the_filter_keeps_groups_whose_rewards_differ_continuous_ones_too():
    rewards = torch.tensor([[0.0, 0.0, 0.0], [1.0, 0.0, 0.0], [1.0, 1.0, 1.0], [0.5, 0.5, 0.25]])
    assert keep_mask(rewards).tolist() == [False, True, False, True]


def _per_token():
    # rows: two rollouts of 3 and 1 valid tokens, a padding row
    per_token = torch.tensor([[1.0, 2.0, 3.0, 0.0], [4.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    return per_token, mask


def test_each_aggregation_mode_by_hand():
    per_token, mask = _per_token()
    norms = Norms(tokens=4, sequences=2, max_tokens=8)
    assert float(aggregate(per_token, mask, "token-mean", norms)) == pytest.approx(10 / 4, abs=1e-7)
    # the mean of each rollout's token mean: (6/3 + 4/1) / 2
    assert float(aggregate(per_token, mask, "seq-mean-token-mean", norms)) == pytest.approx(3.0, abs=1e-7)
    # Dr. GRPO: the token sums over rollouts x the longest a rollout may be: 10 / (2 x 8)
    assert float(aggregate(per_token, mask, "seq-mean-token-sum-norm", norms)) == pytest.approx(10 / 16, abs=1e-7)
    assert float(aggregate(per_token, mask, "token-mean", norms, scale=4.0)) == pytest.approx(10.0, abs=1e-6)
    padded = per_token.clone()
    padded[2] = 7.0  # padding weighs nothing
    assert float(aggregate(padded, mask, "seq-mean-token-mean", norms)) == pytest.approx(3.0, abs=1e-7)
    with pytest.raises(ValueError, match="unknown loss aggregation 'sum'; one of token-mean, "):
        aggregate(per_token, mask, "sum", norms)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_the_aggregated_loss_is_the_same_however_the_rollouts_are_split(mode):
    """The loss and its gradient over 12 rollouts of different lengths: in one micro-batch, in
    micro-batches of 5, 3 and 4 rows, and in two 'ranks' whose shares are summed, each with the
    step's global counts: equal (1e-6), as the engine sums what every rank and micro-batch gives."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(12, 7, generator=gen, requires_grad=True)
    lengths = torch.randint(0, 8, (12,), generator=gen)
    mask = (torch.arange(7)[None, :] < lengths[:, None]).float()
    norms = Norms(float(mask.sum()), float((mask.sum(-1) > 0).sum()), 7.0)

    def loss_of(parts):
        logits.grad = None
        total = sum(aggregate(torch.tanh(logits[p]) * mask[p], mask[p], mode, norms) for p in parts)
        total.backward()
        return float(total), logits.grad.clone()

    whole, g_whole = loss_of([list(range(12))])
    for parts in ([list(range(5)), list(range(5, 8)), list(range(8, 12))],
                  [[0, 2, 4, 6, 8, 10], [1, 3, 5, 7, 9, 11]]):
        got, grad = loss_of(parts)
        assert got == pytest.approx(whole, abs=1e-6) and torch.allclose(grad, g_whole, atol=1e-7)


def test_kl_estimators_are_their_formulas():
    logp = torch.log(torch.tensor([0.5, 0.2, 0.9]))
    ref = torch.log(torch.tensor([0.4, 0.3, 0.9]))
    assert close(KL_ESTIMATORS["k1"](logp, ref), [math.log(0.5 / 0.4), math.log(0.2 / 0.3), 0.0])
    k3 = [0.4 / 0.5 - math.log(0.4 / 0.5) - 1, 0.3 / 0.2 - math.log(0.3 / 0.2) - 1, 0.0]
    assert close(KL_ESTIMATORS["k3"](logp, ref), k3)
    assert all(v >= 0 for v in k3)
    assert float(KL_ESTIMATORS["k3"](torch.tensor([0.0]), torch.tensor([30.0]))) == 10.0  # clamped as verl does


def test_the_soft_overlong_penalty_is_dapos():
    # max 20 tokens, buffer 4: free up to 16, then -1/4 per token, -1 at 20
    assert [overlong_penalty(n, 20, 4, 1.0) for n in (10, 16, 17, 18, 20)] == [0.0, 0.0, -0.25, -0.5, -1.0]
    assert overlong_penalty(18, 20, 4, 0.5) == -0.25
    assert overlong_penalty(20, 20, 0, 1.0) == 0.0  # off


def test_the_tally_gives_reward_truncation_and_zero_std_statistics_from_sums():
    tally = Tally(["a", "b"])
    tally.add("a", successes=1, rollouts=4, checked=1, accepted=1, truncated=1, reward=1.5, reward_sq=1.25)
    tally.add("b", successes=0, rollouts=4, checked=1, rejected=1, reward=0.0, reward_sq=0.0)
    merged = Tally.from_vector(["a", "b"], [x + y for x, y in zip(tally.vector(), tally.vector())])  # two ranks
    m = merged.metrics()
    assert m["ript/reward_mean"] == pytest.approx(3.0 / 16)
    assert m["ript/reward_std"] == pytest.approx(std_from_sums(16, 3.0, 2.5))
    assert m["ript/truncated_frac"] == 2 / 16 and m["ript/frac_reward_zero_std"] == 0.5
    assert merged.counts["a"]["reward"] == 3.0 and merged.counts["a"]["truncated"] == 2


# the trainer's log-probs (pi_old) and the rollout engine's (pi_rollout) of two rollouts of 3 tokens; the
# second's last token is padding (mask 0)
OLD = torch.tensor([[-1.0, -2.0, -0.5], [-0.2, -3.0, -9.0]])
ROLLOUT = torch.tensor([[-1.5, -1.0, -0.5], [-0.2, -2.0, -1.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])


def test_token_tis_by_hand():
    """min(exp(old - rollout), cap) per token: exp(0.5) = 1.6487 stays under cap 2, exp(-1) = 0.3679, exp(0) = 1;
    the padding's weight is 0 whatever its ratio (exp(-8) here)."""
    got = rollout_correction("tis", OLD, ROLLOUT, MASK, cap=2.0)
    assert close(got, [[math.exp(0.5), math.exp(-1.0), 1.0], [1.0, math.exp(-1.0), 0.0]])
    capped = rollout_correction("tis", ROLLOUT, OLD, MASK, cap=2.0)  # the other way round: exp(1) is capped
    assert close(capped, [[math.exp(-0.5), 2.0, 1.0], [1.0, 2.0, 0.0]])
    live = OLD.clone().requires_grad_()
    assert not rollout_correction("tis", live, ROLLOUT, MASK, 2.0).requires_grad  # a weight, never a gradient path


def test_sequence_tis_by_hand():
    """One weight per rollout: min(exp(sum of its tokens' old - rollout), cap). Row 1: 0.5 - 1 + 0 = -0.5;
    row 2 (its padding left out): 0 - 1 = -1; reversed, row 1's exp(0.5) stays, row 2's exp(1) is capped."""
    got = rollout_correction("seq-tis", OLD, ROLLOUT, MASK, cap=2.0)
    assert close(got, [[math.exp(-0.5)] * 3, [math.exp(-1.0), math.exp(-1.0), 0.0]])
    assert close(rollout_correction("seq-tis", ROLLOUT, OLD, MASK, cap=2.0),
                 [[math.exp(0.5)] * 3, [2.0, 2.0, 0.0]])


def test_the_logprob_mismatch_and_its_sums_over_ranks():
    """Tokens, summed |diff| (0.5 + 1 + 0 + 0 + 1), tokens over 0.1 (3) and the largest, on the mask only
    (the padding's 8 is left out); over ranks the maximum is a maximum, every other field a sum."""
    tokens, total, over, most = logp_mismatch(OLD, ROLLOUT, MASK)
    assert (tokens, over) == (5.0, 3.0) and total == pytest.approx(2.5) and most == pytest.approx(1.0)
    a = PolicyStats(tokens=4.0, rollout_tokens=tokens, rollout_diff=total, rollout_over=over, rollout_diff_max=most)
    b = PolicyStats(tokens=1.0, rollout_tokens=1.0, rollout_diff=0.25, rollout_diff_max=0.25)
    both = a + b  # two updates on one rank
    assert (both.tokens, both.rollout_tokens, both.rollout_diff_max) == (5.0, 6.0, 1.0)
    ranks = PolicyStats.from_reduced([x + y for x, y in zip(a.sums(), b.sums())], [max(a.maxima() + b.maxima())])
    assert ranks == both
    metrics = both.metrics()
    assert metrics["rollout/logp_diff_mean"] == pytest.approx(2.75 / 6) and metrics["rollout/logp_diff_max"] == 1.0
    assert metrics["rollout/logp_diff_frac_over_0.1"] == pytest.approx(3 / 6)
    assert "rollout/logp_diff_mean" not in PolicyStats(tokens=3.0).metrics()  # Hugging Face generate: none
