"""Partitioned checkpoints in DeepSpeed's own layout, made crash-safe, and a resume all ranks agree on.

A tag is written in phases (`PHASES`, each a fault-injection point): the writer of each file
system first takes the tag's completeness marker away (and `latest`, if it names the tag) and
removes the old files; then every rank writes its DeepSpeed files, its RNG and loop state
(`ds_train_rank_<r>.pt`), flushes them and records them, with their sizes, in its manifest
(`ds_train_rank_<r>.json`); after a barrier the writer writes the marker `ds_train_state.json`
(the run state and a save sequence number), then `latest`, then prunes. A crash at any point
leaves either a whole tag or one without a marker, which is never loaded.

The writer is global rank 0 when output_dir is one shared file system, and the first rank of each
node when every node has its own (node-local disks): each node then holds its own ranks' files,
marker and `latest` (DeepSpeed's use_node_local_storage). At start-up every rank reports what it
holds; the newest marked tag wins when every rank holds its files of it, and a rank that lacks
them stops the job with a line naming the node, host, rank and files. DeepSpeed's tools
(zero_to_fp32.py, ds_to_universal) work on the same directories.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import re
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ds_train import dist
from ds_train.config import SAVE_PHASES, CheckpointConfig, RunConfig
from ds_train.errors import AgreedError, Preempted, UserError
from ds_train.fs import file_lock, fsync_dir, write_atomic

STATE_FILE = "ds_train_state.json"  # the tag-level completeness marker
UNIVERSAL_SUFFIX = "_universal"
TAG_RE = re.compile(r"^step_(\d{8})$")
# The phases of a save, in order: checkpoint.debug_fault stops the process at one of them.
PHASES = SAVE_PHASES
# Keys that may not change on resume: the model's shape, and what defines the data stream
# (sample g of step s is a function of seed, seq_len and global batch). Training knobs may change.
FIXED_KEYS = ("model.", "seed", "data.dir", "train.seq_len", "train.global_batch_size")
# What a marker must hold, and of which type, for its tag to count as saved (ds_train writes them all).
MARKER_FIELDS = {"world_size": int, "step": int, "seq": int, "zero_stage": int, "config": dict}


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
        if actual != size:
            missing.append(f"{name} ({actual} bytes, {size} written)")
    return missing


def is_complete(tag_dir: Path) -> bool:
    """Marked, and every rank's files are here (one file system holding the whole tag)."""
    state, _ = read_marker(tag_dir)
    if state is None:
        return False
    seq = state.get("seq")
    return not any(rank_missing(tag_dir, r, seq) for r in range(int(state["world_size"])))


def _order(state: dict) -> tuple[int, int]:
    """Newest first by save sequence (a resume from an older tag saves with a higher one), then step."""
    return int(state.get("seq", 0)), int(state["step"])


def complete_tags(ckpt_dir: Path) -> list[str]:
    """Complete tags, oldest save first."""
    if not ckpt_dir.is_dir():
        return []
    tags = [(read_marker(p)[0], p.name) for p in ckpt_dir.iterdir()
            if TAG_RE.match(p.name) and p.is_dir() and is_complete(p)]
    return [name for state, name in sorted(tags, key=lambda t: _order(t[0]))]


def latest_complete(ckpt_dir: Path) -> str | None:
    """The newest complete tag (by save sequence): `latest` is written after the marker, so a crash
    between the two leaves the newer tag complete and `latest` one behind."""
    tags = complete_tags(ckpt_dir)
    return tags[-1] if tags else None


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


def needed_files(engine, ckpt_dir: Path, tag: str) -> list[str]:
    """The DeepSpeed files this rank reads when it loads the tag at the same world size: its model
    states (shared by all ranks below ZeRO-3) and its optimizer partition."""
    names = [Path(engine._get_ckpt_name(str(ckpt_dir), tag)).name]
    if engine.zero_optimization() or engine.bfloat16_enabled():
        names.append(Path(engine._get_zero_ckpt_name(str(ckpt_dir), tag)).name)
    return names


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def parse_fault(spec: str) -> tuple[str, str, int] | None:
    """checkpoint.debug_fault `ACTION:PHASE:STEP` (kill or enospc) -> (action, phase, step)."""
    if not spec:
        return None
    action, phase, step = spec.split(":")
    return action, phase, int(step)


