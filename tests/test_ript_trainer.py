"""The RIPT loop through the real launchers (2 CPU processes): exact counts over ranks, SIGTERM to
the launcher then an exact resume with a model policy, idle ranks, bad input that writes nothing,
and the policy update's loss and gradients against a computation by hand."""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path

import pytest

from conftest import (ROOT, SCRIPTED_TASKS, TESTS_ON_PATH, deepspeed_runner, ds_train, expect_error, free_port, node_launch, pids_with,
                      reap, ript_config, run_cmd, spawn, tree_listing)
from ds_train.checkpoint import commit as checkpoint
from ds_train.ript.sampler import ContextSampler, Tally
from ds_train.ript.sharding import shard_tasks
from ds_train.ript.tasks import load_task
from ript_policies import K, wins

pytestmark = pytest.mark.slow
ZERO2 = str(ROOT / "ds_configs" / "zero2.json")
TEMPLATE = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"  # the policy's plain transcript


def ript_args(config: Path, *overrides: str, runner: bool = False, nproc: int = 2) -> list[str]:
    return [*(deepspeed_runner if runner else node_launch)(nproc), "--module", "ds_train",
            "ript", "--config", str(config), "--ds-config", ZERO2, *overrides]


def launch_ript(config: Path, *overrides: str, timeout: float = 240):
    return run_cmd(ript_args(config, *overrides), timeout=timeout, env=TESTS_ON_PATH)


def predict(iterations: int, quota: int, cap: int) -> list[dict]:
    """Replay the sampler rank by rank: what each rank must count, iteration by iteration."""
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
                tally.add(task.name, successes=w, rollouts=K, checked=1, accepted=int(keep), rejected=int(not keep),
                          reward=w, reward_sq=w, turns=K)  # binary rewards: their squares are themselves; 1 turn each
                accepted, checked = accepted + keep, checked + 1
            per_rank.append(tally.as_dict())
        out.append(per_rank)
    return out, shards


def rank_counts(run_dir: Path, rank: int) -> list[dict]:
    lines = (run_dir / "logs" / f"rank_{rank}.log").read_text().splitlines()
    return [json.loads(line.split(" counts ", 1)[1]) for line in lines if " counts " in line]


def reference_bytes(run_dir: Path, rank: int) -> int:
    """What a rank's log says the parameters beyond the policy's hold: every live module of its
    process but the policy's, measured when the reference policy is reported (ds_train/train/reference.py)."""
    line = next(x for x in (run_dir / "logs" / f"rank_{rank}.log").read_text().splitlines()
                if "reference policy:" in x)
    assert "(every live module's, measured)" in line, line
    return int(line.split("policy's hold ")[1].split(" bytes")[0].replace(",", ""))


