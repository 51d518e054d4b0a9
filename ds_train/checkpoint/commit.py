"""Partitioned checkpoints in DeepSpeed's own layout, made crash-safe; the checkpointer.

A tag is written in phases (`PHASES`, each a fault-injection point): the writer of each file
system first takes the tag's completeness marker away (and `latest`, if it names the tag) and
removes the old files (the ones ds_train wrote: a user's stay, ds_train/checkpoint/tagfiles.py);
then every rank writes its DeepSpeed files, its RNG and loop state (`ds_train_rank_<r>.pt`),
flushes them and records them, with their sizes, in its manifest (`ds_train_rank_<r>.json`); after
a barrier the writer records every file the save wrote, writes the marker `ds_train_state.json`
(the run state and a save sequence number), then `latest`, then prunes (what it wrote, only). A crash at any point
leaves either a whole tag or one without a marker, which is never loaded.

The writer is global rank 0 when output_dir is one shared file system, and the first rank of each
node when every node has its own (node-local disks): each node then holds its own ranks' files,
marker and `latest` (DeepSpeed's use_node_local_storage). Which tag a run resumes from, agreed by
every rank, is ds_train/checkpoint/consensus.py's; when to save, ds_train/checkpoint/checkpointer.py's.
DeepSpeed's tools (zero_to_fp32.py, ds_to_universal) work on the same directories.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import Callable

import numpy as np

from ds_train import dist
from ds_train.checkpoint import tagfiles
from ds_train.checkpoint.rundir import LATEST
from ds_train.checkpoint.universal import UNIVERSAL_SUFFIX, universal_dir
from ds_train.config import SAVE_PHASES
from ds_train.fs import fsync_dir, write_atomic

STATE_FILE = "ds_train_state.json"  # the tag-level completeness marker
TAG_RE = re.compile(r"^step_(\d{8})$")
# The phases of a save, in order: checkpoint.debug_fault stops the process at one of them.
PHASES = SAVE_PHASES
# What a marker must hold, and of which type, for its tag to count as saved (ds_train writes them all).
MARKER_FIELDS = {"world_size": int, "step": int, "seq": int, "zero_stage": int, "config": dict}


def run_record(kind: str, zero_stage: int, dtype: str, storage: str, parallel: dict, config: dict,
               data: dict) -> dict:
    """What every checkpoint of a run records beside its step and position, in its marker: the kind
    of run, the ZeRO stage, dtype and parallel layout it was saved with, where its files live
    (shared or node-local), the run config, and what identifies the data (a resume checks them)."""
    return {"kind": kind, "zero_stage": zero_stage, "dtype": dtype, "storage": storage, "parallel": parallel,
            "config": config, "data": data}


def saved_parallel(state: dict) -> dict:
    """A marker's parallel layout; one written before layouts were recorded is all data-parallel."""
    return state.get("parallel") or {"data": int(state["world_size"]), "sequence": 1, "tensor": 1}


def tag_for(step: int) -> str:
    return f"step_{step:08d}"


def rank_file(tag_dir: Path, rank: int) -> Path:
    """This rank's RNG and loop state."""
    return tag_dir / f"ds_train_rank_{rank}.pt"


def manifest_file(tag_dir: Path, rank: int) -> Path:
    """This rank's record of the files it needs to load the tag, with their sizes (written last)."""
    return tag_dir / f"ds_train_rank_{rank}.json"


def read_marker(tag_dir: Path) -> tuple[dict | None, str]:
    """(the saved state, "") or (None, why the tag is not marked complete)."""
    path = tag_dir / STATE_FILE
    try:
        state = json.loads(path.read_text())
        for key, kind in MARKER_FIELDS.items():
            if not isinstance(state[key], kind) or isinstance(state[key], bool):
                raise TypeError(f"{key} is {type(state[key]).__name__}, not {kind.__name__}")
    except FileNotFoundError:
        return None, f"no {STATE_FILE}: a save that did not finish"
    except KeyError as e:
        return None, f"{STATE_FILE} is damaged (no {e.args[0]!r})"
    except (OSError, ValueError, TypeError, AttributeError) as e:
        return None, f"{STATE_FILE} is damaged ({type(e).__name__}: {str(e)[:80]})"
    return state, ""


