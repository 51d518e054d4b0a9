"""`ds-train parity --shrink`: the same model type with small dimensions (2 layers, 16 per head, the
grouped-query ratio kept, dropout off), and each step held to about SHRUNK_TOKENS_PER_STEP tokens
with every accumulation and data-parallel size kept, so the layout of a 70B job is proved on a laptop.
"""

from __future__ import annotations

import math

from ds_train.config import RunConfig
from ds_train.config.file import build_config
from ds_train.inputs import model_config, model_dirs

SHRUNK_TOKENS_PER_STEP = 8192  # --shrink keeps a step about this small
HEAD_DIM = 16
DROPPED = ("_name_or_path", "transformers_version", "architectures", "auto_map", "torch_dtype", "dtype")


def shrink_model(hf, heads_multiple: int = 1) -> tuple[dict, str]:
    """The same model type with small dimensions: 2 layers, the grouped-query ratio kept (heads a
    multiple of `heads_multiple`, so a layout that splits them still can), 16 per head, the MLP
    2.75x the hidden size, 4 experts of which 2 active; dropout off. Returns model.config and what
    changed, in words."""
    d = {k: v for k, v in hf.to_diff_dict().items() if k not in DROPPED}
    d["model_type"] = hf.model_type
    heads = getattr(hf, "num_attention_heads", None) or getattr(hf, "n_head", None) or 4
    kv = getattr(hf, "num_key_value_heads", None) or heads
    ratio = heads // kv if heads % kv == 0 else 1
    small_heads = math.lcm(4, ratio, heads_multiple)
    hidden = HEAD_DIM * small_heads
    ffn = max(8, round(hidden * 2.75 / 8) * 8)
    layers = 2
    small = {"hidden_size": hidden, "n_embd": hidden, "d_model": hidden,
             "num_attention_heads": small_heads, "n_head": small_heads,
             "num_key_value_heads": small_heads // ratio, "head_dim": HEAD_DIM,
             "intermediate_size": ffn, "n_inner": ffn, "ffn_dim": ffn,
             "moe_intermediate_size": ffn // 2, "shared_expert_intermediate_size": ffn // 2,
             "num_hidden_layers": layers, "n_layer": layers, "num_layers": layers}
    for key, value in small.items():
        if d.get(key) is not None:  # the keys this model type has (GPT-2's n_inner None: 4 x hidden)
            d[key] = value
    for key, cap in (("num_local_experts", 4), ("num_experts", 4), ("n_routed_experts", 4),
                     ("num_experts_per_tok", 2), ("max_window_layers", layers), ("first_k_dense_replace", 1)):
        if isinstance(d.get(key), int):
            d[key] = min(d[key], cap)
    if isinstance(d.get("layer_types"), list):
        d["layer_types"] = d["layer_types"][:layers]
    for key, value in list(d.items()):
        if ("dropout" in key or "pdrop" in key) and isinstance(value, float):
            d[key] = 0.0
    said = (f"{hf.model_type}: hidden {getattr(hf, 'hidden_size', '?')} -> {hidden}, layers "
            f"{getattr(hf, 'num_hidden_layers', '?')} -> {layers}, attention heads {heads}/{kv} -> "
            f"{small_heads}/{small_heads // ratio} (query/key-value), vocabulary "
            f"{getattr(hf, 'vocab_size', '?')} kept")
    return d, said


def shrink(cfg: RunConfig, heads_multiple: int = 1) -> tuple[RunConfig, list[str]]:
    """cfg with its model shrunk (model.config; the tokenizer stays the model's) and each step held
    to about SHRUNK_TOKENS_PER_STEP tokens (seq_len at most 256; the global batch divided by a
    factor of every micro-batch, so every accumulation and data-parallel size stays as it is);
    `heads_multiple`: what the layouts split the heads by."""
    model_dir, _ = model_dirs(cfg)
    hf = model_config(cfg)
    model, said = shrink_model(hf, heads_multiple)
    notes = [f"--shrink: {said}"]
    raw = cfg.to_dict()
    raw["model"] |= {"path": "", "config": model}
    if model_dir and not cfg.data.tokenizer:  # the data keeps the model's tokenizer
        raw["data"]["tokenizer"] = str(model_dir)
    seq = min(cfg.train.seq_len, 256)
    g, micro = cfg.train.global_batch_size, cfg.train.micro_batch_size
    factors = [d for d in range(1, micro + 1) if micro % d == 0 and g % d == 0]  # every accumulation stays
    k = min((d for d in factors if g // d * seq <= SHRUNK_TOKENS_PER_STEP), default=factors[-1])
    changed = [f"seq_len {cfg.train.seq_len} -> {seq}"] if seq != cfg.train.seq_len else []
    if k > 1:
        changed.append(f"global batch {g} -> {g // k}, micro-batch {micro} -> {micro // k} (accumulation and "
                       f"data-parallel sizes kept)")
    if changed:
        raw["train"] |= {"seq_len": seq, "global_batch_size": g // k, "micro_batch_size": micro // k}
        notes.append(f"--shrink: {', '.join(changed)}")
    return build_config(raw, source="parity --shrink"), notes