def logged(run_dir: Path) -> dict[int, dict]:
    return {m["step"]: m for m in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


@pytest.fixture(scope="module")
def scripted_run(tiny_policy, tmp_path_factory) -> tuple:
    """Two iterations with the scripted policy (2 ranks): a finished RIPT run directory."""
    tmp = tmp_path_factory.mktemp("scripted")
    return launch_ript(ript_config(tmp, tiny_policy, log={"plots": True})), tmp / "run"


def test_a_non_finite_update_is_skipped_counted_and_stops_the_run_as_training_does(tiny_policy, tmp_path):
    """The run machinery's non-finite guard in RIPT: train.debug_nonfinite_steps poisons the updates of
    iterations 1 and 2; each optimizer step is skipped (never applied) and counted, and
    train.nonfinite=stop with patience 2 ends the run with exit 3 before anything is saved."""
    config = ript_config(tmp_path, tiny_policy, iterations=4, train={"debug_nonfinite_steps": [1, 2],
                                                                     "nonfinite": "stop", "nonfinite_patience": 2})
    res = launch_ript(config)
    run_dir = tmp_path / "run"
    assert res.returncode == 3, res.out[-4000:]
    assert "iteration 2: 2 consecutive steps with non-finite gradients (train.nonfinite=stop" in res.out
    metrics = logged(run_dir)
    assert metrics[1]["policy/skipped_steps"] == 1 and metrics[1]["policy/tokens"] > 0
    assert 2 not in metrics  # the stop comes before iteration 2 is logged
    for r in (0, 1):
        assert "iteration 1: gradients not finite, update skipped" in (run_dir / "logs" / f"rank_{r}.log").read_text()
    assert not (run_dir / "checkpoints").exists()


def test_scripted_policy_counts_are_exact_and_summed_over_ranks(scripted_run):
    """Rank 0 owns add and rev, which the scripted policy always solves: it accepts nothing and
    stops at its cap while rank 1 fills its quota; no hang, every count as predicted."""
    res, run_dir = scripted_run
    assert res.returncode == 0, res.out[-4000:]
    expected, shards = predict(2, quota=3, cap=6)
    assert shards == [["add", "rev"], ["copy", "sort"]]
    metrics = [m for m in logged(run_dir).values() if "ript/accepted" in m]
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
        # one optimizer step per iteration: it starts from the rollout policy, so the PPO ratio is 1
        assert m["policy/ratio"] == 1.0 and m["policy/clip_frac"] == 0.0 and m["policy/tokens"] > 0
        assert ranks[0]["add"]["checked"] + ranks[0]["rev"]["checked"] == 6  # rank 0 hit its cap
    assert sorted(p.name for p in (run_dir / "plots").iterdir()) == ["heldout.png", "rewards.png", "success.png"]
    assert res.lines(f"plots: {run_dir}/plots/{{success,heldout,rewards}}.png"), res.out[-2000:]
    results = json.loads((run_dir / "ript_results.json").read_text())
    start, final = results["evals"][0], results["evals"][-1]
    assert (run_dir / "logs" / "train.log").read_text().splitlines()[-1] == (  # rank 0's last line
        f"ript: done, 2 iterations, held-out success {start['success_rate']:.3f} (iteration 0) -> "
        f"{final['success_rate']:.3f} (iteration 2); checkpoint step_00000002; run directory {run_dir.resolve()}")
    for task in SCRIPTED_TASKS:  # greedy eval is rollout 0: a success wherever wins >= 1
        heldout = load_task(task).contexts("heldout", 8, 3)
        want = sum(wins(task, c) >= 1 for c in heldout)
        assert results["eval"]["per_task"][task]["successes"] == want
    totals = results["train_counts"]
    assert sum(t["accepted"] for t in totals.values()) == 6
    stats, last = results["statistics"], results["last_sync"]  # the whole run's, and the last sync's
    assert stats["ript/accepted"] == 6 and stats["ript/checked"] == sum(t["checked"] for t in totals.values())
    assert stats["ript/frac_reward_zero_std"] == pytest.approx(1 - 6 / stats["ript/checked"])
    assert last["ript/accepted"] == 3 and last["policy/tokens"] > 0 and "ript/reward_mean" in last
    assert results["shards"] == {"rank0": ["add", "rev"], "rank1": ["copy", "sort"]}
    env = json.loads((run_dir / "env.json").read_text())  # the run machinery's record, as for train
    assert env["command"] == "ript" and env["world_size"] == 2 and env["launcher"] == "deepspeed"
    assert json.loads((run_dir / "ds_config.json").read_text())["train_batch_size"] == 24


MODEL_RIPT = dict(tasks=["parity", "max", "guess"], policy="", iterations=6, ppo_epochs=2, contexts_per_rank=2,
                  rollout_contexts=2, max_contexts_checked=8, train_contexts=4, eval_contexts=8, eval_every=2,
                  skip_solved=True, retest_after=1, sync_every=4)  # counts of a save before 4 are pending
MODEL_TRAIN = {"micro_batch_size": 4, "global_batch_size": 16}  # 2 contexts x K 4 = 8 rollouts per rank
LR, SCALED = 1e-3, 2e-3  # optim.lr_scaling=linear: global batch 16 against a reference of 8


def wait_for_iteration(proc, run_dir: Path, it: int, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    path = run_dir / "metrics.jsonl"
    while time.monotonic() < deadline:
        if path.is_file() and any(m.get("step", 0) >= it and ("ript/accepted" in m or "eval/success" in m)
                                  for m in map(json.loads, path.read_text().splitlines())):
            return
        if proc.poll() is not None:
            pytest.fail(f"ended before iteration {it}:\n{proc.communicate()[0][-3000:]}")
        time.sleep(0.05)
    pytest.fail(f"iteration {it} not reached in {timeout}s")


def test_sigterm_to_the_launcher_saves_and_the_resume_is_exact(sft_policy, tmp_path):
    """A model policy, PPO epochs 2, skip_solved: 6 iterations straight (through the older
    `python -m torch.distributed.launch`, which passes --local-rank) against a run whose `deepspeed`
    runner alone gets SIGTERM (it dies of it and passes nothing on: the ranks see it gone), then
    the same command again."""
    straight, split = tmp_path / "straight", tmp_path / "split"
    for d in (straight, split):
        d.mkdir()
    scaling = ("optim.lr_scaling=linear", "optim.reference_batch_size=8", f"data.chat_template={TEMPLATE}")
    data = {"name": "maxdata", "data": str(task_prompts(tmp_path / "max.jsonl", "max")), "stop": ["\n"]}
    model_ript = {**MODEL_RIPT, "tasks": ["parity", data, "guess"], "kl_coef": 0.02}  # a reference, a dataset

    cfg = ript_config(straight, sft_policy, MODEL_TRAIN, {"lr": LR}, **model_ript)
    res = run_cmd([sys.executable, "-m", "torch.distributed.launch", "--nproc_per_node", "2", "--master_port",
                   str(free_port()), "--module", "ds_train", "ript", "--config", str(cfg), "--ds-config", ZERO2,
                   *scaling], timeout=300)
    assert res.returncode == 0, res.out[-4000:]
    assert json.loads((straight / "run" / "env.json").read_text())["launcher"] == "torchrun"
    ref = logged(straight / "run")
    whole = sum(t.numel() * 4 for t in _initial_weights(sft_policy).values())
    assert [reference_bytes(straight / "run", r) for r in (0, 1)] == [whole, whole]  # ZeRO-2: a whole frozen copy

    cfg = ript_config(split, sft_policy, MODEL_TRAIN, {"lr": LR}, **model_ript)
    proc = spawn(ript_args(cfg, *scaling, "watchdog.debug_fault=slow:0:1.0", runner=True))  # slower (the ranks see the
    wait_for_iteration(proc, split / "run", 2)  # runner gone within a second), same numbers
    os.kill(proc.pid, signal.SIGTERM)  # the `deepspeed` runner alone, as a container runtime signals it
    res = reap(proc, timeout=90)  # every rank closed the output pipe: none is left
    assert not pids_with(str(split)), res.out[-3000:]
    assert res.returncode == -signal.SIGTERM, res.out[-3000:]  # the runner died of it (a shell says 143)
    assert "the deepspeed runner (pid" in res.out and "is gone; saving and stopping as for SIGTERM" in res.out
    saved = checkpoint.latest_complete(split / "run" / "checkpoints")
    k = int(saved.split("_")[1])
    assert 2 <= k < 6 and (split / "run" / "checkpoints" / "latest").read_text() == saved
    assert f"ds-train: stopped by signal 15 at iteration {k}; checkpoint saved" in res.out
    for rank in (0, 1):  # each rank saved, then ended on the signal (exit 143), not killed
        log = (split / "run" / "logs" / f"rank_{rank}.log").read_text()
        assert f"saved checkpoint {saved}" in log and f"exit 143: stopped by signal 15 at iteration {k}" in log

    res = run_cmd(ript_args(cfg, *scaling), timeout=300)
    assert res.returncode == 0, res.out[-4000:]
    assert f"at iteration {k}" in res.out and "resumed from" in res.out
    got = logged(split / "run")
    assert sorted(got) == sorted(ref) == [0, 2, 4, 6]  # evaluations (0: before training) and syncs
    for it in (it for it in ref if it > k):
        for key in ("ript/accepted", "ript/rejected", "ript/checked", "ript/skipped", "ript/success_rate",
                    "eval/success", "policy/tokens"):
            assert got[it].get(key) == ref[it].get(key), (it, key)
        if "policy/loss" in ref[it]:  # logged at each sync: iterations since the last one, over all ranks
            assert got[it]["policy/loss"] == pytest.approx(ref[it]["policy/loss"], rel=1e-6, abs=1e-9)
            assert got[it]["policy/kl"] == pytest.approx(ref[it]["policy/kl"], rel=1e-6, abs=1e-12)
            assert got[it]["optim/lr"] == pytest.approx(SCALED)  # lr scaling reaches RIPT's engine
    assert sorted(it for it in got if "ript/accepted" in got[it]) == [4, 6]  # ript.sync_every=4, and the last
    # skip_solved's state travels too: the skipped counts above equal the straight run's (how many
    # depends on how well this machine's SFT policy came out; test_slurm's scripted run always skips)
    accepted, checked = (sum(got[it][key] for it in (4, 6)) for key in ("ript/accepted", "ript/checked"))
    assert 0 < accepted < checked  # groups of K that disagree (the policy learns) and groups that do not
    for rank in (0, 1):
        assert rank_counts(split / "run", rank) == rank_counts(straight / "run", rank)
    a, b = (json.loads((d / "run" / "ript_results.json").read_text()) for d in (straight, split))
    assert a["evals"] == b["evals"] and a["train_counts"] == b["train_counts"]
    assert [e["iteration"] for e in a["evals"]] == [0, 2, 4, 6]
    assert json.loads((split / "run" / "ds_config.json").read_text())["optimizer"]["params"]["lr"] == SCALED

    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    wa, wb = (get_fp32_state_dict_from_zero_checkpoint(str(d / "run" / "checkpoints"), tag="step_00000006")
              for d in (straight, split))
    assert wa.keys() == wb.keys() and len(wa) > 0
    different = [name for name in wa if not wa[name].equal(wb[name])]
    assert different == []  # tensor by tensor, bitwise
    assert any(not wa[n].equal(w) for n, w in _initial_weights(sft_policy).items() if n in wa)  # it trained


def _initial_weights(policy: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(policy / "model.safetensors")


def test_bad_ript_input_is_one_line_and_changes_nothing(scripted_run, tiny_policy, tmp_path, capsys):
    """Bad input against an existing RIPT run directory, and against a ds_train run given as
    model.path (which would be exported into the run directory): one error line, exit 2, and both
    directories byte for byte as they were. In this process (the CLI's `main`: what the command runs after
    Python starts; the environment a rank's start-up sets restored after), vLLM's cases as the command."""
    _, finished = scripted_run
    run_dir, source = tmp_path / "run", tmp_path / "source_run"
    shutil.copytree(finished, run_dir)
    shutil.copytree(finished, source)
    before = {d: tree_listing(d) for d in (run_dir, source)}
    cfg = ript_config(tmp_path, tiny_policy)
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "copy 12 =", "answer": "12"}\n{"prompt": "copy 34 ="}\n')
    cases = [(["train.global_batch_size=8"], "must be a multiple of train.global_batch_size / data-parallel size"),
             ([f"ript.tasks=[{{data: {rows}, verifier: fuzzy}}]"],
              "ript.tasks[0].verifier: 'fuzzy' is not a verifier; use one of exact, numeric, regex, boxed"),
             ([f"ript.tasks=[add, {rows}]", f"data.chat_template={TEMPLATE}"],
              f"{rows}:2: no 'answer' field (ript.tasks[1]: answer_key)"),
             ([f"model.path={tmp_path}"], "neither a Hugging Face directory"),
             (["ript.tasks=[add,nosuch]"], "'nosuch' is neither a built-in task"),
             (["ript.rloo_batch_size=1"], "ript.rloo_batch_size=1: must be >= 2 (RLOO leaves one out)"),
             (["ript.policy=nosuch:Policy"], "ript.policy: cannot load 'nosuch:Policy'"),
             (["ript.policy=", "ript.rollout_engine=vllm"], "the model's attention head size is 16 (hidden_size / "
              "num_attention_heads), which vLLM's CPU attention cannot serve"),
             (["ript.policy=", "ript.rollout_engine=vllm", "ript.vllm_gpu_memory_utilization=1.5"],
              "ript.vllm_gpu_memory_utilization=1.5: must be within (0, 1]"),
             ([], "saved with 2 ranks; resume ript with the same world size"),  # one process, checkpoints of 2
             ([f"model.path={source}", "checkpoint.resume=none", "train.global_batch_size=8"],
              "must be a multiple of train.global_batch_size / data-parallel size")]
    import torch.distributed as tdist

    from ds_train.__main__ import main

    args = ["ript", "--config", str(cfg), "--ds-config", ZERO2, "train.global_batch_size=12"]
    # vLLM's cases as the command (importing vLLM changes the process: not the test's); the rest in this process,
    # through the CLI's main, world 1: 12 rollouts per rank make one step of 12
    commands = [case for case in cases if "ript.rollout_engine=vllm" in case[0]]
    capsys.readouterr()
    environ = dict(os.environ)  # a rank's start-up sets RANK, WORLD_SIZE, MASTER_PORT...: not for the tests after
    try:
        for overrides, message in (case for case in cases if case not in commands):
            code = main([*args, *overrides])
            out, err = capsys.readouterr()
            assert code == 2 and err.startswith("ds-train: error: ") and message in err, (overrides, err, out[-2000:])
            assert "Traceback" not in out + err and len(err.strip().splitlines()) == 1, err
            assert not tdist.is_initialized(), overrides  # none made, or left behind
    finally:
        os.environ.clear()
        os.environ.update(environ)
    for overrides, message in commands:  # exit 2, one line, no traceback
        res = ds_train(*args, *overrides, timeout=120, env=TESTS_ON_PATH)
        said = res.lines("ds-train: error:")
        assert res.returncode == 2 and len(said) == 1 and message in said[0], (overrides, res.out[-2000:])
        assert "Traceback" not in res.out
    assert {d: tree_listing(d) for d in (run_dir, source)} == before


def test_an_idle_rank_joins_every_collective(tiny_policy, tmp_path):
    """One task, two ranks: rank 1 owns nothing, yet sampling, update and evaluation finish. Without
    a cap rank 0 fills its quota of 3 alone; ript.max_sampling_rounds=2 stops every rank after two
    rounds of one context each."""
    res = launch_ript(ript_config(tmp_path, tiny_policy, tasks=["copy"], allow_idle_ranks=True, iterations=3),
                      "ript.max_sampling_rounds=2")
    assert res.returncode == 0, res.out[-4000:]
    assert "   1  (idle)" in res.out
    idle = rank_counts(tmp_path / "run", 1)
    assert len(idle) == 3 and all(c["copy"]["checked"] == 0 for c in idle)
    busy = rank_counts(tmp_path / "run", 0)
    assert [c["copy"]["checked"] for c in busy] == [2, 2, 2]  # the cap, not the quota, ends each iteration
    assert all(c["copy"]["accepted"] <= 2 for c in busy)


def final_weights(run_dir: Path) -> dict:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    tag = checkpoint.latest_complete(run_dir / "checkpoints")
    return get_fp32_state_dict_from_zero_checkpoint(str(run_dir / "checkpoints"), tag=tag)


def test_ript_under_expert_parallelism_updates_as_with_every_expert_on_each_rank(tiny_policy, tmp_path):
    """A tiny Qwen3-MoE policy (tiny_policy's tokenizer). Scripted rollouts, a KL reference: under
    parallel.expert 2 (AutoEP: the log-probs, the reference's and the update go through experts split
    over the 2 ranks) each iteration's policy loss and KL are parallel.expert 1's within 1e-5. Then the
    model acts under parallel.expert 2 on one task, so rank 1 has nothing to roll out: its dummy rows
    keep the generation's all-to-alls in step (as under ZeRO-3), and the run ends. A policy whose config
    asks for the router's aux loss is refused in one line (RIPT's loss would leave it out)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from test_parity import MOE_MODEL

    policy = tmp_path / "policy"
    tok = AutoTokenizer.from_pretrained(tiny_policy)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.for_model(**{**MOE_MODEL, "vocab_size": len(tok)})).save_pretrained(policy)
    tok.save_pretrained(policy)
    got = {}
    for ep in (2, 1):
        (tmp_path / f"ep{ep}").mkdir()
        cfg = ript_config(tmp_path / f"ep{ep}", policy, tasks=["copy", "rev"], kl_coef=0.05)
        res = launch_ript(cfg, f"parallel.expert={ep}")
        assert res.returncode == 0, res.out[-4000:]
        got[ep] = [m for m in logged(tmp_path / f"ep{ep}" / "run").values() if "policy/loss" in m]
    assert len(got[2]) == len(got[1]) == 2 and got[1][-1]["policy/kl"] > 0
    for a, b in zip(got[2], got[1]):
        assert a["policy/tokens"] == b["policy/tokens"]
        for key in ("policy/loss", "policy/kl"):
            assert abs(a[key] - b[key]) <= 1e-5 * max(abs(b[key]), 1e-3), (key, a, b)

    (tmp_path / "acting").mkdir()
    cfg = ript_config(tmp_path / "acting", policy, tasks=["copy"], policy="", allow_idle_ranks=True, iterations=1)
    res = launch_ript(cfg, "parallel.expert=2", "ript.max_sampling_rounds=2")
    assert res.returncode == 0, res.out[-4000:]
    assert "   1  (idle)" in res.out and "ript: done, 1 iterations" in res.out

    # a router loss asked for by the model config: RIPT's policy loss would leave it out, so it is refused
    config = json.loads((policy / "config.json").read_text())
    (policy / "config.json").write_text(json.dumps({**config, "output_router_logits": True}))
    (tmp_path / "aux").mkdir()
    expect_error(["ript", "--config", str(ript_config(tmp_path / "aux", policy, {"global_batch_size": 12})),
                  "--ds-config",
                  str(ROOT / "ds_configs" / "zero2.json")],
                 "model.config.output_router_logits=true: RIPT's policy loss does not add the router's auxiliary loss")
    assert not (tmp_path / "aux" / "run").exists()


def test_the_same_rollouts_split_into_other_micro_batches_and_ranks_give_the_same_update(tiny_policy, tmp_path):
    """ript_policies:Half accepts every context, so 2 ranks x 3 contexts (copy on one, sort on the
    other) and 1 rank x 6 (copy and sort in turn) roll out the same 24 episodes per iteration. The
    token-mean loss of the one optimizer step per iteration, and the weights after 4 iterations, are
    the same on 2 ranks with micro-batches of 4 (12 rollouts a rank in 3) as on 1 rank with
    micro-batches of 8 (24 in 3): other ranks and other micro-batches. (DeepSpeed's WarmupCosineLR
    runs the first two steps at lr 0: iteration 4's loss is the first after an update.) kl_coef 0: no
    reference policy is built, and none is held: what the parameters beyond the policy's hold, measured
    over every live module of each rank's process, is 0 (with a reference: the whole model under ZeRO-2,
    test_sigterm..., half of it on each of 2 ranks under ZeRO-3, test_a_dataset_task...). The 2-rank
    layout again with compiled layers (model.compile=true: the update's forward and backward compiled,
    generation eager) gives the same losses and weights within 1e-5 (issue 59: compiled layers under RIPT)."""
    common = dict(tasks=["copy", "sort"], policy="ript_policies:Half", advantage="grpo", rollout_contexts=1,
                  iterations=4)
    layouts = {"np2_micro4": (2, 3, 4), "np1_micro8": (1, 6, 8), "np2_micro4_compiled": (2, 3, 4)}
    metrics, weights = {}, {}
    for name, (nproc, quota, micro) in layouts.items():
        (tmp_path / name).mkdir()
        cfg = ript_config(tmp_path / name, tiny_policy, {"micro_batch_size": micro, "global_batch_size": 24},
                          contexts_per_rank=quota, max_contexts_checked=quota, **common)
        args = ript_args(cfg, *(["model.compile=true"] if name.endswith("compiled") else []), nproc=nproc)
        res = run_cmd(args, timeout=240, env=TESTS_ON_PATH)
        assert res.returncode == 0, res.out[-4000:]
        assert "grpo (scale group), token-mean, clip 0.2/0.28, no KL" in res.out
        assert "reference policy: none (ript.kl_coef 0: no reference model is built)" in res.out
        run_dir = tmp_path / name / "run"
        for r in range(nproc):
            log = (run_dir / "logs" / f"rank_{r}.log").read_text()
            assert "reference policy: none; parameters beyond" in log and reference_bytes(run_dir, r) == 0
            assert ("model.compile: torch.compile(backend='inductor') on 2 LlamaDecoderLayer module(s)" in log) == \
                name.endswith("compiled")
        metrics[name], weights[name] = logged(run_dir), final_weights(run_dir)
    ref = metrics["np2_micro4"]
    for name, got in metrics.items():
        for it in (1, 2, 3, 4):
            assert got[it]["ript/accepted"] == 6 and got[it]["policy/tokens"] == ref[it]["policy/tokens"] > 0
            assert got[it]["ript/frac_reward_zero_std"] == 0.0 and got[it]["ript/reward_mean"] == 0.5
            tol = 1e-5 if name.endswith("compiled") else 1e-6
            assert got[it]["policy/loss"] == pytest.approx(ref[it]["policy/loss"], rel=tol, abs=1e-9), (name, it)
        assert got[4]["policy/loss"] != got[3]["policy/loss"]  # the update moved the policy
        w, w0 = weights[name], weights["np2_micro4"]
        diff = sum(float((w[k] - w0[k]).norm() ** 2) for k in w0) ** 0.5
        assert diff <= tol * sum(float(w0[k].norm() ** 2) for k in w0) ** 0.5, name
    start = _initial_weights(tiny_policy)
    assert any(not weights["np1_micro8"][n].equal(w) for n, w in start.items() if n in weights["np1_micro8"])


UPDATE_LR, MAX_TOKENS = 0.5, 16  # SGD's lr: the second epoch's ratios reach the clip
TIS_CAP = 1.5  # ript.tis_cap of the update test's "+tis" mode


def update_rollouts(vocab: int) -> list:
    """Rank 0: two groups of K = 4 rollouts, rank 1: one (half of its step is padding); prompts of 3 to
    6 tokens, 1 to 9 generated, and for some rollouts a second turn after a 2-token observation."""
    import torch

    gen = torch.Generator().manual_seed(0)

    def rand(lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi + 1, (1,), generator=gen))

    def rollout(reward: float) -> dict:
        segments = [(rand(3, 6), 0), (rand(1, 9), 1)] + ([(2, 0), (rand(1, 4), 1)] if rand(0, 1) else [])
        mask = [m for n, m in segments for _ in range(n)]
        engine = (-0.5 - 5.5 * torch.rand(len(mask), generator=gen)).tolist()  # a rollout engine's log-probs
        return {"ids": torch.randint(vocab, (len(mask),), generator=gen).tolist(), "action_mask": mask,
                "reward": reward, "logprobs": [lp if m else 0.0 for lp, m in zip(engine, mask)]}

    rewards = [[[1.0, 0.0, 0.5, 0.0], [0.0, 1.0, 1.0, 0.25]], [[1.0, 0.0, 0.0, 0.0]]]
    return [[[rollout(r) for r in group] for group in rank] for rank in rewards]


def hand_update(model, ranks: list, mode: str, epochs: int = 2, clip: tuple = (0.2, 0.28)) -> float:
    """The RIPT update of `model` in plain torch, one rollout at a time (no padding, micro-batches or
    ranks): RLOO advantages, PPO's clipped surrogate against the policy before the update, `mode`'s
    aggregation over every rank's tokens, an SGD step per epoch. Returns the epochs' mean loss. A mode
    `M+tis`: M, each token's loss times min(pi_old / pi_rollout, TIS_CAP) (the rollouts' `logprobs`)."""
    import torch

    mode, tis = mode.split("+")[0], mode.endswith("+tis")
    rows = []
    for group in (g for rank in ranks for g in rank):
        rewards = [e["reward"] for e in group]
        rows += [(e, e["reward"] - (sum(rewards) - e["reward"]) / (len(group) - 1)) for e in group]
    lengths = [sum(e["action_mask"][1:]) for e, _ in rows]  # the first token is never a target
    tokens, sequences = sum(lengths), sum(n > 0 for n in lengths)
    weight = {"token-mean": lambda n: 1 / tokens, "seq-mean-token-mean": lambda n: 1 / (n * sequences),
              "seq-mean-token-sum-norm": lambda n: 1 / (sequences * MAX_TOKENS)}[mode]
    old, losses = {}, []
    for _ in range(epochs):
        loss = 0.0
        for i, ((e, adv), n) in enumerate(zip(rows, lengths)):
            ids = torch.tensor(e["ids"])
            logp = torch.log_softmax(model(input_ids=ids[None]).logits[0, :-1], -1)[torch.arange(len(ids) - 1),
                                                                                     ids[1:]]
            acted = torch.tensor(e["action_mask"][1:], dtype=torch.bool)
            logp = logp[acted]
            ratio = torch.exp(logp - old.setdefault(i, logp.detach()))
            per_token = -torch.minimum(ratio * adv, ratio.clamp(1 - clip[0], 1 + clip[1]) * adv)
            if tis:
                per_token = per_token * torch.exp(old[i] - torch.tensor(e["logprobs"][1:])[acted]).clamp(max=TIS_CAP)
            loss = loss + per_token.sum() * weight(n)
        model.zero_grad()
        loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= UPDATE_LR * p.grad
        losses.append(float(loss.detach()))
    return sum(losses) / epochs


def test_the_policy_update_is_the_hand_computed_loss_and_gradient_over_ranks_and_micro_batches(tiny_policy,
                                                                                                 tmp_path):
    """ds_train's RIPT update (2 ranks, 4 micro-batches of 2 a step, rollouts of 1 to 13 tokens, rank 1
    with half as many) against hand_update, for each loss aggregation mode in turn, two PPO epochs
    each: the logged policy/loss, and the weights of a ZeRO-2 engine stepping SGD (lr x the gradient
    it reduced over ranks and micro-batches, so a wrong scale or normaliser shows: Adam's steps
    would hide it)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ds_train.ript.algorithms import LOSS_AGG_MODES

    ranks = update_rollouts(len(AutoTokenizer.from_pretrained(tiny_policy)))
    modes = [*LOSS_AGG_MODES, "token-mean+tis"]  # the last: the rollout engine's log-probs weight the loss
    spec = {"ranks": ranks, "modes": modes, "lr": UPDATE_LR, "max_tokens": MAX_TOKENS, "tis_cap": TIS_CAP,
            "train": {"micro_batch_size": 2, "global_batch_size": 16},
            "ript": {"rloo_batch_size": 4, "contexts_per_rank": 2, "ppo_epochs": 2}}
    (tmp_path / "rollouts.json").write_text(json.dumps(spec))
    res = run_cmd([*node_launch(), str(ROOT / "tests" / "ript_update_probe.py"), str(tiny_policy), str(tmp_path / "rollouts.json"),
                   str(tmp_path)], timeout=240)
    assert res.returncode == 0, res.out[-4000:]
    got = torch.load(tmp_path / "update.pt")
    model = AutoModelForCausalLM.from_pretrained(tiny_policy)
    tokens = sum(sum(e["action_mask"][1:]) for rank in ranks for g in rank for e in g)
    for mode in modes:
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        loss = hand_update(model, ranks, mode)
        m = got[mode]["metrics"]
        assert got[mode]["plan"] == [4, 2]  # accumulation x data-parallel ranks: the scale the engine undoes
        assert m["policy/tokens"] == 2 * tokens
        assert 0 < m["policy/clip_frac"] < 0.5, m  # the second epoch's ratios reach the clip, not all of them
        step = sum(float((p.detach() - before[n]).norm() ** 2) for n, p in model.named_parameters()) ** 0.5
        assert step > 0
        for n, p in model.named_parameters():  # lr x the summed gradients of the two epochs, tensor by tensor
            want = p.detach()
            diff = float((got[mode]["weights"][n] - want).norm())
            bound = 1e-4 * max(float((want - before[n]).norm()), 1e-2 * step)
            assert diff <= bound, (mode, n, diff, bound)
        # the second epoch's loss is taken after the first step: a wrong scale shows here too
        assert m["policy/loss"] == pytest.approx(loss, rel=1e-4, abs=1e-6), mode
        if mode.endswith("+tis"):  # the engine's log-probs are far from the trainer's: weights other than 1
            assert m["rollout/logp_diff_max"] > 1 and 0 < m["rollout/tis_weight"] < TIS_CAP, m


