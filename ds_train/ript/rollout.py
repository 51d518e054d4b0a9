"""Batched rollouts: all K episodes of several contexts advance together, one turn at a time.

Each turn generates the next action for every live episode in one `generate` call with a KV cache
(left-padded token ids, sampling, stopping at a newline), then asks each task for the next
observation. Token ids are kept as generated, never re-tokenised from text, so the log-probs the
update recomputes are those of exactly the tokens the policy sampled.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Episode:
    task: Any
    context: Any
    ids: list[int] = field(default_factory=list)  # prompt, actions and observations, as token ids
    action_mask: list[int] = field(default_factory=list)  # 1 on tokens the policy generated
    text: str = ""
    turns: int = 0
    done: bool = False
    success: bool = False


def _newline_ids(tokenizer) -> list[int]:
    """Every vocabulary entry that ends in a newline: any of them ends an action."""
    return sorted({i for tok, i in tokenizer.get_vocab().items()
                   if tokenizer.convert_tokens_to_string([tok]).endswith("\n")})


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def rollout(model, tokenizer, jobs: list[tuple[Any, Any]], max_new_tokens: int = 12,
            temperature: float = 1.0, batch_size: int = 64, synced_gpus: bool = False) -> list[Episode]:
    """Run one episode per (task, context) job, batch_size episodes at a time."""
    episodes = []
    for start in range(0, len(jobs), batch_size):
        episodes += _rollout_batch(model, tokenizer, jobs[start:start + batch_size], max_new_tokens,
                                   temperature, synced_gpus)
    return episodes


def _rollout_batch(model, tokenizer, jobs, max_new_tokens, temperature, synced_gpus) -> list[Episode]:
    import torch

    stops = _newline_ids(tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    episodes = []
    for task, context in jobs:
        prompt = task.reset(context)
        ids = _encode(tokenizer, prompt)
        episodes.append(Episode(task, context, ids, [0] * len(ids), prompt))
    max_turns = max(task.max_turns for task, _ in jobs)
    device = next(model.parameters()).device
    for turn in range(max_turns):
        live = [e for e in episodes if not e.done]
        if not live:
            break
        width = max(len(e.ids) for e in live)
        input_ids = torch.full((len(live), width), pad, dtype=torch.long)
        attention = torch.zeros((len(live), width), dtype=torch.long)
        for row, e in enumerate(live):  # left padding: generation continues every row at the end
            input_ids[row, width - len(e.ids):] = torch.tensor(e.ids)
            attention[row, width - len(e.ids):] = 1
        with torch.no_grad():
            out = model.generate(input_ids.to(device), attention_mask=attention.to(device), do_sample=True,
                                 temperature=temperature, top_k=0, top_p=1.0, max_new_tokens=max_new_tokens,
                                 eos_token_id=stops, pad_token_id=pad, use_cache=True,
                                 synced_gpus=synced_gpus)
        for row, e in enumerate(live):
            new = out[row, width:].tolist()
            cut = next((i + 1 for i, t in enumerate(new) if t in stops), len(new))
            action_ids = new[:cut]
            action = tokenizer.decode(action_ids)
            e.ids += action_ids
            e.action_mask += [1] * len(action_ids)
            e.text += action
            e.turns += 1
            step = e.task.step(e.context, turn, action)
            if step.done or turn + 1 >= e.task.max_turns:
                e.done, e.success = True, step.done and step.success
            else:
                obs_ids = _encode(tokenizer, step.observation)
                e.ids += obs_ids
                e.action_mask += [0] * len(obs_ids)
                e.text += step.observation
    return episodes
