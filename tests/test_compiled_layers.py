"""Compiled layers (model.compile=true: torch.compile of each decoder layer, inductor on this CPU) beyond
one-GPU ZeRO-2 pretraining, each against the model's own eager forward: `ds-train parity`'s reference
runs eager (ds_train/parity), so a compiled layout passes only at the fp32 tolerances (loss 1e-5,
gradient norm 1e-4, relative). AutoTP and activation checkpointing, LoRA with DPO, QLoRA, and RIPT's
update; under AutoEP compiled layers are refused in one line (tests/test_experts.py), and `auto` leaves
them eager there, as the memory plan counts them (tests/test_memory.py)."""

from __future__ import annotations

import json

import pytest

from conftest import ROOT, ds_train, tiny_config, write_config
from ds_train.config.file import build_config
from ds_train.config.model import EXPERTS_EAGER, QUANTISED_EAGER, eager_layers
from ds_train.errors import UserError
from ds_train.model.kernels import compiles
from ds_train.plan.experts import check_expert_run
from ds_train.plan.planner import fused_kernels
from test_lora import base  # noqa: F401  (fixture)
from test_preference import pref_base, pref_data  # noqa: F401  (fixtures)

STAGES = {s: str(ROOT / "ds_configs" / f"zero{s}.json") for s in range(4)}


def compiled_parity(cfg, out, *args: str, n: int) -> str:
    """`ds-train parity` of the config's layouts with compiled layers: every one PASSes against the eager
    reference, each rank of each layout compiled its layers, the reference did not."""
    res = ds_train("parity", "--config", str(cfg), "--steps", "3", "--out", str(out), *args, "model.compile=true",
                   timeout=900)
    assert res.returncode == 0, res.out[-6000:]
    assert f"verdict: PASS: {n} of {n} layout(s) within tolerance of the reference over 3 steps" in res.out
    assert "model.compile" not in (out / "reference" / "logs" / "rank_0.log").read_text()
    runs = [json.loads((out / "parity.json").read_text())["layouts"]][0]
    assert len(runs) == n
    for name in runs:
        for log in (out / name / "logs").glob("rank_*.log"):
            said = log.read_text()
            assert "model.compile: torch.compile(backend='inductor') on 2 LlamaDecoderLayer module(s)" in said, log
            assert "start-up probe: compiled layers against llama's own forward in fp32: 1 of 1 match" in said, log
    return res.out


@pytest.mark.slow
def test_compiled_layers_under_autotp_and_activation_checkpointing_keep_the_math(tiny_data, tmp_path):
    """ZeRO-2 on 2 processes, data 2 and AutoTP 2, activation checkpointing on (the compiled layer runs
    again in the backward's recomputation)."""
    cfg = write_config(tmp_path / "c.yaml", tiny_config(tiny_data, tmp_path / "unused",
                                                        model={"activation_checkpointing": True}))
    out = compiled_parity(cfg, tmp_path / "parity", "--ds-config", STAGES[2], "--nproc", "2", "--tensor", "1", "2",
                          n=2)
    assert "zero2_np2_tp2_accum4: ZeRO-2, fp32, 2 process(es), tensor parallel 2" in out


@pytest.mark.slow
def test_compiled_layers_under_lora_with_dpo_keep_the_math(pref_data, pref_base, tmp_path):  # noqa: F811
    """LoRA (rank 4, every linear layer of the attention and MLP) on a base, DPO with its live reference
    (the base with the adapters off, compiled too), ZeRO-2 and ZeRO-3 on 2 processes."""
    cfg = write_config(tmp_path / "c.yaml", tiny_config(
        pref_data, tmp_path / "unused", data={"dir": str(pref_data), "format": "preference"},
        model={"path": str(pref_base), "config": {}, "lora": {"rank": 4, "alpha": 8}},
        optim={"lr": 3e-3, "warmup_steps": 0}, dpo={"beta": 0.2}))
    out = compiled_parity(cfg, tmp_path / "parity", "--ds-config", STAGES[2], STAGES[3], "--nproc", "2", n=2)
    assert "zero3_np2_accum2: ZeRO-3, fp32, 2 process(es)" in out


