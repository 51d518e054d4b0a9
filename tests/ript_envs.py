"""Tools and environments for the environment tests (loaded as module:function and module:Class), the
well-behaved ones and one of each fault an environment or a tool can have."""

from __future__ import annotations

import re
import time

# The control tokens of the vendored templates' families (ChatML, Llama 3): the test tokenizers' special tokens.
SPECIALS = ["<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
            "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"]


def chat_tokenizer(out_dir, words: str):
    """A small tokenizer trained on `words` (the tests' own vocabulary) with SPECIALS as special tokens and
    Llama 3's begin-of-text: every vendored template renders with it."""
    from ds_train.data.tokenizer import train_tokenizer

    tok = train_tokenizer([words] * 20, 400, out_dir)
    tok.add_special_tokens({"additional_special_tokens": SPECIALS})
    tok.bos_token = "<|begin_of_text|>"
    return tok


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


class Misbehaves:
    """One of every fault an environment can have, chosen by the sample's `kind` (a test batch plays them all at
    once): raise, hang, exit, a flood of text, a NaN / inf / numpy reward, numpy's bool as done, a `done` that is
    not a bool, a daemon child that leaves its process group, a flood of printing. Records its close()."""

    def reset(self, sample: dict) -> list[dict]:
        import os
        import subprocess
        import sys

        self.kind = sample["kind"]
        if self.kind == "reset_raises":
            raise RuntimeError("no such scene")
        if self.kind == "reset_exits":
            os._exit(3)
        if self.kind == "reset_hangs":
            time.sleep(3600)
        if self.kind == "daemon":  # a grandchild in a session of its own: out of its worker's process group
            ready = sample["ready"]
            subprocess.Popen([sys.executable, "-c", f"import os, time; os.setsid(); open({ready!r}, 'w').close(); "
                                                    f"time.sleep(600)  # {sample['tag']}"])
            for _ in range(600):  # until it has left the group
                if os.path.exists(ready):
                    break
                time.sleep(0.05)
        if self.kind == "prints":
            for _ in range(2000):
                print("x" * 1000)
            sys.stderr.write("y" * 100_000)
        if self.kind == "floods":
            return [{"role": "user", "content": "z" * 2_000_000}]
        return [{"role": "user", "content": f"Say {self.kind}."}]

    def step(self, turn: dict) -> tuple:
        import numpy as np

        kind = self.kind
        if kind == "step_raises":
            raise RuntimeError("the simulator crashed")
        if kind == "step_exits":
            import os

            os._exit(1)
        if kind == "step_sysexit":
            raise SystemExit(2)
        if kind == "step_hangs":
            time.sleep(3600)
        rewards = {"nan": float("nan"), "inf": float("inf"), "np_float32": np.float32(1.0), "np_int": np.int64(1)}
        if kind in rewards:
            return [], rewards[kind], True, {}
        if kind == "np_bool_done":
            return [], 1.0, np.bool_(True), {}
        if kind == "done_str":
            return [], 1.0, "yes", {}
        if kind == "many_messages":  # each within the message cap, all of them past the episode's
            return [{"role": "user", "content": "w" * 16000} for _ in range(40)], 0.0, False, {}
        return [], 1.0, True, {}

    def close(self) -> None:
        import os

        path = os.environ.get("DS_TRAIN_TEST_CLOSED")
        if path:
            with open(path, "a") as f:
                f.write(f"{self.kind}\n")


def picky(completion: str, answer, record: dict):
    """A verifier of the user's with one fault per record's `kind`: raises, hangs, NaN, inf, numpy, a string."""
    import numpy as np

    kind = record.get("kind")
    if kind == "v_raises":
        raise ZeroDivisionError("the verifier's own bug")
    if kind == "v_hangs":
        time.sleep(3600)
    values = {"v_nan": float("nan"), "v_inf": -float("inf"), "v_np": np.float64(1.0), "v_np_bool": np.bool_(True),
              "v_str": "1.0"}
    return values.get(kind, 1.0)


class Slowish(Countdown):
    """Each step takes 0.8 s, then the episode succeeds: several on one worker queue behind each other."""

    def reset(self, sample: dict) -> list[dict]:
        return [{"role": "user", "content": "wait"}]

    def step(self, turn):
        time.sleep(0.8)
        return [], 1.0, True, {}


class Echo(Countdown):
    """Its first message is the sample's `text` (records of a few KB fill pipes); where it runs and its limits,
    said in the message's last line."""

    def reset(self, sample: dict) -> list[dict]:
        import os
        import resource

        where = (f"pid={os.getpid()} as={resource.getrlimit(resource.RLIMIT_AS)[0]} "
                 f"fsize={resource.getrlimit(resource.RLIMIT_FSIZE)[0]}")
        return [{"role": "user", "content": sample.get("text", "") + "\n" + where}]

    def step(self, turn):
        return [], 1.0, True, {}


def make_tool():
    """Not a tool: a function that returns one."""
    return calculator


class NotBuildable(Countdown):
    def __init__(self, scene: str):
        self.scene = scene
