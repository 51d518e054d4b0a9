"""A scripted, deterministic policy for the RIPT launcher tests (loaded as ript.policy)."""

from __future__ import annotations

import zlib

from ds_train.ript.tasks import load_task

K = 4
SOLVED = {"add", "rev"}  # every rollout succeeds: these contexts are never accepted


def wins(task: str, context) -> int:
    """How many of the K rollouts of this context succeed: rollout i succeeds iff i < wins."""
    return K if task in SOLVED else zlib.crc32(f"{task}:{context}".encode()) % (K + 1)


class Scripted:
    def act(self, task: str, context, transcript: str, index: int) -> str:
        right = load_task(task).answer(context)
        return f" {right if index < wins(task, context) else right + '9'}\n"


class Half:
    """Every context: rollouts 0 and 1 of K right, 2 and 3 wrong. Every group is accepted, so the
    contexts a run draws do not depend on how the tasks are sharded (the re-split test)."""

    def act(self, task: str, context, transcript: str, index: int) -> str:
        right = load_task(task).answer(context)
        return f" {right if index < K // 2 else right + '9'}\n"