def fault_at(spec: str) -> Callable[[str, int], None]:
    """The fault-injection hook of checkpoint.debug_fault: at PHASE of the save of STEP, `kill`
    SIGKILLs this process (a crash), `enospc` raises the error a full disk raises."""
    fault = parse_fault(spec)

    def hook(phase: str, step: int) -> None:
        if fault is None or (phase, step) != fault[1:]:
            return
        if fault[0] == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise OSError(28, "No space left on device (checkpoint.debug_fault)")

    return hook


def _no_fault(phase: str, step: int) -> None:
    return None


def unmark(ckpt_dir: Path, tag: str) -> None:
    """Before a tag is (re)written: `latest` stops naming it, its marker goes, then its files."""
    tag_dir = ckpt_dir / tag
    latest = ckpt_dir / "latest"
    if latest.is_file() and latest.read_text(errors="replace").strip() == tag:
        older = [t for t in complete_tags(ckpt_dir) if t != tag]
        if older:
            write_atomic(latest, older[-1])
        else:
            latest.unlink()
    if tag_dir.exists():
        (tag_dir / STATE_FILE).unlink(missing_ok=True)
        fsync_dir(tag_dir)
        shutil.rmtree(tag_dir)
        shutil.rmtree(universal_dir(tag_dir), ignore_errors=True)
    fsync_dir(ckpt_dir)


def save(engine, ckpt_dir: Path, step: int, state: dict, rank: int, world: int, keep: int,
         writer: bool | None = None, seq: int = 0, rank_state: dict | None = None,
         fault: Callable[[str, int], None] = _no_fault) -> str:
    """Every rank calls this (it holds collectives). `writer`: this rank marks the tag complete,
    moves `latest` and prunes on its file system (default: rank 0, one shared file system)."""
    import torch

    writer = rank == 0 if writer is None else writer
    tag = tag_for(step)
    tag_dir = ckpt_dir / tag
    from deepspeed.checkpoint.constants import (UNIVERSAL_CHECKPOINT_INFO, UNIVERSAL_CHECKPOINT_VERSION_KEY,
                                                UNIVERSAL_CHECKPOINT_VERSION_VALUE)

    if writer:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        unmark(ckpt_dir, tag)
    dist.barrier()
    fault("unmarked", step)
    # universal_checkpoint_info (no tensor-parallel patterns: plain data parallel) lets DeepSpeed's
    # ds_to_universal convert this checkpoint as it is.
    client_state = {"ds_train": state,
                    UNIVERSAL_CHECKPOINT_INFO: {UNIVERSAL_CHECKPOINT_VERSION_KEY: UNIVERSAL_CHECKPOINT_VERSION_VALUE}}
    engine.save_checkpoint(str(ckpt_dir), tag=tag, client_state=client_state, save_latest=False)
    fault("written", step)
    torch.save({"rng": rng_state(), "loop": rank_state or {}}, rank_file(tag_dir, rank))
    dist.barrier()  # every rank's DeepSpeed files exist (the model states are written by one rank)
    files = [*needed_files(engine, ckpt_dir, tag), rank_file(tag_dir, rank).name]
    for name in files:
        _fsync(tag_dir / name)
    record = {"rank": rank, "seq": seq, "files": {name: (tag_dir / name).stat().st_size for name in files}}
    write_atomic(manifest_file(tag_dir, rank), json.dumps(record, indent=1))
    fsync_dir(tag_dir)
    fault("rank_files", step)
    dist.barrier()
    if writer:  # plain file writes, no collective inside
        write_atomic(tag_dir / STATE_FILE, json.dumps({**state, "world_size": world, "seq": seq}, indent=2))
        fsync_dir(tag_dir)
        fault("marked", step)
        write_atomic(ckpt_dir / "latest", tag)
        fsync_dir(ckpt_dir)
        fault("latest", step)
    doomed = dist.broadcast_object(prunable(ckpt_dir, keep, tag) if rank == 0 else None)
    if writer:
        remove_tags(ckpt_dir, doomed)
    dist.barrier()
    return tag


