"""A model type's config with small dimensions: what `ds-train parity --shrink` trains and what the
start-up probe (ds_train/train/probe.py) runs each speed-up on. Every setting that is not a size stays:
the multipliers, scales, caps and kinds of layer that make a model type's forward its own.

The kinds of layer are those of the built model (its decoder layers' classes, and `layer_types`), not
config-key spellings: the layers kept are one of each kind, and the small model, built on the meta device,
must hold every kind the model type's own does (Jamba's attention layer at period 8, Bamba's
`attn_layer_indices`, RecurrentGemma's 3-long pattern), or shrink_model raises. Lists tied to the head
width (LongRoPE's factors, multimodal RoPE's sections) shrink with it; lengths the run reaches (a sliding
window, a chunk, LongRoPE's original length) are cut below the probe's sequence where `lengths` says so.
"""

from __future__ import annotations

import math
from typing import Callable

HEAD_DIM = 16
DROPPED = ("_name_or_path", "transformers_version", "architectures", "auto_map", "torch_dtype", "dtype")


def shrink_model(hf, heads_multiple: int = 1, head_dim: int = HEAD_DIM,
                 lengths: tuple[int, int] | None = None) -> tuple[dict, str]:
    """The same model type with small dimensions: 2 layers, or one of each kind where the model's layers
    differ (the built layers' classes, layer_types and every other per-layer setting: sliding and full
    attention, dense and MoE, attention and recurrent), the grouped-query ratio kept (heads a multiple of
    `heads_multiple`, so a layout that splits them still can), 16 per head, the MLP 2.75x the hidden size, 4
    experts of which 2 active; dropout off (`head_dim` per head: 16). `lengths`: (the run's sequence length,
    the probe's): each window, chunk and original RoPE length the run reaches is cut below the probe's, each
    it does not reach kept at or above it. Returns model.config and what changed, in words. ValueError: the
    small model lacks a kind of layer the model type's has."""
    full = _built_kinds(lambda: _shrunk(hf, heads_multiple, head_dim, lengths, "all")[0], hf)
    d, said = _shrunk(hf, heads_multiple, head_dim, lengths, None, full)
    if full is None:  # no causal LM of this config (a vision tower), or it does not build: nothing to compare
        return d, said
    small = _built_kinds(lambda: d, hf)
    if small is None or set(full) <= set(small):
        return d, said
    # a pattern the config spells as a period, an offset or a short cycle (Jamba, RecurrentGemma): the first
    # layers that hold every kind, the pattern kept as it is
    prefix = max(2, next(k for k in range(1, len(full) + 1) if set(full[:k]) == set(full)))
    d, said = _shrunk(hf, heads_multiple, head_dim, lengths, prefix)
    small = _built_kinds(lambda: d, hf) or []
    missing = [k for k in dict.fromkeys(full) if k not in small]
    if missing:
        raise ValueError(f"the small {hf.model_type} lacks {len(missing)} of its {len(set(full))} kinds of layer "
                         f"({_kind_said(missing[0])})")
    return d, said


