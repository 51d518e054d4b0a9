"""Batched rollouts: all K episodes of several contexts advance together, one turn at a time.

Each turn asks the policy for the next action of every live episode at once (for a model: one
`generate` call with a KV cache over left-padded token ids, sampling, stopping at a newline), then
asks each task for the next observation. Token ids are kept as generated, never re-tokenised from
text, so the log-probs the update recomputes are those of exactly the tokens the policy sampled.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass
class Episode:
    task: Any
    context: Any
    index: int = 0  # which of the K rollouts of its context
    ids: list[int] = field(default_factory=list)  # prompt, actions and observations, as token ids
    action_mask: list[int] = field(default_factory=list)  # 1 on tokens the policy generated
    text: str = ""
    turns: int = 0
    done: bool = False
    success: bool = False


Act = Callable[[list[Episode]], list[list[int]]]  # live episodes -> each one's action token ids


def _newline_ids(tokenizer) -> list[int]:
    """Every vocabulary entry that ends in a newline: any of them ends an action."""
    return sorted({i for tok, i in tokenizer.get_vocab().items()
                   if tokenizer.convert_tokens_to_string([tok]).endswith("\n")})


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def model_policy(model, tokenizer, max_new_tokens: int = 12, temperature: float = 1.0,
                 synced_gpus: bool = False) -> Act:
    """Sample (temperature > 0) or decode greedily (0) each live episode's next action in one call."""
    import torch

    stops = _newline_ids(tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    sampling = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature > 0 \
        else dict(do_sample=False)

    def act(live: list[Episode]) -> list[list[int]]:
        width = max(len(e.ids) for e in live)
        input_ids = torch.full((len(live), width), pad, dtype=torch.long)
        attention = torch.zeros((len(live), width), dtype=torch.long)
        for row, e in enumerate(live):  # left padding: generation continues every row at the end
            input_ids[row, width - len(e.ids):] = torch.tensor(e.ids)
            attention[row, width - len(e.ids):] = 1
        device = next(model.parameters()).device
        with torch.no_grad():
            out = model.generate(input_ids.to(device), attention_mask=attention.to(device),
                                 max_new_tokens=max_new_tokens, eos_token_id=stops, pad_token_id=pad,
                                 use_cache=True, synced_gpus=synced_gpus, **sampling)
        actions = []
        for row in range(len(live)):
            new = out[row, width:].tolist()
            cut = next((i + 1 for i, t in enumerate(new) if t in stops), len(new))
            actions.append(new[:cut])
        return actions

    return act


def scripted_policy(policy, tokenizer) -> Act:
    """A policy object with `act(task_name, context, transcript, index) -> str` (tests, debugging)."""
    def act(live: list[Episode]) -> list[list[int]]:
        return [encode(tokenizer, policy.act(e.task.name, e.context, e.text, e.index)) for e in live]

    return act


def rollout(act: Act, tokenizer, jobs: list[tuple[Any, Any, int]], batch_size: int = 64,
            turns: int = 0) -> list[Episode]:
    """One episode per (task, context, index) job, batch_size episodes at a time.

    `turns` > 0 makes every batch take exactly that many policy calls, even with no live episode
    left (a one-row dummy), which ZeRO-3's synchronised generation needs on every rank.
    """
    episodes = []
    for start in range(0, len(jobs), batch_size):
        episodes += _rollout_batch(act, tokenizer, jobs[start:start + batch_size], turns)
    if not jobs and turns:
        _rollout_batch(act, tokenizer, [], turns)
    return episodes


def _rollout_batch(act: Act, tokenizer, jobs, turns: int) -> list[Episode]:
    episodes = []
    start = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    for task, context, index in jobs:
        prompt = task.reset(context)  # after a document boundary, as the policy saw text in training
        ids = [start] + encode(tokenizer, prompt)
        episodes.append(Episode(task, context, index, ids, [0] * len(ids), prompt))
    max_turns = turns or max(task.max_turns for task, _, _ in jobs)
    eos = tokenizer.eos_token_id
    for turn in range(max_turns):
        live = [e for e in episodes if not e.done]
        if not live:
            if not turns:
                break
            act([Episode(None, None, 0, [eos], [0], "")])  # keep step with the other ranks
            continue
        for e, action_ids in zip(live, act(live)):
            action = tokenizer.decode(action_ids)
            e.ids += action_ids
            e.action_mask += [1] * len(action_ids)
            e.text += action
            e.turns += 1
            step = e.task.step(e.context, turn, action)
            if step.done or turn + 1 >= e.task.max_turns:
                e.done, e.success = True, step.done and step.success
            else:
                obs_ids = encode(tokenizer, step.observation)
                e.ids += obs_ids
                e.action_mask += [0] * len(obs_ids)
                e.text += step.observation
    return episodes
