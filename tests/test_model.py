"""ds_train.model (hfconfig, weights, build): weights from model.path are checked against the architecture
config.json describes.

Real tiny Llama directories written by `save_pretrained`, then edited; built in-process without a
process group (ds_config `{}`, so not under ZeRO-3).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import ROOT, expect_error, tiny_config, tree_listing, write_config
from ds_train.config.model import ModelConfig
from ds_train.errors import UserError
from ds_train.model.build import build_model, resolve_dtype
from ds_train.model.hfconfig import build_hf_config
from ds_train.model.weights import check_loading_info


def check_model_dir(d: Path):
    """model.path checked as a run checks it: config.json, then every weights file (once)."""
    return build_hf_config(ModelConfig(path=str(d)), 0, 64)

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


NEW_HEAD_PROBE = """
import json, sys, torch, deepspeed
from ds_train import dist, topology
from ds_train.config.model import ModelConfig
from ds_train.model.build import build_model
from ds_train.model.hfconfig import build_hf_config
dist.init(topology.detect_env())
cfg = ModelConfig(path=sys.argv[1], dtype="fp32", attn_implementation="eager", allow_new_weights=True)
out = {}
for stage, other_draws in ((0, 0), (3, 7)):  # ZeRO-3 after other draws: another generator state, as a GPU's
    torch.manual_seed(other_draws)
    built = build_model(cfg, build_hf_config(cfg, 300, 64), {"zero_optimization": {"stage": stage},
                        "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1}, seed=5)
    params = dict(built.model.named_parameters())
    with deepspeed.zero.GatheredParameters([params["lm_head.weight"], params["model.norm.weight"]]):
        out[stage] = {"new": built.new_weights, "head": params["lm_head.weight"].detach().clone().tolist(),
                      "norm": params["model.norm.weight"].detach().clone().tolist(),
                      "partitioned": hasattr(params["lm_head.weight"], "ds_id")}
print(json.dumps(out))
"""


def test_a_new_head_under_zero3_starts_equal_to_zero0s(tmp_path):
    """model.allow_new_weights: transformers draws a missing head on the device its parameters live on
    (under ZeRO-3 a GPU's generator), from whatever state that generator is in. ds_train draws it again
    from the CPU generator seeded by the run's seed and the module's name (seeded_init): ZeRO-3's new
    head equals ZeRO-0's whatever was drawn before; the loaded weights of the model stay as saved. One
    process, gloo, the real zero.Init."""
    import os
    import subprocess
    import sys

    from conftest import free_port

    saved = save_tiny(tmp_path)
    edit_weights(tmp_path, lambda t: t.pop("lm_head.weight"))
    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "PYTHONPATH": str(ROOT)}
    res = subprocess.run([sys.executable, "-c", NEW_HEAD_PROBE, str(tmp_path)], capture_output=True, text=True,
                         env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    zero0, zero3 = got["0"], got["3"]
    assert zero0["new"] == zero3["new"] == ["lm_head.weight"] and zero3["partitioned"] and not zero0["partitioned"]
    assert zero3["head"] == zero0["head"]
    assert zero0["norm"] == zero3["norm"] == saved["model.norm.weight"].tolist()  # loaded: as saved


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


# --- bad input: model.config, model.dtype and model.path, one line each ---------------------------

def hf_config(**config):
    cfg = ModelConfig(config={"model_type": "llama", **TINY, **config}, dtype="fp32")
    return build_hf_config(cfg, 300, 64)


def config_error(**config) -> str:
    with pytest.raises(UserError) as e:
        hf_config(**config)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_a_misspelt_model_config_key_names_the_closest_valid_one():
    assert config_error(hidden_sizee=32) == (
        "model.config.hidden_sizee: unknown key for LlamaConfig (model_type llama), which Hugging Face would "
        "leave unused (did you mean 'hidden_size'?)")
    assert config_error(zzz=1).endswith("which Hugging Face would leave unused; remove it")


def test_valid_model_config_keys_are_accepted_also_those_transformers_converts():
    hf = hf_config(rope_theta=5e4, rope_scaling={"rope_type": "linear", "factor": 2.0}, head_dim=16,
                   tie_word_embeddings=True, rms_norm_eps=1e-5, initializer_range=0.01)
    assert hf.rope_parameters["rope_theta"] == 5e4 and hf.head_dim == 16
    gpt2 = build_hf_config(ModelConfig(config={"model_type": "gpt2", "hidden_size": 64, "n_layer": 2,
                                               "n_head": 4}), 300, 64)  # hidden_size: an alias of n_embd
    assert (gpt2.n_embd, gpt2.n_layer) == (64, 2)


def test_an_unknown_model_type_suggests_the_closest_in_a_short_line():
    with pytest.raises(UserError) as e:
        build_hf_config(ModelConfig(config={"model_type": "llamaa"}), 300, 64)
    assert str(e.value) == ("model.config.model_type: 'llamaa' is not a Hugging Face model type; did you mean "
                            "'llama' or 'mllama' or 'llama4'?")
    with pytest.raises(UserError) as e:
        build_hf_config(ModelConfig(config={"model_type": "t5"}), 300, 64)
    assert str(e.value) == ("model.config: model_type 't5' has no causal LM in transformers "
                            "(AutoModelForCausalLM); choose a decoder model type, for example llama")


def test_what_transformers_rejects_is_one_line_naming_model_config():
    assert config_error(num_attention_heads=5) == (
        "model.config: Hugging Face rejects it: The hidden size (64) is not a multiple of the number of "
        "attention heads (5); fix model.config")
    assert config_error(hidden_act="gelux") == (
        "model.config: Hugging Face cannot build the llama model from it (KeyError: 'gelux'); fix it")
    with pytest.raises(UserError, match=r"^model.attn_implementation: 'nope' cannot be used here \(Specified "
                                        r"`attn_implementation=\"nope\"` is not supported.*\); use sdpa or eager$"):
        build_hf_config(ModelConfig(config={"model_type": "llama", **TINY}, attn_implementation="nope"), 300, 64)


def test_a_precision_the_device_lacks_is_refused_when_the_dtype_is_resolved():
    with pytest.raises(UserError) as e:
        resolve_dtype("fp16", "cpu", True)
    assert str(e.value) == ("model.dtype: fp16 is not supported on the CPU (DeepSpeed's CPU accelerator has no "
                            "fp16); use model.dtype=fp32 or bf16 there (auto picks fp32)")
    with pytest.raises(UserError) as e:
        resolve_dtype("bf16", "cuda", False)
    assert str(e.value) == ("model.dtype: bf16 is not supported on this GPU; use model.dtype=fp16 or fp32 (auto "
                            "picks fp32 there)")
    assert [resolve_dtype(d, "cpu", True) for d in ("auto", "bf16", "fp32")] == ["fp32", "bf16", "fp32"]
    assert resolve_dtype("fp16", "cuda", True) == "fp16"


def test_nan_and_inf_weights_are_named_when_the_weights_are_loaded(tmp_path):
    save_tiny(tmp_path)

    def poison(tensors):
        for name in sorted(tensors)[:6]:
            tensors[name].view(-1)[0] = float("nan")
        tensors["model.norm.weight"][3] = float("inf")

    edit_weights(tmp_path, poison)
    assert one_line_error(tmp_path) == (
        f"model.path '{tmp_path}': 7 tensors hold NaN or inf values (lm_head.weight, model.embed_tokens.weight, "
        f"model.layers.0.input_layernorm.weight, model.layers.0.mlp.down_proj.weight, "
        f"model.layers.0.mlp.gate_proj.weight and 2 more); the weights are damaged: re-export or re-download "
        f"the model directory")


@pytest.mark.parametrize("damage, problem", [
    (lambda f: f.write_bytes(f.read_bytes()[:5000]),
     "is not a whole weights file (Error while deserializing header: incomplete metadata, file not fully covered)"),
    (lambda f: f.write_bytes(bytes(range(256)) * 40),
     "is not a whole weights file (Error while deserializing header: header too large)"),
    (lambda f: f.write_bytes(b""),
     "(empty) is not a whole weights file (Error while deserializing header: header too small)"),
])
def test_a_damaged_weights_file_names_it_and_the_fix(tmp_path, damage, problem):
    save_tiny(tmp_path)
    damage(tmp_path / WEIGHTS)
    with pytest.raises(UserError) as e:
        check_model_dir(tmp_path)
    assert str(e.value) == (f"model.path: '{tmp_path / WEIGHTS}' {problem}; re-export or re-download the "
                            f"model directory")


def test_missing_weights_and_shards_name_the_directory_and_the_fix(tmp_path):
    save_tiny(tmp_path)
    (tmp_path / WEIGHTS).unlink()
    with pytest.raises(UserError) as e:
        check_model_dir(tmp_path)
    assert str(e.value) == (f"model.path: '{tmp_path}' holds no weights (model.safetensors, "
                            f"model.safetensors.index.json and its shards, or pytorch_model.bin); re-export or "
                            f"re-download the model directory")
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(UserError) as e:
        check_model_dir(tmp_path)
    assert str(e.value) == (f"model.path: '{tmp_path / 'model.safetensors.index.json'}' names "
                            f"model-00001-of-00002.safetensors, model-00002-of-00002.safetensors, which are not in "
                            f"'{tmp_path}'; re-export or re-download the model directory")


def test_loading_weights_prints_no_progress_bar(tmp_path, capfd):
    save_tiny(tmp_path)
    capfd.readouterr()
    build(tmp_path)
    assert "Loading weights" not in capfd.readouterr().err


def test_damaged_weights_on_the_command_line_are_one_line_and_write_nothing(tiny_data, tmp_path):
    model_dir = tmp_path / "model"
    save_tiny(model_dir)
    (model_dir / WEIGHTS).write_bytes((model_dir / WEIGHTS).read_bytes()[:5000])
    cfg = write_config(tmp_path / "c.yaml", tiny_config(tiny_data, tmp_path / "run",
                                                        model={"config": {}, "path": str(model_dir)}))
    before = tree_listing(tmp_path)
    expect_error(["train", "--config", str(cfg), "--ds-config", str(ROOT / "ds_configs" / "zero0.json")],
                 f"model.path: '{model_dir / WEIGHTS}' is not a whole weights file", "re-download")
    assert tree_listing(tmp_path) == before


# --- model.config checked the way the architecture will use it (a forward pass on the meta device) --

@pytest.mark.parametrize("model_type, given, keys", [
    ("llama", {"num_key_value_heads": 3}, ("model.config.num_attention_heads=4", "num_key_value_heads=3")),
    ("mistral", {"num_key_value_heads": 3}, ("model.config.num_attention_heads=4", "num_key_value_heads=3")),
    ("qwen2", {"num_key_value_heads": 3}, ("model.config.num_attention_heads=4", "num_key_value_heads=3")),
])
def test_sizes_that_contradict_each_other_fail_before_anything_is_written(model_type, given, keys):
    with pytest.raises(UserError) as e:
        build_hf_config(ModelConfig(config={**TINY, "model_type": model_type, **given}), 300, 64)
    said = str(e.value)
    assert said.startswith("model.config: ") and "\n" not in said, said
    for key in keys:
        assert key in said, said


@pytest.mark.parametrize("given, key", [({"intermediate_size": 0}, "model.config.intermediate_size: 0"),
                                        ({"num_key_value_heads": 0}, "model.config.num_key_value_heads: 0"),
                                        ({"head_dim": -2}, "model.config.head_dim: -2")])
def test_a_size_that_is_not_positive_is_named(given, key):
    with pytest.raises(UserError) as e:
        build_hf_config(ModelConfig(config={**TINY, "model_type": "llama", **given}), 300, 64)
    assert str(e.value).startswith(key) and "must be positive" in str(e.value), str(e.value)


def test_consistent_configs_of_several_architectures_pass_the_forward_check():
    for model_type, extra in (("llama", {"head_dim": 24}), ("mixtral", {"num_local_experts": 4}),
                              ("qwen3", {}), ("gemma", {}), ("gpt2", {})):
        cfg = ({"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4} if model_type == "gpt2"
               else {**TINY, "model_type": model_type, **extra})
        built = build_hf_config(ModelConfig(config=cfg), 300, 64)  # no false refusal: it builds
        assert built.model_type == model_type and built.vocab_size == 300, (model_type, built)


def test_a_large_mixture_of_experts_passes_the_forward_check_on_the_meta_device():
    """Qwen3-30B-A3B's shape (too large to confirm on a real model): the meta device's kernel for the experts'
    grouped matmul takes bf16 only, so a dtype error there is a kernel's limit, not contradicting sizes:
    checked in bf16 instead (it was refused: "Expected inputs of BF16 type")."""
    cfg = {"model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
           "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "num_experts": 128,
           "num_experts_per_tok": 8, "vocab_size": 151936, "max_position_embeddings": 40960}
    assert build_hf_config(ModelConfig(config=cfg), 300, 64).num_experts == 128
    with pytest.raises(UserError, match="num_attention_heads=30, num_key_value_heads=4: the attention heads must be "
                                        "a multiple of the key-value heads"):  # contradicting sizes still are refused
        build_hf_config(ModelConfig(config={**cfg, "num_attention_heads": 30}), 300, 64)


def test_contradicting_sizes_on_the_command_line_are_one_line_and_write_nothing(tiny_data, tmp_path):
    cfg = write_config(tmp_path / "c.yaml", tiny_config(tiny_data, tmp_path / "run"))
    before = tree_listing(tmp_path)
    expect_error(["train", "--config", str(cfg), "--ds-config", str(ROOT / "ds_configs" / "zero0.json"),
                  "model.config.num_key_value_heads=3"], "model.config: ", "num_key_value_heads=3")
    assert tree_listing(tmp_path) == before


def test_the_tiled_loss_is_the_full_logits_loss_in_tiles():
    """train.loss_tile_tokens: the summed loss and every gradient as with the full logits (within
    1e-5), the head's logits never whole; a model that soft-caps its logits keeps the full path."""
    import numpy as np
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from ds_train.data.examples import Batch
    from ds_train.train.losses import forward_loss, tiles

    cfg = AutoConfig.for_model("llama", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=4, vocab_size=300, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    rng = np.random.default_rng(0)
    targets = rng.integers(0, 300, (2, 40))
    targets[0, :7] = -100  # targets only where there is a loss, as sft batches have
    batch = Batch(rng.integers(0, 300, (2, 40)), targets, None)
    grads = []
    for tile, fused in ((0, False), (16, False), (16, True)):  # 80 tokens: 5 tiles, the last one short
        model.zero_grad()
        loss, count = forward_loss(model, batch, tile, fused)
        loss.backward()
        grads.append((float(loss.detach()), count, {n: p.grad.clone() for n, p in model.named_parameters()}))
    (full, n_full, g_full), *tiled_runs = grads
    for tiled, n_tiled, g_tiled in tiled_runs:  # recomputed, then fused
        assert n_full == n_tiled == 73 and abs(tiled - full) <= 1e-5 * abs(full)
        for name, g in g_full.items():  # against the tensor's scale: an element near 0 carries fp32 summation order
            assert float((g_tiled[name] - g).abs().max()) <= 1e-5 * float(g.abs().max()), name
    assert "forward" not in vars(model.get_output_embeddings())  # the head is itself again
    with torch.no_grad():  # evaluation: the fused loss alone, no gradient made
        model.zero_grad()
        loss, _ = forward_loss(model, batch, 16, True)
    assert abs(float(loss) - full) <= 1e-5 * abs(full) and all(p.grad is None for p in model.parameters())
    assert tiles(80, 16) and not tiles(16, 16) and not tiles(80, 0)  # a soft-capping model: tests/test_probe.py


def test_sdpa_over_packed_examples_under_ulysses_is_the_block_causal_mask():
    """ds_train/model/ulysses.py's `documents`: the gathered sequence's examples (position ids
    restarting at 0) each attend causally to their own tokens: the output and the gradients are
    those of sdpa with the block-diagonal causal mask an unsharded packed run builds."""
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from ds_train.model.ulysses import documents

    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = 2, True  # 4 query heads on 2 key/value heads
    torch.manual_seed(0)
    q = torch.randn(2, 4, 12, 8, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, 2, 12, 8, dtype=torch.float64, requires_grad=True) for _ in range(2))
    positions = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3], list(range(12))])
    doc = torch.cumsum(positions == 0, dim=1)
    causal = torch.tril(torch.ones(12, 12, dtype=torch.bool))
    mask = (doc[:, :, None] == doc[:, None, :]) & causal  # [batch, query, key]
    outs = []
    for attend in (lambda: documents(sdpa_attention_forward)(module, q, k, v, None, position_ids=positions),
                   lambda: sdpa_attention_forward(module, q, k, v, mask[:, None], position_ids=positions)):
        out, _ = attend()
        out.pow(2).sum().backward()
        outs.append((out.detach().clone(), *(t.grad.clone() for t in (q, k, v))))
        for t in (q, k, v):
            t.grad = None
    for got, want in zip(*outs):
        assert got.shape == want.shape and torch.allclose(got, want, atol=1e-12)
    one, _ = documents(sdpa_attention_forward)(module, q, k, v, None, position_ids=positions[1:])
    assert torch.allclose(one, sdpa_attention_forward(module, q, k, v, None)[0])  # one example: sdpa as it is


