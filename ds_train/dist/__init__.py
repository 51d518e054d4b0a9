"""The only package that touches torch.distributed / deepspeed.comm: this module (joining the process group, the
collectives every part uses), store.py (the rendezvous store and the side channel over it) and bridge.py (the
groups between the sides of a split job).

Everything else receives `rank` and `world_size` as plain ints. Which rank this process is, from
whichever launcher started it, is ds_train/topology.py's (`detect_env`, a `DistEnv`); `init` joins
the process group from it.
"""

from __future__ import annotations

import contextlib
import os
import socket
from typing import Any

from ds_train.dist.store import _open_store, _serve_backup, backup_rank, free_port, rendezvous
from ds_train.errors import UserError
from ds_train.topology import DistEnv, detect_env


def rank_for_messages() -> int:
    """This process's rank for prefixing an error line; 0 when the environment cannot tell."""
    try:
        return detect_env().rank
    except UserError:
        return 0


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
