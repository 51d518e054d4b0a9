"""completions.jsonl: rank 0's rollouts, as they were generated (ript.log_completions per iteration and
per held-out evaluation): the task, the transcript, the token ids, which of them the policy generated,
the sampling engine's log-prob of each (vLLM's or the rollout ranks'; null from a colocated Hugging Face generate),
with rollout ranks the version of the weights that generated it, the reward; an environment's episode its turns,
tool calls and the fault that ended it ("" when none). TRL's
log_completions, as a file: what the policy actually said, and what a test compares token for token."""

from __future__ import annotations

import json
from pathlib import Path

from ds_train.fs import write_atomic


class Completions:
    """Appends rank 0's first `limit` rollouts of each iteration and kind; on other ranks, and with limit 0,
    nothing."""

    def __init__(self, path: Path, limit: int, writer: bool):
        self.path, self.limit, self.on = path, limit, writer and limit > 0
        self.written: dict[tuple[int, str], int] = {}

    def rewind(self, iteration: int) -> None:
        """Drop what iterations after `iteration` wrote (a resume repeats them; -1: a fresh start)."""
        if not self.on or not self.path.exists():
            return
        kept = [line for line in self.path.read_text().splitlines()
                if line.strip() and json.loads(line)["iteration"] <= iteration]
        write_atomic(self.path, "".join(line + "\n" for line in kept))

    def add(self, iteration: int, kind: str, episodes: list, versions: list[int] | None = None) -> None:
        """`kind`: train (sampled rollouts) or eval (greedy, held-out); `versions`: with rollout ranks, the version
        of the weights that generated each episode (updates done), as the rollout rank loaded them."""
        done = self.written.get((iteration, kind), 0)
        if not self.on or done >= self.limit or not episodes:
            return
        self.written[(iteration, kind)] = done + len(episodes[:self.limit - done])
        with self.path.open("a") as f:
            for n, e in enumerate(episodes[:self.limit - done]):
                f.write(json.dumps({"iteration": iteration, "kind": kind, "task": e.task.name, "sample": e.index,
                                    **({"version": versions[n]} if versions is not None else {}),
                                    "text": e.text, "ids": e.ids, "action_mask": e.action_mask,
                                    "logprobs": e.logprobs, "reward": e.reward, "success": e.success,
                                    "truncated": e.truncated, "turns": e.turns, "tool_calls": e.tool_calls,
                                    "reason": e.reason}) + "\n")