def _shrunk(hf, heads_multiple: int, head_dim: int, lengths: tuple[int, int] | None,
            keep: int | str | None, built: list | None = None) -> tuple[dict, str]:
    """shrink_model's config; `keep`: None one layer of each kind (`built`: each layer's kind in the built
    model), "all" every layer (the model type's own depth at small widths: its kinds of layer), k the first k
    layers."""
    d = {k: v for k, v in hf.to_diff_dict().items() if k not in DROPPED}
    d["model_type"] = hf.model_type
    heads = getattr(hf, "num_attention_heads", None) or getattr(hf, "n_head", None) or 4
    kv = getattr(hf, "num_key_value_heads", None) or heads
    ratio = heads // kv if heads % kv == 0 else 1
    if ratio > 16:  # one key/value head for many queries (DeepSeek-V4's 64 to 1): 4 to 1 keeps it one
        ratio = 4
    small_heads = math.lcm(4, ratio, heads_multiple)
    hidden = head_dim * small_heads
    ffn = max(8, round(hidden * 2.75 / 8) * 8)
    n = _layers(hf)
    layers, per_layer = _layer_kinds(d, n, list(range(n)) if keep == "all" else
                                     list(range(min(keep, n))) if isinstance(keep, int) else None, built)
    small = {"hidden_size": hidden, "n_embd": hidden, "d_model": hidden,
             "num_attention_heads": small_heads, "n_head": small_heads,
             "num_key_value_heads": small_heads // ratio, "head_dim": head_dim,
             "intermediate_size": ffn, "n_inner": ffn, "ffn_dim": ffn,
             "moe_intermediate_size": ffn // 2, "shared_expert_intermediate_size": ffn // 2,
             "num_hidden_layers": layers, "n_layer": layers, "num_layers": layers,
             "decoder_layers": layers, "decoder_attention_heads": small_heads, "decoder_ffn_dim": ffn,  # BART's names
             "encoder_layers": layers, "encoder_attention_heads": small_heads, "encoder_ffn_dim": ffn,
             # state-space and recurrent widths (Mamba, Falcon-H1, RecurrentGemma)
             "mamba_n_heads": 4, "mamba_d_head": head_dim, "mamba_d_ssm": 4 * head_dim, "mamba_d_state": 16,
             "ssm_state_size": 16, "state_size": 16, "lru_width": hidden, "adapter_rank": 8,
             "hidden_size_per_layer_input": head_dim,  # Gemma 3n's and 4's per-layer inputs
             "mlp_dim": ffn, "hidden_size_global": hidden,  # a SAM-style vision tower's MLP (GOT-OCR 2); BLT's
             # XLM's and XLNet's names
             "emb_dim": hidden, "n_heads": small_heads, "n_layers": layers, "d_head": head_dim, "d_inner": ffn,
             # other MLP widths (Llama 4's dense layers, LongCat-Flash's), linear attention's heads (Qwen3.5)
             "intermediate_size_mlp": ffn, "ffn_hidden_size": ffn, "expert_ffn_hidden_size": ffn // 2,
             "linear_key_head_dim": head_dim, "linear_value_head_dim": head_dim,
             # DeepSeek-V4's grouped output projection and its sparse attention's indexer
             "o_lora_rank": 32, "index_head_dim": head_dim, "index_n_heads": 4, "index_topk": 16}
    # multi-head latent attention (DeepSeek-V2/V3, Kimi): its ranks and head widths; a partial rotary width
    small |= {"kv_lora_rank": 32, "q_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": head_dim,
              "qk_head_dim": 16, "rotary_dim": head_dim // 2, "linear_head_dim": head_dim,
              "num_experts_per_token": 2}
    if d.get("v_head_dim") is not None and d.get("v_head_dim") != (d.get("qk_rope_head_dim") or 0) + (
            d.get("qk_nope_head_dim") or 0):
        small["v_head_dim"] = head_dim // 2  # values narrower than queries and keys (DeepSeek-V3: 128 and 192) stay so
    if d.get("qk_rope_head_dim") is not None and d.get("head_dim") is not None:
        small["head_dim"] = small["qk_rope_head_dim"]  # MLA's head_dim is its rotary part's (transformers sets it so)
    for key, value in small.items():
        if d.get(key) is not None:  # the keys this model type has (GPT-2's n_inner None: 4 x hidden)
            d[key] = value
    for key, value in list(d.items()):  # a multimodal model's sub-models (its text_config, vision_config, ...)
        if key.endswith("_config") and isinstance(value, dict) and hasattr(getattr(hf, key, None), "to_diff_dict"):
            d[key] = _shrunk(getattr(hf, key), heads_multiple, head_dim, lengths, keep)[0]
        elif key.endswith("_config") and isinstance(value, dict) and value.get("model_type"):
            d[key] = _shrunk_part(value, heads_multiple, head_dim, lengths, keep)
    for key, cap in (("num_local_experts", 4), ("num_experts", 4), ("n_routed_experts", 4), ("n_group", 2),
                     ("zero_expert_num", 4), ("encoder_hash_byte_group_vocab", 1024), ("moe_topk", 2), ("o_groups", 2),
                     ("linear_num_key_heads", 2),
                     ("topk_group", 1),  # DeepSeek-V3's groups of experts: 2 of 2 experts, the top 2 from 1 group
                     ("num_experts_per_tok", 2), ("max_window_layers", layers), ("first_k_dense_replace", 1)):
        if isinstance(d.get(key), int):
            d[key] = min(d[key], cap)
    if isinstance(d.get("linear_num_value_heads"), int) and d.get("linear_num_key_heads"):  # their ratio kept
        d["linear_num_value_heads"] = d["linear_num_key_heads"] * max(1, per_key_value(hf))
    d.update({k: [small[k]] * len(v) if k in small else v for k, v in per_layer.items()})  # a width a layer: cut
    _state_space_widths(d, hidden)
    _head_width_lists(d, _rotary_width(hf), _rotary_width_small(d, hidden, small_heads))
    if lengths:
        _cut_lengths(d, *lengths)
    for key, value in list(d.items()):
        if ("dropout" in key or "pdrop" in key) and isinstance(value, float):
            d[key] = 0.0
    said = (f"{hf.model_type}: hidden {getattr(hf, 'hidden_size', '?')} -> {hidden}, layers "
            f"{getattr(hf, 'num_hidden_layers', '?')} -> {layers}, attention heads {heads}/{kv} -> "
            f"{small_heads}/{small_heads // ratio} (query/key-value), vocabulary "
            f"{getattr(hf, 'vocab_size', '?')} kept")
    return d, said


