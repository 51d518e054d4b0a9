"""The start-up probe (ds_train/train/probe.py): each speed-up against the model's own forward, the head
factor measured, not listed; a speed-up that does not hold is refused where asked for, turned off where
on by default, never run wrong."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import ROOT, deepspeed_train, expect_error, tiny_config, write_config

torch = pytest.importorskip("torch")

# The table: what each model type's forward does after its head, at these settings.
HEADS = [("granite", {"logits_scaling": 4.0}, 0.25),  # divides
         ("hyperclovax", {"logits_scaling": 4.0}, 4.0),  # multiplies
         ("falcon_h1", {"lm_head_multiplier": 0.25}, 0.25),  # multiplies
         ("recurrent_gemma", {}, None)]  # soft-caps at 30, its default: no constant factor


def run_config(**train):
    from ds_train.config.file import build_config

    raw = tiny_config("/nonexistent/data", "/nonexistent/run")
    raw["train"].update({"seq_len": 2048, "micro_batch_size": 1, "global_batch_size": 1, **train})
    return build_config(raw, source="test")


def probe_of(model_type: str, settings: dict, dtype: str = "fp32", **train):
    from transformers import AutoConfig

    from ds_train.plan.parallel import ParallelDims
    from ds_train.train.probe import probe

    return probe(run_config(**train), AutoConfig.for_model(model_type, **settings), dtype, "cpu", ParallelDims(1), 0)


def tiled_against_full(model_type: str, settings: dict, fast) -> float:
    """The relative difference between the loss a run with these speed-ups computes (tiles of 16 tokens,
    their head factor) and the loss from the model's own logits, on a model of this type other than the
    probe's (another width, another seed)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from ds_train.data.examples import Batch
    from ds_train.model.shrunk import shrink_model
    from ds_train.train.losses import forward_loss

    small, _ = shrink_model(AutoConfig.for_model(model_type, **settings), heads_multiple=3)
    small.pop("model_type")
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **small))
    rng = np.random.default_rng(1)
    vocab = model.config.vocab_size
    batch = Batch(rng.integers(0, vocab, (2, 40)), rng.integers(0, vocab, (2, 40)), None)
    with torch.no_grad():
        full = float(forward_loss(model, batch)[0])
        tiled = float(forward_loss(model, batch, 16 if fast.loss_tile_tokens else 0, False, fast.head_factor)[0])
    return abs(tiled - full) / abs(full)


@pytest.mark.parametrize("model_type, settings, factor", HEADS, ids=[h[0] for h in HEADS])
def test_each_model_types_tiled_loss_is_its_own_or_off_or_refused(model_type, settings, factor):
    """On by default (train.loss_tile_tokens 1024 under 2,048-token micro-batches): the probe measures the
    head factor (Granite's 1 / 4, HyperCLOVA X's 4, Falcon-H1's 0.25) and the tiled loss then equals the
    model's own within 1e-5 on another model of the type; RecurrentGemma's soft cap keeps the full logits,
    one line saying so. Asked for explicitly (32 tokens), a soft cap is refused in one line naming the model
    type, the speed-up and the setting that turns it off. (Before: 132.9, 2.078 and 0.117 against 8.4.)"""
    from ds_train.errors import UserError

    fast = probe_of(model_type, settings)
    assert fast.probed.startswith(f"start-up probe: tiled loss against {model_type}'s own forward in fp32")
    if factor is None:
        assert fast.loss_tile_tokens == 0 and fast.head_factor == 1
        assert fast.notes == (f"train.loss_tile_tokens: the tiled loss does not match {model_type}'s own forward: "
                              f"its logits are not a constant times its head's output (an op after the head, such "
                              f"as a soft cap: " + fast.notes[0].split("soft cap: ")[1],)
        with pytest.raises(UserError, match=rf"^train\.loss_tile_tokens: the tiled loss does not match {model_type}'s "
                                            r"own forward: .*; set train\.loss_tile_tokens=0$"):
            probe_of(model_type, settings, loss_tile_tokens=32)
    else:
        assert (fast.loss_tile_tokens, fast.notes) == (1024, ())
        assert fast.head_factor == pytest.approx(factor, rel=1e-6)
        assert f"(head factor {factor:g})" in fast.probed
    assert tiled_against_full(model_type, settings, fast) <= 1e-5


