"""ds_train.config: YAML + key=value overrides -> a validated, frozen RunConfig."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest

from conftest import expect_error, tree_listing
from ds_train.config import RunConfig
from ds_train.config.file import (all_keys, build_config, describe, load_config, parse_overrides,
                                  read_yaml)
from ds_train.errors import UserError

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "recipes" / "quickstart.yaml"
ARCH = {"model": {"config": {"model_type": "llama", "hidden_size": 64}}}


def with_arch(**sections) -> dict:
    return {"model": {"config": {"model_type": "llama", "hidden_size": 64}}, **sections}


# --- loading the recipe --------------------------------------------------------------------------

def test_quickstart_recipe_loads_with_its_values():
    cfg = load_config(QUICKSTART)
    assert isinstance(cfg, RunConfig)
    assert cfg.output_dir == "runs/quickstart"
    assert cfg.seed == 1234
    assert cfg.model.config["model_type"] == "llama"
    assert cfg.model.config["hidden_size"] == 128
    assert cfg.model.path == ""
    assert cfg.data.sources == ["python-stdlib"]
    assert cfg.train.max_steps == 300
    assert cfg.train.global_batch_size == 32
    assert cfg.train.micro_batch_size == 2
    assert cfg.optim.lr == pytest.approx(8e-3)
    assert isinstance(cfg.optim.lr, float)
    assert cfg.log.wandb == "off"  # a bare YAML `off` is false in YAML 1.1; it must stay "off"
    assert cfg.log.sample_prompt == "def"


def test_fields_not_in_the_recipe_keep_their_defaults():
    cfg = load_config(QUICKSTART)
    assert cfg.optim.betas == [0.9, 0.95]
    assert cfg.log.wandb_project == "ds_train"
    assert cfg.checkpoint.save_final is True


def test_no_file_and_no_overrides_still_needs_a_model():
    with pytest.raises(UserError, match="model.path.*model.config"):
        load_config(None)


def test_split_digits_is_refused_where_a_tokenizer_is_given(tmp_path):
    assert load_config(QUICKSTART, ["data.split_digits=true"]).data.split_digits is True
    with pytest.raises(UserError, match="override data.split_digits=true: applies to the BPE prepare trains when "
                                        "no tokenizer is given, but data.tokenizer gives one; drop data.split_digits"):
        load_config(QUICKSTART, ["data.split_digits=true", "data.tokenizer=/tok"])
    with pytest.raises(UserError, match="data.split_digits: applies to .* but model.path gives one"):
        build_config({"model": {"path": str(tmp_path)}, "data": {"split_digits": True}})


# --- key=value overrides -------------------------------------------------------------------------

def test_int_override():
    cfg = load_config(QUICKSTART, ["train.max_steps=20"])
    assert cfg.train.max_steps == 20 and type(cfg.train.max_steps) is int


def test_float_override_with_a_decimal_point():
    cfg = load_config(QUICKSTART, ["optim.lr=3.0e-4", "data.val_fraction=0.25"])
    assert cfg.optim.lr == pytest.approx(3e-4)
    assert cfg.data.val_fraction == pytest.approx(0.25)


def test_int_given_for_a_float_field_becomes_float():
    cfg = load_config(QUICKSTART, ["train.grad_clip=2"])
    assert cfg.train.grad_clip == 2.0 and type(cfg.train.grad_clip) is float


def test_float_override_in_exponent_form_3e_minus_4():
    """Regression, fixed: before the fix, PyYAML (YAML 1.1) reads `3e-4` (no decimal point) as the string '3e-4', so
    `optim.lr=3e-4` fails with "optim.lr: '3e-4' must be a number". Expected: 0.0003."""
    cfg = load_config(QUICKSTART, ["optim.lr=3e-4"])
    assert cfg.optim.lr == pytest.approx(3e-4)


def test_float_in_exponent_form_in_a_yaml_file(tmp_path):
    """Regression, fixed (same root cause): `lr: 3e-4` in a recipe is rejected as a string."""
    path = tmp_path / "run.yaml"
    path.write_text("model:\n  config: {model_type: llama}\noptim:\n  lr: 3e-4\n")
    assert load_config(path).optim.lr == pytest.approx(3e-4)


@pytest.mark.parametrize("text, expected", [("false", False), ("true", True), ("False", False),
                                            ("no", False), ("on", True)])
def test_bool_override(text, expected):
    cfg = load_config(QUICKSTART, [f"log.progress={text}"])
    assert cfg.log.progress is expected


def test_string_overrides():
    cfg = load_config(QUICKSTART, ["output_dir=runs/exp_1", "data.tokenizer=/models/tok",
                                   "log.sample_prompt=", "model.attn_implementation=eager"])
    assert cfg.output_dir == "runs/exp_1"
    assert cfg.data.tokenizer == "/models/tok"
    assert cfg.log.sample_prompt == ""
    assert cfg.model.attn_implementation == "eager"


def test_numeric_looking_string_override_stays_a_string():
    """Regression, fixed: before the fix, a str field given digits, e.g. `log.wandb_project=2024`, is YAML-parsed to the
    int 2024 and rejected ("log.wandb_project: 2024 must be a string"). Expected: '2024'."""
    cfg = load_config(QUICKSTART, ["log.wandb_project=2024"])
    assert cfg.log.wandb_project == "2024"


@pytest.mark.parametrize("mode", ["off", "offline", "online"])
def test_wandb_override_keeps_the_mode_string(mode):
    cfg = load_config(QUICKSTART, [f"log.wandb={mode}"])
    assert cfg.log.wandb == mode
    assert cfg.log.wandb is not False


def test_nested_model_config_override_merges_into_the_architecture():
    cfg = load_config(QUICKSTART, ["model.config.hidden_size=64", "model.config.rms_norm_eps=1.0e-5"])
    assert cfg.model.config["hidden_size"] == 64
    assert cfg.model.config["rms_norm_eps"] == pytest.approx(1e-5)
    assert cfg.model.config["num_hidden_layers"] == 3  # the rest of the recipe's architecture stays
    assert cfg.model.config["model_type"] == "llama"


def test_override_without_equals_sign_is_a_user_error():
    with pytest.raises(UserError, match="key=value"):
        parse_overrides(["train.max_steps"])
    with pytest.raises(UserError, match="key=value"):
        parse_overrides(["=3"])


def test_parse_overrides_types():
    assert parse_overrides(["a=1", "b=1.5", "c=true", "d=hello", "e="]) == [
        ("a", 1), ("b", 1.5), ("c", True), ("d", "hello"), ("e", "")]


# --- unknown keys --------------------------------------------------------------------------------

def test_unknown_override_key_suggests_the_closest():
    with pytest.raises(UserError) as e:
        load_config(QUICKSTART, ["train.max_step=3"])
    assert "train.max_step" in str(e.value)
    assert "'train.max_steps'" in str(e.value)


def test_unknown_yaml_key_suggests_the_closest(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("model:\n  config: {model_type: llama}\ntrain:\n  max_step: 3\n")
    with pytest.raises(UserError) as e:
        load_config(path)
    msg = str(e.value)
    assert str(path) in msg
    assert "train.max_step: unknown key" in msg
    assert "'train.max_steps'" in msg


def test_unknown_keys_in_yaml_are_all_reported(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("model:\n  config: {model_type: llama}\n  dtyp: bf16\noptim:\n  learning_rate: 1\n")
    with pytest.raises(UserError) as e:
        load_config(path)
    msg = str(e.value)
    assert "model.dtyp" in msg and "'model.dtype'" in msg
    assert "optim.learning_rate" in msg


def test_misspelt_section_suggests_the_section():
    """Regression, fixed: before the fix, a misspelt top-level section (`trian:`) is reported as "trian: unknown key" with
    no suggestion, because _suggest only compares against dotted leaf keys. Expected: a hint
    naming 'train'."""
    with pytest.raises(UserError) as e:
        build_config({**ARCH, "trian": {"max_steps": 3}})
    assert "trian" in str(e.value)
    assert "did you mean" in str(e.value) and "train" in str(e.value).split("did you mean")[1]


# --- problems reported together ------------------------------------------------------------------

def test_several_bad_values_are_reported_in_one_error():
    with pytest.raises(UserError) as e:
        load_config(QUICKSTART, ["train.max_steps=-5", "optim.lr=-0.5"])
    msg = str(e.value)
    assert msg.startswith("overrides: 2 problems:")  # the recipe's own values are fine
    assert "override train.max_steps=-5: must be positive" in msg
    assert "override optim.lr=-0.5: must be positive" in msg


def test_several_type_errors_are_reported_in_one_error():
    with pytest.raises(UserError) as e:
        build_config(with_arch(train={"seq_len": "long", "micro_batch_size": 2.5}))
    msg = str(e.value)
    assert "train.seq_len: 'long' must be an integer" in msg
    assert "train.micro_batch_size: 2.5 must be an integer" in msg


def test_type_error_and_range_error_are_reported_together():
    """Regression, fixed: before the fix, build_config skips the range checks (cfg.check()) whenever a type error was
    found, so `train.max_steps=abc optim.lr=-1` reports only the max_steps problem, although the
    module promises "every problem is collected and reported at once". Expected: both."""
    with pytest.raises(UserError) as e:
        load_config(QUICKSTART, ["train.max_steps=abc", "optim.lr=-1"])
    msg = str(e.value)
    assert "override train.max_steps=abc: must be an integer" in msg
    assert "override optim.lr=-1: must be positive" in msg


def test_cross_field_check_names_both_keys():
    with pytest.raises(UserError, match="optim.reference_batch_size.*'linear'"):
        build_config(with_arch(optim={"lr_scaling": "linear"}))


# --- type errors ---------------------------------------------------------------------------------

@pytest.mark.parametrize("override, needle", [
    ("train.max_steps=ten", "override train.max_steps=ten: must be an integer"),
    ("train.max_steps=true", "override train.max_steps=true: must be an integer"),
    ("train.seq_len=12.5", "override train.seq_len=12.5: must be an integer"),
    ("optim.lr=fast", "override optim.lr=fast: must be a number"),
    ("log.progress=maybe", "override log.progress=maybe: must be true or false"),
    ("model.dtype=fp8", "override model.dtype=fp8: is not one of auto, bf16, fp16, fp32"),
    ("optim.betas=0.9", "override optim.betas=0.9: must be a list of numbers"),
])
def test_type_errors_of_overrides_name_the_override(override, needle):
    """A bad value given on the command line is the override's problem, not the recipe's."""
    with pytest.raises(UserError) as e:
        load_config(QUICKSTART, [override])
    assert str(e.value) == needle


def test_section_that_is_not_a_mapping_is_an_error():
    with pytest.raises(UserError, match="train: must be a mapping"):
        build_config({**ARCH, "train": 5})


# --- the YAML file -------------------------------------------------------------------------------

def test_invalid_yaml_names_file_and_line(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("seed: 1\ntrain:\n  max_steps: 5\n  seq_len: a: b\n")
    with pytest.raises(UserError) as e:
        read_yaml(path)
    assert str(path) in str(e.value)
    assert "line 4" in str(e.value)


def test_invalid_yaml_through_load_config(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("seed: 1\ntrain:\n\tmax_steps: 5\n")
    with pytest.raises(UserError, match=r"broken\.yaml: invalid YAML at line 3"):
        load_config(path)


def test_missing_file_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")


def test_top_level_list_is_rejected(tmp_path):
    path = tmp_path / "list.yaml"
    path.write_text("- a\n- b\n")
    with pytest.raises(UserError, match="top level must be a mapping"):
        read_yaml(path)


def test_empty_yaml_is_an_empty_mapping(tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text("")
    assert read_yaml(path) == {}


# --- frozen, described ---------------------------------------------------------------------------

def test_config_is_frozen():
    cfg = load_config(QUICKSTART)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.seed = 1  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.train.max_steps = 1  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.optim.lr = 1.0  # type: ignore[misc]


def test_to_dict_round_trips_through_build_config():
    cfg = load_config(QUICKSTART, ["train.max_steps=7"])
    assert build_config(cfg.to_dict()) == cfg


def test_all_keys_are_dotted_and_accepted_as_overrides():
    keys = all_keys()
    assert len(keys) == len(set(keys))
    assert {"seed", "output_dir", "train.max_steps", "optim.lr", "log.wandb", "model.config"} <= set(keys)
    for key in keys:
        assert key == key.strip() and " " not in key


def test_describe_mentions_every_key():
    text = describe()
    for key in all_keys():
        assert key in text, key
    assert "Optimizer steps to train for." in text  # the field help is printed too


def test_ript_recipes_load_and_agree_with_two_ranks(tmp_path):
    sft = load_config(QUICKSTART.parent / "ript_sft.yaml")
    assert sft.data.sources == ["recipes/data/ript_demos.jsonl"] and sft.data.format == "sft" and sft.output_dir == "runs/ript_sft"
    cfg = load_config(QUICKSTART.parent / "ript_demo.yaml", [f"model.path={tmp_path}"])
    assert cfg.ript.tasks == ["add", "rev", "copy", "sort", "parity", "max", "guess"] and cfg.ript.rloo_batch_size == 8
    rows_per_rank = cfg.ript.contexts_per_rank * cfg.ript.rloo_batch_size
    assert rows_per_rank % (cfg.train.global_batch_size // 2) == 0  # what `ript` checks at 2 ranks
    with pytest.raises(UserError, match=r"override ript.early_stop_fraction=0: must be within \(0, 1\]"):
        load_config(None, [f"model.path={tmp_path}", "ript.early_stop_fraction=0"])


# What each RIPT size ended in before its bound (issue 72), the limit and a value the machinery takes at it.
RIPT_SIZES = [
    # a MemoryError building a group's episodes (ript.max_contexts_checked 64, rollout_contexts 8: the defaults)
    (["ript.rloo_batch_size=1000000000000"], "ript.max_contexts_checked x rloo_batch_size: 64 x 1000000000000 = "
                                             "64000000000000 is above 16777216", ["ript.rloo_batch_size=262144"]),
    (["ript.rollout_contexts=1000000000000"], "ript.rollout_contexts x rloo_batch_size: 1000000000000 x 8 = "
                                              "8000000000000 is above 16777216", ["ript.rollout_contexts=2097152"]),
    # a start that never ends (each rank draws the contexts into a list, 50 tries each)
    (["ript.train_contexts=1000000000000"], "ript.train_contexts=1000000000000: must be within [1, 16777216]",
     ["ript.train_contexts=16777216"]),
    (["ript.eval_contexts=1000000000000"], "ript.eval_contexts=1000000000000: must be within [1, 16777216]",
     ["ript.eval_contexts=16777216"]),
    # an iteration that never ends (every epoch's order drawn before the first)
    (["ript.ppo_epochs=1000000000000"], "ript.ppo_epochs=1000000000000: must be within [1, 1024]", ["ript.ppo_epochs=1024"]),
    (["ript.max_new_tokens=1000000000000"], "ript.max_new_tokens=1000000000000: must be within [1, 16777216]",
     ["ript.max_new_tokens=16777216"]),
    # RuntimeError: probability tensor contains either `inf`, `nan` or element < 0 (HF's sampler)
    (["ript.temperature=1e-300"], "ript.temperature=1e-300: is below 1e-30", ["ript.temperature=1e-30", "ript.temperature=0"]),
    # RuntimeError: value cannot be converted to type float without overflow (torch.clamp of the ratio)
    (["ript.clip_high=1e308"], "ript.clip_high=1e308: is above 1e38", ["ript.clip_high=1e38"]),
    (["ript.tis_cap=1e308", "ript.rollout_engine=vllm"], "ript.tis_cap=1e308: is above 1e38", []),  # the same clamp
]


@pytest.mark.parametrize("bad, said, at_limit", RIPT_SIZES, ids=[b[0][0] for b in RIPT_SIZES])
def test_ript_sizes_past_what_the_machinery_takes_are_one_line_naming_the_key_value_and_limit(tmp_path, bad, said,
                                                                                               at_limit):
    """Absurd but positive RIPT sizes ended in a MemoryError, a torch RuntimeError or a start or iteration that never
    ended; each is refused when the config loads, in one line naming the key, the value and the limit, and the limit
    itself loads (each measured to run: ript.clip_high=1e38 and ript.temperature=1e-30 through whole iterations)."""
    base = [f"model.path={tmp_path}"]
    with pytest.raises(UserError) as e:
        load_config(None, [*base, *bad], command="ript")
    assert "\n" not in str(e.value) and said in str(e.value), str(e.value)
    for ok in at_limit:
        load_config(None, [*base, ok], command="ript")


def test_a_chat_template_given_as_a_jinja_file_is_read_into_the_config(tmp_path, monkeypatch):
    """data.chat_template: the path of a .jinja file (from the recipe or an override) becomes the template's text,
    so the run's saved config holds the template it rendered with; a missing file is one line naming it."""
    qwen = QUICKSTART.parent / "templates" / "qwen2_5.jinja"
    cfg = load_config(QUICKSTART.parent / "tool_sft.yaml")
    assert cfg.data.chat_template == qwen.read_text() and cfg.data.format == "sft"
    (tmp_path / "t.jinja").write_text("{{ messages[0]['content'] }}")
    monkeypatch.chdir(tmp_path)  # a path from the directory the run starts in, as data.sources are
    model = "model.config.model_type=llama"
    assert load_config(None, [model, "data.chat_template=t.jinja"]).data.chat_template == "{{ messages[0]['content'] }}"
    literal = "{% for m in messages %}{{ m['content'] }}.jinja{% endfor %}"  # a template's text stays text
    assert load_config(None, [model, f"data.chat_template={literal}"]).data.chat_template == literal
    with pytest.raises(UserError, match=r"^nope\.jinja: chat template not found \(override data.chat_template names "
                                        r"it; give a path from the directory you run in, or the template's text\)$"):
        load_config(None, [model, "data.chat_template=nope.jinja"])


