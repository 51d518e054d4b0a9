"""Where a rank's start-up goes: from its process's start to the end of its first step, phase by phase.

A user pays the start-up on every launch and every resume; on one GPU a ~1B model's was a minute
(2026-11-26), half of it before the first step could run. The loops mark the phases as they pass them
(`mark`), and the first step's end says the whole (`said`, rank 0's console and every rank's log;
`phases` goes into results.json as `startup_s`):

    start-up: 21.4 s to the end of the first step: imports 6.1, inputs 1.2, process group 0.1,
    model 4.0, engine 3.3, run set-up 0.4, resume 0.0, first step 6.3

Wall-clock seconds (time.time), the first phase measured from the process's creation as the kernel
records it, so the interpreter's own start and every import before the first mark count.
"""

from __future__ import annotations

import time


def process_started() -> float:
    """This process's creation time (seconds since the epoch)."""
    import psutil

    return psutil.Process().create_time()


class StartupClock:
    """The phases of one rank's start-up, in the order they were marked."""

    def __init__(self, started: float):
        self.started = started
        self.marks: list[tuple[str, float]] = []
        self.finished = False  # the first step has ended: later steps are no start-up

    @classmethod
    def begin(cls) -> "StartupClock":
        """A clock from this process's start, its first phase the imports every run needs (torch,
        DeepSpeed, transformers and its model code: imported here if nothing has yet). transformers
        imports lazily: its modelling modules took 8 of the 9 s that checking a 1.1B Llama's inputs
        took on an H200 host (2026-11-28), which are imports, not checks."""
        clock = cls(process_started())
        import deepspeed  # noqa: F401
        import torch  # noqa: F401
        import transformers.modeling_utils  # noqa: F401

        clock.mark("imports")
        return clock

    def mark(self, phase: str, now: float | None = None) -> None:
        """`phase` ended now (or at `now`); a phase marked again adds to its time."""
        self.marks.append((phase, time.time() if now is None else now))

    def finish(self, phase: str = "first step") -> bool:
        """The last phase ended now; True the first time only."""
        if self.finished:
            return False
        self.mark(phase)
        self.finished = True
        return True

    def phases(self) -> dict[str, float]:
        """Seconds per phase, in order; a phase marked twice is summed."""
        out: dict[str, float] = {}
        last = self.started
        for phase, at in self.marks:
            out[phase] = out.get(phase, 0.0) + max(at - last, 0.0)
            last = at
        return out

    def total_s(self) -> float:
        return max(self.marks[-1][1] - self.started, 0.0) if self.marks else 0.0

    def said(self, end: str = "the first step") -> str:
        """One line: the whole, then each phase's seconds."""
        parts = ", ".join(f"{phase} {s:.1f}" for phase, s in self.phases().items())
        return f"start-up: {self.total_s():.1f} s to the end of {end}: {parts}"