def rank_missing(tag_dir: Path, rank: int, seq: int | None = None) -> list[str]:
    """The files `rank` needs from this tag that are absent or not as written (empty: it can load).
    `seq`: the manifest must come from that save (not an older save into the same tag)."""
    man = manifest_file(tag_dir, rank)
    try:
        record = json.loads(man.read_text())
        files = dict(record["files"])
    except FileNotFoundError:
        return [man.name]
    except (OSError, ValueError, KeyError, TypeError):
        return [f"{man.name} (damaged)"]
    if seq is not None and record.get("seq") != seq:
        return [f"{man.name} (from another save)"]
    missing = []
    for name, size in files.items():
        try:
            actual = (tag_dir / name).stat().st_size
        except OSError:
            missing.append(name)
            continue
        if actual < size:
            missing.append(f"{name} (cut short: {actual} of {size} bytes written)")
        elif actual > size:
            missing.append(f"{name} ({actual} bytes, not {size} bytes written)")
    return missing


def is_complete(tag_dir: Path) -> bool:
    """Marked, and every rank's files are here (one file system holding the whole tag)."""
    state, _ = read_marker(tag_dir)
    if state is None:
        return False
    seq = state.get("seq")
    return not any(rank_missing(tag_dir, r, seq) for r in range(int(state["world_size"])))


def save_order(state: dict) -> tuple[int, int]:
    """Newest first by save sequence (a resume from an older tag saves with a higher one), then step."""
    return int(state.get("seq", 0)), int(state["step"])


def complete_tags(ckpt_dir: Path) -> list[str]:
    """Complete tags, oldest save first."""
    if not ckpt_dir.is_dir():
        return []
    tags = [(read_marker(p)[0], p.name) for p in ckpt_dir.iterdir()
            if TAG_RE.match(p.name) and p.is_dir() and is_complete(p)]
    return [name for state, name in sorted(tags, key=lambda t: save_order(t[0]))]


def latest_complete(ckpt_dir: Path) -> str | None:
    """The newest complete tag (by save sequence): `latest` is written after the marker, so a crash
    between the two leaves the newer tag complete and `latest` one behind."""
    tags = complete_tags(ckpt_dir)
    return tags[-1] if tags else None


def read_latest(ckpt_dir: Path) -> str:
    """What `latest` names, as said to a user: '' when there is none. Resuming never depends on it
    (the newest complete save wins); a `latest` that names something else is worth a word."""
    try:
        text = (ckpt_dir / LATEST).read_bytes()
    except OSError:
        return ""
    try:
        name = text.decode().strip()
    except UnicodeDecodeError:
        return f"{len(text)} bytes that are not text"
    return name if TAG_RE.match(name) or name.endswith(UNIVERSAL_SUFFIX) else f"{name[:40]!r}, not a tag"


def rng_state() -> dict:
    import torch

    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    import torch

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def weights_finite(engine) -> bool:
    """All ranks agree whether every weight is finite (ZeRO-3: each rank checks its partition)."""
    import torch

    bad = 0.0
    for p in engine.module.parameters():
        t = getattr(p, "ds_tensor", None)
        t = p if t is None else t
        if t.numel() and not bool(torch.isfinite(t).all()):
            bad = 1.0
            break
    return dist.all_reduce_max([bad])[0] == 0.0


def has_frozen(engine) -> bool:
    """A frozen base (LoRA, a peft model): its weights are left out of the checkpoint (they come from
    model.path or model.config and the seed, recorded by fingerprint), and loading puts back the trained
    rest. A model's own parameters that take no gradient (afmoe's expert_bias) are saved as the others
    are: nothing else would put them back (bench/models.py found one missing from every export)."""
    return getattr(engine.module, "peft_config", None) is not None and any(
        not p.requires_grad for p in engine.module.parameters())


def save_engine(engine, ckpt_dir: Path, tag: str, state: dict) -> None:
    engine.save_checkpoint(str(ckpt_dir), tag=tag, client_state=client_state(state, engine), save_latest=False,
                           exclude_frozen_parameters=has_frozen(engine))


