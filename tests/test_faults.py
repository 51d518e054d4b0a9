"""ds_train/faults.py: each debug_fault fires on its rank and its step (or save phase) only. What
each fault does to a real job is tested where its path is: test_watchdog.py, test_checkpoint.py,
test_multinode.py."""

from __future__ import annotations

import pytest

from ds_train import faults
from ds_train.config import WatchdogConfig


def test_step_faults_fire_on_their_rank_and_step_only(monkeypatch):
    slept = []
    monkeypatch.setattr(faults.time, "sleep", slept.append)
    assert faults.step_fault("", 0) is None and faults.step_fault("raise:1:3", 0) is None
    hook = faults.step_fault("raise:1:3", 1)
    hook(2, "data")
    hook(3, "forward")
    with pytest.raises(RuntimeError, match="injected failure on rank 1 at step 3"):
        hook(3, "data")
    slow = faults.step_fault("slow:0:0.05:2", 0)
    slow(1, "data")  # before its first step
    slow(2, "forward")  # not a phase it slows
    assert slept == []
    slow(2, "data")
    slow(3, "rollout")
    assert slept == [0.05, 0.05]
    # device_assert: a real out-of-range index in a kernel (on this CPU torch's own bounds check)
    kernel = faults.step_fault("device_assert:0:4", 0)
    kernel(3, "data")
    with pytest.raises(IndexError, match="index 4 is out of bounds"):
        kernel(4, "data")
    assert WatchdogConfig(debug_fault="device_assert:0:4").check() == []
    assert "is not ACTION:RANK:ARG" in WatchdogConfig(debug_fault="device_assert:x:4").check()[0]


def test_a_save_fault_can_name_the_one_rank_it_fires_on():
    assert faults.parse_save_fault("kill:written:4") == ("kill", "written", 4, None)
    assert faults.parse_save_fault("enospc:marked:6:0") == ("enospc", "marked", 6, 0)
    quiet = faults.save_fault("enospc:written:4:1", rank=0)  # rank 1's fault: rank 0 goes on
    quiet("written", 4)
    loud = faults.save_fault("enospc:written:4:1", rank=1)
    loud("written", 2)  # another step
    with pytest.raises(OSError, match="No space left on device"):
        loud("written", 4)
    with pytest.raises(OSError):
        faults.save_fault("enospc:written:4", rank=3)("written", 4)  # no rank: every rank
