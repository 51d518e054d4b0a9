"""ds_train.inputs: the check step reads and checks every input once, before anything is written,
the model before the data (a bad key fails in a second, preparing a corpus takes minutes)."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import ROOT, TINY_MODEL
from ds_train.config.file import build_config
from ds_train.errors import UserError
from ds_train.inputs import check_inputs, tokenizer_dir

ZERO0 = str(ROOT / "ds_configs" / "zero0.json")


def test_a_bad_model_fails_before_the_data_is_prepared(tmp_path):
    (tmp_path / "doc.txt").write_text("some text\n" * 50)
    cfg = build_config({"model": {"config": {**TINY_MODEL, "hidden_sizee": 64}},
                        "data": {"dir": str(tmp_path / "data"), "sources": [str(tmp_path / "doc.txt")]}})
    with pytest.raises(UserError, match=r"model.config.hidden_sizee: unknown key .* \(did you mean 'hidden_size'\?\)"):
        check_inputs(cfg, ZERO0)
    assert not (tmp_path / "data").exists()
    with pytest.raises(UserError, match="nope.json: DeepSpeed JSON file not found"):  # the DeepSpeed JSON first
        check_inputs(build_config({"model": {"config": TINY_MODEL}}), str(tmp_path / "nope.json"))


def test_a_model_trained_from_scratch_takes_the_data_tokenizers_vocabulary(tiny_data, tmp_path):
    cfg = build_config({"model": {"config": TINY_MODEL}, "data": {"dir": str(tiny_data)},
                        "train": {"seq_len": 64}})
    inputs = check_inputs(cfg, ZERO0)
    assert inputs.source.hf_config.vocab_size == len(inputs.source.tokenizer) == 512
    assert inputs.source.weights is None and inputs.data.train.seq_len == 64
    assert inputs.data_id()["tokenizer"] == inputs.data_id()["tokenizer"] and "train_tokens" in inputs.data_id()
    assert inputs.template["zero_optimization"]["stage"] == 0


def test_the_tokenizer_of_the_data_is_decided_in_one_place(tiny_policy):
    cfg = build_config({"model": {"path": str(tiny_policy)}, "train": {"seq_len": 64}})
    assert tokenizer_dir(cfg, tiny_policy) == str(tiny_policy)  # the model's
    assert tokenizer_dir(build_config({"data": {"tokenizer": "/t"}, "model": {"path": str(tiny_policy)}}),
                         tiny_policy) == "/t"  # data.tokenizer first
    assert tokenizer_dir(build_config({"model": {"config": TINY_MODEL}}), None) == ""  # the BPE prepare trains
    ript = check_inputs(cfg, ZERO0, data=False)  # a run without data: the model's own tokenizer
    assert Path(ript.source.tokenizer.name_or_path) == tiny_policy and ript.data is None


def test_a_model_vocabulary_smaller_than_its_tokenizer_is_refused(tmp_path):
    """The data may use only the low ids (chat tokens added on top never occur in plain text), but
    the tokenizer can produce every one (a prompt, a sample, RIPT's rollouts): model.config.vocab_size
    below the tokenizer's size is a contradiction, found before anything is written."""
    from ds_train.data.prepare import prepare
    from ds_train.data.tokenizer import train_tokenizer

    (tmp_path / "doc.txt").write_text("def f(x):\n    return x + 1\n" * 200)
    tok = train_tokenizer([(tmp_path / "doc.txt").read_text()], 300, tmp_path / "tok")
    tok.add_special_tokens({"additional_special_tokens": ["<|user|>", "<|assistant|>"]})
    tok.save_pretrained(str(tmp_path / "tok"))
    prepare([str(tmp_path / "doc.txt")], tmp_path / "data", str(tmp_path / "tok"), val_fraction=0.1)
    base = len(tok) - 2
    cfg = build_config({"model": {"config": {**TINY_MODEL, "vocab_size": base}},
                        "data": {"dir": str(tmp_path / "data"), "tokenizer": str(tmp_path / "tok")},
                        "train": {"seq_len": 16}})
    with pytest.raises(UserError) as e:
        check_inputs(cfg, ZERO0)
    said = str(e.value)
    assert said.startswith(f"model.config.vocab_size: {base} is smaller than the tokenizer") and \
        f"({len(tok)} tokens)" in said, said


@pytest.mark.parametrize("section, value, needle", [
    ("optimizer", "AdamWW", "optimizer.type: 'AdamWW' is not an optimizer DeepSpeed knows"),
    ("scheduler", "WarmupCosine", "scheduler.type: 'WarmupCosine' is not a DeepSpeed scheduler"),
])
def test_a_deepspeed_optimizer_or_scheduler_name_it_lacks_is_refused_at_the_check(tmp_path, section, value, needle):
    import json

    ds = json.loads(Path(ZERO0).read_text())
    ds[section] = {"type": value, "params": {}}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds))
    with pytest.raises(UserError) as e:
        check_inputs(build_config({"model": {"config": TINY_MODEL}}), str(path))
    said = str(e.value)
    assert said.startswith(f"{path}: {needle}") and ("adamw" in said or "WarmupCosineLR" in said), said


@pytest.mark.parametrize("key, value", [("eos_token_id", 10_000), ("pad_token_id", -5), ("eos_token_id", [1, 999]),
                                        ("bos_token_id", 512)])
def test_a_special_token_id_outside_the_vocabulary_is_named(tiny_data, key, value):
    cfg = build_config({"model": {"config": {**TINY_MODEL, key: value}}, "data": {"dir": str(tiny_data)},
                        "train": {"seq_len": 64}})
    with pytest.raises(UserError) as e:
        check_inputs(cfg, ZERO0)
    assert str(e.value).startswith(f"model.config.{key}: ") and "0 to 511" in str(e.value), str(e.value)