def test_the_tiled_mlp_is_the_mlp_in_tiles():
    """train.mlp_tile_positions: every decoder layer's MLP runs a tile at a time (DeepSpeed's TiledMLP),
    with and without activation checkpointing: the loss and every gradient as untiled (within
    1e-5); a sequence within one tile, or 0, leaves the model as it is; an MLP with dropout is
    left whole and said."""
    import numpy as np
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from ds_train.train.losses import forward_loss
    from ds_train.model.build import checkpoint_activations
    from ds_train.model.tiled_mlp import tiled_mlps

    cfg = AutoConfig.for_model("llama", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=4, vocab_size=300)
    batch = np.random.default_rng(0).integers(0, 300, (2, 41))
    for checkpointing in (False, True):
        grads = []
        for tile in (0, 16):  # 40 positions a sequence: 3 tiles of 14, 14 and 12 positions
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(cfg)
            if checkpointing:
                checkpoint_activations(model)
            assert tiled_mlps(model, tile, 40) == ((["LlamaMLP"], []) if tile else ([], []))
            loss, _ = forward_loss(model, batch)
            loss.backward()
            grads.append((float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters()}))
        assert "forward" in vars(model.model.layers[1].mlp)
        (full, g_full), (tiled, g_tiled) = grads
        assert abs(tiled - full) <= 1e-5 * abs(full)
        for name, g in g_full.items():
            assert torch.allclose(g_tiled[name], g, rtol=1e-5, atol=1e-7), (checkpointing, name)
    model = AutoModelForCausalLM.from_config(cfg)
    assert tiled_mlps(model, 40, 40) == ([], []) and "forward" not in vars(model.model.layers[0].mlp)
    gpt2 = AutoModelForCausalLM.from_config(AutoConfig.for_model("gpt2", n_embd=32, n_layer=1, n_head=4))
    assert tiled_mlps(gpt2, 16, 40) == ([], ["GPT2MLP (dropout p=0.1 would differ in the recomputation)"])


