"""ds-train parity: the comparison and --shrink (pure), its bad input (one line), and through the real
launcher the parity matrix (ZeRO 0-3 x accumulation 1 and 4 x data-parallel 1 and 2, pretraining and
SFT). The matrix's numbers are checked again here from the runs' own metrics, not only from the verdict
the command prints. --shrink on the SFT recipe, as the README writes it, runs in
tests/test_doc_commands.py (its reference, its ZeRO-3 layout and its verdict checked there)."""

from __future__ import annotations

import json
import math
import re

import pytest

from conftest import ROOT, TINY_MODEL, ds_train, tiny_config, write_config
from ds_train.__main__ import main
from ds_train.model.shrunk import shrink_model
from ds_train.parity.tolerance import FLOOR_FACTOR, FP32_TOLERANCES, compare, noise_floor, rel, tolerances

STAGES = [str(ROOT / "ds_configs" / f"zero{s}.json") for s in range(4)]
GLOBAL_BATCH = 8  # accumulation 1 and 4 at 1 and 2 processes: micro-batches 8, 2, 4 and 1
STEPS = 5


def series(losses, norms, eval_loss):
    return {"steps": {s + 1: (l, g) for s, (l, g) in enumerate(zip(losses, norms))}, "eval": eval_loss}


def test_a_layout_within_the_tolerances_passes_and_one_past_them_fails():
    ref = series([2.0, 1.5], [1.0, 0.8], 1.4)
    lines, ok = compare(series([2.0, 1.5 * (1 + 5e-6)], [1.0, 0.8 * (1 + 5e-5)], 1.4), ref, 1e-5, 1e-4)
    assert ok and lines[-1] == ("  PASS: largest loss difference 5.0e-06 at step 2 (<= 1e-05), largest gradient-norm "
                                "difference 5.0e-05 at step 2 (<= 0.0001)")
    assert len(lines) == 1 + 2 + 1 + 1  # header, a row per step, the held-out loss, the verdict
    # a loss 2% off at one step fails (a real run with a mean of per-rank means injected:
    # test_bf16_parity_measures_its_noise_floor_and_fails_each_injected_fault)
    _, ok = compare(series([2.0, 1.53], [1.0, 0.8], 1.4), ref, 1e-5, 1e-4)
    assert not ok
    _, ok = compare(series([2.0, 1.5], [1.0, 0.8], 1.41), ref, 1e-5, 1e-4)  # the held-out loss counts too
    assert not ok
    _, ok = compare(series([2.0], [1.0], 1.4), ref, 1e-5, 1e-4)  # a step missing
    assert not ok
    _, ok = compare(series([2.0, math.nan], [1.0, 0.8], 1.4), ref, 1e-5, 1e-4)
    assert not ok and rel(None, 1.0) == math.inf
    assert tolerances("fp32", None, None, None) == FP32_TOLERANCES == (1e-5, 1e-4)


def test_a_mixture_of_experts_layout_is_held_to_the_references_router_counts_and_aux_loss():
    """Tokens per expert per layer: at most ROUTER_TOLERANCE of the routing choices may differ (near ties);
    the aux loss is held to the loss's tolerance; a layout without them fails."""
    ref = {**series([2.0, 1.5], [1.0, 0.8], 1.4), "router": {1: [[6, 2]], 2: [[5, 3]]}, "aux": {1: 2.0, 2: 2.1}}
    same = {**series([2.0, 1.5], [1.0, 0.8], 1.4), "router": {1: [[6, 2]], 2: [[5, 3]]}, "aux": {1: 2.0, 2: 2.1}}
    lines, ok = compare(same, ref, 1e-5, 1e-4)
    assert ok and lines[-3:-1] == [
        "  router aux loss: largest relative difference 0.0e+00 at step 2 (<= 1e-05)",
        "  router: tokens per expert per layer, summed over ranks: largest share of routing choices off the "
        "reference's 0.0e+00 (<= 0.001)"]
    local = {**same, "router": {1: [[3, 1]], 2: [[3, 1]]}}  # each rank's own counts: half of them
    lines, ok = compare(local, ref, 1e-5, 1e-4)
    assert not ok and "off the reference's 3.3e-01 at step 2 (> 0.001)" in lines[-2]
    lines, ok = compare({**same, "aux": {1: 2.0, 2: 2.2}}, ref, 1e-5, 1e-4)
    assert not ok and lines[-3] == "  router aux loss: largest relative difference 4.8e-02 at step 2 (> 1e-05)"
    assert not compare({**same, "router": {1: [[6, 2]]}}, ref, 1e-5, 1e-4)[1]  # a step's counts missing
    assert not compare({k: v for k, v in same.items() if k != "aux"}, ref, 1e-5, 1e-4)[1]


