"""Tools and environments for the environment tests (loaded as module:function and module:Class), the
well-behaved ones and one of each fault an environment or a tool can have."""

from __future__ import annotations

import re
import time


def calculator(expression: str) -> str:
    """Evaluates an arithmetic expression of integers.

    Args:
        expression: digits, + - * and parentheses, e.g. "12 * 34"
    """
    if not re.fullmatch(r"[\d\s+\-*()]+", expression):
        raise ValueError(f"not an arithmetic expression: {expression!r}")
    return str(eval(expression))  # digits and operators only (checked above)


def slow(seconds: float) -> str:
    """Sleeps, then says so.

    Args:
        seconds: how long to sleep
    """
    time.sleep(seconds)
    return "slept"


class Countdown:
    """Multi-turn, user turns only: the policy counts down from the sample's n, one number a turn; each right
    number is answered "next", a wrong one ends the episode. Reward 1 at zero."""

    def reset(self, sample: dict) -> list[dict]:
        self.n = int(sample["n"])
        return [{"role": "user", "content": f"Count down from {self.n}."}]

    def step(self, turn: dict) -> tuple[list[dict], float, bool, dict]:
        said = turn["content"].split("</think>")[-1].strip()
        if said != str(self.n):
            return [], 0.0, True, {"wrong": said}
        self.n -= 1
        if self.n < 0:
            return [], 1.0, True, {}
        return [{"role": "user", "content": "next"}], 0.0, False, {}


class RaisesOnStep(Countdown):
    def step(self, turn):
        raise RuntimeError("the simulator crashed")


class RaisesOnReset(Countdown):
    def reset(self, sample):
        raise KeyError("no such scene")


class HangsOnStep(Countdown):
    def step(self, turn):
        time.sleep(3600)


class Malformed(Countdown):
    def step(self, turn):
        return "next", 0.0, False  # not (messages, reward, done, info)


CALL = '<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{}"}}}}\n</tool_call><|im_end|>'


class ToolScript:
    """A scripted policy (ript.policy) for the environment launch tests. calc: rollouts 0 and 1 call the
    calculator, then answer with its result; 2 writes a call that does not parse; 3 calls `slow`, which runs
    past ript.env_step_timeout_s. sim (an environment that raises): a number."""

    def act(self, task: str, context, transcript: str, index: int) -> str:
        if task.startswith("sim"):
            return "3<|im_end|>"
        if "<tool_response>" in transcript:
            return transcript.rsplit("<tool_response>\n", 1)[1].split("\n", 1)[0] + "<|im_end|>"
        if index == 2:
            return '<tool_call>\n{"name": "calculator", "arguments": </tool_call><|im_end|>'
        if index == 3:
            return '<tool_call>\n{"name": "slow", "arguments": {"seconds": 60}}\n</tool_call><|im_end|>'
        return CALL.format(context.record["expression"])


class Chatter:
    """Three turns whatever the policy says ("go on" after the first two); reward 1 when the last turn's text
    has an even length: random rewards for a random policy, so groups disagree and the policy updates."""

    def reset(self, sample: dict) -> list[dict]:
        self.turn = 0
        return [{"role": "user", "content": f"Say something ({sample['n']})."}]

    def step(self, turn: dict) -> tuple[list[dict], float, bool, dict]:
        self.turn += 1
        if self.turn < 3:
            return [{"role": "user", "content": "go on"}], 0.0, False, {}
        return [], float(len(turn["content"]) % 2 == 0), True, {}


class Unhurried(Countdown):
    """Countdown whose reset takes an uneven time (0-80 ms, drawn anew each episode): ranks finish their batches at
    times that differ from batch to batch."""

    def reset(self, sample: dict) -> list[dict]:
        import random

        time.sleep(random.uniform(0.0, 0.08))
        return super().reset(sample)


class Sluggish(Countdown):
    """Countdown whose every reset takes 200 ms: rollouts slower than the update (a trainer starved)."""

    def reset(self, sample: dict) -> list[dict]:
        time.sleep(0.2)
        return super().reset(sample)