def test_from_scratch_weights_depend_on_the_seed_alone_and_leave_the_callers_rng_as_it_was(tmp_path):
    """The default generator seeded otherwise and consumed before the build changes nothing; the
    caller's RNG state is the same after the build as before it."""
    def weights(caller_seed: int, draws: int) -> dict[str, torch.Tensor]:
        torch.manual_seed(caller_seed)
        torch.rand(draws)
        before = torch.get_rng_state()
        cfg = ModelConfig(config={"model_type": "llama", **TINY})
        built = build_model(cfg, build_hf_config(cfg, 300, 64), {}, seed=7)
        assert torch.equal(torch.get_rng_state(), before)
        return {k: v.clone() for k, v in built.model.state_dict().items()}

    a, b = weights(1, 0), weights(2, 12345)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    other = ModelConfig(config={"model_type": "llama", **TINY})
    c = build_model(other, build_hf_config(other, 300, 64), {}, seed=8).model.state_dict()
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])


def test_a_bf16_run_builds_in_bf16_exactly_what_the_engine_made_of_the_fp32_build(tmp_path):
    """The model is built in the dtype it trains in (no fp32 copy in host memory): from scratch and
    from a checkpoint (fp32 on disk) it is bitwise the fp32 build cast to bf16, which is what
    DeepSpeed's engine made of the fp32 build before, buffers included."""
    from transformers import AutoModelForCausalLM

    from ds_train.model.build import training_dtype

    bf16 = {"bf16": {"enabled": True}, "zero_optimization": {"stage": 2}}
    assert training_dtype(bf16) == torch.bfloat16 and training_dtype({"fp16": {"enabled": True}}) == torch.float16
    assert training_dtype({"bf16": {"enabled": False}}) == training_dtype({}) == torch.float32
    scratch = ModelConfig(config={"model_type": "llama", **TINY})
    hf = build_hf_config(scratch, 300, 64)
    AutoModelForCausalLM.from_config(hf).save_pretrained(tmp_path / "ckpt")
    for cfg in (scratch, ModelConfig(path=str(tmp_path / "ckpt"))):
        model = build_model(cfg, hf, bf16, seed=7).model
        cast = build_model(cfg, hf, {}, seed=7).model.to(torch.bfloat16)
        assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
        mine, theirs = model.state_dict(), cast.state_dict()
        assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k].to(mine[k].dtype)) for k in mine)


