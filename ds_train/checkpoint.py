"""Partitioned checkpoints in DeepSpeed's own layout, made crash-safe, and exact resume.

A save is complete when every rank has written its DeepSpeed files and then its own
`ds_train_rank_<r>.pt` (per-rank RNG), and rank 0 has written `ds_train_state.json` after a
barrier. Only then does rank 0 point `latest` at the tag (write-to-temp, rename). A tag without the
state file or a rank file is never loaded, so a crash during a save leaves the previous checkpoint
as the latest. DeepSpeed's tools (zero_to_fp32.py, ds_to_universal) work on the same directories.
"""

from __future__ import annotations

import json
import random
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ds_train import dist
from ds_train.config import CheckpointConfig, RunConfig
from ds_train.errors import Preempted, UserError
from ds_train.fs import file_lock, write_atomic

STATE_FILE = "ds_train_state.json"
UNIVERSAL_SUFFIX = "_universal"
TAG_RE = re.compile(r"^step_(\d{8})$")
# Keys that may not change on resume: the model's shape, and what defines the data stream
# (sample g of step s is a function of seed, seq_len and global batch). Training knobs may change.
FIXED_KEYS = ("model.", "seed", "data.dir", "train.seq_len", "train.global_batch_size")


def tag_for(step: int) -> str:
    return f"step_{step:08d}"


def rank_file(tag_dir: Path, rank: int) -> Path:
    return tag_dir / f"ds_train_rank_{rank}.pt"


def is_complete(tag_dir: Path) -> bool:
    """The state file exists and every rank that saved wrote its rank file."""
    state = tag_dir / STATE_FILE
    if not state.is_file():
        return False
    try:
        world = json.loads(state.read_text())["world_size"]
    except (json.JSONDecodeError, KeyError):
        return False
    return all(rank_file(tag_dir, r).is_file() for r in range(world))


def complete_tags(ckpt_dir: Path) -> list[str]:
    """Complete tags in step order."""
    if not ckpt_dir.is_dir():
        return []
    tags = [p.name for p in ckpt_dir.iterdir() if TAG_RE.match(p.name) and is_complete(p)]  # not *_universal
    return sorted(tags)


def latest_complete(ckpt_dir: Path) -> str | None:
    """The tag `latest` names if complete, else the newest complete tag (latest is written last)."""
    latest = ckpt_dir / "latest"
    if latest.is_file():
        tag = latest.read_text().strip()
        if is_complete(ckpt_dir / tag):
            return tag
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


def save(engine, ckpt_dir: Path, step: int, state: dict, rank: int, world: int, keep: int) -> str:
    """Every rank calls this (it holds collectives); rank 0 alone marks the tag complete and prunes."""
    import torch

    tag = tag_for(step)
    tag_dir = ckpt_dir / tag
    from deepspeed.checkpoint.constants import (UNIVERSAL_CHECKPOINT_INFO, UNIVERSAL_CHECKPOINT_VERSION_KEY,
                                                UNIVERSAL_CHECKPOINT_VERSION_VALUE)

    # universal_checkpoint_info (no tensor-parallel patterns: plain data parallel) lets DeepSpeed's
    # ds_to_universal convert this checkpoint as it is.
    client_state = {"ds_train": state,
                    UNIVERSAL_CHECKPOINT_INFO: {UNIVERSAL_CHECKPOINT_VERSION_KEY: UNIVERSAL_CHECKPOINT_VERSION_VALUE}}
    engine.save_checkpoint(str(ckpt_dir), tag=tag, client_state=client_state, save_latest=False)
    torch.save(rng_state(), rank_file(tag_dir, rank))  # after this rank's DeepSpeed files
    dist.barrier()
    if rank == 0:  # plain file writes, no collective inside
        write_atomic(tag_dir / STATE_FILE, json.dumps({**state, "world_size": world}, indent=2))
        write_atomic(ckpt_dir / "latest", tag)
        prune(ckpt_dir, keep)
    dist.barrier()
    return tag


def prune(ckpt_dir: Path, keep: int) -> None:
    """Keep the newest `keep` complete tags (0: keep all); incomplete older tags go too."""
    if keep <= 0:
        return
    newest = complete_tags(ckpt_dir)[-keep:]
    if not newest:
        return
    for p in ckpt_dir.iterdir():
        base = p.name.removesuffix(UNIVERSAL_SUFFIX)  # a tag's universal copy goes with it
        if TAG_RE.match(base) and base not in newest and base < newest[-1]:
            shutil.rmtree(p, ignore_errors=True)


@dataclass(frozen=True)
class ResumePoint:
    load_dir: Path  # the checkpoints directory DeepSpeed loads from
    tag: str
    state: dict  # ds_train_state.json: step, samples, world_size, zero_stage, config


