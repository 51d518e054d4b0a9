"""LoRA (model.lora, ds_train/model/lora.py and ds_train/checkpoint/lora_export.py): the config and its checks
(unit), the memory plan's count of what trains against peft's own model, and through the real
launcher: ZeRO-3 on 2 processes against ZeRO-0 on 1, the exports, kill -9 and resume, the size of a
checkpoint, a changed base."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from conftest import (ROOT, TINY_MODEL, deepspeed_args, deepspeed_train, ds_train, node_launch, run_cmd, spawn,
                      tiny_config, write_config)
from ds_train.checkpoint import commit as checkpoint
from ds_train.config.file import build_config, describe
from ds_train.errors import UserError
from ds_train.model.lora import apply_lora, check_lora
from ds_train.plan.memory import model_shape, model_states
from test_checkpoint import STALL_S, kill_rank, metrics_by_step


def lora_cfg(**lora):
    return build_config({"model": {"config": dict(TINY_MODEL), "lora": {"rank": 4, **lora}}}).model.lora


def hf_llama(**kw):
    from transformers import AutoConfig

    return AutoConfig.for_model(**{**TINY_MODEL, "vocab_size": 512, **kw})


def test_the_lora_section_is_checked_whole_and_listed_by_help_config():
    assert lora_cfg().rank == 4 and lora_cfg().target_modules == ["all-linear"]
    assert build_config({"model": {"config": dict(TINY_MODEL)}}).model.lora.rank == 0  # off by default
    assert "model.lora.rank = 0" in describe() and "model.lora.target_modules = ['all-linear']" in describe()
    with pytest.raises(UserError) as e:
        build_config({"model": {"config": dict(TINY_MODEL), "lora": {"rnk": 4}}})
    assert str(e.value) == "config: model.lora.rnk: unknown key (did you mean 'model.lora.rank'?)"
    with pytest.raises(UserError) as e:
        lora_cfg(target_modules=[], modules_to_save=[])
    assert "model.lora: rank 4 with empty target_modules and modules_to_save trains nothing" in str(e.value)
    with pytest.raises(UserError) as e:
        build_config({"model": {"config": dict(TINY_MODEL), "lora": {"load_in": "4bit"}}})
    assert "model.lora.load_in=4bit needs LoRA" in str(e.value)  # said once: not again as set but unused
    with pytest.raises(UserError, match="config: 2 problems: model.lora.rank: -1 must be >= 0; model.lora.dropout"):
        build_config({"model": {"config": dict(TINY_MODEL), "lora": {"rank": -1, "dropout": 1.5}}})


def test_target_modules_that_match_nothing_name_the_models_linear_layers():
    check_lora(lora_cfg(target_modules=["q_proj", "model.layers.0.mlp.down_proj"]), hf_llama())
    with pytest.raises(UserError) as e:
        check_lora(lora_cfg(target_modules=["q_proj", "qkv", "c_attn"]), hf_llama())
    assert str(e.value) == ("model.lora.target_modules: 'qkv', 'c_attn' match no linear layer of this llama model; "
                            "choose from q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj (or lm_head, "
                            "the output head), or all-linear")
    with pytest.raises(UserError, match="model.lora.modules_to_save: 'embeddings' name no module of this llama "
                                        "model; for example embed_tokens"):
        check_lora(lora_cfg(modules_to_save=["embeddings"]), hf_llama())
    qlora = build_config({"model": {"path": str(ROOT), "lora": {"rank": 4, "load_in": "4bit"}}}).model.lora
    check_lora(qlora, hf_llama())  # bitsandbytes' CPU backend: QLoRA runs here (test_qlora_trains_the_adapters...)
    import importlib.util

    real = importlib.util.find_spec
    try:
        importlib.util.find_spec = lambda name, *a: None if name == "bitsandbytes" else real(name, *a)
        with pytest.raises(UserError, match="model.lora.load_in=4bit \\(QLoRA\\) needs bitsandbytes, which is not "
                                            "installed \\(pip install 'bitsandbytes>=0.50'\\)"):
            check_lora(qlora, hf_llama())
    finally:
        importlib.util.find_spec = real


@pytest.mark.parametrize("model_type, left_out", [("falcon_h1", {"out_proj"}), ("phimoe", {"router"}),
                                                   ("llama4_text", {"router"}), ("falcon", set())])
def test_all_linear_adapts_every_linear_layer_peft_can_and_a_layer_it_cannot_is_refused(model_type, left_out):
    """all-linear (the default) on a Mamba hybrid leaves out the layers peft refuses there (its out_proj;
    before: peft's ValueError at build), and on PhiMoE and Llama 4 their routers (an nn.Linear of the modeling file
    that returns a tuple; Llama 4's is not recorded as a router, found by its forward not computing x W^T + b;
    before: an AttributeError in the first forward). Falcon's own nn.Linear computes x W^T + b: adapted. Naming a
    refused layer is one line before anything is built; the adapted model's forward and backward run, gradients on
    adapters alone."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    hf = AutoConfig.for_model(model_type, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=2, num_key_value_heads=1, vocab_size=64)
    torch.manual_seed(0)
    adapted = apply_lora(AutoModelForCausalLM.from_config(hf), lora_cfg(), 0)
    wrapped = {n.rsplit(".", 1)[-1] for n, m in adapted.named_modules() if hasattr(m, "lora_A")}
    assert wrapped and not wrapped & left_out, wrapped
    if model_type == "falcon":
        assert {"query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"} <= wrapped, wrapped
    adapted(input_ids=torch.arange(8)[None], use_cache=False).logits.square().mean().backward()
    grads = [n for n, p in adapted.named_parameters() if p.grad is not None]
    assert grads and all(".lora_" in n for n in grads)
    if model_type == "falcon_h1":
        with pytest.raises(UserError) as e:
            check_lora(lora_cfg(target_modules=["out_proj", "q_proj"]), hf)
        assert str(e.value).startswith("model.lora.target_modules: peft puts no LoRA on 'out_proj' of a falcon_h1 "
                                       "model ([PEFT:PeftType.LORA] Module 'out_proj' is incompatible with Mamba"), e.value
        assert "or all-linear (which leaves them out)" in str(e.value)