def test_seeded_init_draws_on_cpu_copies_wherever_the_parameters_live():
    """A ZeRO-3 parameter is gathered on its device; the draws must still come from the CPU generator
    (a GPU's gives another sequence for the same seed). Parameters on the meta device stand in for a
    device here: every module's parameters reach `_init_weights` on the CPU, and end where they were."""
    from transformers import AutoModelForCausalLM

    from ds_train.model.build import seeded_init

    cfg = ModelConfig(config={"model_type": "llama", **TINY})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(build_hf_config(cfg, 300, 64))
    seen = []
    init = model._init_weights
    model._init_weights = lambda module: (seen.extend(p.device.type for p in module.parameters(recurse=False)),
                                          init(module))
    seeded_init(model, 0, zero3=False)
    assert seen and set(seen) == {"cpu"}
    assert {p.device.type for p in model.parameters()} == {"meta"}


def _tiled_against_full(model, vocab: int, factor: float = 1.0) -> None:
    """forward_loss with tiles of 16 tokens (the head's output times `factor`: the start-up probe's head
    factor) against the full logits: loss and every gradient of what trains within 1e-6 relative (fp32)."""
    import numpy as np

    from ds_train.data.examples import Batch
    from ds_train.train.losses import forward_loss

    rng = np.random.default_rng(0)
    batch = Batch(rng.integers(0, vocab, (2, 40)), rng.integers(0, vocab, (2, 40)), None)
    runs = []
    for tile, fused in ((0, False), (16, False), (16, True)):
        model.zero_grad()
        loss, _ = forward_loss(model, batch, tile, fused, factor)
        loss.backward()
        runs.append((float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters()
                                            if p.grad is not None}))
    (full, g_full), *tiled_runs = runs
    for tiled, g_tiled in tiled_runs:  # recomputed, then fused where the head is a plain Linear
        assert abs(tiled - full) <= 1e-6 * abs(full), (tiled, full)
        assert g_full.keys() == g_tiled.keys() and g_full
        for name, g in g_full.items():
            assert float((g_tiled[name] - g).abs().max()) <= 1e-6 * max(float(g.abs().max()), 1e-30), name


