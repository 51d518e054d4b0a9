"""The resume every rank agrees on, and how to load it.

At start-up each rank reports what it holds of the run's checkpoints (`scan`: every tag's marker
and this rank's own files); `decide`, a pure function of all the reports, picks the newest marked
tag that every rank holds whole, and refuses with a line naming the node, host, rank and files
when one lacks it; `agree` gathers the reports (one all-gather) so every rank decides the same.
`check_resume` refuses a resume that would change the model, the data or the kind of run;
`plan_resume` decides between loading as saved and going through DeepSpeed's universal checkpoint
(`convert_to_universal`, when the world size or the ZeRO stage changed); `load` loads it.
"""

from __future__ import annotations

import json
import pickle
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ds_train import dist
from ds_train.checkpoint.commit import (STATE_FILE, TAG_RE, UNIVERSAL_SUFFIX, ds_to_universal, has_frozen, is_complete,
                                        latest_complete, manifest_file, rank_file, rank_missing, read_latest,
                                        read_marker, save_order, saved_parallel, set_rng_state, universal_dir)
from ds_train.checkpoint.rundir import RunPaths
from ds_train.config import RunConfig
from ds_train.errors import UserError
from ds_train.fs import file_lock, write_atomic
from ds_train.plan.parallel import ParallelDims

# Keys that may not change on resume: the model's shape, and what defines the data stream
# (sample g of step s is a function of seed, seq_len and global batch). Training knobs may change.
FIXED_KEYS = ("model.", "seed", "data.dir", "train.seq_len", "train.global_batch_size")
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
    load_dir, wanted = locate_checkpoint(resume, ckpt_dir, key)
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


def locate_checkpoint(resume: str, ckpt_dir: Path, key: str = "checkpoint.resume") -> tuple[Path, str | None]:
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
            return (RunPaths(cand).checkpoints if RunPaths(cand).checkpoints.is_dir() else cand), None
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
    latest: str = ""  # what `latest` in the directory resumed from names (checkpoint.read_latest)

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
            marked[t] = max(states, key=save_order)
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
    chosen = wanted or max(marked, key=lambda t: save_order(marked[t]))
    state = marked[chosen]
    lacking = _lacking(chosen, state, views, world)
    if lacking:
        older = [t for t in sorted(marked, key=lambda t: save_order(marked[t])) if t != chosen and
                 not _lacking(t, marked[t], views, world)]
        alt = f"resume from {older[-1]} with checkpoint.resume={older[-1]}, " if older else ""
        raise UserError(f"checkpoint {load_dir / chosen} ({unit} {state['step']}, the newest complete save) "
                        f"is incomplete on {'; '.join(lacking)}; restore those files, {alt}or start over "
                        f"with checkpoint.resume=restart")
    skipped = [u for u in unfinished if u.split()[0] != chosen]
    said = f"resumed from {load_dir / chosen} at {unit} {state['step']}"
    if skipped:
        said += f"; not complete, skipped: {_listed(skipped, 5)}"
    off = sorted({v.latest for v in views if v.latest and v.latest != chosen}) if wanted is None else []
    if off:  # a save cut short between its marker and `latest`, or a hand-edited or damaged file
        said += f"; `latest` names {_listed(off)}, not the newest complete save (rewritten at the next save)"
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
    load_dir, wanted = locate_checkpoint(resume, ckpt_dir)
    own = {p.name: read_marker(p)[0] for p in ckpt_dir.iterdir() if TAG_RE.match(p.name) and p.is_dir()} \
        if ckpt_dir.is_dir() else {}
    mine = RankView(env.rank, env.node_rank, host, scan(load_dir, wanted, env.rank, env.world_size),
                    max((int(s["seq"]) for s in own.values() if s), default=0),
                    tuple(sorted(name for name, s in own.items() if s)), read_latest(load_dir))
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
        if key not in old and (key.startswith(("launch.", "ript.", "dist.", "watchdog."))
                               or key.startswith("model.lora.") and not new.get("model.lora.rank")):
            continue  # a section added since the checkpoint was written (LoRA: while it is off)
        if old.get(key) != new.get(key) and key != "output_dir":
            line = f"{key}: {old.get(key)!r} -> {new.get(key)!r}"
            (errors if key.startswith(FIXED_KEYS) else notes).append(line)
    return errors, notes


