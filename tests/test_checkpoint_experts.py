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
        bias = state.pop(f"{layer}.{spec.router_name}.e_score_correction_bias", None)
        if bias is not None:  # a buffer AutoEP copies into its router (DeepSeek-V3, MiniMax-M3)
            state[f"{layer}.router.e_score_correction_bias"] = bias
    return state


def hidden_first(model) -> None:
    """The model's fused experts put in Transformers' other layout ([E, H, 2F] and [E, F, H])."""
    for module in model.modules():
        if hasattr(module, "gate_up_proj") and hasattr(module, "down_proj"):
            module.gate_up_proj = torch.nn.Parameter(module.gate_up_proj.transpose(1, 2).contiguous())
            module.down_proj = torch.nn.Parameter(module.down_proj.transpose(1, 2).contiguous())


MOE = {"qwen3_moe": dict(num_experts=4, moe_intermediate_size=16),
       "qwen2_moe": dict(num_experts=4, moe_intermediate_size=16, shared_expert_intermediate_size=16),
       "qwen3_5_moe_text": dict(num_experts=4, moe_intermediate_size=16, shared_expert_intermediate_size=16),
       "mixtral": dict(num_local_experts=4),
       "deepseek_v2": dict(n_routed_experts=4, moe_intermediate_size=16, first_k_dense_replace=1, n_group=2,
                           topk_group=1, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
                           v_head_dim=16),
       "deepseek_v3": dict(n_routed_experts=4, moe_intermediate_size=16, first_k_dense_replace=1, n_group=2,
                           topk_group=1, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
                           v_head_dim=16),
       "minimax_m3_vl_text": dict(num_local_experts=4)}


def test_every_model_type_autoeps_presets_name_is_covered():
    from deepspeed.module_inject.auto_ep_presets.registry import PRESET_MODELS

    assert sorted(MOE) == sorted(t for preset in PRESET_MODELS.values() for t in preset.hf_model_types)


@pytest.mark.parametrize("model_type, layout", [(t, "gate_up_first") for t in MOE] + [("qwen3_moe", "hidden_first")])
def test_autoep_weights_go_back_to_the_models_own_layout_exactly(model_type, layout):
    """Every preset's model type, buffers included (DeepSeek-V3's router bias, moved off zero). The
    hidden size is twice the expert width (32 and 16), where one tensor's shape cannot tell the two
    fused layouts apart."""
    config = transformers.AutoConfig.for_model(model_type, **SHAPE, **MOE[model_type])
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(config)
    for name, buffer in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buffer.copy_(torch.randn_like(buffer))
    if layout == "hidden_first":
        hidden_first(model), hidden_first(meta)
    saved = as_autoep_saves_it(model, config)
    assert any(k.endswith(".mlp.experts.w1") for k in saved) and not any(".experts.gate_up_proj" in k for k in saved)
    back = hf_layout(saved, autoep_specs(meta, config), {k: v.shape for k, v in meta.state_dict().items()})
    want = model.state_dict()
    assert sorted(back) == sorted(want)
    assert all(torch.equal(back[k], want[k]) for k in want)
    if model_type == "deepseek_v3":
        assert float(want["model.layers.1.mlp.gate.e_score_correction_bias"].abs().sum()) > 0


def test_a_checkpoint_without_autoep_experts_is_one_line():
    config = transformers.AutoConfig.for_model("qwen3_moe", **SHAPE, num_experts=4, moe_intermediate_size=16)
    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(config)
    with pytest.raises(UserError, match=r"export: the checkpoint has no AutoEP experts for model.layers.0.mlp"):
        hf_layout(dict(meta.state_dict()), autoep_specs(meta, config), {})