@pytest.mark.parametrize("model_type, scale, factor", [("granite", {"logits_scaling": 4.0}, 0.25),
                                                       ("cohere", {"logit_scale": 0.0625}, 0.0625)])
def test_the_tiled_loss_applies_the_models_scaling_after_the_head(model_type, scale, factor):
    """Granite divides the head's output by logits_scaling, Cohere multiplies it by logit_scale: the
    start-up probe measures that factor (no list of model types), and the tiles apply it (before, a
    Granite run's tiled loss was 4x too small: 2.084 against 8.318)."""
    import numpy as np
    from transformers import AutoConfig, AutoModelForCausalLM

    from ds_train.train.losses import tiles
    from ds_train.train.probe import head_factor

    def build(hidden: int):
        cfg = AutoConfig.for_model(model_type, hidden_size=hidden, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=4, vocab_size=300, **scale)
        return AutoModelForCausalLM.from_config(cfg)

    torch.manual_seed(0)
    model = build(32)
    ids = np.random.default_rng(0).integers(0, 300, (2, 17))
    assert tiles(80, 16) and head_factor(model, ids, lambda: build(64)) == (pytest.approx(factor, rel=1e-6), "")
    _tiled_against_full(model, 300, factor)


def test_the_tiled_loss_goes_through_a_lora_head():
    """LoRA on the output head: the tiles run the adapted head (the adapters' gradients equal the full
    logits' ones), not the frozen base weight."""
    import peft
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("llama", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=4, vocab_size=300, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = peft.get_peft_model(AutoModelForCausalLM.from_config(cfg),
                                peft.LoraConfig(r=4, target_modules=["q_proj", "lm_head"], init_lora_weights=False))
    assert any("lm_head.lora_B" in n for n, p in model.named_parameters() if p.requires_grad)
    _tiled_against_full(model, 300)


def test_the_fused_loss_takes_a_heads_bias_and_a_frozen_head():
    """train.fused_loss: a head with a bias gets the bias's gradient too; a frozen head (LoRA elsewhere)
    gets none made, only its input's; a LoRA-adapted head is not a plain Linear and is recomputed."""
    import peft
    from transformers import AutoConfig, AutoModelForCausalLM

    from ds_train.train.losses import fuses

    cfg = AutoConfig.for_model("llama", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=4, vocab_size=300, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    model.lm_head = torch.nn.Linear(32, 300, bias=True)
    _tiled_against_full(model, 300)
    assert model.lm_head.bias.grad is not None and float(model.lm_head.bias.grad.abs().sum()) > 0
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights=False))
    head = lora.get_output_embeddings()
    assert fuses(head) and not head.weight.requires_grad
    _tiled_against_full(lora, 300)
    assert head.weight.grad is None
    adapted = peft.get_peft_model(AutoModelForCausalLM.from_config(cfg),
                                  peft.LoraConfig(r=4, target_modules=["lm_head"]))
    assert not fuses(adapted.get_output_embeddings())


