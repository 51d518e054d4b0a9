"""export: real checkpoints from the real launcher (conftest.stage_run: ZeRO 0, 2 and 3 with 2 processes) become
Hugging Face directories that load without missing keys and hold exactly the weights DeepSpeed's own
zero_to_fp32.py recovers; bad sources, incomplete tags and an occupied `out` are refused."""

from __future__ import annotations

import json
import shutil
import sys

import pytest
import torch

from conftest import ROOT, expect_error, run_cmd, tree_listing
from ds_train.checkpoint import commit as checkpoint
from ds_train.checkpoint.export import check_outside_checkpoints, export, resolve_source
from ds_train.config.file import build_config
from ds_train.errors import UserError

METADATA = ("generation_config.json", "tokenizer.json", "tokenizer_config.json")


@pytest.fixture
def trained(stage_run):
    """The run directory of conftest's shared 2-process run of a ZeRO stage (8 steps, saved at 4 and
    8). Shared with other tests: a test that changes one copies it first."""

    def get(stage):
        res, run = stage_run(stage)
        assert res.returncode == 0, res.out[-3000:]
        return run

    return get


def load_exported(out):
    """from_pretrained with its loading report: nothing missing, unexpected or mismatched."""
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert {k: v for k, v in info.items() if v} == {}, info
    assert model.dtype == torch.float32
    return model.eval()


def zero_to_fp32(ckpt_dir, tag, dest) -> dict:
    """The weights DeepSpeed's own script recovers (the copy it left in checkpoints/), run as a subprocess."""
    res = run_cmd([sys.executable, str(ckpt_dir / "zero_to_fp32.py"), str(ckpt_dir), str(dest), "--tag", tag],
                  timeout=120)
    assert res.returncode == 0, res.out[-3000:]
    return torch.load(dest / "pytorch_model.bin", map_location="cpu", weights_only=True)


def reference_model(state_dict, config_dir):
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config_dir), dtype=torch.float32)
    model.load_state_dict(state_dict, strict=True)
    return model.eval()


