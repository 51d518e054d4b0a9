"""The run machinery's pure parts: batch math per command, the model source, signals, the host
table, the run directory's checks. (Built runs are tested through the launchers in test_trainer.py
and test_ript_trainer.py.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from conftest import ROOT
from ds_train.checkpoint.rundir import RunPaths
from ds_train.checkpoint.storage import check_run_dir, host_table, nodes
from ds_train.config.file import build_config
from ds_train.dsconfig import read_ds_template
from ds_train.errors import UserError
from ds_train.inputs import check_inputs
from ds_train.ript.trainer import ript_spec
from ds_train.run import StopRequest, _ending
from ds_train.train.loop import train_spec

ZERO0 = str(ROOT / "ds_configs" / "zero0.json")


def resolve_model(cfg):
    return check_inputs(cfg, ZERO0, data=False).source


def test_each_command_checks_its_own_batch_math_and_schedule_length():
    cfg = build_config({"model": {"config": {"model_type": "llama"}},
                        "train": {"max_steps": 30, "micro_batch_size": 4, "global_batch_size": 24},
                        "ript": {"iterations": 5, "ppo_epochs": 2, "contexts_per_rank": 3, "rloo_batch_size": 4}})
    template = read_ds_template(ZERO0)
    layout, steps = train_spec(cfg).check(cfg, template, 2)
    assert (layout.dims.data, layout.batch.grad_accum_steps, steps) == (2, 3, 30)
    layout, steps = ript_spec(cfg).check(cfg, template, 2)  # 12 rollouts per rank = 1 step of 12, x 2 epochs x 5
    assert steps == 5 * 2 * 1
    with pytest.raises(UserError, match="12 rollouts per rank must be a multiple of .* = 8; set "
                                        "train.global_batch_size to 36"):
        ript_spec(cfg).check(cfg, template, 3)  # 24 / (4 x 3): 8 sequences per rank and step
    with pytest.raises(UserError, match="not a multiple of train.micro_batch_size=4 x world size 5"):
        train_spec(cfg).check(cfg, template, 5)
    assert ript_spec(cfg).same_world and not train_spec(cfg).same_world
    assert (train_spec(cfg).unit, ript_spec(cfg).unit) == ("step", "iteration")


def test_model_source_is_a_hf_directory_or_a_ds_train_run(tiny_policy, tmp_path):
    cfg = build_config({"model": {"path": str(tiny_policy)}, "train": {"seq_len": 64}})
    source = resolve_model(cfg)
    assert source.weights == tiny_policy and source.export_from is None
    assert source.hf_config.vocab_size == len(source.tokenizer)
    (tmp_path / "checkpoints").mkdir()  # a run directory that never finished a save
    with pytest.raises(UserError, match="model.path: .* holds no complete checkpoint"):
        resolve_model(build_config({"model": {"path": str(tmp_path)}}))
    (tmp_path / "checkpoints").rmdir()
    with pytest.raises(UserError, match="neither a Hugging Face directory .* nor a ds_train run"):
        resolve_model(build_config({"model": {"path": str(tmp_path)}}))
    assert list(tmp_path.iterdir()) == []


def test_a_signal_is_only_recorded_the_first_wins_and_the_handlers_come_back():
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    stop = StopRequest()
    assert stop.agreed() == 0
    os.kill(os.getpid(), signal.SIGINT)  # would end the test process without the handler
    os.kill(os.getpid(), signal.SIGTERM)  # what DeepSpeed's launcher sends after a Ctrl-C
    assert stop.agreed() == signal.SIGINT  # the first one: exit 130, as for Ctrl-C
    stop.restore()
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before


def test_sigusr1_before_the_run_is_kept_for_it_and_after_its_end_is_harmless():
    """SLURM's pre-timeout SIGUSR1 can come during start-up or after the last step (the CI run of
    2026-11-25 saw a finished rank die of it, exit 138, and the job requeued for nothing)."""
    from ds_train import signals
    before = signal.getsignal(signal.SIGUSR1)
    try:
        signals.keep_usr1()
        os.kill(os.getpid(), signal.SIGUSR1)  # start-up: no run handler yet; the default would kill pytest
        stop = StopRequest()
        assert stop.agreed() == signal.SIGUSR1  # kept for the run: it saves at its first step
        stop.restore()
        os.kill(os.getpid(), signal.SIGUSR1)  # after the run's end: kept, not fatal
        assert signals.take_kept() == signal.SIGUSR1 and signals.take_kept() == 0
        assert StopRequest().signum == 0  # taken once
    finally:
        signal.signal(signal.SIGUSR1, before)


def test_sigusr1_while_the_interpreter_finalizes_is_not_fatal():
    """Python restores SIGUSR1's fatal default while it finalizes, after `main` returned: the CI run
    of 2026-11-25 (second) saw a finished rank die there, srun said "User defined signal 1" and the
    job was requeued for nothing. An object destroyed at finalization sends it here."""
    script = ("import os, signal\n"
              "from ds_train import signals\n"
              "class Late:\n"
              "    def __del__(self):\n"
              "        os.kill(os.getpid(), signal.SIGUSR1)\n"
              "signals.keep_usr1()\n"
              "late = Late()\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, (done.returncode, done.stderr)
    bare = subprocess.run([sys.executable, "-c", script.replace("signals.keep_usr1()", "signal.signal(signal.SIGUSR1, signals._keep)")],
                          capture_output=True, text=True, timeout=60)
    assert bare.returncode == -signal.SIGUSR1  # the fault the exit hook removes


def test_each_rank_log_ends_with_how_the_run_ended():
    from ds_train.errors import Preempted

    assert _ending(None) == "run ended"
    assert _ending(Preempted(15, 7, "iteration")).startswith("exit 143: stopped by signal 15 at iteration 7")
    assert _ending(UserError("bad")) == "exit 2: bad"
    assert _ending(ValueError("boom")) == "exit 1: ValueError: boom"


def test_host_table_is_keyed_by_node_rank():
    """Loopback "nodes" on one machine share a hostname: the node rank keeps them apart."""
    gathered = [(0, "vm"), (0, "vm"), (1, "vm"), (1, "vm")]  # what each rank sends, by rank
    assert host_table(gathered) == "hosts: node0 vm -> ranks 0,1; node1 vm -> ranks 2,3"
    assert host_table([(0, "a"), (1, "b")]) == "hosts: node0 a -> ranks 0; node1 b -> ranks 1"
    assert nodes([(1, "b"), (0, "a")]) == [{"node": 0, "host": "a", "ranks": [1]},
                                           {"node": 1, "host": "b", "ranks": [0]}]


def test_names_the_run_uses_taken_by_the_wrong_kind_are_refused(tmp_path):
    check_run_dir(RunPaths(tmp_path / "nothing yet"))
    (tmp_path / "checkpoints").write_text("x")
    (tmp_path / "metrics.jsonl").mkdir()
    with pytest.raises(UserError, match=r"metrics.jsonl is a directory; checkpoints is a file, where the run keeps "
                                        r"its own; move them away or choose another output_dir"):
        check_run_dir(RunPaths(tmp_path))


def test_one_run_at_a_time_holds_the_run_directory(tmp_path):
    import os

    from ds_train.fs import hold_lock

    fd, holder = hold_lock(tmp_path / ".ds_train.lock")
    assert fd is not None and holder == ""
    again, holder = hold_lock(tmp_path / ".ds_train.lock")  # another open file: as another process
    assert again is None and holder.startswith(f"pid {os.getpid()} on ")
    os.close(fd)
    fd, holder = hold_lock(tmp_path / ".ds_train.lock")
    assert fd is not None
    os.close(fd)
