"""Ulysses sequence parallelism (DeepSpeed's ALST) for a Hugging Face model.

Before the model is built, DeepSpeed's Ulysses attention replaces the model's core attention
(`model.attn_implementation`) in transformers' registry: each rank of a sequence-parallel group
holds seq_len / parallel.sequence positions of every sequence (ds_train/data/datasets.py's
`sequence_shard`), and around each attention an all-to-all trades that for the whole sequence on
heads / parallel.sequence heads, then back. Everything else in the model runs on the rank's own
positions. The returned `mpu` (DeepSpeed's sequence-parallel groups) goes to deepspeed.initialize,
which then averages gradients over the data x sequence ranks.

Ulysses hands the core attention the whole sequence with no mask (it is causal over all of it) and
the gathered position ids. Packed examples (position ids restarting at 0 at each) are kept apart
by the attention itself: flash attention reads the packed examples from the position ids, and for
sdpa, `documents` runs it causally over each example on its own.
"""

from __future__ import annotations

from contextlib import contextmanager
from types import SimpleNamespace

from ds_train.errors import UserError


# The attention functions Ulysses replaced in transformers' registry, to put back when the run ends.
_REPLACED: dict = {}


def register_ulysses(hf_config, attn_implementation: str, sequence: int, micro_batch_size: int,
                     packed: bool = False):
    """DeepSpeed's mpu for `sequence` > 1 (after the process group is up, before the model is
    built); None without sequence parallelism. `packed`: the data packs several examples to a
    sequence (sdpa then runs per example; otherwise it runs as it is, with no per-layer check)."""
    if sequence == 1:
        return None
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    _REPLACED.setdefault(attn_implementation, ALL_ATTENTION_FUNCTIONS[attn_implementation])
    if packed and attn_implementation == "sdpa":  # Ulysses wraps what the registry holds when it registers
        ALL_ATTENTION_FUNCTIONS["sdpa"] = documents(_REPLACED["sdpa"])
    return UlyssesSPAttentionHF.register_with_transformers(
        SimpleNamespace(config=_with_head_size(hf_config)), core_attn_implementation=attn_implementation,
        sequence_parallel_size=sequence, micro_batch_size=micro_batch_size, seq_length_is_variable=True)


