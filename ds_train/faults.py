"""Fault injection: the debug_fault hooks that make real failures on purpose, so that every path a
failure takes is tested, and can be tried by hand.

  watchdog.debug_fault    at the data phase of a step (step 0: of an at_start lm-eval scoring), on one rank:
                          stall, slow, raise, kill, device_assert (step_fault; Heartbeat.beat calls it)
  checkpoint.debug_fault  at a phase of a save: kill, enospc (save_fault; the checkpointer calls it)
  train.debug_loss_fault  in the loss math of a training step: the mistakes `ds-train parity` must
                          catch (loss_fault; the training step applies it)
"""

from __future__ import annotations

import os
import signal
import time
from typing import Callable


def _injected_stall() -> None:
    """watchdog.debug_fault=stall: this rank stops making progress (and sleeps, as a rank stuck on
    I/O or a lock does)."""
    while True:
        time.sleep(3600)


def _device_assert() -> None:
    """watchdog.debug_fault=device_assert: an index out of range inside a kernel on this rank's
    device, as a token id >= vocab_size makes in the embedding. On a GPU that is the real CUDA error
    ("device-side assert triggered", the CUDA context lost); on a CPU, torch's IndexError."""
    import torch

    device = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else torch.device("cpu")
    table = torch.zeros(4, device=device)
    table[torch.tensor([len(table)], device=device)].sum().item()  # .item() syncs: the error surfaces here


# where a step's fault strikes (ds_train/ript/feed.py: wait-rollouts; a rollout rank's policy calls: generate)
STEP_PHASES = ("data", "rollout", "wait-rollouts", "generate")
# ...and where step 0's does: rank 0's first forward scoring lm-eval's tasks at the start (benchmarks.at_start)
FIRST_PHASES = STEP_PHASES + ("scoring",)


def step_fault(spec: str, rank: int | str) -> Callable[[int, str], None] | None:
    """watchdog.debug_fault: the hook Heartbeat.beat calls, for ACTION:RANK:ARG on this rank (None
    elsewhere); a rollout rank N is `rN`."""
    if not spec:
        return None
    action, target, arg, *start = spec.split(":")
    if target != str(rank):
        return None
    if action == "slow":  # a step's work: its data, its rollouts (with rollout ranks: its wait for them)
        def slow(step: int, phase: str) -> None:
            if phase in STEP_PHASES and step >= int((start or [0])[0]):
                time.sleep(float(arg))
        return slow
    at = int(float(arg))

    def hook(step: int, phase: str) -> None:
        if step != at or phase not in FIRST_PHASES:
            return
        if action == "stall":
            _injected_stall()
        elif action == "kill":
            os.kill(os.getpid(), 9)
        elif action == "device_assert":
            _device_assert()
        else:
            raise RuntimeError(f"injected failure on rank {rank} at step {step} (watchdog.debug_fault)")
    return hook


def parse_save_fault(spec: str) -> tuple[str, str, int, int | None] | None:
    """checkpoint.debug_fault `ACTION:PHASE:STEP[:RANK]` (kill or enospc) -> (action, phase, step,
    rank or None for every rank)."""
    if not spec:
        return None
    action, phase, step, *rank = spec.split(":")
    return action, phase, int(step), int(rank[0]) if rank else None


def save_fault(spec: str, rank: int = 0) -> Callable[[str, int], None]:
    """The fault-injection hook of checkpoint.debug_fault: at PHASE of the save of STEP, on RANK (every
    rank without one), `kill` SIGKILLs this process (a crash), `enospc` raises the error a full disk
    raises."""
    fault = parse_save_fault(spec)
    if fault is not None and fault[3] not in (None, rank):
        fault = None

    def hook(phase: str, step: int) -> None:
        if fault is None or (phase, step) != fault[1:3]:
            return
        if fault[0] == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise OSError(28, "No space left on device (checkpoint.debug_fault)")

    return hook


# train.debug_loss_fault: the mistakes a trainer's loss math makes that only a comparison across layouts
# shows (each trains, and its loss goes down).
LOSS_FAULTS = {
    "mean_of_rank_means": "every rank's gradient is of its own mean loss, then averaged: ranks with few "
                          "target tokens weigh as much as ranks with many",
    "drop_micro_batch": "global rank 0's last micro-batch of every step adds nothing to the gradient or the loss",
    "sequence_divisor": "the gradient is divided by the data-parallel size under ZeRO-3 and by data x sequence "
                        "under ZeRO 0-2: the other stage's rule, off by parallel.sequence",
    "router_counts_local": "a mixture-of-experts model's tokens per expert are each rank's own, not summed over "
                           "the ranks",
    "aux_loss_summed": "the router's auxiliary loss is summed over a rank's micro-batches, not averaged: it weighs "
                       "gradient-accumulation-steps times as much",
}


def loss_fault_problem(spec: str) -> str | None:
    """What is wrong with a train.debug_loss_fault value (None: nothing)."""
    for part in filter(None, spec.split(",")):
        kind, _, stage = part.partition(":")
        if kind not in LOSS_FAULTS or stage and stage not in "0123":
            return (f"{part!r} is not KIND[:STAGE] with KIND one of {', '.join(LOSS_FAULTS)} and STAGE a ZeRO "
                    f"stage 0-3; give e.g. drop_micro_batch:2")
    return None


def loss_fault(spec: str, zero_stage: int) -> str:
    """The train.debug_loss_fault kind that applies under `zero_stage` ('' for none)."""
    for part in filter(None, spec.split(",")):
        kind, _, stage = part.partition(":")
        if not stage or int(stage) == zero_stage:
            return kind
    return ""
