"""ds-train estimate and dry-run: the plan, presets, suggestions, and the one-device rehearsal."""

from __future__ import annotations

import json
import re

import pytest

from conftest import ROOT, ds_train
from ds_train.config.file import build_config
from ds_train.estimate import estimate_outcome, format_estimate, run_estimate
from ds_train.plan.memory import model_shape
from ds_train.plan.planner import Target, oom_report, pick_preset

SEVEN_B = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008,
           "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
           "vocab_size": 32000, "max_position_embeddings": 4096}


def seven_b(tmp_path, **train):
    return build_config({"output_dir": str(tmp_path / "run"), "model": {"config": SEVEN_B},
                         "train": {"seq_len": 4096, "micro_batch_size": 4, "global_batch_size": 256, **train}})


def test_estimate_marks_what_fits_and_ranks_fixes(tmp_path):
    cfg = seven_b(tmp_path)
    target = Target(2, 8, 80)
    out = run_estimate(cfg, str(ROOT / "ds_configs" / "zero2.json"), target, None)
    assert len(out["rows"]) == 8 and sum(r["given"] for r in out["rows"]) == 1
    by = {(r["config"], r["activation_checkpointing"]): r for r in out["rows"]}
    assert by[("ZeRO-3", False)]["gpu_peak_gib"] < by[("ZeRO-0", False)]["gpu_peak_gib"]
    assert not by[("ZeRO-0", False)]["fits"]  # 16 bytes x 6.7B params is more than 80 GiB
    given = next(r for r in out["rows"] if r["given"])
    assert not given["fits"] and out["suggestions"]  # 4 x 4096 tokens of 7B activations do not fit
    fixes = out["suggestions"]
    assert fixes[0]["change"].startswith("train.micro_batch_size=2")
    assert any(f["fits"] for f in fixes)
    assert all(f["gpu_peak_gib"] < given["gpu_peak_gib"] for f in fixes)
    assert estimate_outcome(out, target) == (  # the command's last line
        f"estimate: ZeRO-2 micro 4, checkpointing off (as given): peak {given['gpu_peak_gib']:.2f} of 80 GiB per GPU "
        f"on world 16 -> DOES NOT FIT (the changes above, cheapest first)")


def test_a_mixture_of_experts_that_does_not_fit_is_told_to_split_its_experts_first(tmp_path):
    """Qwen3-30B-A3B's shape on 8 x 80 GiB with every expert on every rank: AutoEP over the 8 ranks (128
    experts, 16 a rank) is the first fix, at the peak the recipe's own estimate gives."""
    from ds_train.config.file import load_config

    cfg = load_config(str(ROOT / "recipes" / "qwen3_30b_a3b.yaml"), ["parallel.expert=1"])
    out = run_estimate(cfg, str(ROOT / "ds_configs" / "zero2.json"), Target(1, 8, 80), None)
    given = next(r for r in out["rows"] if r["given"])
    assert not given["fits"] and round(given["gpu_peak_gib"], 2) == 114.49
    first = out["suggestions"][0]
    assert first["change"].startswith("parallel.expert=8 (AutoEP, an all-to-all a layer: each rank holds 1/8 of "
                                      "every MoE layer's 128 experts") and first["fits"]
    assert round(first["gpu_peak_gib"], 2) == 67.24  # docs/parallel.md: the recipe at parallel.expert 8
    dense = run_estimate(seven_b(tmp_path), str(ROOT / "ds_configs" / "zero2.json"), Target(2, 8, 80), None)
    assert not any("parallel.expert" in f["change"] for f in dense["suggestions"])


@pytest.mark.parametrize("preset, fraction", [("conservative", 0.5), ("balanced", 0.7), ("aggressive", 0.9)])
def test_presets_stay_within_their_memory_fraction(tmp_path, preset, fraction):
    cfg = seven_b(tmp_path)
    target = Target(2, 8, 80)
    p = pick_preset(model_shape_of(cfg), cfg, target, "bf16", preset)
    assert p["gpu_peak_gib"] <= fraction * 80
    assert 256 % (p["micro_batch_size"] * 16) == 0


def model_shape_of(cfg):
    from ds_train.model.hfconfig import build_hf_config

    return model_shape(build_hf_config(cfg.model, SEVEN_B["vocab_size"], cfg.train.seq_len))


