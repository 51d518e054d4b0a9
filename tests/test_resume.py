"""The resume every rank agrees on (pure: built from fake tags laid out as a save lays them out),
what a resume may change, and how it loads (as saved, or through a universal checkpoint)."""

from __future__ import annotations

import shutil

import pytest

from ds_train.checkpoint import commit as checkpoint

from ds_train.checkpoint import consensus, resume
from ds_train.errors import UserError
from ds_train.plan.parallel import ParallelDims
from test_checkpoint import fake_tag


def test_find_resume(tmp_path):
    assert resume.find_resume("auto", tmp_path / "nothing") is None
    assert resume.find_resume("none", tmp_path) is None
    tag = fake_tag(tmp_path, 4)
    assert resume.find_resume("auto", tmp_path).tag == tag
    assert resume.find_resume(tag, tmp_path).state["step"] == 4
    assert resume.find_resume(str(tmp_path / tag), tmp_path / "elsewhere").tag == tag
    fake_tag(tmp_path, 6, complete=False)
    with pytest.raises(UserError, match="incomplete"):
        resume.find_resume("step_00000006", tmp_path)
    with pytest.raises(UserError, match="neither a tag"):
        resume.find_resume(str(tmp_path / "nowhere"), tmp_path)


# ---- the resume every rank agrees on (what each rank reports, then the one decision) ----------

def views(ckpt_dirs: list, world: int = 2, wanted=None) -> list:
    """Each rank's report, rank r reading ckpt_dirs[r] (one directory: shared; several: node-local)."""
    return [consensus.RankView(r, r, f"host{r}", consensus.scan(d, wanted, r, world), latest=checkpoint.read_latest(d))
            for r, d in enumerate(ckpt_dirs)]


def test_every_rank_resumes_from_the_newest_save_and_unfinished_tags_are_named(tmp_path):
    fake_tag(tmp_path, 2, seq=1)
    fake_tag(tmp_path, 4, seq=2)
    fake_tag(tmp_path, 6, complete=False)
    d = consensus.decide("auto", tmp_path, None, views([tmp_path, tmp_path]), 2)
    assert d.point.tag == "step_00000004" and d.point.state["step"] == 4 and d.next_seq == 3
    assert d.said == (f"resumed from {tmp_path / 'step_00000004'} at step 4; not complete, skipped: "
                      f"step_00000006 (no ds_train_state.json: a save that did not finish)")


@pytest.mark.parametrize("latest, said", [
    (b"step_00000004", ""),  # as it should be: nothing to say
    (b"step_00000002\n", "; `latest` names step_00000002, not the newest complete save (rewritten at the next save)"),
    (b"step_00000008", "; `latest` names step_00000008, not the newest complete save (rewritten at the next save)"),
    (bytes(range(128, 138)), "; `latest` names 10 bytes that are not text, not the newest complete save "
                             "(rewritten at the next save)"),
    (b"../elsewhere", "; `latest` names '../elsewhere', not a tag, not the newest complete save (rewritten at the "
                      "next save)")])
def test_a_latest_that_names_another_tag_or_is_damaged_is_said_and_not_followed(tmp_path, latest, said):
    """A crash between a save's marker and `latest` leaves it one behind; a deleted tag or damage
    leaves it naming nothing usable. The newest complete save wins either way, and the line says so."""
    fake_tag(tmp_path, 2, seq=1)
    fake_tag(tmp_path, 4, seq=2)
    (tmp_path / "latest").write_bytes(latest)
    d = consensus.decide("auto", tmp_path, None, views([tmp_path, tmp_path]), 2)
    assert d.point.tag == "step_00000004"
    assert d.said == f"resumed from {tmp_path / 'step_00000004'} at step 4" + said


