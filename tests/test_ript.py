"""RIPT's pure parts: RLOO, the dynamic-sampling filter, the clipped loss, sharding, the tasks."""

from __future__ import annotations

import json

import pytest
import torch

from ds_train.errors import UserError
from ds_train.ript.rloo import clipped_policy_loss, keep_mask, rloo_advantages
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
    loss.backward()
    assert torch.count_nonzero(logits.grad[2:]) == 0 and torch.count_nonzero(logits.grad[:2]) > 0
    assert stats["tokens"] == 12


def test_clipping_uses_separate_low_and_high_bounds():
    logp = torch.log(torch.tensor([[1.5, 0.5]]))
    old = torch.zeros(1, 2)
    mask = torch.ones(1, 2)
    pos, _ = clipped_policy_loss(logp, old, torch.tensor([1.0]), mask, clip_low=0.2, clip_high=0.28)
    assert pos.item() == pytest.approx(-(1.28 + 0.5))  # ratio 1.5 capped at 1 + high
    neg, _ = clipped_policy_loss(logp, old, torch.tensor([-1.0]), mask, clip_low=0.2, clip_high=0.28)
    assert neg.item() == pytest.approx(1.5 + 0.8)  # ratio 0.5 floored at 1 - low


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


# --- through the real launcher ------------------------------------------------------------------

from pathlib import Path  # noqa: E402

from conftest import BIN, ROOT, TINY_MODEL, free_port, run_cmd, write_config  # noqa: E402
from ript_policies import K, wins  # noqa: E402

SCRIPTED_TASKS = ["add", "copy", "rev", "sort"]


