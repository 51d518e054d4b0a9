"""The task API and the built-in CPU suite: verifiable text tasks and an interactive one.

A task gives contexts (deterministic from a seed, split into train and held-out), starts an
episode from a context, and answers each action with the next observation, or with the end and
whether it succeeded. A single-turn task ends after one action (prompt -> completion -> verifier);
a multi-step task goes on (observation -> action -> observation ... -> success), which is the
shape a simulator-backed robot task plugs into. User tasks load by `module:Class`.
"""

from __future__ import annotations

import abc
import random
import zlib
from dataclasses import dataclass
from typing import Any, Iterator, Protocol

from ds_train.errors import UserError, load_user_object, raised_at


@dataclass(frozen=True)
class Step:
    observation: str  # text appended to the transcript before the next action ("" when done)
    done: bool
    success: bool = False
    reward: float | None = None  # the episode's reward when done; None: 1.0 on success, else 0.0
    ids: tuple[int, ...] | None = None  # the observation as token ids (chat turns: as the template renders it)


class Task(Protocol):
    name: str
    max_turns: int  # 1 for single-turn tasks

    def contexts(self, split: str, n: int, seed: int) -> list[Any]: ...
    def reset(self, context: Any) -> str: ...  # the first observation (the prompt)
    def step(self, context: Any, turn: int, action: str) -> Step: ...


def held_out(key: str) -> bool:
    """A context belongs to the held-out split by a hash of its text: disjoint, seed-independent."""
    return zlib.crc32(key.encode()) % 5 == 0


class SingleTurn(abc.ABC):
    """Prompt `<name> <input> =`, action ` <expected>\n`; the first line of the action is checked."""

    name = ""
    max_turns = 1
    digits = (3, 4)

    def make(self, rng: random.Random) -> str:
        n = rng.randint(*self.digits)
        return "".join(rng.choice("0123456789") for _ in range(n))

    @abc.abstractmethod
    def answer(self, x: str) -> str:
        """The expected completion for input x (the verifier)."""

    def contexts(self, split: str, n: int, seed: int) -> list[str]:
        rng = random.Random(f"{self.name}:{seed}")
        out, seen = [], set()
        for _ in range(n * 50):
            x = self.make(rng)
            if x not in seen and held_out(f"{self.name}:{x}") == (split == "heldout"):
                seen.add(x)
                out.append(x)
                if len(out) == n:
                    break
        return out

    def reset(self, context: str) -> str:
        return f"{self.name} {context} ="

    def step(self, context: str, turn: int, action: str) -> Step:
        got = action.strip().split("\n")[0].strip()
        return Step("", True, got == self.answer(context))

    def demonstration_messages(self, context: str) -> list[dict]:
        return [{"role": "user", "content": self.reset(context)},
                {"role": "assistant", "content": f" {self.answer(context)}\n"}]

    def demonstration(self, context: str) -> str:
        return "".join(m["content"] for m in self.demonstration_messages(context))


class Add(SingleTurn):
    name = "add"

    def make(self, rng):
        return f"{rng.randint(0, 99)}+{rng.randint(0, 99)}"

    def answer(self, x):
        a, b = x.split("+")
        return str(int(a) + int(b))


class Reverse(SingleTurn):
    name = "rev"

    def answer(self, x):
        return x[::-1]


class Copy(SingleTurn):
    name = "copy"

    def answer(self, x):
        return x


class SortDigits(SingleTurn):
    name = "sort"

    def answer(self, x):
        return "".join(sorted(x))


class Parity(SingleTurn):
    name = "parity"

    def answer(self, x):
        return "even" if sum(map(int, x)) % 2 == 0 else "odd"


class MaxDigit(SingleTurn):
    name = "max"

    def answer(self, x):
        return max(x)


class GuessNumber:
    """Interactive: find a hidden digit in up to 4 guesses, told `higher` or `lower` each time.

    Context: (hidden, lo, hi), the range the game announces. A transcript reads
    `guess 0-9 = 4\nhigher = 7\nlower = 6\n`: every action ends with a newline.
    """

    name = "guess"
    max_turns = 4

    def contexts(self, split: str, n: int, seed: int) -> list[tuple[int, int, int]]:
        universe = [(h, lo, hi) for lo in range(10) for hi in range(lo + 2, 10) for h in range(lo, hi + 1)]
        pool = [c for c in universe if held_out(f"guess:{c}") == (split == "heldout")]
        rng = random.Random(f"guess:{seed}")
        return [pool[rng.randrange(len(pool))] for _ in range(n)]

    def reset(self, context) -> str:
        _, lo, hi = context
        return f"guess {lo}-{hi} ="

    def step(self, context, turn: int, action: str) -> Step:
        hidden = context[0]
        got = action.strip().split("\n")[0].strip()
        if got == str(hidden):
            return Step("", True, True)
        if turn + 1 >= self.max_turns or not got.isdigit():
            return Step("", True, False)
        return Step(f"{'higher' if int(got) < hidden else 'lower'} =", False)

    def demonstration_messages(self, context) -> list[dict]:
        """Binary search, the behaviour a policy should learn: the game's turns and the guesses."""
        hidden, lo, hi = context
        messages = [{"role": "user", "content": self.reset(context)}]
        for turn in range(self.max_turns):
            g = (lo + hi) // 2
            messages.append({"role": "assistant", "content": f" {g}\n"})
            step = self.step(context, turn, str(g))
            if step.done:
                break
            messages.append({"role": "user", "content": step.observation})
            lo, hi = (g + 1, hi) if g < hidden else (lo, g - 1)
        return messages

    def demonstration(self, context) -> str:
        return "".join(m["content"] for m in self.demonstration_messages(context))


BUILTIN: dict[str, type] = {t.name: t for t in (Add, Reverse, Copy, SortDigits, Parity, MaxDigit, GuessNumber)}


def demonstration_records(per_task: int) -> Iterator[dict]:
    """Each built-in task's solved conversation for `per_task` training contexts (seed 0): the SFT
    data of recipes/ript_sft.yaml (recipes/data/ript_demos.jsonl, written by scripts/ript_demos.py)."""
    for name, cls in BUILTIN.items():
        task = cls()
        for context in task.contexts("train", per_task, seed=0):
            yield {"task": name, "messages": task.demonstration_messages(context)}


def load_object(spec: str, what: str):
    """`module:Class` -> an instance, or one UserError naming `what` whatever loading it or calling it
    raised, and where (errors.load_user_object)."""
    cls = load_user_object(spec, what)
    try:
        return cls()
    except Exception as e:
        raise UserError(f"{what}: {spec}() raised {raised_at(e)}") from e


def load_task(spec: str) -> Task:
    """A built-in name (add, rev, copy, sort, parity, max, guess) or `module:Class`."""
    if spec in BUILTIN:
        return BUILTIN[spec]()
    if ":" not in spec:
        raise UserError(f"ript.tasks: {spec!r} is neither a built-in task ({', '.join(BUILTIN)}) "
                        f"nor module:Class")
    task = load_object(spec, "ript.tasks")
    for attr in ("name", "max_turns", "contexts", "reset", "step"):
        if not hasattr(task, attr):
            raise UserError(f"ript.tasks: {spec!r} lacks {attr!r} (see ds_train/ript/tasks.py: Task)")
    return task
