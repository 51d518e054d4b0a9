"""A real SLURM (scripts/local_slurm.sh: slurmctld, slurmd and munge on this machine, one node):
scripts written by `ds-train slurm` are submitted with sbatch, train under srun with the
environment SLURM sets, get SIGUSR1 before a short time limit, save, and continue exactly, through
SLURM's requeue (training) or a second submission (RIPT).

    bash scripts/local_slurm.sh        # what the fixture runs: installs and starts, idempotently

Both jobs run side by side (the node offers twice its CPUs; their ranks mostly wait: rank 0 of
each is slowed by watchdog.debug_fault so the signal comes mid-run), beside their reference runs.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from conftest import BIN, ROOT, TESTS_ON_PATH, free_port, ript_config, run_cmd, tiny_config, write_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
ZERO2 = str(ROOT / "ds_configs" / "zero2.json")


@pytest.fixture(scope="module")
def slurm():
    up = run_cmd(["bash", str(ROOT / "scripts" / "local_slurm.sh")], timeout=180)
    assert up.returncode == 0, f"scripts/local_slurm.sh could not start SLURM (run it as root):\n{up.out[-3000:]}"
    return up


def job_state(job: str) -> dict[str, str]:
    out = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True).stdout
    return dict(re.findall(r"(\w+)=(\S*)", out))


def wait_for(cond, timeout_s: float, what: str, every_s: float = 1.0):
    deadline = time.monotonic() + timeout_s
    while True:
        value = cond()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(every_s)


def write_script(path: Path, *args: str, env: dict | None = None) -> Path:
    res = run_cmd([sys.executable, "-m", "ds_train", "slurm", "--nodes", "1", "--gpus-per-node", "2",
                   "--no-gpu-request", "--out", str(path), *args], timeout=60, env=env)
    assert res.returncode == 0, res.out
    return path


def sbatch(script: Path, out: Path, env: dict | None = None) -> str:
    import os

    full = {**os.environ, "PATH": f"{BIN}:{os.environ.get('PATH', '')}", "WANDB_MODE": "offline", **(env or {})}
    proc = subprocess.run(["sbatch", "--parsable", f"--output={out}", str(script)], capture_output=True, text=True,
                          env=full, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().split(";")[0]


def cancel(job: str) -> None:
    subprocess.run(["scancel", job], capture_output=True)


def test_sigusr1_before_the_time_limit_saves_and_the_requeued_job_resumes_exactly(slurm, tiny_data, tmp_path):
    """Training: `--time 2 --signal-lead 60 --requeue`. SIGUSR1 reaches both srun tasks 60-90 s
    before the limit: every rank saves and exits 138, the script requeues the job, and the same job
    (restart 1, same output file) resumes from the save and finishes. Its losses equal a straight
    run's, bitwise. Rank 0 sleeps 1 s a step until the save (watchdog.debug_fault, dropped from the
    config file before the requeued job starts), so the signal comes mid-run."""
    sections = dict(train={"max_steps": 100}, log={"every": 5}, checkpoint={"every": 0, "save_final": True})
    cfg = tmp_path / "run.yaml"
    write_config(cfg, tiny_config(tiny_data, tmp_path / "run", **sections, watchdog={"debug_fault": "slow:0:1.0"}))
    script = write_script(tmp_path / "job.sbatch", "--time", "2", "--signal-lead", "60", "--requeue", "--", "train",
                          "--config", str(cfg), "--ds-config", ZERO2)
    out = tmp_path / "job.out"
    job = sbatch(script, out)
    try:
        ref_cfg = write_config(tmp_path / "ref.yaml", tiny_config(tiny_data, tmp_path / "ref", **sections))
        ref = run_cmd([str(BIN / "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()), "--module",
                       "ds_train", "train", "--config", str(ref_cfg), "--ds-config", ZERO2], timeout=300)
        assert ref.returncode == 0, ref.out[-3000:]
        wait_for(lambda: out.exists() and "requeueing job" in out.read_text(), 240, "the save before the time limit")
        write_config(cfg, tiny_config(tiny_data, tmp_path / "run", **sections))
        state = wait_for(lambda: (s := job_state(job)).get("JobState") in ("COMPLETED", "FAILED", "TIMEOUT",
                                                                            "CANCELLED") and s, 240, "the requeued job")
    finally:
        cancel(job)
    text = out.read_text()
    assert state["JobState"] == "COMPLETED" and state["Restarts"] == "1", (state, text[-3000:])
    assert f"ds-train slurm: job {job} (restart 0)" in text and f"ds-train slurm: job {job} (restart 1)" in text
    m = re.search(r"ds-train: stopped by signal 10 at step (\d+); checkpoint saved", text)
    assert m, text[-3000:]
    step = int(m.group(1))
    assert 1 <= step < 100
    run = tmp_path / "run"
    assert f"resumed from {run / 'checkpoints' / f'step_{step:08d}'} at step {step}" in text
    for rank in (0, 1):
        log = (run / "logs" / f"rank_{rank}.log").read_text()
        assert f"exit 138: stopped by signal 10 at step {step}" in log and "launcher slurm" in log
    got = {m["step"]: m["loss"] for m in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}
    want = {m["step"]: m["loss"] for m in map(json.loads, (tmp_path / "ref" / "metrics.jsonl").read_text().splitlines())}
    assert got == want  # every logged step, before and after the save, bitwise


def test_ript_saves_before_the_time_limit_and_a_second_submission_continues_exactly(slurm, tiny_policy, tmp_path):
    """RIPT: the same signal, save and exit 138 (no --requeue: the script says to submit again); a
    second submission with a longer limit continues, and its counts, losses and evaluations equal
    a straight run's."""
    ript = dict(iterations=40, eval_every=10)
    cfg = ript_config(tmp_path, tiny_policy, **ript)
    plain = cfg.read_text()
    cfg.write_text(yaml.safe_dump({**yaml.safe_load(plain), "watchdog": {"debug_fault": "slow:0:1.0"}}))
    first = write_script(tmp_path / "first.sbatch", "--time", "2", "--signal-lead", "60", "--", "ript", "--config",
                         str(cfg), "--ds-config", ZERO2, env=TESTS_ON_PATH)
    out = tmp_path / "first.out"
    job = sbatch(first, out, env=TESTS_ON_PATH)
    try:
        ref_dir = tmp_path / "ref"
        ref_dir.mkdir()
        ref_cfg = ript_config(ref_dir, tiny_policy, **ript)
        ref = run_cmd([str(BIN / "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()), "--module",
                       "ds_train", "ript", "--config", str(ref_cfg), "--ds-config", ZERO2], timeout=300,
                      env=TESTS_ON_PATH)
        assert ref.returncode == 0, ref.out[-3000:]
        state = wait_for(lambda: (s := job_state(job)).get("JobState") not in ("PENDING", "RUNNING", "COMPLETING",
                                                                                None) and s, 240, "the first job")
    finally:
        cancel(job)
    text = out.read_text()
    assert state["ExitCode"] == "138:0", (state, text[-3000:])
    assert "ds-train slurm: saved before the time limit; submit this script again to continue" in text
    m = re.search(r"ds-train: stopped by signal 10 at iteration (\d+); checkpoint saved", text)
    assert m and 1 <= int(m.group(1)) < 40, text[-3000:]

    cfg.write_text(plain)
    second = write_script(tmp_path / "second.sbatch", "--time", "10", "--", "ript", "--config", str(cfg),
                          "--ds-config", ZERO2, env=TESTS_ON_PATH)
    out2 = tmp_path / "second.out"
    job2 = sbatch(second, out2, env=TESTS_ON_PATH)
    try:
        state = wait_for(lambda: (s := job_state(job2)).get("JobState") not in ("PENDING", "RUNNING", "COMPLETING",
                                                                                 None) and s, 240, "the second job")
    finally:
        cancel(job2)
    text2 = out2.read_text()
    assert state["JobState"] == "COMPLETED", (state, text2[-3000:])
    assert f"at iteration {m.group(1)}" in text2 and "resumed from" in text2
    got = json.loads((tmp_path / "run" / "ript_results.json").read_text())
    want = json.loads((ref_dir / "run" / "ript_results.json").read_text())
    assert got["iteration"] == want["iteration"] == 40
    assert got["train_counts"] == want["train_counts"] and got["evals"] == want["evals"]
    def policy_losses(run: Path) -> dict:
        return {m["step"]: m["policy/loss"] for m in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
                if "policy/loss" in m}

    want_losses = policy_losses(ref_dir / "run")
    assert sorted(policy_losses(tmp_path / "run")) == sorted(want_losses) == list(range(1, 41))
    assert policy_losses(tmp_path / "run") == pytest.approx(want_losses, rel=1e-6)