@pytest.mark.slow
def test_compiled_layers_on_a_quantised_base_are_refused_where_they_differ(tiny_data, base, tmp_path):  # noqa: F811
    """QLoRA (a 4-bit NF4 base through bitsandbytes' CPU backend, an MLP width its kernels take): eager,
    2 processes of ZeRO-2 match the one-process reference (gradient norm within 4e-8, measured); compiled,
    they did not (2e-5 at the first step, 4e-4 by the third: 2026-11-29). So model.compile=true is
    refused with a quantised base in one line before anything is written, and auto leaves the layers
    eager there, on a GPU too, as the plan counts them."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    quantisable = tmp_path / "base"
    torch.manual_seed(0)
    hf = AutoConfig.from_pretrained(base)
    hf.intermediate_size = 128
    AutoModelForCausalLM.from_config(hf).save_pretrained(quantisable)
    AutoTokenizer.from_pretrained(base).save_pretrained(quantisable)
    raw = tiny_config(tiny_data, tmp_path / "unused", optim={"lr": 3e-3, "warmup_steps": 0},
                      model={"path": str(quantisable), "config": {},
                             "lora": {"rank": 4, "load_in": "4bit", "target_modules": ["q_proj", "v_proj", "gate_proj"]}})
    cfg = write_config(tmp_path / "c.yaml", raw)
    out = tmp_path / "parity"
    res = ds_train("parity", "--config", str(cfg), "--steps", "3", "--out", str(out), "--ds-config", STAGES[2],
                   "--nproc", "2", "model.compile=true")
    assert res.returncode == 2 and res.out.strip().splitlines()[-1] == (
        f"ds-train: error: {cfg}: model.compile=true with model.lora.load_in=4bit: {QUANTISED_EAGER}; leave model.compile "
        f"at auto (eager layers on a quantised base) or train LoRA on a full base"), res.out[-2000:]
    assert not out.exists()
    res = ds_train("parity", "--config", str(cfg), "--steps", "3", "--out", str(out), "--ds-config", STAGES[2],
                   "--nproc", "2", timeout=900)
    assert res.returncode == 0 and "verdict: PASS: 1 of 1 layout(s)" in res.out, res.out[-3000:]
    parsed = build_config(raw, source="x")
    assert eager_layers(parsed).startswith("a quantised base (model.lora.load_in=4bit)")
    assert not compiles(parsed, "cuda") and fused_kernels(parsed) == []


def test_compiled_layers_under_expert_parallelism_are_refused_and_auto_leaves_them_eager():
    """AutoEP's grouped expert matmul does not trace (torch._grouped_mm in dynamo's fake-tensor run,
    fp32, measured with `ds-train parity --expert 2 model.compile=true`: every rank failed at its first
    forward). Refused in one line with model.compile=true; auto leaves the layers eager on a GPU too, and
    the plan counts them eager."""
    moe = {"model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2}

    def cfg(**model):
        return build_config({"output_dir": "/nonexistent/run", "parallel": {"expert": 2},
                             "model": {"config": moe, **model}}, source="x")

    with pytest.raises(UserError) as e:
        check_expert_run(cfg(compile=True))
    assert str(e.value) == (f"model.compile=true with parallel.expert=2: {EXPERTS_EAGER}; leave model.compile at auto "
                            f"(eager layers under expert parallelism)")
    assert "torch._grouped_mm" in str(e.value)
    assert not compiles(cfg(), "cuda") and fused_kernels(cfg()) == []
    assert eager_layers(cfg()).startswith("expert parallelism (parallel.expert=2)")
    one = build_config({"output_dir": "/nonexistent/run", "model": {"config": moe}}, source="x")
    assert compiles(one, "cuda") and fused_kernels(one) == ["compiled (model.compile)"] and eager_layers(one) == ""
    check_expert_run(cfg(compile=False))
