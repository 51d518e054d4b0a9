"""`ds-train parity --shrink`: the same model type with small dimensions (2 layers, 16 per head, the
grouped-query ratio kept, dropout off), and each step held to about SHRUNK_TOKENS_PER_STEP tokens
with every accumulation and data-parallel size kept, so the layout of a 70B job is proved on a laptop.
"""

from __future__ import annotations

from ds_train.config import RunConfig
from ds_train.config.file import build_config
from ds_train.inputs import model_config, model_dirs
from ds_train.model.shrunk import shrink_model

SHRUNK_TOKENS_PER_STEP = 8192  # --shrink keeps a step about this small


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
