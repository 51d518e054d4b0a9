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
and module:Class tasks keep their text observations.

The environments and tools run in the task's room (env_room.py): threads of the rank's process, or
ript.env_workers worker processes, where a step past its time is killed. Never a crashed run: a malformed
call, an unknown tool, a tool that raises or runs past ript.env_step_timeout_s, an environment whose reset
or step raises, hangs or returns other than the protocol's shapes, or whose worker dies, each end that
episode with reward 0 and its reason (sampler.REASONS), counted by the
trainer (ript/env_failed/REASON) and named by `ds-train doctor` when every episode ends so.
"""

from __future__ import annotations

import itertools
import json
from typing import Any, Callable, Protocol

from ds_train.errors import UserError, load_user_object
from ds_train.ript.chat_turns import ChatTurns, parse_turn
from ds_train.ript.datatask import DatasetTask, Prompt, check_task_entries
from ds_train.ript.env_room import Processes, Threads
from ds_train.ript.rollout import max_rollout_tokens
from ds_train.ript.sampler import REASONS
from ds_train.ript.tasks import Step, load_task

DEFAULT_TURNS = 4  # an environment task's max_turns when its entry sets none


class Environment(Protocol):
    def reset(self, sample: dict) -> list[dict]: ...
    def step(self, turn: dict) -> tuple[list[dict], float, bool, dict]: ...


class Answer:
    """The environment of a dataset entry with tools and no `env:`: the record's prompt, then the first
    turn without a tool call is the answer, scored by the entry's verifier."""

    def __init__(self, task: "EnvTask", sample: dict):
        self.task, self.sample = task, sample

    def reset(self, sample: dict) -> list[dict]:
        return self.task.messages_of(sample, self.task.where)

    def step(self, turn: dict) -> tuple[list[dict], float, bool, dict]:
        reward = float(self.task.verify(turn["content"], self.sample[self.task.options["answer_key"]], self.sample))
        return [], reward, True, {}


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
    """`module:function` specs -> {name: function}; one line for one that does not load or repeats a name."""
    tools: dict[str, Callable] = {}
    for i, spec in enumerate(specs):
        fn = load_user_object(spec, f"{where}[{i}]")
        if not callable(fn):
            raise UserError(f"{where}[{i}]: {spec!r} is not callable; name a function (module:function)")
        if fn.__name__ in tools:
            raise UserError(f"{where}[{i}]: a second tool named {fn.__name__!r}; tools are called by name")
        tools[fn.__name__] = fn
    return tools


class EnvTask(DatasetTask):
    """A dataset entry played by an environment, with or without tools (see the module)."""

    def __init__(self, options: dict, tokenizer, chat_template: str, max_new_tokens: int,
                 max_positions: int | None, where: str, step_timeout_s: float = 30.0, env_workers: int = 0):
        self.tools = load_tools(options["tools"], f"{where}.tools")
        self.env_class = load_user_object(options["env"], f"{where}.env") if options["env"] else None
        self.step_timeout_s = step_timeout_s
        self.ids = itertools.count()  # each episode's id in the room
        tools = {**self.tools}
        self.room = (Processes(env_workers, options["env"], list(options["tools"]), step_timeout_s) if env_workers
                     else Threads(self.env_class, tools, step_timeout_s))
        self.turns = ChatTurns(tokenizer, chat_template, [tool_schema(f, f"{where}.tools") for f in
                                                          self.tools.values()], where)
        super().__init__(options, tokenizer, chat_template, max_new_tokens, max_positions, where)
        self.max_turns = options["max_turns"] or DEFAULT_TURNS

    def _prompt(self, record: Any, where: str, max_positions: int | None) -> Prompt:
        if self.env_class is None:  # the record's prompt and answer, rendered with the tools
            prompt = super()._prompt(record, where, max_positions)
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


class Session:
    """One episode of an environment task: its prompt's ids, each turn's outcome. Its environment and tools run
    in the task's room (env_room: threads, or worker processes); a turn is begun (`begin`: parsed, its tool
    calls or its step sent) and finished (`finish`: the reply awaited, rendered), so that the rollout runs
    the turns of a batch concurrently."""

    def __init__(self, task: "EnvTask", context: Prompt):
        self.task, self.context, self.sid = task, context, next(task.ids)
        self.tool_calls, self.reason, self.turn = 0, "", 0
        self._pending: Any = None
        self._prompt: list[int] | None = list(context.ids) if task.env_class is None else None
        self.env = Answer(task, context.record) if task.env_class is None else None
        self._opening = None if self._prompt is not None else task.room.begin(("open", self.sid, (context.record,)))

    @property
    def prompt_ids(self) -> list[int]:
        if self._prompt is None:
            reason, messages = self.task.room.finish(self._opening)
            if reason:  # the environment did not start: the episode ends at its first turn
                self.reason = "env_timeout" if reason.endswith("timeout") else reason
                messages = [{"role": "user", "content": ""}]
            self._prompt = self.task.turns.prompt_ids(messages)
        return self._prompt

    def step(self, turn: int, action: str) -> Step:
        """The outcome of assistant turn `turn` whose sampled text is `action` (begin, then finish)."""
        self.begin(turn, action)
        return self.finish()

    def begin(self, turn: int, action: str) -> None:
        task = self.task
        self.turn, self.action = turn, action
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
        elif self.env is not None:  # the answer, scored by the verifier here
            self._pending = ("done", self.env.step(parsed.message))
        else:
            self._pending = ("step", task.room.begin(("step", self.sid, parsed.message)))

    def finish(self) -> Step:
        task, (kind, what), self._pending = self.task, self._pending, None
        if kind == "end":
            return self._end(what)
        if kind == "done":
            messages, reward, done = what[0], what[1], True
        else:
            reason, value = task.room.finish(what)
            if reason:
                return self._end(reason)
            if kind == "tools":
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
        ids = task.turns.after_turn_ids(messages, self.action)
        return Step(task.tokenizer.decode(ids), False, ids=tuple(ids))

    def _end(self, reason: str) -> Step:
        assert reason in REASONS, reason
        self.reason = reason
        self._close()
        return Step("", True, False, 0.0)

    def _close(self) -> None:
        if self.env is None and not self.reason.endswith(("timeout", "lost")):
            self.task.room.finish(self.task.room.begin(("close", self.sid, ())))


def load_tasks(cfg, tokenizer, hf_config) -> dict[str, Any]:
    """Every task of ript.tasks by name, whole, checked: a dataset read and rendered with the tokenizer's
    chat template (or data.chat_template); one with `env` or `tools` an environment task."""
    r = cfg.ript
    options = check_task_entries(cfg)
    max_positions = getattr(hf_config, "max_position_embeddings", None)
    tasks: dict[str, Any] = {}
    for i, entry in enumerate(r.tasks):
        where = f"ript.tasks[{i}]"
        if i not in options:
            task = load_task(str(entry))
        elif options[i]["env"] or options[i]["tools"]:
            task = EnvTask(options[i], tokenizer, cfg.data.chat_template, r.max_new_tokens, max_positions, where,
                           r.env_step_timeout_s, r.env_workers)
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
