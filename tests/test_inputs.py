"""ds_train.inputs: the check step reads and checks every input once, before anything is written,
the model before the data (a bad key fails in a second, preparing a corpus takes minutes)."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import ROOT, TINY_MODEL
from ds_train.configfile import build_config
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
