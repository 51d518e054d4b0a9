"""Checkpoints: completeness, keep-last-k, resume resolution (unit), and through the real launcher:
exact resume after kill -9 and after SIGTERM, for zero2 and zero3."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import time
from pathlib import Path

import pytest

from conftest import (ROOT, Result, STRAIGHT_STEPS, TINY_MODEL, deepspeed_args, deepspeed_train, ds_train, expect_error,
                      node_launch, pids_with, reap, run_cmd, spawn, tiny_config, tree_listing, write_config)
from ds_train.checkpoint import commit as checkpoint
from ds_train.checkpoint import consensus, resume
from ds_train.observe.doctor import diagnose


def fake_tag(ckpt_dir, step, world=2, complete=True, seq=None):
    """A tag as `checkpoint.save` lays it out: each rank's files and manifest, then the marker."""
    seq = step if seq is None else seq
    tag_dir = ckpt_dir / checkpoint.tag_for(step)
    tag_dir.mkdir(parents=True)
    (tag_dir / "mp_rank_00_model_states.pt").write_bytes(b"weights")
    for r in range(world if complete else world - 1):
        (tag_dir / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt").write_bytes(b"optim" * (r + 1))
        checkpoint.rank_file(tag_dir, r).write_bytes(b"x")
        files = ["mp_rank_00_model_states.pt", f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt",
                 checkpoint.rank_file(tag_dir, r).name]
        checkpoint.manifest_file(tag_dir, r).write_text(json.dumps(
            {"rank": r, "seq": seq, "files": {f: (tag_dir / f).stat().st_size for f in files}}))
    if complete:
        (tag_dir / checkpoint.STATE_FILE).write_text(json.dumps(
            {"step": step, "world_size": world, "seq": seq, "zero_stage": 2, "config": {}}))
    return tag_dir.name


def test_tags_are_zero_padded_and_sort_by_step():
    assert checkpoint.tag_for(100) == "step_00000100"
    assert sorted([checkpoint.tag_for(s) for s in (1000, 20, 3)]) == [
        checkpoint.tag_for(s) for s in (3, 20, 1000)]


def test_a_tag_is_complete_when_marked_and_every_rank_file_is_as_written(tmp_path):
    good, bad = fake_tag(tmp_path, 2), fake_tag(tmp_path, 4, complete=False)
    (tmp_path / bad / checkpoint.STATE_FILE).write_text(json.dumps({"step": 4, "world_size": 2, "seq": 4}))
    assert checkpoint.is_complete(tmp_path / good)
    assert not checkpoint.is_complete(tmp_path / bad)
    assert checkpoint.complete_tags(tmp_path) == [good]
    assert checkpoint.rank_missing(tmp_path / bad, 1) == ["ds_train_rank_1.json"]
    shard = tmp_path / good / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    shard.write_bytes(b"cut")  # truncated after it was recorded
    assert checkpoint.rank_missing(tmp_path / good, 1) == [f"{shard.name} (cut short: 3 of 10 bytes written)"]
    shard.write_bytes(b"overwritten!")  # another writer's file
    assert checkpoint.rank_missing(tmp_path / good, 1) == [f"{shard.name} (12 bytes, not 10 bytes written)"]
    assert not checkpoint.is_complete(tmp_path / good)
    (tmp_path / good / checkpoint.STATE_FILE).write_text('{"step": 2, "world')  # a damaged marker
    assert checkpoint.read_marker(tmp_path / good)[1].startswith("ds_train_state.json is damaged")


def test_the_newest_save_wins_not_the_highest_step(tmp_path):
    """A resume from an older tag saves with a higher sequence number than the abandoned tags."""
    fake_tag(tmp_path, 2, seq=1)
    fake_tag(tmp_path, 6, seq=3)  # the continuation that was abandoned
    fake_tag(tmp_path, 4, seq=4)  # saved after resuming from step 2
    (tmp_path / "latest").write_text("step_00000002")  # a crash between the marker and `latest`
    assert checkpoint.latest_complete(tmp_path) == "step_00000004"
    assert checkpoint.complete_tags(tmp_path) == ["step_00000002", "step_00000006", "step_00000004"]


def test_pruning_keeps_the_newest_saves_and_never_the_tag_just_saved(tmp_path):
    fake_tag(tmp_path, 2, seq=1)
    fake_tag(tmp_path, 6, seq=3)
    fake_tag(tmp_path, 8, seq=4)
    fake_tag(tmp_path, 9, complete=False)  # a save that did not finish
    fake_tag(tmp_path, 4, seq=5)  # just saved, after a resume from step 2
    assert checkpoint.prunable(tmp_path, 2, "step_00000004") == ["step_00000002", "step_00000006",
                                                                 "step_00000009"]
    assert checkpoint.prunable(tmp_path, 0, "step_00000004") == []  # keep=0 keeps every tag
    checkpoint.prune(tmp_path, keep=2)
    assert checkpoint.complete_tags(tmp_path) == ["step_00000008", "step_00000004"]


def test_a_marker_without_what_a_save_writes_is_damaged_and_said(tmp_path):
    tag = tmp_path / fake_tag(tmp_path, 4)
    good = json.loads((tag / checkpoint.STATE_FILE).read_text())
    for key, value in (("seq", None), ("config", None), ("zero_stage", None), ("step", "abc"), ("seq", True)):
        broken = {k: v for k, v in good.items() if k != key} if value is None else {**good, key: value}
        (tag / checkpoint.STATE_FILE).write_text(json.dumps(broken))
        state, why = checkpoint.read_marker(tag)
        assert state is None and why.startswith("ds_train_state.json is damaged") and key in why, (key, why)


def test_latest_that_is_not_text_and_files_named_like_tags_are_survived(tmp_path):
    fake_tag(tmp_path, 2)
    (tmp_path / "latest").write_bytes(b"\x00\xffgarbage")
    (tmp_path / "step_00000008").write_text("a stray file, not a tag")
    checkpoint.unmark(tmp_path, "step_00000004")  # reads `latest` without choking
    assert checkpoint.complete_tags(tmp_path) == ["step_00000002"]
    assert checkpoint.prunable(tmp_path, 1, "step_00000004") == ["step_00000002"]  # the file is not deleted
    assert (tmp_path / "step_00000008").is_file()


def protocol_save(ckpt_dir, step, seq, keep, world=2, said=None):
    """A save through the real protocol (begin, then every rank's commit, rank 0 last as the writer), one
    process playing every rank; the engine's files are stand-ins, one under a name ds_train knows nothing of."""
    tag = checkpoint.begin(None, ckpt_dir, step, writer=True)
    tag_dir = ckpt_dir / tag
    (tag_dir / "mp_rank_00_model_states.pt").write_bytes(b"weights")
    (tag_dir / "expert_0_mp_rank_00_model_states.pt").write_bytes(b"experts")  # in no manifest
    state, said = {"step": step, "zero_stage": 2, "config": {}}, [] if said is None else said
    for r in reversed(range(world)):
        (tag_dir / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt").write_bytes(b"optim")
        checkpoint.rank_file(tag_dir, r).write_bytes(b"x")
        checkpoint.commit(ckpt_dir, tag, step, state, r, world, keep, r == 0, seq,
                          ["mp_rank_00_model_states.pt", f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt"],
                          lambda phase: None, lambda chosen: chosen or [], say=said.append)
    return tag


def test_retention_deletes_only_what_ds_train_wrote_and_says_what_a_user_left(tmp_path):
    ckpts, said = tmp_path / "checkpoints", []
    t2, t4 = protocol_save(ckpts, 2, 1, keep=2), protocol_save(ckpts, 4, 2, keep=2)
    assert checkpoint.complete_tags(ckpts) == [t2, t4]
    (ckpts / t2 / "notes.txt").write_text("lr too high")  # a user's files, after the save
    (ckpts / t2 / "eval").mkdir()
    (ckpts / t2 / "eval" / "results.json").write_text("{}")
    (ckpts / "step_00000010").mkdir()
    (ckpts / "step_00000010" / "mine.txt").write_text("put there before ds_train saved step 10")
    protocol_save(ckpts, 6, 3, keep=2, said=said)  # prunes tag 2
    assert sorted(tree_listing(ckpts / t2)) == ["eval", "eval/results.json", "notes.txt"]  # the save's files gone
    assert said == [f"checkpoint.keep: removed {t2}'s checkpoint files; kept 2 file(s) a user left there "
                    f"(eval/results.json, notes.txt): ds_train deletes only what it wrote"]
    assert not checkpoint.tagfiles.holds_a_save(ckpts / t2) and checkpoint.complete_tags(ckpts) == [t4, "step_00000006"]
    # A save into a folder that holds a user's file, cut short (no commit): pruned as an unfinished save, the
    # file kept; a save that finishes there records it as the user's too.
    t10 = checkpoint.begin(None, ckpts, 10, writer=True)
    (ckpts / t10 / "mp_rank_00_model_states.pt").write_bytes(b"half")
    assert checkpoint.prunable(ckpts, 2, "step_00000008") == [t4, t10]  # the user-only tag 2 is no save
    said.clear()
    protocol_save(ckpts, 8, 4, keep=2, said=said)
    assert sorted(tree_listing(ckpts / t10)) == ["mine.txt"] and not (ckpts / t4).exists()  # tag 4: nothing of a user's
    assert said == [f"checkpoint.keep: removed {t10}'s checkpoint files; kept 1 file(s) a user left there "
                    f"(mine.txt): ds_train deletes only what it wrote"]
    protocol_save(ckpts, 10, 5, keep=0)
    (ckpts / t10 / "later.txt").write_text("after the save")
    assert checkpoint.remove_tags(ckpts, [t10]) == {t10: ["later.txt", "mine.txt"]}
    # Folders of a user's files only are not saves: pruning passes them by, the resume does not call them
    # unfinished (or damaged), and nothing newer is said to be skipped.
    assert checkpoint.prunable(ckpts, 1, "step_00000008") == ["step_00000006"]
    view = consensus.RankView(0, 0, "h", consensus.scan(ckpts, None, 0, 2))
    assert sorted(view.tags) == ["step_00000006", "step_00000008"]
    decision = consensus.decide("auto", ckpts, None, [view, consensus.RankView(1, 0, "h", view.tags)], 2)
    assert decision.point.tag == "step_00000008"
    assert decision.said == f"resumed from {ckpts / 'step_00000008'} at step 8"
    assert resume.newer_incomplete(resume.ResumePoint(ckpts, t4, {"step": 4})) == []


def test_a_tag_saved_before_the_record_loses_only_ds_trains_files_and_what_its_manifests_list(tmp_path):
    tag = tmp_path / fake_tag(tmp_path, 2)  # as an older ds_train laid it out: no ds_train_files.json
    (tag / "notes.txt").write_text("mine")
    assert checkpoint.remove_tags(tmp_path, [tag.name]) == {tag.name: ["notes.txt"]}
    assert sorted(tree_listing(tag)) == ["notes.txt"]


# ---- through the real launcher -------------------------------------------------------------

STEPS = STRAIGHT_STEPS  # conftest.straight_zero2: the reference of the zero2 runs stopped and resumed


def metrics_by_step(run_dir):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {m["step"]: m for m in map(json.loads, lines)}


def rank_pid(run_dir, rank):
    text = (run_dir / "logs" / f"rank_{rank}.log").read_text()
    return int(text.rsplit(" pid ", 1)[1].split()[0])  # this start's (a resumed run appends to the log)


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


STALL_S = 30  # watchdog.stall_s of the kill tests: a job that lost a rank ends within STALL_S + 60 s


def kill_rank(proc, run_dir: Path, rank: int, after: int) -> Result:
    """SIGKILL `rank` (as the OOM killer does) once the run logged step `after`; the job must end
    within STALL_S + 60 s (reap's limit) with the verdict on that rank."""
    wait_for_step(proc, run_dir, after)
    os.kill(rank_pid(run_dir, rank), signal.SIGKILL)
    res = reap(proc, timeout=STALL_S + 60)
    assert res.returncode != 0, res.out[-3000:]
    assert "Traceback" not in res.out, res.out[-4000:]  # the surviving rank says one line, no gloo traceback
    failure = json.loads((run_dir / "logs" / "failure.json").read_text())
    host = socket.gethostname()
    assert (failure["kind"], failure["rank"], failure["host"], failure["signal"]) == ("killed", rank, host, "SIGKILL")
    assert after <= failure["step"] <= max(metrics_by_step(run_dir)) + 1  # the step it died in, not a stale one
    last = [line for line in res.out.splitlines() if line.startswith("ds-train")][-1]
    assert last.startswith(f"ds-train: error: rank {rank} on node 0 ({host}) was killed by SIGKILL in step "
                           f"{failure['step']}"), res.out[-3000:]
    assert f"then rank {1 - rank} lost the connection" in last
    doctor = ds_train("doctor", str(run_dir), timeout=120)  # the doctor reads the live failure
    assert "a rank was killed" in doctor.out and f"rank {rank} on {host}" in doctor.out, doctor.out
    return res


@pytest.mark.slow
def test_sigkill_of_rank_0_then_of_rank_1_each_named_and_each_resume_is_exact(tiny_data, tmp_path):
    """ZeRO-3 under sequence parallelism (parallel.sequence=2 on 2 processes: both ranks hold halves
    of the same sequences), saving every 2 steps. Rank 0 (which serves the rendezvous store) is
    killed after step 3: the job ends with one line naming rank 0, its host, SIGKILL and its last
    step (the second store, on rank 1, carries the verdict). The same command resumes from the newest
    whole save, whose marker records the layout; rank 1 is killed 2 steps later, named the same way;
    the third start finishes with the uninterrupted run's losses, bitwise."""
    def config(run_dir):
        return write_config(tmp_path / f"{run_dir.name}.yaml", tiny_config(
            tiny_data, run_dir, train={"micro_batch_size": 2}, parallel={"sequence": 2},
            checkpoint={"every": 2, "keep": 2}, watchdog={"stall_s": STALL_S, "heartbeat_s": 0.5}))

    straight = tmp_path / "straight"
    res = deepspeed_train(config(straight), "zero3.json")
    assert res.returncode == 0, res.out[-3000:]
    assert "parallel: data 1 x sequence 2 x tensor 1 = world 2; each rank holds 32 positions of a sequence" in res.out
    ref = metrics_by_step(straight)
    run_dir = tmp_path / "run"
    cfg = config(run_dir)
    args = deepspeed_args(cfg, "zero3.json", "watchdog.debug_fault=slow:0:0.3")  # slower, same numbers
    ckpts = run_dir / "checkpoints"
    kill_rank(spawn(args), run_dir, 0, after=3)
    first = checkpoint.latest_complete(ckpts)
    assert first in ("step_00000002", "step_00000004") and (ckpts / "latest").read_text() == first
    assert checkpoint.read_marker(ckpts / first)[0]["parallel"] == {"data": 1, "sequence": 2, "tensor": 1}

    k = int(first.split("_")[1])
    res = kill_rank(spawn(args), run_dir, 1, after=k + 3)  # the save of step k + 2 is whole by then
    assert f"resumed from {ckpts / first} at step {k}" in res.out
    second = checkpoint.latest_complete(ckpts)
    assert int(second.split("_")[1]) > k and len(checkpoint.complete_tags(ckpts)) == 2  # keep=2

    res = deepspeed_train(cfg, "zero3.json")
    assert res.returncode == 0, res.out[-3000:]
    k2 = int(second.split("_")[1])
    assert f"resumed from {ckpts / second} at step {k2}" in res.out
    got = metrics_by_step(run_dir)
    assert sorted(got) == sorted(ref) == list(range(1, 9))  # no duplicated or missing lines
    for step in range(k2 + 1, 9):  # bitwise: same float printed
        assert got[step]["loss"] == ref[step]["loss"], (step, got[step]["loss"], ref[step]["loss"])


@pytest.mark.slow
def test_tensor_parallelism_resumes_exactly_converts_to_one_rank_a_layer_and_exports(tiny_data, tmp_path):
    """AutoTP (parallel.tensor=2 on 2 processes, ZeRO-2), saving every 2 steps. Rank 1 is killed after
    step 3; the same command resumes from the newest whole save (its marker records the layout) and
    finishes with the uninterrupted run's losses, bitwise. A save resumed at parallel.tensor=1 goes
    through DeepSpeed's universal checkpoint (AutoTP's shards merged) and continues within 1e-5 of
    the uninterrupted run. The last save exported loads with from_pretrained and gives the TP
    engine's logits within 1e-5."""
    def config(run_dir, tensor=2):
        return write_config(tmp_path / f"{run_dir.name}.yaml", tiny_config(
            tiny_data, run_dir, parallel={"tensor": tensor}, checkpoint={"every": 2, "keep": 0},
            watchdog={"stall_s": STALL_S, "heartbeat_s": 0.5}))

    straight = tmp_path / "straight"
    res = deepspeed_train(config(straight), "zero2.json")
    assert res.returncode == 0, res.out[-3000:]
    assert "parallel: data 1 x sequence 1 x tensor 2 = world 2; AutoTP splits the layers: rank 0 holds" in res.out
    ref = metrics_by_step(straight)
    run_dir = tmp_path / "killed"
    args = deepspeed_args(config(run_dir), "zero2.json", "watchdog.debug_fault=slow:0:0.3")  # slower, same numbers
    kill_rank(spawn(args), run_dir, 1, after=3)
    first = checkpoint.latest_complete(run_dir / "checkpoints")
    assert first in ("step_00000002", "step_00000004")
    assert checkpoint.read_marker(run_dir / "checkpoints" / first)[0]["parallel"] == {"data": 1, "sequence": 1,
                                                                                       "tensor": 2}
    res = deepspeed_train(config(run_dir), "zero2.json")
    assert res.returncode == 0, res.out[-3000:]
    k = int(first.split("_")[1])
    assert f"resumed from {run_dir / 'checkpoints' / first} at step {k}" in res.out
    got = metrics_by_step(run_dir)
    assert sorted(got) == sorted(ref) == list(range(1, 9))
    for step in range(k + 1, 9):  # bitwise: the same float printed
        assert got[step]["loss"] == ref[step]["loss"], (step, got[step]["loss"], ref[step]["loss"])

    one = tmp_path / "tensor1"  # the same 2 ranks, data-parallel now
    res = deepspeed_train(config(one, tensor=1), "zero2.json",
                          f"checkpoint.resume={straight / 'checkpoints' / 'step_00000004'}")
    assert res.returncode == 0, res.out[-3000:]
    assert ("parallel: data 1 x sequence 1 x tensor 2 = world 2 -> data 2 x sequence 1 x tensor 1 = world 2: loading "
            "through DeepSpeed's universal checkpoint step_00000004_universal") in res.out
    after = metrics_by_step(one)
    assert sorted(after) == list(range(5, 9))
    assert abs(after[5]["loss"] - ref[5]["loss"]) <= 1e-5 * abs(ref[5]["loss"]), (after[5], ref[5])

    exported = tmp_path / "exported"
    res = ds_train("export", str(straight), "--out", str(exported), timeout=300)
    assert res.returncode == 0, res.out[-3000:]
    assert res.out.strip().splitlines()[-1] == (f"export: wrote {exported} from step_00000008: a Hugging Face model "
                                                f"directory (AutoModelForCausalLM.from_pretrained({str(exported)!r}))")
    assert_export_matches(exported, engine_logits(config(straight), "zero2.json", straight / "checkpoints",
                                                  "step_00000008", tmp_path / "engine_logits.pt"))



def engine_logits(config: Path, ds_config: str, ckpt_dir: Path, tag: str, out: Path):
    """tests/tp_logits_probe.py on 2 processes: the AutoTP engine given the tag, its logits on a fixed input."""
    import torch

    res = run_cmd([*node_launch(), str(ROOT / "tests" / "tp_logits_probe.py"), str(config), str(ROOT / "ds_configs" / ds_config),
                   str(ckpt_dir), tag, str(out)], timeout=300)
    assert res.returncode == 0, res.out[-3000:]
    return torch.load(out)


def assert_export_matches(exported: Path, engine: dict) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    assert sorted(p.name for p in exported.iterdir() if p.name.startswith(".")) == []  # no scratch left
    model = AutoModelForCausalLM.from_pretrained(exported).eval()
    with torch.no_grad():
        logits = model(input_ids=engine["input_ids"]).logits
    assert logits.shape == engine["logits"].shape
    assert float((logits - engine["logits"]).abs().max() / engine["logits"].abs().max()) <= 1e-5


@pytest.mark.slow
def test_zero0_tensor_parallelism_resumes_at_another_data_size_and_exports(tiny_data, tmp_path):
    """fp32 ZeRO-0 under AutoTP (parallel.tensor=2): no optimizer partitions, each tensor rank's
    shard of the weights and optimizer in its own mp_rank file. A save resumes as it is on 4 processes
    (data 2 x tensor 2) and continues within 1e-5; the last save exports (the shards merged by
    AutoTP's saved maps) to the TP engine's logits within 1e-5."""
    def config(run_dir):
        return write_config(tmp_path / f"{run_dir.name}.yaml", tiny_config(
            tiny_data, run_dir, parallel={"tensor": 2}, train={"max_steps": 4},
            checkpoint={"every": 2, "keep": 0}))

    straight = tmp_path / "straight"
    res = deepspeed_train(config(straight), "zero0.json")
    assert res.returncode == 0, res.out[-3000:]
    assert "parallel: data 1 x sequence 1 x tensor 2 = world 2; AutoTP splits the layers" in res.out
    saved = straight / "checkpoints" / "step_00000002"
    assert sorted(p.name for p in saved.glob("mp_rank_*")) == ["mp_rank_00_model_states.pt",
                                                               "mp_rank_01_model_states.pt"]
    ref = metrics_by_step(straight)

    wider = tmp_path / "wider"
    res = deepspeed_train(config(wider), "zero0.json", f"checkpoint.resume={saved}", nproc=4)
    assert res.returncode == 0, res.out[-3000:]
    assert "world size 2 -> 4, ZeRO stage 0 -> 0: the ZeRO-0 checkpoint loads as it is" in res.out
    got = metrics_by_step(wider)
    assert sorted(got) == [3, 4]
    for step in (3, 4):  # the same weights and optimizer; the gradient now all-reduced over 2 data ranks
        assert abs(got[step]["loss"] - ref[step]["loss"]) <= 1e-5 * abs(ref[step]["loss"]), (step, got, ref)

    res = ds_train("convert", "--to", "universal", str(straight))
    assert res.returncode == 2 and res.out.strip().splitlines()[-1] == (
        f"ds-train: error: {straight / 'checkpoints' / 'step_00000004'}: a ZeRO-0 checkpoint (its optimizer whole in "
        f"each model-states file) has no partitions to convert: it resumes at any data-parallel size as it is, under "
        f"ZeRO-0 and model.dtype=fp32 with parallel.tensor=2"), res.out[-2000:]

    from ds_train.checkpoint.export import export

    exported = tmp_path / "exported"
    export(straight, exported)  # in this process: the command's own line is the AutoTP test's above
    assert_export_matches(exported, engine_logits(config(straight), "zero0.json", straight / "checkpoints",
                                                  "step_00000004", tmp_path / "engine_logits.pt"))


@pytest.mark.slow
def test_bf16_zero0_saves_its_optimizer_in_the_model_states_and_resumes_exactly(tiny_data, tmp_path):
    """bf16 ZeRO-0 steps DeepSpeed's unfused optimizer, whose state goes in mp_rank_00_model_states.pt
    (no ZeRO optimizer file): its save completes and a resume continues bitwise (one process each)."""
    zero0 = str(ROOT / "ds_configs" / "zero0.json")

    def run(run_dir, *overrides):
        cfg = write_config(tmp_path / f"{run_dir.name}.yaml", tiny_config(
            tiny_data, run_dir, model={"config": dict(TINY_MODEL), "dtype": "bf16"}, train={"max_steps": 4},
            checkpoint={"every": 2, "keep": 0}))
        res = ds_train("train", "--config", str(cfg), "--ds-config", zero0, *overrides, timeout=180)
        assert res.returncode == 0, res.out[-3000:]
        return res

    straight = tmp_path / "straight"
    run(straight)
    saved = straight / "checkpoints" / "step_00000002"
    assert checkpoint.is_complete(saved) and not list(saved.glob("*optim_states.pt"))
    resumed = tmp_path / "resumed"
    assert f"resumed from {saved} at step 2" in run(resumed, f"checkpoint.resume={saved}").out
    ref, got = metrics_by_step(straight), metrics_by_step(resumed)
    assert sorted(got) == [3, 4] and all(got[s]["loss"] == ref[s]["loss"] for s in (3, 4)), (got, ref)

def stop_by(proc, run_dir: Path, after: int, pid, signum: int, within_s: float) -> int:
    """Once the run logged step `after`, send `signum` to `pid()` (a rank, or the launcher alone): every
    rank saves at the next step and exits, and no process of the job is left `within_s` later.
    Returns the step saved."""
    wait_for_step(proc, run_dir, after)
    os.kill(pid(), signum)
    res = reap(proc, timeout=within_s)  # every rank closed the output pipe: none is left
    assert not pids_with(str(run_dir.parent)), res.out[-3000:]
    saved = checkpoint.latest_complete(run_dir / "checkpoints")
    k = int(saved.split("_")[1])
    assert after <= k < STEPS, res.out[-3000:]
    assert f"stopped by signal {int(signal.SIGTERM)} at step {k}; checkpoint saved" in res.out, res.out[-3000:]
    for rank in (0, 1):  # each rank saved and ended on the stop (exit 143), none was killed
        assert f"exit 143: stopped by signal 15 at step {k}" in (run_dir / "logs" / f"rank_{rank}.log").read_text()
    return k


@pytest.mark.slow
def test_sigterm_to_a_rank_or_the_launcher_and_sigkill_of_the_launcher_save_and_resume_exactly(
        straight_zero2, tiny_data, tmp_path):
    """Three stops, each followed by the same command: SIGTERM to rank 1 (the other rank learns of
    it at the next step); SIGTERM to the `deepspeed` runner's PID alone (what a container runtime
    sends: the runner dies of it and passes nothing on; the ranks see their launcher gone); SIGKILL
    of the runner. Each time every rank saves and exits and nothing is left; the last start
    finishes with the straight run's losses, bitwise."""
    run_dir = tmp_path / "run"
    cfg = write_config(tmp_path / "run.yaml", tiny_config(
        tiny_data, run_dir, train={"max_steps": STEPS}, checkpoint={"every": 100, "save_final": True},
        watchdog={"stall_s": STALL_S}))
    args = deepspeed_args(cfg, "zero2.json", "watchdog.debug_fault=slow:0:0.5", runner=True)  # slower, same numbers
    proc = spawn(args)
    k = stop_by(proc, run_dir, 2, lambda: rank_pid(run_dir, 1), signal.SIGTERM, 60)
    for signum, within_s in ((signal.SIGTERM, 60), (signal.SIGKILL, STALL_S + 60)):
        proc = spawn(args)
        k2 = stop_by(proc, run_dir, k + 1, lambda: proc.pid, signum, within_s)
        assert k2 > k
        k = k2

    res = deepspeed_train(cfg, "zero2.json")
    assert res.returncode == 0, res.out[-3000:]
    got, ref = metrics_by_step(run_dir), metrics_by_step(straight_zero2)
    assert sorted(got) == list(range(1, STEPS + 1))
    assert all(got[s]["loss"] == ref[s]["loss"] for s in range(k + 1, STEPS + 1))


@pytest.mark.slow
@pytest.mark.parametrize("ds_config", ["zero0.json"])  # torch AdamW; DeepSpeed's own optimizer: the test below
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
    """ZeRO-2 (DeepSpeed's own optimizer): a lone non-finite step is skipped and counted, training
    goes on and saves; two in a row (train.nonfinite_patience) stop the run, its last good save kept."""
    run_dir = tmp_path / "run"
    cfg = write_config(tmp_path / "run.yaml", tiny_config(
        tiny_data, run_dir, train={"debug_nonfinite_steps": [3, 5, 6], "nonfinite": "stop",
                                   "nonfinite_patience": 2},
        checkpoint={"every": 2, "keep": 0, "save_final": True}))
    res = deepspeed_train(cfg, "zero2.json")
    assert res.returncode != 0
    assert "step 6: 2 consecutive steps with non-finite gradients" in res.out
    m = metrics_by_step(run_dir)
    assert m[3]["loss"] == "inf" and isinstance(m[4]["loss"], float)  # counted, not hidden
    assert [m[s]["train/skipped_steps"] for s in (2, 3, 4)] == [0, 1, 1]
    ckpts = run_dir / "checkpoints"
    assert checkpoint.complete_tags(ckpts) == ["step_00000002", "step_00000004"]
    assert (ckpts / "latest").read_text() == "step_00000004"
    assert not (ckpts / "step_00000006").exists()
    found = diagnose(str(run_dir))  # the doctor on this live failure: its rank logs hold the stop
    assert found[0].cls == "nonfinite" and any("non-finite gradients" in e for e in found[0].evidence), found


@pytest.mark.slow
def test_two_process_checkpoint_resumes_on_one_process_through_the_universal_checkpoint(
        straight_zero2, tiny_data, tmp_path):
    ref = metrics_by_step(straight_zero2)  # 2 ranks, checkpoints every 4 steps
    tag_dir = straight_zero2 / "checkpoints" / "step_00000008"
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
    assert res.out.strip().splitlines()[-1] == (f"convert: wrote {out} (DeepSpeed universal checkpoint); resume from "
                                                f"it at any world size with checkpoint.resume={out}"), res.out[-2000:]

    res = deepspeed_train(cfg, "zero2.json", "train.max_steps=10", "optim.lr=0.005")
    assert res.returncode == 0, res.out[-3000:]
    assert "resuming with changed settings: optim.lr: 0.01 -> 0.005; train.max_steps: 8 -> 10" in res.out
    assert sorted(metrics_by_step(run_dir)) == list(range(1, 11))

    res = ds_train("train", "--config", str(cfg), "--ds-config", zero0, "train.max_steps=12")
    assert res.returncode == 2
    assert "DeepSpeed cannot move optimizer states between ZeRO-2 fp32 and ZeRO-0 fp32" in res.out


def single(cfg, *overrides, timeout=180):
    """One process (`python -m ds_train train`), zero2."""
    return ds_train("train", "--config", str(cfg), "--ds-config", str(ROOT / "ds_configs" / "zero2.json"),
                    *overrides, timeout=timeout)


def agreed_tag(ckpts):
    """What a one-rank resume of this directory would choose."""
    view = consensus.RankView(0, 0, "h", consensus.scan(ckpts, None, 0, 1))
    point = consensus.decide("auto", ckpts, None, [view], 1).point
    return point.tag if point else None


@pytest.mark.slow
def test_a_save_into_an_existing_tag_killed_at_each_phase_leaves_whole_tags(tiny_data, tmp_path):
    """Two ranks, 6 steps, a save every 2. The base run writes tags 2 and 4 in the background
    (checkpoint.async_save) and blocks for 6, the last. Then resumes from 2 whose save of 4 (into
    the existing tag) loses a rank (SIGKILL, checkpoint.debug_fault=kill:PHASE:4:RANK) at each phase,
    each phase once, the phases shared between a blocking save and a background one (the kill lands
    in the writer thread while step 5 trains) so that each writer loses rank 1 while rank 0 goes on
    to the next barrier, and rank 0 (the writer) once the marker or `latest` is written (the commit
    protocol is one function for both; only its barriers differ). The job ends naming the killed
    rank; `latest` and the tag a resume chooses are always whole; the resume from the worst case (the
    shards half replaced) gives the base run's losses, bitwise."""
    base = tmp_path / "base"
    cfg = write_config(tmp_path / "run.yaml", tiny_config(tiny_data, base, train={"max_steps": 6},
                                                          checkpoint={"every": 2, "keep": 0, "async_save": True},
                                                          watchdog={"heartbeat_s": 0.5}))  # a killed rank named sooner
    res = deepspeed_train(cfg, "zero2.json")
    assert res.returncode == 0, res.out[-3000:]
    ref = metrics_by_step(base)
    log = (base / "logs" / "rank_1.log").read_text()
    assert "checkpoint step_00000004: state copied in" in log and "writing in the background" in log
    assert "saved checkpoint step_00000004 in" in log and "s of it stopped training)" in log
    assert "checkpoint step_00000006: state copied" not in log and "saved checkpoint step_00000006 in" in log
    assert checkpoint.complete_tags(base / "checkpoints") == [checkpoint.tag_for(s) for s in (2, 4, 6)]
    cases = [(False, "unmarked"), (True, "written"), (False, "rank_files"), (True, "marked"), (False, "latest")]
    assert sorted(phase for _, phase in cases) == sorted(checkpoint.PHASES)
    for background, phase in cases:
        run = tmp_path / f"{phase}_{'background' if background else 'blocking'}"
        shutil.copytree(base, run)
        checkpoint.remove_tags(run / "checkpoints", ["step_00000006"])  # tags 2 and 4, `latest` 4
        (run / "checkpoints" / "latest").write_text("step_00000004")
        killed = 0 if phase in ("marked", "latest") else 1  # only the writer (rank 0) has those phases
        res = deepspeed_train(cfg, "zero2.json", f"output_dir={run}", "checkpoint.resume=step_00000002",
                              f"checkpoint.async_save={str(background).lower()}",
                              f"checkpoint.debug_fault=kill:{phase}:4:{killed}")
        assert res.returncode != 0, (run.name, res.out[-2000:])
        failure = json.loads((run / "logs" / "failure.json").read_text())
        assert (failure["rank"], failure["signal"]) == (killed, "SIGKILL"), (run.name, failure["line"])
        ckpts = run / "checkpoints"
        latest = (ckpts / "latest").read_text()
        assert checkpoint.is_complete(ckpts / latest), run.name
        marked = phase in ("marked", "latest")  # the new tag 4 is whole; before that, it is not a tag
        assert agreed_tag(ckpts) == ("step_00000004" if marked else "step_00000002"), run.name
        assert latest == ("step_00000004" if phase == "latest" else "step_00000002"), run.name
        assert checkpoint.is_complete(ckpts / "step_00000004") == marked, run.name
        assert not (ckpts / "step_00000006").exists(), run.name  # the job ended before its last save
        if marked:  # the rewritten tag is the new save's alone (a higher save number than the old one)
            assert checkpoint.read_marker(ckpts / "step_00000004")[0]["seq"] == 3, run.name
    written = tmp_path / "written_background"  # the shards half replaced
    res = deepspeed_train(cfg, "zero2.json", f"output_dir={written}")
    assert res.returncode == 0, res.out[-3000:]
    assert f"resumed from {written / 'checkpoints' / 'step_00000002'} at step 2" in res.out
    got = metrics_by_step(written)
    assert sorted(got) == list(range(1, 7)) and [got[s]["loss"] for s in range(3, 7)] == [
        ref[s]["loss"] for s in range(3, 7)]


@pytest.mark.slow
def test_an_expert_parallel_run_killed_resumes_exactly_in_another_layout_and_exports(tiny_data, tmp_path):
    """parallel.expert 2 (AutoEP) on a tiny Qwen3-MoE under ZeRO-2, saved every 2 steps: rank 1
    SIGKILLed at step 4, the same command resumes from step 2 and ends with the straight run's losses,
    bitwise (DeepSpeed writes AutoEP's checkpoint its own way: ds_train's client state must not collide
    with it). Resumed on 4 ranks with parallel.expert 4 and ZeRO-1 (DeepSpeed's universal checkpoint),
    the losses continue within 1e-6. A resume at parallel.expert 1, or into ZeRO-3, is refused in one
    line and writes nothing. The export is a
    Hugging Face Qwen3-MoE directory (the experts gathered into the model's own layout) whose held-out loss is
    the run's after the last step (the AutoEP engine's, on the weights it saved), within 1e-5."""
    import torch
    from transformers import AutoModelForCausalLM

    from test_parity import MOE_MODEL
    from ds_train.data.datasets import TokenData, eval_micro_batches
    from ds_train.train.losses import forward_loss

    runs = {}
    for name in ("straight", "killed"):
        runs[name] = tmp_path / name
        cfg = write_config(tmp_path / f"{name}.yaml", tiny_config(
            tiny_data, runs[name], model={"config": dict(MOE_MODEL)}, train={"max_steps": 6},
            parallel={"expert": 2}, checkpoint={"every": 2, "keep": 0}))
        fault = ("watchdog.debug_fault=kill:1:4",) if name == "killed" else ()
        res = deepspeed_train(cfg, "zero2.json", *fault)
        assert (res.returncode == 0) == (name == "straight"), res.out[-3000:]
    assert checkpoint.latest_complete(runs["killed"] / "checkpoints") == "step_00000002"
    before = tree_listing(runs["killed"])
    expect_error(["train", "--config", str(tmp_path / "killed.yaml"), "--ds-config", str(ROOT / "ds_configs" /
                  "zero2.json"), "parallel.expert=1"], "saved with parallel.expert=2, resumed with parallel.expert=1: "
                 "AutoEP's layers and the model's own MoE blocks keep the experts under other names")
    res = deepspeed_train(tmp_path / "killed.yaml", "zero3.json")  # into ZeRO-3: DeepSpeed would assert
    assert res.returncode == 2 and "saved with ZeRO-2, resumed with ZeRO-3" in res.out, res.out[-3000:]
    assert "from and to ZeRO-1 or 2 only" in res.out and "Traceback" not in res.out
    assert tree_listing(runs["killed"]) == before
    res = deepspeed_train(tmp_path / "killed.yaml", "zero2.json")
    assert res.returncode == 0, res.out[-3000:]
    assert f"resumed from {runs['killed'] / 'checkpoints' / 'step_00000002'} at step 2" in res.out
    straight, resumed = metrics_by_step(runs["straight"]), metrics_by_step(runs["killed"])
    assert sorted(resumed) == list(range(1, 7)) and [resumed[s]["loss"] for s in range(3, 7)] == [
        straight[s]["loss"] for s in range(3, 7)]

    wider = tmp_path / "wider"  # 4 ranks, experts split 4 ways: through DeepSpeed's universal checkpoint
    res = deepspeed_train(tmp_path / "killed.yaml", "zero1.json", f"output_dir={wider}", "parallel.expert=4",
                          f"checkpoint.resume={runs['straight'] / 'checkpoints' / 'step_00000002'}", nproc=4)
    assert res.returncode == 0, res.out[-3000:]
    assert ("world size 2 -> 4, ZeRO stage 2 -> 1, parallel.expert 2 -> 4: loading through DeepSpeed's universal "
            "checkpoint step_00000002_universal") in res.out
    moved = metrics_by_step(wider)
    assert all(abs(moved[s]["loss"] - straight[s]["loss"]) <= 1e-6 * straight[s]["loss"] for s in range(3, 7)), moved
    from ds_train.checkpoint.export import export

    export(runs["killed"], tmp_path / "hf")  # in this process: the command's own line is the AutoTP test's
    assert sorted(p.name for p in (tmp_path / "hf").iterdir() if p.name.startswith(".")) == []  # no scratch left
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    assert model.model.layers[0].mlp.experts.gate_up_proj.shape[0] == 4  # every expert, gathered
    val = TokenData(tiny_data / "val.bin", "uint16", 64, 7)
    with torch.no_grad():  # the evaluator's batches: eval_batches 2 of micro 2 on each of the 2 data ranks
        parts = [forward_loss(model, b) for r in range(2) for b in eval_micro_batches(val, 2, 2, r, 2)]
    held_out = sum(float(loss) for loss, _ in parts) / sum(n for _, n in parts)
    assert abs(held_out - resumed[6]["eval/loss"]) <= 1e-5 * resumed[6]["eval/loss"], (held_out, resumed[6])


DEEPSEEK_V3 = {"model_type": "deepseek_v3", "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
               "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4, "n_routed_experts": 4,
               "num_experts_per_tok": 2, "n_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 2,
               "topk_group": 1, "q_lora_rank": 32, "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
               "v_head_dim": 16, "routed_scaling_factor": 2.5, "max_position_embeddings": 128,
               "tie_word_embeddings": False, "vocab_size": 512}


@pytest.mark.slow
def test_a_deepseek_v3_under_expert_parallelism_exports_with_its_router_bias_from_zero_2_and_3(tiny_data, tmp_path):
    """A tiny DeepSeek-V3 (MLA, a dense first layer, shared experts, grouped top-k routing, a routed scale)
    fine-tuned from a directory whose router bias (a buffer, e_score_correction_bias, no gradient) is
    off zero, as a pretrained model's is: parallel.expert 2 under ZeRO-2 and ZeRO-3 (DeepSpeed's ZeRO-3
    universal conversion writes flat tensors and no buffers), exported. `from_pretrained` reports no
    missing, unexpected or mismatched key, the bias comes back as it went in, and the logits are the
    AutoEP engine's on the same tag within 1e-5."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from ds_train.data.tokenizer import load_tokenizer

    base = tmp_path / "base"
    load_tokenizer(tiny_data / "tokenizer").save_pretrained(str(base))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**DEEPSEEK_V3))
    bias = torch.tensor([0.3, -0.2, 0.1, -0.4])
    model.model.layers[1].mlp.gate.e_score_correction_bias.copy_(bias)
    model.save_pretrained(base)
    for stage in (2, 3):
        run = tmp_path / f"zero{stage}"
        cfg = tiny_config(tiny_data, run, parallel={"expert": 2}, train={"max_steps": 2},
                          checkpoint={"save_final": True})
        cfg["model"] = {"path": str(base), "dtype": "fp32"}
        config = write_config(tmp_path / f"zero{stage}.yaml", cfg)
        res = deepspeed_train(config, f"zero{stage}.json")
        assert res.returncode == 0, res.out[-3000:]
        assert "expert rank 1 holds 2 of each one's 4 experts" in (run / "logs" / "rank_1.log").read_text()
        exported = tmp_path / f"hf{stage}"
        res = ds_train("export", str(run), "--out", str(exported), timeout=300)
        assert res.returncode == 0, res.out[-3000:]
        back, info = AutoModelForCausalLM.from_pretrained(exported, output_loading_info=True)
        assert not any(info.values()), info
        assert torch.equal(back.model.layers[1].mlp.gate.e_score_correction_bias, bias)
        assert_export_matches(exported, engine_logits(config, f"zero{stage}.json", run / "checkpoints",
                                                      "step_00000002", tmp_path / f"logits{stage}.pt"))


@pytest.mark.slow
def test_fresh_finished_and_damaged_runs(tiny_data, tmp_path):
    """A truncated metrics line is dropped and said; a finished run changes nothing; a fresh run
    into a used directory is refused (exit 2, one line, nothing touched); restart starts over."""
    run = tmp_path / "run"
    cfg = write_config(tmp_path / "run.yaml", tiny_config(tiny_data, run, train={"max_steps": 4},
                                                          checkpoint={"every": 2, "keep": 2}))
    assert single(cfg).returncode == 0
    (run / "checkpoints" / "step_00000002" / "notes.txt").write_text("a user's, kept by checkpoint.keep")
    metrics = run / "metrics.jsonl"
    metrics.write_text(metrics.read_text()[:-25])  # a kill in the middle of writing step 4's line
    res = single(cfg, "train.max_steps=6")
    assert res.returncode == 0, res.out[-3000:]
    assert "metrics.jsonl: dropped 1 line(s) that do not parse (a write cut short, or damage)" in res.out
    assert f"resumed from {run / 'checkpoints' / 'step_00000004'} at step 4" in res.out
    # keep=2 pruned step 2 at the save of 6: DeepSpeed's files and ds_train's went, the user's file stayed
    assert sorted(tree_listing(run / "checkpoints" / "step_00000002")) == ["notes.txt"]
    assert ("checkpoint.keep: removed step_00000002's checkpoint files; kept 1 file(s) a user left there (notes.txt)"
            in (run / "logs" / "rank_0.log").read_text())
    record = json.loads((run / "checkpoints" / "step_00000006" / "ds_train_files.json").read_text())
    assert record["user"] == [] and {"mp_rank_00_model_states.pt", checkpoint.STATE_FILE} <= set(record["files"])
    assert sorted(metrics_by_step(run)) == [1, 2, 3, 5, 6]

    results = (run / "results.json").read_bytes()
    before = tree_listing(run / "checkpoints")
    res = single(cfg, "train.max_steps=6")  # already finished
    said = (f"train: nothing to do, already trained to step 6 >= train.max_steps=6 (raise train.max_steps to continue, "
            f"or set another output_dir); checkpoint step_00000006; run directory {run.resolve()}")
    assert res.returncode == 0 and res.out.strip().splitlines()[-1] == said, res.out[-2000:]
    assert "not complete" not in res.out  # the folder of a user's file is no unfinished save
    assert (run / "results.json").read_bytes() == results and sorted(metrics_by_step(run)) == [1, 2, 3, 5, 6]
    assert tree_listing(run / "checkpoints") == before

    (run / "results.json").unlink()  # a finished run whose results went: said, the weights are whole
    res = single(cfg, "train.max_steps=6")
    assert res.returncode == 0 and f"note: {run / 'results.json'} is missing or damaged" in res.out
    assert res.out.strip().splitlines()[-1] == said  # the note before it
    (run / "results.json").write_bytes(results)

    args = ["train", "--config", str(cfg), "--ds-config", str(ROOT / "ds_configs" / "zero2.json")]
    listing = tree_listing(tmp_path)
    expect_error([*args, "checkpoint.resume=none"],
                 f"checkpoint.resume=none: {run / 'checkpoints'} holds checkpoints of an earlier run "
                 f"(step_00000004, step_00000006)", "checkpoint.resume=restart")
    (tmp_path / "elsewhere").mkdir()  # a path that holds nothing: not a fresh start over this run
    expect_error([*args, f"checkpoint.resume={tmp_path / 'elsewhere'}"],
                 f"checkpoint.resume: {tmp_path / 'elsewhere'} holds no complete checkpoint")
    expect_error([*args, "seed=8"], "cannot resume with a changed seed: 7 -> 8",
                 "start over with checkpoint.resume=restart")
    assert tree_listing(tmp_path) == {**listing, "elsewhere": tree_listing(tmp_path)["elsewhere"]}

    # a rank file of the right size with other bytes: one line, the run's records left as they were
    rank_file = checkpoint.rank_file(run / "checkpoints" / "step_00000006", 0)
    size = rank_file.stat().st_size  # other bytes, always the same (random ones fail in other ways each time)
    rank_file.write_bytes((b"not a checkpoint " * (size // 17 + 1))[:size])
    kept = {name: (run / name).read_bytes() for name in ("config.yaml", "metrics.jsonl", "ds_config.json")}
    expect_error([*args, "train.max_steps=8"], f"{run / 'checkpoints' / 'step_00000006'}: cannot be loaded, a file "
                 f"in it is damaged (UnpicklingError", "resume from an older tag")
    assert {name: (run / name).read_bytes() for name in kept} == kept

    res = single(cfg, "checkpoint.resume=restart", "train.max_steps=2")
    assert res.returncode == 0 and "starting at step 0 (checkpoint.resume=restart)" in res.out
    assert sorted(metrics_by_step(run)) == [1, 2]
    assert checkpoint.complete_tags(run / "checkpoints") == ["step_00000002"]


@pytest.mark.slow
def test_no_room_for_a_checkpoint_is_one_line_and_latest_stays(tiny_data, tmp_path):
    """A 1 MiB file system (a tmpfs in a mount namespace) cannot take a 2.1 MB tag: refused before
    writing; a save that fails midway (an injected ENOSPC) ends with one line, `latest` as it was."""
    run = tmp_path / "run"
    run.mkdir()
    cfg = write_config(tmp_path / "run.yaml", tiny_config(tiny_data, run, train={"max_steps": 4},
                                                          checkpoint={"every": 2}))
    args = ["train", "--config", str(cfg), "--ds-config", str(ROOT / "ds_configs" / "zero2.json")]
    tmpfs = ["unshare", "-m", "--propagation", "private", "sh", "-c",
             f'mount -t tmpfs -o size=1m tmpfs {run} && exec "$0" "$@"']
    line = expect_error(args, "checkpoint step_00000002 not written:", f"{run / 'checkpoints'}",
                        "needs about 2.0 MiB", "free; free space or lower checkpoint.keep",
                        "no checkpoint of this run was completed", wrap=tmpfs)
    assert "MiB free" in line
    line = expect_error([*args, "checkpoint.debug_fault=enospc:written:4"],
                        "checkpoint step_00000004: writing", "failed: No space left on device",
                        "the newest complete checkpoint is step_00000002, where a resume starts")
    assert (run / "checkpoints" / "latest").read_text() == "step_00000002"
    assert agreed_tag(run / "checkpoints") == "step_00000002"
    # written in the background: the writer's failure ends the run at the next save or the last step, as one line
    expect_error([*args, "checkpoint.debug_fault=enospc:written:4", "checkpoint.async_save=true", "train.max_steps=6",
                  "checkpoint.every=4"], "checkpoint step_00000004: writing", "failed: No space left on device",
                 "the newest complete checkpoint is step_00000002, where a resume starts")
    assert (run / "checkpoints" / "latest").read_text() == "step_00000002"
    assert agreed_tag(run / "checkpoints") == "step_00000002"
    assert "background save of step_00000004 failed" in (run / "logs" / "rank_0.log").read_text()
    found = diagnose(str(run))  # the doctor on this live failure
    assert found[0].cls == "disk_full" and any("No space left on device" in e for e in found[0].evidence), found


@pytest.mark.slow
def test_an_output_dir_that_cannot_be_written_fails_before_any_work(tiny_data, tmp_path):
    (tmp_path / "file").write_text("x")
    cfg = write_config(tmp_path / "run.yaml", tiny_config(tiny_data, tmp_path / "file" / "run"))
    args = ["train", "--config", str(cfg), "--ds-config", str(ROOT / "ds_configs" / "zero2.json")]
    expect_error(args, f"output_dir: '{tmp_path / 'file' / 'run'}' cannot be a directory: "
                       f"'{tmp_path / 'file'}' is a file")
    ro = tmp_path / "ro"
    ro.mkdir()
    readonly = ["unshare", "-m", "--propagation", "private", "sh", "-c",
                f'mount -t tmpfs -o ro tmpfs {ro} && exec "$0" "$@"']
    expect_error([*args, f"output_dir={ro / 'run'}"], f"output_dir: '{ro / 'run'}' is on a read-only file system",
                 wrap=readonly)