def test_low_precision_tolerances_follow_the_measured_noise_floor_step_by_step():
    """bf16: the reference's layout in bf16 against it in fp32 gives, per step, the largest difference
    so far; a layout may differ by FLOOR_FACTOR x that (never less than fp32's tolerances). A fault
    that shows from the first step fails there even when later steps drift further apart."""
    ref = series([2.0, 1.5, 1.2], [1.0, 0.8, 0.6], 1.1)
    floor = noise_floor(series([2.0 * (1 + 1e-4), 1.5 * (1 + 3e-4), 1.2 * (1 + 1e-4)],
                               [1.0 * (1 + 1e-3), 0.8 * (1 + 1e-3), 0.6 * (1 + 5e-3)], 1.1 * (1 + 4e-4)), ref)
    assert [round(v, 9) for v in floor[0].values()] == [1e-4, 3e-4, 3e-4, 4e-4]  # steps 1-3 so far, then eval
    assert [round(v, 9) for v in floor[1].values()] == [1e-3, 1e-3, 5e-3]
    loss_tol, grad_tol = tolerances("bf16", floor, None, None)
    assert FLOOR_FACTOR == 4 and round(loss_tol[1], 9) == 4e-4 and round(grad_tol[3], 9) == 2e-2
    drifting = series([2.0, 1.5 * (1 + 1e-3), 1.2], [1.0 * (1 + 3e-3), 0.8, 0.6 * (1 + 1.5e-2)], 1.1 * (1 + 1e-3))
    lines, ok = compare(drifting, ref, loss_tol, grad_tol)
    assert ok, lines
    early = series([2.0, 1.5, 1.2], [1.0 * (1 + 6e-3), 0.8, 0.6], 1.1)  # 6e-3 at step 1: past 4 x 1e-3 there
    lines, ok = compare(early, ref, loss_tol, grad_tol)
    assert not ok and "gradient-norm difference 6.0e-03 at step 1 (> 0.004)" in lines[-1], lines[-1]
    assert tolerances("bf16", floor, 1e-2, None)[0] == 1e-2  # --loss-tol replaces the derived one
    tiny = noise_floor(series([2.0, 1.5, 1.2], [1.0, 0.8, 0.6], 1.1), ref)  # no rounding at all: fp32's
    assert tolerances("bf16", tiny, None, None) == ({1: 1e-5, 2: 1e-5, 3: 1e-5, "eval": 1e-5},
                                                     {1: 1e-4, 2: 1e-4, 3: 1e-4})


