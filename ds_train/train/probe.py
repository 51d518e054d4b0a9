"""The start-up probe: each speed-up a run turns on that replaces part of the model's forward, run once
against the model's own forward before anything is written, instead of lists of model types.

The speed-ups assume things about a model's forward that model types break: the tiled and fused loss
compute the head's logits themselves (a model that scales, soft-caps or cuts them after its head gets
another loss), the tiled MLP recomputes each MLP in pieces, compiled layers run inductor's code,
Ulysses hands each rank's attention the whole sequence on some of the heads, Liger replaces norms, RoPE
and MLP. So each one the run turns on (model.speedups.configured) is run on a *probe model*: the run's
model type and config with its sizes shrunk (model/shrunk.py: 2 layers or one of each kind, 16 per head;
every multiplier, scale and cap kept), built from its config, seeded, on the run's device in the run's
dtype, its logits at a trained model's scale (LOGIT_STD), over a few synthetic token ids (two packed examples
a row where the run packs). Its summed loss and its gradients are compared with those of the model's own eager
forward, the loss from its own logits: within the dtype's tolerance (TOLERANCES), and in bf16 and fp16 no
farther from the fp32 forward of the same weights than the own forward is (LOW_PRECISION_RATIO), or the speed-up
does not hold for this model. Windows, chunks and RoPE's original lengths the run reaches are cut inside the
probe's sequence (shrink_model's `lengths`), so that the probe reaches them too; what Ulysses cannot run (a mask
pattern it drops, RoPE that reads the largest position id) is refused first (model.ulysses.check_ulysses).

What the model does after its head is measured, not listed: the head's output is replaced by a random
tensor Z spanning six decades, and the logits the forward returns must be c x Z for one constant c (the
head factor: 1 for most, 1 / logits_scaling for Granite, logit_scale for Cohere), the same c at another
width, with no weight of the model in it. The tiled loss then computes c x the head's output tile by tile.
A soft cap, a cut of a padded vocabulary, or anything else leaves the model's full logits.

A speed-up that does not hold: where the config asks for it explicitly (a value other than its default),
one line naming the model type, the speed-up, the difference and the setting that turns it off, before
anything is written; where it is on by default (the tiled loss and MLP, model.compile=auto), it is turned
off for this run and a line says so.

How it runs across ranks: every rank probes on its own (the same seed and synthetic ids give every rank
the same verdict; nothing is exchanged), after the process group is up and before anything is written.
The probe model has no ZeRO-3 partitioning and no tensor parallelism: whether a layout keeps the math is
`ds-train parity`'s to prove, and a speed-up's agreement with a model's forward does not depend on the
layout. Ulysses is the exception: its probe is a collective over each sequence-parallel group, each rank
holding its part of the probe's sequences as in training, the summed loss and gradients of the group
against the whole sequences' on one rank.

Its cost: a probe model built and a few forward and backward passes over 2 x 64 tokens, independent of
the model's size, plus inductor's compile of the probe's layers where compiled layers are on (docs/models.md).
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import replace
from typing import Any, Callable

import numpy as np

from ds_train import dist
from ds_train.config import RunConfig
from ds_train.data.examples import Batch
from ds_train.errors import UserError
from ds_train.model.kernels import apply_liger, compile_layers
from ds_train.model.shrunk import shrink_model
from ds_train.model.speedups import Speedups, configured
from ds_train.model.tiled_mlp import tiled_mlps
from ds_train.model.ulysses import check_ulysses, register_ulysses, unregister_ulysses
from ds_train.plan.parallel import ParallelDims
from ds_train.train.losses import forward_losses

ROWS, LENGTH = 2, 64  # the probe's synthetic sequences: 128 tokens
TILE_TOKENS, MLP_TILE = 48, 16  # tiles that do not divide the tokens evenly: the last one is short
# (loss, gradients) relative: an fp32 forward differs from another order of the same sums by ~1e-7; bf16 and
# fp16 by their rounding (their epsilon 2^-7, 2^-10: one rounding moves a value by at most half of it).
TOLERANCES = {"fp32": (1e-5, 1e-4), "bf16": (2.0 ** -7, 4 * 2.0 ** -7), "fp16": (2.0 ** -10, 4 * 2.0 ** -10)}
# bf16 and fp16 are also held to the model's own forward's error against the fp32 forward of the same weights (as
# torch._dynamo's accuracy check holds a compiled graph to the eager one's error against fp64, a multiplier of 2):
# the loss at most LOW_PRECISION_RATIO x as far from fp32's as the own forward's, plus LOSS_FLOOR; each parameter's
# gradient's component along fp32's (relative to it) at most that ratio x the own forward's, plus BIAS_TOLERANCE.
# Rounding averages out of that component (the own bf16 forward's is ~1e-3 on Llama), a fault does not: a
# gradient 1.6% off (2^-6, above bf16's bound) shows at ~2e-2, where the distance from fp32 (~0.9% for both: each
# gradient's rounding) cannot tell them apart.
LOW_PRECISION_RATIO, LOSS_FLOOR, BIAS_TOLERANCE = 2.0, 2.0 ** -10, 2.0 ** -8
# The probe model's logits scaled to this standard deviation, as a trained model's are (random init gives ~0.2,
# where the loss is about ln V whatever the layers compute).
LOGIT_STD = 4.0
PACKED_AT = (24, 40)  # where the run packs: each probe row two examples, position ids restarting here
HEAD_FACTOR_TOLERANCE = 1e-5  # Z and the logits in fp32: a product by c is exact to a rounding or two
FACTOR_TOKENS = 8  # the head factor's forward: Z holds this many tokens' logits
GRAD_FLOOR = 1e-6  # a parameter's gradient is compared relative to at least this share of the whole one's


def probe(cfg: RunConfig, hf_config, dtype: str, device_type: str, dims: ParallelDims, rank: int,
          losses: bool = True) -> Speedups:
    """The speed-ups this run keeps after each has run against the model's own forward (see the module).
    `losses`: the command computes its loss through the tiled loss (train, but for preference pairs and RL,
    whose log-probs come from the model's logits). UserError: one an explicit setting asks for does not hold."""
    check_ulysses(hf_config, dims.sequence, cfg.train.seq_len)
    want = configured(cfg, device_type)
    if not losses:
        want = replace(want, loss_tile_tokens=0, fused_loss=False)
    asked = _asked(cfg, want, device_type, dims)
    if not asked:
        return want
    seed, start, ids = cfg.seed, time.monotonic(), _ids(hf_config, cfg.seed)
    positions = _packed_positions() if packs(cfg) else None
    lengths = (cfg.train.seq_len, LENGTH)
    try:
        small = shrink_model(hf_config, dims.sequence, lengths=lengths)[0]
        _probe_model(cfg, small, dtype, seed)
    except Exception as e:  # noqa: BLE001 - unchecked is not kept: every speed-up asked is off or refused
        why = (f"the probe cannot build a small {getattr(hf_config, 'model_type', '?')} to check it against "
               f"({type(e).__name__}: {' '.join(str(e).split())[:160]})")
        diffs, factor = {name: why for name in asked}, None
    else:
        diffs, factor = differences(
            lambda: _probe_model(cfg, small, dtype, seed), ids, asked, dtype, device_type,
            lambda: _probe_model(cfg, shrink_model(hf_config, dims.sequence, 32, lengths)[0], dtype, seed),
            lambda m, ref: _ulysses_differs(m, ids, ref, cfg, dtype, dims, rank, positions), positions)
    notes: list[str] = []
    kept = want
    for name in asked:
        kept = _verdict(kept, name, diffs[name], cfg, hf_config, notes, factor=factor)
    packed = " over packed examples" if positions is not None else ""
    said = (f"start-up probe: {', '.join(asked)} against {getattr(hf_config, 'model_type', '?')}'s own forward in "
            f"{dtype}{packed}: {len(asked) - len(notes)} of {len(asked)} match"
            + (f" (head factor {kept.head_factor:g})" if kept.head_factor != 1 else "")
            + f" ({time.monotonic() - start:.1f} s)")
    return replace(kept, notes=tuple(notes), probed=said)


def differences(make: Callable[[], Any], ids: np.ndarray, asked: list[str], dtype: str, device_type: str,
                wider: Callable[[], Any], ulysses: Callable[[Any, tuple], str] | None = None,
                positions: np.ndarray | None = None) -> tuple[dict[str, str], float | None]:
    """Each speed-up of `asked` on a probe model (`make()`: a fresh one, the same weights every time) against
    its own forward over `ids` (`positions`: packed examples' position ids, restarting at each): '' where it
    matches, else how it differs, in words (a speed-up that raises differs); and the head factor (None: not a
    constant). In bf16 and fp16 each is also held to the own forward's distance from the fp32 forward of the
    same weights. `wider()`: the model type at another width; `ulysses(model, reference)`: the
    sequence-parallel comparison (a collective: every rank reaches it)."""
    import torch

    batch = _batch(ids, positions)

    def own(m):
        return forward_losses(m, batch)[0]

    model = make()
    ref = _measure(model, own)
    if dtype != "fp32":  # the same weights in fp32: what a speed-up's rounding is measured from
        ref = (*ref, _measure(_in_fp32(model), own))
    del model
    diffs: dict[str, str] = {}
    factor = None

    def check(name: str, run: Callable[[], str]) -> None:
        try:
            diffs[name] = run()
        except Exception as e:  # noqa: BLE001 - a speed-up that raises on this model type does not hold
            diffs[name] = f"it raises {type(e).__name__}: {' '.join(str(e).split())[:300]}"

    if "tiled loss" in asked or "fused loss" in asked:
        model = make()
        factor, why = head_factor(model, ids, wider)
        for name in ("tiled loss", "fused loss"):
            if name in asked:
                check(name, lambda name=name: why or _differs(ref, _measure(model, lambda m: forward_losses(
                    m, batch, TILE_TOKENS, name == "fused loss", factor)[0]), dtype))

    def variant(change: Callable[[Any], Any]) -> str:
        model = make()
        return "" if change(model) is False else _differs(ref, _measure(model, own), dtype)

    if "tiled MLP" in asked:
        check("tiled MLP", lambda: variant(lambda m: bool(tiled_mlps(m, MLP_TILE, LENGTH)[0])))
    if "compiled layers" in asked:
        from deepspeed.accelerator import get_accelerator

        try:
            check("compiled layers", lambda: variant(lambda m: compile_layers(m, get_accelerator().get_compile_backend())))
        finally:
            torch._dynamo.reset()  # the probe's compiled code counts toward no recompile limit of the run's
    if "Liger kernels" in asked:
        check("Liger kernels", lambda: variant(lambda m: apply_liger(m, device_type)[0]))
    if "Ulysses attention" in asked:
        # a collective: no rank may skip it. Every rank runs the same shapes, so one that raises (DeepSpeed's
        # check of the heads' widths) raises on each, at the same point.
        check("Ulysses attention", lambda: ulysses(make(), ref) if ulysses else "")
    return diffs, factor


# ---- what is asked, and what becomes of it ----

# speed-up -> (its setting, the value that turns it off, the Speedups field it clears)
SETTINGS = {"tiled loss": ("train.loss_tile_tokens", "0", "loss_tile_tokens"),
            "fused loss": ("train.fused_loss", "false", "fused_loss"),
            "tiled MLP": ("train.mlp_tile_positions", "0", "mlp_tile_positions"),
            "compiled layers": ("model.compile", "false", "compile"),
            "Liger kernels": ("model.liger_kernels", "false", "liger"),
            "Ulysses attention": ("parallel.sequence", "1", "")}


def _asked(cfg: RunConfig, want: Speedups, device_type: str, dims: ParallelDims) -> list[str]:
    """The speed-ups this run would use: the loss tiled where a micro-batch holds more tokens than a tile,
    the MLP where a rank holds more positions of a sequence than a tile."""
    t = cfg.train
    rank_tokens = t.micro_batch_size * t.seq_len // dims.sequence
    asked = []
    if want.loss_tile_tokens and rank_tokens > want.loss_tile_tokens:
        asked.append("tiled loss")
        if want.fused_loss:
            asked.append("fused loss")
    if want.mlp_tile_positions and t.seq_len // dims.sequence > want.mlp_tile_positions:
        asked.append("tiled MLP")
    if want.compile:
        asked.append("compiled layers")
    if want.liger and device_type == "cuda":
        asked.append("Liger kernels")
    if dims.sequence > 1:
        asked.append("Ulysses attention")
    return asked


def _explicit(cfg: RunConfig, key: str) -> bool:
    """Whether the config sets `key` to other than its default (a default is turned off, not refused)."""
    section, name = key.split(".")
    part = getattr(cfg, section)
    default = next(f.default for f in dataclasses.fields(part) if f.name == name)
    return getattr(part, name) != default or key == "parallel.sequence"


def _verdict(kept: Speedups, name: str, diff: str, cfg: RunConfig, hf_config, notes: list[str],
             factor: float | None = None) -> Speedups:
    key, off, field = SETTINGS[name]
    model_type = getattr(hf_config, "model_type", "?")
    if not diff:
        return replace(kept, head_factor=factor) if factor is not None and name == "tiled loss" else kept
    if _explicit(cfg, key):
        raise UserError(f"{key}: the {name} does not match {model_type}'s own forward: {diff}; set {key}={off}")
    notes.append(f"{key}: the {name} does not match {model_type}'s own forward: {diff}; off for this run")
    cleared = {field: 0 if field.endswith(("tokens", "positions")) else False}
    if field == "loss_tile_tokens":
        cleared["fused_loss"] = False
    return replace(kept, **cleared)


# ---- the probe model, its inputs, its measurements ----

def _probe_model(cfg: RunConfig, small: dict, dtype: str, seed: int):
    """The run's model type at probe size (`small`: shrink_model's config), built from its config in the run's
    dtype and attention implementation on this rank's device, every weight drawn from `seed`, its logits at a
    trained model's scale (trained_scale)."""
    from transformers import AutoConfig
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    from ds_train.model.build import from_scratch, training_dtype

    unset_hf_deepspeed_config()  # an earlier ZeRO-3 run in this process (parity's worker) must not partition it

    small = dict(small)
    model_type = small.pop("model_type")
    config = AutoConfig.for_model(model_type, **small)
    ds = {"bf16": {"enabled": dtype == "bf16"}, "fp16": {"enabled": dtype == "fp16"}}
    model, _ = from_scratch(config, seed, False, attn_implementation=cfg.model.attn_implementation,
                            dtype=training_dtype(ds))
    model = model.to(dist.device()).train()
    trained_scale(model, _ids(config, seed))
    return model


def trained_scale(model, ids: np.ndarray) -> None:
    """The output head's weight scaled so that the logits over `ids` have LOGIT_STD's standard deviation, as a
    trained model's have (a tied embedding scales with it). A model without a head's weight stays as built."""
    import torch

    head = model.get_output_embeddings()
    weight = getattr(head, "weight", None)
    if not isinstance(weight, torch.nn.Parameter):
        return
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        logits = model(input_ids=torch.from_numpy(ids[:1, :LENGTH]).to(dist.device()), use_cache=False).logits
        std = float(logits.float().std())
        if math.isfinite(std) and std > 0:
            weight.mul_(LOGIT_STD / std)


def _in_fp32(model):
    """A copy of `model` in fp32 (the same weights: bf16's and fp16's values are fp32's too)."""
    import copy

    return copy.deepcopy(model).float()


def packs(cfg: RunConfig) -> bool:
    """Whether the run may pack several examples to a sequence (sft, data.pack not false)."""
    return cfg.data.format == "sft" and cfg.data.pack is not False


def _packed_positions() -> np.ndarray:
    """ROWS rows of LENGTH position ids, each two packed examples: restarting at PACKED_AT[row]."""
    return np.stack([np.concatenate([np.arange(cut), np.arange(LENGTH - cut)]) for cut in PACKED_AT[:ROWS]])


def _batch(ids: np.ndarray, positions: np.ndarray | None):
    """The probe's windows as forward_losses takes them: as they are, or a Batch with packed position ids."""
    return ids if positions is None else Batch(ids[:, :-1], ids[:, 1:], positions)


def _ids(hf_config, seed: int) -> np.ndarray:
    """ROWS windows of LENGTH + 1 synthetic token ids (inputs and their next-token targets), from the lower
    half of the vocabulary (a padded vocabulary's padding, which a model may cut from its logits, is on top)."""
    vocab = int(getattr(hf_config, "vocab_size", 0) or 0) or 256
    return np.random.default_rng(seed).integers(0, max(vocab // 2, 2), (ROWS, LENGTH + 1), dtype=np.int64)


def _measure(model, loss_of: Callable[[Any], Any]) -> tuple[float, list]:
    """The summed loss of one forward and each parameter's gradient (fp32 on the CPU; zeros where none)."""
    import torch

    model.zero_grad(set_to_none=True)
    with torch.random.fork_rng(devices=[]):  # a forward that draws (router jitter, dropout) draws alike each time
        torch.manual_seed(0)
        loss = loss_of(model)
        loss.backward()
    grads = [(p.grad if p.grad is not None else torch.zeros_like(p)).detach().float().cpu()
             for p in model.parameters() if p.requires_grad]
    model.zero_grad(set_to_none=True)
    return float(loss.detach()), grads


def _distances(ref: tuple[float, list], got: tuple[float, list]) -> tuple[float, list[float]]:
    """`got`'s loss and each parameter's gradient from `ref`'s, relative (each gradient to its own norm: a layer's
    is not hidden by the embedding's)."""
    loss = abs(got[0] - ref[0]) / max(abs(ref[0]), 1e-30)
    # each relative to its own norm, but not to a gradient that is zero in exact arithmetic (a key bias's: the
    # softmax does not see it), whose rounding noise is all there is: at least GRAD_FLOOR x the whole gradient's
    floor = GRAD_FLOOR * float(sum(float(r.norm()) ** 2 for r in ref[1]) ** 0.5)
    return loss, [float((g - r).norm()) / max(float(r.norm()), floor, 1e-30) for g, r in zip(got[1], ref[1])]


def _differs(ref: tuple, got: tuple[float, list], dtype: str) -> str:
    """'' when `got` is within the dtype's tolerance of `ref` (the own forward's (loss, gradients)): the loss, and
    each parameter's gradient; in bf16 and fp16 (`ref` then also holds the fp32 forward's) also no farther from
    the fp32 forward than LOW_PRECISION_RATIO x the own forward is, plus fp32's tolerance. Else the differences,
    in words."""
    loss_tol, grad_tol = TOLERANCES.get(dtype, TOLERANCES["fp32"])
    loss, grads = _distances(ref[:2], got)
    grad = max(grads, default=0.0)
    held = loss <= loss_tol and grad <= grad_tol  # NaN compares false: a NaN differs
    said = (f"loss {got[0]:.6g} against {ref[0]:.6g}, {loss:.1e} relative; a parameter's gradient {grad:.1e} "
            f"relative")
    if held and len(ref) == 3:
        exact = ref[2]
        own_loss, got_loss = (abs(x - exact[0]) / max(abs(exact[0]), 1e-30) for x in (ref[0], got[0]))
        own, mine = _along(exact, ref[1]), _along(exact, got[1])
        worst = max(range(len(mine)), key=lambda i: abs(mine[i]) - LOW_PRECISION_RATIO * abs(own[i]), default=None)
        if (got_loss > LOW_PRECISION_RATIO * own_loss + LOSS_FLOOR or worst is not None
                and abs(mine[worst]) > LOW_PRECISION_RATIO * abs(own[worst]) + BIAS_TOLERANCE):
            grad = "" if worst is None else (f", a parameter's gradient {mine[worst]:+.1e} along fp32's (the own "
                                             f"forward's {own[worst]:+.1e})")
            return (f"{said}; against the fp32 forward of the same weights: loss {got_loss:.1e} (the own {dtype} "
                    f"forward's {own_loss:.1e}){grad}, relative")
    return "" if held else said


def _along(exact: tuple[float, list], grads: list) -> list[float]:
    """Each gradient's difference from the fp32 forward's (`exact`), its component along that gradient,
    relative to it (a gradient 1% too large: +1e-2); 0 where the fp32 gradient is below GRAD_FLOOR x the
    whole's."""
    floor = GRAD_FLOOR * float(sum(float(r.norm()) ** 2 for r in exact[1]) ** 0.5)
    return [float(((g - r) * r).sum()) / float((r * r).sum()) if float(r.norm()) > floor else 0.0
            for g, r in zip(grads, exact[1])]


def head_factor(model, ids: np.ndarray, wider) -> tuple[float | None, str]:
    """What the model's forward does to its head's output, if it is a product by one constant: (c, '');
    else (None, what it does instead). `wider()`: the same model type at another width (a factor that
    depends on the model's sizes differs there)."""
    c, why = _factor(model, ids)
    if c is None or c == 1:  # none at all: no size it could depend on
        return c, why
    c2, why2 = _factor(wider(), ids)
    if c2 is None or abs(c2 - c) > HEAD_FACTOR_TOLERANCE * abs(c):
        return None, why2 or f"its logits are {c:.6g} x its head's output at one width, {c2:.6g} x at another"
    return c, ""


def _factor(model, ids: np.ndarray) -> tuple[float | None, str]:
    import torch

    head = model.get_output_embeddings()
    if head is None:
        return None, "it names no output head (get_output_embeddings)"
    generator = torch.Generator().manual_seed(0)
    held = {}

    def replace_output(module, args, out):
        # fp32, as the tiled loss's value is: six decades of magnitude, both signs (a soft cap shows)
        z = torch.randn(out.shape, generator=generator) * torch.logspace(-3, 3, out.shape[-1])
        held["z"] = z.to(out.device)
        return held["z"]

    hook = head.register_forward_hook(replace_output)
    try:
        model.zero_grad(set_to_none=True)
        logits = model(input_ids=torch.from_numpy(ids[:1, :FACTOR_TOKENS]).to(dist.device()), use_cache=False).logits
    finally:
        hook.remove()
    z = held["z"]
    if logits.shape != z.shape:
        return None, f"its logits' shape {tuple(logits.shape)} is not its head's output's {tuple(z.shape)}"
    got, z = logits.detach().float(), z.float()
    c = float((got * z).sum() / (z * z).sum())
    err = float((got - c * z).abs().max() / got.abs().max())
    if not (math.isfinite(err) and err <= HEAD_FACTOR_TOLERANCE):
        return None, (f"its logits are not a constant times its head's output (an op after the head, such as a soft "
                      f"cap: {err:.1e} off the nearest constant)")
    if logits.requires_grad:
        logits.float().sum().backward()
        moved = [n for n, p in model.named_parameters() if p.grad is not None and bool(p.grad.abs().sum() > 0)]
        model.zero_grad(set_to_none=True)
        if moved:
            return None, f"its logits depend on {moved[0]} after its head"
    buffer = _buffer_after_head(model, ids, head, got)
    if buffer:  # a buffer added after the head (BART's final_logits_bias: zeros here, not in a checkpoint)
        return None, f"its logits depend on {buffer} after its head"
    return c, ""


def _buffer_after_head(model, ids: np.ndarray, head, logits) -> str:
    """The first floating buffer that changes the logits when the head's output is held fixed (each one
    set to random values in turn, then put back); '' when none does."""
    import torch

    z = torch.randn(logits.shape, generator=torch.Generator().manual_seed(1)).to(dist.device())
    hook = head.register_forward_hook(lambda module, args, out: z)
    try:
        with torch.no_grad():
            base = model(input_ids=torch.from_numpy(ids[:1, :FACTOR_TOKENS]).to(dist.device()), use_cache=False).logits
            for name, buf in model.named_buffers():
                if not buf.is_floating_point() or buf.numel() == 0:
                    continue
                kept = buf.clone()
                buf.copy_(torch.randn(buf.shape, generator=torch.Generator().manual_seed(2)).to(buf))
                try:
                    out = model(input_ids=torch.from_numpy(ids[:1, :FACTOR_TOKENS]).to(dist.device()),
                                use_cache=False).logits
                except Exception:  # noqa: BLE001 - a buffer the trunk cannot run without: not after the head
                    out = base
                finally:
                    buf.copy_(kept)
                if out.shape != base.shape or not torch.equal(out, base):
                    return name
    finally:
        hook.remove()
    return ""


def _ulysses_differs(model, ids: np.ndarray, ref: tuple, cfg: RunConfig, dtype: str,
                     dims: ParallelDims, rank: int, positions: np.ndarray | None = None) -> str:
    """The probe model under Ulysses attention, each rank of a sequence-parallel group holding its part of
    the sequences (data.datasets.sequence_shard, as in training), the group's summed loss and gradients
    against the whole sequences' (`ref`). Every rank of the world calls it."""
    import torch

    from ds_train.data.datasets import sequence_shard

    sequence_rank = dims.coords(rank)[1]
    mpu = register_ulysses(model.config, cfg.model.attn_implementation, dims.sequence, ROWS,
                           packed=positions is not None)
    try:
        # built before: the attention Ulysses replaced is looked up at each call
        part = sequence_shard(_batch(ids, positions), sequence_rank, dims.sequence)
        loss, grads = _measure(model, lambda m: forward_losses(m, part)[0])
        group = mpu.get_sequence_parallel_group()
        summed = dist.all_reduce_tensor(torch.tensor([loss], dtype=torch.float64, device=dist.device()), group)
        grads = [dist.all_reduce_tensor(g.to(dist.device()), group).cpu() for g in grads]
    finally:
        unregister_ulysses()
    return _differs(ref, (float(summed), grads), dtype)