def test_liger_kernels_patch_a_llama_on_a_gpu_and_say_why_not_elsewhere():
    """model.liger_kernels: off a CUDA device nothing is patched and one line says so; on one, Liger
    patches each RMSNorm and MLP instance, or (not installed) one line says how to install it."""
    import importlib.util

    from transformers import AutoConfig, AutoModelForCausalLM

    from ds_train.model.kernels import apply_liger

    cfg = AutoConfig.for_model("llama", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=4, vocab_size=300)
    model = AutoModelForCausalLM.from_config(cfg)
    done, said = apply_liger(model, "cpu")
    assert not done and said.endswith("this run is on cpu; it goes on without them")
    assert "forward" not in vars(model.model.norm) and "forward" not in vars(model.model.layers[0].mlp)
    done, said = apply_liger(model, "cuda")  # patching needs no GPU; Liger's kernels would
    if importlib.util.find_spec("liger_kernel") is None:
        assert not done and "`pip install liger-kernel`, or set model.liger_kernels=false" in said
    else:
        assert done and said.endswith("kernels on llama") and "forward" in vars(model.model.layers[0].mlp)


def test_model_compile_compiles_each_decoder_layer_once_and_leaves_the_loss_eager():
    """model.compile: each decoder layer is compiled (one graph for all of them), the tiled loss stays
    eager, so micro-batch after micro-batch nothing compiles again (a whole-model compile did: the
    head's forward is the tiled loss for one forward at a time), and the loss is the eager one."""
    import numpy as np
    import torch._dynamo
    from transformers import AutoConfig, AutoModelForCausalLM

    from ds_train.train.losses import forward_loss
    from ds_train.model.kernels import compile_layers

    cfg = AutoConfig.for_model("llama", hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                               num_attention_heads=4, vocab_size=300)
    torch.manual_seed(0)
    eager = AutoModelForCausalLM.from_config(cfg)
    compiled = AutoModelForCausalLM.from_config(cfg)
    compiled.load_state_dict(eager.state_dict())
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()  # dynamo's counters outlive reset(): this test's graphs alone
    assert compile_layers(compiled, "eager") == (3, "LlamaDecoderLayer")
    rng = np.random.default_rng(0)
    for _ in range(4):
        batch = rng.integers(0, 300, (2, 41))
        (a, _), (b, _) = forward_loss(eager, batch, 32), forward_loss(compiled, batch, 32)
        assert abs(float(a) - float(b)) <= 1e-5 * abs(float(a))
        b.backward()
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    assert all(p.grad is not None for p in compiled.parameters())