def task_prompts(path: Path, name: str, n: int = 400, answer: str = "") -> Path:
    """A JSONL dataset of a built-in task's prompts and answers (the policy's own format); `answer`:
    only the contexts with that answer."""
    task = load_task(name)
    rows = [json.dumps({"prompt": task.reset(c), "answer": task.answer(c)})
            for split in ("train", "heldout") for c in task.contexts(split, n // 2, 0)
            if answer in ("", task.answer(c))]
    path.write_text("\n".join(rows) + "\n")
    return path


def test_a_dataset_task_with_a_reference_policy_trains_under_zero3_and_its_heldout_success_rises(sft_policy,
                                                                                                   tmp_path):
    """ZeRO-3, 2 processes: the policy learns a task read from a JSONL file (exact verifier, a newline
    ends a completion; its prompts split over the 2 ranks) with GRPO and a k3 KL penalty in the reward
    to a frozen reference that each rank holds half of; held-out success (greedy, prompts the hash keeps out of
    training) rises. The task: parity prompts
    whose answer is always "odd": the SFT policy says "even" when greedy, "odd" sometimes when sampling."""
    data = task_prompts(tmp_path / "odd.jsonl", "parity", n=800, answer="odd")
    task = {"name": "odds", "data": str(data), "verifier": "exact", "stop": ["\n"], "heldout_fraction": 0.2}
    cfg = ript_config(tmp_path, sft_policy, {"micro_batch_size": 8, "global_batch_size": 32}, {"lr": 1e-3},
                      tasks=[task], policy="", iterations=8, contexts_per_rank=4, rollout_contexts=4,
                      max_contexts_checked=16, eval_contexts=40, advantage="grpo", kl_coef=0.05, kl_in="reward")
    args = ript_args(cfg, f"data.chat_template={TEMPLATE}")
    args[args.index(ZERO2)] = str(ROOT / "ds_configs" / "zero3.json")
    res = run_cmd(args, timeout=400, env=TESTS_ON_PATH)
    assert res.returncode == 0, res.out[-4000:]
    run_dir = tmp_path / "run"
    assert "grpo (scale group), token-mean, clip 0.2/0.28, KL k3 x 0.05 in the reward" in res.out
    assert "partitioned over 2 ranks (ZeRO-3)" in res.out
    assert "   0  odds#0" in res.out and "   1  odds#1" in res.out  # one dataset, both ranks busy
    whole = sum(t.numel() * 4 for t in _initial_weights(sft_policy).values())
    for r in (0, 1):
        held = reference_bytes(run_dir, r)
        assert 0.4 * whole < held < 0.6 * whole, (held, whole)  # half of it, never whole on a rank
    got = logged(run_dir)
    kls = [m["policy/kl"] for m in got.values() if "policy/kl" in m]
    assert kls and all(k >= 0 for k in kls) and max(kls) > 0
    results = json.loads((run_dir / "ript_results.json").read_text())
    first, last = results["evals"][0], results["evals"][-1]
    assert first["per_task"]["odds"]["episodes"] == 40
    assert last["success_rate"] > first["success_rate"], (first, last)
