"""The groups between the two sides of a split job (ds_train/topology.py `Split`: trainer ranks and rollout
ranks, each side a torch.distributed world of its own): the transport room of asynchronous RL.

Each side's default process group holds its own ranks only, so DeepSpeed, ZeRO-3's collectives without a group,
the checkpoint's consensus and every statistic's all-reduce run among the trainers exactly as in a job of
trainers alone, and the rollout ranks' among themselves. What crosses between the sides goes through the groups
here, made directly on the rendezvous store (gloo on a CPU, NCCL on GPUs, the same code), outside either world:

- `everyone`: every rank of the job: the trainers' word to the rollout ranks (`broadcast`, from trainer 0), and
  point to point (`exchange`) the rollout ranks' episodes to the trainers that take them, their counts to trainer
  0, and at a save and a resume each trainer's share of what they hold;
- one group per node: the node's first trainer and its rollout ranks, over which the weights travel
  (`send_weights` / `receive_weights`), so each node's copy crosses the network once at most.
"""

from __future__ import annotations

import datetime
import pickle
import time
from typing import Any, Iterable, Iterator

from ds_train.topology import Split


def _group(store, prefix: str, rank: int, size: int, backend: str, timeout: datetime.timedelta):
    """A process group of `size` ranks on `store` under `prefix`, outside torch's world (only its members make it)."""
    import torch.distributed as tdist

    keys = tdist.PrefixStore(prefix, store)
    if backend == "nccl":
        options = tdist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return tdist.ProcessGroupNCCL(keys, rank, size, options)
    return tdist.ProcessGroupGloo(keys, rank, size, timeout)


class Bridge:
    """This rank's groups across the split; every method is a collective of the group it names."""

    def __init__(self, split: Split, store, backend: str, timeout: datetime.timedelta):
        import torch

        self.split, job = split, split.job
        self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        self.everyone = _group(store, "ds_train/bridge/all/", job.rank, job.world_size, backend, timeout)
        self.node_ranks = self.node_members(job.node_rank)
        self.node = (_group(store, f"ds_train/bridge/node{job.node_rank}/", self.node_ranks.index(job.rank),
                            len(self.node_ranks), backend, timeout) if job.rank in self.node_ranks else None)
        self.send_s = 0.0  # the last weights' time on this rank (sent or received)

    def node_members(self, node: int) -> list[int]:
        """Job ranks of a node's weight group: its first trainer, then its rollout ranks."""
        per, first = self.split.job.local_world_size, node * self.split.job.local_world_size
        return [first] + [first + i for i in range(self.split.trainers_per_node, per)]

    @property
    def leads_node(self) -> bool:
        """This rank sends its node's rollout ranks the weights (the node's first trainer)."""
        return self.split.job.rank == self.node_ranks[0]

    def _bytes(self, obj: Any):
        import torch

        return torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(self.device)

    def exchange(self, sends: dict[int, Any], sources: list[int]) -> dict[int, Any]:
        """Point to point between job ranks: each object of `sends` to its job rank, and one object from each job
        rank of `sources` (both ends of every pair call it at the same meeting). What moves is what is sent, once:
        O(ranks) messages, no padding, nothing for a rank it is not meant for."""
        import torch

        payloads = {d: self._bytes(o) for d, o in sends.items()}
        sizes_out = {d: torch.tensor([p.numel()], dtype=torch.long, device=self.device) for d, p in payloads.items()}
        sizes_in = {s: torch.zeros(1, dtype=torch.long, device=self.device) for s in sources}
        works = ([self.everyone.send([t], d, 0) for d, t in sizes_out.items()] +
                 [self.everyone.recv([t], s, 0) for s, t in sizes_in.items()])
        for work in works:
            work.wait()
        bufs = {s: torch.empty(int(t.item()), dtype=torch.uint8, device=self.device) for s, t in sizes_in.items()}
        works = ([self.everyone.send([p], d, 1) for d, p in payloads.items()] +
                 [self.everyone.recv([b], s, 1) for s, b in bufs.items()])
        for work in works:
            work.wait()
        return {s: pickle.loads(b.cpu().numpy().tobytes()) for s, b in bufs.items()}

    def broadcast(self, obj: Any = None) -> Any:
        """Trainer 0's object (job rank 0) on every rank of the job (the others pass anything)."""
        return self._broadcast(self.everyone, obj, self.split.job.rank == 0)

    def _broadcast(self, group, obj: Any, root: bool) -> Any:
        import torch

        data = self._bytes(obj) if root else None
        size = torch.tensor([data.numel() if root else 0], dtype=torch.long, device=self.device)
        group.broadcast(size, 0).wait()
        buf = data if root else torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
        group.broadcast(buf, 0).wait()
        return obj if root else pickle.loads(buf.cpu().numpy().tobytes())

    def send_weights(self, weights: Iterable[tuple[str, Any]], version: int) -> None:
        """The node's first trainer: the weights of update `version`, each (name, tensor), to the node's rollout
        ranks, then the stream's end with its version, its count and a checksum (`receive_weights` refuses a stream
        that does not add up); the other trainers walk the stream too (under ZeRO-3 and AutoTP it gathers, a
        collective of the trainers) and send nothing."""
        import torch

        t0 = time.perf_counter()
        count, checksum = 0, None
        for name, tensor in weights:
            if self.node is None:
                continue
            t = tensor.detach().to(self.device).contiguous()
            self._broadcast(self.node, (name, tuple(t.shape), str(t.dtype).removeprefix("torch.")), True)
            self.node.broadcast(t, 0).wait()
            count += 1
            checksum = _checksum(t) if checksum is None else checksum + _checksum(t)
        if self.node is not None:
            total = float(checksum.item()) if checksum is not None else 0.0
            self._broadcast(self.node, {"end": True, "version": version, "count": count, "checksum": total}, True)
        self.send_s = time.perf_counter() - t0

    def receive_weights(self) -> Iterator[tuple[str, Any]]:
        """A rollout rank: the weights its node's first trainer sends, one (name, tensor) at a time (on this
        rank's device), until the end of the stream, whose record (version, count, checksum) is then
        `self.received`. A stream whose count or checksum differs from what arrived raises."""
        import torch

        t0 = time.perf_counter()
        count, checksum = 0, None
        self.received = None
        while True:
            head = self._broadcast(self.node, None, False)
            if isinstance(head, dict):
                break
            name, shape, dtype = head
            t = torch.empty(shape, dtype=getattr(torch, dtype), device=self.device)
            self.node.broadcast(t, 0).wait()
            count += 1
            checksum = _checksum(t) if checksum is None else checksum + _checksum(t)
            yield name, t
        total = float(checksum.item()) if checksum is not None else 0.0
        if head["count"] != count or not _same(head["checksum"], total):
            raise RuntimeError(f"the weights of update {head['version']} arrived incomplete or changed: {count} "
                               f"tensor(s) with checksum {total!r}, the sender sent {head['count']} with "
                               f"{head['checksum']!r}")
        self.received = head
        self.send_s = time.perf_counter() - t0


def _same(a: float, b: float) -> bool:
    return a == b or a != a and b != b  # NaN weights (the update's guard names them) sum to NaN on both sides


def _checksum(t):
    """A tensor's float64 sum on its device (one reduction: the same bits give the same sum on both sides)."""
    return t.detach().double().sum()
