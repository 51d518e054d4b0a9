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


# What each fault does to a speed-up, per dtype: a factor past what the dtype's rounding explains.
WRONG = {"fp32": 1 + 2.0 ** -6, "bf16": 1 + 2.0 ** -3}


@pytest.mark.parametrize("speedup", ["tiled loss", "fused loss", "tiled MLP", "compiled layers"])
def test_a_speedup_that_computes_something_else_is_never_kept(speedup, monkeypatch):
    """No cell "runs, wrong": each speed-up made to compute something else (the loss's tiles, the fused
    tiles' loss and gradients, each MLP tile, each compiled layer 1.6% off in fp32, 12.5% in bf16) is refused
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