def test_nothing_to_probe_costs_nothing():
    """Micro-batches within a tile, the MLP within a tile, eager layers, no sequence parallelism: no probe
    model is built (the run's speed-ups as configured)."""
    from ds_train.model.speedups import configured

    fast = probe_of("llama", {}, seq_len=64)
    assert fast == configured(run_config(seq_len=64), "cpu") and fast.probed == ""


# What each fault does to a speed-up, per dtype: 1.6% (2^-6), past fp32's tolerance and at bf16's bound (its
# rounding, 2^-7 relative, and the gradients' 4 x 2^-7, let a fault of the tiled MLP's at 2^-6 through before
# the probe held bf16 to the fp32 forward of the same weights).
WRONG = {"fp32": 1 + 2.0 ** -6, "bf16": 1 + 2.0 ** -6}


@pytest.mark.parametrize("speedup", ["tiled loss", "fused loss", "tiled MLP", "compiled layers"])
def test_a_speedup_that_computes_something_else_is_never_kept(speedup, monkeypatch):
    """No cell "runs, wrong": each speed-up made to compute something else (the loss's tiles, the fused
    tiles' loss and gradients, each MLP tile, each compiled layer 1.6% off, in fp32 and in bf16) is refused
    where the config asks for it, and turned off where it is on by default (Llama)."""
    import ds_train.model.tiled_mlp as tiled_mlp
    import ds_train.train.losses as losses
    import ds_train.train.probe as probe
    from ds_train.errors import UserError

    wrong = [WRONG["fp32"]]
    if speedup == "tiled loss":
        monkeypatch.setattr(losses, "tiled_loss_sum", lambda *a, _f=losses.tiled_loss_sum: _f(*a) * wrong[0])
        explicit, key = {"loss_tile_tokens": 512}, "train.loss_tile_tokens"
    elif speedup == "fused loss":
        monkeypatch.setattr(losses, "fused_loss_sum", lambda *a, _f=losses.fused_loss_sum: _f(*a) * wrong[0])
        explicit, key = {"fused_loss": True}, "train.fused_loss"
    elif speedup == "tiled MLP":
        def wrong_tile(mlp, shards, _tile=tiled_mlp._tile):
            _tile(mlp, shards)
            tiled = mlp.forward
            mlp.forward = lambda x: tiled(x) * wrong[0]
        monkeypatch.setattr(tiled_mlp, "_tile", wrong_tile)
        explicit, key = {"mlp_tile_positions": 512}, "train.mlp_tile_positions"
    else:
        def wrong_compile(model, backend):  # each layer's output scaled (not compiled: the fault is the point)
            for layer in model.model.layers:
                layer.register_forward_hook(lambda m, a, out: (out[0] * wrong[0], *out[1:]) if isinstance(out, tuple)
                                            else out * wrong[0])
            return len(model.model.layers), "LlamaDecoderLayer"
        monkeypatch.setattr(probe, "compile_layers", wrong_compile)
        explicit, key = {}, "model.compile"
    model = {"compile": True} if speedup == "compiled layers" else {}
    for dtype in ("fp32", "bf16"):
        wrong[0] = WRONG[dtype]
        with pytest.raises(UserError, match=rf"^{key}: the {speedup} does not match llama's own forward: loss .*"
                                            rf"relative; set {key}=(0|false)$"):
            _probe_with(dtype, model, seq_len=2048, **explicit)
    if speedup in ("tiled loss", "tiled MLP"):  # on by default: off for the run, one line saying so
        wrong[0] = WRONG["fp32"]
        fast = _probe_with("fp32", {}, seq_len=16384, micro_batch_size=1, global_batch_size=1)
        field = "loss_tile_tokens" if speedup == "tiled loss" else "mlp_tile_positions"
        assert getattr(fast, field) == 0 and any(n.startswith(f"{key}: the {speedup} does not match llama's")
                                                 for n in fast.notes)


