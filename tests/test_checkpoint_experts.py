"""An expert-parallel checkpoint's weights in the model's own layout (ds_train/checkpoint/experts.py):
the inverse of DeepSpeed's own repacking, checked by a round trip through it for each fused layout
AutoEP's presets cover. End to end (a killed AutoEP run exported, its held-out loss the engine's):
tests/test_checkpoint.py."""

from __future__ import annotations

import pytest
import torch
import transformers

from ds_train.checkpoint.experts import autoep_specs, hf_layout
from ds_train.errors import UserError

SHAPE = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
             num_experts_per_tok=2, vocab_size=50)


def as_autoep_saves_it(model, config) -> dict:
    """The model's weights as an AutoEP run's universal checkpoint holds them: each MoE layer's experts
    repacked by DeepSpeed (deepspeed.moe.ep_repack, one expert group of all of them), its router under
    router.gate and AutoEP's alias."""
    from deepspeed.moe.ep_repack import repack_expert_weights

    state = dict(model.state_dict())
    for spec in autoep_specs(model, config):
        layer = spec.moe_module_name
        w1, w2, w3 = repack_expert_weights(model.get_submodule(f"{layer}.{spec.experts_name}"), spec, 0, 1)
        for key in [k for k in state if k.startswith(f"{layer}.{spec.experts_name}.")]:
            del state[key]
        state.update({f"{layer}.experts.w1": w1, f"{layer}.experts.w2": w2, f"{layer}.experts.w3": w3})
        gate = state.pop(f"{layer}.{spec.router_name}.weight")
        state[f"{layer}.router.gate.weight"] = state[f"{layer}.{spec.router_name}.gate.weight"] = gate
    return state


@pytest.mark.parametrize("model_type, experts", [("qwen3_moe", {"num_experts": 4, "moe_intermediate_size": 16}),
                                                 ("mixtral", {"num_local_experts": 4})])
def test_autoep_weights_go_back_to_the_models_own_layout_exactly(model_type, experts):
    config = transformers.AutoConfig.for_model(model_type, **SHAPE, **experts)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(config)
    saved = as_autoep_saves_it(model, config)
    assert "model.layers.0.mlp.experts.w1" in saved and "model.layers.0.mlp.experts.gate_up_proj" not in saved
    back = hf_layout(saved, autoep_specs(meta, config), {k: v.shape for k, v in meta.state_dict().items()})
    want = model.state_dict()
    assert sorted(back) == sorted(want)
    assert all(torch.equal(back[k], want[k]) for k in want)


def test_a_checkpoint_without_autoep_experts_is_one_line():
    config = transformers.AutoConfig.for_model("qwen3_moe", **SHAPE, num_experts=4, moe_intermediate_size=16)
    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(config)
    with pytest.raises(UserError, match=r"export: the checkpoint has no AutoEP experts for model.layers.0.mlp"):
        hf_layout(dict(meta.state_dict()), autoep_specs(meta, config), {})
