"""The only package that touches torch.distributed / deepspeed.comm (this module, and the groups between
the sides of a split job: ds_train/dist/bridge.py).

Everything else receives `rank` and `world_size` as plain ints. Which rank this process is, from
whichever launcher started it, is ds_train/topology.py's (`detect_env`, a `DistEnv`); `init` joins
the process group from it.
"""

from __future__ import annotations

import contextlib
import os
import socket
from dataclasses import replace
from typing import Any

from ds_train.errors import Stalled, UserError
from ds_train.topology import DistEnv, detect_env, node_hosts


def rank_for_messages() -> int:
    """This process's rank for prefixing an error line; 0 when the environment cannot tell."""
    try:
        return detect_env().rank
    except UserError:
        return 0


def free_port() -> int:
    """A TCP port free on this host now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init(env: DistEnv, timeout_s: float = 1800, join_timeout_s: float = 300, host: str = "") -> None:
    """Join the process group through deepspeed.comm (gloo on the CPU, NCCL on GPUs).

    Several ranks meet first in the rendezvous store (`rendezvous`), so ranks that never arrive are
    named; the process group is then built on that store. A rank of a split job (`env.split`: trainer and
    rollout ranks) meets the whole job there, joins its side's world as its default group, and makes the
    groups between the sides (ds_train/dist/bridge.py, `sides()`)."""
    import datetime

    import deepspeed
    import torch.distributed as tdist
    from deepspeed.accelerator import get_accelerator

    job = env.split.job if env.split else env
    port = job.master_port or free_port()  # several ranks must agree on it before any binds it
    os.environ.update(RANK=str(env.rank), LOCAL_RANK=str(job.local_rank), WORLD_SIZE=str(env.world_size),
                      LOCAL_WORLD_SIZE=str(env.local_world_size), MASTER_ADDR=env.master_addr,
                      MASTER_PORT=str(port))
    accel = get_accelerator()
    timeout = datetime.timedelta(seconds=timeout_s)
    if accel.device_name() == "cuda":
        accel.set_device(job.local_rank)
    # Every group made later (DeepSpeed's clone of the world for data parallelism, ZeRO's groups,
    # the token groups) takes torch's default timeout (30 min gloo, 10 min NCCL), not the world's:
    # without this, dist.timeout_s never applied to the collectives a training step runs.
    from torch.distributed import distributed_c10d

    distributed_c10d.default_pg_timeout = timeout
    if isinstance(getattr(distributed_c10d, "default_pg_nccl_timeout", None), datetime.timedelta):
        distributed_c10d.default_pg_nccl_timeout = timeout
    kwargs = {"device_id": accel.device(job.local_rank)} if accel.device_name() == "cuda" else {}
    backend = accel.communication_backend_name()
    if job.world_size == 1 and not job.master_port and not tdist.is_initialized():
        # One process and no port given: its store binds a port the OS picks and holds it. A port
        # chosen first and bound later can be taken in between by another job on the host.
        store = _open_store(env, 0, timeout_s, True)
        os.environ["MASTER_PORT"] = str(store.port)
        tdist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=timeout, **kwargs)
    if job.world_size > 1 and not tdist.is_initialized():
        store = rendezvous(job, port, join_timeout_s, host or socket.gethostname())
        side = tdist.PrefixStore(f"ds_train/{env.split.role}/", store) if env.split else store
        tdist.init_process_group(backend, store=side, rank=env.rank, world_size=env.world_size, timeout=timeout,
                                 **kwargs)
        if job.rank == backup_rank(job):
            _serve_backup(job, store)
        if env.split:
            from ds_train.dist.bridge import Bridge

            _bridges[:] = [Bridge(env.split, store, backend, timeout)]
    deepspeed.init_distributed(auto_mpi_discovery=False, timeout=timeout)


_bridges: list = []  # this process's Bridge, once a split job's init made it


def sides():
    """The groups between trainer and rollout ranks (ds_train/dist/bridge.py): a split job's, after `init`."""
    return _bridges[0]