def test_a_noise_floor_past_what_rounding_explains_widens_no_tolerance(tmp_path):
    """A broken bf16 reference (its layout in bf16 off the fp32 reference by 5%: a skipped update, a
    fault in the bf16 path) would make 4x its floor, 20%, every layout's tolerance: the floor is bounded
    by bf16's epsilon (FLOOR_BOUNDS), said by floor_problem (parity stops on it), and a layout off by as
    much as the broken run still fails."""
    from ds_train.parity.tolerance import FLOOR_BOUNDS, floor_problem

    ref = series([2.0, 1.5, 1.2], [1.0, 0.8, 0.6], 1.1)
    broken = series([2.0 * 1.03, 1.5 * 1.05, 1.2 * 1.03], [1.0 * 1.2, 0.8 * 1.1, 0.6 * 1.1], 1.1 * 1.03)
    floor = noise_floor(broken, ref)
    assert FLOOR_BOUNDS["bf16"] == (2 ** -7, 2 ** -5) and FLOOR_BOUNDS["fp16"] == (2 ** -10, 2 ** -8)
    assert floor_problem("bf16", floor) == ("loss 5.0e-02 at step 2 (bound 7.8e-03); gradient norm 2.0e-01 at "
                                            "step 1 (bound 3.1e-02)")
    loss_tol, grad_tol = tolerances("bf16", floor, None, None)
    assert loss_tol[1] == FLOOR_FACTOR * 2 ** -7 and grad_tol[3] == FLOOR_FACTOR * 2 ** -5
    lines, ok = compare(broken, ref, loss_tol, grad_tol)  # as far off as the broken floor run: fails
    assert not ok and "loss difference 5.0e-02 at step 2 (> 0.031)" in lines[-1], lines[-1]
    from ds_train.errors import UserError
    from ds_train.parity import FLOOR, _measured_floor

    (tmp_path / FLOOR).mkdir()  # the floor run as parity reads it: its env.json and metrics.jsonl
    (tmp_path / FLOOR / "env.json").write_text(json.dumps({"dtype": "bf16"}))
    records = [{"step": s, "train/loss": l, "optim/grad_norm": g} for s, (l, g) in broken["steps"].items()]
    records[-1]["eval/loss"] = broken["eval"]
    (tmp_path / FLOOR / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    with pytest.raises(UserError, match=r"^parity: the bf16 noise-floor run .* by more than bf16 rounding explains: "
                                        r"loss 5.0e-02 at step 2 \(bound 7.8e-03\); gradient norm 2.0e-01"):
        _measured_floor(tmp_path, ref)
    measured = noise_floor(series([2.0 * (1 + 1e-4), 1.5, 1.2], [1.0 * (1 + 2e-3), 0.8, 0.6], 1.1 * (1 + 2e-4)), ref)
    assert floor_problem("bf16", measured) is None  # what this CPU measures: within the bound
    assert floor_problem("fp16", measured) is None


def test_shrink_keeps_the_model_type_and_its_shape_ratios():
    from transformers import AutoConfig

    big = AutoConfig.for_model("llama", hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                               num_attention_heads=64, num_key_value_heads=8, vocab_size=128256,
                               max_position_embeddings=8192, attention_dropout=0.1)
    small, said = shrink_model(big)
    assert small["model_type"] == "llama" and small["vocab_size"] == 128256
    assert (small["num_attention_heads"], small["num_key_value_heads"]) == (8, 1)  # grouped 8:1, as before
    assert (small["hidden_size"], small["head_dim"], small["num_hidden_layers"]) == (128, 16, 2)
    assert small["intermediate_size"] == 352 and small["attention_dropout"] == 0.0
    assert said.startswith("llama: hidden 8192 -> 128, layers 80 -> 2, attention heads 64/8 -> 8/1")
    small, _ = shrink_model(big, heads_multiple=3)  # a layout that splits heads 3 ways still can
    assert small["num_attention_heads"] % 3 == 0 and small["num_attention_heads"] % small["num_key_value_heads"] == 0
    qwen = AutoConfig.for_model("qwen2", hidden_size=512, num_attention_heads=8, num_key_value_heads=2,
                                num_hidden_layers=6)
    small, _ = shrink_model(qwen)
    assert len(small["layer_types"]) == 2 and small["max_window_layers"] == 2
    gpt2, _ = shrink_model(AutoConfig.for_model("gpt2"))
    assert (gpt2["n_embd"], gpt2["n_layer"], gpt2["n_head"], gpt2["n_inner"]) == (64, 2, 4, None)
    assert gpt2["resid_pdrop"] == gpt2["attn_pdrop"] == 0.0


def test_shrink_keeps_per_layer_settings_lists_of_layers_and_derived_widths_consistent():
    """A list of layer indices stays a list of indices (Llama 4's moe_layers: before, every layer was a kind of its
    own and all 48 were kept), settings keyed by layer follow their layers (Gemma 4's per_layer_config), shared
    key/value layers stay shared (Gemma 3n), state-space widths follow the hidden size (Mamba-2's validator), and
    one key/value head for 64 queries stays one (DeepSeek-V4: before, 64 heads of 16 = hidden 1024)."""
    from transformers import AutoConfig

    llama4, _ = shrink_model(AutoConfig.for_model("llama4_text"))
    assert llama4["num_hidden_layers"] == len(llama4["layer_types"]) <= 4
    assert llama4["moe_layers"] == list(range(llama4["num_hidden_layers"]))
    gemma4, _ = shrink_model(AutoConfig.for_model("gemma4_text"))
    assert gemma4["layer_types"] == ["sliding_attention", "full_attention"]
    assert list(gemma4["per_layer_config"]) == ["01"]  # the full-attention layer's, was "05"
    gemma3n, _ = shrink_model(AutoConfig.for_model("gemma3n_text"))
    kept = gemma3n["num_hidden_layers"]
    assert 0 < gemma3n["num_kv_shared_layers"] < kept and len(gemma3n["intermediate_size"]) == kept
    assert set(gemma3n["intermediate_size"]) == {gemma3n["hidden_size"] * 11 // 4}
    AutoConfig.for_model(**gemma3n)
    mamba2, _ = shrink_model(AutoConfig.for_model("mamba2"))
    assert mamba2["num_heads"] * mamba2["head_dim"] == mamba2["expand"] * mamba2["hidden_size"]
    AutoConfig.for_model(**mamba2)  # its validator passes
    v4, _ = shrink_model(AutoConfig.for_model("deepseek_v4"))
    assert (v4["num_attention_heads"], v4["num_key_value_heads"], v4["hidden_size"]) == (4, 1, 64)


@pytest.mark.parametrize("extra, needle", [
    (["--grad-accum", "3"], "--grad-accum 3 at 2 process(es) needs train.global_batch_size=8 divisible by 3 x "
                            "data-parallel size 2; choose 1, 2 or 4"),
    (["--nproc", "3"], "train.global_batch_size=8 is not a multiple of train.micro_batch_size=2 x world size 3"),
    (["--nproc", "0"], "--nproc 0: give positive whole numbers"),
    (["--nproc", "4", "parallel.sequence=3"], "parallel.sequence=3 x parallel.tensor=1 = 3 does not divide the world "
                                              "size 4"),
    (["--out", "OCCUPIED"], "exists and is not a parity directory"),
    (["--loss-tol", "0"], "parity: --loss-tol 0.0: give a positive relative tolerance"),
    (["--grad-tol", "nan"], "parity: --grad-tol nan: give a positive relative tolerance"),
    (["train.debug_loss_fault=halve"], "train.debug_loss_fault=halve: is not KIND[:STAGE] with KIND one of "
                                       "mean_of_rank_means, drop_micro_batch, sequence_divisor"),
])
def test_bad_parity_input_is_one_line_before_any_launch(capsys, tiny_data, tmp_path, extra, needle):
    (tmp_path / "occupied").mkdir()
    (tmp_path / "occupied" / "notes.txt").write_text("mine")
    cfg = write_config(tmp_path / "c.yaml", tiny_config(tiny_data, tmp_path / "run"))
    extra = [str(tmp_path / "occupied") if x == "OCCUPIED" else x for x in extra]
    code = main(["parity", "--config", str(cfg), "--ds-config", STAGES[2], *extra])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and needle in err, (code, err)
    assert (tmp_path / "occupied" / "notes.txt").read_text() == "mine"
    assert not (tmp_path / "run").exists()


# ---- through the real launcher ---------------------------------------------------------------

@pytest.fixture(scope="module")
def sft_data(tmp_path_factory):
    """The RIPT demonstrations as conversations (data.format sft): assistant-only targets, so the
    target count differs between micro-batches and ranks."""
    from ds_train.data.prepare import prepare

    out = tmp_path_factory.mktemp("sft_data")
    prepare([str(ROOT / "recipes" / "data" / "ript_demos.jsonl")], out, vocab_size=300, val_fraction=0.1,
            fmt="sft", chat_template="{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}")
    return out


def metrics(run_dir):
    return {r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


def assert_matches(run, ref) -> None:
    """A layout's run against the reference: every step's loss within 1e-5 and gradient norm within
    1e-4 (relative, fp32), the held-out loss within 1e-5."""
    got = metrics(run)
    assert sorted(got) == list(range(1, STEPS + 1))
    for s in got:
        assert rel(got[s]["train/loss"], ref[s]["train/loss"]) <= 1e-5, (run.name, s)
        assert rel(got[s]["optim/grad_norm"], ref[s]["optim/grad_norm"]) <= 1e-4, (run.name, s)
    assert rel(got[STEPS]["eval/loss"], ref[STEPS]["eval/loss"]) <= 1e-5, run.name


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["pretraining", "sft"])
def test_the_parity_matrix_keeps_the_math(kind, tiny_data, sft_data, straight_zero2, tmp_path):
    """ZeRO stages x accumulation 1 and 4 x data-parallel 1 and 2 against the one-process fp32
    ZeRO-0 reference, 5 steps each: loss within 1e-5 and gradient norm within 1e-4 (relative), the
    held-out loss too. Two launches (one per world size, its layouts in turn) and one reference.
    SFT trains from scratch on assistant-only targets (unequal target counts a rank), under ZeRO
    0/1/2/3: each stage's partitioning of the optimizer, gradients and weights. Pretraining continues
    a ds_train run (model.path: its weights, exported once for every run) under ZeRO-0, where they
    load whole (as under ZeRO-1 and 2), and ZeRO-3, where they load partitioned."""
    data = {"pretraining": tiny_data, "sft": sft_data}[kind]
    stages = (0, 1, 2, 3) if kind == "sft" else (0, 3)
    model = {"path": str(straight_zero2), "config": {}} if kind == "pretraining" else {}
    # continued pretraining at a tenth of the from-scratch lr (at 1e-2 its 5 steps overshoot: the loss rose)
    optim = {"lr": 1e-3} if kind == "pretraining" else {}
    cfg = write_config(tmp_path / "c.yaml", tiny_config(
        data, tmp_path / "unused", train={"global_batch_size": GLOBAL_BATCH, "micro_batch_size": 2},
        data={"dir": str(data), "format": "text" if kind == "pretraining" else "sft"}, optim=optim,
        **({"model": model} if model else {})))
    out = tmp_path / "parity"
    res = ds_train("parity", "--config", str(cfg), "--ds-config", *(STAGES[s] for s in stages), "--nproc", "1",
                   "2", "--grad-accum", "1", "4", "--steps", str(STEPS), "--out", str(out), timeout=900)
    assert res.returncode == 0, res.out[-6000:]
    n = 4 * len(stages)
    assert f"verdict: PASS: {n} of {n} layout(s) within tolerance of the reference over 5 steps" in res.out
    assert sorted(p.name for p in out.glob("launch_*.log")) == ["launch_np1.log", "launch_np2.log"]
    ref = metrics(out / "reference")
    ref_ds = json.loads((out / "reference" / "ds_config.json").read_text())
    assert (ref_ds["zero_optimization"]["stage"], ref_ds["gradient_accumulation_steps"]) == (0, GLOBAL_BATCH)
    assert json.loads((out / "reference" / "env.json").read_text())["world_size"] == 1
    layouts = 0
    for stage in stages:
        for world in (1, 2):
            for accum in (1, 4):
                run = out / f"zero{stage}_np{world}_accum{accum}"
                ds = json.loads((run / "ds_config.json").read_text())
                assert (ds["zero_optimization"]["stage"], ds["gradient_accumulation_steps"],
                        ds["train_batch_size"]) == (stage, accum, GLOBAL_BATCH)
                assert json.loads((run / "env.json").read_text())["world_size"] == world
                assert_matches(run, ref)
                layouts += 1
    assert layouts == n
    assert ref[STEPS]["train/loss"] < ref[1]["train/loss"]  # it trained: the steps are not all alike
    exported = [str(p.relative_to(out)) for p in out.rglob("init_model/config.json")]
    assert exported == (["init_model/config.json"] if kind == "pretraining" else []), exported  # once, for all
    if kind == "sft":  # the case a mean of per-micro-batch means gets wrong: unequal target counts
        from ds_train.data.datasets import SftData, rank_micro_batches
        from ds_train.data.meta import load_meta

        d = SftData(sft_data, "train", load_meta(sft_data)["dtype"], 64, 7, True, "drop", 0)
        counts = [b.n_targets for r in (0, 1) for b in rank_micro_batches(d, 0, GLOBAL_BATCH, 1, r, 2)]
        assert len(set(counts)) > 1, counts


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["pretraining", "sft"])
def test_ulysses_sequence_parallelism_keeps_the_math(kind, tiny_data, sft_data, tmp_path):
    """parallel.sequence 2 on 2 processes (each holds half of every sequence; the attention gathers
    it), ZeRO-2 and ZeRO-3, against the one-process reference without sequence parallelism: loss
    within 1e-5, gradient norm within 1e-4, the held-out loss too (evaluation under SP). SFT: targets
    on the assistant's tokens only, so the two halves of a sequence hold different target counts, and
    examples packed several to a sequence (each attends to itself alone, as in the reference).
    Pretraining computes the loss and the MLPs in tiles (train.loss_tile_tokens, mlp_tile_positions),
    ZeRO-3 gathering the tied head and each MLP again for the backward's recomputation, every decoder
    layer compiled (model.compile=true, its default on a GPU; the reference eager, as parity's always is:
    compiled layers under SP held to the fp32 tolerances; tests/test_compiled_layers.py has the others)."""
    data = {"pretraining": tiny_data, "sft": sft_data}[kind]
    cfg = write_config(tmp_path / "c.yaml", tiny_config(
        data, tmp_path / "unused", train={"global_batch_size": GLOBAL_BATCH, "micro_batch_size": 2},
        data={"dir": str(data), "format": "text" if kind == "pretraining" else "sft", "pack": kind == "sft"}))
    out = tmp_path / "parity"
    # 2 x 32 positions a rank: the loss and every MLP in 2 tiles
    tiles = ["train.loss_tile_tokens=48", "train.mlp_tile_positions=16", "model.compile=true"] \
        if kind == "pretraining" else []
    res = ds_train("parity", "--config", str(cfg), "--ds-config", STAGES[2], STAGES[3], "--nproc", "2",
                   "--sequence", "2", "--steps", str(STEPS), "--out", str(out), *tiles, timeout=600)
    assert res.returncode == 0, res.out[-6000:]
    assert res.out.strip().splitlines()[-1] == ("verdict: PASS: 2 of 2 layout(s) within tolerance of the reference "
                                                f"over 5 steps; the runs are in {out}")
    assert "zero3_np2_sp2_accum4: ZeRO-3, fp32, 2 process(es), sequence parallel 2, micro 2 x accum 4" in res.out
    ref = metrics(out / "reference")
    assert json.loads((out / "reference" / "env.json").read_text())["parallel"] == {"data": 1, "sequence": 1,
                                                                                     "tensor": 1}
    for stage in (2, 3):
        run = out / f"zero{stage}_np2_sp2_accum4"
        assert json.loads((run / "env.json").read_text())["parallel"] == {"data": 1, "sequence": 2, "tensor": 1}
        assert_matches(run, ref)
        compiled = "model.compile: torch.compile(backend='inductor') on 2 LlamaDecoderLayer module(s)"
        log = (run / "logs" / "rank_1.log").read_text()
        assert (compiled in log) == (kind == "pretraining")
        assert "function: 'wrapped_fn'" not in log  # DeepSpeed's NVTX wrapper of ZeRO-3's hooks: not recompiled
        # the start-up probe ran each speed-up against the model's own forward, Ulysses as a collective
        probed = ("tiled loss, tiled MLP, compiled layers, Ulysses attention" if kind == "pretraining"
                  else "Ulysses attention")
        n, packed = probed.count(",") + 1, " over packed examples" if kind == "sft" else ""  # SFT packs, the probe too
        assert f"start-up probe: {probed} against llama's own forward in fp32{packed}: {n} of {n} match" in log, \
            log[-3000:]
    assert ref[STEPS]["train/loss"] < ref[1]["train/loss"]
    if kind == "sft":  # several examples to a sequence: what the attention has to keep apart
        from ds_train.data.datasets import SftData
        from ds_train.data.meta import load_meta

        packed = SftData(sft_data, "train", load_meta(sft_data)["dtype"], 64, 7, True, "drop", 0)
        assert packed.examples >= 2 * packed.num_samples, packed.summary()


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_autotp_tensor_parallelism_keeps_the_math(model_type, tiny_data, tmp_path):
    """parallel.tensor 2 on 2 processes, ZeRO 0-2 (fp32), for Llama (tied embeddings), also as
    data-parallel 2 x tensor 2 on 4 processes, and Qwen2 (biases on q/k/v, an untied head split over
    the vocabulary and gathered; its loss in tiles of 32 tokens through that head, every layout and
    the reference; the data-parallel groups beside tensor parallelism are Llama's to prove), against
    the one-process reference: loss within 1e-5, gradient norm within 1e-4, the held-out loss too.
    Each rank really holds its shard of the split layers."""
    worlds = (2, 4) if model_type == "llama" else (2,)
    model = {**TINY_MODEL, "model_type": model_type, "num_key_value_heads": 2}
    tile = {}
    if model_type == "qwen2":
        model |= {"tie_word_embeddings": False, "use_sliding_window": False}
        tile = {"loss_tile_tokens": 32}  # a micro-batch is 128 tokens
    cfg = write_config(tmp_path / "c.yaml", tiny_config(
        tiny_data, tmp_path / "unused", model={"config": model},
        train={"global_batch_size": GLOBAL_BATCH, "micro_batch_size": 2, **tile}))
    out = tmp_path / "parity"
    res = ds_train("parity", "--config", str(cfg), "--ds-config", *STAGES[:3], "--nproc", *map(str, worlds),
                   "--tensor", "2", "--steps", str(STEPS), "--out", str(out), timeout=900)
    assert res.returncode == 0, res.out[-6000:]
    n = 3 * len(worlds)
    assert f"verdict: PASS: {n} of {n} layout(s) within tolerance of the reference over 5 steps" in res.out
    assert "zero2_np2_tp2_accum4: ZeRO-2, fp32, 2 process(es), tensor parallel 2, micro 2 x accum 4" in res.out
    assert sorted(p.name for p in out.glob("launch_*.log")) == ["launch_np1.log", *(f"launch_np{w}_tp2.log"
                                                                                  for w in worlds)]
    if model_type == "llama":
        assert "zero2_np4_tp2_accum2: ZeRO-2, fp32, 4 process(es), tensor parallel 2, micro 2 x accum 2" in res.out
    ref = metrics(out / "reference")
    for stage in (0, 1, 2):
        for world in worlds:
            run = out / f"zero{stage}_np{world}_tp2_accum{GLOBAL_BATCH // (2 * (world // 2))}"
            assert json.loads((run / "env.json").read_text())["parallel"] == {"data": world // 2, "sequence": 1,
                                                                               "tensor": 2}
            tp = json.loads((run / "ds_config.json").read_text())["tensor_parallel"]
            assert tp == {"autotp_size": 2, "vocab_parallel_lm_head": False}, tp
            assert_matches(run, ref)
            held = {re.search(r"AutoTP: this rank holds ([\d,]+) of the model's ([\d,]+) parameters",
                              (run / "logs" / f"rank_{r}.log").read_text()).groups() for r in range(world)}
            assert len(held) == 1, held  # every rank the same share
            mine, whole = (int(n.replace(",", "")) for n in held.pop())
            assert 0.5 * whole < mine < 0.8 * whole, (mine, whole)  # the layers split, embeddings and norms whole
    assert ref[STEPS]["train/loss"] < ref[1]["train/loss"]


MOE_MODEL = {"model_type": "qwen3_moe", "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "num_experts": 4,
             "num_experts_per_tok": 2, "max_position_embeddings": 128, "tie_word_embeddings": True}


@pytest.mark.slow
def test_autoep_expert_parallelism_keeps_the_math(sft_data, tmp_path):
    """parallel.expert 2 (DeepSpeed AutoEP) on a tiny Qwen3-MoE (4 experts, top 2, its router loss trained:
    output_router_logits), SFT with examples packed several to a sequence (unequal target counts a rank),
    ZeRO 1-3, on 2 processes (expert groups of 2 within data 2) and on 4 (within data 4), against the
    one-process reference (the model's own MoE blocks, every expert on one rank): loss within 1e-5,
    gradient norm within 1e-4, the held-out loss and the router's aux loss too, and the tokens each
    layer's router sent to each expert, summed over the ranks, equal to the reference's counts.
    Each rank really holds half of each layer's experts, and the tokens routed to the other half went
    there and back. ZeRO-1 has a wrong reduction of the router statistics injected
    (train.debug_loss_fault=router_counts_local): it trains the same, and parity fails it on them.
    (Pretraining under EP: tests/test_checkpoint.py, killed and resumed bitwise.)"""
    cfg = write_config(tmp_path / "c.yaml", tiny_config(
        sft_data, tmp_path / "unused", model={"config": dict(MOE_MODEL, output_router_logits=True)},
        train={"global_batch_size": GLOBAL_BATCH, "micro_batch_size": 2},
        data={"dir": str(sft_data), "format": "sft", "pack": True}))
    out = tmp_path / "parity"
    res = ds_train("parity", "--config", str(cfg), "--ds-config", *STAGES[1:], "--nproc", "2", "4",
                   "--expert", "2", "--steps", str(STEPS), "--out", str(out),
                   "train.debug_loss_fault=router_counts_local:1", timeout=900)
    assert res.returncode == 1, res.out[-6000:]
    assert "verdict: FAIL: 4 of 6 layout(s) within tolerance of the reference over 5 steps" in res.out, res.out[-3000:]
    assert "zero3_np4_ep2_accum1: ZeRO-3, fp32, 4 process(es), expert parallel 2, micro 2 x accum 1" in res.out
    verdicts = re.findall(r"^(zero\d_np\d_ep2)_accum\d: .*\n(?:.*\n)*?  router: (.*)\n  (PASS|FAIL)", res.out, re.M)
    assert [(name, verdict) for name, _, verdict in verdicts] == [
        (f"zero{stage}_np{world}_ep2", "FAIL" if stage == 1 else "PASS") for world in (2, 4) for stage in (1, 2, 3)]
    assert all("off the reference's 0.0e+00 (<= 0.001)" in said for name, said, _ in verdicts if "zero1" not in name)
    ref = metrics(out / "reference")
    assert all(ref[s]["moe/aux_loss"] > 0 and len(ref[s]["moe/tokens_per_expert"]) == 2 for s in ref)
    tokens = [sum(map(sum, ref[s]["moe/tokens_per_expert"])) for s in ref]
    assert len(set(tokens)) == 1 and tokens[0] == 2 * 2 * GLOBAL_BATCH * 64  # layers x top 2 x every token, once
    for stage in (1, 2, 3):
        for world in (2, 4):
            run = out / f"zero{stage}_np{world}_ep2_accum{GLOBAL_BATCH // (2 * world)}"
            assert json.loads((run / "env.json").read_text())["parallel"] == {"data": world, "sequence": 1,
                                                                               "tensor": 1, "expert": 2}
            assert json.loads((run / "ds_config.json").read_text())["expert_parallel"] == {
                "enabled": True, "autoep_size": 2, "preset_model": "qwen3_moe"}
            assert_matches(run, ref)
            got = metrics(run)
            for s in got:
                assert rel(got[s]["moe/aux_loss"], ref[s]["moe/aux_loss"]) <= 1e-5, (run.name, s)
                counts = got[s]["moe/tokens_per_expert"]
                assert (counts == ref[s]["moe/tokens_per_expert"]) == (stage > 1), (run.name, s)  # exact
                assert stage > 1 or sum(map(sum, counts)) < sum(map(sum, ref[s]["moe/tokens_per_expert"]))
            for r in range(world):
                log = (run / "logs" / f"rank_{r}.log").read_text()
                assert f"AutoEP: 2 MoE layer(s) split; expert rank {r % 2} holds 2 of each one's 4 experts" in log
    assert ref[STEPS]["train/loss"] < ref[1]["train/loss"]


def loaded(run_dir):
    import yaml

    return yaml.safe_load((run_dir / "config.yaml").read_text())


@pytest.mark.slow
def test_bf16_parity_measures_its_noise_floor_and_fails_each_injected_fault(tiny_data, sft_data, tmp_path):
    """bf16 (GPU's default) in two launches. (1) SFT (unequal target counts a rank), 4 processes of
    data 2 x sequence 2, ZeRO 0-3 with train.debug_loss_fault putting one mistake under each of ZeRO
    1-3: the tolerances come from the noise floor (the reference's layout in bf16); ZeRO-0 (bf16 +
    ZeRO-0 + Ulysses, at parity since its optimizer's initial step is undone) passes, and each fault
    fails: a mean of per-rank means, a dropped micro-batch, the sequence divisor of the other stage.
    (2) AutoTP 2 (ZeRO 1 and 2) passes bf16 parity; --tf32 lets the fp32 reference use TF32."""
    cfg = write_config(tmp_path / "sft.yaml", tiny_config(
        sft_data, tmp_path / "unused", model={"dtype": "bf16"},
        data={"dir": str(sft_data), "format": "sft", "pack": True},
        train={"global_batch_size": GLOBAL_BATCH, "micro_batch_size": 2}))
    out = tmp_path / "faults"
    faults = "mean_of_rank_means:1,drop_micro_batch:2,sequence_divisor:3"
    res = ds_train("parity", "--config", str(cfg), "--ds-config", *STAGES, "--nproc", "4", "--sequence", "2",
                   "--steps", str(STEPS), "--out", str(out), f"train.debug_loss_fault={faults}", timeout=900)
    assert res.returncode == 1, res.out[-6000:]
    assert "verdict: FAIL: 1 of 4 layout(s) within tolerance of the reference over 5 steps" in res.out, res.out[-3000:]
    assert "TF32 off in the fp32 runs" in res.out
    floor_line = next(line for line in res.out.splitlines() if line.startswith("noise floor: "))
    assert "the reference's layout in bf16 differs from it in fp32 by up to" in floor_line, floor_line
    verdicts = {m.group(1): m.group(2) for m in re.finditer(r"^(zero\d)_np4_sp2_accum2: .*\n(?:.*\n)*?  (PASS|FAIL)",
                                                             res.out, re.M)}
    assert verdicts == {"zero0": "PASS", "zero1": "FAIL", "zero2": "FAIL", "zero3": "FAIL"}, verdicts
    floor, ref = loaded(out / "floor"), loaded(out / "reference")
    assert (floor["model"]["dtype"], ref["model"]["dtype"], ref["model"]["tf32"]) == ("bf16", "fp32", False)
    assert floor["train"]["debug_loss_fault"] == ref["train"]["debug_loss_fault"] == ""
    assert loaded(out / "zero0_np4_sp2_accum2")["train"]["debug_loss_fault"] == faults
    assert json.loads((out / "zero0_np4_sp2_accum2" / "env.json").read_text())["parallel"] == {
        "data": 2, "sequence": 2, "tensor": 1}
    assert json.loads((out / "floor" / "env.json").read_text())["dtype"] == "bf16"

    model = {**TINY_MODEL, "num_key_value_heads": 2}
    cfg = write_config(tmp_path / "tp.yaml", tiny_config(
        tiny_data, tmp_path / "unused", model={"config": model, "dtype": "bf16"},
        train={"global_batch_size": GLOBAL_BATCH, "micro_batch_size": 2}))
    res = ds_train("parity", "--config", str(cfg), "--ds-config", *STAGES[1:3], "--nproc", "2", "--tensor", "2",
                   "--steps", str(STEPS), "--out", str(tmp_path / "tp"), "--tf32", timeout=600)
    assert res.returncode == 0, res.out[-6000:]
    assert "verdict: PASS: 2 of 2 layout(s) within tolerance of the reference over 5 steps" in res.out
    assert "zero2_np2_tp2_accum4: ZeRO-2, bf16, 2 process(es), tensor parallel 2" in res.out
    assert "TF32 allowed (--tf32) in the fp32 runs" in res.out
    assert loaded(tmp_path / "tp" / "reference")["model"]["tf32"]


def test_a_layout_the_model_cannot_take_is_refused_before_any_launch(tiny_data, tmp_path):
    """--sequence 3 on a model of 4 attention heads: one line from the layout check the run uses
    (parallel.check_layout), exit 2, and no launch started (no launch log, no out directory)."""
    from conftest import expect_error

    cfg = write_config(tmp_path / "c.yaml", tiny_config(tiny_data, tmp_path / "unused"))
    out = tmp_path / "parity"
    expect_error(["parity", "--config", str(cfg), "--ds-config", STAGES[2], "--nproc", "3", "--sequence", "3",
                  "--steps", "2", "--out", str(out)],
                 "parallel.sequence=3 does not divide the model's 4 attention heads")
    assert not out.exists()