def test_aggressive_preset_packs_more_than_conservative(tmp_path):
    cfg = seven_b(tmp_path)
    shape, target = model_shape_of(cfg), Target(2, 8, 80)
    cons = pick_preset(shape, cfg, target, "bf16", "conservative")
    aggr = pick_preset(shape, cfg, target, "bf16", "aggressive")
    assert (aggr["activation_checkpointing"], aggr["stage"], -aggr["micro_batch_size"]) <= \
           (cons["activation_checkpointing"], cons["stage"], -cons["micro_batch_size"])


def test_oom_report_lists_the_plan_and_fixes(tmp_path):
    from ds_train.model.hfconfig import build_hf_config

    cfg = seven_b(tmp_path)
    hf = build_hf_config(cfg.model, 32000, 4096)
    text = oom_report(cfg, {"bf16": {"enabled": True}, "zero_optimization": {"stage": 2}}, hf, 8, 80)
    assert "out of GPU memory" in text and "ZeRO-2 micro 4" in text
    assert "model.activation_checkpointing=true" in text and "zero3.json" in text


def test_estimate_cli_for_the_quickstart_on_the_example_hostfile(tmp_path):
    res = ds_train("estimate", "--config", str(ROOT / "recipes" / "quickstart.yaml"),
                   "--ds-config", str(ROOT / "ds_configs" / "zero3.json"),
                   "--hostfile", str(ROOT / "hostfile.example"), "model.config.vocab_size=4096",
                   "--preset", "balanced", timeout=120)
    assert res.returncode == 0, res.out[-3000:]
    assert "world 16" in res.out and "<- given" in res.out and "preset balanced" in res.out
    last = res.out.strip().splitlines()[-1]
    assert re.fullmatch(r"estimate: ZeRO-3 micro 2, checkpointing off \(as given\): peak [\d.]+ of [\d.]+ GiB per GPU "
                        r"on world 16 -> fits", last), last


def test_estimate_refuses_batch_math_that_does_not_fit_the_target(tmp_path):
    res = ds_train("estimate", "--config", str(ROOT / "recipes" / "quickstart.yaml"),
                   "--ds-config", str(ROOT / "ds_configs" / "zero2.json"), "--nodes", "3",
                   "--gpus-per-node", "1", "model.config.vocab_size=4096", timeout=120)
    assert res.returncode == 2
    assert "train.global_batch_size=32 is not a multiple of train.micro_batch_size=2 x world size 3" in res.out


@pytest.mark.slow
@pytest.mark.parametrize("sequence", [2])  # 1, as the README runs it: tests/test_doc_commands.py
def test_dry_run_of_the_quickstart_for_the_example_hostfile(tmp_path, sequence):
    """The quickstart recipe as shipped (its corpus is prepared on first use) for hostfile.example;
    with parallel.sequence=2 this device runs a rank's half of each sequence, and the step time is
    projected to attention over the whole sequence."""
    res = ds_train("dry-run", "--config", str(ROOT / "recipes" / "quickstart.yaml"),
                   "--ds-config", str(ROOT / "ds_configs" / "zero2.json"),
                   "--hostfile", str(ROOT / "hostfile.example"), f"output_dir={tmp_path / 'run'}",
                   f"data.dir={tmp_path / 'data'}", f"parallel.sequence={sequence}", timeout=180)
    assert res.returncode == 0, res.out[-3000:]  # its speed is a benchmark's business, not a test's
    out = json.loads((tmp_path / "run" / "dry_run.json").read_text())
    assert out["target"]["world"] == 16 and out["batch"]["grad_accum_steps"] == sequence
    m, p = out["measured"], out["predicted"]
    assert m["step_time_s"] > 0 and m["rank_seq_len"] == 128 // sequence
    assert p["fits"] and p["tokens_per_s_cluster"] == pytest.approx(16 * p["tokens_per_s_per_gpu"])
    assert p["time_to_finish_s"] == pytest.approx(300 * p["step_time_s"])
    tokens = 32 // (16 // sequence) * 128 // sequence  # a rank's share of a step's tokens
    assert p["tokens_per_s_per_gpu"] == pytest.approx(tokens / p["step_time_s"])
    if sequence == 1:
        assert p["step_time_s"] == pytest.approx(m["step_time_s"], rel=1e-12)  # x1 up to rounding
    else:  # 6N + 12 L h s FLOPs a token at s = 128 over those at s = 64 (ds_train/model/build.py)
        ratio = p["step_time_s"] / m["step_time_s"]
        assert 1 < ratio < 1.5 and f"all 128 positions (x{ratio:.3f})" in res.out
        assert "note: parallel.sequence=2: ran a rank's 64 positions of each sequence with every head" in res.out
    assert out["checkpoint_round_trip"]["ok"] and p["checkpoint_gib"] > 0
    assert "save/load round trip ok" in res.out and "fits" in res.out
    assert res.out.strip().splitlines()[-1] == (
        f"dry-run: predicted peak {p['per_gpu_peak_gib']:.2f} of {p['gpu_memory_gib']:g} GiB per GPU -> fits, "
        f"{p['tokens_per_s_cluster']:,.0f} tokens/s on world 16; checkpoint round trip ok; wrote "
        f"{tmp_path / 'run' / 'dry_run.json'}")
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["dry_run.json"]  # nothing else left
    assert (tmp_path / "data" / "meta.json").is_file()  # the corpus was prepared on first use


