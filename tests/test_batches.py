"""Asynchronous RL's batches (ds_train/ript/batches.py): the weights that generate each batch, the seed of a rank's
batch, the episode between the sides, the trainers' shares, and the staleness kept and dropped."""

from __future__ import annotations

import pytest

from ds_train.ript.batches import Staleness, batch_seed, deal, from_wire, source_version, to_wire
from ds_train.ript.rollout import Episode
from ds_train.ript.tasks import load_task


@pytest.mark.parametrize("k", [0, 1, 2, 5])
def test_batch_i_comes_from_update_i_minus_1_minus_k_so_its_staleness_is_k_once_k_updates_passed(k):
    for i in range(1, 12):
        version = source_version(i, k)
        assert version == max(0, i - 1 - k) and 0 <= version <= i - 1
        assert (i - 1) - version == min(i - 1, k)  # at update i the policy is version i - 1


def test_a_batch_seed_is_its_seed_rank_and_index_alone():
    seeds = {batch_seed(3, rank, batch) for rank in range(4) for batch in range(1, 50)}
    assert len(seeds) == 4 * 49 and batch_seed(3, 1, 7) == batch_seed(3, 1, 7) != batch_seed(4, 1, 7)


@pytest.mark.parametrize("groups, trainers, want", [
    ([["a0", "a1"], ["b0", "b1"]], 2, [["a0", "a1"], ["b0", "b1"]]),  # one a trainer: the colocated run's shares
    ([["a0"], ["b0"], ["c0", "c1"], ["d0"]], 2, [["a0", "c0", "c1"], ["b0", "d0"]]),
    ([["a0", "a1", "a2"]], 2, [["a0", "a2"], ["a1"]]),
    ([["a0", "a1", "a2"]], 3, [["a0"], ["a1"], ["a2"]]),
    ([["a0", "a1"], ["b0", "b1", "b2"]], 4, [["a0"], ["b0", "b2"], ["a1"], ["b1"]]),
])
def test_every_group_goes_to_one_trainer(groups, trainers, want):
    shares = deal(groups, trainers)
    assert shares == want
    assert sorted(g for s in shares for g in s) == sorted(g for r in groups for g in r)


def test_an_episode_crosses_by_its_task_name_and_keeps_every_token():
    task = load_task("parity")
    e = Episode(task, "0110", 2, [1, 5, 6, 2], [0, 1, 1, 0], "x", turns=1, done=True, success=True, reward=1.0,
                logprobs=[0.0, -0.5, -0.25, 0.0], tool_calls=1, env_seconds=0.5)
    back, version = from_wire(to_wire(e, 7), {"parity": task})
    assert version == 7 and back.task is task
    assert (back.context, back.index, back.ids, back.action_mask, back.logprobs, back.success, back.reward) == (
        "0110", 2, [1, 5, 6, 2], [0, 1, 1, 0], [0.0, -0.5, -0.25, 0.0], True, 1.0)
    assert (back.tool_calls, back.env_seconds, back.turns, back.text) == (1, 0.5, 1, "x")


def test_groups_older_than_k_are_dropped_and_counted_and_the_rest_kept_by_age():
    s = Staleness(limit=1)
    groups = [[("e", 4), ("f", 4)], [("g", 3)], [("h", 2), ("i", 2), ("j", 2)]]
    kept = s.keep(groups, policy_version=4)
    assert kept == [["e", "f"], ["g"]] and s.dropped == 3 and s.histogram == {0: 2, 1: 1}
    m = s.metrics()
    assert m["async/staleness_mean"] == pytest.approx(1 / 3) and m["async/staleness_max"] == 1.0
    assert (m["async/stale_dropped"], m["async/staleness_0"], m["async/staleness_1"]) == (3.0, 2.0, 1.0)
    s.restart()
    assert s.metrics() == {"async/stale_dropped": 0.0}  # nothing kept: no staleness said
