"""The launchers above a rank (ds_train/observe/launchers.py): which command lines are launchers, and a
launcher that ends (killed, or a zombie nobody reaped) is seen gone. The launch tests (SIGTERM and
SIGKILL of the `deepspeed` runner) are in tests/test_checkpoint.py and tests/test_ript_trainer.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from ds_train.observe.launchers import LauncherWatch, launcher_kind


@pytest.mark.parametrize("cmdline, kind", [
    (["/venv/bin/python3", "-u", "-m", "deepspeed.launcher.launch", "--world_info=e30=", "--module", "ds_train",
      "train"], "deepspeed launcher"),
    (["/venv/bin/python3", "/venv/bin/deepspeed", "--num_gpus", "2", "--module", "ds_train", "train"],
     "deepspeed runner"),
    (["python", "-m", "deepspeed.launcher.runner", "--hostfile", "h"], "deepspeed runner"),
    (["/venv/bin/python3", "/venv/bin/torchrun", "--nproc_per_node", "2", "-m", "ds_train"], "torchrun"),
    (["python", "-m", "torch.distributed.launch", "--nproc_per_node", "2"], "torchrun"),
    (["/venv/bin/python3", "/venv/bin/ds-train", "launch", "--hostfile", "h", "--", "train"], "ds-train launch"),
    (["python", "-m", "ds_train", "--debug", "launch", "--hostfile", "h"], "ds-train launch"),
    # not launchers: a rank itself, a shell, nohup, SLURM's step daemon, a path that mentions deepspeed
    (["/venv/bin/python3", "-u", "-m", "ds_train", "--local_rank=0", "train", "--ds-config", "ds_configs/zero2.json"],
     None),
    (["bash", "run.sh"], None), (["nohup", "python", "-m", "ds_train", "train"], None),
    (["slurmstepd: [12.0]"], None), (["python", "train.py", "--out", "/data/deepspeed_runs/a"], None),
])
def test_launcher_kind(cmdline, kind):
    assert launcher_kind(cmdline) == kind


def test_a_launcher_above_is_watched_and_seen_gone_when_killed_even_as_an_unreaped_zombie():
    """A real chain: this test -> `python -c ... torchrun` (a launcher by its command line) -> a child.
    The child's watch holds the launcher (not this test: pytest is no launcher); SIGKILL of the
    launcher leaves a zombie until its parent reaps it, and the watch already names it gone."""
    code = ("import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', "
            "'import time; time.sleep(60)']); print(p.pid, flush=True); time.sleep(60)")
    launcher = subprocess.Popen([sys.executable, "-c", code, "torchrun"], stdout=subprocess.PIPE, text=True)
    try:
        child = int(launcher.stdout.readline())
        watch = LauncherWatch(child)
        assert [(w.kind, w.pid) for w in watch.launchers] == [("torchrun", launcher.pid)]
        assert watch.gone() is None
        os.kill(launcher.pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while watch.gone() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert watch.gone() is not None and watch.gone().pid == launcher.pid  # a zombie: not reaped yet
        assert launcher.poll() == -signal.SIGKILL  # reaped now: still gone
        assert watch.gone().describe() == f"torchrun (pid {launcher.pid})"
        assert LauncherWatch().launchers == []  # this test process: started by no launcher
    finally:
        launcher.kill()
        launcher.wait()
        try:
            os.kill(child, signal.SIGKILL)
        except (ProcessLookupError, UnboundLocalError):
            pass


def test_the_grace_period_comes_from_the_launcher_above_or_slurm():
    from ds_train.observe.launchers import Launcher, kill_grace

    watch = LauncherWatch()
    assert kill_grace(watch, {}) is None  # pytest is no launcher
    assert kill_grace(watch, {"SLURM_JOB_ID": "7"}) == ("SLURM (KillWait, 30 s by default)", 30.0)
    watch.launchers = [Launcher("deepspeed launcher", 1, 0.0), Launcher("deepspeed runner", 2, 0.0)]
    assert kill_grace(watch, {"SLURM_JOB_ID": "7"}) == ("the deepspeed launcher", 30.0)


def test_the_launch_beat_comes_from_the_environment_or_is_one_line():
    from ds_train.errors import UserError
    from ds_train.observe.launchers import BEAT_S, launch_beat_s

    assert launch_beat_s({}) == BEAT_S and launch_beat_s({"DS_TRAIN_LAUNCHER_BEAT_S": " 1.5 "}) == 1.5
    for bad in ("fast", "0", "-2", "nan", "1e9"):
        with pytest.raises(UserError, match=rf"DS_TRAIN_LAUNCHER_BEAT_S='{bad}': not a number of seconds"):
            launch_beat_s({"DS_TRAIN_LAUNCHER_BEAT_S": bad})