def test_the_plan_of_a_long_context_job_knows_sequence_parallelism():
    """Llama-3-8B's shape at seq_len 131072 on 2 nodes x 8 GPUs: Ulysses over 8 ranks gives each rank
    16,384 positions (activations an eighth), ZeRO partitions over all 16 ranks; without it nothing
    fits, and sequence parallelism is among the ranked fixes."""

    llama = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
             "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
             "max_position_embeddings": 131072}
    raw = {"output_dir": "/tmp/unused", "model": {"config": llama, "dtype": "bf16", "activation_checkpointing": True},
           "train": {"seq_len": 131072, "micro_batch_size": 1, "global_batch_size": 16, "loss_tile_tokens": 0,
                     "mlp_tile_positions": 0}}
    target = Target(2, 8, 80.0)
    zero3 = str(ROOT / "ds_configs" / "zero3.json")
    with_sp = run_estimate(build_config({**raw, "parallel": {"sequence": 8}}, source="t"), zero3, target, None)
    without = run_estimate(build_config(raw, source="t"), zero3, target, None)
    sp, no = (next(r for r in out["rows"] if r["given"]) for out in (with_sp, without))
    assert sp["activations_gib"] == pytest.approx(no["activations_gib"] / 8, rel=1e-9)
    assert sp["optimizer_gib"] == pytest.approx(no["optimizer_gib"])  # ZeRO over data x sequence = 16 ranks either way
    assert sp["fits"] and not no["fits"]
    text = format_estimate(with_sp, target)
    assert ("parallel: data 2 x sequence 8 x tensor 1; each rank holds 16,384 of the 131,072 positions of a sequence "
            "(activations); ZeRO partitions over data x sequence = 16 ranks") in text
    assert any(s["change"].startswith("parallel.sequence=2 (Ulysses") for s in without["suggestions"])
    # recipes/llama3_8b_128k.yaml, as docs/parallel.md shows it: the default tiles of the loss and the MLP
    from ds_train.config.file import load_config

    recipe = run_estimate(load_config(str(ROOT / "recipes" / "llama3_8b_128k.yaml"), []), zero3, target, None)
    row = next(r for r in recipe["rows"] if r["given"])
    assert (round(row["gpu_peak_gib"], 2), round(row["activations_gib"], 2)) == (16.49, 7.94)  # layers compiled
    # the loss in tiles of 4096 tokens: the 16,384 positions' fp32 log-softmax (8 GiB) is never whole
    raw["train"]["loss_tile_tokens"] = 4096
    tiled = run_estimate(build_config({**raw, "parallel": {"sequence": 8}}, source="t"), zero3, target, None)
    gained = sp["activations_gib"] - next(r for r in tiled["rows"] if r["given"])["activations_gib"]
    assert gained == pytest.approx((16384 - 4096) * 128256 * (4 + 2 + 4) / 2**30, rel=1e-6)  # ~15 GiB


