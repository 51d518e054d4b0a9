"""RIPT's pure parts: RLOO, the dynamic-sampling filter, the clipped loss, sharding, the tasks."""

from __future__ import annotations

import json

import pytest
import torch

from ds_train.errors import UserError
from ds_train.ript.algorithms import clipped_policy_loss, keep_mask, rloo_advantages
from ds_train.ript.sharding import shard_tasks
from ds_train.ript.tasks import BUILTIN, GuessNumber, load_task


def test_rloo_leaves_one_out():
    adv = rloo_advantages(torch.tensor([[1.0, 0.0, 0.0, 0.0]]))
    assert torch.allclose(adv, torch.tensor([[1.0, -1 / 3, -1 / 3, -1 / 3]]))
    assert torch.equal(rloo_advantages(torch.ones(3, 8)), torch.zeros(3, 8))
    assert torch.equal(rloo_advantages(torch.zeros(2, 4)), torch.zeros(2, 4))
    assert torch.allclose(rloo_advantages(torch.rand(5, 6)).sum(-1), torch.zeros(5), atol=1e-6)


def test_filter_keeps_only_groups_that_disagree():
    rewards = torch.tensor([[0, 0, 0, 0], [1, 0, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.float)
    assert keep_mask(rewards).tolist() == [False, True, True, False]


def test_padded_rows_give_zero_gradient():
    torch.manual_seed(0)
    logits = torch.randn(4, 6, requires_grad=True)
    logp = torch.log_softmax(logits, -1)
    old = logp.detach() + 0.1 * torch.randn(4, 6)
    mask = torch.ones(4, 6)
    mask[2:] = 0  # rows 2 and 3 are padding
    loss, stats = clipped_policy_loss(logp, old, torch.tensor([1.0, -0.5, 3.0, -2.0]), mask, 0.2, 0.28)
    loss.sum().backward()
    assert torch.count_nonzero(logits.grad[2:]) == 0 and torch.count_nonzero(logits.grad[:2]) > 0
    assert stats["tokens"] == 12


def test_clipping_uses_separate_low_and_high_bounds():
    logp = torch.log(torch.tensor([[1.5, 0.5]]))
    old = torch.zeros(1, 2)
    mask = torch.ones(1, 2)
    pos, _ = clipped_policy_loss(logp, old, torch.tensor([1.0]), mask, clip_low=0.2, clip_high=0.28)
    assert pos.sum().item() == pytest.approx(-(1.28 + 0.5))  # ratio 1.5 capped at 1 + high
    neg, _ = clipped_policy_loss(logp, old, torch.tensor([-1.0]), mask, clip_low=0.2, clip_high=0.28)
    assert neg.sum().item() == pytest.approx(1.5 + 0.8)  # ratio 0.5 floored at 1 - low


@pytest.mark.parametrize("world", [1, 2, 3, 7])
@pytest.mark.parametrize("mode", ["round_robin", "balanced"])
def test_sharding_covers_every_task_once(world, mode):
    costs = {name: float(len(name) * (i + 1)) for i, name in enumerate(sorted(BUILTIN))}
    shards = shard_tasks(costs, world, mode)
    flat = [t for s in shards for t in s]
    assert sorted(flat) == sorted(costs) and len(flat) == len(set(flat))
    assert shard_tasks(dict(reversed(list(costs.items()))), world, mode) == shards  # same on every rank
    if mode == "round_robin":
        sizes = [len(s) for s in shards]
        assert max(sizes) - min(sizes) <= 1


def test_balanced_sharding_evens_out_cost():
    costs = {"a": 10, "b": 9, "c": 1, "d": 1, "e": 1}
    loads = [sum(costs[t] for t in s) for s in shard_tasks(costs, 2, "balanced")]
    assert sorted(loads) == [11, 11]  # LPT: a | b, c; then d, e go to the lighter rank


def test_more_ranks_than_tasks_needs_allow_idle_ranks():
    with pytest.raises(UserError, match="allow_idle_ranks"):
        shard_tasks({"a": 1, "b": 1}, 3)
    assert shard_tasks({"a": 1, "b": 1}, 3, allow_idle_ranks=True)[2] == []


@pytest.mark.parametrize("name", sorted(BUILTIN))
def test_tasks_are_deterministic_split_and_solvable(name):
    task = load_task(name)
    train = task.contexts("train", 40, seed=3)
    assert train == task.contexts("train", 40, seed=3)
    heldout = task.contexts("heldout", 20, seed=3)
    assert len(train) == 40 and len(heldout) == 20
    assert not {str(c) for c in train} & {str(c) for c in heldout}
    for context in train[:10] + heldout[:10]:  # replaying the demonstration solves the episode
        text = task.demonstration(context)
        assert text.startswith(task.reset(context)) and text.endswith("\n")
        lines = text.splitlines()
        for turn, line in enumerate(lines):
            step = task.step(context, turn, line.rsplit("=", 1)[1])
            assert step.done == (turn == len(lines) - 1)
        assert step.success, (name, context, text)


def test_guess_is_interactive():
    task = GuessNumber()
    context = (7, 0, 9)
    assert task.reset(context) == "guess 0-9 ="
    assert task.step(context, 0, "4") == task.step(context, 0, " 4\n")
    assert task.step(context, 0, "4").observation == "higher =" and not task.step(context, 0, "4").done
    assert task.step(context, 1, "8").observation == "lower ="
    assert task.step(context, 2, "7").success
    assert task.step(context, 3, "5").done and not task.step(context, 3, "5").success
    assert task.step(context, 0, "x").done


def test_user_tasks_load_by_module_and_class():
    assert load_task("ds_train.ript.tasks:Reverse").name == "rev"
    with pytest.raises(UserError, match="neither a built-in"):
        load_task("nosuch")
    with pytest.raises(UserError, match="cannot load"):
        load_task("ds_train.ript.tasks:Nope")



def test_sampler_cycles_each_task_in_a_seeded_order_and_skips_solved_contexts():
    from ds_train.ript.sampler import ContextSampler, Tally

    tasks = [load_task("copy"), load_task("max")]
    a = ContextSampler(tasks, 5, seed=1, skip_solved=True, retest_after=2)
    tally = Tally(["copy", "max"])
    first = a.next(10, tally)  # two epochs of 5 contexts, alternating tasks
    assert [t.name for t, _, _ in first] == ["copy", "max"] * 5
    assert sorted(i for t, i, _ in first if t.name == "copy") == list(range(5))
    a.record("copy", 0, successes=8, k=8)  # solved: skipped twice, then re-tested
    b = ContextSampler(tasks, 5, seed=1, skip_solved=True, retest_after=2)
    b.load_state(json.loads(json.dumps({"tasks": a.state()["tasks"], "turns": {"copy,max": a.state()["turn"]}})))
    picked_a, picked_b = a.next(30, tally), b.next(30, Tally(["copy", "max"]))
    assert [(t.name, i) for t, i, _ in picked_a] == [(t.name, i) for t, i, _ in picked_b]  # state round trip
    copy0 = [k for k, (t, i, _) in enumerate(picked_a) if (t.name, i) == ("copy", 0)]
    # 30 picks reach copy:0 four times: skipped, skipped, re-tested, and skipped again (no result
    # was recorded for the re-test, so it still counts as solved)
    assert len(copy0) == 1 and tally.counts["copy"]["skipped"] == 3
    a.record("copy", 0, successes=3, k=8)
    assert 0 not in a.streams["copy"].solved


def test_tally_travels_as_one_vector():
    from ds_train.ript.sampler import Tally

    t = Tally(["b", "a"])
    t.add("a", successes=3, rollouts=8, accepted=1, checked=1)
    t.add("b", rollouts=8, rejected=1, checked=1)
    back = Tally.from_vector(["a", "b"], [2 * v for v in t.vector()])
    assert back.counts["a"]["successes"] == 6 and back.counts["b"]["rejected"] == 2
    m = t.metrics()
    assert m["ript/success_rate"] == 3 / 16 and m["ript/accepted"] == 1 and m["ript/checked"] == 2


def test_the_shipped_demonstrations_file_is_what_scripts_ript_demos_writes(tmp_path):
    """recipes/ript_sft.yaml trains on it: conversations whose plain rendering is each task's
    demonstration transcript."""
    import json
    import subprocess
    import sys

    from conftest import ROOT
    from ds_train.ript.tasks import BUILTIN

    subprocess.run([sys.executable, str(ROOT / "scripts" / "ript_demos.py"), "--out", str(tmp_path / "d.jsonl")],
                   check=True, capture_output=True, env={"PYTHONPATH": str(ROOT)})
    shipped = (ROOT / "recipes" / "data" / "ript_demos.jsonl").read_text()
    assert (tmp_path / "d.jsonl").read_text() == shipped
    records = [json.loads(line) for line in shipped.splitlines()]
    assert len(records) == 48 * len(BUILTIN)
    for r in records[::16]:
        task = BUILTIN[r["task"]]()
        context = next(c for c in task.contexts("train", 48, 0)
                       if task.demonstration_messages(c) == r["messages"])
        assert "".join(m["content"] for m in r["messages"]) == task.demonstration(context)
        assert [m["role"] for m in r["messages"]][:2] == ["user", "assistant"]


def test_task_weighting_accepted_shares_rollouts_by_accept_rate_and_resumes_exactly():
    from ds_train.ript.sampler import FLOOR, ContextSampler, Tally

    names = ["add", "copy", "sort"]
    tasks = [load_task(n) for n in names]
    rate = {"add": 0.0, "copy": 0.5, "sort": 1.0}  # sort: every context accepted, add: none

    def feed(sampler, picks):
        for task, index, _ in picks:
            accepted = (index % 100) < rate[task.name] * 100
            sampler.record(task.name, index, 4 if accepted else 0, 8)

    a = ContextSampler(tasks, 100, seed=1, weighting="accepted")
    uniform = ContextSampler(tasks, 100, seed=1)
    feed(a, a.next(300, Tally(names)))
    w = a.weights()
    assert w["add"] == FLOOR and w["sort"] > w["copy"] > w["add"]
    got = [t.name for t, _, _ in a.next(120, Tally(names))]
    assert got.count("sort") > got.count("copy") > got.count("add") >= 1  # the floor: add still drawn
    assert [t.name for t, _, _ in uniform.next(6, Tally(names))] == names * 2  # the default: in turn
    b = ContextSampler(tasks, 100, seed=1, weighting="accepted")
    b.load_state(json.loads(json.dumps({"tasks": a.state()["tasks"], "turns": {"add,copy,sort": a.state()["turn"]}})))
    assert [(t.name, i) for t, i, _ in a.next(50, Tally(names))] == [(t.name, i) for t, i, _ in b.next(50, Tally(names))]


@pytest.mark.parametrize("model_type,extra", [
    ("llama", {}), ("qwen3_moe", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}),
    ("mixtral", {"num_local_experts": 4})])
def test_the_weights_the_trainers_send_have_their_place_in_a_rollout_model_built_from_the_config(model_type, extra):
    """ds_train/ript/inputs.py check_weight_stream on the meta device: what the trainers send (rollout_weights:
    LoRA merged, a MoE's fused experts as in memory) fits the rollout ranks' model exactly. The checkpoint's names
    would not: 12 of a Qwen3-MoE's 35 had no place (found at the first meeting, after the whole start-up)."""
    import dataclasses

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from ds_train.config import RunConfig
    from ds_train.model.gathered import policy_weights
    from ds_train.ript.inputs import check_weight_stream

    hf = AutoConfig.for_model(model_type, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, vocab_size=128, **extra)
    cfg = RunConfig()
    check_weight_stream(cfg, hf)
    lora = dataclasses.replace(cfg.model.lora, rank=4, target_modules=("q_proj", "v_proj"))
    check_weight_stream(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, lora=lora)), hf)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf)
    unplaced = {n for n, _ in policy_weights(model)} - set(dict(model.named_parameters()))
    assert bool(unplaced) == (model_type != "llama"), unplaced  # the checkpoint's layout: a MoE's experts one by one