@pytest.mark.parametrize("lora", [{}, {"target_modules": ["q_proj", "v_proj"], "modules_to_save": ["lm_head"]}])
def test_the_plan_counts_what_peft_trains_and_a_frozen_base_has_no_gradients_or_optimizer(lora):
    import torch
    from transformers import AutoModelForCausalLM

    config = hf_llama(tie_word_embeddings=False)
    cfg = lora_cfg(**lora)
    model = apply_lora(AutoModelForCausalLM.from_config(config), cfg, seed=1)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    shape = model_shape(config, cfg)
    assert shape.trainable == trainable and shape.n_params == sum(p.numel() for p in model.parameters())
    assert torch.count_nonzero(model.base_model.model.model.layers[0].self_attn.v_proj.lora_B.default.weight) == 0
    full = model_states(shape.n_params, 2, "bf16", 4)
    adapted = model_states(shape.n_params, 2, "bf16", 4, trainable=trainable)
    assert adapted.params == full.params  # the frozen base is held all the same
    assert adapted.grads == pytest.approx(full.grads * trainable / shape.n_params)
    assert adapted.optimizer == 12 * trainable / 4


def test_a_changed_base_is_refused_in_one_line(tmp_path):
    from ds_train.checkpoint import resume
    cfg = build_config({"model": {"config": dict(TINY_MODEL), "lora": {"rank": 4}}})
    state = {"step": 4, "world_size": 2, "config": cfg.to_dict(), "data": {"tokenizer": "t", "base": "aaaa"}}
    point = resume.ResumePoint(tmp_path, "step_00000004", state)
    assert resume.check_resume(point, cfg, "train", 2, data={"tokenizer": "t", "base": "aaaa"}) == []
    with pytest.raises(UserError) as e:
        resume.check_resume(point, cfg, "train", 2, data={"tokenizer": "t", "base": "bbbb"})
    assert "the base model's weights changed since this checkpoint (model.path '': fingerprint aaaa -> bbbb)" in str(e.value)