def needed_files(engine, ckpt_dir: Path, tag: str) -> list[str]:
    """The DeepSpeed files this rank reads when it loads the tag at the same world size: its model
    states (shared by the data ranks below ZeRO-3) and, under ZeRO 1-3, its optimizer partition
    (ZeRO-0 keeps the optimizer in the model states, in bf16 too)."""
    names = [Path(engine._get_ckpt_name(str(ckpt_dir), tag)).name]
    if engine.zero_optimization():
        names.append(Path(engine._get_zero_ckpt_name(str(ckpt_dir), tag)).name)
    return names


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

def _no_fault(phase: str, step: int) -> None:
    return None


def _no_say(line: str) -> None:
    return None


def unmark(ckpt_dir: Path, tag: str) -> None:
    """Before a tag is (re)written: `latest` stops naming it, its marker goes, then its files."""
    tag_dir = ckpt_dir / tag
    latest = ckpt_dir / LATEST
    if latest.is_file() and latest.read_text(errors="replace").strip() == tag:
        older = [t for t in complete_tags(ckpt_dir) if t != tag]
        if older:
            write_atomic(latest, older[-1])
        else:
            latest.unlink()
    if tag_dir.is_dir():
        tagfiles.remove_ours(tag_dir, STATE_FILE)  # the marker first; a user's files stay
        shutil.rmtree(universal_dir(tag_dir), ignore_errors=True)
    fsync_dir(ckpt_dir)


def begin(engine, ckpt_dir: Path, step: int, writer: bool, fault: Callable[[str, int], None] = _no_fault) -> str:
    """A save's first phase, on every rank (a collective): the writers take the tag away, so that
    from here until its marker it is not a checkpoint."""
    tag = tag_for(step)
    if writer:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        unmark(ckpt_dir, tag)
        tagfiles.record_begin(ckpt_dir / tag)
    dist.barrier()
    fault("unmarked", step)
    return tag


def client_state(state: dict, engine) -> dict:
    """What DeepSpeed stores beside the engine's own state: ours, and where the engine's module has
    none (AutoTP attaches its own, with the tensor-parallel patterns ds_to_universal merges shards
    by; an engine with MoE layers, AutoEP's, writes its own and refuses another), universal_checkpoint_info
    for plain data parallelism, which lets DeepSpeed's ds_to_universal convert the checkpoint as it is."""
    from deepspeed.checkpoint.constants import (UNIVERSAL_CHECKPOINT_INFO, UNIVERSAL_CHECKPOINT_VERSION_KEY,
                                                UNIVERSAL_CHECKPOINT_VERSION_VALUE)

    if getattr(engine.module, UNIVERSAL_CHECKPOINT_INFO, None) is not None or getattr(engine, "has_moe_layers", False):
        return {"ds_train": state}
    return {"ds_train": state,
            UNIVERSAL_CHECKPOINT_INFO: {UNIVERSAL_CHECKPOINT_VERSION_KEY: UNIVERSAL_CHECKPOINT_VERSION_VALUE}}


def rank_record(rank_state: dict | None) -> dict:
    """This rank's own file: its RNG states and the loop's per-rank state."""
    return {"rng": rng_state(), "loop": rank_state or {}}


