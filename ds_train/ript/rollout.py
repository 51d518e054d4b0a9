"""Batched rollouts: all K episodes of several contexts advance together, one turn at a time.

Each turn asks the policy for the next action of every live episode at once (for a model: one
`generate` call with a KV cache over left-padded token ids per kind of action, sampling, stopping at
the task's stop strings: a newline for the built-in tasks), then asks each task for the next
observation. An action that reaches its max_new_tokens without a stop is marked truncated. Token ids
are kept as generated, never re-tokenised from text, so the log-probs the update recomputes are those
of exactly the tokens the policy sampled.
"""

from __future__ import annotations

import time
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
    reward: float = 0.0  # the task's reward (1.0 / 0.0 for success / failure unless the task says)
    truncated: bool = False  # an action reached its max_new_tokens without a stop token
    # the sampling engine's log-prob of each token of `ids` (0.0 off the actions); None when the policy
    # reports none (Hugging Face generate): the update then recomputes them all (ds_train/ript/update.py)
    logprobs: list[float] | None = None
    session: Any = None  # an environment task's episode (ds_train/ript/environments.py Session)
    reason: str = ""  # why an environment's episode ended failed (sampler.REASONS); "" otherwise
    tool_calls: int = 0
    env_seconds: float = 0.0  # its share of the wall time the rollout waited for environments and tools


class Sampled(list):
    """An action's token ids, with the log-prob the sampling engine gave each (vLLM's)."""

    def __init__(self, ids: list[int], logprobs: list[float]):
        super().__init__(ids)
        self.logprobs = list(logprobs)


Act = Callable[[list[Episode]], list[list[int]]]  # live episodes -> each one's action token ids (or Sampled)


@dataclass(frozen=True)
class Generation:
    """How a task's actions are generated: the strings that end one, and its most tokens."""

    stop: tuple[str, ...]
    max_new_tokens: int


def generation(task, max_new_tokens: int) -> Generation:
    """A task's Generation: its own `stop` strings (built-in tasks: a newline) and `max_new_tokens`
    when it has them, else ript.max_new_tokens."""
    return Generation(tuple(getattr(task, "stop", ("\n",))), getattr(task, "max_new_tokens", 0) or max_new_tokens)


def max_rollout_tokens(task, max_new_tokens: int) -> int:
    """The most tokens a rollout of `task` can generate: its actions' limit x its turns."""
    return generation(task, max_new_tokens).max_new_tokens * task.max_turns


_STOP_IDS: dict[tuple, list[int]] = {}


def stop_ids(tokenizer, stop: tuple[str, ...]) -> list[int]:
    """Every vocabulary entry whose text ends with one of the stop strings: any of them ends an
    action (a newline inside a longer token too)."""
    key = (id(tokenizer), stop)
    if key not in _STOP_IDS:
        _STOP_IDS[key] = sorted({i for tok, i in tokenizer.get_vocab().items()
                                 if tokenizer.convert_tokens_to_string([tok]).endswith(stop)})
    return _STOP_IDS[key]


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def model_policy(model, tokenizer, max_new_tokens: int = 12, temperature: float = 1.0,
                 synced_gpus: bool = False, tasks: list | None = None) -> Act:
    """Sample (temperature > 0) or decode greedily (0) each live episode's next action: one
    `generate` call per kind of generation (stop strings, max_new_tokens) among the live episodes.
    `synced_gpus` (ZeRO-3, where generation is a collective): one call for every kind of `tasks`,
    in the same order on every rank, with a dummy row where a rank has no episode of that kind."""
    import torch

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    sampling = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature > 0 \
        else dict(do_sample=False)
    kinds = sorted({generation(t, max_new_tokens) for t in tasks or []}, key=repr)

    def generate(rows: list[Episode], kind: Generation) -> list[list[int]]:
        stops = stop_ids(tokenizer, kind.stop)
        width = max(len(e.ids) for e in rows)
        input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
        attention = torch.zeros((len(rows), width), dtype=torch.long)
        for row, e in enumerate(rows):  # left padding: generation continues every row at the end
            input_ids[row, width - len(e.ids):] = torch.tensor(e.ids)
            attention[row, width - len(e.ids):] = 1
        device = next(model.parameters()).device
        # eager: compiled layers (model.compile) would compile again for each new length of the cache
        with torch.no_grad(), torch.compiler.set_stance("force_eager"):
            out = model.generate(input_ids.to(device), attention_mask=attention.to(device),
                                 max_new_tokens=kind.max_new_tokens, eos_token_id=stops, pad_token_id=pad,
                                 use_cache=True, synced_gpus=synced_gpus, **sampling)
        actions = []
        for row in range(len(rows)):
            new = out[row, width:].tolist()
            cut = next((i + 1 for i, t in enumerate(new) if t in stops), len(new))
            actions.append(new[:cut])
        return actions

    def act(live: list[Episode]) -> list[list[int]]:
        by_kind: dict[Generation, list[int]] = {}
        for i, e in enumerate(live):
            if e.task is not None:
                by_kind.setdefault(generation(e.task, max_new_tokens), []).append(i)
        actions: list[list[int]] = [[] for _ in live]
        dummy = Episode(None, None, 0, [tokenizer.eos_token_id], [0], "")  # a rank with nothing of this kind
        for kind in (kinds if synced_gpus else list(by_kind)):
            rows = by_kind.get(kind, [])
            got = generate([live[i] for i in rows] or [dummy], kind)
            for i, ids in zip(rows, got):
                actions[i] = ids
        return actions

    return act