def _probe_with(dtype: str, model: dict, **train):
    from transformers import AutoConfig

    from ds_train.config.file import build_config
    from ds_train.plan.parallel import ParallelDims
    from ds_train.train.probe import probe

    raw = tiny_config("/nonexistent/data", "/nonexistent/run", model={"compile": True} if model else {})
    raw["train"].update({"micro_batch_size": 1, "global_batch_size": 1, **train})
    cfg = build_config(raw, source="test")
    return probe(cfg, AutoConfig.for_model("llama", vocab_size=512), dtype, "cpu", ParallelDims(1), 0)


@pytest.mark.parametrize("dtype, compiled", [("fp32", True), ("bf16", False)])
def test_every_speedup_that_holds_is_kept(dtype, compiled):
    """The tiled and fused loss, the tiled MLP and (fp32) compiled layers, inductor's for real, on Llama: each
    within the dtype's tolerance of the model's own forward, each kept, the probe's line saying so."""
    fast = _probe_with(dtype, {"compile": True} if compiled else {}, seq_len=2048, loss_tile_tokens=512,
                       fused_loss=True, mlp_tile_positions=512)
    assert (fast.loss_tile_tokens, fast.fused_loss, fast.mlp_tile_positions, fast.compile) == (512, True, 512, compiled)
    names = "tiled loss, fused loss, tiled MLP" + (", compiled layers" if compiled else "")
    n = 3 + compiled
    assert fast.notes == () and fast.probed.startswith(
        f"start-up probe: {names} against llama's own forward in {dtype}: {n} of {n} match (")


@pytest.mark.slow
def test_a_refusal_from_the_probe_comes_before_anything_is_written(tiny_data, tmp_path):
    """`ds-train train` on a RecurrentGemma with the tiled loss asked for: exit 2, one line, and no output_dir
    (the probe runs after the process group is up, before the run directory)."""
    model = {"model_type": "recurrent_gemma", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 16, "lru_width": 64}
    out = tmp_path / "run"
    cfg = write_config(tmp_path / "c.yaml", tiny_config(tiny_data, out, model={"config": model},
                                                        train={"loss_tile_tokens": 32}))
    expect_error(["train", "--config", str(cfg), "--ds-config", str(ROOT / "ds_configs" / "zero0.json")],
                 "train.loss_tile_tokens: the tiled loss does not match recurrent_gemma's own forward",
                 "; set train.loss_tile_tokens=0")
    assert not out.exists()


def test_a_model_type_the_probe_cannot_shrink_keeps_no_unchecked_speedup():
    """Mamba-2 at probe size fails its config's own validator (its heads x head width must equal hidden x
    expand): nothing is checked, so the tiled loss on by default is off with one line, and asked for it is
    refused in one line, never a traceback and never kept unchecked."""
    from ds_train.errors import UserError

    fast = probe_of("mamba2", {})
    assert fast.loss_tile_tokens == 0 and fast.notes[0].startswith(
        "train.loss_tile_tokens: the tiled loss does not match mamba2's own forward: the probe cannot build a small "
        "mamba2 to check it against (")
    with pytest.raises(UserError, match=r"^train\.loss_tile_tokens: .*the probe cannot build a small mamba2.*; set "
                                        r"train\.loss_tile_tokens=0$"):
        probe_of("mamba2", {}, loss_tile_tokens=32)


