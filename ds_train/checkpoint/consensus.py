"""The resume every rank agrees on.

At start-up each rank reports what it holds of the run's checkpoints (`scan`: every tag's marker
and this rank's own files); `decide`, a pure function of all the reports, picks the newest marked
tag that every rank holds whole, and refuses with a line naming the node, host, rank and files
when one lacks it; `agree` gathers the reports (one all-gather) so every rank decides the same.
What the chosen point may change, and how it loads, is ds_train/checkpoint/resume.py's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from ds_train import dist
from ds_train.checkpoint.commit import TAG_RE, manifest_file, rank_missing, read_latest, read_marker, save_order
from ds_train.checkpoint.tagfiles import holds_a_save
from ds_train.checkpoint.resume import ResumePoint, locate_checkpoint
from ds_train.errors import UserError


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
    """What this rank holds: every tag of `load_dir` (and the one wanted), marker and own files. A
    folder named like a tag that holds no save (a user's files, left by retention) is none."""
    names = (sorted(p.name for p in load_dir.iterdir() if TAG_RE.match(p.name) and p.is_dir() and holds_a_save(p))
             if load_dir.is_dir() else [])
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