def scripted_policy(policy, tokenizer) -> Act:
    """A policy object with `act(task_name, context, transcript, index) -> str` (tests, debugging)."""
    def act(live: list[Episode]) -> list[list[int]]:
        return [encode(tokenizer, policy.act(e.task.name, e.context, e.text, e.index)) for e in live]

    return act


def rollout(act: Act, tokenizer, jobs: list[tuple[Any, Any, int]], batch_size: int = 64,
            turns: int = 0, max_new_tokens: int = 12) -> list[Episode]:
    """One episode per (task, context, index) job, batch_size episodes at a time. `max_new_tokens`:
    a task's limit when it sets none (to tell a truncated action; the policy enforces it).

    `turns` > 0 makes every batch take exactly that many policy calls, even with no live episode
    left (a one-row dummy), which ZeRO-3's synchronised generation needs on every rank.
    """
    episodes = []
    for start in range(0, len(jobs), batch_size):
        episodes += _rollout_batch(act, tokenizer, jobs[start:start + batch_size], turns, max_new_tokens)
    if not jobs and turns:
        _rollout_batch(act, tokenizer, [], turns, max_new_tokens)
    return episodes


def _rollout_batch(act: Act, tokenizer, jobs, turns: int, max_new_tokens: int) -> list[Episode]:
    episodes = []
    start = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    # an environment's episodes: every one opened (its reset begun) before the first prompt is awaited
    waited = time.perf_counter()
    sessions = [task.open(context) if hasattr(task, "open") else None for task, context, _ in jobs]
    for (task, context, index), session in zip(jobs, sessions):
        if session is not None:
            ids = list(session.prompt_ids)
            prompt = tokenizer.decode(ids)
        elif hasattr(task, "prompt_ids"):  # rendered by the task itself (a chat template)
            prompt, ids = task.reset(context), task.prompt_ids(context)
        else:  # after a document boundary, as the policy saw text in training
            prompt = task.reset(context)
            ids = [start] + encode(tokenizer, prompt)
        episodes.append(Episode(task, context, index, ids, [0] * len(ids), prompt, logprobs=[0.0] * len(ids),
                                session=session))
    _share(time.perf_counter() - waited, [e for e in episodes if e.session is not None])
    max_turns = turns or max(task.max_turns for task, _, _ in jobs)
    eos = tokenizer.eos_token_id
    for turn in range(max_turns):
        live = [e for e in episodes if not e.done]
        if not live:
            if not turns:
                break
            act([Episode(None, None, 0, [eos], [0], "")])  # keep step with the other ranks
            continue
        acted = list(zip(live, act(live)))
        waited = time.perf_counter()
        for e, action_ids in acted:  # an environment's step begun for each, so that they run together
            if e.session is not None:
                e.session.begin(turn, tokenizer.decode(action_ids), tokens=len(action_ids))
        for e, action_ids in acted:
            action = tokenizer.decode(action_ids)
            kind = generation(e.task, max_new_tokens)
            if len(action_ids) >= kind.max_new_tokens and action_ids[-1] not in stop_ids(tokenizer, kind.stop):
                e.truncated = True
            e.ids += action_ids
            e.action_mask += [1] * len(action_ids)
            sampled = getattr(action_ids, "logprobs", None)  # a Sampled action's; HF generate gives none
            e.logprobs = None if sampled is None or e.logprobs is None else e.logprobs + sampled
            e.text += action
            e.turns += 1
            step = e.session.finish() if e.session is not None else e.task.step(e.context, turn, action)
            if step.done or turn + 1 >= e.task.max_turns:
                e.done, e.success = True, step.done and step.success
                e.reward = float(step.reward) if step.done and step.reward is not None else float(e.success)
                if e.session is not None:
                    e.reason, e.tool_calls = e.session.reason, e.session.tool_calls
            else:
                # token-in/token-out: the environment's ids as its chat template renders them, else the text's
                obs_ids = list(step.ids) if step.ids is not None else encode(tokenizer, step.observation)
                e.ids += obs_ids
                e.action_mask += [0] * len(obs_ids)
                e.logprobs = None if e.logprobs is None else e.logprobs + [0.0] * len(obs_ids)
                e.text += step.observation
        _share(time.perf_counter() - waited, [e for e in live if e.session is not None])
    return episodes


def _share(seconds: float, episodes: list[Episode]) -> None:
    """The wall time spent on environments, shared among the episodes it was spent for."""
    for e in episodes:
        e.env_seconds += seconds / len(episodes)
