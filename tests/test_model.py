"""ds_train.model: weights from model.path are checked against the architecture config.json describes.

Real tiny Llama directories written by `save_pretrained`, then edited; built in-process without a
process group (ds_config `{}`, so not under ZeRO-3).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ds_train.config import ModelConfig
from ds_train.errors import UserError
from ds_train.model import build_hf_config, build_model, check_loading_info

TINY = dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=4, vocab_size=300, max_position_embeddings=128)
WEIGHTS = "model.safetensors"


def save_tiny(d: Path, **overrides) -> dict[str, torch.Tensor]:
    """A tiny Llama saved into `d`; returns its state dict as saved."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**{"tie_word_embeddings": False, **TINY, **overrides}))
    model.save_pretrained(d)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def edit_weights(d: Path, edit) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(d / WEIGHTS)
    edit(tensors)
    save_file(tensors, d / WEIGHTS, metadata={"format": "pt"})


def build(d: Path, **model_kw):
    cfg = ModelConfig(path=str(d), dtype="fp32", attn_implementation="eager", **model_kw)
    return build_model(cfg, build_hf_config(cfg, 300, 64), {}, 0)


def one_line_error(d: Path, **model_kw) -> str:
    with pytest.raises(UserError) as e:
        build(d, **model_kw)
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith(f"model.path {str(d)!r}: ")
    return msg


def test_a_matching_directory_loads_the_saved_weights(tmp_path):
    saved = save_tiny(tmp_path)
    built = build(tmp_path)
    assert built.new_weights == ()
    loaded = built.model.state_dict()
    assert loaded.keys() == saved.keys()
    for key, value in saved.items():
        assert torch.equal(loaded[key], value), key


def test_a_tied_head_that_was_not_saved_is_not_missing(tmp_path):
    from safetensors import safe_open

    saved = save_tiny(tmp_path, tie_word_embeddings=True)
    with safe_open(tmp_path / WEIGHTS, framework="pt") as f:
        assert "lm_head.weight" not in f.keys()  # the premise: save_pretrained drops the tied copy
    built = build(tmp_path)
    assert built.new_weights == ()
    model = built.model
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert torch.equal(model.lm_head.weight, saved["model.embed_tokens.weight"])


def test_a_missing_tensor_is_an_error_naming_it_and_the_option(tmp_path):
    save_tiny(tmp_path)
    edit_weights(tmp_path, lambda t: t.pop("model.norm.weight"))
    msg = one_line_error(tmp_path)
    assert "lack 1 tensor the llama architecture needs (model.norm.weight)" in msg
    assert "model.allow_new_weights=true" in msg


def test_allow_new_weights_initialises_and_lists_the_missing_tensor(tmp_path):
    saved = save_tiny(tmp_path)
    edit_weights(tmp_path, lambda t: t.pop("model.norm.weight"))
    built = build(tmp_path, allow_new_weights=True)
    assert built.new_weights == ("model.norm.weight",)
    loaded = built.model.state_dict()
    assert torch.equal(loaded["model.embed_tokens.weight"], saved["model.embed_tokens.weight"])
    assert torch.isfinite(loaded["model.norm.weight"]).all()  # initialised, not left empty


def test_an_unexpected_tensor_is_an_error_naming_it_even_with_allow_new_weights(tmp_path):
    save_tiny(tmp_path)
    edit_weights(tmp_path, lambda t: t.update({"model.extra_head.weight": torch.zeros(3, 64)}))
    for kw in ({}, {"allow_new_weights": True}):
        msg = one_line_error(tmp_path, **kw)
        assert "hold 1 tensor the llama architecture does not use (model.extra_head.weight)" in msg
        assert "config.json does not describe these weights" in msg


def test_a_config_json_that_disagrees_with_the_weights_shapes_is_an_error(tmp_path):
    save_tiny(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["hidden_size"] = 128  # head_dim follows hidden_size / heads, so every shape changes
    (tmp_path / "config.json").write_text(json.dumps(config))
    for kw in ({}, {"allow_new_weights": True}):
        msg = one_line_error(tmp_path, **kw)
        assert "of other shapes than the llama architecture needs (saved vs needed: " in msg
        assert "lm_head.weight [300, 64] vs [300, 128]" in msg  # weights vs config.json
        assert " more)" in msg  # many tensors: the list is cut short
        assert "model.allow_new_weights does not cover changed shapes" in msg


# --- the report itself ---------------------------------------------------------------------------

def test_long_key_lists_are_cut_to_five_and_a_count():
    info = {"missing_keys": {f"layer.{i}.weight" for i in range(8)}, "unexpected_keys": set(),
            "mismatched_keys": set()}
    with pytest.raises(UserError, match=r"lack 8 tensors .*\(layer\.0\.weight, .*, layer\.4\.weight "
                                        r"and 3 more\)"):
        check_loading_info("/x", "llama", info, allow_new_weights=False)
    assert check_loading_info("/x", "llama", info, allow_new_weights=True)[0] == "layer.0.weight"


def test_every_problem_is_reported_in_one_line():
    info = {"missing_keys": {"lm_head.weight"}, "unexpected_keys": {"head.weight"},
            "mismatched_keys": {("model.norm.weight", torch.Size([64]), torch.Size([32]))}}
    with pytest.raises(UserError) as e:
        check_loading_info("/x", "llama", info, allow_new_weights=False)
    msg = str(e.value)
    assert "\n" not in msg
    assert all(k in msg for k in ("lm_head.weight", "head.weight", "model.norm.weight [64] vs [32]"))