def prunable(ckpt_dir: Path, keep: int, saved: str) -> list[str]:
    """Tags to delete after saving `saved`: beyond the newest `keep` marked saves, and unmarked ones
    (saves that did not finish). Never `saved`. keep=0 keeps every marked tag."""
    marked, unmarked = [], []
    for p in ckpt_dir.iterdir() if ckpt_dir.is_dir() else ():
        if not TAG_RE.match(p.name) or p.name == saved or not p.is_dir():
            continue  # (a file named like a tag is not ours to delete)
        state, _ = read_marker(p)
        (marked if state else unmarked).append((state, p.name))
    if keep <= 0:
        return []
    marked.sort(key=lambda t: _order(t[0]))
    return sorted([name for _, name in marked[:max(0, len(marked) - (keep - 1))]] +
                  [name for _, name in unmarked])


def remove_tags(ckpt_dir: Path, tags: list[str]) -> None:
    """Delete tags (their marker first, so a crash midway leaves nothing that looks complete) and
    their universal copies."""
    for tag in tags:
        tag_dir = ckpt_dir / tag
        (tag_dir / STATE_FILE).unlink(missing_ok=True)
        shutil.rmtree(tag_dir, ignore_errors=True)
        shutil.rmtree(universal_dir(tag_dir), ignore_errors=True)


def prune(ckpt_dir: Path, keep: int) -> None:
    """Keep the newest `keep` complete tags (0: keep all) on one file system."""
    newest = latest_complete(ckpt_dir)
    if newest is not None:
        remove_tags(ckpt_dir, prunable(ckpt_dir, keep, newest))


@dataclass(frozen=True)
class ResumePoint:
    load_dir: Path  # the checkpoints directory DeepSpeed loads from
    tag: str
    state: dict  # ds_train_state.json: step, samples, world_size, zero_stage, config


def find_resume(resume: str, ckpt_dir: Path, key: str = "checkpoint.resume") -> ResumePoint | None:
    """checkpoint.resume on one file system holding the whole checkpoint (`ds-train convert`, tools):
    auto (the newest complete tag, if any), none, a tag, or a path. `key`: what the user gave it as."""
    if resume in ("none", "restart"):
        return None
    load_dir, wanted = locate(resume, ckpt_dir, key)
    if wanted is None:
        tag = latest_complete(load_dir)
        if tag is None and resume != "auto":
            raise UserError(f"{key}: {str(load_dir)!r} holds no complete checkpoint")
        return _point(load_dir, tag) if tag else None
    if not is_complete(load_dir / wanted):
        raise UserError(f"{key}: {str(load_dir / wanted)!r} is incomplete (a save that did not finish, or "
                        f"damaged files); use another tag")
    return _point(load_dir, wanted)


def newer_incomplete(point: ResumePoint) -> list[str]:
    """Tags after `point` (by step) that are not complete: what choosing the newest complete one
    skipped, to say so."""
    step = int(point.state["step"])
    return [f"{p.name} ({read_marker(p)[1] or 'files missing or damaged'})" for p in sorted(point.load_dir.iterdir())
            if TAG_RE.match(p.name) and p.is_dir() and int(TAG_RE.match(p.name).group(1)) > step and not is_complete(p)]


def locate(resume: str, ckpt_dir: Path, key: str = "checkpoint.resume") -> tuple[Path, str | None]:
    """checkpoint.resume -> (the directory of tags, the tag asked for; None: the newest)."""
    if resume in ("auto", "none", "restart"):
        return ckpt_dir, None
    if TAG_RE.match(resume) or resume.endswith(UNIVERSAL_SUFFIX) and "/" not in resume:
        return ckpt_dir, resume  # a tag of this run: whether every rank has it is agreed later
    path = Path(resume)
    for cand in [ckpt_dir / resume, path] if not path.is_absolute() else [path]:
        if cand.is_dir() and ((cand / STATE_FILE).exists() or TAG_RE.match(cand.name)):
            return cand.parent, cand.name
        if cand.is_dir():
            return (cand / "checkpoints" if (cand / "checkpoints").is_dir() else cand), None
    if key != "checkpoint.resume":
        raise UserError(f"{key}: {resume!r} is not a run directory, checkpoints directory or tag directory")
    raise UserError(f"checkpoint.resume: {resume!r} is neither a tag in {str(ckpt_dir)!r} nor a "
                    f"checkpoint directory; use auto, none, restart, a tag (step_00000100) or a path")


def _point(load_dir: Path, tag: str) -> ResumePoint:
    return ResumePoint(load_dir, tag, read_marker(load_dir / tag)[0])