def test_model_compile_auto_compiles_on_a_cuda_gpu_alone(tmp_path):
    """model.compile: auto is on where the device is CUDA (where the H100 lease measured 1.39x eager) and
    off elsewhere; true and false are what they say anywhere."""
    from ds_train.config.file import build_config
    from ds_train.model.kernels import compiles

    def cfg(**model):
        return build_config({"output_dir": "/nonexistent/run", "model": {"config": {"model_type": "llama"}, **model}},
                            source="x")

    assert compiles(cfg(), "cuda") and not compiles(cfg(), "cpu") and not compiles(cfg(), "xpu")
    assert compiles(cfg(compile=True), "cpu") and not compiles(cfg(compile=False), "cuda")
    # Liger's kernels inside compiled layers crashed on an H200 (2026-11-28): auto leaves them eager there,
    # true with them is refused when the config loads, and the plan counts the layers as what runs
    assert not compiles(cfg(liger_kernels=True), "cuda")
    from ds_train.plan.planner import fused_kernels

    base = {"output_dir": "/nonexistent/run", "model": {"config": {"model_type": "llama"}}}
    liger = build_config({**base, "model": {**base["model"], "liger_kernels": True}}, source="x")
    assert fused_kernels(liger) == ["Liger's kernels (model.liger_kernels)"]
    assert fused_kernels(build_config(base, source="x")) == ["compiled (model.compile)"]
    both = tmp_path / "both.yaml"
    both.write_text(json.dumps({**base, "model": {**base["model"], "liger_kernels": True, "compile": True}}))
    expect_error(["estimate", "--config", str(both), "--ds-config", str(ROOT / "ds_configs" / "zero2.json"),
                  "--nodes", "1", "--gpus-per-node", "1"],
                 "model.compile=true with model.liger_kernels=true: Liger's Triton kernels inside compiled layers "
                 "failed on a GPU")


def _drawn_twice(hf, dtype, seed: int):
    """The construction every from-scratch run made before the start-up fix: transformers' own draws
    and initialisation pass, then seeded_init over them."""
    from transformers import AutoModelForCausalLM

    from ds_train.model.build import seeded_init

    with torch.random.fork_rng(devices=[]):
        model = AutoModelForCausalLM.from_config(hf, dtype=dtype)
    assert seeded_init(model, seed, zero3=False) == []
    return model


@pytest.mark.parametrize("model_type, extra", [("llama", {}), ("qwen2", {}), ("gemma", {"head_dim": 16}),
                                               ("gpt2", {}), ("olmo2", {}), ("phi3", {"pad_token_id": 0})])
def test_from_scratch_skips_constructions_draws_and_gives_the_same_weights(model_type, extra):
    """A model from its config is built without torch.nn.init's draws and transformers' initialisation
    pass (built_unset), then drawn once by seeded_init: every weight and buffer equal to the old
    construction's (draws, the pass, then seeded_init over them), in fp32 and bf16; tied weights stay
    tied. The start-up fix of the GPU issue: on the ~1.1B Llama it halved the model's build (35.6 s to
    17.5 s on this 2-core VM)."""
    from transformers import AutoConfig

    from ds_train.model.build import from_scratch

    if model_type == "gpt2":
        hf = AutoConfig.for_model("gpt2", n_embd=64, n_layer=2, n_head=4, vocab_size=300, n_positions=128,
                                  bos_token_id=0, eos_token_id=0)
    else:
        hf = AutoConfig.for_model(model_type, **{**TINY, "num_key_value_heads": 2, **extra})
    for dtype in (torch.float32, torch.bfloat16):
        model, constructed = from_scratch(hf, 7, False, dtype=dtype)
        old = _drawn_twice(hf, dtype, 7)
        mine, theirs = model.state_dict(), old.state_dict()
        assert constructed == () and mine.keys() == theirs.keys()
        differ = [k for k in mine if not torch.equal(mine[k], theirs[k])]
        assert not differ, differ
        assert all(torch.isfinite(b).all() for b in model.buffers() if b.is_floating_point())
        tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
        assert tied == (old.get_output_embeddings().weight is old.get_input_embeddings().weight)
    assert torch.nn.init.normal_.__module__ == "torch.nn.init"  # construction's draws are back after the build