def assert_same_weights(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == torch.float32, name
        assert torch.equal(got[name], tensor.float()), name


def logits(model):
    ids = torch.randint(0, model.config.vocab_size, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return model(input_ids=ids).logits


def assert_no_leftovers(parent):
    assert [p.name for p in parent.iterdir() if p.name.startswith(".")] == []


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["zero2", "zero3"])
def test_export_holds_the_weights_zero_to_fp32_recovers(stage, trained, tmp_path):
    from transformers import AutoTokenizer

    run = trained(stage)
    shard = "200KB" if stage == "zero3" else "5GB"  # the tiny model is ~0.5 MB: zero3 goes in 3 shards
    out = export(run, tmp_path / "hf", max_shard_size=shard)
    assert out == tmp_path / "hf"
    files = {p.name for p in out.iterdir()}
    shards = {f for f in files if f.startswith("model-") and f.endswith(".safetensors")}
    if stage == "zero3":
        assert "model.safetensors.index.json" in files and len(shards) == 3, files
    else:
        assert "model.safetensors" in files and not shards, files
    for name in METADATA:  # exactly what the run recorded
        assert (out / name).read_bytes() == (run / "hf_model" / name).read_bytes(), name
    assert_no_leftovers(tmp_path)

    model = load_exported(out)
    assert model.config.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    assert model.config.architectures == ["LlamaForCausalLM"] and model.config.use_cache
    tok = AutoTokenizer.from_pretrained(out)
    assert len(tok) == model.config.vocab_size
    assert tok.decode(tok("def f(x):\n    return x + 1\n").input_ids) == "def f(x):\n    return x + 1\n"

    ref = zero_to_fp32(run / "checkpoints", "step_00000008", tmp_path / "ref")
    assert_same_weights(model.state_dict(), ref)
    torch.testing.assert_close(logits(model), logits(reference_model(ref, out)), rtol=1e-6, atol=1e-6)


@pytest.mark.slow
def test_a_bf16_runs_export_is_bf16_and_says_so(trained, tmp_path):
    """A tag saved by a bf16 run (its marker's dtype) exports in bf16: every weight the fp32 master rounded to
    nearest, as DeepSpeed's bf16 copy that the run trained and scored, and config.json's dtype says bfloat16, so
    from_pretrained(dtype="auto") and `lm_eval --model hf` with no dtype load it as the run held it."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    run = tmp_path / "run"
    shutil.copytree(trained("zero2"), run, ignore=shutil.ignore_patterns("step_00000004"))
    marker = run / "checkpoints" / "step_00000008" / checkpoint.STATE_FILE
    marker.write_text(json.dumps(json.loads(marker.read_text()) | {"dtype": "bf16"}))
    out = export(run, tmp_path / "hf")
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    master = get_fp32_state_dict_from_zero_checkpoint(str(run / "checkpoints"), tag="step_00000008")
    written = load_file(out / "model.safetensors")
    assert {t.dtype for t in written.values()} == {torch.bfloat16}
    for name, tensor in written.items():
        assert torch.equal(tensor, master[name].to(torch.bfloat16)), name
    assert AutoModelForCausalLM.from_pretrained(out, dtype="auto").dtype == torch.bfloat16


@pytest.mark.slow
def test_zero0_export_holds_the_engine_module_weights(trained, tmp_path):
    run = trained("zero0")
    out = export(run / "checkpoints", tmp_path / "hf")  # the checkpoints directory as the source
    model = load_exported(out)
    saved = torch.load(run / "checkpoints" / "step_00000008" / "mp_rank_00_model_states.pt",
                       map_location="cpu", weights_only=False)["module"]
    assert_same_weights(model.state_dict(), saved)
    torch.testing.assert_close(logits(model), logits(reference_model(saved, out)), rtol=1e-6, atol=1e-6)


@pytest.mark.slow
def test_a_tag_picks_an_older_checkpoint(trained, tmp_path):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    run = trained("zero2")
    ckpts = run / "checkpoints"
    assert checkpoint.complete_tags(ckpts) == ["step_00000004", "step_00000008"]
    step4 = get_fp32_state_dict_from_zero_checkpoint(str(ckpts), tag="step_00000004")
    for out in (export(run, tmp_path / "by_tag", tag="step_00000004"),
                export(run, tmp_path / "by_step", tag="4"),
                export(ckpts / "step_00000004", tmp_path / "by_dir")):
        assert_same_weights(load_exported(out).state_dict(), step4)
    latest = load_exported(export(run, tmp_path / "latest")).state_dict()
    assert not torch.equal(latest["model.embed_tokens.weight"], step4["model.embed_tokens.weight"])
    with pytest.raises(UserError, match="no tag 'step_00000006'.*step_00000004, step_00000008"):
        export(run, tmp_path / "nope", tag="step_00000006")
    with pytest.raises(UserError, match="is the tag step_00000004, but tag='step_00000008'"):
        export(ckpts / "step_00000004", tmp_path / "nope", tag="step_00000008")
    assert not (tmp_path / "nope").exists()


@pytest.mark.slow
def test_an_incomplete_tag_is_refused(trained, tmp_path):
    run = shutil.copytree(trained("zero2"), tmp_path / "run")
    tag_dir = run / "checkpoints" / "step_00000008"
    checkpoint.rank_file(tag_dir, 1).unlink()  # rank 1 died during the save
    with pytest.raises(UserError, match=r"step_00000008' is incomplete.*complete tags: step_00000004"):
        export(run, tmp_path / "a", tag="step_00000008")
    with pytest.raises(UserError, match="is incomplete"):
        export(tag_dir, tmp_path / "b")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    # `latest` still names step 8; without a tag the newest complete tag is exported instead
    assert (run / "checkpoints" / "latest").read_text() == "step_00000008"
    src = resolve_source(run)  # and says so: the command prints it (`export: took ...`)
    assert src.tag == "step_00000004"
    assert src.passed_over == "skipped step_00000008 (incomplete: a save that did not finish)"
    assert resolve_source(run, "step_00000004").passed_over == ""  # asked for by name: nothing passed over


@pytest.mark.slow
def test_an_existing_non_empty_out_is_refused_and_left_untouched(trained, tmp_path):
    run = trained("zero0")
    out = tmp_path / "hf"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match="exists and is not empty; export never overwrites"):
        export(run, out)
    assert [p.name for p in out.iterdir()] == ["notes.txt"] and (out / "notes.txt").read_text() == "mine"
    assert_no_leftovers(tmp_path)
    empty = tmp_path / "empty"  # an empty directory is filled
    empty.mkdir()
    assert (export(run, empty) / "model.safetensors").is_file()


@pytest.mark.slow
def test_a_failed_export_leaves_nothing(trained, tmp_path):
    run = shutil.copytree(trained("zero0"), tmp_path / "run")
    config = run / "hf_model" / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "intermediate_size": 128}))
    with pytest.raises(UserError, match="do not fit .*hf_model/config.json"):
        export(run, tmp_path / "exports" / "hf")  # fails after the weights were read
    assert list((tmp_path / "exports").iterdir()) == []
    with pytest.raises(UserError, match="max_shard_size='lots' is not a size"):
        export(trained("zero0"), tmp_path / "exports" / "hf", max_shard_size="lots")
    assert list((tmp_path / "exports").iterdir()) == []


def fake_tag(ckpt_dir, step, complete=True):
    tag_dir = ckpt_dir / checkpoint.tag_for(step)
    tag_dir.mkdir(parents=True)
    checkpoint.rank_file(tag_dir, 0).write_bytes(b"x")
    checkpoint.manifest_file(tag_dir, 0).write_text(json.dumps(
        {"rank": 0, "seq": step, "files": {checkpoint.rank_file(tag_dir, 0).name: 1}}))
    if complete:
        (tag_dir / checkpoint.STATE_FILE).write_text(json.dumps(
            {"step": step, "world_size": 1, "zero_stage": 2, "seq": step, "config": {}}))
    return tag_dir


def test_bad_sources_name_the_path_and_the_fix(tmp_path):
    with pytest.raises(UserError, match="'.*missing' is not a directory; give a run directory"):
        export(tmp_path / "missing", tmp_path / "out")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="holds no checkpoints"):
        export(tmp_path / "empty", tmp_path / "out")
    fake_tag(tmp_path / "run" / "checkpoints", 4, complete=False)
    with pytest.raises(UserError, match="checkpoints' holds no complete checkpoint"):
        export(tmp_path / "run", tmp_path / "out")
    step8 = fake_tag(tmp_path / "run" / "checkpoints", 8)
    with pytest.raises(UserError, match=r"hf_model/config.json' not found; export needs .* hf_model/"):
        export(tmp_path / "run", tmp_path / "out")
    # as checkpoint.convert_to_universal marks its output
    universal = shutil.copytree(step8, step8.with_name("step_00000008_universal"))
    (universal / checkpoint.STATE_FILE).write_text(json.dumps(
        {"step": 8, "world_size": 0, "zero_stage": 2, "seq": 8, "config": {}, "universal": True,
         "source_tag": "step_00000008"}))
    with pytest.raises(UserError, match=r"universal checkpoint .*; export '.*/step_00000008' instead"):
        export(universal, tmp_path / "out")
    assert not (tmp_path / "out").exists()


# --- bad input: model.path directories and --out targets -----------------------------------------

@pytest.mark.parametrize("content, problem", [
    ("[]", "is a JSON list, not an object"),
    ("{not json", "is not valid JSON (line 1, column 2: Expecting property name enclosed in double quotes)"),
])
def test_a_damaged_config_json_in_model_path_is_named(tmp_path, content, problem):
    from ds_train.inputs import check_inputs

    (tmp_path / "config.json").write_text(content)
    (tmp_path / "tokenizer.json").write_text("{}")
    cfg = build_config({"model": {"path": str(tmp_path)}})
    with pytest.raises(UserError) as e:
        check_inputs(cfg, str(ROOT / "ds_configs" / "zero0.json"), data=False)
    assert str(e.value) == (f"model.path: '{tmp_path / 'config.json'}' {problem}; re-export or re-download the "
                            f"model directory")


def fake_run(tmp_path):
    """A run directory export accepts up to the point it reads the weights."""
    fake_tag(tmp_path / "run" / "checkpoints", 8)
    (tmp_path / "run" / "hf_model").mkdir()
    (tmp_path / "run" / "hf_model" / "config.json").write_text("{}")
    return tmp_path / "run"


def test_an_out_that_cannot_be_written_is_one_line_naming_out(tmp_path):
    run = fake_run(tmp_path)
    (tmp_path / "file").write_text("x")
    with pytest.raises(UserError) as e:
        export(run, tmp_path / "file" / "hf")
    assert str(e.value) == (f"--out: '{tmp_path / 'file' / 'hf'}' cannot be a directory: '{tmp_path / 'file'}' "
                            f"is a file; choose another --out")
    ro = tmp_path / "ro"
    ro.mkdir()
    before = tree_listing(tmp_path)
    readonly = ["unshare", "-m", "--propagation", "private", "sh", "-c",
                f'mount -t tmpfs -o ro tmpfs {ro} && exec "$0" "$@"']
    for out in (ro / "hf", ro):
        expect_error(["export", str(run), "--out", str(out)],
                     f"--out: '{out}' is on a read-only file system ('{ro}'); choose a writable --out", wrap=readonly)
    assert tree_listing(tmp_path) == before


def test_an_export_into_a_tag_or_a_checkpoints_directory_is_refused_before_anything_is_written(tmp_path):
    """checkpoint.keep prunes a tag's folder and a resume reads checkpoints/: an export never goes there."""
    run = fake_run(tmp_path)
    ckpts = run / "checkpoints"
    fresh = tmp_path / "fresh"  # a run that has not saved yet: its checkpoints/ does not exist
    fresh.mkdir()
    (fresh / "config.yaml").write_text("{}")
    (tmp_path / "link").symlink_to(ckpts / "step_00000008")
    before = tree_listing(tmp_path)
    line = expect_error(["export", str(run), "--out", str(ckpts / "step_00000008" / "hf")])
    assert line == (f"ds-train: error: export: --out '{ckpts / 'step_00000008' / 'hf'}' is inside the checkpoints "
                    f"directory '{ckpts}', where checkpoint.keep prunes and a resume reads; export beside it, e.g. "
                    f"--out '{run / 'hf_export'}'")
    for out, holder in ((ckpts / "step_00000008", ckpts), (ckpts, ckpts), (ckpts / "hf", ckpts),
                        (ckpts / "step_00000012", ckpts), (tmp_path / "link" / "hf", ckpts),
                        (fresh / "checkpoints" / "hf", fresh / "checkpoints")):
        with pytest.raises(UserError) as e:
            export(run, out)
        assert f"is inside the checkpoints directory '{holder}'" in str(e.value), out
    assert tree_listing(tmp_path) == before  # nothing written, nothing created
    for out in (run / "hf_export", tmp_path / "elsewhere" / "hf", fresh / "hf_export"):
        check_outside_checkpoints(out)  # beside the checkpoints: allowed
