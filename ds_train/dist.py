"""The only module that touches torch.distributed / deepspeed.comm or reads rank variables.

Everything else receives `rank` and `world_size` as plain ints. Supported launchers: the
`deepspeed` launcher, torchrun, SLURM srun, a manual RANK/WORLD_SIZE/MASTER_ADDR environment, and
a plain single process.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
from dataclasses import dataclass
from typing import Any, Mapping

from ds_train.errors import UserError


@dataclass(frozen=True)
class DistEnv:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    master_addr: str
    master_port: int
    launcher: str  # deepspeed | torchrun | slurm | manual | single

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _int(environ: Mapping[str, str], key: str, default: int | None = None) -> int:
    if default is not None and not environ.get(key):
        return default
    value = environ.get(key, "")
    if not re.fullmatch(r"\d+", value.strip()):
        raise UserError(f"environment: {key}={value!r} must be a non-negative integer")
    return int(value)


def first_slurm_host(nodelist: str) -> str:
    """First host of a SLURM node list: 'gpu[003-005,009],cpu1' -> 'gpu003'."""
    m = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not m:
        raise UserError(f"environment: cannot read SLURM_JOB_NODELIST={nodelist!r}")
    prefix, ranges = m.group(1), m.group(2)
    if not ranges:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


def detect_env(environ: Mapping[str, str] | None = None) -> DistEnv:
    """Work out rank / world / master from whichever launcher started us (a pure function)."""
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:
        world = _int(env, "WORLD_SIZE")
        # torchrun exports LOCAL_WORLD_SIZE; the deepspeed launcher exports LOCAL_SIZE.
        local_world = _int(env, "LOCAL_WORLD_SIZE", _int(env, "LOCAL_SIZE", world))
        launcher = ("torchrun" if "TORCHELASTIC_RUN_ID" in env
                    else "deepspeed" if "CROSS_RANK" in env or "LOCAL_SIZE" in env or
                    env.get("DS_TRAIN_LAUNCHER") == "deepspeed" else "manual")
        if "CROSS_RANK" in env:  # the deepspeed launcher's node index
            node_rank = _int(env, "CROSS_RANK")
        elif "GROUP_RANK" in env:  # torchrun's
            node_rank = _int(env, "GROUP_RANK")
        else:
            node_rank = _int(env, "NODE_RANK", 0)
        if "MASTER_ADDR" not in env or "MASTER_PORT" not in env:
            raise UserError("environment: RANK and WORLD_SIZE are set but MASTER_ADDR or MASTER_PORT "
                            "is not; set both (or launch with deepspeed / torchrun)")
        rank = _int(env, "RANK")
        if rank >= world:
            raise UserError(f"environment: RANK={rank} must be below WORLD_SIZE={world}")
        return DistEnv(rank, _int(env, "LOCAL_RANK", 0), world, local_world, node_rank,
                       env["MASTER_ADDR"], _int(env, "MASTER_PORT"), launcher)
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or "localhost"
        job_id = _int(env, "SLURM_JOB_ID", 0)
        ntasks = _int(env, "SLURM_NTASKS")
        nnodes = _int(env, "SLURM_NNODES", 1)
        # A port derived from the job id, so two jobs sharing a node do not collide.
        port = _int(env, "MASTER_PORT", 29500 + job_id % 1000)
        return DistEnv(_int(env, "SLURM_PROCID"), _int(env, "SLURM_LOCALID"), ntasks,
                       max(1, ntasks // max(1, nnodes)), _int(env, "SLURM_NODEID", 0),
                       env.get("MASTER_ADDR") or first_slurm_host(nodelist), port, "slurm")
    return DistEnv(0, 0, 1, 1, 0, "127.0.0.1", 0, "single")


def rank_for_messages() -> int:
    """This process's rank for prefixing an error line; 0 when the environment cannot tell."""
    try:
        return detect_env().rank
    except UserError:
        return 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init(env: DistEnv, timeout_s: float = 1800) -> None:
    """Join the process group through deepspeed.comm (gloo on the CPU, NCCL on GPUs)."""
    import datetime

    import deepspeed
    from deepspeed.accelerator import get_accelerator

    port = env.master_port or _free_port()
    os.environ.update(RANK=str(env.rank), LOCAL_RANK=str(env.local_rank), WORLD_SIZE=str(env.world_size),
                      LOCAL_WORLD_SIZE=str(env.local_world_size), MASTER_ADDR=env.master_addr,
                      MASTER_PORT=str(port))
    accel = get_accelerator()
    if accel.device_name() == "cuda":
        accel.set_device(env.local_rank)
    deepspeed.init_distributed(auto_mpi_discovery=False, timeout=datetime.timedelta(seconds=timeout_s))


def device():
    import torch
    from deepspeed.accelerator import get_accelerator

    return torch.device(get_accelerator().current_device_name())


def accelerator_name() -> str:
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().device_name()


def _reduce(values: list[float], op: str) -> list[float]:
    import torch
    import deepspeed.comm as comm

    t = torch.tensor(values, dtype=torch.float64, device=device())
    if comm.is_initialized() and comm.get_world_size() > 1:
        comm.all_reduce(t, op=comm.ReduceOp.SUM if op == "sum" else comm.ReduceOp.MAX)
    return t.tolist()


def all_reduce_sum(values: list[float]) -> list[float]:
    """Sum a list of numbers over all ranks in one collective (every rank must call it)."""
    return _reduce(values, "sum")


def all_reduce_max(values: list[float]) -> list[float]:
    return _reduce(values, "max")


def all_gather_object(obj: Any) -> list[Any]:
    import deepspeed.comm as comm
    import torch.distributed as tdist

    if not comm.is_initialized() or comm.get_world_size() == 1:
        return [obj]
    out = [None] * comm.get_world_size()
    tdist.all_gather_object(out, obj)
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


def shutdown() -> None:
    import torch.distributed as tdist

    if tdist.is_available() and tdist.is_initialized():
        tdist.destroy_process_group()