def test_the_plan_counts_a_colocated_vllm_engine_awake_beside_the_model_states():
    """recipes/rl_vllm.yaml (Qwen2.5-7B's shape, ZeRO-3, 8 x 80 GB): vLLM takes 0.3 of each GPU while it
    generates, its bf16 weights whole within that; every row's peak is the larger of the update's and the
    model states + vLLM's; a share below vLLM's weights leaves no KV cache, and nothing fits, until engines of
    2 GPUs split the weights."""
    from ds_train.config.file import load_config

    zero3, target = str(ROOT / "ds_configs" / "zero3.json"), Target(1, 8, 80)
    cfg = load_config(str(ROOT / "recipes" / "rl_vllm.yaml"), [])
    out = run_estimate(cfg, zero3, target, None)
    e = out["rollout_engine"]
    assert (e["fraction"], e["gib"]) == (0.3, pytest.approx(24.0))
    assert e["weights_gib"] == pytest.approx(7_615_616_512 * 2 / 2**30, rel=1e-3) and e["kv_cache_gib"] > 9
    without = run_estimate(load_config(str(ROOT / "recipes" / "rl_vllm.yaml"), ["ript.rollout_engine=hf",
                                                                                "ript.tis_cap=0"]), zero3, target, None)
    assert "rollout_engine" not in without
    for row, bare in zip(out["rows"], without["rows"]):
        assert row["rollout_peak_gib"] == pytest.approx(row["model_states_gib"] + 24.0)
        assert row["gpu_peak_gib"] == pytest.approx(max(bare["gpu_peak_gib"], row["rollout_peak_gib"]))
    assert estimate_outcome(out, target).endswith("peak 38.19 of 80 GiB per GPU on world 8 -> fits")
    starved = run_estimate(load_config(str(ROOT / "recipes" / "rl_vllm.yaml"),
                                       ["ript.vllm_gpu_memory_utilization=0.1"]), zero3, target, None)
    assert starved["rollout_engine"]["kv_cache_gib"] < 0 and not any(r["fits"] for r in starved["rows"])
    # engines of 2 GPUs (vLLM tensor parallelism): half the weights on each GPU, the same share; the 0.1 fits now
    split = run_estimate(load_config(str(ROOT / "recipes" / "rl_vllm.yaml"), ["ript.vllm_gpu_memory_utilization=0.1",
                                                                              "ript.vllm_tensor_parallel_size=2"]),
                         zero3, target, None)
    e2 = split["rollout_engine"]
    assert e2["weights_gib"] == pytest.approx(7_615_616_512 / 2**30, rel=1e-3) and e2["gib"] == pytest.approx(8.0)
    assert e2["kv_cache_gib"] > 0 and any(r["fits"] for r in split["rows"])
    assert "1/2 of them on each GPU of an engine" in format_estimate(split, target)


def test_the_plan_says_what_a_node_can_give_to_rollout_ranks_and_counts_trainers_apart():
    """recipes/rl_vllm.yaml on a node of 8 x 80 GB: the ZeRO-3 update fits on 2 of its GPUs, so up to 6 can generate
    (a rollout rank holds the bf16 policy whole and a KV cache of rollout_contexts x K rows of seq_len). With
    ript.rollout_ranks_per_node=2 the rows are the 6 trainers' (ZeRO-3 partitions over 6, not 8); a node left
    without a trainer is refused in one line."""
    from ds_train.config.file import load_config
    from ds_train.errors import UserError

    zero3, target = str(ROOT / "ds_configs" / "zero3.json"), Target(1, 8, 80)
    cfg = load_config(str(ROOT / "recipes" / "rl_vllm.yaml"), [])
    out = run_estimate(cfg, zero3, target, None)
    r = out["rollout_ranks"]
    rows = cfg.ript.rollout_contexts * cfg.ript.rloo_batch_size
    assert (r["trainers_per_node"], r["rollout_max"], r["per_node"]) == (2, 6, 0)
    assert r["rollout_weights_gib"] == pytest.approx(7_615_616_512 * 2 / 2**30, rel=1e-3)
    assert r["rollout_kv_gib"] == pytest.approx(2 * 28 * 512 * 2 * rows * 2048 / 2**30) and r["rollout_fits"]
    assert "so a node of 8 can give up to 6 to rollout ranks (ript.rollout_ranks_per_node)" in format_estimate(
        out, target)
    split = ["ript.rollout_engine=hf", "ript.tis_cap=0", "ript.rollout_ranks_per_node=2", "train.global_batch_size=240"]
    apart = run_estimate(load_config(str(ROOT / "recipes" / "rl_vllm.yaml"), split), zero3, target, None)
    given = next(row for row in apart["rows"] if row["given"])
    assert apart["target"]["world"] == 6 and given["params_gib"] == pytest.approx(7_615_616_512 * 2 / 6 / 2**30,
                                                                                   rel=1e-3)
    assert "ript.rollout_ranks_per_node=2: the rows below are the 6 trainers of each node" in format_estimate(
        apart, target)
    with pytest.raises(UserError, match=r"ript.rollout_ranks_per_node=8: a node of 8 GPU\(s\) would have none"):
        run_estimate(load_config(str(ROOT / "recipes" / "rl_vllm.yaml"), split[:3] + ["ript.rollout_ranks_per_node=8"]),
                     zero3, target, None)