# ---- the resume every rank agrees on ---------------------------------------------------------

@dataclass(frozen=True)
class TagSeen:
    """One tag as one rank sees it."""

    state: dict | None  # the marker, where this rank can read it
    why: str  # why not, where it cannot
    missing: tuple[str, ...] = ()  # this rank's files that are absent or damaged (same world size)
    files_seq: int | None = None  # the save this rank's manifest comes from
    all_missing: dict = field(default_factory=dict)  # rank 0 at another world size: saved rank -> files


@dataclass(frozen=True)
class RankView:
    rank: int
    node: int
    host: str
    tags: dict  # tag -> TagSeen
    max_seq: int = 0  # the newest save in this run's own checkpoints directory
    own: tuple[str, ...] = ()  # marked tags in this run's own checkpoints directory

    def where(self) -> str:
        return f"node {self.node} ({self.host}) rank {self.rank}"


def _manifest_seq(tag_dir: Path, rank: int) -> int | None:
    try:
        return int(json.loads(manifest_file(tag_dir, rank).read_text())["seq"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def scan(load_dir: Path, wanted: str | None, rank: int, world: int) -> dict[str, TagSeen]:
    """What this rank holds: every tag of `load_dir` (and the one wanted), marker and own files."""
    names = sorted(p.name for p in load_dir.iterdir() if TAG_RE.match(p.name) and p.is_dir()) if load_dir.is_dir() else []
    if wanted is not None and wanted not in names:
        names.append(wanted)
    seen = {}
    for name in names:
        tag_dir = load_dir / name
        if not tag_dir.is_dir():
            seen[name] = TagSeen(None, "no such directory", (f"{name}/",))
            continue
        state, why = read_marker(tag_dir)
        saved_world = int(state["world_size"]) if state else world
        if saved_world == world:
            seen[name] = TagSeen(state, why, tuple(rank_missing(tag_dir, rank)), _manifest_seq(tag_dir, rank))
        else:  # another world size: rank 0 converts it and needs every saved rank's files
            seq = state.get("seq")
            everyone = {r: rank_missing(tag_dir, r, seq) for r in range(saved_world)} if rank == 0 else {}
            seen[name] = TagSeen(state, why, all_missing={r: m for r, m in everyone.items() if m})
    return seen


@dataclass(frozen=True)
class Decision:
    point: ResumePoint | None
    said: str  # printed once and logged on every rank
    next_seq: int  # the save sequence number of this run's first save


def _listed(items: list[str], n: int = 3) -> str:
    return ", ".join(items[:n]) + (f" and {len(items) - n} more" if len(items) > n else "")


def decide(resume: str, load_dir: Path, wanted: str | None, views: list[RankView], world: int,
           unit: str = "step", own_dir: Path | None = None) -> Decision:
    """The one resume point of every rank (a pure function of what every rank reported): the
    newest marked tag, which every rank must hold whole; a rank that lacks it is an error."""
    names = sorted({t for v in views for t in v.tags})
    marked: dict[str, dict] = {}
    for t in names:
        states = [v.tags[t].state for v in views if t in v.tags and v.tags[t].state]
        if states:
            marked[t] = max(states, key=_order)
    next_seq = 1 + max([int(s.get("seq", 0)) for s in marked.values()] + [v.max_seq for v in views])
    unfinished = [f"{t} ({next(v.tags[t].why for v in views if t in v.tags)})" for t in names if t not in marked]
    if resume in ("none", "restart"):
        if resume == "none" and marked:
            raise UserError(f"checkpoint.resume=none: {load_dir} holds checkpoints of an earlier run "
                            f"({_listed(sorted(marked))}); continue it with checkpoint.resume=auto, use "
                            f"another output_dir, or start over with checkpoint.resume=restart (deletes "
                            f"them and its metrics)")
        return Decision(None, f"starting at {unit} 0 (checkpoint.resume={resume})", next_seq)
    why = f"; tags present but none complete: {_listed(unfinished, 5)}" if unfinished else ""
    if wanted is None and not marked and resume != "auto":  # a path asked for: not a fresh start
        raise UserError(f"checkpoint.resume: {load_dir} holds no complete checkpoint{why}; give a checkpoint "
                        f"directory or tag, or checkpoint.resume=auto to start afresh where there is none")
    own = sorted({t for v in views for t in v.own})
    if own and own_dir is not None and load_dir.resolve() != own_dir.resolve():
        raise UserError(f"checkpoint.resume={resume}: output_dir's {own_dir} holds checkpoints of its own "
                        f"({_listed(own)}); continue them with checkpoint.resume=auto, or give this run another "
                        f"output_dir (checkpoint.resume=restart deletes them)")
    if wanted is None and not marked:
        return Decision(None, f"nothing to resume in {load_dir}{why}; starting at {unit} 0", next_seq)
    if wanted is not None and wanted not in marked:
        why = next((v.tags[wanted].why for v in views if wanted in v.tags), "not found")
        raise UserError(f"checkpoint.resume: {load_dir / wanted} is not a complete checkpoint ({why}); "
                        f"resume from another tag ({_listed(sorted(marked)) or 'none complete'}) or "
                        f"use checkpoint.resume=auto")
    chosen = wanted or max(marked, key=lambda t: _order(marked[t]))
    state = marked[chosen]
    lacking = _lacking(chosen, state, views, world)
    if lacking:
        older = [t for t in sorted(marked, key=lambda t: _order(marked[t])) if t != chosen and
                 not _lacking(t, marked[t], views, world)]
        alt = f"resume from {older[-1]} with checkpoint.resume={older[-1]}, " if older else ""
        raise UserError(f"checkpoint {load_dir / chosen} ({unit} {state['step']}, the newest complete save) "
                        f"is incomplete on {'; '.join(lacking)}; restore those files, {alt}or start over "
                        f"with checkpoint.resume=restart")
    skipped = [u for u in unfinished if u.split()[0] != chosen]
    said = f"resumed from {load_dir / chosen} at {unit} {state['step']}"
    if skipped:
        said += f"; not complete, skipped: {_listed(skipped, 5)}"
    return Decision(ResumePoint(load_dir, chosen, state), said, next_seq)


def _lacking(tag: str, state: dict, views: list[RankView], world: int) -> list[str]:
    """`node n (host) rank r: missing f1, f2` for each rank that cannot load `tag`."""
    out = []
    if int(state["world_size"]) != world:
        zero = next(v for v in views if v.rank == 0)
        seen = zero.tags.get(tag)
        for r, files in sorted((seen.all_missing if seen else {}).items()):
            out.append(f"{zero.where()} (converting it for world size {world}): saved rank {r}'s "
                       f"{_listed(files)} missing (a new world size needs every rank's files in one place)")
        return out
    for v in views:
        seen = v.tags.get(tag)
        files = list(seen.missing) if seen else [f"{tag}/"]
        if seen and not files and seen.files_seq != state.get("seq"):
            files = [f"{manifest_file(Path(tag), v.rank).name} (from another save)"]
        if files:
            out.append(f"{v.where()}: missing {_listed(files)}")
    return out


def agree(resume: str, ckpt_dir: Path, env, host: str, unit: str = "step") -> Decision:
    """Every rank reports what it holds (one all-gather), then every rank decides the same."""
    load_dir, wanted = locate(resume, ckpt_dir)
    own = {p.name: read_marker(p)[0] for p in ckpt_dir.iterdir() if TAG_RE.match(p.name) and p.is_dir()} \
        if ckpt_dir.is_dir() else {}
    mine = RankView(env.rank, env.node_rank, host, scan(load_dir, wanted, env.rank, env.world_size),
                    max((int(s["seq"]) for s in own.values() if s), default=0),
                    tuple(sorted(name for name, s in own.items() if s)))
    return decide(resume, load_dir, wanted, dist.all_gather_object(mine), env.world_size, unit, ckpt_dir)


def _flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out |= _flatten(v, f"{prefix}{k}.")
        else:
            out[f"{prefix}{k}"] = v
    return out


def config_changes(saved: dict, current: dict) -> tuple[list[str], list[str]]:
    """(errors, notes): changes to FIXED_KEYS are errors; other changed keys are listed as notes."""
    old, new = _flatten(saved), _flatten(current)
    errors, notes = [], []
    for key in sorted(set(old) | set(new)):
        if key not in old and key.startswith(("launch.", "ript.", "dist.", "watchdog.")):
            continue  # a section added since the checkpoint was written
        if old.get(key) != new.get(key) and key != "output_dir":
            line = f"{key}: {old.get(key)!r} -> {new.get(key)!r}"
            (errors if key.startswith(FIXED_KEYS) else notes).append(line)
    return errors, notes


def universal_dir(tag_dir: Path) -> Path:
    return tag_dir.with_name(tag_dir.name + UNIVERSAL_SUFFIX)


def convert_to_universal(tag_dir: Path) -> Path:
    """DeepSpeed's ds_to_universal on a complete tag, into `<tag>_universal` (once, under a lock)."""
    if not is_complete(tag_dir):
        raise UserError(f"{tag_dir}: not a complete ds_train checkpoint; cannot convert it")
    state = read_marker(tag_dir)[0]
    if uses_torch_optimizer(state["zero_stage"], state.get("dtype", "fp32")):
        raise UserError(f"{tag_dir}: an fp32 ZeRO-0 checkpoint (a plain torch optimizer, replicated) has no "
                        f"partitions to convert: it resumes at any world size as it is, under fp32 ZeRO-0")
    out = universal_dir(tag_dir)
    with file_lock(tag_dir.parent / ".convert.lock"):
        if is_complete(out):
            return out
        tmp = out.with_name(f".{out.name}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
               str(tag_dir), "--output_folder", str(tmp), "--num_extract_workers", "2",
               "--num_merge_workers", "1"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            last = (proc.stderr.strip() or proc.stdout.strip() or "no output").splitlines()[-1]
            raise UserError(f"{tag_dir}: DeepSpeed's ds_to_universal failed: {last}")
        state = json.loads((tag_dir / STATE_FILE).read_text())
        state |= {"universal": True, "source_tag": tag_dir.name, "source_world_size": state["world_size"],
                  "world_size": 0}  # no per-rank files: a universal checkpoint fits any world size
        write_atomic(tmp / STATE_FILE, json.dumps(state, indent=2))
        tmp.rename(out)
    return out


def uses_torch_optimizer(stage: int, dtype: str) -> bool:
    """fp32 ZeRO-0 steps a plain torch optimizer, whose states DeepSpeed cannot re-partition."""
    return stage == 0 and dtype == "fp32"


def check_resume(point: ResumePoint | None, cfg: RunConfig, kind: str, world: int,
                 same_world: bool = False, data: dict | None = None) -> list[str]:
    """Refuse a resume that would change the model, the data stream or the kind of run (or, for
    `same_world`, the world size); return the allowed changes as notes. `data`: what identifies the
    tokenizer and the prepared data now (a checkpoint records it): the same data.dir re-prepared
    with another tokenizer would feed the saved weights other token ids."""
    if point is None:
        return []
    where = point.load_dir / point.tag
    saved_data = point.state.get("data") or {}
    changed = sorted(k for k in set(saved_data) & set(data or {}) if saved_data[k] != data[k])
    if changed:
        raise UserError(f"{where}: the data changed since this checkpoint ({', '.join(changed)}: "
                        f"{', '.join(f'{saved_data[k]} -> {data[k]}' for k in changed)}; data.dir re-prepared?): "
                        f"its weights were trained on the old token ids; restore the old data.dir, or start over "
                        f"with checkpoint.resume=restart")
    saved_kind = point.state.get("kind", "train")
    if saved_kind != kind:
        raise UserError(f"{where}: a {saved_kind} checkpoint; `{kind}` cannot resume from it (use "
                        f"another output_dir, or checkpoint.resume=restart to delete it)")
    if same_world and point.state["world_size"] != world:
        raise UserError(f"{where}: saved with {point.state['world_size']} ranks; resume {kind} with the "
                        f"same world size (its work is sharded per rank)")
    errors, notes = config_changes(point.state["config"], cfg.to_dict())
    if errors:
        raise UserError(f"{where}: cannot resume with a changed " + "; ".join(errors) +
                        " (these fix the model or the data order); use another output_dir, or start over "
                        "with checkpoint.resume=restart (deletes this run's checkpoints)")
    return notes


@dataclass(frozen=True)
class ResumePlan:
    """How to load: as saved, or through DeepSpeed's universal checkpoint (converted first when
    `convert`). Deciding writes nothing; `prepare_resume` does the conversion."""

    point: ResumePoint | None
    notes: tuple[str, ...] = ()
    universal: bool = False  # the engine loads with checkpoint.load_universal
    convert: bool = False  # ds_to_universal must run on `point` first


def plan_resume(point: ResumePoint | None, world: int, stage: int, dtype: str,
                force_universal: bool) -> ResumePlan:
    """Directly, or through a universal checkpoint when the world size or the ZeRO stage changed."""
    if point is None:
        return ResumePlan(None)
    if point.state.get("universal"):
        return ResumePlan(point, (f"loading universal checkpoint {point.tag}",), universal=True)
    saved_world, saved_stage = point.state["world_size"], point.state["zero_stage"]
    saved_torch = uses_torch_optimizer(saved_stage, point.state.get("dtype", "fp32"))
    target_torch = uses_torch_optimizer(stage, dtype)
    if saved_world == world and saved_stage == stage and not force_universal:
        return ResumePlan(point)
    change = f"world size {saved_world} -> {world}, ZeRO stage {saved_stage} -> {stage}"
    if saved_torch and target_torch:  # replicated weights and optimizer: loadable at any world size
        return ResumePlan(point, (f"{change}: the fp32 ZeRO-0 checkpoint loads as it is",))
    if saved_torch or target_torch:
        raise UserError(f"{point.load_dir / point.tag}: {change}: DeepSpeed cannot move optimizer "
                        f"states between fp32 ZeRO-0 (a plain torch optimizer) and ZeRO-{max(stage, saved_stage)} "
                        f"or bf16; resume with the stage and dtype it was saved with")
    name = universal_dir(point.load_dir / point.tag).name
    return ResumePlan(point, (f"{change}: loading through DeepSpeed's universal checkpoint {name}",),
                      universal=True, convert=True)


def prepare_resume(plan: ResumePlan) -> ResumePoint | None:
    """The point to load, after running ds_to_universal where the plan needs it."""
    if not plan.convert:
        return plan.point
    universal = convert_to_universal(plan.point.load_dir / plan.point.tag)
    return _point(plan.point.load_dir, universal.name)


def load(engine, point: ResumePoint, rank: int, world: int) -> dict:
    """Load weights, optimizer, scheduler, this rank's RNG; returns the saved state, with this rank's
    own loop state under "rank" when the world size is the one saved."""
    import torch

    where = point.load_dir / point.tag
    try:
        load_path, _ = engine.load_checkpoint(str(point.load_dir), tag=point.tag,
                                              load_optimizer_states=True, load_lr_scheduler_states=True)
        if load_path is None:
            raise UserError(f"{where}: DeepSpeed could not load this checkpoint")
        if point.state["world_size"] != world:  # per-rank state only where the ranks are the same ranks
            return point.state
        saved = torch.load(rank_file(where, rank), weights_only=False)
        set_rng_state(saved["rng"])
        return {**point.state, "rank": saved["loop"]}
    except (pickle.UnpicklingError, EOFError, RuntimeError, OSError, KeyError, TypeError, ValueError) as e:
        # A file of the right size with other bytes in it (the sizes were checked when the ranks agreed).
        raise UserError(f"{where}: cannot be loaded, a file in it is damaged ({type(e).__name__}: "
                        f"{str(e).splitlines()[0][:160] if str(e) else 'no detail'}); resume from an older tag "
                        f"(checkpoint.resume=step_...), or start over with checkpoint.resume=restart") from None


class Checkpointer:
    """Decides at each step boundary whether the step is its: every `checkpoint.every` steps, the
    last step (`checkpoint.save_final`), or a SIGTERM / SIGINT that every rank agreed on, after
    which it raises Preempted. Every rank calls `maybe_save` at every boundary: the signal
    agreement and the save are collectives, never behind a rank guard. Before each save the
    writers compare their free space with the predicted size of a tag; a save that fails for
    space or I/O ends the run with one line, `latest` still naming a whole tag."""

    def __init__(self, engine, run_dir: Path, cfg: CheckpointConfig, last: int, rank: int, world: int,
                 record: dict, stop, log, unit: str = "step", writer: bool | None = None, seq: int = 1,
                 needed_bytes: int = 0, where: str = "", beat: Callable[[int, str], None] = lambda step, phase: None):
        self.engine, self.ckpt_dir, self.cfg, self.last = engine, run_dir / "checkpoints", cfg, last
        self.rank, self.world, self.record, self.stop, self.log, self.unit = rank, world, record, stop, log, unit
        self.writer = rank == 0 if writer is None else writer
        self.seq, self.needed_bytes, self.where = seq, needed_bytes, where
        self.fault = fault_at(cfg.debug_fault)
        self.beat = beat  # the heartbeat: the stop agreement is a collective, a save is long I/O

    def due(self, step: int) -> bool:
        every = self.cfg.every > 0 and step % self.cfg.every == 0
        return every or (step == self.last and self.cfg.save_final)

    def maybe_save(self, step: int, state: Callable[[], dict] = dict, rank_state: Callable[[], dict] = dict) -> None:
        """Save when due or signalled; `state()` (called on every rank, may hold collectives) adds
        the loop's own position to the record, `rank_state()` this rank's own (its rank file)."""
        self.beat(step, "agree-stop")
        signum = self.stop.agreed()
        if signum or self.due(step):
            self.save(step, state(), rank_state())
        if signum:
            raise Preempted(signum, step, self.unit)

    def save(self, step: int, state: dict, rank_state: dict | None = None) -> str:
        """Non-finite weights are never saved: the last good checkpoint stays the latest."""
        self.beat(step, "save")
        if not weights_finite(self.engine):
            raise UserError(f"{self.unit} {step}: the weights are not finite; no checkpoint written ("
                            f"{self._latest()}); if model.path's weights are finite, lower optim.lr and resume")
        self.check_space(step)
        try:
            tag = save(self.engine, self.ckpt_dir, step, {**self.record, **state, "step": step}, self.rank,
                       self.world, self.cfg.keep, self.writer, self.seq, rank_state, self.fault)
        except (OSError, RuntimeError) as e:
            # torch.save reports a failed write as a RuntimeError ("... file write failed", "No space left")
            if isinstance(e, RuntimeError) and not _IO_ERROR.search(str(e)):
                raise
            raise UserError(f"checkpoint {tag_for(step)}: writing {getattr(e, 'filename', None) or self.ckpt_dir} "
                            f"failed: {_why(e)}; {self._room()}; {self._latest()}") from None
        self.seq += 1
        self.log.info(f"saved checkpoint {tag}")
        return tag

    def check_space(self, step: int) -> None:
        """Every writer compares the free space of its file system with the predicted tag size
        (one all-gather: every rank stops, or none does)."""
        short = None
        if self.writer and self.needed_bytes:
            self.ckpt_dir.mkdir(parents=True, exist_ok=True)
            free = shutil.disk_usage(self.ckpt_dir).free
            if free < self.needed_bytes:
                short = f"{self.ckpt_dir}{self.where}: needs about {_gib(self.needed_bytes)}, {_gib(free)} free"
        reports = [r for r in dist.all_gather_object(short) if r]
        if reports:
            raise AgreedError(f"checkpoint {tag_for(step)} not written: {'; '.join(reports)}; free space "
                              f"or lower checkpoint.keep; {self._latest()}")

    def _latest(self) -> str:
        """Which checkpoint a resume would take now (the newest complete one; `latest` may lag it)."""
        tag = latest_complete(self.ckpt_dir) if self.ckpt_dir.is_dir() else None
        return (f"the newest complete checkpoint is {tag}, where a resume starts" if tag else
                "no checkpoint of this run was completed")

    def _room(self) -> str:
        if not self.ckpt_dir.is_dir():
            return f"a tag needs about {_gib(self.needed_bytes)}"
        usage, inodes = shutil.disk_usage(self.ckpt_dir), os.statvfs(self.ckpt_dir).f_favail
        return (f"a tag needs about {_gib(self.needed_bytes)}, {_gib(usage.free)} free" +
                (f", {inodes} inodes free (df -i)" if inodes < 1000 else ""))


# What a failed write looks like when torch.save or DeepSpeed report it as a RuntimeError.
_IO_ERROR = re.compile(r"No space left|file write failed|open file failed|Disk quota|Read-only file system|"
                       r"Input/output error|errno", re.I)


def _why(e: BaseException) -> str:
    if isinstance(e, OSError):
        return str(e.strerror or e)
    m = re.search(r"strerror: ([^\n]+)|(No space left on device|Disk quota exceeded|Read-only file system)", str(e))
    return (m.group(1) or m.group(2)).strip() if m else str(e).splitlines()[0][:160]


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"