def _with_head_size(hf_config):
    """The config Ulysses reads its head size from, `head_dim` set to the query/key heads' width: DeepSpeed takes
    `head_dim` where the config has the key, so a None (Mixtral: hidden / heads) or multi-head latent attention's
    rotary part (DeepSeek-V3: `qk_head_dim` is the width) is replaced. The start-up probe proves the result on
    the model type's own forward."""
    import copy

    text = hf_config.get_text_config()
    width = (getattr(text, "qk_head_dim", None) or getattr(text, "head_dim", None)
             or text.hidden_size // text.num_attention_heads)
    if getattr(text, "head_dim", None) == width:
        return hf_config
    view = copy.copy(text)
    view.head_dim = width
    return SimpleNamespace(get_text_config=lambda: view, _attn_implementation=getattr(hf_config, "_attn_implementation",
                                                                                      None))


@contextmanager
def plain_attention():
    """Within it, transformers' registry holds the attention functions Ulysses replaced: a model this process builds
    and runs alone (rank 0 scoring lm-eval's tasks on the gathered weights, ds_train/train/benchmarks.py) attends
    over its own whole sequence, with no all-to-all the other ranks would have to join. Ulysses' are put back after.
    Nothing to do without sequence parallelism."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    ulysses = {name: ALL_ATTENTION_FUNCTIONS[name] for name in _REPLACED}
    try:
        for name, fn in _REPLACED.items():
            ALL_ATTENTION_FUNCTIONS[name] = fn
        yield
    finally:
        for name, fn in ulysses.items():
            ALL_ATTENTION_FUNCTIONS[name] = fn


def unregister_ulysses() -> None:
    """The run ended: transformers' attention and DeepSpeed's sequence groups as before (a process
    that runs several runs, as parity's worker does, builds the next model without Ulysses)."""
    if not _REPLACED:
        return
    from deepspeed.runtime.sequence_parallel import parallel_state_sp
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    for name, fn in _REPLACED.items():
        ALL_ATTENTION_FUNCTIONS[name] = fn
    _REPLACED.clear()
    parallel_state_sp._release_sequence_parallel_groups()


def documents(sdpa):
    """transformers' sdpa attention over the whole gathered sequence, causal within each packed
    example: where the position ids restart at 0 a new example begins, and each example's queries
    see only its own keys (exactly what the block-diagonal causal mask of an unsharded run gives,
    without an L x L mask). One example per sequence: `sdpa` as it is."""
    import torch

    def attention(module, query, key, value, attention_mask, *args, position_ids=None, **kwargs):
        if position_ids is None or attention_mask is not None or position_ids.shape[-1] != query.shape[2]:
            return sdpa(module, query, key, value, attention_mask, *args, position_ids=position_ids, **kwargs)
        starts = (position_ids[:, 1:] == 0).expand(query.shape[0], -1)
        if not bool(starts.any()):
            return sdpa(module, query, key, value, None, *args, position_ids=position_ids, **kwargs)
        length, rows = query.shape[2], []
        for b in range(query.shape[0]):
            cuts = [0, *(torch.nonzero(starts[b]).flatten() + 1).tolist(), length]
            rows.append(torch.cat([sdpa(module, query[b:b + 1, :, s:e], key[b:b + 1, :, s:e], value[b:b + 1, :, s:e],
                                        None, *args, **kwargs)[0] for s, e in zip(cuts, cuts[1:])], dim=1))
        return torch.cat(rows), None

    return attention


def check_ulysses(hf_config, sequence: int, seq_len: int) -> None:
    """What Ulysses gets wrong for this model, refused in one line (parallel.sequence > 1): an attention
    pattern that lives in the mask, which DeepSpeed's Ulysses attention drops (it attends causally over the
    whole gathered sequence): Llama 4's chunks (attention_chunk_size, its chunked_attention layers) once the
    sequence is longer than a chunk, bidirectional attention (use_bidirectional_attention); and RoPE whose
    frequencies follow max(position_ids) (dynamic NTK, LongRoPE) once the sequence passes the length where
    they change: each rank computes them from its own part's positions, not the whole sequence's. No rank is
    handed the global length, so these are refused, not run. Any attention implementation: the chunks are not
    a window flash attention takes."""
    if sequence == 1:
        return
    text = hf_config.get_text_config()
    model_type = getattr(text, "model_type", "?")
    where = f"parallel.sequence={sequence}"
    layer_types = list(getattr(text, "layer_types", None) or [])
    chunk = getattr(text, "attention_chunk_size", None)
    if isinstance(chunk, int) and chunk < seq_len and (not layer_types or "chunked_attention" in layer_types):
        raise UserError(f"{where}: {model_type} attends within chunks of {chunk} tokens (attention_chunk_size), "
                        f"which live in the attention mask Ulysses drops: its {seq_len}-token sequences would get "
                        f"full causal attention; use train.seq_len <= {chunk} or parallel.sequence=1")
    if "chunked_attention" in layer_types and not isinstance(chunk, int):
        raise UserError(f"{where}: {model_type}'s chunked_attention layers live in the attention mask Ulysses drops; "
                        f"use parallel.sequence=1")
    bidirectional = getattr(text, "use_bidirectional_attention", None)
    if bidirectional is True or bidirectional == "all":  # "vision": among image tokens only, which text has none of
        raise UserError(f"{where}: {model_type}'s bidirectional attention (use_bidirectional_attention="
                        f"{bidirectional!r}) lives in the attention mask Ulysses drops (it attends causally); set "
                        f"model.config.use_bidirectional_attention=false or parallel.sequence=1")
    for rope_type, length in _length_dependent_rope(text):
        if seq_len > length:
            raise UserError(f"{where}: {model_type}'s {rope_type} RoPE takes its frequencies from the largest "
                            f"position id a forward sees, past {length} tokens; under Ulysses each rank sees only "
                            f"its part's ({seq_len // sequence} of {seq_len}), so the ranks' frequencies differ from "
                            f"the whole sequence's; use train.seq_len <= {length}, a RoPE type that does not depend "
                            f"on the length, or parallel.sequence=1")


def _length_dependent_rope(text) -> list[tuple[str, int]]:
    """(rope type, the length past which its frequencies change) of each RoPE of the config (one a layer type
    in Gemma 3's) that transformers' dynamic_rope_update recomputes from max(position_ids): dynamic types past
    max_position_embeddings (or the original length), LongRoPE past original_max_position_embeddings."""
    rope = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}
    if not isinstance(rope, dict):
        return []
    ropes = [rope] if "rope_type" in rope or "type" in rope else [v for v in rope.values() if isinstance(v, dict)]
    found = []
    for r in ropes:
        kind = str(r.get("rope_type") or r.get("type") or "")
        original = r.get("original_max_position_embeddings") or getattr(text, "original_max_position_embeddings", None)
        top = getattr(text, "max_position_embeddings", None)
        if "dynamic" in kind:
            found.append((kind, min((v for v in (original, top) if isinstance(v, int)), default=0)))
        elif kind == "longrope":
            found.append((kind, original if isinstance(original, int) else 0))
    return found
