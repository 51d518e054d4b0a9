"""Asynchronous RL through the launcher (ds_train/ript/feed.py, rollout_ranks.py, ds_train/dist/bridge.py): rollout
ranks beside trainer ranks in one job. k = 0 against the colocated run; staleness over uneven environment time,
with a batch made stale on purpose; kill -9 while batches are queued, then the resume, bitwise, under ZeRO-3 and
with LoRA."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from conftest import (ROOT, TESTS_ON_PATH, expect_error, node_launch, pids_with, reap, ript_config, run_cmd, spawn,
                      tree_listing)
from test_ript_trainer import LR, MODEL_RIPT, MODEL_TRAIN, TEMPLATE, logged

pytestmark = pytest.mark.slow

ZERO2, ZERO3 = (str(ROOT / "ds_configs" / f"zero{s}.json") for s in (2, 3))


def ript(cfg: Path, nproc: int, ds_config: str = ZERO2, *overrides: str) -> list[str]:
    return [*node_launch(nproc), "--module", "ds_train", "ript", "--config", str(cfg), "--ds-config", ds_config,
            f"data.chat_template={TEMPLATE}", *overrides]


def test_with_staleness_0_rollout_ranks_train_on_current_weights_as_the_colocated_run_does(sft_policy, tmp_path):
    """2 trainers and 2 rollout ranks (the last 2 of the node's 4), ript.max_staleness 0, against the colocated run
    on 2 ranks: every batch comes from the current weights (staleness 0, the rollout ranks' log-probs the trainers'
    own), and the run is the colocated one: the same losses, counts and evaluations."""
    runs = {}
    for name, nproc, extra in (("colocated", 2, {}), ("split", 4, {"rollout_ranks_per_node": 2})):
        (tmp_path / name).mkdir()
        cfg = ript_config(tmp_path / name, sft_policy, MODEL_TRAIN, {"lr": LR},
                          **{**MODEL_RIPT, "iterations": 3, "sync_every": 1, "eval_every": 3, **extra})
        res = run_cmd(ript(cfg, nproc), timeout=300, env=TESTS_ON_PATH)
        assert res.returncode == 0, res.out[-4000:]
        runs[name] = (logged(tmp_path / name / "run"), res.out)
    (colocated, _), (split, out) = runs["colocated"], runs["split"]
    assert "rollout ranks: the last 2 of every node's 4 (2 in all) generate, 2 train; ript.max_staleness 0" in out
    assert sorted(colocated) == sorted(split) == [0, 1, 2, 3]
    for it in (1, 2, 3):
        assert split[it]["async/staleness_max"] == 0 and split[it]["async/staleness_0"] > 0
        assert split[it]["async/stale_dropped"] == 0 and split[it]["async/queue_depth"] == 0
        assert split[it]["rollout/logp_diff_max"] < 1e-5  # sampled by the weights the trainers hold
        assert split[it]["async/weights_send_s"] > 0
        for key in ("ript/accepted", "ript/rejected", "ript/checked", "ript/success_rate", "policy/tokens"):
            assert split[it][key] == colocated[it][key], (it, key)
        assert split[it]["policy/loss"] == pytest.approx(colocated[it]["policy/loss"], rel=1e-5, abs=1e-7)
    assert split[3]["eval/success"] == colocated[3]["eval/success"]
    assert json.loads((tmp_path / "split" / "run" / "env.json").read_text())["world_size"] == 2  # the trainers'


def test_staleness_is_k_exactly_over_uneven_environment_time_and_an_older_batch_is_dropped(sft_policy, tmp_path):
    """1 trainer and 2 rollout ranks, max_staleness 2, an environment whose every reset takes 0-80 ms: at update i
    the episodes are min(i - 1, 2) updates old, never more. ript.debug_stale_iteration=5 makes batch 5 one update
    older: the trainer drops all of it and counts it (the doctor names it)."""
    sim = tmp_path / "sim.jsonl"
    sim.write_text("".join(json.dumps({"n": i}) + "\n" for i in range(40)))
    cfg = ript_config(tmp_path, sft_policy, {"micro_batch_size": 4, "global_batch_size": 16}, {"lr": LR},
                      **{**MODEL_RIPT, "contexts_per_rank": 4, "tasks": ["parity", {"name": "sim", "data": str(sim),
                                                             "env": "ript_envs:Unhurried", "max_turns": 2}],
                         "iterations": 6, "sync_every": 1, "eval_every": 0, "rollout_ranks_per_node": 2,
                         "max_staleness": 2, "tis_cap": 2, "debug_stale_iteration": 5})
    res = run_cmd(ript(cfg, 3, ZERO2, "checkpoint.every=1", "checkpoint.keep=0", "ript.log_completions=4",
                       "ript.temperature=0.7"), timeout=300, env=TESTS_ON_PATH)
    assert res.returncode == 0, res.out[-4000:]
    got = logged(tmp_path / "run")
    # the probe: each logged episode's log-probs are those of the weights its stamp names, at its temperature
    # (recomputed from that version's checkpoint), and not those of the next version
    records = [json.loads(l) for l in (tmp_path / "run" / "completions.jsonl").read_text().splitlines()]
    train = [c for c in records if c["kind"] == "train"]
    assert {c["iteration"]: c["version"] for c in train} == {1: 0, 2: 0, 3: 0, 4: 1, 5: 1, 6: 3}, train
    off = []
    for c in train:
        mine, later = (probe_logprobs(sft_policy, tmp_path / "run", v, c["ids"], 0.7)
                       for v in (c["version"], c["version"] + 1))
        assert max(abs(a - b) for a, b in zip(mine[1:], c["logprobs"][1:])) < 1e-5, c
        off.append(max(abs(a - b) for a, b in zip(later[1:], c["logprobs"][1:])))
    assert max(off) > 1e-3, off  # the probe tells versions apart
    for it in range(1, 7):
        ages = {int(k.rsplit("_", 1)[1]): v for k, v in got[it].items() if k.startswith("async/staleness_")
                and k.rsplit("_", 1)[1].isdigit()}
        if it == 5:
            assert ages == {} and got[it]["async/stale_dropped"] > 0, got[it]
            continue
        assert list(ages) == [min(it - 1, 2)] and got[it]["async/stale_dropped"] == 0, (it, got[it])
        assert got[it]["async/staleness_max"] == min(it - 1, 2) <= 2
    assert got[6]["async/queue_depth"] == 0  # nothing is generated past the last iteration
    assert any(got[it]["async/queue_depth"] == 1 for it in range(1, 5))  # k = 2: one batch held beyond the next
    doctor = run_cmd(["ds-train", "doctor", str(tmp_path / "run")], timeout=120)
    assert "[rl_stale_dropped]" in doctor.out and "iteration 5: " in doctor.out, doctor.out
    assert "episodes dropped as stale (older than ript.max_staleness), none of them trained" in doctor.out
    # the run continued without its rollout ranks: refused in one line before anything is written
    before = tree_listing(tmp_path / "run")
    expect_error(["ript", "--config", str(cfg), "--ds-config", ZERO2, f"data.chat_template={TEMPLATE}",
                  "ript.iterations=7", "ript.rollout_ranks_per_node=0", "ript.max_staleness=0", "ript.tis_cap=0",
                  "ript.debug_stale_iteration=0"], "saved with 2 rollout rank(s) in all (ript.rollout_ranks_per_node), "
                 "this job has 0", wrap=["env", f"PYTHONPATH={ROOT / 'tests'}"])
    assert tree_listing(tmp_path / "run") == before


def probe_logprobs(policy: Path, run_dir: Path, version: int, ids: list[int], temperature: float) -> list[float]:
    """The log-prob of each token of `ids` under the weights of `version` (updates done: 0 the starting policy,
    else the checkpoint of that iteration), at `temperature`; 0.0 for the first."""
    import torch
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32).eval()
    if version:
        weights = get_fp32_state_dict_from_zero_checkpoint(str(run_dir / "checkpoints"), tag=f"step_{version:08d}")
        model.load_state_dict(weights, strict=False)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids[:-1]])).logits.float() / temperature
    return [0.0] + torch.log_softmax(logits, -1)[0].gather(-1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()


@pytest.mark.parametrize("layout,signum", [("zero3", signal.SIGKILL), ("lora", signal.SIGTERM)])
def test_a_stop_while_batches_are_queued_then_the_resume_is_bitwise(sft_policy, tmp_path, layout, signum):
    """2 trainers and a rollout rank, max_staleness 1, a checkpoint every 2 iterations: after iteration 3, while the
    rollout rank holds batch 4 or generates it, every process of the job gets the signal at once (the job's process
    group: what scancel, a SLURM preemption and Ctrl-C send). SIGKILL: the same command resumes from iteration 2;
    SIGTERM: every rank (the rollout rank too, which keeps it as the stop word) saves at the stop's iteration and
    the job exits 143. Either way the resume takes back the batch the checkpoint holds and ends with the weights of
    the uninterrupted run, bitwise."""
    ds_config, extra = (ZERO3, ("checkpoint.every=2",)) if layout == "zero3" else (
        ZERO2, ("checkpoint.every=2", "model.lora.rank=4", "model.lora.target_modules=[q_proj,v_proj]"))
    dirs = {}
    for name in ("straight", "killed"):
        (tmp_path / name).mkdir()
        cfg = ript_config(tmp_path / name, sft_policy, MODEL_TRAIN, {"lr": LR},
                          **{**MODEL_RIPT, "iterations": 5, "sync_every": 1, "eval_every": 0,
                             "rollout_ranks_per_node": 1, "max_staleness": 1, "tis_cap": 2})
        dirs[name] = (cfg, tmp_path / name / "run")
    cfg, run_dir = dirs["straight"]
    res = run_cmd(ript(cfg, 3, ds_config, *extra), timeout=300, env=TESTS_ON_PATH)
    assert res.returncode == 0, res.out[-4000:]

    cfg, run_dir = dirs["killed"]
    proc = spawn(ript(cfg, 3, ds_config, *extra), env=TESTS_ON_PATH)
    deadline = time.monotonic() + 240
    while not (run_dir / "metrics.jsonl").is_file() or 3 not in logged(run_dir):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-3000:]
        time.sleep(0.05)
    os.killpg(proc.pid, signum)
    stopped = reap(proc, timeout=90)
    assert not pids_with(str(run_dir))
    if signum == signal.SIGKILL:
        k = 2
    else:
        k = int((run_dir / "checkpoints" / "latest").read_text().split("_")[1])
        assert 3 <= k < 5 and f"ds-train: stopped by signal 15 at iteration {k}; checkpoint saved" in stopped.out
        for rank in (0, 1):  # each trainer saved, then ended on the signal, not killed (DeepSpeed's launcher, which
            #                  got it too, exits 1 once its ranks are gone)
            log = (run_dir / "logs" / f"rank_{rank}.log").read_text()
            assert f"exit 143: stopped by signal 15 at iteration {k}" in log, log[-2000:]
        assert "Traceback" not in stopped.out and "Connection closed" not in stopped.out, stopped.out[-4000:]
    assert (run_dir / "checkpoints" / "latest").read_text() == f"step_{k:08d}"
    res = run_cmd(ript(cfg, 3, ds_config, *extra), timeout=300, env=TESTS_ON_PATH)
    assert res.returncode == 0, res.out[-4000:]
    assert "resumed from" in res.out and f"at iteration {k}" in res.out
    a, b = logged(dirs["straight"][1]), logged(run_dir)
    for it in range(k + 1, 6):
        for key in ("ript/accepted", "ript/checked", "policy/tokens", "async/staleness_max"):
            assert a[it][key] == b[it][key], (it, key)
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    wa, wb = (get_fp32_state_dict_from_zero_checkpoint(str(d / "checkpoints"), tag="step_00000005")
              for d in (dirs["straight"][1], run_dir))
    assert wa.keys() == wb.keys() and len(wa) > 0
    assert [n for n in wa if not wa[n].equal(wb[n])] == []  # tensor by tensor, bitwise


def test_a_rollout_rank_that_raises_ends_the_job_within_seconds_its_error_printed_and_named(sft_policy, tmp_path):
    """1 trainer and 2 rollout ranks; rollout rank 1 raises while it generates batch 3 (watchdog.debug_fault
    raise:r1:3), the other waits in a meeting, the trainer in the bridge's gather. The watchdog's stall limit is
    far away: the job must end because the error is published, not because a wait timed out. Its traceback is
    printed before anything waits on it, and the job's last line names the rollout rank and the error."""
    cfg = ript_config(tmp_path, sft_policy, {"micro_batch_size": 4, "global_batch_size": 8}, {"lr": LR},
                      **{**MODEL_RIPT, "iterations": 6, "sync_every": 1, "eval_every": 0, "rollout_ranks_per_node": 2})
    proc = spawn(ript(cfg, 3, ZERO2, "watchdog.debug_fault=raise:r1:3", "watchdog.stall_s=600"), env=TESTS_ON_PATH)
    lines, raised_at = [], None
    deadline = time.monotonic() + 300
    for line in proc.stdout:  # until every process of the job closed it
        lines.append(line)
        if raised_at is None and "injected failure on rank r1 at step 3" in line:
            raised_at = time.monotonic()
        assert time.monotonic() < deadline, "".join(lines)[-4000:]
    ended = time.monotonic()
    res = reap(proc, timeout=30)
    out = "".join(lines)
    assert raised_at is not None and ended - raised_at < 60, out[-4000:]
    assert res.returncode != 0 and not pids_with(str(tmp_path / "run"))
    assert "ds-train[rollout rank 1, job rank 2]: error:\nTraceback" in out, out[-4000:]
    last = [l for l in out.splitlines() if l.startswith("ds-train: error: ")][-1]
    assert "rollout rank 1 (job rank 2) on node 0" in last and "failed first, in phase rollout of step 3" in last
    assert "RuntimeError: injected failure on rank r1 at step 3 (watchdog.debug_fault)" in last, last
    assert "stalled" not in out and "hang:" not in out, out[-4000:]


@pytest.mark.parametrize("killed", ["rollout", "trainer"])
def test_a_rank_killed_from_outside_ends_the_job_in_one_line_naming_it(sft_policy, tmp_path, killed):
    """A trainer and a rollout rank; the rollout rank sleeps 2 s at each sampling round and policy call
    (watchdog.debug_fault slow:r0:2) under watchdog.stall_s 5: its batches outlast the stall limit while the trainer
    waits for them, which is no hang (each step of a batch is progress). Then one of them is killed with SIGKILL
    (the OOM killer's way) after iteration 2: the rollout rank, or the trainer (which holds the rendezvous store: the
    rollout rank goes on with the second). The other, inside the bridge, loses its connection: the job ends within
    a minute with one verdict naming the rank killed, and no traceback on any rank."""
    cfg = ript_config(tmp_path, sft_policy, {"micro_batch_size": 4, "global_batch_size": 8}, {"lr": LR},
                      **{**MODEL_RIPT, "iterations": 20, "sync_every": 1, "eval_every": 0, "rollout_ranks_per_node": 1})
    run_dir = tmp_path / "run"
    proc = spawn(ript(cfg, 2, ZERO2, "watchdog.stall_s=5", "watchdog.debug_fault=slow:r0:2"), env=TESTS_ON_PATH)
    deadline = time.monotonic() + 240
    while not (run_dir / "metrics.jsonl").is_file() or 2 not in logged(run_dir):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-3000:]
        time.sleep(0.05)
    assert all(logged(run_dir)[it]["perf/iteration_s"] > 5 for it in (1, 2)), logged(run_dir)  # past the limit
    local = 1 if killed == "rollout" else 0
    victim = [p for p in pids_with(str(tmp_path / "ript.yaml")) if f"--local_rank={local}" in
              Path(f"/proc/{p}/cmdline").read_bytes().decode(errors="replace")]
    assert len(victim) == 1, victim
    at = time.monotonic()
    os.kill(victim[0], signal.SIGKILL)
    res = reap(proc, timeout=120)
    assert time.monotonic() - at < 60 and res.returncode != 0, res.out[-4000:]
    verdicts = [l for l in res.out.splitlines() if l.startswith("ds-train: error: ")]
    named, other = (("rollout rank 0 (job rank 1) on node 0", "then rank 0 lost the connection") if killed == "rollout"
                    else ("rank 0 on node 0", "then rollout rank 0 (job rank 1) lost the connection"))
    assert len(verdicts) == 1 and verdicts[0].startswith(f"ds-train: error: {named}"), res.out[-4000:]
    assert "was killed by SIGKILL" in verdicts[0] and other in verdicts[0], verdicts
    assert "Traceback" not in res.out, res.out[-4000:]
    assert not pids_with(str(run_dir))