def find_resume(resume: str, ckpt_dir: Path) -> ResumePoint | None:
    """checkpoint.resume: auto (latest complete in output_dir, if any), none, a tag, or a path."""
    if resume == "none":
        return None
    if resume == "auto":
        tag = latest_complete(ckpt_dir)
        return _point(ckpt_dir, tag) if tag else None
    path = Path(resume)
    candidates = [ckpt_dir / resume, path] if not path.is_absolute() else [path]
    for cand in candidates:
        if cand.is_dir() and ((cand / STATE_FILE).exists() or TAG_RE.match(cand.name)):
            if not is_complete(cand):
                raise UserError(f"checkpoint.resume: {str(cand)!r} is incomplete (a save that did not "
                                f"finish); resume from another tag or use resume=auto")
            return _point(cand.parent, cand.name)
        if cand.is_dir():
            tag = latest_complete(cand)
            if tag is None:
                raise UserError(f"checkpoint.resume: {str(cand)!r} holds no complete checkpoint")
            return _point(cand, tag)
    raise UserError(f"checkpoint.resume: {resume!r} is neither a tag in {str(ckpt_dir)!r} nor a "
                    f"checkpoint directory; use auto, none, a tag (step_00000100) or a path")


def _point(load_dir: Path, tag: str) -> ResumePoint:
    return ResumePoint(load_dir, tag, json.loads((load_dir / tag / STATE_FILE).read_text()))


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
        if key not in old and key.startswith(("launch.", "ript.")):
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
                 same_world: bool = False) -> list[str]:
    """Refuse a resume that would change the model, the data stream or the kind of run (or, for
    `same_world`, the world size); return the allowed changes as notes."""
    if point is None:
        return []
    where = point.load_dir / point.tag
    saved_kind = point.state.get("kind", "train")
    if saved_kind != kind:
        raise UserError(f"{where}: a {saved_kind} checkpoint; `{kind}` cannot resume from it (use "
                        f"another output_dir or checkpoint.resume=none)")
    if same_world and point.state["world_size"] != world:
        raise UserError(f"{where}: saved with {point.state['world_size']} ranks; resume {kind} with the "
                        f"same world size (its work is sharded per rank)")
    errors, notes = config_changes(point.state["config"], cfg.to_dict())
    if errors:
        raise UserError(f"{where}: cannot resume with a changed " + "; ".join(errors) +
                        " (these fix the model or the data order; use another output_dir or "
                        "checkpoint.resume=none)")
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
    """Load weights, optimizer, scheduler and this rank's RNG; returns the saved trainer state."""
    import torch

    load_path, _ = engine.load_checkpoint(str(point.load_dir), tag=point.tag,
                                          load_optimizer_states=True, load_lr_scheduler_states=True)
    if load_path is None:
        raise UserError(f"{point.load_dir / point.tag}: DeepSpeed could not load this checkpoint")
    if point.state["world_size"] == world:  # per-rank RNG only where the ranks are the same ranks
        set_rng_state(torch.load(rank_file(point.load_dir / point.tag, rank), weights_only=False))
    return point.state


class Checkpointer:
    """Decides at each step boundary whether the step is its: every `checkpoint.every` steps, the
    last step (`checkpoint.save_final`), or a SIGTERM / SIGINT that every rank agreed on, after
    which it raises Preempted. Every rank calls `maybe_save` at every boundary: the signal
    agreement and the save are collectives, never behind a rank guard."""

    def __init__(self, engine, run_dir: Path, cfg: CheckpointConfig, last: int, rank: int, world: int,
                 record: dict, stop, log, unit: str = "step"):
        self.engine, self.ckpt_dir, self.cfg, self.last = engine, run_dir / "checkpoints", cfg, last
        self.rank, self.world, self.record, self.stop, self.log, self.unit = rank, world, record, stop, log, unit

    def due(self, step: int) -> bool:
        every = self.cfg.every > 0 and step % self.cfg.every == 0
        return every or (step == self.last and self.cfg.save_final)

    def maybe_save(self, step: int, state: Callable[[], dict] = dict) -> None:
        """Save when due or signalled; `state()` (called on every rank, may hold collectives) adds
        the loop's own position to the record."""
        signum = self.stop.agreed()
        if signum or self.due(step):
            self.save(step, state())
        if signum:
            raise Preempted(signum, step, self.unit)

    def save(self, step: int, state: dict) -> str:
        """Non-finite weights are never saved: the last good checkpoint stays the latest."""
        if not weights_finite(self.engine):
            raise UserError(f"{self.unit} {step}: the weights are not finite; no checkpoint written, the last "
                            f"good one stays in {self.ckpt_dir}; lower optim.lr and resume")
        tag = save(self.engine, self.ckpt_dir, step, {**self.record, **state, "step": step}, self.rank,
                   self.world, self.cfg.keep)
        self.log.info(f"saved checkpoint {tag}")
        return tag