def backup_rank(env: DistEnv) -> int:
    """The rank that serves the second store: the first rank of the last node (another host than
    rank 0 where there are several), so that the death of any one rank or host leaves one store."""
    per_node = max(1, env.local_world_size)
    return env.world_size - per_node if env.world_size > per_node else env.world_size - 1


_backup_server: list = []  # kept alive for the life of the process


def _serve_backup(env: DistEnv, store) -> None:
    """Serve the backup store on a free port and tell every rank where, through the first store."""
    import datetime

    from torch.distributed import PrefixStore, TCPStore

    server = TCPStore("0.0.0.0", 0, None, True, timeout=datetime.timedelta(seconds=30), wait_for_workers=False)
    _backup_server.append(server)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:  # the address that reaches rank 0's host
        probe.connect((env.master_addr, 9))
        addr = probe.getsockname()[0]
    PrefixStore(_namespace(), store).set("backup", f"{addr}:{server.port}")


def _namespace() -> str:
    """Store keys of this attempt: a restarted job (torchrun's restarts, a SLURM requeue) reuses
    neither the keys nor the verdicts of the last one."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT") or os.environ.get("SLURM_RESTART_COUNT") or "0"
    return f"ds_train/{attempt}/"


def _open_store(env: DistEnv, port: int, timeout_s: float, server: bool):
    import datetime

    from torch.distributed import TCPStore
    return TCPStore(env.master_addr, port, env.world_size, is_master=server,
                    timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False)


def missing_ranks_line(missing: list[int], joined: dict[int, dict], env: DistEnv, hosts: list[str],
                       timeout_s: float) -> str:
    """Which ranks never reached the rendezvous, by node and host (a pure function)."""
    per_node = max(1, env.local_world_size)
    by_node: dict[int, list[int]] = {}
    for r in missing:
        by_node.setdefault(r // per_node, []).append(r)
    known = {info["node"]: info["host"] for info in joined.values()}
    parts = []
    for node, ranks in sorted(by_node.items()):
        host = known.get(node) or (hosts[node] if node < len(hosts) else "host unknown")
        parts.append(f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} (node {node}, {host})")
    return (f"start-up: {'; '.join(parts)} did not reach the rendezvous at {env.master_addr}:{env.master_port} "
            f"within dist.join_timeout_s={timeout_s:g} s ({len(joined)} of {env.world_size} ranks did); their "
            f"launcher did not start them, or they failed or hung before it (see that node's output)")


def rendezvous(env: DistEnv, port: int, timeout_s: float, host: str):
    """The store every rank meets in: rank 0 serves it (unless torchrun's agent does); each rank
    announces itself, and waits until all have. Ranks missing at the timeout are named."""
    import json
    import time

    from torch.distributed import DistError, PrefixStore

    server = env.rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
    try:
        store = _open_store(env, port, timeout_s, server)
    except DistError as e:
        if server:
            raise UserError(f"start-up: rank 0 cannot listen on {env.master_addr}:{port} ({str(e).splitlines()[0]}); "
                            f"another job holds the port: choose another master port") from None
        raise Stalled(f"start-up: rank {env.rank} ({host}) could not reach the rendezvous at "
                      f"{env.master_addr}:{port} (rank 0) within dist.join_timeout_s={timeout_s:g} s: rank 0 did "
                      f"not start, or this host cannot reach that address and port (firewall, wrong "
                      f"interface)") from None
    keys = PrefixStore(_namespace(), store)
    keys.set(f"join/{env.rank}", json.dumps({"host": host, "node": env.node_rank, "pid": os.getpid()}))
    wanted = [f"join/{r}" for r in range(env.world_size)]
    deadline, pause = time.monotonic() + timeout_s, 0.05
    try:
        while not keys.check(wanted):
            if keys.check(["join/failed"]):
                keys.add("join/told", 1)
                raise Stalled(keys.get("join/failed").decode(), agreed=True)
            if time.monotonic() > deadline:
                joined = {r: json.loads(keys.get(f"join/{r}")) for r in range(env.world_size)
                          if keys.check([f"join/{r}"])}
                missing = [r for r in range(env.world_size) if r not in joined]
                line = missing_ranks_line(missing, joined, replace(env, master_port=port), node_hosts(), timeout_s)
                if env.rank == 0:  # say it once, and serve the store until the others have read it
                    keys.set("join/failed", line)
                    told = time.monotonic() + 5
                    while keys.add("join/told", 0) < len(joined) - 1 and time.monotonic() < told:
                        time.sleep(0.1)
                raise Stalled(line, agreed=env.rank != 0)
            time.sleep(pause)
            pause = min(2 * pause, 0.25)  # a store check is cheap; a longer pause delays every start-up
    except DistError:  # rank 0 gave up and took the store with it: it says why
        raise Stalled(f"start-up: rank {env.rank}: the rendezvous at {env.master_addr}:{port} ended before every "
                      f"rank joined", agreed=True) from None
    return store


class SideChannel:
    """Small messages between ranks without a collective: a connection of its own to the
    rendezvous store, safe to use from a thread while the main thread waits in a collective (the
    watchdog's heartbeats and alarms, `ds-train launch`'s stop requests). Values are text.

    Rank 0 serves that store, so it goes with rank 0. A second store, served by `backup_rank`,
    keeps the channel: `fail_over` moves to it once the first no longer answers (what `mirror`
    wrote is there already)."""

    def __init__(self, addr: str, port: int, timeout_s: float = 10.0, backup: str | None = None):
        import threading

        self._timeout_s = timeout_s
        self._keys = self._connect(addr, port)
        self.backup = backup  # "addr:port" of the second store, None without one
        self._mirror = None
        self.on_backup = False
        self._lock = threading.Lock()

    def _connect(self, addr: str, port: int):
        import datetime

        from torch.distributed import PrefixStore, TCPStore

        store = TCPStore(addr, port, is_master=False, timeout=datetime.timedelta(seconds=self._timeout_s))
        return PrefixStore(_namespace(), store)

    def _second(self):
        if self._mirror is None and self.backup:
            addr, _, port = self.backup.rpartition(":")
            self._mirror = self._connect(addr, int(port))
        return self._mirror

    def set(self, key: str, value: str) -> None:
        self._keys.set(key, value)

    def mirror(self, key: str, value: str) -> None:
        """Set `key` in both stores (a heartbeat must outlive rank 0)."""
        self._keys.set(key, value)
        if not self.on_backup and self.backup:
            try:
                self._second().set(key, value)
            except Exception:  # the backup's rank is gone: the first store still has it
                self.backup, self._mirror = None, None

    def get(self, key: str) -> str | None:
        """The value, or None when the key is not set (never waits for it)."""
        return self._keys.get(key).decode() if self._keys.check([key]) else None

    def add(self, key: str, amount: int = 1) -> int:
        return int(self._keys.add(key, amount))

    def fail_over(self) -> bool:
        """The first store stopped answering: use the second from now on. False without one (or
        when it is gone too). Safe from several threads: the first caller moves, the rest see it."""
        with self._lock:
            if self.on_backup:
                return True
            try:
                second = self._second()
                second.check(["backup"])  # answers?
            except Exception:
                return False
            if second is None:
                return False
            self._keys, self.on_backup = second, True
            return True


def side_channel(env: DistEnv, timeout_s: float = 30.0) -> SideChannel | None:
    """This rank's side channel (after `init`); None for a single process."""
    if env.world_size == 1:
        return None
    import datetime

    channel = SideChannel(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
    channel._keys.wait(["backup"], datetime.timedelta(seconds=timeout_s))  # backup_rank serves it by now
    channel.backup = channel.get("backup")
    return channel


def send_stop(addr: str, port: int, signum: int, timeout_s: float = 5.0) -> bool:
    """Ask every rank of a running job to save and stop, as if each got `signum` (for `ds-train
    launch`, which may not share a machine with any rank). False when the job cannot be reached."""
    from torch.distributed import DistError

    try:
        channel = SideChannel(addr, port, timeout_s)
        channel.set("signal", str(signum))
        channel.add("alarm", 1)
    except DistError:
        return False
    return True


def device():
    import torch
    from deepspeed.accelerator import get_accelerator

    return torch.device(get_accelerator().current_device_name())


def accelerator_name() -> str:
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().device_name()


def _reduce(values: list[float], op: str, group=None) -> list[float]:
    import torch

    return all_reduce_tensor(torch.tensor(values, dtype=torch.float64, device=device()), group, op).tolist()


def all_reduce_sum(values: list[float], group=None) -> list[float]:
    """Sum a list of numbers over the ranks of `group` (None: all) in one collective (every rank of
    it must call it)."""
    return _reduce(values, "sum", group)


def all_reduce_tensor(t, group=None, op: str = "sum"):
    """Sum (or max) a tensor over the ranks of `group` (None: all), in place; returns it."""
    import deepspeed.comm as comm

    if comm.is_initialized() and comm.get_world_size() > 1:
        comm.all_reduce(t, op=comm.ReduceOp.SUM if op == "sum" else comm.ReduceOp.MAX, group=group)
    return t


def subgroup(groups: list[list[int]], rank: int):
    """The process group among `groups` (disjoint lists of ranks covering the world) that holds
    `rank`; None when one group is the whole world (the default group). Every rank must call it
    with the same lists: each group is created by all ranks, in order."""
    import deepspeed.comm as comm

    if len(groups) == 1:
        return None
    mine = None
    for ranks in groups:
        group = comm.new_group(ranks)
        if rank in ranks:
            mine = group
    return mine


def tensor_parallel_groups(size: int):
    """DeepSpeed's data x tensor groups for AutoTP (tensor innermost: runs of `size` consecutive
    ranks), made once per process; the module DeepSpeed reads them from, to hand in as its `mpu`."""
    from deepspeed.utils import groups

    groups._init_tp_mesh_device(tensor_model_parallel_size=size)
    return groups


def tensor_parallel_group():
    """This rank's AutoTP group (tensor_parallel_groups made it)."""
    from deepspeed.utils import groups

    return groups.get_tensor_model_parallel_group()


def all_reduce_max(values: list[float]) -> list[float]:
    return _reduce(values, "max")


def all_gather_floats(values: list[float]) -> list[list[float]]:
    """Every rank's list of numbers (all the same length), in rank order: one small collective."""
    import torch
    import deepspeed.comm as comm

    t = torch.tensor(values, dtype=torch.float64, device=device())
    if not comm.is_initialized() or comm.get_world_size() == 1:
        return [t.tolist()]
    out = [torch.empty_like(t) for _ in range(comm.get_world_size())]
    comm.all_gather(out, t)
    return [o.tolist() for o in out]


def all_gather_object(obj: Any, group=None) -> list[Any]:
    """Every rank's object in rank order, over `group` (None: all ranks; each of them must call it)."""
    import deepspeed.comm as comm
    import torch.distributed as tdist
    if not comm.is_initialized() or comm.get_world_size() == 1:
        return [obj]
    out = [None] * tdist.get_world_size(group)
    tdist.all_gather_object(out, obj, group=group)
    return out


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank `src`'s object on every rank (every rank must call it; the others pass anything)."""
    import deepspeed.comm as comm
    import torch.distributed as tdist

    if not comm.is_initialized() or comm.get_world_size() == 1:
        return obj
    box = [obj]
    tdist.broadcast_object_list(box, src=src)
    return box[0]


def barrier() -> None:
    import deepspeed.comm as comm

    if comm.is_initialized() and comm.get_world_size() > 1:
        comm.barrier()


def release_shared_memory(env: DistEnv) -> None:
    """Unlink this job's /dev/shm buffers of DeepSpeed's CPU all-reduce (it never does; 69 MB a
    rank). Called after a barrier: every rank has them mapped, so unlinking frees them at exit."""
    import glob

    if env.local_rank == 0:
        for path in glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_{os.environ.get('MASTER_PORT', '')}_*"):
            with contextlib.suppress(OSError):  # already gone
                os.unlink(path)


def leave() -> None:
    """Every rank out of the process group together: one exiting with it up while a peer tears its own
    down can abort at exit (gloo: "terminate called without an active exception"), code 2 turned -6."""
    barrier()
    shutdown()


def shutdown() -> None:
    import torch.distributed as tdist

    if tdist.is_available() and tdist.is_initialized():
        tdist.destroy_process_group()