def test_nothing_to_resume_says_why(tmp_path):
    d = consensus.decide("auto", tmp_path, None, views([tmp_path, tmp_path]), 2)
    assert d.point is None and d.said == f"nothing to resume in {tmp_path}; starting at step 0"
    fake_tag(tmp_path, 2, complete=False)
    d = consensus.decide("auto", tmp_path, None, views([tmp_path, tmp_path]), 2, unit="iteration")
    assert d.point is None and d.said == (
        f"nothing to resume in {tmp_path}; tags present but none complete: step_00000002 (no "
        f"ds_train_state.json: a save that did not finish); starting at iteration 0")


def test_node_local_directories_agree_and_a_node_missing_files_is_named(tmp_path):
    node0, node1 = tmp_path / "node0", tmp_path / "node1"
    for node, rank in ((node0, 0), (node1, 1)):  # each node holds its own rank's files and a marker
        for step in (2, 4):
            fake_tag(node, step)
            other = node / checkpoint.tag_for(step)
            for f in (checkpoint.manifest_file(other, 1 - rank), checkpoint.rank_file(other, 1 - rank)):
                f.unlink()
    d = consensus.decide("auto", node0, None, views([node0, node1]), 2)
    assert d.point.tag == "step_00000004"
    (node1 / "step_00000004" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    with pytest.raises(UserError) as e:
        consensus.decide("auto", node0, None, views([node0, node1]), 2)
    assert str(e.value) == (
        f"checkpoint {node0 / 'step_00000004'} (step 4, the newest complete save) is incomplete on node 1 "
        f"(host1) rank 1: missing zero_pp_rank_1_mp_rank_00_optim_states.pt; restore those files, resume "
        f"from step_00000002 with checkpoint.resume=step_00000002, or start over with checkpoint.resume=restart")
    shutil.rmtree(node1 / "step_00000004")  # the whole tag gone from node 1: named the same way
    with pytest.raises(UserError, match="incomplete on node 1 \\(host1\\) rank 1: missing step_00000004/"):
        consensus.decide("auto", node0, None, views([node0, node1]), 2)


def test_a_rank_file_from_another_save_into_the_same_tag_is_not_whole(tmp_path):
    fake_tag(tmp_path, 4, seq=7)
    man = checkpoint.manifest_file(tmp_path / "step_00000004", 1)
    man.write_text(man.read_text().replace('"seq": 7', '"seq": 5'))
    with pytest.raises(UserError, match="rank 1: missing ds_train_rank_1.json \\(from another save\\)"):
        consensus.decide("auto", tmp_path, None, views([tmp_path, tmp_path]), 2)


def test_a_fresh_run_into_a_used_directory_is_refused_and_restart_is_named(tmp_path):
    fake_tag(tmp_path, 2)
    with pytest.raises(UserError, match="checkpoint.resume=none: .* holds checkpoints of an earlier run "
                                        "\\(step_00000002\\); .*checkpoint.resume=restart"):
        consensus.decide("none", tmp_path, None, views([tmp_path, tmp_path]), 2)
    d = consensus.decide("restart", tmp_path, None, views([tmp_path, tmp_path]), 2)
    assert d.point is None and d.next_seq == 3


def test_a_path_asked_for_must_hold_a_checkpoint_and_may_not_mix_with_this_runs_own(tmp_path):
    """checkpoint.resume=<a directory>: nothing there is an error, not a fresh start over this run's
    checkpoints; loading another run's while output_dir holds its own is refused (it would mix)."""
    own, other = tmp_path / "run" / "checkpoints", tmp_path / "other"
    other.mkdir()
    fake_tag(own, 4)
    with pytest.raises(UserError, match=f"checkpoint.resume: {other} holds no complete checkpoint; give a checkpoint "
                                        f"directory or tag, or checkpoint.resume=auto"):
        consensus.decide(str(other), other, None, views([other, other]), 2, own_dir=own)
    fake_tag(other, 2)
    mine = [consensus.RankView(r, 0, "h", consensus.scan(other, None, r, 2), own=("step_00000004",)) for r in (0, 1)]
    with pytest.raises(UserError, match=r"output_dir's .*run/checkpoints holds checkpoints of its own "
                                        r"\(step_00000004\); continue them with checkpoint.resume=auto"):
        consensus.decide(str(other), other, None, mine, 2, own_dir=own)
    fresh = [consensus.RankView(r, 0, "h", consensus.scan(other, None, r, 2)) for r in (0, 1)]
    assert consensus.decide(str(other), other, None, fresh, 2, own_dir=own).point.tag == "step_00000002"


def test_a_checkpoint_of_other_data_is_refused(tmp_path):
    from ds_train.config import RunConfig
    from ds_train.config.model import ModelConfig

    cfg = RunConfig(model=ModelConfig(config={"model_type": "llama"}))
    state = {"step": 4, "world_size": 1, "seq": 1, "zero_stage": 2, "config": cfg.to_dict(), "kind": "train",
             "data": {"tokenizer": "aaaa", "train_tokens": 100, "val_tokens": 10}}
    point = resume.ResumePoint(tmp_path, "step_00000004", state)
    same = {"tokenizer": "aaaa", "train_tokens": 100, "val_tokens": 10}
    assert resume.check_resume(point, cfg, "train", 1, data=same) == []
    with pytest.raises(UserError, match=r"the data changed since this checkpoint \(tokenizer: aaaa -> bbbb; "
                                        r"data.dir re-prepared\?\): its weights were trained on the old token ids"):
        resume.check_resume(point, cfg, "train", 1, data={**same, "tokenizer": "bbbb"})


def test_a_named_tag_must_be_complete_and_a_new_world_size_needs_every_rank_in_one_place(tmp_path):
    fake_tag(tmp_path, 2)
    fake_tag(tmp_path, 4, complete=False)
    with pytest.raises(UserError, match="step_00000004 is not a complete checkpoint \\(no ds_train_state"):
        consensus.decide("step_00000004", tmp_path, "step_00000004",
                          views([tmp_path, tmp_path], wanted="step_00000004"), 2)
    d = consensus.decide("auto", tmp_path, None, views([tmp_path], world=1), 1)  # 2 ranks' tag, 1 rank now
    assert d.point.tag == "step_00000002"
    checkpoint.manifest_file(tmp_path / "step_00000002", 1).unlink()
    with pytest.raises(UserError, match="saved rank 1's ds_train_rank_1.json missing"):
        consensus.decide("auto", tmp_path, None, views([tmp_path], world=1), 1)


def test_config_changes_split_into_errors_and_notes():
    saved = {"seed": 1, "model": {"config": {"hidden_size": 64}}, "optim": {"lr": 1e-3},
             "train": {"max_steps": 10, "seq_len": 64}}
    now = {"seed": 1, "model": {"config": {"hidden_size": 128}}, "optim": {"lr": 5e-4},
           "train": {"max_steps": 20, "seq_len": 64}}
    errors, notes = resume.config_changes(saved, now)
    assert errors == ["model.config.hidden_size: 64 -> 128"]
    assert notes == ["optim.lr: 0.001 -> 0.0005", "train.max_steps: 10 -> 20"]
    # a checkpoint from before model.lora existed: LoRA off is no change, LoRA on is one
    off = {**saved, "model": {"config": {"hidden_size": 64}, "lora": {"rank": 0, "alpha": 16.0}}}
    assert resume.config_changes(saved, off) == ([], [])
    on = {**saved, "model": {"config": {"hidden_size": 64}, "lora": {"rank": 8, "alpha": 16.0}}}
    assert resume.config_changes(saved, on)[0] == ["model.lora.alpha: None -> 16.0", "model.lora.rank: None -> 8"]


def test_check_resume_refuses_another_kind_and_for_ript_another_world_size(tmp_path):
    from ds_train.config.file import build_config

    cfg = build_config({"model": {"config": {"model_type": "llama"}}})
    state = {"step": 4, "world_size": 2, "config": cfg.to_dict()}
    train_point = resume.ResumePoint(tmp_path, "step_00000004", state)  # written before `kind` existed
    ript_point = resume.ResumePoint(tmp_path, "step_00000004", {**state, "kind": "ript"})
    assert resume.check_resume(train_point, cfg, "train", world=1) == []  # world size may change
    with pytest.raises(UserError, match="a train checkpoint; `ript` cannot resume from it"):
        resume.check_resume(train_point, cfg, "ript", world=2, same_world=True)
    with pytest.raises(UserError, match="a ript checkpoint; `train` cannot resume from it"):
        resume.check_resume(ript_point, cfg, "train", world=2)
    with pytest.raises(UserError, match="saved with 2 ranks; resume ript with the same world size"):
        resume.check_resume(ript_point, cfg, "ript", world=3, same_world=True)


def test_an_asynchronous_ript_checkpoint_resumes_only_with_its_max_staleness(tmp_path):
    """The batches the rollout ranks held at the save were generated for the saved k: a lower k would drop them all
    as stale at the first updates, a higher one train on batches generated too early; refused in one line."""
    from ds_train.config.file import build_config

    def config(k: int):
        return build_config({"model": {"config": {"model_type": "llama"}},
                             "ript": {"rollout_ranks_per_node": 1, "max_staleness": k, "tis_cap": 2 if k else 0}})

    saved = {"step": 4, "world_size": 1, "kind": "ript", "config": config(2).to_dict(), "ript": {"rollout_ranks": 1}}
    point = resume.ResumePoint(tmp_path, "step_00000004", saved)
    assert resume.check_resume(point, config(2), "ript", world=1, same_world=True, rollout_ranks=1) == []
    for k in (0, 1, 3):
        with pytest.raises(UserError, match=f"saved with ript.max_staleness=2, resumed with {k}: .* resume with "
                                            f"ript.max_staleness=2"):
            resume.check_resume(point, config(k), "ript", world=1, same_world=True, rollout_ranks=1)


def test_max_staleness_above_0_needs_the_off_policy_correction():
    from ds_train.config.file import build_config

    model = {"config": {"model_type": "llama"}}
    with pytest.raises(UserError, match="ript.max_staleness: 1 trains on episodes of older weights, and ript.tis_cap "
                                        "is 0 .* set tis_cap"):
        build_config({"model": model, "ript": {"rollout_ranks_per_node": 1, "max_staleness": 1}})
    assert build_config({"model": model, "ript": {"rollout_ranks_per_node": 1, "max_staleness": 1,
                                                  "tis_cap": 2}}).ript.tis_cap == 2


def test_plan_resume_decides_without_writing(tmp_path):
    point = resume.ResumePoint(tmp_path, "step_00000004", {"world_size": 2, "zero_stage": 2, "dtype": "fp32"})
    assert resume.plan_resume(point, ParallelDims(2), 2, "fp32", False) == resume.ResumePlan(point)
    moved = resume.plan_resume(point, ParallelDims(1), 3, "fp32", False)
    assert moved.universal and moved.convert and "world size 2 -> 1, ZeRO stage 2 -> 3" in moved.notes[0]
    with pytest.raises(UserError, match="between ZeRO-2 fp32 and ZeRO-0 fp32 .* resume with ZeRO-2 and model.dtype=fp32"):
        resume.plan_resume(point, ParallelDims(2), 0, "fp32", False)
    assert list(tmp_path.iterdir()) == []  # deciding wrote nothing; prepare_resume converts


def test_a_zero0_checkpoint_loads_as_it_is_at_any_data_size_with_its_dtype_and_tensor_split(tmp_path):
    """ZeRO-0 keeps the optimizer whole in each tensor rank's model-states file (fp32: torch's, bf16:
    DeepSpeed's unfused one): no universal conversion reads it, none is needed for another data size."""
    tp2 = {"world_size": 2, "zero_stage": 0, "dtype": "bf16", "parallel": {"data": 1, "sequence": 1, "tensor": 2}}
    point = resume.ResumePoint(tmp_path, "step_00000004", tp2)
    wider = resume.plan_resume(point, ParallelDims(2, 1, 2), 0, "bf16", False)
    assert not wider.universal and wider.notes == ("world size 2 -> 4, ZeRO stage 0 -> 0: the ZeRO-0 checkpoint "
                                                   "loads as it is",)
    with pytest.raises(UserError) as e:
        resume.plan_resume(point, ParallelDims(2), 0, "bf16", False)
    assert "a ZeRO-0 checkpoint saved with parallel.tensor=2 holds each tensor rank's shard" in str(e.value)
    assert str(e.value).endswith("resume with parallel.tensor=2 (any data-parallel size), or train with ZeRO-1/2 to "
                                 "change the tensor split later")
    with pytest.raises(UserError, match="between ZeRO-0 bf16 and ZeRO-0 fp32"):
        resume.plan_resume(point, ParallelDims(2, 1, 2), 0, "fp32", False)
    with pytest.raises(UserError, match="between ZeRO-0 bf16 and ZeRO-1 bf16"):
        resume.plan_resume(point, ParallelDims(2, 1, 2), 1, "bf16", False)
    plain = resume.ResumePoint(tmp_path, "step_00000004", {"world_size": 2, "zero_stage": 0, "dtype": "bf16"})
    assert resume.plan_resume(plain, ParallelDims(1), 0, "bf16", False).notes == (
        "world size 2 -> 1, ZeRO stage 0 -> 0: the ZeRO-0 checkpoint loads as it is",)
    assert list(tmp_path.iterdir()) == []


def test_a_checkpoint_resumes_directly_where_zero_partitions_over_the_same_ranks(tmp_path):
    """The marker records the parallel layout (one written before it did is all data-parallel).
    Sequence ranks hold the whole model and ZeRO partitions over data x sequence, so the same world
    in another data / sequence split loads as it is; another tensor split goes through the universal
    checkpoint, which DeepSpeed cannot make of a sequence-parallel one (one line)."""
    saved = {"world_size": 4, "zero_stage": 2, "dtype": "fp32", "parallel": {"data": 2, "sequence": 2, "tensor": 1}}
    point = resume.ResumePoint(tmp_path, "step_00000004", saved)
    assert resume.plan_resume(point, ParallelDims(2, 2, 1), 2, "fp32", False) == resume.ResumePlan(point)
    split = resume.plan_resume(point, ParallelDims(4), 2, "fp32", False)
    assert not split.convert and split.notes == ("parallel.sequence 2 -> 1: the checkpoint loads as it is (sequence "
                                                 "ranks hold the whole model, and ZeRO partitions over data x "
                                                 "sequence = 4 ranks either way)",)
    with pytest.raises(UserError) as e:
        resume.plan_resume(point, ParallelDims(2, 1, 2), 2, "fp32", False)
    assert ("a checkpoint saved with parallel.sequence=2 cannot go through DeepSpeed's universal checkpoint" in str(e.value)
            and str(e.value).endswith("resume at world size 4, ZeRO stage 2 (any parallel.sequence that divides it)"))
    with pytest.raises(UserError, match="world size 4 -> 2"):
        resume.plan_resume(point, ParallelDims(2), 2, "fp32", False)
    dp = {"world_size": 4, "zero_stage": 2, "dtype": "fp32", "parallel": {"data": 4, "sequence": 1, "tensor": 1}}
    moved = resume.plan_resume(resume.ResumePoint(tmp_path, "step_00000004", dp), ParallelDims(2, 1, 2), 2, "fp32",
                               False)
    assert moved.convert and ("world size 4 -> 4, ZeRO stage 2 -> 2, parallel: data 4 x sequence 1 x tensor 1 = "
                              "world 4 -> data 2 x sequence 1 x tensor 2 = world 4") in moved.notes[0]
    old = resume.ResumePoint(tmp_path, "step_00000004", {"world_size": 4, "zero_stage": 2, "dtype": "fp32"})
    assert resume.plan_resume(old, ParallelDims(4), 2, "fp32", False) == resume.ResumePlan(old)
