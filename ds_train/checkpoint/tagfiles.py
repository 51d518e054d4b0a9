"""Which files of a tag folder ds_train wrote: retention (checkpoint.keep) and a save into an
existing tag delete those, and nothing a user left there (notes, an evaluation, an export).

Every file ds_train itself writes into a tag is named `ds_train_*` (the marker, each rank's file and
manifest, and RECORD); a folder that holds none is not a save, finished or not, whatever its name:
retention, the resume and export pass it by. RECORD lists, when a save starts, the files already in
the folder (a user's, kept) and, before the marker is written, every file the save wrote, DeepSpeed's
included whatever their names. Deleting a tag's files takes the marker first (nothing half-deleted
looks complete) and RECORD last (a crash midway leaves a folder that still says what is ds_train's).
A tag written before RECORD existed counts its `ds_train_*` files and those its manifests list.
"""

from __future__ import annotations

import json
from pathlib import Path

from ds_train.fs import fsync_dir, write_atomic

RECORD = "ds_train_files.json"
OWN_PREFIX = "ds_train_"  # every file ds_train itself writes into a tag


def holds_a_save(tag_dir: Path) -> bool:
    """Whether a tag folder holds (part of) a save: any file ds_train writes there."""
    try:
        return any(p.name.startswith(OWN_PREFIX) for p in tag_dir.iterdir())
    except OSError:
        return False


def _files(tag_dir: Path) -> set[str]:
    """Every file under `tag_dir`, as a path relative to it (symbolic links not followed)."""
    return {p.relative_to(tag_dir).as_posix() for p in tag_dir.rglob("*") if p.is_symlink() or p.is_file()}


def _record(tag_dir: Path) -> dict:
    try:
        record = json.loads((tag_dir / RECORD).read_text())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def record_begin(tag_dir: Path) -> None:
    """A save into `tag_dir` begins (the writer, after the tag's earlier files went): what is here is a user's."""
    tag_dir.mkdir(parents=True, exist_ok=True)
    write_atomic(tag_dir / RECORD, json.dumps({"user": sorted(_files(tag_dir) - {RECORD})}, indent=1))


def record_written(tag_dir: Path, marker: str) -> None:
    """Every rank's files are durable, the marker comes next: record all the save wrote, and the marker."""
    user = set(_record(tag_dir).get("user") or [])
    ours = (_files(tag_dir) - user - {RECORD}) | {marker}
    write_atomic(tag_dir / RECORD, json.dumps({"user": sorted(user), "files": sorted(ours)}, indent=1))


def ours(tag_dir: Path) -> set[str]:
    """The files under `tag_dir` that ds_train wrote (RECORD among them)."""
    present = _files(tag_dir)
    record = _record(tag_dir)
    if isinstance(record.get("files"), list):  # a save that reached its marker
        return (set(record["files"]) | {RECORD}) & present
    if isinstance(record.get("user"), list):  # a save that did not finish: all but what was here before it
        return present - set(record["user"])
    own = {name for name in present if name.startswith(OWN_PREFIX)}  # a tag saved before RECORD existed
    for name in sorted(own):
        if name.startswith(f"{OWN_PREFIX}rank_") and name.endswith(".json"):  # a manifest: the files it needs
            try:
                own |= set(json.loads((tag_dir / name).read_text())["files"]) & present
            except (OSError, ValueError, KeyError, TypeError):
                continue
    return own


def remove_ours(tag_dir: Path, marker: str) -> list[str]:
    """Delete what ds_train wrote in `tag_dir`: the marker first, RECORD last, then the folder if nothing
    else is left. Returns what is left: the files a user put there."""
    doomed = ours(tag_dir)
    (tag_dir / marker).unlink(missing_ok=True)
    fsync_dir(tag_dir)
    for name in sorted(doomed - {RECORD, marker}) + [RECORD]:
        (tag_dir / name).unlink(missing_ok=True)
    for folder in sorted({(tag_dir / name).parent for name in doomed}, key=lambda p: -len(p.parts)):
        try:
            folder.rmdir()  # only when nothing else is in it
        except OSError:
            pass
    return sorted(_files(tag_dir)) if tag_dir.exists() else []