def test_ulysses_reads_the_width_of_the_heads_the_attention_gets():
    """DeepSpeed's Ulysses takes `head_dim` where the config has the key: Mixtral's None is hidden / heads, and
    multi-head latent attention's `head_dim` (its rotary part) gives way to the query/key width."""
    from transformers import AutoConfig

    from ds_train.model.ulysses import _with_head_size

    mixtral = AutoConfig.for_model("mixtral", hidden_size=64, num_attention_heads=4, head_dim=None)
    assert mixtral.head_dim is None and _with_head_size(mixtral).get_text_config().head_dim == 16
    mla = AutoConfig.for_model("deepseek_v3", qk_rope_head_dim=8, qk_nope_head_dim=24, head_dim=8)
    assert _with_head_size(mla).get_text_config().head_dim == 32 and mla.head_dim == 8  # the model's own kept
    llama = AutoConfig.for_model("llama", hidden_size=64, num_attention_heads=4)
    assert _with_head_size(llama) is llama


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ulysses_that_raises_on_the_model_is_refused_by_every_rank_before_anything_is_written(tiny_data, tmp_path):
    """A DeepSeek-V3 whose values are narrower than its queries and keys (as the real one's, 128 and 192) under
    parallel.sequence=2 on 2 processes: DeepSpeed's Ulysses takes one head width, and raises on it inside the
    probe, which is a collective. Every rank raises at the same point and the ranks agree: the one line, naming
    the speed-up and its setting, said once; the run exits 2 with no output_dir, and neither rank hangs."""
    model = {"model_type": "deepseek_v3", "hidden_size": 64, "intermediate_size": 176, "moe_intermediate_size": 88,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4, "kv_lora_rank": 32,
             "q_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 8, "head_dim": 8,
             "n_routed_experts": 4, "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1,
             "first_k_dense_replace": 1, "max_position_embeddings": 128}
    out = tmp_path / "run"
    cfg = write_config(tmp_path / "c.yaml", tiny_config(tiny_data, out, model={"config": model},
                                                        parallel={"sequence": 2}))
    res = deepspeed_train(cfg, "zero2.json", timeout=240)
    line = ("ds-train: error: parallel.sequence: the Ulysses attention does not match deepseek_v3's own forward: it "
            "raises AssertionError: [{rank}]: key or value input tensor does not match the required shape")
    assert res.returncode == 2, res.out[-3000:]
    assert line.format(rank=0) in res.out and res.out.count("ds-train: error:") == 1, res.out[-3000:]
    assert "value.shape=torch.Size([32, 2, 4, 8]); set parallel.sequence=1" in res.out  # what differs, whole
    assert "Traceback" not in res.out
    assert not out.exists()


# ---- the probe model: every kind of layer, the lengths the run reaches, lists tied to the head width ----

KINDS = [("jamba", {}), ("bamba", {"attn_layer_indices": [9, 18, 27]}), ("recurrent_gemma", {}), ("lfm2", {}),
         ("lfm2", {"num_hidden_layers": 16, "full_attn_idxs": [2, 5, 8, 10, 12, 14]})]


