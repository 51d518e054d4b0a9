"""Periodic saves written in the background (checkpoint.async_save).

Training stops only while DeepSpeed's `save_checkpoint` runs against a checkpoint engine that
copies what it is handed into host memory instead of writing it (`Capture`): every rank's model
and optimizer states and its rank file, snapshots the next step cannot change. A thread then
writes them and runs the same commit protocol as a save that blocks (ds_train/checkpoint/commit.py's
`commit`), its barriers and rank 0's prune list passed through the rendezvous store instead of
collectives: the completeness marker only after every rank's files are durable, `latest` only
after the marker, so a crash at any moment leaves whole tags. One save is in flight at a time: the
next save, a stop and the run's last step wait for it (ds_train/checkpoint/checkpointer.py).

Costs: host memory for one copy of this rank's checkpoint state while it is written, and the CPU
the writer takes from the loop's host work.
"""

from __future__ import annotations

import copy
import json
import os
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable

from ds_train.checkpoint import commit as checkpoint
def snapshot(obj: Any, memo: dict | None = None) -> Any:
    """A copy of a state dict in host memory: tensors copied storage by storage (views of one
    storage stay views of one copy, as torch.save would write them), containers rebuilt, other
    values deep-copied."""
    import torch

    memo = {} if memo is None else memo
    if isinstance(obj, torch.Tensor):
        storage = obj.untyped_storage()
        key = (storage.data_ptr(), str(obj.device), storage.nbytes())
        if key not in memo:
            memo[key] = storage.cpu() if obj.device.type != "cpu" else storage.clone()
        out = torch.empty(0, dtype=obj.dtype).set_(memo[key], obj.storage_offset(), obj.size(), obj.stride())
        if isinstance(obj, torch.nn.Parameter):
            return torch.nn.Parameter(out, requires_grad=obj.requires_grad)
        return out.requires_grad_(obj.requires_grad) if obj.is_leaf else out
    if isinstance(obj, dict):
        out = copy.copy(obj)  # the same mapping type (OrderedDict, ...) with its attributes
        out.clear()
        out.update((k, snapshot(v, memo)) for k, v in obj.items())
        return out
    if isinstance(obj, list):
        return [snapshot(v, memo) for v in obj]
    if isinstance(obj, tuple):
        items = [snapshot(v, memo) for v in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    return copy.deepcopy(obj)


class Capture:
    """DeepSpeed's checkpoint engine during a background save: `save` keeps a snapshot of what it
    is handed; everything else (directories, loading) is the engine's own."""

    def __init__(self, inner):
        self._inner = inner
        self.files: list[tuple[str, Any]] = []

    def save(self, state_dict, path: str) -> None:
        self.files.append((str(path), snapshot(state_dict)))

    def __getattr__(self, name: str):
        return getattr(self._inner, name)


class Abandoned(Exception):
    """Another rank's part of this save failed: this rank stops writing it (the tag stays unmarked)."""


class StoreMeeting:
    """A save's barriers and rank 0's prune list through the rendezvous store (no collective: the
    writer threads of all ranks meet while their main threads train). `channel` None: one process.

    A rank may die while the others wait here, after its last collective (a writer that outran the
    training): no collective fails to say so. Each rank's watchdog republishes its heartbeat in the
    store (hb/<r>) every heartbeat_s from its own thread, whatever its main thread does; a peer's that
    stays the same for `gone_s` of this rank's clock (no clocks compared) is a process gone: the save
    is abandoned, and the collective after it names the rank."""

    POLL_S = 0.02

    def __init__(self, channel, seq: int, rank: int, world: int, gone_s: float = 10.0):
        self.channel, self.rank, self.world, self.gone_s = channel, rank, world, gone_s
        self.prefix = f"ckpt/{seq}/"
        self._beats: dict[int, tuple[str, float]] = {}  # peer -> (its last heartbeat, when it changed)
        self._looked = 0.0

    def _check(self) -> None:
        why = self.channel.get(self.prefix + "failed")
        if why is not None:
            raise Abandoned(why)
        now = time.monotonic()
        if now - self._looked < 1.0:
            return
        self._looked = now
        for peer in (r for r in range(self.world) if r != self.rank):
            beat = self.channel.get(f"hb/{peer}")
            if beat is None:  # never published (no watchdog): not judged
                continue
            last, since = self._beats.get(peer, (None, now))
            if beat != last:
                self._beats[peer] = (beat, now)
            elif now - since > self.gone_s:
                raise Abandoned(f"rank {peer}'s heartbeat stopped {now - since:.0f} s ago: its process is gone")

    def meet(self, name: str) -> None:
        if self.channel is None:
            return
        key = self.prefix + name
        self.channel.add(key, 1)
        while self.channel.add(key, 0) < self.world:
            self._check()
            time.sleep(self.POLL_S)

    def share(self, value: list | None) -> list:
        if self.channel is None:
            return value or []
        key = self.prefix + "doomed"
        if self.rank == 0:
            self.channel.set(key, json.dumps(value))
            return value or []
        while (text := self.channel.get(key)) is None:
            self._check()
            time.sleep(self.POLL_S)
        return json.loads(text)

    def fail(self, why: str) -> None:
        if self.channel is not None:
            self.channel.set(self.prefix + "failed", why)


class BackgroundSave:
    """One save: `start` (every rank; collectives) takes the snapshots and starts the writer
    thread; `join` waits for it and returns what went wrong on this rank (None: its part is done)."""

    def __init__(self, channel, log, gone_s: float = 10.0):
        self.channel, self.log, self.gone_s = channel, log, gone_s
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.stall_s = self.write_s = 0.0
        self.tag, self.step = "", 0

    def start(self, engine, ckpt_dir: Path, step: int, state: dict, rank: int, world: int, keep: int, writer: bool,
              seq: int, rank_state: dict | None, fault: Callable[[str, int], None]) -> str:
        t0 = time.perf_counter()
        self.step = step
        self.tag = checkpoint.begin(engine, ckpt_dir, step, writer, fault)
        inner = engine.checkpoint_engine
        capture = engine.checkpoint_engine = Capture(inner)
        try:
            checkpoint.save_engine(engine, ckpt_dir, self.tag, state)
        finally:
            engine.checkpoint_engine = inner
        files = [*capture.files, (str(checkpoint.rank_file(ckpt_dir / self.tag, rank)),
                                  snapshot(checkpoint.rank_record(rank_state)))]
        needed = checkpoint.needed_files(engine, ckpt_dir, self.tag)
        meeting = StoreMeeting(self.channel, seq, rank, world, self.gone_s)
        serialize = getattr(inner, "zipfile_serialization", True)
        self.stall_s = time.perf_counter() - t0

        def write() -> None:
            import torch

            t1 = time.perf_counter()
            try:
                # The lowest CPU priority, for this thread alone (Linux): the writer takes the time the
                # training threads leave (waits in collectives, on the GPU) rather than theirs.
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
            except (OSError, AttributeError):
                pass
            try:
                for i, (path, obj) in enumerate(files):
                    if i == len(files) - 1:
                        fault("written", step)  # as a blocking save: after DeepSpeed's files, before the rank file
                    torch.save(obj, path, _use_new_zipfile_serialization=serialize)
                files.clear()  # the host copy goes as soon as it is on disk
                checkpoint.commit(ckpt_dir, self.tag, step, state, rank, world, keep, writer, seq, needed,
                                  meeting.meet, meeting.share, fault, self.log.info)
            except Abandoned as e:
                self.error = e
            except BaseException as e:  # said by `join`, in the main thread
                self.error = e
                self.log.error("background save of " + self.tag + " failed:\n" +
                               "".join(traceback.format_exception(e)).rstrip())
                try:
                    meeting.fail(f"rank {rank}: {type(e).__name__}: {e}")
                except Exception:
                    pass  # the store is gone with rank 0: the job is ending anyway
            self.write_s = time.perf_counter() - t1

        self.thread = threading.Thread(target=write, name=f"ds_train-save-{self.tag}", daemon=True)
        self.thread.start()
        return self.tag

    def join(self, beat: Callable[[], None]) -> BaseException | None:
        """Wait for the writer (beating: its I/O is this rank's progress)."""
        while self.thread is not None and self.thread.is_alive():
            beat()
            self.thread.join(1.0)
        return self.error