def commit(ckpt_dir: Path, tag: str, step: int, state: dict, rank: int, world: int, keep: int, writer: bool,
           seq: int, needed: list[str], meet: Callable[[str], None], share: Callable[[list | None], list],
           fault: Callable[[str, int], None] = _no_fault, say: Callable[[str], None] = _no_say) -> None:
    """A save's second half, once this rank's files are written: the same protocol for a save that
    blocks (`meet` a barrier, `share` a broadcast from rank 0) and one written in the background
    (both through the rendezvous store). Every rank flushes the files it needs (`needed`, and its
    rank file) and records them in its manifest; once every rank has, the writers mark the tag
    complete, then move `latest`, then prune what rank 0 chose (`say`: the writer's log, where it names
    the files a user left in a pruned tag, which stay)."""
    tag_dir = ckpt_dir / tag
    meet("written")  # every rank's DeepSpeed files exist (the model states are written by one rank)
    files = [*needed, rank_file(tag_dir, rank).name]
    for name in files:
        _fsync(tag_dir / name)
    record = {"rank": rank, "seq": seq, "files": {name: (tag_dir / name).stat().st_size for name in files}}
    write_atomic(manifest_file(tag_dir, rank), json.dumps(record, indent=1))
    fsync_dir(tag_dir)
    fault("rank_files", step)
    meet("durable")
    if writer:  # plain file writes
        tagfiles.record_written(tag_dir, STATE_FILE)
        fsync_dir(tag_dir)  # the record of what the save wrote before the marker that makes it a checkpoint
        write_atomic(tag_dir / STATE_FILE, json.dumps({**state, "world_size": world, "seq": seq}, indent=2))
        fsync_dir(tag_dir)
        fault("marked", step)
        write_atomic(ckpt_dir / LATEST, tag)
        fsync_dir(ckpt_dir)
        fault("latest", step)
    doomed = share(prunable(ckpt_dir, keep, tag) if rank == 0 else None)
    if writer:
        for pruned, left in remove_tags(ckpt_dir, doomed).items():
            say(f"checkpoint.keep: removed {pruned}'s checkpoint files; kept {len(left)} file(s) a user left there "
                f"({', '.join(left[:3])}{', ...' if len(left) > 3 else ''}): ds_train deletes only what it wrote")
    meet("pruned")


def _barrier(name: str) -> None:
    dist.barrier()


def save(engine, ckpt_dir: Path, step: int, state: dict, rank: int, world: int, keep: int,
         writer: bool | None = None, seq: int = 0, rank_state: dict | None = None,
         fault: Callable[[str, int], None] = _no_fault, say: Callable[[str], None] = _no_say) -> str:
    """A save that blocks until the tag is whole. Every rank calls this (it holds collectives).
    `writer`: this rank marks the tag complete, moves `latest` and prunes on its file system
    (default: rank 0, one shared file system)."""
    import torch

    writer = rank == 0 if writer is None else writer
    tag = begin(engine, ckpt_dir, step, writer, fault)
    save_engine(engine, ckpt_dir, tag, state)
    fault("written", step)
    torch.save(rank_record(rank_state), rank_file(ckpt_dir / tag, rank))
    commit(ckpt_dir, tag, step, state, rank, world, keep, writer, seq, needed_files(engine, ckpt_dir, tag),
           _barrier, dist.broadcast_object, fault, say)
    return tag


def prunable(ckpt_dir: Path, keep: int, saved: str) -> list[str]:
    """Tags to delete after saving `saved`: beyond the newest `keep` marked saves, and unmarked ones
    (saves that did not finish). Never `saved`. keep=0 keeps every marked tag."""
    marked, unmarked = [], []
    for p in ckpt_dir.iterdir() if ckpt_dir.is_dir() else ():
        if not TAG_RE.match(p.name) or p.name == saved or not p.is_dir() or not tagfiles.holds_a_save(p):
            continue  # (a file named like a tag, or a folder of a user's files only, is not ours to delete)
        state, _ = read_marker(p)
        (marked if state else unmarked).append((state, p.name))
    if keep <= 0:
        return []
    marked.sort(key=lambda t: save_order(t[0]))
    return sorted([name for _, name in marked[:max(0, len(marked) - (keep - 1))]] +
                  [name for _, name in unmarked])


def remove_tags(ckpt_dir: Path, tags: list[str]) -> dict[str, list[str]]:
    """Delete what ds_train wrote in these tags (their marker first, so a crash midway leaves nothing
    that looks complete) and their universal copies; returns, per tag, the files a user left there (kept)."""
    kept = {}
    for tag in tags:
        tag_dir = ckpt_dir / tag
        try:
            left = tagfiles.remove_ours(tag_dir, STATE_FILE) if tag_dir.is_dir() else []
        except OSError:  # as before: what cannot be deleted now goes at the next prune
            left = []
        if left:
            kept[tag] = left
        shutil.rmtree(universal_dir(tag_dir), ignore_errors=True)
    return kept


def prune(ckpt_dir: Path, keep: int) -> dict[str, list[str]]:
    """Keep the newest `keep` complete tags (0: keep all) on one file system; returns what remove_tags does."""
    newest = latest_complete(ckpt_dir)
    return remove_tags(ckpt_dir, prunable(ckpt_dir, keep, newest)) if newest is not None else {}