def convert_to_universal(tag_dir: Path) -> Path:
    """DeepSpeed's ds_to_universal on a complete tag, into `<tag>_universal` (once, under a lock)."""
    if not is_complete(tag_dir):
        raise UserError(f"{tag_dir}: not a complete ds_train checkpoint; cannot convert it")
    state = read_marker(tag_dir)[0]
    if state["zero_stage"] == 0:
        tensor = saved_parallel(state).get("tensor", 1)
        raise UserError(f"{tag_dir}: a ZeRO-0 checkpoint (its optimizer whole in each model-states file) has no "
                        f"partitions to convert: it resumes at any data-parallel size as it is, under ZeRO-0 and "
                        f"model.dtype={state.get('dtype', 'fp32')}" + (f" with parallel.tensor={tensor}" if tensor > 1
                                                                      else ""))
    out = universal_dir(tag_dir)
    with file_lock(tag_dir.parent / ".convert.lock"):
        if is_complete(out):
            return out
        tmp = out.with_name(f".{out.name}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        ds_to_universal(tag_dir, tmp)
        state = json.loads((tag_dir / STATE_FILE).read_text())
        state |= {"universal": True, "source_tag": tag_dir.name, "source_world_size": state["world_size"],
                  "world_size": 0}  # no per-rank files: a universal checkpoint fits any world size
        write_atomic(tmp / STATE_FILE, json.dumps(state, indent=2))
        tmp.rename(out)
    return out


def check_resume(point: ResumePoint | None, cfg: RunConfig, kind: str, world: int,
                 same_world: bool = False, data: dict | None = None) -> list[str]:
    """Refuse a resume that would change the model, the data stream or the kind of run (or, for
    `same_world`, the world size); return the allowed changes as notes. `data`: what identifies the
    tokenizer and the prepared data now (a checkpoint records it): the same data.dir re-prepared
    with another tokenizer would feed the saved weights other token ids."""
    if point is None:
        return []
    where = point.load_dir / point.tag
    saved_data = dict(point.state.get("data") or {})
    data = dict(data or {})
    saved_base, base = saved_data.pop("base", None), data.pop("base", None)
    if saved_base and base and saved_base != base:
        raise UserError(f"{where}: the base model's weights changed since this checkpoint (model.path "
                        f"{cfg.model.path!r}: fingerprint {saved_base} -> {base}); a LoRA checkpoint holds only the "
                        f"adapters trained on the old base; point model.path at that base, or start over with "
                        f"checkpoint.resume=restart")
    changed = sorted(k for k in set(saved_data) & set(data) if saved_data[k] != data[k])
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


def plan_resume(point: ResumePoint | None, dims: ParallelDims, stage: int, dtype: str,
                force_universal: bool) -> ResumePlan:
    """Directly, or through a universal checkpoint when the world size, the parallel layout or the
    ZeRO stage changed."""
    if point is None:
        return ResumePlan(None)
    if point.state.get("universal"):
        return ResumePlan(point, (f"loading universal checkpoint {point.tag}",), universal=True)
    saved_world, saved_stage = point.state["world_size"], point.state["zero_stage"]
    saved_dims = ParallelDims.from_record(saved_parallel(point.state), saved_world)
    saved_dtype = point.state.get("dtype", "fp32")
    if saved_world == dims.world and saved_dims == dims and saved_stage == stage and not force_universal:
        return ResumePlan(point)
    if (saved_world == dims.world and saved_dims.tensor == dims.tensor and saved_stage == stage
            and not force_universal):  # only the sequence / data split of the same ranks moved
        return ResumePlan(point, (f"parallel.sequence {saved_dims.sequence} -> {dims.sequence}: the checkpoint loads "
                                  f"as it is (sequence ranks hold the whole model, and ZeRO partitions over data x "
                                  f"sequence = {dims.data * dims.sequence} ranks either way)",))
    change = f"world size {saved_world} -> {dims.world}, ZeRO stage {saved_stage} -> {stage}"
    if saved_dims.world == saved_world and (saved_dims.sequence, saved_dims.tensor) != (dims.sequence, dims.tensor):
        change += f", {saved_dims.describe()} -> {dims.describe().removeprefix('parallel: ')}"
    if 0 in (saved_stage, stage):  # ZeRO-0: the optimizer whole in each tensor rank's model-states file
        return _zero0_plan(point, change, saved_dims, dims, (saved_stage, saved_dtype), (stage, dtype))
    if saved_dims.sequence > 1:
        raise UserError(f"{point.load_dir / point.tag}: {change}: a checkpoint saved with parallel.sequence="
                        f"{saved_dims.sequence} cannot go through DeepSpeed's universal checkpoint (ds_to_universal "
                        f"reads its sequence ranks as tensor ranks); resume at world size {saved_world}, ZeRO stage "
                        f"{saved_stage} (any parallel.sequence that divides it)")
    name = universal_dir(point.load_dir / point.tag).name
    return ResumePlan(point, (f"{change}: loading through DeepSpeed's universal checkpoint {name}",),
                      universal=True, convert=True)


def _zero0_plan(point: ResumePoint, change: str, saved_dims: ParallelDims, dims: ParallelDims,
                saved: tuple[int, str], target: tuple[int, str]) -> ResumePlan:
    """ZeRO-0 keeps the optimizer whole (a torch optimizer in fp32, DeepSpeed's unfused one in bf16/fp16)
    in each tensor rank's model-states file, which DeepSpeed's universal conversion cannot read: such a
    checkpoint loads as it is at any data-parallel size, with the same stage, dtype and tensor split."""
    where = point.load_dir / point.tag
    if saved != target:
        raise UserError(f"{where}: {change}: DeepSpeed cannot move optimizer states between ZeRO-{saved[0]} "
                        f"{saved[1]} and ZeRO-{target[0]} {target[1]} (a ZeRO-0 optimizer is not partitioned, so "
                        f"ds_to_universal cannot read it); resume with ZeRO-{saved[0]} and model.dtype={saved[1]}")
    if saved_dims.tensor != dims.tensor:
        raise UserError(f"{where}: {change}: a ZeRO-0 checkpoint saved with parallel.tensor={saved_dims.tensor} holds "
                        f"each tensor rank's shard of the weights and optimizer in its own file, which DeepSpeed cannot "
                        f"re-split; resume with parallel.tensor={saved_dims.tensor} (any data-parallel size), or train "
                        f"with ZeRO-1/2 to change the tensor split later")
    return ResumePlan(point, (f"{change}: the ZeRO-0 checkpoint loads as it is",))


def prepare_resume(plan: ResumePlan) -> ResumePoint | None:
    """The point to load, after running ds_to_universal where the plan needs it."""
    if not plan.convert:
        return plan.point
    universal = convert_to_universal(plan.point.load_dir / plan.point.tag)
    return _point(plan.point.load_dir, universal.name)


def load_resume(engine, point: ResumePoint, rank: int, world: int) -> dict:
    """Load weights, optimizer, scheduler, this rank's RNG; returns the saved state, with this rank's
    own loop state under "rank" when the world size is the one saved."""
    import torch

    where = point.load_dir / point.tag
    try:
        load_path, _ = engine.load_checkpoint(str(point.load_dir), tag=point.tag,
                                              load_module_strict=not has_frozen(engine),  # LoRA: the base is not in it
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