def per_key_value(hf) -> int:
    """Linear attention's value heads per key head (Qwen3.5: 32 to 16)."""
    keys, values = getattr(hf, "linear_num_key_heads", None), getattr(hf, "linear_num_value_heads", None)
    return values // keys if keys and values and values % keys == 0 else 1


def _state_space_widths(d: dict, hidden: int) -> None:
    """State-space widths that follow from the hidden size: heads x head width = expand x hidden (Mamba-2,
    Bamba, Granite-MoE-hybrid; Zamba 2 derives its own from the hidden size)."""
    inner = int((d.get("mamba_expand") or d.get("expand") or 2) * hidden)
    if d.get("mamba_n_heads") and "mamba_d_head" in d:  # Falcon-H1 names its own inner width (mamba_d_ssm)
        d["mamba_d_head"] = (d.get("mamba_d_ssm") or inner) // d["mamba_n_heads"]
    if d.get("n_mamba_heads"):  # Zamba 2: its attention and Mamba widths come from the hidden size
        for key in ("mamba_headdim", "attention_hidden_size", "attention_head_dim", "kv_channels"):
            d.pop(key, None)
    if "state_size" in d and "expand" in d and d.get("num_heads") and d.get("head_dim"):  # Mamba-2
        d["num_heads"] = max(1, inner // d["head_dim"])
        if d.get("n_groups"):
            d["n_groups"] = math.gcd(d["n_groups"], d["num_heads"])


def _layers(hf) -> int:
    for key in ("num_hidden_layers", "n_layer", "num_layers", "decoder_layers"):
        if isinstance(getattr(hf, key, None), int):
            return getattr(hf, key)
    return 0


def _layer_kinds(d: dict, n: int, keep: list[int] | None = None, built: list | None = None) -> tuple[int, dict]:
    """How many layers the small model keeps, and its per-layer settings: each setting of the config that
    holds one entry a layer (a list, or a string of one letter a layer) cut to the first layer of each
    distinct kind (its entries in every such setting together, and `built`: each layer's kind in the built
    model), at least 2 layers; `keep`: these layers instead."""
    indices = {k: set(v) for k, v in d.items() if n > 1 and k.endswith(INDEX_KEYS) and _indices(v, n)}
    by_index = {k: {int(i): v for i, v in m.items()} for k, m in d.items()  # {layer: settings} (Gemma 4)
                if n > 1 and isinstance(m, dict) and m and "layer" in k and all(str(i).isdigit() for i in m)}
    per_layer = {k: v for k, v in d.items() if n > 1 and k != "model_type" and k not in indices
                 and (isinstance(v, list) or isinstance(v, str) and "pattern" in k) and len(v) == n}
    shared = d.get("num_kv_shared_layers") or 0  # the last ones reuse an earlier layer's keys and values (Gemma 3n)
    if keep is None:
        kinds = {}
        for i in range(n):
            kind = (tuple(repr(v[i]) for v in per_layer.values()) + tuple(i in s for s in indices.values())
                    + tuple(repr(m.get(i)) for m in by_index.values()) + (i >= n - shared > 0,)
                    + ((built[i],) if built and len(built) == n else ()))
            kinds.setdefault(kind, i)
        keep = sorted(kinds.values())
        keep += [i for i in range(n) if i not in keep][:max(0, 2 - len(keep))]
    cut = {k: (type(v)(v[i] for i in keep) if isinstance(v, list) else "".join(v[i] for i in keep))
           for k, v in per_layer.items()}
    cut |= {k: [j for j, i in enumerate(keep) if i in s] for k, s in indices.items()}
    cut |= {k: {str(j).zfill(len(next(iter(d[k])))): m[i] for j, i in enumerate(keep) if i in m}
            for k, m in by_index.items()}
    if shared:
        cut["num_kv_shared_layers"] = sum(i >= n - shared for i in keep)
    return max(2, len(keep)), cut


INDEX_KEYS = ("_layers", "_layer_ids", "_layer_indices", "_idxs")  # lists of layer indices: Llama 4's moe_layers,
# Bamba's attn_layer_indices, LFM2's full_attn_idxs


def _built_kinds(config_dict: Callable[[], dict], hf) -> list | None:
    """Each decoder layer's kind in the model built from `config_dict()` (model.config's form) on the meta
    device: its layer type (layer_types) and the classes it is made of. None: there is no causal LM of it,
    it does not build, or its decoder layers cannot be told apart from its other stacks."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        small = dict(config_dict())
        config = AutoConfig.for_model(small.pop("model_type"), **small)
        with torch.random.fork_rng(devices=[]), torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except Exception:  # noqa: BLE001 - a config transformers rejects: the probe says so when it builds it
        return None
    return layer_kinds(model, config)


def layer_kinds(model, config) -> list | None:
    """The kind of each of `model`'s decoder layers: (its layer type, its class, the classes it holds), or
    None where no stack of the text model's depth is found."""
    import torch

    text = config.get_text_config()
    n = _layers(text)
    stacks = [(name, m) for name, m in model.named_modules() if isinstance(m, torch.nn.ModuleList) and len(m) == n
              and not any(w in name for w in ("vision", "visual", "audio", "encoder", "image", "vit"))]
    if not n or not stacks:
        return None
    types = getattr(text, "layer_types", None)
    types = list(types) if isinstance(types, (list, tuple)) and len(types) == n else [None] * n
    return [(types[i], type(layer).__name__, tuple(sorted({type(m).__name__ for m in layer.modules()})))
            for i, layer in enumerate(stacks[0][1])]


def _kind_said(kind) -> str:
    layer_type, cls, held = kind
    return f"{cls}" + (f" ({layer_type})" if layer_type else "") + f" of {', '.join(held[1:6]) or 'nothing else'}"


def _rotary_width(hf) -> int:
    """The width a head's rotary embedding spans (before partial_rotary_factor): MLA's rotary part, else
    head_dim or hidden / heads; 0 where unknown."""
    d = hf.to_dict()  # a per-layer width (Gemma 4's head_dim) raises on attribute access: read as stored
    for key in ("qk_rope_head_dim", "head_dim"):
        if isinstance(d.get(key), int) and d[key] > 0:
            return d[key]
    hidden, heads = d.get("hidden_size"), d.get("num_attention_heads")
    return hidden // heads if isinstance(hidden, int) and isinstance(heads, int) and heads > 0 else 0


def _rotary_width_small(d: dict, hidden: int, heads: int) -> int:
    for key in ("qk_rope_head_dim", "head_dim"):
        if isinstance(d.get(key), int) and d[key] > 0:
            return d[key]
    return hidden // heads


def _head_width_lists(d: dict, width: int, small_width: int) -> None:
    """Lists whose length or sum follows a head's rotary width, in rope_parameters (and per layer type's):
    LongRoPE's long_factor and short_factor (one a frequency: width / 2) resampled to the small width's
    count, end points kept; multimodal RoPE's sections (mrope_section, summing to width / 2) scaled in
    proportion, each at least 1."""
    if not width or width == small_width:
        return
    for rope in _rope_dicts(d):
        for key, v in list(rope.items()):
            if not (isinstance(v, list) and v and all(isinstance(x, (int, float)) and not isinstance(x, bool)
                                                      for x in v)):
                continue
            if key in ("long_factor", "short_factor"):
                m = max(1, round(len(v) * small_width / width))
                rope[key] = [v[round(i * (len(v) - 1) / max(m - 1, 1))] for i in range(m)]
            elif key.endswith("_section") and all(isinstance(x, int) for x in v):
                rope[key] = _sections(v, round(sum(v) * small_width / width))


def _sections(parts: list[int], total: int) -> list[int]:
    """`parts` scaled to sum to `total` (largest remainders), each at least 1 where `total` allows."""
    whole, least = sum(parts), 1 if total >= len(parts) else 0
    exact = [p * total / whole for p in parts]
    out = [max(least, int(x)) for x in exact]
    for i in sorted(range(len(parts)), key=lambda i: int(exact[i]) - exact[i]):
        if sum(out) >= total:
            break
        out[i] += 1
    while sum(out) > total and max(out) > least:
        out[out.index(max(out))] -= 1
    return out


def _rope_dicts(d: dict) -> list[dict]:
    """The config's RoPE settings: rope_parameters / rope_scaling, and each layer type's within them (Gemma 3)."""
    found = []
    for key in ("rope_parameters", "rope_scaling"):
        rope = d.get(key)
        if isinstance(rope, dict):
            found.append(rope)
            found += [v for v in rope.values() if isinstance(v, dict)]
    return found


LENGTH_KEYS = ("sliding_window", "attention_chunk_size", "attention_window_size", "original_max_position_embeddings")


def _cut_lengths(d: dict, run: int, probe: int) -> None:
    """Windows, chunks and RoPE's original lengths against the probe's sequence (`probe` tokens): one the run
    (`run` tokens) reaches is cut to a quarter of the probe's, so that the probe reaches it too; one it does
    not reach is kept at or above the probe's. max_position_embeddings keeps its ratio to a cut original
    length (LongRoPE's and YaRN's scale), and at least the probe's length."""
    cut = max(2, probe // 4)

    def fit(value):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            return value
        return cut if run > value else max(value, probe)

    originals = []
    for part in (d, *_rope_dicts(d)):
        for key in LENGTH_KEYS:
            if key in part:
                was, part[key] = part[key], fit(part[key])
                if key == "original_max_position_embeddings" and isinstance(was, int) and part[key] != was:
                    originals.append((was, part[key]))
    if originals and isinstance(d.get("max_position_embeddings"), int):
        was, now = originals[0]
        d["max_position_embeddings"] = max(probe, -(-d["max_position_embeddings"] * now // was))


def _indices(v, n: int) -> bool:
    """A list of layer indices (Llama 4's moe_layers), not a value a layer."""
    return (isinstance(v, list) and bool(v) and all(type(i) is int for i in v) and v == sorted(set(v))
            and v[-1] < n and (len(v) < n or v == list(range(n))))


def _shrunk_part(part: dict, heads_multiple: int, head_dim: int, lengths, keep) -> dict:
    """A sub-model's config (a dict with its model_type) shrunk as a model is; as it was where transformers
    has no config class for it."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.for_model(part["model_type"], **{k: v for k, v in part.items() if k != "model_type"})
    except (ValueError, KeyError, TypeError):
        return part
    small, _ = _shrunk(config, heads_multiple, head_dim, lengths, keep)
    return small