def test_the_long_context_recipe_passes_every_check_for_its_two_ranks():
    """recipes/long_context.yaml as bench/long_context.py launches it: 2 ranks, one sequence a step
    split over both, each rank 4,096 positions (what Ulysses and the batch plan check)."""
    from ds_train.plan.batch import plan_batch
    from ds_train.dsconfig import read_ds_template
    from ds_train.plan.parallel import check_heads, check_sequence, check_window, plan_dims

    cfg = load_config(QUICKSTART.parent / "long_context.yaml")
    dims = plan_dims(cfg.parallel, 2)
    plan = plan_batch(cfg.train.global_batch_size, cfg.train.micro_batch_size, dims.data, cfg.train.seq_len,
                      dims.derivation())
    assert (dims.data, dims.sequence, plan.grad_accum_steps, cfg.train.seq_len // dims.sequence) == (1, 2, 1, 4096)
    check_sequence(cfg, read_ds_template(str(QUICKSTART.parents[1] / "ds_configs" / "zero2.json")))
    from transformers import AutoConfig

    hf = AutoConfig.for_model(**cfg.model.config)
    check_heads(dims, hf)
    check_window(dims, hf, cfg.model.attn_implementation, cfg.train.seq_len)
    assert hf.max_position_embeddings >= cfg.train.seq_len


# --- bad input: one line naming the file, key or value and the fix --------------------------------

def test_an_empty_data_dir_is_refused_like_an_empty_output_dir(tmp_path):
    """`data.dir=` would prepare the dataset into the current directory."""
    fix = ("must not be empty (it would prepare into the current directory); give the directory that "
           "holds or will hold train.bin, val.bin and meta.json")
    with pytest.raises(UserError) as e:
        load_config(QUICKSTART, ["data.dir="])
    assert str(e.value) == f"override data.dir=: {fix}"
    path = tmp_path / "c.yaml"
    path.write_text("model: {config: {model_type: llama}}\ndata:\n  dir: ''\n")
    with pytest.raises(UserError) as e:
        load_config(path)
    assert str(e.value) == f"{path}: data.dir: {fix}"


def test_a_key_given_twice_names_the_key_the_file_and_both_lines(tmp_path):
    path = tmp_path / "base.yaml"
    path.write_text("seed: 7\nmodel: {config: {model_type: llama}}\ntrain:\n  seq_len: 64\n  max_steps: 3\n"
                    "  seq_len: 128\nseed: 99\n")
    with pytest.raises(UserError) as e:
        load_config(path)
    assert str(e.value) == (f"{path}: 'train.seq_len' is given twice, at lines 4 and 6 (YAML would keep only "
                            f"the second); remove one of them")


def test_yaml_merge_keys_are_not_duplicates(tmp_path):
    path = tmp_path / "merge.yaml"
    path.write_text("base: &b {lr: 0.1, warmup_steps: 2}\n"
                    "optim:\n  <<: *b\n  lr: 0.01\n")
    assert read_yaml(path)["optim"] == {"lr": 0.01, "warmup_steps": 2}


def test_a_config_file_that_is_not_utf8_is_one_line(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes("seed: 7\n# caf\xe9\n".encode("latin-1"))
    with pytest.raises(UserError) as e:
        load_config(path)
    assert str(e.value) == f"{path}: not UTF-8 text (byte 0xe9 on line 2); save the config file as UTF-8"


def test_a_control_character_in_the_config_file_is_one_line(tmp_path):
    path = tmp_path / "ctl.yaml"
    path.write_text("seed: 7\x00\n")
    with pytest.raises(UserError) as e:
        load_config(path)
    assert str(e.value) == f"{path}: invalid YAML: character #x0000 at offset 7 is not allowed in YAML; remove it"


def test_a_directory_given_as_the_config_file(tmp_path):
    with pytest.raises(UserError) as e:
        load_config(tmp_path)
    assert str(e.value) == f"--config: '{tmp_path}' is a directory, not a config file; give the file itself"


def test_a_bad_override_is_blamed_on_the_override_and_a_bad_file_value_on_the_file(tmp_path):
    """The file says seq_len 64; `train.seq_len=1.5` on the command line is the problem."""
    path = tmp_path / "base.yaml"
    path.write_text("model: {config: {model_type: llama}}\ntrain: {seq_len: 64}\noptim: {lr: -1}\n")
    with pytest.raises(UserError) as e:
        load_config(path, ["train.seq_len=1.5", "optim.lr=0.1"])
    assert str(e.value) == "override train.seq_len=1.5: must be an integer"
    with pytest.raises(UserError) as e:
        load_config(path)
    assert str(e.value) == f"{path}: optim.lr: -1.0 must be positive"
    with pytest.raises(UserError) as e:
        load_config(path, ["train.seq_len=1.5"])
    assert str(e.value) == (f"{path} and overrides: 2 problems: override train.seq_len=1.5: must be an "
                            f"integer; optim.lr: -1.0 must be positive")


def test_bad_config_input_on_the_command_line_is_one_line_and_writes_nothing(tmp_path):
    (tmp_path / "base.yaml").write_text(f"output_dir: {tmp_path / 'run'}\nmodel: {{config: {{model_type: llama}}}}\n"
                                        f"train: {{seq_len: 64}}\nseed: 7\nseed: 99\n")
    before = tree_listing(tmp_path)
    args = ["train", "--config", str(tmp_path / "base.yaml"), "--ds-config", str(ROOT / "ds_configs" / "zero0.json")]
    expect_error(args, f"{tmp_path / 'base.yaml'}: 'seed' is given twice, at lines 4 and 5")
    (tmp_path / "base.yaml").write_text(f"output_dir: {tmp_path / 'run'}\nmodel: {{config: {{model_type: llama}}}}\n")
    before = tree_listing(tmp_path)
    expect_error([*args, "train.seq_len=1.5", "data.dir="],
                 "overrides: 2 problems: override train.seq_len=1.5: must be an integer; override data.dir=: "
                 "must not be empty")
    expect_error([*args, "--ds-config", str(tmp_path)], f"--ds-config: '{tmp_path}' is a directory, not a "
                                                        f"DeepSpeed JSON file")
    assert tree_listing(tmp_path) == before


def test_a_path_the_os_refuses_is_named_with_its_key_at_load(tmp_path):
    """Every path a user gives (output_dir, data.dir, data.sources[i], data.tokenizer, model.path,
    checkpoint.resume) is checked at load: a name the file system will not take is one line."""
    long = str(tmp_path / ("x" * 300))
    (tmp_path / "f.txt").write_text("x")
    cases = {"output_dir": {"output_dir": long}, "data.dir": {"data": {"dir": long}},
             "data.sources[1]": {"data": {"sources": [str(tmp_path / "f.txt"), long]}},
             "data.tokenizer": {"data": {"tokenizer": str(tmp_path / "f.txt" / "tok")}},
             "checkpoint.resume": {"checkpoint": {"resume": long}},
             "model.path": {"model": {"path": long}}}
    for key, raw in cases.items():
        with pytest.raises(UserError) as e:
            build_config({**with_arch(), **raw} if key != "model.path" else raw)
        assert f"{key}: " in str(e.value) and ("255 bytes" in str(e.value) or "is a file" in str(e.value)), \
            (key, str(e.value))


def test_a_path_the_os_refuses_on_the_command_line_is_one_line_and_writes_nothing(tmp_path):
    (tmp_path / "base.yaml").write_text(f"output_dir: {tmp_path / 'run'}\nmodel: {{config: {{model_type: llama}}}}\n"
                                        f"data: {{dir: {tmp_path / 'data'}, sources: [{tmp_path / 'base.yaml'}]}}\n")
    before = tree_listing(tmp_path)
    args = ["train", "--config", str(tmp_path / "base.yaml"), "--ds-config", str(ROOT / "ds_configs" / "zero0.json")]
    for override in (f"data.dir={tmp_path / ('d' * 300)}", f"model.path={tmp_path / ('m' * 300)}",
                     f"data.tokenizer={tmp_path / ('t' * 300)}", f"output_dir={tmp_path / ('o' * 300)}"):
        expect_error([*args, override, *(["model.config={}"] if "model.path" in override else [])],
                     override.split("=")[0], "longer than 255 bytes")
    assert tree_listing(tmp_path) == before


def _numeric_fields(cls=RunConfig, prefix=""):
    """(key, type, bound) of every number (int, float, list of floats) of the run config, at any depth."""
    import typing

    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            yield from _numeric_fields(tp, f"{prefix}{f.name}.")
        elif tp in (int, float) or tp == list[float]:
            yield f"{prefix}{f.name}", tp, f.metadata.get("bound")


def _outside(bound) -> list:
    """Values just outside each finite end of a bound (an open end: the end itself)."""
    from ds_train.config.fields import Range

    if isinstance(bound, tuple):
        bound = Range(*bound)
    if not isinstance(bound, Range):
        return []
    out = [bound.low if bound.low_open else bound.low - 1] if math.isfinite(bound.low) else []
    return out + ([bound.high if bound.high_open else bound.high + 1] if math.isfinite(bound.high) else [])


def _nest(key: str, value) -> dict:
    for part in reversed(key.split(".")):
        value = {part: value}
    return value


@pytest.mark.parametrize("key, tp, bound", list(_numeric_fields()), ids=lambda x: x if isinstance(x, str) else "")
def test_every_number_of_the_config_is_checked_where_it_is_declared(key, tp, bound):
    """Non-finite numbers (YAML's .nan, .inf), numbers outside the field's declared bound and values of
    another type: each is one error naming the key, from a file's mapping and from an override alike."""
    base = {"output_dir": "/nonexistent/run", "model": {"config": {"model_type": "llama"}}}
    bad = [float("nan"), float("inf"), float("-inf")] if tp is float else []
    bad += [[float("nan")]] if tp == list[float] else []
    bad += ["many", [1]] if tp is not list else []
    if bound == "positive":
        bad.append(0)
    if bound in ("positive", ">= 0"):
        bad.append(-1)
    bad += _outside(bound)
    for value in bad:
        raw = _nest(key, value)
        for section, values in base.items():
            if isinstance(values, dict):
                raw.setdefault(section, {})
                raw[section] = {**values, **raw[section]} if section in raw else values
            else:
                raw.setdefault(section, values)
        with pytest.raises(UserError) as e:
            build_config(raw, source="c.yaml")
        assert key in str(e.value) and "\n" not in str(e.value), (value, str(e.value))
    for value in [v for v in bad if isinstance(v, float)]:  # the command line's spelling of the same
        with pytest.raises(UserError) as e:
            load_config(None, [f"{key}={value}", "output_dir=/nonexistent/run", "model.config.model_type=llama"])
        assert key in str(e.value), (value, str(e.value))


def test_a_nan_from_the_yaml_file_or_the_ds_config_is_refused_before_anything_is_written(tmp_path):
    """optim.lr: .nan in the run config, NaN in the DeepSpeed JSON's optimizer.params and a negative
    warm-up in its scheduler.params: one line each, exit 2, and the output directory never made."""
    from conftest import ROOT

    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"output_dir: {tmp_path / 'run'}\nmodel: {{config: {{model_type: llama}}}}\noptim: {{lr: .nan}}\n")
    expect_error(["train", "--config", str(cfg), "--ds-config", str(ROOT / "ds_configs" / "zero0.json")],
                 "optim.lr: nan must be a finite number")
    ds = tmp_path / "ds.json"
    ds.write_text('{"optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": [0.9, NaN]}}}')
    cfg.write_text(f"output_dir: {tmp_path / 'run'}\nmodel: {{config: {{model_type: llama}}}}\n")
    expect_error(["train", "--config", str(cfg), "--ds-config", str(ds)],
                 f"{ds}: optimizer.params.betas[1]: nan is not a finite number")
    ds.write_text('{"scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": "auto", '
                  '"warmup_num_steps": -3}}}')  # was DeepSpeed's ValueError traceback, after the run directory
    expect_error(["train", "--config", str(cfg), "--ds-config", str(ds)],
                 f"{ds}: scheduler.params.warmup_num_steps=-3 must be >= 1")
    assert not (tmp_path / "run").exists()


def test_a_key_set_in_a_section_the_run_does_not_use_is_refused_by_one_rule():
    """dpo.* outside preference training and model.lora.* with LoRA off would be ignored: each key set
    to other than its default is one error naming it and what uses it; defaults (a saved config.yaml
    writes every key) and a section the run uses pass."""
    base = {"output_dir": "/nonexistent/run", "model": {"config": {"model_type": "llama"}}}
    with pytest.raises(UserError) as e:
        build_config({**base, "dpo": {"beta": 0.5, "label_smoothing": 0.0},
                      "model": {**base["model"], "lora": {"alpha": 8, "load_in": "4bit"}}})
    said = str(e.value)
    assert said.startswith("config: 4 problems: ")  # load_in: needs model.path, and needs LoRA (said once)
    assert "dpo.beta: set, but only preference training (data.format: preference) uses dpo.*" in said
    assert "model.lora.alpha: set, but only LoRA (model.lora.rank > 0) uses model.lora.*" in said
    assert "model.lora.load_in=4bit needs LoRA" in said and "model.lora.load_in: set" not in said
    assert "label_smoothing" not in said
    full = RunConfig(output_dir="/nonexistent/run", model=build_config(base).model).to_dict()  # every key
    assert build_config(full).dpo.beta == 0.1
    used = build_config({**base, "data": {"format": "preference"}, "dpo": {"beta": 0.5},
                         "model": {**base["model"], "lora": {"rank": 4, "alpha": 8}}})
    assert (used.dpo.beta, used.model.lora.alpha) == (0.5, 8)


# --- the sections a command reads (ds_train/config/uses.py) -------------------------------------

def test_every_section_of_the_run_config_has_a_row_saying_which_command_reads_it():
    """A section added later (a field of RunConfig, or a section inside one) without a row would be
    neither refused nor said: the table must name it; every row names a real key or section."""
    import typing

    from ds_train.config.uses import READS, USES

    def sections(cls, prefix: str) -> list[str]:
        out = []
        for name, tp in typing.get_type_hints(cls).items():
            if dataclasses.is_dataclass(tp):
                out += [f"{prefix}{name}", *sections(tp, f"{prefix}{name}.")]
            elif not prefix:
                out.append(name)  # a top-level key (output_dir, seed) is its own row
        return out

    missing = [s for s in sections(RunConfig, "") if s not in USES]
    assert not missing, f"add a row to ds_train/config/uses.py USES for {missing}"
    real = set(sections(RunConfig, "")) | set(all_keys())
    assert not [row for row in USES if row not in real]
    assert {"train", "ript", "dry-run", "parity", "estimate", "prepare"} <= set(READS)


def test_a_key_of_a_section_the_command_does_not_read_is_refused_by_one_rule():
    """train ignores ript.*, ript ignores data.* (but for its chat template) and train.max_steps;
    dry-run, parity and prepare read a train run's config; estimate plans either kind."""
    ript_keys = {"ript": {"iterations": 3}}
    for command in ("train", "dry-run", "parity", "prepare"):
        with pytest.raises(UserError, match=rf"^config: ript.iterations: set, but `ds-train {command}` does not "
                                            rf"read ript.\* \(`ds-train ript` does\); remove it, or run"):
            build_config({**ARCH, **ript_keys}, command=command)
    with pytest.raises(UserError) as e:
        build_config({**ARCH, "data": {"dir": "d", "chat_template": "{{ x }}"}, "train": {"max_steps": 5},
                      "log": {"sample_prompt": "x"}}, command="ript")
    said = str(e.value)
    assert said.startswith("config: 3 problems: ") and "chat_template" not in said
    assert "data.dir: set, but `ds-train ript` does not read data.* (`ds-train train` does)" in said
    assert "train.max_steps: set, but `ds-train ript` does not read train.max_steps (" in said
    assert "log.sample_prompt: set, but" in said
    both = {**ARCH, **ript_keys, "data": {"dir": "d"}}
    assert build_config(both, command="estimate").ript.iterations == 3  # plans a train or a ript run
    assert build_config(both).ript.iterations == 3  # a library caller naming no command: either
    full = RunConfig(output_dir="/nonexistent/run", model=build_config(ARCH).model).to_dict()  # every key
    for command in ("train", "ript", "estimate"):
        assert build_config(full, command=command).ript.iterations == 50  # defaults are no setting


def test_a_train_run_given_ript_keys_is_refused_before_anything_is_written(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"output_dir: {tmp_path / 'run'}\nmodel: {{config: {{model_type: llama}}}}\n"
                   f"data: {{dir: {tmp_path / 'data'}}}\nript: {{tasks: [add]}}\n")
    before = tree_listing(tmp_path)
    for args in (["train"], ["parity", "--nproc", "2"], ["dry-run", "--nodes", "1", "--gpus-per-node", "1"]):
        expect_error([*args, "--config", str(cfg), "--ds-config", "ds_configs/zero2.json"],
                     f"{cfg}: ript.tasks: set, but `ds-train {args[0]}` does not read ript.*")
    expect_error(["ript", "--config", str(cfg), "--ds-config", "ds_configs/zero2.json", "train.max_steps=3"],
                 "data.dir: set, but `ds-train ript` does not read data.*",
                 "override train.max_steps=3: set, but `ds-train ript` does not read train.max_steps")
    assert tree_listing(tmp_path) == before
    from ds_train.__main__ import check_command, plan_memory  # what `ds-train launch` / `slurm` check first

    for check in (check_command, plan_memory):
        with pytest.raises(UserError, match=r"ript.tasks: set, but `ds-train train` does not read ript.\*"):
            check(["train", "--config", str(cfg), "--ds-config", "ds_configs/zero2.json"], 2)
    assert tree_listing(tmp_path) == before


@pytest.mark.parametrize("recipe", sorted((ROOT / "recipes").glob("*.yaml")), ids=lambda p: p.name)
def test_each_recipe_loads_for_the_command_its_header_documents(recipe, tmp_path):
    """A recipe's header comment shows its command (deepspeed ... --module ds_train train|ript, ds-train
    estimate ...): the recipe must pass that command's check of the sections it reads."""
    import re

    header = "".join(line for line in recipe.read_text().splitlines(keepends=True) if line.startswith("#"))
    commands = set(re.findall(r"(?:ds_train|ds-train) (train|ript|estimate|prepare|dry-run|parity)\b", header))
    assert commands, f"{recipe.name}: its header names no command"
    import yaml

    model_path = (yaml.safe_load(recipe.read_text()).get("model") or {}).get("path")
    model = [f"model.path={tmp_path}"] if model_path else []  # a local model a quickstart may not have made yet
    for command in commands:
        load_config(recipe, model, command=command)


@pytest.mark.parametrize("key, tp, bound", [k for k in _numeric_fields() if k[1] in (int, float)],
                         ids=lambda x: x if isinstance(x, str) else "")
def test_a_keys_range_is_said_one_way_wherever_a_value_is_refused(key, tp, bound):
    """A key's range lives in its field's bound and is worded by out_of_range: over values across and
    at its ends, whatever refuses a value of the key alone (naming no other key) says exactly that, and
    nothing refuses a value the bound admits (no second check in a section's check() with its own words,
    "below 1" beside ">= 0")."""
    import re

    from ds_train.config.fields import in_bound, out_of_range

    others = [k for k in all_keys() if k != key]
    base = {"output_dir": "/nonexistent/run", "model": {"config": {"model_type": "llama"}}}
    probes = [-1, 0, 1, 2, 3, 10 ** 9] if tp is int else [-1.0, 0.0, 0.25, 0.5, 1.0, 1.5, 2.0, 1e9]
    for value in sorted(set(probes + [tp(v) for v in _outside(bound)])):
        raw = _nest(key, value)
        raw["model"] = {**base["model"], **raw.get("model", {})}
        try:
            build_config({**raw, "output_dir": base["output_dir"]}, source="c.yaml")
            said = []
        except UserError as e:
            said = str(e).split(": ", 1)[1]
            said = said.split(" problems: ", 1)[1] if " problems: " in said else said
            said = [p for p in said.split("; ") if p.startswith((f"{key}:", f"{key}=")) and
                    not any(re.search(rf"(?<![\w.]){re.escape(other)}(?!\w)", p) for other in others)]
        assert said == ([] if not bound or in_bound(value, bound) else [out_of_range(key, value, bound)]), \
            (value, said)


def test_a_dense_model_given_expert_parallelism_is_told_it_has_no_experts():
    from transformers import AutoConfig

    from ds_train.plan.experts import check_expert_model

    with pytest.raises(UserError, match=r"^parallel.expert=2: model type 'llama' has no experts \(a dense model"):
        check_expert_model(2, AutoConfig.for_model("llama", hidden_size=64))
