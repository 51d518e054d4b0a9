"""The checkpointer: which steps are its, the stop every rank agreed on, and failed writes named by
their cause (its saves through the real launcher are in test_checkpoint.py)."""

from __future__ import annotations

import signal

import pytest

from conftest import ROOT
from ds_train.checkpoint import checkpointer
from ds_train.checkpoint.commit import tag_for


def test_failed_writes_name_their_cause():
    torch_message = ("[enforce fail at inline_container.cc:747] . open file failed with strerror: No space left on "
                     "device")
    assert checkpointer._IO_ERROR.search(torch_message)
    assert checkpointer._why(RuntimeError(torch_message)) == "No space left on device"
    assert checkpointer._why(OSError(28, "No space left on device")) == "No space left on device"
    assert not checkpointer._IO_ERROR.search("CUDA error: an illegal memory access was encountered")


class _Stop:
    def __init__(self, signum=0):
        self.signum = signum

    def agreed(self):
        return self.signum


class _Recorder(checkpointer.Checkpointer):
    """The Checkpointer's own decisions, with the save (DeepSpeed's collective) recorded instead."""

    def save(self, step, state, rank_state=None, background=False):
        self.saved.append((step, state) + (("background",) if background else ()))
        return tag_for(step)


def recorder(every=0, save_final=True, signum=0, async_save=False):
    from ds_train.config import CheckpointConfig

    cfg = CheckpointConfig(every=every, save_final=save_final, async_save=async_save)
    c = _Recorder(cfg, None, checkpointer.SaveSite(ROOT / "checkpoints"), checkpointer.SaveHooks(_Stop(signum), None),
                  last=10, record={}, unit="iteration")
    c.saved = []
    return c


def test_the_checkpointer_decides_which_steps_are_its():
    c = recorder(every=4)
    for step in range(1, 11):
        c.maybe_save(step, lambda: {"at": step})
    assert c.saved == [(4, {"at": 4}), (8, {"at": 8}), (10, {"at": 10})]
    c = recorder(every=0, save_final=False)
    for step in range(1, 11):
        c.maybe_save(step)
    assert c.saved == []
    c = recorder(every=4, async_save=True)  # periodic saves in the background; the last one blocks
    for step in range(1, 11):
        c.maybe_save(step)
    assert c.saved == [(4, {}, "background"), (8, {}, "background"), (10, {})]
    c = recorder(every=3, async_save=True, signum=int(signal.SIGTERM))  # a stop's save blocks
    with pytest.raises(Exception, match="stopped by signal 15"):
        c.maybe_save(3)
    assert c.saved == [(3, {})]


def test_an_agreed_signal_saves_then_stops_with_128_plus_the_signal():
    from ds_train.errors import Preempted

    c = recorder(signum=int(signal.SIGTERM))
    with pytest.raises(Preempted, match="stopped by signal 15 at iteration 3; checkpoint saved") as stop:
        c.maybe_save(3, lambda: {"ript": "state"})
    assert c.saved == [(3, {"ript": "state"})] and stop.value.exit_code == 143


def test_a_save_longer_than_half_the_launchers_grace_period_is_said_once_with_the_fix():
    from ds_train.checkpoint.checkpointer import grace_warning

    assert grace_warning(14.9, ("the deepspeed launcher", 30.0)) is None  # fits, with the step in progress
    assert grace_warning(100.0, None) is None  # no launcher known to kill (a single process, srun's own)
    said = grace_warning(42.4, ("the deepspeed launcher", 30.0))
    assert said.startswith("checkpoint: a save takes 42 s; the deepspeed launcher kills the ranks 30 s after a "
                           "SIGTERM") and "SIGUSR1" in said and "--signal-lead" in said and "\n" not in said
