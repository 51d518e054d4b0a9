"""A real SLURM (scripts/local_slurm.sh: slurmctld, slurmd and munge on this machine, one node):
scripts written by `ds-train slurm` are submitted with sbatch, train under srun with the
environment SLURM sets, get SIGUSR1 before a short time limit, save, and continue exactly, through
SLURM's requeue (training) or a second submission queued behind the first (RIPT,
`sbatch --dependency=afterany`).

    bash scripts/local_slurm.sh        # what the fixture runs: installs and starts, idempotently

The jobs run side by side with their reference runs (the node offers twice its CPUs; the jobs'
ranks mostly wait: rank 0 of each first job is slowed by watchdog.debug_fault, so the signal comes
mid-run, and the config is made fast again once its ranks have read it, for the next start).
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

from conftest import (BIN, ROOT, TESTS_ON_PATH, losses_by_step, node_launch, ript_config, run_cmd, tiny_config,
                      write_config)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
ZERO2 = str(ROOT / "ds_configs" / "zero2.json")


@pytest.fixture(scope="module")
def slurm():
    up = run_cmd(["bash", str(ROOT / "scripts" / "local_slurm.sh")], timeout=180)
    assert up.returncode == 0, f"scripts/local_slurm.sh could not start SLURM (run it as root):\n{up.out[-3000:]}"
    return up


@pytest.fixture(scope="module")
def first_jobs(slurm, tiny_data, tiny_policy, tmp_path_factory):
    """Both tests' jobs, submitted together (RIPT's second submission queued behind its first), and
    both reference runs, launched while the first jobs wait for their signal."""
    jobs = {"train": submit_train(tmp_path_factory.mktemp("slurm_train"), tiny_data),
            "ript": submit_ript(tmp_path_factory.mktemp("slurm_ript"), tiny_policy)}
    try:
        for j in jobs.values():  # once its ranks have read the slow config, the next start runs at full speed
            wait_for(lambda: all((j["run"] / "logs" / f"rank_{r}.log").is_file() for r in (0, 1)), 120,
                     f"the ranks of {j['out']}", every_s=0.2)
            j["fast"]()
        tmp = jobs["train"]["tmp"]
        jobs["train"]["ref"] = reference(write_config(tmp / "ref.yaml", tiny_config(tiny_data, tmp / "ref", **TRAIN)),
                                         "train")
        ref_dir = jobs["ript"]["tmp"] / "ref"
        ref_dir.mkdir()
        jobs["ript"]["ref"] = reference(ript_config(ref_dir, tiny_policy, **RIPT), "ript")
        yield jobs
    finally:
        for j in jobs.values():
            for job in j["ids"]:
                cancel(job)


def reference(config: Path, command: str) -> Path:
    """The same run straight through, through the deepspeed launcher beside SLURM: its run dir."""
    res = run_cmd([*node_launch(), "--module",
                   "ds_train", command, "--config", str(config), "--ds-config", ZERO2], timeout=300, env=TESTS_ON_PATH)
    assert res.returncode == 0, res.out[-3000:]
    return Path(yaml.safe_load(config.read_text())["output_dir"])


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


def sbatch(script: Path, out: Path, *options: str, env: dict | None = None) -> str:
    import os

    full = {**os.environ, "PATH": f"{BIN}:{os.environ.get('PATH', '')}", "WANDB_MODE": "offline", **(env or {})}
    proc = subprocess.run(["sbatch", "--parsable", f"--output={out}", *options, str(script)], capture_output=True,
                          text=True, env=full, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().split(";")[0]


def cancel(job: str) -> None:
    subprocess.run(["scancel", job], capture_output=True)


TRAIN = dict(train={"max_steps": 100}, log={"every": 5}, checkpoint={"every": 0, "save_final": True})
RIPT = dict(iterations=40, eval_every=10, skip_solved=True, retest_after=2)
SLOW = {"debug_fault": "slow:0:1.0"}  # rank 0 sleeps 1 s a step (a rollout round): the signal comes mid-run


def submit_train(tmp: Path, tiny_data: Path) -> dict:
    cfg = write_config(tmp / "run.yaml", tiny_config(tiny_data, tmp / "run", **TRAIN, watchdog=SLOW))
    script = write_script(tmp / "job.sbatch", "--time", "2", "--signal-lead", "60", "--requeue", "--", "train",
                          "--config", str(cfg), "--ds-config", ZERO2)
    job = sbatch(script, tmp / "job.out")
    return {"tmp": tmp, "run": tmp / "run", "out": tmp / "job.out", "id": job, "ids": [job],
            "fast": lambda: write_config(cfg, tiny_config(tiny_data, tmp / "run", **TRAIN))}


def submit_ript(tmp: Path, tiny_policy: Path) -> dict:
    cfg = ript_config(tmp, tiny_policy, **RIPT)
    fast = cfg.read_text()
    cfg.write_text(yaml.safe_dump({**yaml.safe_load(fast), "watchdog": SLOW}))
    first = write_script(tmp / "first.sbatch", "--time", "2", "--signal-lead", "60", "--", "ript", "--config",
                         str(cfg), "--ds-config", ZERO2, env=TESTS_ON_PATH)
    job = sbatch(first, tmp / "first.out", env=TESTS_ON_PATH)
    second = write_script(tmp / "second.sbatch", "--time", "10", "--", "ript", "--config", str(cfg),
                          "--ds-config", ZERO2, env=TESTS_ON_PATH)
    job2 = sbatch(second, tmp / "second.out", f"--dependency=afterany:{job}", env=TESTS_ON_PATH)
    return {"tmp": tmp, "run": tmp / "run", "out": tmp / "first.out", "out2": tmp / "second.out", "id": job,
            "id2": job2, "ids": [job, job2], "fast": lambda: cfg.write_text(fast)}


def finished(job: str) -> dict | None:
    state = job_state(job)
    return state if state.get("JobState") not in ("PENDING", "RUNNING", "COMPLETING", "REQUEUED", None) else None


def test_sigusr1_before_the_time_limit_saves_and_the_requeued_job_resumes_exactly(first_jobs):
    """Training: `--time 2 --signal-lead 60 --requeue`. SIGUSR1 reaches both srun tasks 60-90 s
    before the limit: every rank saves and exits 138, the script requeues the job, and the same job
    (restart 1, same output file) resumes from the save and finishes. Its losses equal a straight
    run's, bitwise. Rank 0 sleeps 1 s a step until the save (watchdog.debug_fault, dropped from the
    config file once the first start has read it), so the signal comes mid-run."""
    j = first_jobs["train"]
    tmp, out, job = j["tmp"], j["out"], j["id"]
    state = wait_for(lambda: job_state(job).get("Restarts", "0") != "0" and finished(job), 240,
                     "the requeued job")
    text = out.read_text()
    assert state["JobState"] == "COMPLETED", (state, text[-3000:])
    restarts = int(state["Restarts"])  # 1; 2 when a requeued start was still slow enough to be signalled
    assert [f"ds-train slurm: job {job} (restart {r})" in text for r in range(restarts + 1)] == [True] * (restarts + 1)
    steps = [int(s) for s in re.findall(r"ds-train: stopped by signal 10 at step (\d+); checkpoint saved", text)]
    assert len(steps) == restarts and all(1 <= s < 100 for s in steps), text[-3000:]
    run = tmp / "run"
    for step in steps:  # every save before the limit is where the next start resumed
        assert f"resumed from {run / 'checkpoints' / f'step_{step:08d}'} at step {step}" in text
        log = (run / "logs" / "rank_1.log").read_text()
        assert f"exit 138: stopped by signal 10 at step {step}" in log and "launcher slurm" in log
    assert losses_by_step(run) == losses_by_step(j["ref"])  # every logged step, before and after the save, bitwise


def test_ript_saves_before_the_time_limit_and_a_second_submission_continues_exactly(first_jobs):
    """RIPT: the same signal, save and exit 138 (no --requeue: the script says to submit again); a
    second submission queued behind it (`sbatch --dependency=afterany`, a longer limit) continues,
    and its counts (skip_solved's skips too), losses and evaluations equal a straight run's."""
    j = first_jobs["ript"]
    out, job, out2, job2 = j["out"], j["id"], j["out2"], j["id2"]
    state = wait_for(lambda: finished(job), 240, "the first job")
    text = out.read_text()
    assert state["ExitCode"] == "138:0", (state, text[-3000:])
    assert "ds-train slurm: saved before the time limit; submit this script again to continue" in text
    m = re.search(r"ds-train: stopped by signal 10 at iteration (\d+); checkpoint saved", text)
    assert m and 1 <= int(m.group(1)) < 40, text[-3000:]
    state = wait_for(lambda: finished(job2), 240, "the second job")
    text2 = out2.read_text()
    assert state["JobState"] == "COMPLETED", (state, text2[-3000:])
    assert f"at iteration {m.group(1)}" in text2 and "resumed from" in text2
    got = json.loads((j["run"] / "ript_results.json").read_text())
    want = json.loads((j["ref"] / "ript_results.json").read_text())
    assert got["iteration"] == want["iteration"] == 40
    assert got["train_counts"] == want["train_counts"] and got["evals"] == want["evals"]
    assert sum(c["skipped"] for c in got["train_counts"].values()) > 0  # solved contexts skipped, before and after

    def policy_losses(run: Path) -> dict:
        return {m["step"]: m["policy/loss"] for m in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
                if "policy/loss" in m}

    want_losses = policy_losses(j["ref"])
    assert sorted(policy_losses(j["run"])) == sorted(want_losses) == list(range(1, 41))
    assert policy_losses(j["run"]) == pytest.approx(want_losses, rel=1e-6)


def test_rollout_ranks_run_under_srun_like_every_other_run(slurm, tiny_policy, tmp_path):
    """A script of `ds-train slurm` for 2 tasks on the node, ript.rollout_ranks_per_node=1: srun numbers the tasks
    node by node, the second generates, the first trains (max_staleness 1); the job completes, its staleness
    is min(i - 1, 1) and the trainers' world is one rank."""
    cfg = ript_config(tmp_path, tiny_policy, iterations=4, sync_every=1, rollout_ranks_per_node=1, max_staleness=1, tis_cap=2)
    script = write_script(tmp_path / "job.sbatch", "--time", "10", "--signal-lead", "0", "--", "ript", "--config",
                          str(cfg), "--ds-config", ZERO2, "train.global_batch_size=12", env=TESTS_ON_PATH)  # no stop
    job = sbatch(script, tmp_path / "job.out", env=TESTS_ON_PATH)
    try:
        state = wait_for(lambda: finished(job), 240, "the job")
    finally:
        cancel(job)
    text = (tmp_path / "job.out").read_text()
    assert state["JobState"] == "COMPLETED", (state, text[-3000:])
    assert "rollout ranks: the last 1 of every node's 2 (1 in all) generate, 1 train; ript.max_staleness 1" in text
    metrics = {m["step"]: m for m in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())}
    assert [metrics[i]["async/staleness_max"] for i in range(1, 5)] == [0, 1, 1, 1]
    env = json.loads((tmp_path / "run" / "env.json").read_text())
    assert (env["launcher"], env["world_size"]) == ("slurm", 1)
