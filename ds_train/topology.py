"""Where this process sits in the job, read from whichever launcher started it: rank, local rank,
world size, node, the job's nodes where the launcher says them, and master address (`detect_env`, a
`DistEnv`), and the host of each node (`node_hosts`, SLURM node lists expanded). Pure reads of the
environment: no process group. A job split into trainer and rollout ranks (`split_job`) needs the same
number of ranks on every node; under the deepspeed launcher each rank knows its own node's (LOCAL_SIZE)
and the job's nodes (CROSS_SIZE), so a rank of an uneven hostfile says so itself.

Supported launchers: the `deepspeed` launcher, torchrun, SLURM srun, a manual
RANK/WORLD_SIZE/MASTER_ADDR environment, and a plain single process. ds_train/dist/ joins the
process group from a `DistEnv`.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Mapping

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
    split: "Split | None" = None  # this rank's side of a job split into trainer and rollout ranks (`split_job`)
    nodes: int = 0  # the job's nodes where the launcher says (the deepspeed launcher's CROSS_SIZE); 0: not said

    @property
    def is_main(self) -> bool:
        return self.rank == 0


@dataclass(frozen=True)
class Split:
    """A job whose last `rollout_per_node` local ranks of every node are rollout ranks (ript.rollout_ranks_per_node)
    and the others trainer ranks. Each side is a world of its own (`side`: its DistEnv, ranks numbered node by node);
    `job` is the whole job as launched, which the rendezvous and the groups between the sides use."""

    job: DistEnv
    rollout_per_node: int

    @property
    def nodes(self) -> int:
        return self.job.world_size // self.job.local_world_size

    @property
    def trainers_per_node(self) -> int:
        return self.job.local_world_size - self.rollout_per_node

    def is_rollout(self, job_rank: int) -> bool:
        return job_rank % self.job.local_world_size >= self.trainers_per_node

    @property
    def role(self) -> str:
        return "rollout" if self.is_rollout(self.job.rank) else "trainer"

    def side_rank(self, job_rank: int) -> int:
        """A job rank's rank in its side's world."""
        node, local = divmod(job_rank, self.job.local_world_size)
        if self.is_rollout(job_rank):
            return node * self.rollout_per_node + local - self.trainers_per_node
        return node * self.trainers_per_node + local

    def job_ranks(self, role: str) -> list[int]:
        """The job ranks of one side, in its own rank order."""
        return [r for r in range(self.job.world_size) if self.is_rollout(r) == (role == "rollout")]

    def world(self, role: str) -> DistEnv:
        """One side's world as a whole (its sizes; its first rank)."""
        per = self.rollout_per_node if role == "rollout" else self.trainers_per_node
        return DistEnv(0, 0, self.nodes * per, per, 0, self.job.master_addr, self.job.master_port, self.job.launcher)

    def side(self) -> DistEnv:
        job, per = self.job, self.rollout_per_node if self.role == "rollout" else self.trainers_per_node
        return DistEnv(self.side_rank(job.rank), job.local_rank - (self.trainers_per_node if self.role == "rollout"
                                                                    else 0),
                       self.nodes * per, per, job.node_rank, job.master_addr, job.master_port, job.launcher, self)


def split_job(env: DistEnv, rollout_per_node: int, key: str = "ript.rollout_ranks_per_node") -> DistEnv:
    """This rank's side of the job (`env` itself when `rollout_per_node` is 0): refused in one line where the
    launcher's ranks do not split (a node left without a trainer, ranks not numbered node by node)."""
    if not rollout_per_node:
        return env
    if env.nodes and env.nodes * env.local_world_size != env.world_size:  # an uneven hostfile: each node its own count
        raise UserError(f"{key}={rollout_per_node}: node {env.node_rank} runs {env.local_world_size} of the job's "
                        f"{env.world_size} ranks over {env.nodes} nodes, so the nodes run different numbers of ranks, "
                        f"and the last {rollout_per_node} of each would not split them alike; give every node the same "
                        f"slots= in the hostfile (`ds-train launch --check` names the nodes)")
    if rollout_per_node >= env.local_world_size:
        raise UserError(f"{key}={rollout_per_node}: each node runs {env.local_world_size} rank(s), and at least one "
                        f"must train; set it below {env.local_world_size}, or launch more ranks per node")
    if env.world_size % env.local_world_size or env.rank != env.node_rank * env.local_world_size + env.local_rank:
        raise UserError(f"{key}={rollout_per_node}: the launcher numbered rank {env.rank} (node {env.node_rank}, "
                        f"local rank {env.local_rank}) out of node order, or nodes run different numbers of ranks "
                        f"({env.world_size} in all, {env.local_world_size} here); launch the same number of ranks "
                        f"on every node with the deepspeed launcher, torchrun or srun's block distribution")
    return Split(env, rollout_per_node).side()


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
        if launcher == "manual" and "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
            task, tasks = _int(env, "SLURM_PROCID"), _int(env, "SLURM_NTASKS")
            if (rank, world) != (task, tasks):  # each task would take itself for rank `rank` of `world`
                raise UserError(
                    f"environment: RANK={rank} and WORLD_SIZE={world} are set, but SLURM started this process as "
                    f"task {task} of {tasks} (SLURM_PROCID, SLURM_NTASKS): exported by the shell that submitted "
                    f"the job? Unset RANK, LOCAL_RANK, WORLD_SIZE and LOCAL_WORLD_SIZE in the job script (ds_train "
                    f"reads SLURM's own), or start the ranks with torchrun or deepspeed")
        return DistEnv(rank, _int(env, "LOCAL_RANK", 0), world, local_world, node_rank,
                       env["MASTER_ADDR"], _int(env, "MASTER_PORT"), launcher,
                       nodes=_int(env, "CROSS_SIZE", 0))  # the deepspeed launcher's; each node's own LOCAL_SIZE
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


def node_hosts(environ: Mapping[str, str] | None = None) -> list[str]:
    """The host of each node, in node order, where the launcher told us: DS_TRAIN_HOSTS (written by
    `ds-train launch`) or SLURM's node list; empty when unknown."""
    env = os.environ if environ is None else environ
    if env.get("DS_TRAIN_HOSTS"):
        return env["DS_TRAIN_HOSTS"].split(",")
    if env.get("SLURM_JOB_NODELIST"):
        return expand_slurm_nodelist(env["SLURM_JOB_NODELIST"])
    return []


def expand_slurm_nodelist(nodelist: str) -> list[str]:
    """'gpu[003-005,009],cpu1' -> ['gpu003', 'gpu004', 'gpu005', 'gpu009', 'cpu1']."""
    hosts = []
    for prefix, ranges, plain in re.findall(r"([^,\[]+)\[([^\]]+)\]|([^,\[\]]+)", nodelist):
        if plain:
            hosts.append(plain)
            continue
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            hosts += [f"{prefix}{i:0{len(lo)}d}" for i in range(int(lo), int(hi or lo) + 1)]
    return hosts


def threads_per_rank(environ: Mapping[str, str], cores: int, local_world_size: int) -> int | None:
    """torch's threads for each of the `local_world_size` ranks sharing this node's `cores`, or None
    where OMP_NUM_THREADS is set (the user's choice; torch reads it itself). The `deepspeed` launcher
    leaves every rank torch's default, one thread per core, so N ranks on N cores run N x N threads
    that wait on each other: a CPU run's forwards 6-11x slower on 2 cores (bench/threads.py; CPU
    Adam under offload takes the same threads). torchrun sets 1; the cores are split here."""
    if environ.get("OMP_NUM_THREADS", "").strip():
        return None
    return max(1, cores // max(1, local_world_size))