@pytest.fixture(scope="module")
def tiny_policy(tmp_path_factory) -> Path:
    """A Hugging Face directory: a tiny Llama and a BPE trained on the task demonstrations."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from ds_train.data import train_tokenizer

    out = tmp_path_factory.mktemp("policy")
    texts = [t().demonstration(c) for t in BUILTIN.values() for c in t().contexts("train", 30, 0)]
    tok = train_tokenizer(texts, 300, out)
    torch.manual_seed(0)
    cfg = AutoConfig.for_model(**{**TINY_MODEL, "vocab_size": len(tok)})
    AutoModelForCausalLM.from_config(cfg).save_pretrained(out)
    return out


def ript_config(tmp: Path, policy: Path, **ript) -> Path:
    cfg = {"output_dir": str(tmp / "run"), "seed": 3,
           "model": {"path": str(policy), "dtype": "fp32"},
           "train": {"micro_batch_size": 4, "global_batch_size": 24, "seq_len": 64},
           "optim": {"lr": 1e-3, "warmup_steps": 0, "weight_decay": 0.0, "min_lr_ratio": 1.0},
           "checkpoint": {"every": 0, "save_final": True},
           "log": {"progress": False},
           "ript": {"tasks": SCRIPTED_TASKS, "policy": "ript_policies:Scripted", "iterations": 2,
                    "rloo_batch_size": K, "contexts_per_rank": 3, "rollout_contexts": 1,
                    "max_contexts_checked": 6, "train_contexts": 20, "eval_contexts": 8,
                    "eval_every": 0, **ript}}
    return write_config(tmp / "ript.yaml", cfg)


def launch_ript(config: Path, *overrides: str, ds_config: str = "zero2.json", timeout: float = 240):
    return run_cmd([str(BIN / "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()),
                    "--module", "ds_train", "ript", "--config", str(config),
                    "--ds-config", str(ROOT / "ds_configs" / ds_config), *overrides],
                   timeout=timeout, env={"PYTHONPATH": str(ROOT / "tests")})


def predict(iterations: int, quota: int, cap: int) -> list[dict]:
    """Replay the sampler rank by rank: what each rank must count, iteration by iteration."""
    from ds_train.ript.sampler import ContextSampler, Tally

    shards = shard_tasks({n: 20.0 for n in SCRIPTED_TASKS}, 2, "balanced")
    out = []
    samplers = [ContextSampler([load_task(n) for n in s], 20, 3) for s in shards]
    for _ in range(iterations):
        per_rank = []
        for sampler in samplers:
            tally, accepted, checked = Tally(SCRIPTED_TASKS), 0, 0
            while accepted < quota and checked < cap:  # rollout_contexts 1; the other rank never fills it
                (task, _, context), = sampler.next(1, tally)
                w = wins(task.name, context)
                keep = 0 < w < K
                tally.add(task.name, successes=w, rollouts=K, checked=1, accepted=int(keep), rejected=int(not keep))
                accepted, checked = accepted + keep, checked + 1
            per_rank.append(tally.as_dict())
        out.append(per_rank)
    return out, shards


def rank_counts(run_dir: Path, rank: int) -> list[dict]:
    lines = (run_dir / "logs" / f"rank_{rank}.log").read_text().splitlines()
    return [json.loads(line.split(" counts ", 1)[1]) for line in lines if " counts " in line]


def test_scripted_policy_counts_are_exact_and_summed_over_ranks(tiny_policy, tmp_path):
    """Rank 0 owns add and rev, which the scripted policy always solves: it accepts nothing and
    stops at its cap while rank 1 fills its quota; no hang, every count as predicted."""
    res = launch_ript(ript_config(tmp_path, tiny_policy))
    assert res.returncode == 0, res.out[-4000:]
    run_dir = tmp_path / "run"
    expected, shards = predict(2, quota=3, cap=6)
    assert shards == [["add", "rev"], ["copy", "sort"]]
    metrics = [m for m in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
               if "ript/accepted" in m]
    assert [m["step"] for m in metrics] == [1, 2]
    for it, m in enumerate(metrics):
        ranks = [rank_counts(run_dir, r)[it] for r in (0, 1)]
        assert ranks == expected[it]  # each rank's own counts, exactly
        for task in SCRIPTED_TASKS:  # each task's rollouts on exactly one rank
            owners = [r for r in (0, 1) if ranks[r][task]["rollouts"]]
            assert owners == [0 if task in shards[0] else 1]
        total = {key: sum(r[t][key] for r in ranks for t in SCRIPTED_TASKS) for key in ("accepted", "checked")}
        assert m["ript/accepted"] == total["accepted"] == 3  # rank 1's quota; rank 0 accepts none
        assert m["ript/checked"] == total["checked"]
        successes = sum(r[t]["successes"] for r in ranks for t in SCRIPTED_TASKS)
        rollouts = sum(r[t]["rollouts"] for r in ranks for t in SCRIPTED_TASKS)
        assert m["ript/success_rate"] == pytest.approx(successes / rollouts)  # not a mean of rank means
        assert ranks[0]["add"]["checked"] + ranks[0]["rev"]["checked"] == 6  # rank 0 hit its cap
    results = json.loads((run_dir / "ript_results.json").read_text())
    for task in SCRIPTED_TASKS:  # greedy eval is rollout 0: a success wherever wins >= 1
        heldout = load_task(task).contexts("heldout", 8, 3)
        want = sum(wins(task, c) >= 1 for c in heldout)
        assert results["eval"]["per_task"][task]["successes"] == want
    totals = results["train_counts"]
    assert sum(t["accepted"] for t in totals.values()) == 6
    assert results["shards"] == {"rank0": ["add", "rev"], "rank1": ["copy", "sort"]}


def test_resume_continues_exactly(tiny_policy, tmp_path):
    """2 iterations, then 2 more from the checkpoint == 4 straight: the sampler position, the
    per-context statistics (skip_solved) and the weights and optimizer all come back."""
    straight, split = tmp_path / "straight", tmp_path / "split"
    for d in (straight, split):
        d.mkdir()
    opts = {"skip_solved": True, "retest_after": 1, "train_contexts": 4}
    res = launch_ript(ript_config(straight, tiny_policy, iterations=4, **opts))
    assert res.returncode == 0, res.out[-4000:]
    res = launch_ript(ript_config(split, tiny_policy, iterations=2, **opts))
    assert res.returncode == 0, res.out[-4000:]
    res = launch_ript(ript_config(split, tiny_policy, iterations=4, **opts))
    assert res.returncode == 0, res.out[-4000:]
    assert "resumed from" in res.out and "at iteration 2" in res.out

    def logged(d):
        return {m["step"]: m for m in map(json.loads, (d / "run" / "metrics.jsonl").read_text().splitlines())}

    a, b = logged(straight), logged(split)
    for step in (3, 4):
        for key in ("ript/accepted", "ript/checked", "ript/skipped", "ript/success_rate"):
            assert a[step][key] == b[step][key], (step, key)
        assert a[step]["policy/loss"] == pytest.approx(b[step]["policy/loss"], rel=1e-5, abs=1e-7)
    assert a[3]["ript/skipped"] > 0  # solved contexts were being skipped right after the resume
    for rank in (0, 1):
        assert rank_counts(straight / "run", rank) == rank_counts(split / "run", rank)
    ra = json.loads((straight / "run" / "ript_results.json").read_text())
    rb = json.loads((split / "run" / "ript_results.json").read_text())
    assert ra["train_counts"] == rb["train_counts"] and ra["iteration"] == rb["iteration"] == 4


def test_bad_ript_input_is_one_line_and_writes_nothing(tiny_policy, tmp_path):
    from conftest import ds_train

    cfg = ript_config(tmp_path, tiny_policy)
    zero2 = str(ROOT / "ds_configs" / "zero2.json")
    cases = [(["train.global_batch_size=8"], "must be a multiple of train.global_batch_size / world size"),
             ([f"model.path={tmp_path}"], "neither a Hugging Face directory"),
             (["ript.tasks=[add,nosuch]"], "'nosuch' is neither a built-in task"),
             (["ript.rloo_batch_size=1"], "ript.rloo_batch_size: 1 must be at least 2"),
             (["ript.policy=nosuch:Policy"], "ript.policy: cannot load 'nosuch:Policy'")]
    for overrides, message in cases:  # one process: 12 rollouts per rank make one step of 12
        res = ds_train("ript", "--config", str(cfg), "--ds-config", zero2, "train.global_batch_size=12",
                       *overrides, timeout=120,
                       env={"PYTHONPATH": str(ROOT / "tests")})
        assert res.returncode == 2 and message in res.out, (overrides, res.out[-2000:])
        assert "Traceback" not in res.out and len(res.lines("ds-train: error:")) == 1, res.out
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_an_idle_rank_joins_every_collective(tiny_policy, tmp_path):
    """One task, two ranks: rank 1 owns nothing, yet sampling, update and evaluation finish."""
    res = launch_ript(ript_config(tmp_path, tiny_policy, tasks=["copy"], allow_idle_ranks=True))
    assert res.returncode == 0, res.out[-4000:]
    assert "   1  (idle)" in res.out
    idle = rank_counts(tmp_path / "run", 1)
    assert len(idle) == 2 and all(c["copy"]["checked"] == 0 for c in idle)
    busy = rank_counts(tmp_path / "run", 0)
    assert [c["copy"]["accepted"] for c in busy] == [3, 3]  # rank 0 fills its quota alone