def test_lora_with_tensor_parallelism_is_refused():
    from ds_train.plan.parallel import check_parallel

    cfg = build_config({"model": {"config": dict(TINY_MODEL), "lora": {"rank": 4}, "dtype": "fp32"},
                        "parallel": {"tensor": 2}})
    with pytest.raises(UserError, match="parallel.tensor=2 with LoRA \\(model.lora.rank=4\\): AutoTP replaces"):
        check_parallel(cfg, {"zero_optimization": {"stage": 2}})


@pytest.fixture(scope="module")
def base(tiny_data, tmp_path_factory):
    """A pretrained base: a tiny Llama with the tiny corpus's tokenizer (untied head, as most are)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    out = tmp_path_factory.mktemp("lora_base")
    tok = AutoTokenizer.from_pretrained(tiny_data / "tokenizer")
    torch.manual_seed(0)
    cfg = AutoConfig.for_model(**{**TINY_MODEL, "tie_word_embeddings": False, "vocab_size": len(tok)})
    AutoModelForCausalLM.from_config(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def lora_run(tiny_data, base, run_dir: Path, lr: float = 3e-2, **sections) -> Path:
    return write_config(run_dir.parent / f"{run_dir.name}.yaml", tiny_config(
        tiny_data, run_dir, model={"path": str(base), "config": {}, "dtype": "fp32",
                                   "lora": {"rank": 8, "alpha": 16, "modules_to_save": ["lm_head"]}},
        optim={"lr": lr, "warmup_steps": 0}, **sections))


def read_adapter(path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(path / "adapter_model.safetensors")


@pytest.mark.slow
def test_zero3_on_two_processes_trains_the_adapters_of_zero0_on_one_and_both_exports_give_the_engines_logits(
        tiny_data, base, tmp_path):
    """5 steps, the same global batch: ZeRO-3 on 2 processes (the base partitioned, the adapters with
    it; the loss in tiles of 32 tokens through the lm_head copy modules_to_save trains) and ZeRO-0 on
    1 (the full logits) log the same loss and gradient norm at every step and train the same
    adapters: what the steps moved each exported tensor by (lora_B from zero, lora_A and the lm_head
    copy from their seeded and copied starting values, which both runs share) agrees within 1e-4 of
    itself; no exported adapter tensor is empty. The merged export gives the ZeRO-3 engine's logits
    within 1e-5, and so does PeftModel on the base with the exported adapter."""
    import torch
    from peft import PeftModel, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    from ds_train.config.file import load_config

    runs = {}
    for name, ds_config, nproc, tile in (("zero3", "zero3.json", 2, 32), ("zero0", "zero0.json", 1, 0)):
        cfg = lora_run(tiny_data, base, tmp_path / name, lr=1e-3, train={"max_steps": 5, "loss_tile_tokens": tile},
                       checkpoint={"save_final": True})
        res = deepspeed_train(cfg, ds_config, nproc=nproc)
        assert res.returncode == 0, res.out[-3000:]
        assert "M of them trained (LoRA rank 8: the adapters and lm_head; the base frozen)" in res.out
        runs[name] = cfg
    res = ds_train("export", str(tmp_path / "zero3"), "--out", str(tmp_path / "zero3_adapter"), timeout=300)
    assert res.returncode == 0, res.out[-3000:]
    assert res.out.strip().splitlines()[-1].startswith(
        f"export: wrote {tmp_path / 'zero3_adapter'} from step_00000005: a peft LoRA adapter"), res.out[-2000:]
    from ds_train.checkpoint.lora_export import export_lora  # the same export in this process (no CLI start-up)

    export_lora(tmp_path / "zero0", tmp_path / "zero0_adapter")
    logged = {name: metrics_by_step(tmp_path / name) for name in runs}
    assert sorted(logged["zero3"]) == sorted(logged["zero0"]) == [1, 2, 3, 4, 5]
    for step, m in logged["zero3"].items():  # a lost or doubled rank's gradient shows in both, Adam or not
        want = logged["zero0"][step]
        assert m["train/loss"] == pytest.approx(want["train/loss"], rel=1e-6), step
        assert m["optim/grad_norm"] == pytest.approx(want["optim/grad_norm"], rel=1e-6), step
    assert logged["zero0"][5]["train/loss"] < logged["zero0"][1]["train/loss"]

    got, ref = read_adapter(tmp_path / "zero3_adapter"), read_adapter(tmp_path / "zero0_adapter")
    assert sorted(got) == sorted(ref) and any("lora_A" in k for k in got) and any("lm_head" in k for k in got)
    assert all(t.numel() > 0 for t in [*got.values(), *ref.values()])
    # What trained: the exported tensors less their starting values (lora_A seeded, lora_B zero, the
    # lm_head copy the base's), so that values the runs share untrained cannot hide a difference
    cfg = load_config(str(runs["zero0"]), [])
    adapted = apply_lora(AutoModelForCausalLM.from_pretrained(base), cfg.model.lora, cfg.seed)
    start = get_peft_model_state_dict(adapted)
    assert sorted(start) == sorted(ref)
    moved = {k: ref[k] - start[k] for k in ref}
    assert all(float(moved[k].abs().max()) > 0 for k in ref)  # every adapter and the lm_head copy trained
    assert all(float(start[k].abs().max()) == 0 for k in ref if "lora_B" in k)
    # Tensor by tensor within 1e-4 of what it moved: Adam divides each element's momentum by its own
    # scale, so an element whose momentum nearly cancels carries the 1e-7 reduction-order differences
    # of the gradients (between 1 and 2 ranks) further.
    for k in ref:
        assert float((got[k] - ref[k]).norm()) <= 1e-4 * float(moved[k].norm()), k

    merged = tmp_path / "merged"
    export_lora(tmp_path / "zero3", merged, merge=True)  # `--merge` as a command: tests/test_doc_commands.py
    probe = tmp_path / "engine_logits.pt"
    res = run_cmd([*node_launch(), str(ROOT / "tests" / "tp_logits_probe.py"), str(runs["zero3"]), str(ROOT / "ds_configs" / "zero3.json"),
                   str(tmp_path / "zero3" / "checkpoints"), "step_00000005", str(probe)], timeout=300)
    assert res.returncode == 0, res.out[-3000:]
    engine = torch.load(probe)
    scale = engine["logits"].abs().max()
    with torch.no_grad():
        merged_logits = AutoModelForCausalLM.from_pretrained(merged).eval()(input_ids=engine["input_ids"]).logits
        adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), tmp_path / "zero3_adapter")
        peft_logits = adapter.eval()(input_ids=engine["input_ids"]).logits
        base_logits = AutoModelForCausalLM.from_pretrained(base).eval()(input_ids=engine["input_ids"]).logits
    assert float((merged_logits - engine["logits"]).abs().max() / scale) <= 1e-5
    assert float((peft_logits - engine["logits"]).abs().max() / scale) <= 1e-5
    assert float((base_logits - engine["logits"]).abs().max() / scale) > 1e-3  # the adapters changed it
    assert json.loads((tmp_path / "zero3_adapter" / "adapter_config.json").read_text())["base_model_name_or_path"] \
        == str(base.resolve())


@pytest.mark.slow
def test_a_killed_lora_run_resumes_exactly_its_checkpoints_hold_the_adapters_and_a_changed_base_is_refused(
        tiny_data, base, tmp_path):
    """ZeRO-2, 2 processes, a save every 2 steps: rank 1 is killed after step 3 and the same command
    finishes with the uninterrupted run's losses, bitwise. A tag is at most 1.1 x the adapters, their
    optimizer states and the loop state; a resume on another base is refused in one line."""
    own_base = tmp_path / "base"
    shutil.copytree(base, own_base)

    def config(run_dir):
        return lora_run(tiny_data, own_base, run_dir, checkpoint={"every": 2, "keep": 0},
                        watchdog={"stall_s": STALL_S, "heartbeat_s": 0.5})

    straight = tmp_path / "straight"
    assert deepspeed_train(config(straight), "zero2.json").returncode == 0
    ref = metrics_by_step(straight)
    run_dir = tmp_path / "killed"
    kill_rank(spawn(deepspeed_args(config(run_dir), "zero2.json", "watchdog.debug_fault=slow:0:0.3")), run_dir, 1,
              after=3)
    first = checkpoint.latest_complete(run_dir / "checkpoints")
    res = deepspeed_train(config(run_dir), "zero2.json")
    assert res.returncode == 0, res.out[-3000:]
    assert f"resumed from {run_dir / 'checkpoints' / first}" in res.out
    got = metrics_by_step(run_dir)
    k = int(first.split("_")[1])
    assert sorted(got) == sorted(ref) and all(got[s]["loss"] == ref[s]["loss"] for s in range(k + 1, 9))

    import torch
    from transformers import AutoModelForCausalLM

    from ds_train.config.file import load_config

    lora = load_config(str(config(straight)), []).model.lora
    model = apply_lora(AutoModelForCausalLM.from_pretrained(own_base), lora, 0)
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    tag = straight / "checkpoints" / "step_00000008"
    size = sum(p.stat().st_size for p in tag.iterdir())
    loop = sum(p.stat().st_size for p in tag.glob("ds_train_*"))
    # the adapters (fp32 here) and their optimizer states: DeepSpeed's fp32 master copy, exp_avg, exp_avg_sq
    assert size <= 1.1 * (trained * 4 + trained * 12 + loop), (size, trained)
    saved = torch.load(tag / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)["module"]
    assert saved and all(".lora_" in k or ".modules_to_save." in k for k in saved), sorted(saved)[:5]  # no base

    with torch.no_grad():  # another base at the same path: the adapters do not fit it any more
        other = AutoModelForCausalLM.from_pretrained(own_base)
        for p in other.parameters():
            p.add_(0.01)
        other.save_pretrained(own_base)
    res = ds_train("train", "--config", str(config(run_dir)), "--ds-config", str(ROOT / "ds_configs" / "zero2.json"),
                   "train.max_steps=10", timeout=180)
    assert res.returncode == 2, res.out[-3000:]
    last = res.out.strip().splitlines()[-1]
    assert last.startswith(f"ds-train: error: {run_dir / 'checkpoints' / 'step_00000008'}: the base model's weights "
                           f"changed since this checkpoint (model.path {str(own_base)!r}: fingerprint "), last
    assert sorted(metrics_by_step(run_dir)) == sorted(ref)  # nothing written
    assert os.path.exists(run_dir / "checkpoints" / "step_00000008")


def test_bad_lora_input_is_one_line_before_anything_is_written(capsys, tiny_data, base, tmp_path):
    """ds-train train, launch --check and estimate: a target that matches nothing, a quantised base
    without its GPU library, LoRA with AutoTP; each one line, exit 2, the run directory untouched."""
    from test_cli import expect_error

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
    cfg = write_config(tmp_path / "c.yaml", tiny_config(tiny_data, run_dir, model={
        "config": dict(TINY_MODEL), "dtype": "fp32", "lora": {"rank": 4}}))
    zero2 = str(ROOT / "ds_configs" / "zero2.json")
    train = ["train", "--config", str(cfg), "--ds-config", zero2]
    expect_error(capsys, run_dir, [*train, "model.lora.target_modules=[q_proj,query]"],
                 "model.lora.target_modules: 'query' match no linear layer of this llama model; choose from q_proj")
    expect_error(capsys, run_dir, [*train, "model.lora.target_modules=[]"],
                 "trains nothing; list target_modules")
    expect_error(capsys, run_dir, [*train, "model.lora.load_in=8bit"],
                 "model.lora.load_in=8bit: a quantised base is loaded from model.path")
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("127.0.0.2 slots=2\n")
    expect_error(capsys, run_dir, ["launch", "--hostfile", str(hostfile), "--check", "--", *train,
                                   "model.lora.target_modules=[qkv]"], "'qkv' match no linear layer")
    expect_error(capsys, run_dir, ["estimate", "--config", str(cfg), "--ds-config", zero2, "--nodes", "1",
                                   "--gpus-per-node", "2", "parallel.tensor=2"],
                 "parallel.tensor=2 with LoRA (model.lora.rank=4)")
    from ds_train.__main__ import main

    assert main(["estimate", "--config", str(cfg), "--ds-config", zero2, "--nodes", "1", "--gpus-per-node", "1"]) == 0
    assert "; LoRA trains 0.01M of them (the frozen base: no gradients, no optimizer states)" in capsys.readouterr().out


@pytest.mark.slow
def test_ript_trains_the_adapters_of_the_policy(tiny_policy, tmp_path):
    """RIPT with model.lora: the policy is the adapted model (ZeRO-2, 2 processes); the update moves
    the adapters alone and the final checkpoint holds them, not the base. With a KL term the
    reference is the base itself (the adapters turned off): no copy is built."""
    import json

    import torch

    from conftest import ript_config
    from test_ript_trainer import launch_ript

    # 4 iterations: the KL of iteration 1 before any update, that of iteration 4 after updates
    res = launch_ript(ript_config(tmp_path, tiny_policy, iterations=4, kl_coef=0.1), "model.lora.rank=4",
                      "model.lora.target_modules=[q_proj,v_proj]")
    assert res.returncode == 0, res.out[-4000:]
    assert "M of them trained (LoRA rank 4: the adapters; the base frozen)" in res.out
    assert "reference policy: the base model (the policy with its LoRA adapters off); 0.0 MiB of parameters" in res.out
    kl = {m["step"]: m.get("policy/kl") for m in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text()
                                                     .splitlines()) if "policy/tokens" in m}
    assert kl[1] == 0.0 and kl[4] > 0, kl  # the adapters start at zero: policy = base until they move
    tag = checkpoint.latest_complete(tmp_path / "run" / "checkpoints")
    saved = torch.load(tmp_path / "run" / "checkpoints" / tag / "mp_rank_00_model_states.pt", map_location="cpu",
                       weights_only=False)["module"]
    assert saved and all(k.endswith((".lora_A.default.weight", ".lora_B.default.weight")) for k in saved), sorted(saved)
    assert any(float(v.abs().max()) > 0 for k, v in saved.items() if "lora_B" in k)  # the update moved them


@pytest.mark.slow
def test_the_dry_run_of_a_lora_run_says_what_trains_and_its_checkpoint_round_trips(tiny_data, base, tmp_path):
    cfg = lora_run(tiny_data, base, tmp_path / "run")
    res = ds_train("dry-run", "--config", str(cfg), "--ds-config", str(ROOT / "ds_configs" / "zero3.json"),
                   "--nodes", "1", "--gpus-per-node", "2", timeout=300)
    assert res.returncode == 0, res.out[-3000:]
    assert "LoRA trains 0.05M of them (the frozen base: no gradients, no optimizer states)" in res.out
    assert "save/load round trip ok" in res.out, res.out[-2000:]


@pytest.mark.slow
def test_qlora_trains_the_adapters_on_a_4bit_base_through_bitsandbytes_cpu_backend(tiny_data, base, tmp_path):
    """model.lora.load_in=4bit (NF4, double quantisation) on 2 processes, ZeRO-2: the base loads as
    bitsandbytes' Linear4bit (its CPU backend; an MLP width its packed CPU kernels take, a multiple
    of 64), only the adapters train and are saved, the loss falls, the eval runs."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    quantisable = tmp_path / "base"
    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(base)
    cfg = AutoConfig.from_pretrained(base)
    cfg.intermediate_size = 128
    AutoModelForCausalLM.from_config(cfg).save_pretrained(quantisable)
    tok.save_pretrained(quantisable)
    run_dir = tmp_path / "run"
    config = lora_run(tiny_data, quantisable, run_dir, train={"max_steps": 6, "eval_every": 6},
                      checkpoint={"save_final": True})
    res = deepspeed_train(config, "zero2.json", "model.lora.load_in=4bit", "model.lora.modules_to_save=[]",
                          "model.lora.target_modules=[q_proj,v_proj,gate_proj]")
    assert res.returncode == 0, res.out[-3000:]
    assert "M of them trained (LoRA rank 8: the adapters; the base frozen)" in res.out, res.out[-2000:]
    m = metrics_by_step(run_dir)
    assert m[6]["train/loss"] < m[1]["train/loss"] and "eval/loss" in m[6]
    states = [p for p in (run_dir / "checkpoints").rglob("*model_states.pt")]
    saved = torch.load(states[0], map_location="cpu", weights_only=False)["module"]
    base_entries = [k for k in saved if "lora_" not in k]
    assert any("lora_" in k for k in saved)  # the adapters; of the 4-bit base only its quantisation state
    assert base_entries and all(".weight." in k and not k.endswith(".weight") for k in base_entries), base_entries[:5]
    assert sum(v.numel() for k, v in saved.items() if k in base_entries) < sum(
        p.numel() for p in AutoModelForCausalLM.from_config(cfg).parameters()) / 10
