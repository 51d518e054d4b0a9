"""Where a run writes: its directory checked and held (one run at a time), one file system for all
ranks or one per node (node-local disks), a fresh start's clean slate, and env.json's record.

File names are ds_train/checkpoint/rundir.py's (RunPaths); this module decides who writes them.
"""

from __future__ import annotations

import platform
import shutil
import uuid

from ds_train import dist, topology
from ds_train.checkpoint.rundir import KINDS, RunPaths
from ds_train.errors import AgreedError, UserError
from ds_train.fs import hold_lock

SHARED, NODE_LOCAL = "shared", "node-local"


def check_run_dir(paths: RunPaths) -> None:
    """Names the run directory uses, taken by something of another kind (a file `checkpoints`)."""
    wrong = [f"{name} is a {'file' if kind == 'dir' else 'directory'}" for name, kind in RunPaths.ENTRIES.items()
             if (paths.root / name).exists() and (paths.root / name).is_dir() != (kind == "dir")]
    if wrong:
        raise UserError(f"output_dir {paths.root}: {'; '.join(wrong)}, where the run keeps its own; move "
                        f"{'them' if len(wrong) > 1 else 'it'} away or choose another output_dir")


def hold_run_dir(paths: RunPaths, writer: bool) -> int | None:
    """One run at a time in a run directory: each file system's writer holds its lock (the ranks
    agree: if any writer finds it held, every rank stops)."""
    fd, holder = None, ""
    if writer:
        paths.root.mkdir(parents=True, exist_ok=True)
        fd, holder = hold_lock(paths.lock)
    busy = [h for h in dist.all_gather_object(holder) if h]
    if busy:
        raise AgreedError(f"output_dir {paths.root} is in use by another run ({busy[0]}); wait for it to end, or "
                          f"use another output_dir")
    return fd


def storage_layout(paths: RunPaths, env: topology.DistEnv) -> str:
    """Whether output_dir is one file system for every rank (SHARED) or each node's own
    (NODE_LOCAL): the first rank of each node leaves a mark, every rank says whose it sees."""
    if env.world_size == env.local_world_size:
        return SHARED  # one node
    run_dir = paths.root
    nonce = dist.broadcast_object(uuid.uuid4().hex if env.is_main else None)
    mark = run_dir / f".ds_train_node_{nonce}_{env.rank}"
    if env.local_rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        mark.touch()
    dist.barrier()
    seen = sorted(int(p.name.rsplit("_", 1)[1]) for p in run_dir.glob(f".ds_train_node_{nonce}_*"))
    views = dist.all_gather_object(seen)
    dist.barrier()
    if env.local_rank == 0:
        mark.unlink(missing_ok=True)
    leaders = sorted({r for view in views for r in view})
    if all(view == leaders for view in views):
        return SHARED
    if all(len(view) == 1 for view in views):
        return NODE_LOCAL
    groups = sorted({tuple(view) for view in views})
    raise UserError(f"output_dir {run_dir}: some nodes share it and some do not (nodes led by ranks "
                    f"{'; '.join(','.join(map(str, g)) for g in groups)} see the same directory); give "
                    f"every node its own, or one shared by all")


def check_storage(storage: str, converting: str, export_final: bool) -> None:
    """What a node-local output_dir cannot do: gather every rank's files in one place (`converting`:
    the checkpoint a resume converts, '' when it converts none)."""
    if storage != NODE_LOCAL:
        return
    if converting:
        raise UserError(f"{converting}: resuming at a new world size or ZeRO stage converts the checkpoint, "
                        f"which needs every rank's files in one place; copy the nodes' checkpoints/ into one "
                        f"shared directory and resume from it")
    if export_final:
        raise UserError("checkpoint.export_final: a node-local output_dir holds each node's part of the "
                        "checkpoint; set it to false and run `ds-train export` on the checkpoints "
                        "copied into one directory")


def start_over(paths: RunPaths, writer: bool) -> None:
    """checkpoint.resume=restart: this file system's checkpoints and the earlier run's metrics and
    results go; everything else is rewritten by the new run."""
    if writer:
        for path in (paths.checkpoints, paths.tensorboard, paths.plots):
            shutil.rmtree(path, ignore_errors=True)
        for path in (paths.metrics, *(paths.results(kind) for kind in KINDS.values())):
            path.unlink(missing_ok=True)
    dist.barrier()


def env_record(env: topology.DistEnv, hosts: list[tuple[int, str]], dtype: str, kind: str, parallel: dict,
               storage: str = SHARED) -> dict:
    import deepspeed
    import psutil
    import torch
    import transformers

    return {"command": kind, "torch": torch.__version__, "deepspeed": deepspeed.__version__,
            "transformers": transformers.__version__, "python": platform.python_version(),
            "world_size": env.world_size, "parallel": parallel, "launcher": env.launcher, "hosts": nodes(hosts),
            "accelerator": dist.accelerator_name(), "dtype": dtype, "output_dir": storage,
            "started": round(psutil.Process().create_time(), 3)}  # this attempt (reports older than it are history)


def nodes(hosts: list[tuple[int, str]]) -> list[dict]:
    """[{node, host, ranks}] in node order, from each rank's (node rank, hostname)."""
    by_node: dict[tuple[int, str], list[int]] = {}
    for rank, (node, host) in enumerate(hosts):
        by_node.setdefault((node, host), []).append(rank)
    return [{"node": node, "host": host, "ranks": ranks} for (node, host), ranks in sorted(by_node.items())]


def host_table(hosts: list[tuple[int, str]]) -> str:
    """`hosts: node0 vm -> ranks 0,1; node1 vm -> ranks 2,3`."""
    return "hosts: " + "; ".join(f"node{n['node']} {n['host']} -> ranks {','.join(map(str, n['ranks']))}"
                                 for n in nodes(hosts))