@pytest.mark.parametrize("model_type, settings", KINDS, ids=["jamba", "bamba", "recurrent_gemma", "lfm2", "lfm2-1.2b"])
def test_the_probe_model_holds_every_kind_of_layer_the_model_has(model_type, settings):
    """The kinds of layer of the model type's own model, built from its config on the meta device (each decoder
    layer's class, the classes it holds and its layer type), are all in the probe model's, in few layers. Before,
    read from config-key spellings: Jamba's attention layer (period 8, offset 4) and Bamba's attn_layer_indices
    were dropped, RecurrentGemma's 3-long pattern kept only recurrent layers, LFM2's default kept all 32 layers."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from ds_train.model.shrunk import layer_kinds, shrink_model

    hf = AutoConfig.for_model(model_type, **settings)
    with torch.device("meta"):
        full = layer_kinds(AutoModelForCausalLM.from_config(hf), hf)
    small, _ = shrink_model(hf)
    small.pop("model_type")
    config = AutoConfig.for_model(model_type, **small)
    with torch.device("meta"):
        kept = layer_kinds(AutoModelForCausalLM.from_config(config), config)
    assert set(full) <= set(kept) and len(set(full)) >= (1 if model_type == "lfm2" and not settings else 2)
    assert len(kept) <= 5, len(kept)  # Jamba's first 5 hold its 3 kinds


def test_lengths_the_run_reaches_are_cut_below_the_probes_and_those_it_does_not_kept_above():
    """A sliding window, Llama 4's chunk and LongRoPE's original length that a run of 8,192 tokens reaches are
    cut to 16, inside the probe's 64 tokens (at 64 tokens a window of 4,096 was never active), max_position_
    embeddings keeping its ratio to the original length; a run of 2,048 tokens keeps them (and a window of 32
    the run does not reach is not made active at 64)."""
    from transformers import AutoConfig

    from ds_train.model.shrunk import shrink_model

    mistral = AutoConfig.for_model("mistral", sliding_window=4096)
    assert shrink_model(mistral, lengths=(8192, 64))[0]["sliding_window"] == 16
    assert shrink_model(mistral, lengths=(2048, 64))[0]["sliding_window"] == 4096
    assert shrink_model(AutoConfig.for_model("mistral", sliding_window=32), lengths=(16, 64))[0]["sliding_window"] == 64
    llama4 = AutoConfig.for_model("llama4_text")
    assert shrink_model(llama4, lengths=(16384, 64))[0]["attention_chunk_size"] == 16
    phi = shrink_model(AutoConfig.for_model("phi3", **PHI35), lengths=(8192, 64))[0]
    assert (phi["original_max_position_embeddings"], phi["rope_parameters"]["original_max_position_embeddings"],
            phi["max_position_embeddings"]) == (16, 16, 512)  # 131072 / 4096 = 512 / 16


# Phi-3.5-mini's RoPE: LongRoPE, 48 factors (one a frequency of its 96-wide heads), 4,096 tokens original
PHI35 = {"hidden_size": 3072, "num_attention_heads": 32, "num_key_value_heads": 32, "max_position_embeddings": 131072,
         "original_max_position_embeddings": 4096, "vocab_size": 512, "pad_token_id": 0,
         "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 4096,
                             "long_factor": [1.0 + i / 8 for i in range(48)],
                             "short_factor": [1.0 + i / 64 for i in range(48)]}}


def test_lists_tied_to_the_head_width_shrink_with_it_no_false_refusal():
    """Phi-3.5-mini's LongRoPE factors (48 for 96-wide heads) become 8 for the probe's 16, end points kept, and
    at 8,192 tokens (past its original 4,096: the long factors) the tiled loss is probed and kept, where before
    the probe could not build them and turned it off. Qwen3.5's multimodal RoPE sections [11, 11, 10] (a quarter
    of 256-wide heads) scale to the probe's width, and its small model runs."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from ds_train.model.shrunk import shrink_model

    small = shrink_model(AutoConfig.for_model("phi3", **PHI35))[0]["rope_parameters"]
    assert (len(small["long_factor"]), small["long_factor"][0], small["long_factor"][-1]) == (8, 1.0, 1.0 + 47 / 8)
    fast = probe_of("phi3", PHI35, seq_len=8192)
    assert (fast.loss_tile_tokens, fast.notes) == (1024, ()), fast.notes
    assert fast.probed.startswith("start-up probe: tiled loss against phi3's own forward in fp32: 1 of 1 match")
    qwen = {"head_dim": 256, "vocab_size": 512, "rope_parameters": {
        "rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25, "mrope_interleaved": True,
        "mrope_section": [11, 11, 10]}}
    small = shrink_model(AutoConfig.for_model("qwen3_5_text", **qwen))[0]
    assert small["rope_parameters"]["mrope_section"] == [1, 1, 0]  # 32 of 128 frequencies -> 2 of 8
    small.pop("model_type")
    out = AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen3_5_text", **small))(
        input_ids=torch.zeros(1, 8, dtype=torch.long), use_cache=False)
    assert out.logits.shape == (1, 8, 512)


# ---- Ulysses: what it drops, refused in one line ----

