"""Checkpoints: completeness, keep-last-k, resume resolution (unit), and through the real launcher:
exact resume after kill -9 and after SIGTERM, for zero2 and zero3."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from conftest import ROOT, deepspeed_args, deepspeed_train, ds_train, reap, spawn, tiny_config, write_config
from ds_train import checkpoint
from ds_train.errors import UserError


def fake_tag(ckpt_dir, step, world=2, complete=True):
    tag_dir = ckpt_dir / checkpoint.tag_for(step)
    tag_dir.mkdir(parents=True)
    for r in range(world if complete else world - 1):
        checkpoint.rank_file(tag_dir, r).write_bytes(b"x")
    if complete:
        (tag_dir / checkpoint.STATE_FILE).write_text(json.dumps(
            {"step": step, "world_size": world, "config": {}}))
    return tag_dir.name


def test_tags_are_zero_padded_and_sort_by_step():
    assert checkpoint.tag_for(100) == "step_00000100"
    assert sorted([checkpoint.tag_for(s) for s in (1000, 20, 3)]) == [
        checkpoint.tag_for(s) for s in (3, 20, 1000)]


def test_a_tag_missing_a_rank_file_is_incomplete(tmp_path):
    good, bad = fake_tag(tmp_path, 2), fake_tag(tmp_path, 4, complete=False)
    (tmp_path / bad / checkpoint.STATE_FILE).write_text(json.dumps({"world_size": 2}))
    assert checkpoint.is_complete(tmp_path / good)
    assert not checkpoint.is_complete(tmp_path / bad)
    assert checkpoint.complete_tags(tmp_path) == [good]


def test_latest_falls_back_to_the_newest_complete_tag(tmp_path):
    a, b = fake_tag(tmp_path, 2), fake_tag(tmp_path, 4)
    fake_tag(tmp_path, 6, complete=False)
    (tmp_path / "latest").write_text("step_00000006")  # names an incomplete tag: never loaded
    assert checkpoint.latest_complete(tmp_path) == b
    (tmp_path / "latest").write_text(a)
    assert checkpoint.latest_complete(tmp_path) == a


def test_prune_keeps_the_newest_k(tmp_path):
    tags = [fake_tag(tmp_path, s) for s in (2, 4, 6, 8)]
    checkpoint.prune(tmp_path, keep=2)
    assert checkpoint.complete_tags(tmp_path) == tags[-2:]
    checkpoint.prune(tmp_path, keep=0)
    assert checkpoint.complete_tags(tmp_path) == tags[-2:]


def test_find_resume(tmp_path):
    assert checkpoint.find_resume("auto", tmp_path / "nothing") is None
    assert checkpoint.find_resume("none", tmp_path) is None
    tag = fake_tag(tmp_path, 4)
    assert checkpoint.find_resume("auto", tmp_path).tag == tag
    assert checkpoint.find_resume(tag, tmp_path).state["step"] == 4
    assert checkpoint.find_resume(str(tmp_path / tag), tmp_path / "elsewhere").tag == tag
    fake_tag(tmp_path, 6, complete=False)
    with pytest.raises(UserError, match="incomplete"):
        checkpoint.find_resume("step_00000006", tmp_path)
    with pytest.raises(UserError, match="neither a tag"):
        checkpoint.find_resume("step_00000099", tmp_path)


def test_config_changes_split_into_errors_and_notes():
    saved = {"seed": 1, "model": {"config": {"hidden_size": 64}}, "optim": {"lr": 1e-3},
             "train": {"max_steps": 10, "seq_len": 64}}
    now = {"seed": 1, "model": {"config": {"hidden_size": 128}}, "optim": {"lr": 5e-4},
           "train": {"max_steps": 20, "seq_len": 64}}
    errors, notes = checkpoint.config_changes(saved, now)
    assert errors == ["model.config.hidden_size: 64 -> 128"]
    assert notes == ["optim.lr: 0.001 -> 0.0005", "train.max_steps: 10 -> 20"]


def test_check_resume_refuses_another_kind_and_for_ript_another_world_size(tmp_path):
    from ds_train.configfile import build_config

    cfg = build_config({"model": {"config": {"model_type": "llama"}}})
    state = {"step": 4, "world_size": 2, "config": cfg.to_dict()}
    train_point = checkpoint.ResumePoint(tmp_path, "step_00000004", state)  # written before `kind` existed
    ript_point = checkpoint.ResumePoint(tmp_path, "step_00000004", {**state, "kind": "ript"})
    assert checkpoint.check_resume(train_point, cfg, "train", world=1) == []  # world size may change
    with pytest.raises(UserError, match="a train checkpoint; `ript` cannot resume from it"):
        checkpoint.check_resume(train_point, cfg, "ript", world=2, same_world=True)
    with pytest.raises(UserError, match="a ript checkpoint; `train` cannot resume from it"):
        checkpoint.check_resume(ript_point, cfg, "train", world=2)
    with pytest.raises(UserError, match="saved with 2 ranks; resume ript with the same world size"):
        checkpoint.check_resume(ript_point, cfg, "ript", world=3, same_world=True)


def test_plan_resume_decides_without_writing(tmp_path):
    point = checkpoint.ResumePoint(tmp_path, "step_00000004", {"world_size": 2, "zero_stage": 2, "dtype": "fp32"})
    assert checkpoint.plan_resume(point, 2, 2, "fp32", False) == checkpoint.ResumePlan(point)
    moved = checkpoint.plan_resume(point, 1, 3, "fp32", False)
    assert moved.universal and moved.convert and "world size 2 -> 1, ZeRO stage 2 -> 3" in moved.notes[0]
    with pytest.raises(UserError, match="fp32 ZeRO-0"):
        checkpoint.plan_resume(point, 2, 0, "fp32", False)
    assert list(tmp_path.iterdir()) == []  # deciding wrote nothing; prepare_resume converts


class _Stop:
    def __init__(self, signum=0):
        self.signum = signum

    def agreed(self):
        return self.signum


class _Recorder(checkpoint.Checkpointer):
    """The Checkpointer's own decisions, with the save (DeepSpeed's collective) recorded instead."""

    def save(self, step, state):
        self.saved.append((step, state))
        return checkpoint.tag_for(step)


def checkpointer(every=0, save_final=True, signum=0):
    from ds_train.config import CheckpointConfig

    c = _Recorder(None, ROOT, CheckpointConfig(every=every, save_final=save_final), 10, 0, 1, {}, _Stop(signum),
                  None, unit="iteration")
    c.saved = []
    return c


def test_the_checkpointer_decides_which_steps_are_its():
    c = checkpointer(every=4)
    for step in range(1, 11):
        c.maybe_save(step, lambda: {"at": step})
    assert c.saved == [(4, {"at": 4}), (8, {"at": 8}), (10, {"at": 10})]
    c = checkpointer(every=0, save_final=False)
    for step in range(1, 11):
        c.maybe_save(step)
    assert c.saved == []


def test_an_agreed_signal_saves_then_stops_with_128_plus_the_signal():
    from ds_train.errors import Preempted

    c = checkpointer(signum=int(signal.SIGTERM))
    with pytest.raises(Preempted, match="stopped by signal 15 at iteration 3; checkpoint saved") as stop:
        c.maybe_save(3, lambda: {"ript": "state"})
    assert c.saved == [(3, {"ript": "state"})] and stop.value.exit_code == 143


# ---- through the real launcher -------------------------------------------------------------

STEPS = 18  # kill-9 at step 10 leaves 8 steps and two saves still to run


def metrics_by_step(run_dir):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {m["step"]: m for m in map(json.loads, lines)}


def rank_pid(run_dir, rank):
    text = (run_dir / "logs" / f"rank_{rank}.log").read_text()
    return int(text.split(" pid ", 1)[1].split()[0])


def wait_for_step(proc, run_dir, step, timeout=180):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        path = run_dir / "metrics.jsonl"
        if path.is_file() and any(json.loads(l)["step"] >= step for l in path.read_text().splitlines()):
            return
        if proc.poll() is not None:
            pytest.fail(f"run ended before step {step}:\n{proc.communicate()[0][-3000:]}")
        time.sleep(0.05)
    pytest.fail(f"step {step} not reached in {timeout}s")


@pytest.fixture(scope="module")
def reference(tiny_data, tmp_path_factory):
    """Uninterrupted runs, one per stage."""
    cache = {}

    def get(stage):
        if stage not in cache:
            out = tmp_path_factory.mktemp(f"ref_{stage}")
            cfg = write_config(out / "run.yaml", tiny_config(
                tiny_data, out / "run", train={"max_steps": STEPS}, checkpoint={"every": 4, "keep": 0}))
            res = deepspeed_train(cfg, f"{stage}.json")
            assert res.returncode == 0, res.out[-3000:]
            cache[stage] = metrics_by_step(out / "run")
            cache[stage + "_dir"] = out / "run"
        return cache[stage]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["zero3"])  # zero2: the SIGTERM test below interrupts and resumes it
def test_kill_9_of_rank_1_then_resume_is_exact(stage, reference, tiny_data, tmp_path):
    run_dir = tmp_path / "run"
    cfg = write_config(tmp_path / "run.yaml", tiny_config(
        tiny_data, run_dir, train={"max_steps": STEPS}, checkpoint={"every": 4, "keep": 2}))
    proc = spawn(deepspeed_args(cfg, f"{stage}.json"))
    wait_for_step(proc, run_dir, 10)
    os.kill(rank_pid(run_dir, 1), signal.SIGKILL)
    t0 = time.monotonic()
    res = reap(proc, timeout=60)
    assert res.returncode != 0 and time.monotonic() - t0 < 60
    ckpts = run_dir / "checkpoints"
    resumed_from = checkpoint.latest_complete(ckpts)
    assert resumed_from is not None and (ckpts / "latest").read_text() == resumed_from
    assert len(checkpoint.complete_tags(ckpts)) <= 2  # keep=2

    res = deepspeed_train(cfg, f"{stage}.json")
    assert res.returncode == 0, res.out[-3000:]
    k = int(resumed_from.split("_")[1])
    assert f"resumed from {ckpts / resumed_from} at step {k}" in res.out
    got, ref = metrics_by_step(run_dir), reference(stage)
    assert sorted(got) == list(range(1, STEPS + 1))  # no duplicated or missing lines
    for step in range(k + 1, STEPS + 1):  # bitwise: same float printed
        assert got[step]["loss"] == ref[step]["loss"], (step, got[step]["loss"], ref[step]["loss"])


@pytest.mark.slow
def test_sigterm_saves_at_the_next_step_and_the_resume_continues(reference, tiny_data, tmp_path):
    run_dir = tmp_path / "run"
    cfg = write_config(tmp_path / "run.yaml", tiny_config(
        tiny_data, run_dir, train={"max_steps": STEPS}, checkpoint={"every": 100, "save_final": True}))
    proc = spawn(deepspeed_args(cfg, "zero2.json"))
    wait_for_step(proc, run_dir, 5)
    os.kill(rank_pid(run_dir, 1), signal.SIGTERM)
    res = reap(proc, timeout=60)
    assert res.returncode != 0, res.out[-3000:]
    saved = checkpoint.latest_complete(run_dir / "checkpoints")
    k = int(saved.split("_")[1])
    assert 5 <= k < STEPS
    assert f"stopped by signal {int(signal.SIGTERM)} at step {k}" in res.out

    res = deepspeed_train(cfg, "zero2.json")
    assert res.returncode == 0, res.out[-3000:]
    got, ref = metrics_by_step(run_dir), reference("zero2")
    assert sorted(got) == list(range(1, STEPS + 1))
    assert all(got[s]["loss"] == ref[s]["loss"] for s in range(k + 1, STEPS + 1))


@pytest.mark.slow
@pytest.mark.parametrize("ds_config", ["zero0.json", "zero2.json"])  # torch AdamW path; DeepSpeed's own
def test_injected_inf_loss_is_skipped(ds_config, tiny_data, tmp_path):
    run_dir = tmp_path / "run"
    cfg = write_config(tmp_path / "run.yaml", tiny_config(
        tiny_data, run_dir, train={"debug_nonfinite_steps": [3, 4], "nonfinite": "skip"},
        checkpoint={"save_final": True}))
    res = deepspeed_train(cfg, ds_config)
    assert res.returncode == 0, res.out[-3000:]
    m = metrics_by_step(run_dir)
    assert m[3]["loss"] == "inf" and m[4]["loss"] == "inf"  # counted, not hidden
    assert [m[s]["train/skipped_steps"] for s in (2, 3, 4, 8)] == [0, 1, 2, 2]
    assert isinstance(m[8]["loss"], float) and m[8]["loss"] < m[1]["loss"]
    assert checkpoint.latest_complete(run_dir / "checkpoints") == "step_00000008"


@pytest.mark.slow
def test_nonfinite_stop_exits_and_keeps_the_last_good_checkpoint(tiny_data, tmp_path):
    run_dir = tmp_path / "run"
    cfg = write_config(tmp_path / "run.yaml", tiny_config(
        tiny_data, run_dir, train={"debug_nonfinite_steps": [5, 6], "nonfinite": "stop",
                                   "nonfinite_patience": 2},
        checkpoint={"every": 2, "keep": 0, "save_final": True}))
    res = deepspeed_train(cfg, "zero2.json")
    assert res.returncode != 0
    assert "step 6: 2 consecutive steps with non-finite gradients" in res.out
    ckpts = run_dir / "checkpoints"
    assert checkpoint.complete_tags(ckpts) == ["step_00000002", "step_00000004"]
    assert (ckpts / "latest").read_text() == "step_00000004"
    assert not (ckpts / "step_00000006").exists()


@pytest.mark.slow
def test_two_process_checkpoint_resumes_on_one_process_through_the_universal_checkpoint(
        reference, tiny_data, tmp_path):
    ref = reference("zero2")  # 2 ranks, checkpoints every 4 steps
    tag_dir = reference("zero2_dir") / "checkpoints" / "step_00000008"
    run_dir = tmp_path / "run"
    cfg = write_config(tmp_path / "run.yaml", tiny_config(
        tiny_data, run_dir, train={"max_steps": STEPS}, checkpoint={"every": 4, "resume": str(tag_dir)}))
    res = ds_train("train", "--config", str(cfg), "--ds-config", str(ROOT / "ds_configs" / "zero2.json"))
    assert res.returncode == 0, res.out[-3000:]
    assert "world size 2 -> 1, ZeRO stage 2 -> 2: loading through DeepSpeed's universal checkpoint " \
           "step_00000008_universal" in res.out
    assert "resumed from" in res.out and "at step 8" in res.out
    got = metrics_by_step(run_dir)
    assert sorted(got) == list(range(9, STEPS + 1))
    assert all(got[s]["world_size"] == 1 for s in got)
    for step in range(9, STEPS + 1):  # same data stream, one rank instead of two: reduction order only
        assert got[step]["loss"] == pytest.approx(ref[step]["loss"], rel=2e-3), step


@pytest.mark.slow
def test_changed_config_on_resume_convert_command_and_refused_stage_change(tiny_data, tmp_path):
    """One 8-step run, then: a changed model is refused; `ds-train convert` writes a universal
    checkpoint; changed knobs resume and are listed; a move to fp32 ZeRO-0 is refused."""
    run_dir = tmp_path / "run"
    cfg = write_config(tmp_path / "run.yaml", tiny_config(tiny_data, run_dir, checkpoint={"save_final": True}))
    zero2, zero0 = (str(ROOT / "ds_configs" / f) for f in ("zero2.json", "zero0.json"))
    assert deepspeed_train(cfg, "zero2.json").returncode == 0
    res = ds_train("train", "--config", str(cfg), "--ds-config", zero2, "model.config.hidden_size=128")
    assert res.returncode == 2
    assert "cannot resume with a changed model.config.hidden_size: 64 -> 128" in res.out

    res = ds_train("convert", "--to", "universal", str(run_dir))
    assert res.returncode == 0, res.out[-3000:]
    out = run_dir / "checkpoints" / "step_00000008_universal"
    assert checkpoint.is_complete(out) and (out / "zero").is_dir()
    assert f"wrote {out}" in res.out

    res = deepspeed_train(cfg, "zero2.json", "train.max_steps=10", "optim.lr=0.005")
    assert res.returncode == 0, res.out[-3000:]
    assert "resuming with changed settings: optim.lr: 0.01 -> 0.005; train.max_steps: 8 -> 10" in res.out
    assert sorted(metrics_by_step(run_dir)) == list(range(1, 11))

    res = ds_train("train", "--config", str(cfg), "--ds-config", zero0, "train.max_steps=12")
    assert res.returncode == 2
    assert "DeepSpeed cannot move optimizer states between fp32 ZeRO-0" in res.out


@pytest.mark.slow
def test_kill_9_during_a_save_leaves_the_previous_checkpoint_latest(tiny_data, tmp_path):
    """A model large enough that a save takes a while; rank 1 is killed while a tag is half written."""
    run_dir = tmp_path / "run"
    model = {"hidden_size": 256, "intermediate_size": 704, "num_hidden_layers": 4}
    cfg = write_config(tmp_path / "run.yaml", tiny_config(
        tiny_data, run_dir, model={"config": {**tiny_config(tiny_data, run_dir)["model"]["config"], **model}},
        train={"max_steps": 400}, checkpoint={"every": 1, "keep": 0}))
    proc = spawn(deepspeed_args(cfg, "zero2.json"))
    wait_for_step(proc, run_dir, 2)
    ckpts, killed, deadline = run_dir / "checkpoints", None, time.monotonic() + 120
    while killed is None and time.monotonic() < deadline and proc.poll() is None:
        for tag_dir in ckpts.glob("step_*"):
            if any(tag_dir.iterdir()) and not checkpoint.is_complete(tag_dir):
                os.kill(rank_pid(run_dir, 1), signal.SIGKILL)
                killed = tag_dir.name
                break
        time.sleep(0.002)
    t0 = time.monotonic()
    res = reap(proc, timeout=60)
    assert killed is not None, "never saw a save in progress"
    assert res.returncode != 0 and time.monotonic() - t0 < 60
    latest = (ckpts / "latest").read_text()
    assert checkpoint.is_complete(ckpts / latest) and latest < killed
    assert checkpoint.latest_complete(ckpts) == latest  # the half-written tag is never chosen

    k = int(latest.split("_")[1])
    res = deepspeed_train(cfg, "zero2.json", f"train.max_steps={k + 1}")
    assert res.returncode == 0, res.out[-3000:]
    assert f"resumed from {ckpts / latest} at step {k}" in res.out
