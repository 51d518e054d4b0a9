"""Metrics sinks behind one `log(metrics, step)` interface, plus throughput, memory and MFU.

Only global rank 0 gets real sinks (console, metrics.jsonl, wandb, progress bar); every other rank
gets null objects, so the training loop has no rank guards (STYLE habit 6, USERS.md trap 9).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from ds_train.checkpoint.rundir import RunKind, RunPaths
from ds_train.errors import UserError
from ds_train.fs import replacing, write_atomic

# Peak dense bf16 tensor TFLOP/s per device, from the vendors' data sheets (SXM parts).
# The longest matching name wins ("H100 PCIE" before "H100", "L40S" before "L40" before "L4").
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "H100 PCIE": 756.0, "A100": 312.0, "L40S": 362.0,
               "L40": 181.0, "L4": 121.0, "A10G": 70.0, "A10": 125.0, "V100": 125.0,
               "MI300X": 1307.0, "B200": 2250.0}


@dataclass(frozen=True)
class Interval:
    """When a component acts: every `every` steps (0: never), and at the `last` step."""

    every: int
    last: int

    def __contains__(self, step: int) -> bool:
        return step == self.last or (self.every > 0 and step % self.every == 0)


class Logger(Protocol):
    def log(self, metrics: dict[str, Any], step: int) -> None: ...
    def close(self) -> None: ...


class NullLogger:
    """What every rank but 0 gets: logging there is a no-op, never a branch in the loop."""

    def log(self, metrics: dict[str, Any], step: int) -> None:
        return None

    def close(self) -> None:
        return None


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e4 else f"{value:,.0f}"
    return str(value)


class ConsoleLogger:
    """One line per logged step; written through tqdm so it does not break the progress bar."""

    def __init__(self, keys: tuple[str, ...]):
        self.keys = keys

    def log(self, metrics: dict[str, Any], step: int) -> None:
        from tqdm import tqdm

        parts = [f"{k} {_fmt(metrics[k])}" for k in self.keys if metrics.get(k)]
        tqdm.write(f"step {step}: " + " | ".join(parts), file=sys.stdout)

    def close(self) -> None:
        return None  # stdout is not ours to close


class JsonlLogger:
    """metrics.jsonl: one JSON object per logged step, flushed at once (a crash loses nothing).

    Keys are the namespaced ones plus the short aliases loss, lr and tokens_per_s, and `time` (Unix
    seconds) when the record was written.
    """

    ALIASES = {"train/loss": "loss", "optim/lr": "lr", "perf/tokens_per_s": "tokens_per_s"}

    def __init__(self, path: Path):
        self.path, self.fh = path, None  # opened at the first record: after a resume has rewound it

    def log(self, metrics: dict[str, Any], step: int) -> None:
        flat: dict[str, Any] = {"step": step, "time": round(time.time(), 3)}
        for key, value in metrics.items():
            if isinstance(value, float) and not math.isfinite(value):
                value = str(value)
            flat[key] = value
            if key in self.ALIASES:
                flat[self.ALIASES[key]] = value
        try:
            if self.fh is None:
                self.fh = open(self.path, "a", buffering=1)
            self.fh.write(json.dumps(flat) + "\n")
        except OSError as e:
            raise UserError(f"{self.path}: writing step {step}'s metrics failed ({e.strerror or e}); free space "
                            f"and launch again to resume from the last checkpoint") from None

    def close(self) -> None:
        if self.fh is not None:
            with contextlib.suppress(OSError):  # a full disk already said so
                self.fh.close()


def rewind_jsonl(path: Path, step: int) -> int:
    """Keep the records up to `step` (a resumed run trains the steps after it again; -1: none, a
    fresh run starts afresh). A line that does not parse (a write cut short by a kill) is dropped;
    returns how many were."""
    if not path.is_file():
        return 0
    keep, damaged = [], 0
    for line in path.read_text(errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            at = int(record.get("step", 0))
        except (ValueError, TypeError, AttributeError):
            damaged += 1
            continue
        if at <= step:
            keep.append(line + "\n")
    with replacing(path) as tmp:
        tmp.write_text("".join(keep))
    return damaged


class WandbLogger:
    def __init__(self, mode: str, project: str, run_dir: Path, name: str, config: dict):
        import wandb

        # The API key is read by wandb itself from the environment or netrc; we never print it.
        self.run = wandb.init(project=project, name=name, dir=str(run_dir), mode=mode, config=config,
                              resume="allow", id=_wandb_id(run_dir))

    def log(self, metrics: dict[str, Any], step: int) -> None:
        self.run.log({k: v for k, v in metrics.items() if isinstance(v, (int, float))}, step=step)

    def close(self) -> None:
        self.run.finish()


def _wandb_id(run_dir: Path) -> str:
    """A stable run id kept in the run dir, so a resumed job continues the same wandb run."""
    path = run_dir / "wandb_id.txt"
    if path.is_file():
        return path.read_text().strip()
    import uuid

    run_id = uuid.uuid4().hex[:12]
    write_atomic(path, run_id)
    return run_id


class TensorBoardLogger:
    """TensorBoard event files in run_dir/tensorboard (log.tensorboard), numbers under the same keys
    as metrics.jsonl. A resumed run purges the events past its checkpoint (the steps it trains
    again), as metrics.jsonl is rewound."""

    def __init__(self, log_dir: Path):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise UserError("log.tensorboard: true needs the tensorboard package: pip install tensorboard "
                            "(or set log.tensorboard=false)") from None

        self.log_dir, self.writer_class, self.writer = log_dir, SummaryWriter, None

    def log(self, metrics: dict[str, Any], step: int) -> None:
        if self.writer is None:  # the first step this process logs: every later event is redone
            self.writer = self.writer_class(log_dir=str(self.log_dir), purge_step=step)
        for key, value in metrics.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


class MultiLogger:
    def __init__(self, sinks: list[Logger]):
        self.sinks = sinks

    def log(self, metrics: dict[str, Any], step: int) -> None:
        """Nothing to log (a step where no component reported) writes nothing."""
        for sink in self.sinks if metrics else ():
            sink.log(metrics, step)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


def build_logger(is_main: bool, paths: RunPaths, wandb_mode: str, project: str, config: dict,
                 console_keys: tuple[str, ...], tensorboard: bool = False) -> Logger:
    """Real sinks on global rank 0, a null logger everywhere else."""
    if not is_main:
        return NullLogger()
    sinks: list[Logger] = [ConsoleLogger(console_keys), JsonlLogger(paths.metrics)]
    if tensorboard:
        sinks.append(TensorBoardLogger(paths.tensorboard))
    if wandb_mode != "off":
        sinks.append(WandbLogger(wandb_mode, project, paths.root, paths.root.name, config))
    return MultiLogger(sinks)


class Progress:
    """A tqdm bar on rank 0 that shows one metric as it is logged; closes when its block ends."""

    def __init__(self, total: int, initial: int, desc: str, unit: str, postfix: tuple[str, str]):
        from tqdm import tqdm

        self.bar = tqdm(total=total, initial=initial, desc=desc, unit=unit, dynamic_ncols=True,
                        file=sys.stdout, mininterval=1.0)
        self.key, self.label = postfix

    def advance(self, metrics: dict[str, Any]) -> None:
        """One step done; show the metric if this step logged it."""
        self.bar.update()
        if metrics.get(self.key) is not None:
            self.bar.set_postfix_str(f"{self.label} {metrics[self.key]:.3f}")

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.bar.close()


class NullProgress:
    """The progress bar of every rank but 0 (and of rank 0 with log.progress false)."""

    def advance(self, metrics: dict[str, Any]) -> None:
        return None

    def __enter__(self) -> "NullProgress":
        return self

    def __exit__(self, *exc) -> None:
        return None


def build_progress(is_main: bool, enabled: bool, total: int, kind: RunKind, initial: int = 0):
    """The kind's bar (its name, its unit, its metric) on rank 0, a null one elsewhere."""
    return Progress(total, initial, kind.name, kind.unit, kind.progress) if is_main and enabled else NullProgress()


def device_name(on_gpu: bool) -> str:
    """The device's name, as the MFU table and env.json read it: the GPU's, else the processor's."""
    import platform

    import torch

    return torch.cuda.get_device_name() if on_gpu else platform.processor() or "cpu"


def peak_flops(device_name: str, override_tflops: float) -> float | None:
    """Peak FLOP/s of one device: the override, else the table, else None (no MFU, e.g. on CPU)."""
    if override_tflops > 0:
        return override_tflops * 1e12
    for key in sorted(PEAK_TFLOPS, key=len, reverse=True):
        if key in device_name.upper():
            return PEAK_TFLOPS[key] * 1e12
    return None


def mfu(tokens_per_s_per_device: float, flops_per_token: float, peak: float | None) -> float | None:
    return tokens_per_s_per_device * flops_per_token / peak if peak else None


def memory_gib(device_type: str) -> tuple[float, float]:
    """(accelerator max allocated, process RSS) in GiB for this rank."""
    import psutil

    rss = psutil.Process(os.getpid()).memory_info().rss / 2**30
    gpu = 0.0
    if device_type == "cuda":
        import torch

        gpu = torch.cuda.max_memory_allocated() / 2**30
    return gpu, rss
