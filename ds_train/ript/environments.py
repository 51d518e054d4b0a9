"""Environments and tools: multi-turn episodes over chat turns, kept token-in/token-out (chat_turns.py).

A dataset entry of ript.tasks with `env: module:Class` or `tools: [module:function, ...]` is an
environment task. Each episode builds the environment anew (`Class()`) and plays:

    messages = env.reset(sample)                          # sample: the dataset's record
    messages, reward, done, info = env.step(turn)         # turn: {"role": "assistant", "content", "tool_calls"}

The first messages are rendered with the chat template (and the tools) into the prompt; after each
assistant turn, the tool calls in it (chat_turns.parse_turn) are run, each result a tool message, and
the environment is not asked; a turn with no call goes to `env.step`. The messages either adds are
rendered after the sampled turn and masked from the loss. Without `env:`, the environment is the
dataset's own (`Answer`): the prompt is the record's prompt_key, and the first turn with no tool call is
the answer, scored by the entry's verifier.

How today's Task protocol relates: an environment task is a Task (ds_train/ript/tasks.py) whose
`open(context)` starts an episode's Session, which the rollout steps in place of `task.step`. Built-in
and module:Class tasks keep their text observations. A dataset entry whose verifier is the user's own
(`verifier: module:function`) is such a task too (one turn, no environment): its verifier runs in the room.

The environments, tools and verifiers run in the task's room (env_room.py): ript.env_workers worker processes a
rank (the default), where a step past its time is killed with its whole process tree, or, for trusted code only,
threads of the rank's process (env_workers=0). An environment's optional `close()` is called when its episode
ends, however it ends. Every object named is checked for its kind when the task loads (before anything is
written). Never a crashed run: a malformed call, an unknown tool, a tool that raises or runs past
ript.env_step_timeout_s, an environment whose reset or step raises, hangs, exits or returns other than the
protocol's shapes (a reward any finite real number, numpy's included; `done` a bool), a verifier that raises,
hangs or returns NaN, messages the chat template cannot take (chat_turns.TurnFault), an episode past its
characters or tokens (ript.env_max_*, the model's positions), or a worker that dies: each ends that episode
with reward 0 and its reason (sampler.REASONS), counted by the trainer (ript/env_failed/REASON) and named by
`ds-train doctor` when every episode ends so. Each message is cut to ript.env_max_message_chars and
env_max_message_tokens (ript.env_truncation_side) before it is rendered.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from typing import Any, Callable, Protocol

from ds_train.errors import UserError, load_user_object
from ds_train.ript.chat_turns import ChatTurns, TurnFault, parse_turn
from ds_train.ript.datatask import DatasetTask, Prompt, check_task_entries
from ds_train.ript.env_room import Limits, Room, check_kind, limit_problems, open_room, worker_spec
from ds_train.ript.rollout import max_rollout_tokens
from ds_train.ript.sampler import REASONS
from ds_train.ript.tasks import Step, load_task

DEFAULT_TURNS = 4  # an environment task's max_turns when its entry sets none
DEFAULT_WORKERS = 4  # ript.env_workers' default (ds_train/config/posttrain.py says why)


class Environment(Protocol):
    def reset(self, sample: dict) -> list[dict]: ...
    def step(self, turn: dict) -> tuple[list[dict], float, bool, dict]: ...
    # optional: close(self) -> None, called when its episode ends, however it ends


def tool_schema(fn: Callable, where: str) -> dict:
    """A tool's JSON schema for the chat template, from its signature and docstring (transformers'
    get_json_schema: type hints, and an Args: section describing each argument)."""
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(fn)
    except Exception as e:  # its DocstringParsingException and TypeError: a tool it cannot describe
        raise UserError(f"{where}: {getattr(fn, '__name__', fn)!r} cannot be given to the chat template ("
                        f"{' '.join(str(e).split())[:160]}); give it type hints and a docstring with an Args: "
                        f"line for each argument") from None


def load_tools(specs: list[str], where: str) -> dict[str, Callable]:
    """`module:function` specs -> {name: function}; one line for one that does not load, is not a function, or
    repeats a name."""
    tools: dict[str, Callable] = {}
    for i, spec in enumerate(specs):
        fn = load_user_object(spec, f"{where}[{i}]")
        wrong = check_kind(fn, "tool", spec, f"{where}[{i}]")
        if wrong:
            raise UserError(wrong)
        if fn.__name__ in tools:
            raise UserError(f"{where}[{i}]: a second tool named {fn.__name__!r}; tools are called by name")
        tools[fn.__name__] = fn
    return tools


def load_env_class(spec: str, where: str):
    """`module:Class` -> the class, checked for its kind (a class with reset and step, built with no arguments)."""
    env_class = load_user_object(spec, where)
    wrong = check_kind(env_class, "env", spec, where)
    if wrong:
        raise UserError(wrong)
    return env_class


def in_room(options: dict) -> bool:
    """A dataset entry whose user code runs in a room: an environment, tools, or a verifier of its own
    (module:function)."""
    return bool(options["env"] or options["tools"] or ":" in options["verifier"])


class EnvTask(DatasetTask):
    """A dataset entry played in a room: an environment, tools, or a verifier of the user's (see the module).
    `limits`: the room's (ript.env_*); `message_tokens`, `episode_tokens`: each environment message's tokens and
    the episode's at most (0: the model's positions, `max_positions`)."""

    def __init__(self, options: dict, tokenizer, chat_template: str, max_new_tokens: int,
                 max_positions: int | None, where: str, step_timeout_s: float = 30.0,
                 env_workers: int = DEFAULT_WORKERS, limits: Limits | None = None, message_tokens: int = 4096,
                 episode_tokens: int = 0):
        self.tools = load_tools(options["tools"], f"{where}.tools")
        self.env_class = load_env_class(options["env"], f"{where}.env") if options["env"] else None
        self.limits = dataclasses.replace(limits or Limits(), step_timeout_s=step_timeout_s)
        self.message_tokens = message_tokens
        positions = [n for n in (episode_tokens, max_positions) if n]
        self.max_episode_tokens = min(positions) if positions else None  # None: no bound but the characters'
        self.ids = itertools.count()  # each episode's id in the room
        self.turns = ChatTurns(tokenizer, chat_template, [tool_schema(f, f"{where}.tools") for f in
                                                          self.tools.values()], where)
        super().__init__(options, tokenizer, chat_template, max_new_tokens, max_positions, where)
        self.max_turns = options["max_turns"] or (DEFAULT_TURNS if options["env"] or options["tools"] else 1)
        verifier = None if options["env"] else ("ds_train.ript.verifiers:build_verifier", [
            options["verifier"], float(options["tolerance"]), options["pattern"], f"{where}.verifier"])
        spec = worker_spec(options["env"], list(options["tools"]), verifier, self.limits)
        self.room = open_room(Room(self.env_class, dict(self.tools), self.verify, self.limits, env_workers, spec))

    def _prompt(self, record: Any, where: str, max_positions: int | None) -> Prompt:
        if self.env_class is None:  # the record's prompt and answer, rendered with the tools
            prompt = super()._prompt(record, where, max_positions)
            if not self.tools:
                return prompt
            ids = tuple(self.turns.prompt_ids(self.messages_of(record, where)))
            return Prompt(ids, prompt.answer, where, record)
        if not isinstance(record, dict):
            raise UserError(f"{where}: expected a JSON object (a sample for {self.options['env']})")
        return Prompt((), record.get(self.options["answer_key"]), where, record)

    def split_key(self, prompt: Prompt) -> str:
        return self.tokenizer.decode(prompt.ids) if prompt.ids else json.dumps(prompt.record, sort_keys=True)

    def open(self, context: Prompt) -> "Session":
        return Session(self, context)

    def step(self, context: Prompt, turn: int, action: str) -> Step:
        raise UserError(f"{self.where}: an environment task is stepped through its session (open)")

    def cut(self, messages: list[dict]) -> list[dict]:
        """Each message's content cut to message_tokens tokens, on the room's truncation side."""
        out, n, right = [], self.message_tokens, self.limits.truncation_side == "right"
        for m in messages:
            try:  # as chat_turns encodes it: text, a special token's spelling split (never a control token)
                ids = self.tokenizer(m["content"], add_special_tokens=False, split_special_tokens=True)["input_ids"] \
                    if isinstance(m.get("content"), str) and len(m["content"]) > n else ()
            except (TypeError, ValueError, UnicodeError) as e:  # a lone surrogate: the tokenizer's TypeError
                raise TurnFault("env_text", f"a message's content is not text ({type(e).__name__})") from None
            if len(ids) > n:
                m = {**m, "content": self.tokenizer.decode(ids[:n] if right else ids[-n:])}
            out.append(m)
        return out


class Session:
    """One episode of a room's task: its prompt's ids, each turn's outcome. Its environment, tools and verifier
    run in the task's room (env_room: worker processes, or threads); a turn is begun (`begin`: parsed, its tool
    calls, step or verification sent) and finished (`finish`: the reply awaited, rendered), so that the rollout
    runs the turns of a batch concurrently. Whatever goes wrong ends the episode with its reason (sampler.REASONS)
    and reward 0; the environment is closed however it ends."""

    def __init__(self, task: "EnvTask", context: Prompt):
        self.task, self.context, self.sid = task, context, next(task.ids)
        self.tool_calls, self.reason, self.turn, self.chars = 0, "", 0, 0
        self._pending: Any = None
        self._prompt: list[int] | None = list(context.ids) if task.env_class is None else None
        self.length = len(context.ids)  # the episode's tokens so far
        self._opening = None if self._prompt is not None else task.room.begin(("open", self.sid, (context.record,)))

    @property
    def prompt_ids(self) -> list[int]:
        if self._prompt is None:
            task = self.task
            reason, messages = task.room.finish(self._opening)
            ids: list[int] = []
            if not reason:
                self.chars = sum(len(m["content"]) for m in messages)
                try:
                    ids = task.turns.prompt_ids(task.cut(messages))
                except TurnFault as e:
                    reason = e.reason
            if not reason and not self._fits(len(ids)):
                reason = "env_overlong"
            if reason:  # the environment did not start: the episode ends at its first turn, from an empty prompt
                self.reason = reason
                ids = task.turns.prompt_ids([{"role": "user", "content": ""}])
            self._prompt, self.length = ids, len(ids)
        return self._prompt

    def _fits(self, more: int) -> bool:
        """The episode, `more` tokens and the next action at its most within the task's positions."""
        most = self.task.max_episode_tokens
        return most is None or self.length + more + self.task.max_new_tokens <= most

    def step(self, turn: int, action: str) -> Step:
        """The outcome of assistant turn `turn` whose sampled text is `action` (begin, then finish)."""
        self.begin(turn, action)
        return self.finish()

    def begin(self, turn: int, action: str, tokens: int | None = None) -> None:
        """`tokens`: the action's length when the caller knows it (the rollout's sampled ids); else its text's
        tokens, encoded again (an engine's split can be longer: rollout.py should pass it)."""
        task = self.task
        self.turn, self.action = turn, action
        self.length += len(task.turns.encode(action)) if tokens is None else tokens
        if self.reason:  # the environment failed to start
            self._pending = ("end", self.reason)
            return
        parsed = parse_turn(task.completion(action), task.turns.style if task.tools else None)
        if parsed.malformed:
            self._pending = ("end", "malformed_call")
        elif parsed.calls:
            self.calls = parsed.calls
            self._pending = ("tools", task.room.begin(("tools", self.sid, [(c.name, c.arguments) for c in parsed.calls]),
                                                      calls=len(parsed.calls)))
        elif task.env_class is None:  # the answer, scored by the verifier in the room
            said = parsed.content if task.tools else task.completion(action)
            record = self.context.record
            self._pending = ("verify", task.room.begin(("verify", self.sid, (said, self.context.answer, record))))
        else:
            self._pending = ("step", task.room.begin(("step", self.sid, parsed.message)))

    def finish(self) -> Step:
        task, (kind, what), self._pending = self.task, self._pending, None
        if kind == "end":
            return self._end(what)
        reason, value = task.room.finish(what)
        if reason:
            return self._end(reason)
        if kind == "verify":
            messages, reward, done = [], value, True
        elif kind == "tools":
            messages = [{"role": "tool", "name": c.name, "content": v} for c, v in zip(self.calls, value)]
            self.tool_calls += len(value)
            reward, done = 0.0, False
        else:
            messages, reward, done = value
        if done:
            self._close()
            return Step("", True, reward >= 1.0, reward)
        if self.turn + 1 >= task.max_turns:
            return self._end("max_turns")
        self.chars += sum(len(m["content"]) for m in messages)
        if self.chars > task.limits.episode_chars:
            return self._end("env_overlong")
        try:
            ids = task.turns.after_turn_ids(task.cut(messages), self.action)
        except TurnFault as e:
            return self._end(e.reason)
        if not self._fits(len(ids)):
            return self._end("env_overlong")
        self.length += len(ids)
        return Step(task.tokenizer.decode(ids), False, ids=tuple(ids))

    def _end(self, reason: str) -> Step:
        assert reason in REASONS, reason
        self.reason = reason
        self._close()
        return Step("", True, False, 0.0)

    def _close(self) -> None:
        """The environment closed (its close() called, when it has one), unless its worker is gone with it."""
        if self.task.env_class is not None and not self.reason.endswith(("timeout", "lost")):
            self.task.room.finish(self.task.room.begin(("close", self.sid, ())))