ULYSSES = [("llama4_text", {}, 16384, "parallel.sequence=2: llama4_text attends within chunks of 8192 tokens "
            "(attention_chunk_size), which live in the attention mask Ulysses drops: its 16384-token sequences would "
            "get full causal attention; use train.seq_len <= 8192 or parallel.sequence=1"),
           ("gemma3_text", {"use_bidirectional_attention": True}, 2048,
            "parallel.sequence=2: gemma3_text's bidirectional attention (use_bidirectional_attention=True) lives in "
            "the attention mask Ulysses drops (it attends causally); set model.config.use_bidirectional_attention="
            "false or parallel.sequence=1"),
           ("phi3", PHI35, 8192, "parallel.sequence=2: phi3's longrope RoPE takes its frequencies from the largest "
            "position id a forward sees, past 4096 tokens; under Ulysses each rank sees only its part's (4096 of "
            "8192), so the ranks' frequencies differ from the whole sequence's; use train.seq_len <= 4096, a RoPE "
            "type that does not depend on the length, or parallel.sequence=1"),
           ("llama", {"max_position_embeddings": 16384, "rope_parameters": {
               "rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0, "original_max_position_embeddings": 2048}},
            8192, "parallel.sequence=2: llama's dynamic RoPE takes its frequencies from the largest position id")]


@pytest.mark.parametrize("model_type, settings, seq_len, line", ULYSSES, ids=[u[0] for u in ULYSSES])
def test_ulysses_is_refused_where_it_drops_a_mask_or_splits_a_length_dependent_rope(model_type, settings, seq_len,
                                                                                       line):
    """Llama 4's chunked attention (DeepSpeed's Ulysses attention drops the mask: it ran full causal attention),
    bidirectional attention, and RoPE that reads max(position_ids) (LongRoPE, dynamic NTK: each rank's part gave
    other frequencies, cos off by up to 2.38 at 8,192 tokens) are refused by the probe in one line at
    parallel.sequence=2, before any collective; within the length where nothing changes they are not."""
    from transformers import AutoConfig

    from ds_train.errors import UserError
    from ds_train.plan.parallel import ParallelDims
    from ds_train.train.probe import probe

    hf = AutoConfig.for_model(model_type, **settings)
    cfg = run_config(seq_len=seq_len, loss_tile_tokens=0, mlp_tile_positions=0)
    with pytest.raises(UserError) as e:
        probe(cfg, hf, "fp32", "cpu", ParallelDims(1, sequence=2), 0)
    assert str(e.value).startswith(line), str(e.value)
    if model_type != "gemma3_text":
        from ds_train.model.ulysses import check_ulysses

        check_ulysses(hf, 2, seq_len // 4)  # shorter than the chunk / the original length: kept


# ---- bf16: a trained model's logit scale, the fp32 forward as the reference; packed examples ----

def test_the_probe_model_has_a_trained_models_logit_scale():
    """At random init a Llama's logits spread ~0.16 and the loss is about ln V whatever the layers compute; the probe
    model's are scaled to LOGIT_STD (4), as a trained model's."""
    from transformers import AutoConfig

    from ds_train.model.shrunk import shrink_model
    from ds_train.train.probe import LOGIT_STD, _ids, _probe_model

    hf = AutoConfig.for_model("llama", vocab_size=512)
    model = _probe_model(run_config(), shrink_model(hf)[0], "fp32", 7)
    with torch.no_grad():
        logits = model(input_ids=torch.from_numpy(_ids(hf, 7)[:, :64])).logits
    assert float(logits.std()) == pytest.approx(LOGIT_STD, rel=0.05)


def test_a_run_that_packs_is_probed_over_packed_examples():
    """sft with data.pack (auto or true): the probe's rows are two examples each, position ids restarting (as
    the run's are); the tiled loss is compared over them, and the line says so."""
    fast = _probe_with("fp32", {}, seq_len=2048, loss_tile_tokens=512)
    assert "packed" not in fast.probed
    from ds_train.config.file import build_config
    from ds_train.plan.parallel import ParallelDims
    from ds_train.train.probe import probe
    from transformers import AutoConfig

    raw = tiny_config("/nonexistent/data", "/nonexistent/run", data={"dir": "/nonexistent/data", "format": "sft"})
    raw["train"].update({"micro_batch_size": 1, "global_batch_size": 1, "seq_len": 2048, "loss_tile_tokens": 512})
    fast = probe(build_config(raw, source="test"), AutoConfig.for_model("llama", vocab_size=512), "fp32", "cpu",
                 ParallelDims(1), 0)
    assert fast.probed.startswith("start-up probe: tiled loss against llama's own forward in fp32 over packed "
                                  "examples: 1 of 1 match"), fast.probed
