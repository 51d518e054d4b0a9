"""How to resume from the point every rank agreed on (ds_train/checkpoint/consensus.py), and load it.

`find_resume` reads checkpoint.resume on one file system holding the whole checkpoint (tools);
`check_resume` refuses a resume that would change the model, the data or the kind of run;
`plan_resume` decides between loading as saved and going through DeepSpeed's universal checkpoint
(`convert_to_universal`, when the world size or the ZeRO stage changed); `load` loads it.
"""

from __future__ import annotations

import json
import pickle
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ds_train.checkpoint.commit import (STATE_FILE, TAG_RE, has_frozen, is_complete, latest_complete, rank_file,
                                        read_marker, saved_parallel, set_rng_state)
from ds_train.checkpoint.rundir import RunPaths
from ds_train.checkpoint.tagfiles import holds_a_save
from ds_train.checkpoint.universal import UNIVERSAL_SUFFIX, ds_to_universal, universal_dir
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
            if TAG_RE.match(p.name) and p.is_dir() and int(TAG_RE.match(p.name).group(1)) > step and not is_complete(p)
            and holds_a_save(p)]


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
                 same_world: bool = False, data: dict | None = None, rollout_ranks: int = 0) -> list[str]:
    """Refuse a resume that would change the model, the data stream or the kind of run (or, for
    `same_world`, the world size, and a ript run's rollout ranks: `rollout_ranks` in all); return the allowed
    changes as notes. `data`: what identifies the tokenizer and the prepared data now (a checkpoint records
    it): the same data.dir re-prepared with another tokenizer would feed the saved weights other token ids."""
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
    saved_rollout = (point.state.get("ript") or {}).get("rollout_ranks", 0) if kind == "ript" else 0
    if saved_rollout != rollout_ranks:
        raise UserError(f"{where}: saved with {saved_rollout} rollout rank(s) in all (ript.rollout_ranks_per_node), "
                        f"this job has {rollout_ranks}; resume with the same rollout ranks per node and nodes (the "
                        f"batches in flight and the samplers belong to their ranks), or use another output_dir")
    saved_k = ((point.state.get("config") or {}).get("ript") or {}).get("max_staleness", 0)
    if saved_rollout and saved_k != cfg.ript.max_staleness:
        raise UserError(f"{where}: saved with ript.max_staleness={saved_k}, resumed with {cfg.ript.max_staleness}: the "
                        f"batches the rollout ranks held at the save were generated for {saved_k} (with a lower k the "
                        f"first updates would drop them all as stale); resume with ript.max_staleness={saved_k}, or "
                        f"use another output_dir")
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
    if max(saved_dims.expert, dims.expert) > 1:  # AutoEP's experts, each in its own rank's files
        return _expert_plan(point, saved_dims, dims, saved_stage, stage)
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


def _expert_plan(point: ResumePoint, saved_dims: ParallelDims, dims: ParallelDims, saved_stage: int,
                 stage: int) -> ResumePlan:
    """An expert-parallel checkpoint in another layout: through DeepSpeed's universal checkpoint, which
    gathers and re-splits AutoEP's experts, from ZeRO-1/2 to ZeRO-1/2 at any world size and
    parallel.expert > 1 (measured: the losses continue within 1e-7); what it cannot do, one line."""
    where, saved_world = point.load_dir / point.tag, point.state["world_size"]
    as_saved = f"resume at world size {saved_world}, ZeRO stage {saved_stage}, parallel.expert={saved_dims.expert}"
    if min(saved_dims.expert, dims.expert) == 1:
        raise UserError(f"{where}: saved with parallel.expert={saved_dims.expert}, resumed with parallel.expert="
                        f"{dims.expert}: AutoEP's layers and the model's own MoE blocks keep the experts under other "
                        f"names, which DeepSpeed does not map when it loads; {as_saved} (any parallel.expert > 1 "
                        f"with ZeRO-1/2), or `ds-train export` it and start from the export (model.path=DIR) with "
                        f"parallel.expert={dims.expert}")
    if not {saved_stage, stage} <= {1, 2}:
        raise UserError(f"{where}: saved with ZeRO-{saved_stage}, resumed with ZeRO-{stage}, world size {saved_world} "
                        f"-> {dims.world}, parallel.expert {saved_dims.expert} -> {dims.expert}: an expert-parallel "
                        f"checkpoint moves between layouts through DeepSpeed's universal checkpoint from and to ZeRO-1 "
                        f"or 2 only (into ZeRO-3 DeepSpeed 0.19.8 fails, a ZeRO-3 one drifts, ZeRO-0 has no optimizer "
                        f"partitions); {as_saved}")
    name = universal_dir(where).name
    return ResumePlan(point, (f"world size {saved_world} -> {dims.world}, ZeRO stage {saved_stage} -> {stage}, "
                              f"parallel.expert {saved_dims.expert} -> {dims.expert}: loading through DeepSpeed's "
                              f"universal checkpoint {name}",), universal=True, convert=True)


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
                        f"each tensor rank's shard of the weights and optimizer in its own file, which DeepSpeed "
                        f"cannot re-split; resume with parallel.tensor={saved_dims.tensor} (any data-parallel size), "
                        f"or train with ZeRO-1/2 to change the tensor split later")
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