def room_limits(r) -> Limits:
    """The room's limits from the ript section."""
    return Limits(step_timeout_s=r.env_step_timeout_s, message_chars=r.env_max_message_chars,
                  episode_chars=r.env_max_episode_chars, truncation_side=r.env_truncation_side,
                  memory_mb=r.env_worker_memory_mb, file_mb=r.env_worker_file_mb, processes=r.env_worker_processes,
                  episodes_per_worker=r.env_worker_episodes, log_chars=r.env_log_chars)


def load_tasks(cfg, tokenizer, hf_config) -> dict[str, Any]:
    """Every task of ript.tasks by name, whole, checked: a dataset read and rendered with the tokenizer's
    chat template (or data.chat_template); one with `env`, `tools` or a verifier of its own a room's task
    (EnvTask), its limits checked against what this machine allows."""
    r = cfg.ript
    options = check_task_entries(cfg)
    max_positions = getattr(hf_config, "max_position_embeddings", None)
    if r.env_max_episode_tokens and max_positions and r.env_max_episode_tokens > max_positions:
        raise UserError(f"ript.env_max_episode_tokens: {r.env_max_episode_tokens} is more than the model's "
                        f"{max_positions} positions (max_position_embeddings); lower it, or 0 for the model's")
    if r.rollout_engine == "vllm" and not max_positions:
        max_positions = 4096  # vLLM's max_model_len where the config names none (ds_train/ript/vllm_engine.py)
    limits = room_limits(r)
    tasks: dict[str, Any] = {}
    for i, entry in enumerate(r.tasks):
        where = f"ript.tasks[{i}]"
        if i not in options:
            task = load_task(str(entry))
        elif in_room(options[i]):
            problems = limit_problems(limits, r.env_workers)
            if problems:
                raise UserError("; ".join(problems))
            task = EnvTask(options[i], tokenizer, cfg.data.chat_template, r.max_new_tokens, max_positions, where,
                           r.env_step_timeout_s, r.env_workers, limits, r.env_max_message_tokens,
                           r.env_max_episode_tokens)
        else:
            task = DatasetTask(options[i], tokenizer, cfg.data.chat_template, r.max_new_tokens, max_positions, where)
        if task.name in tasks:
            raise UserError(f"{where}: a second task named {task.name!r}; give it another name (name: ...)")
        most = max_rollout_tokens(task, r.max_new_tokens)
        if r.overlong_buffer and r.overlong_buffer >= most:
            raise UserError(f"ript.overlong_buffer: {r.overlong_buffer} is not below the {most} tokens task "
                            f"{task.name!r} may generate (the penalty starts overlong_buffer tokens before the "
                            f"limit); lower it")
        tasks[task.name] = task
    return tasks