def test_a_weight_the_models_init_leaves_alone_keeps_its_constructors_value():
    """A model whose `_init_weights` does not reach one parameter (here a Llama whose init skips its
    head): what seeded_init leaves NaN names it, and the model is built again with construction's
    draws, so the head holds its constructor's values, as transformers gives them, and every other
    weight is the seeded one."""
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    from ds_train.model.build import from_scratch

    class HeadlessInitConfig(LlamaConfig):
        model_type = "ds_train_headless_init"

    class HeadlessInitLlama(LlamaForCausalLM):
        config_class = HeadlessInitConfig

        def _init_weights(self, module):
            if module is not self.lm_head:
                super()._init_weights(module)

    AutoConfig.register(HeadlessInitConfig.model_type, HeadlessInitConfig, exist_ok=True)
    AutoModelForCausalLM.register(HeadlessInitConfig, HeadlessInitLlama, exist_ok=True)
    hf = HeadlessInitConfig(**{**TINY, "tie_word_embeddings": False})
    torch.manual_seed(3)
    model, constructed = from_scratch(hf, 7, False, dtype=torch.bfloat16)
    assert constructed == ("lm_head.weight",)
    head = model.lm_head.weight
    assert torch.isfinite(head).all() and float(head.float().std()) > 0
    torch.manual_seed(3)
    with torch.random.fork_rng(devices=[]):
        reference = AutoModelForCausalLM.from_config(hf, dtype=torch.bfloat16)  # construction's own draws
    assert torch.equal(head, reference.lm_head.weight)
    other = _drawn_twice(LlamaConfig(**{**TINY, "tie_word_embeddings": False}), torch.bfloat16, 7)
    theirs = other.state_dict()
    assert all(torch.equal(v, theirs[k]) for k, v in model.state_dict().items() if k != "lm_head.weight")


def test_a_key_the_model_reads_is_accepted_though_its_config_class_does_not_declare_it():
    """Qwen3-MoE's attention reads head_dim with getattr (its config class does not declare it): "unused" is
    what the model does not read when built and run on the meta device, so head_dim=128 (the real
    Qwen3-30B-A3B's, as recipes/qwen3_30b_a3b.yaml says) is accepted and widens the attention the plan
    counts; a misspelt key is still refused, pointed at the key the model reads."""
    from ds_train.config.file import load_config
    from ds_train.plan.memory import model_shape

    recipe = load_config(str(ROOT / "recipes" / "qwen3_30b_a3b.yaml"), [])
    assert recipe.model.config["head_dim"] == 128
    small = {"model_type": "qwen3_moe", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
             "num_hidden_layers": 2, "intermediate_size": 64, "moe_intermediate_size": 32, "num_experts": 4,
             "num_experts_per_tok": 2}
    counts = [model_shape(build_hf_config(ModelConfig(config={**small, **extra}), 300, 64)).n_params
              for extra in ({}, {"head_dim": 32})]
    assert counts[1] - counts[0] == 2 * (64 * 16 * (4 + 2 + 2 + 4) + 2 * 16)  # 2 layers: q, k, v, o; q/k norms 16 wider
    with pytest.raises(UserError, match=r"^model.config.head_dimm: unknown key for Qwen3MoeConfig \(model_type "
                                        r"qwen3_moe\), which Hugging Face would leave unused \(did you mean "
                                        r"'head_dim'\?\)$"):
        build_hf_config(ModelConfig(config={**small, "head_dimm": 32}), 300, 64)


def test_a_default_padding_id_outside_the_vocabulary_ds_train_gives_is_one_line_before_the_build():
    """Phi-3's default pad_token_id 32000 under a 512-token tokenizer (a model trained from scratch) or a
    model.config.vocab_size of 512: one line naming the id, where it comes from and the fix, before the model
    is built (it was nn.Embedding's AssertionError 'Padding_idx must be within num_embeddings', a traceback, at
    the meta build of build_hf_config). A vocabulary that holds it builds."""
    from ds_train.model.hfconfig import with_vocab

    phi3 = {"model_type": "phi3", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 4}
    line = ("model.config: the phi3 model type's default pad_token_id 32000 is not a token id of the vocabulary "
            "(0 to 511, {}), so its embedding cannot be built; set model.config.pad_token_id to an id in that range, "
            "or null")
    scratch = ModelConfig(config=phi3)
    hf = build_hf_config(scratch, 512, 64)  # the tokenizer's size is not known yet: the build is checked alone
    with pytest.raises(UserError) as e:
        with_vocab(hf, scratch, 512)
    assert str(e.value) == line.format("the tokenizer's size")
    with pytest.raises(UserError) as e:
        build_hf_config(ModelConfig(config={**phi3, "vocab_size": 512}), 512, 64)
    assert str(e.value) == line.format("model.config.vocab_size")
    assert with_vocab(build_hf_config(scratch, 512, 64), scratch, 32064).vocab_size == 32064
