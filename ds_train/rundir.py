"""A run directory read from outside the run, read-only: what `ds-train monitor`, `doctor` and
`plot` see. Only files: config.yaml, env.json, metrics.jsonl, heartbeats/rank_<r>.json, logs/
(hang_report.json, failure.json, rank_<r>.log, train.log), results.json / ript_results.json and
checkpoints/latest. Works from another terminal or another node with the directory mounted; a file
being written (a torn last line, a heartbeat replaced under us) is skipped, never an error.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# A live rank rewrites its heartbeat every watchdog.heartbeat_s (default 2 s): one this much older
# than that (and older than this floor) belongs to a rank that is gone.
STALE_HEARTBEATS = 5
STALE_FLOOR_S = 30.0


def read_json(path: Path) -> Any:
    """The parsed file, None when it is missing, being replaced or damaged."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def read_metrics(path: Path) -> list[dict]:
    """metrics.jsonl's records in order; a line that does not parse (being written) is skipped.
    Non-finite values, stored as strings ("nan"), come back as floats."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return []
    out = []
    for line in text.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and isinstance(rec.get("step"), int):
            out.append({k: float(v) if v in ("nan", "inf", "-inf") else v for k, v in rec.items()})
    return out


def read_yaml(path: Path) -> dict:
    import yaml

    try:
        out = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError):
        return {}
    return out if isinstance(out, dict) else {}


def series(records: list[dict], key: str, x: str = "step") -> tuple[list[float], list[float]]:
    """(xs, ys) of the records that hold a number under `key` (and under `x`)."""
    xs, ys = [], []
    for rec in records:
        value, at = rec.get(key), rec.get(x)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and isinstance(at, (int, float)):
            xs.append(at)
            ys.append(float(value))
    return xs, ys


def lock_holder(run_dir: Path) -> str | None:
    """Who holds the run directory's lock (a run writing it: 'pid P on HOST since T'), None when no
    process does. Only a process on this node (or a file system with shared locks) is seen."""
    try:
        fd = os.open(run_dir / ".ds_train.lock", os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    except BlockingIOError:
        return os.pread(fd, 200, 0).decode(errors="replace").strip() or "a process"
    finally:
        os.close(fd)


@dataclass
class RunView:
    """One look at a run directory."""

    path: Path
    config: dict = field(default_factory=dict)
    env: dict = field(default_factory=dict)
    metrics: list[dict] = field(default_factory=list)
    heartbeats: dict[int, dict] = field(default_factory=dict)
    hang: dict | None = None  # logs/hang_report.json of this attempt
    failure: dict | None = None  # logs/failure.json of this attempt
    results: dict | None = None  # results.json (train) or ript_results.json (ript)
    latest: str = ""  # checkpoints/latest
    holder: str | None = None  # who holds the run directory's lock, if anyone here
    read_at: float = 0.0

    @property
    def kind(self) -> str:
        return "ript" if self.env.get("command") == "ript" or (self.path / "ript_results.json").is_file() else "train"

    @property
    def target(self) -> int:
        """The last step (train.max_steps) or iteration (ript.iterations) of the run."""
        section, key = ("ript", "iterations") if self.kind == "ript" else ("train", "max_steps")
        value = (self.config.get(section) or {}).get(key)
        return int(value) if isinstance(value, int) else 0

    @property
    def step(self) -> int:
        """How far the run got: the furthest of its metrics, heartbeats and results."""
        steps = [int(r["step"]) for r in self.metrics[-1:]]
        steps += [int(hb.get("step") or 0) for hb in self.heartbeats.values()]
        if self.results:
            steps.append(int(self.results.get("steps") or self.results.get("iteration") or 0))
        return max(steps, default=0)

    @property
    def heartbeat_s(self) -> float:
        return float((self.config.get("watchdog") or {}).get("heartbeat_s") or 2.0)

    def heartbeat_age(self, rank: int) -> float:
        return max(0.0, self.read_at - float(self.heartbeats[rank].get("time") or 0))

    def stale(self, rank: int) -> bool:
        hb = self.heartbeats[rank]
        return (hb.get("status") == "running" and
                self.heartbeat_age(rank) > max(STALE_FLOOR_S, STALE_HEARTBEATS * self.heartbeat_s))

    def state(self) -> tuple[str, str]:
        """(running | finished | stopped | failed | hung | dead | not started, why in one line)."""
        if self.hang:
            return "hung", self.hang.get("line", "the watchdog found a hang")
        if self.failure:
            return "failed", self.failure.get("line", "a rank failed")
        statuses = {hb.get("status") for hb in self.heartbeats.values()}
        done = self.target and self.step >= self.target and (self.results is not None)
        if done and statuses <= {"ended", None}:
            return "finished", f"reached {'iteration' if self.kind == 'ript' else 'step'} {self.target}"
        if "failed" in statuses:
            bad = sorted(r for r, hb in self.heartbeats.items() if hb.get("status") == "failed")
            return "failed", f"rank(s) {', '.join(map(str, bad))} failed (see logs/rank_<r>.log)"
        if "stopped" in statuses:
            saved = f"; checkpoint {self.latest} saved, the same command resumes" if self.latest else ""
            return "stopped", f"stopped by a signal at step {self.step}{saved}"
        if self.heartbeats and statuses <= {"ended"}:
            return "finished", f"ended at step {self.step}"
        if not self.heartbeats:
            return ("not started", "no heartbeats yet (the ranks are starting, or this is not a run directory)")
        stale = sorted(r for r in self.heartbeats if self.stale(r))
        if stale and not self.holder:
            age = min(self.heartbeat_age(r) for r in stale)
            return "dead", (f"no heartbeat from rank(s) {', '.join(map(str, stale))} for {age:.0f} s and no "
                            f"process holds the run directory: the job is gone (killed, or its node is down)")
        return "running", f"step {self.step} of {self.target}"


def read_run(path: str | Path) -> RunView:
    """Everything the monitor, doctor and plots read, in one pass."""
    run_dir = Path(path)
    view = RunView(run_dir, read_at=time.time())
    view.config = read_yaml(run_dir / "config.yaml")
    view.env = read_json(run_dir / "env.json") or {}
    view.metrics = read_metrics(run_dir / "metrics.jsonl")
    for hb_path in sorted((run_dir / "heartbeats").glob("rank_*.json")):
        rec = read_json(hb_path)
        if isinstance(rec, dict) and isinstance(rec.get("rank"), int):
            view.heartbeats[rec["rank"]] = rec
    started = float(view.env.get("started") or _mtime(run_dir / "env.json"))
    newest_beat = max((float(hb.get("time") or 0) for hb in view.heartbeats.values()
                       if hb.get("status") == "running"), default=0.0)
    for name in ("hang_report.json", "failure.json"):  # this attempt's: a resumed run starts clean
        report = read_json(run_dir / "logs" / name)
        at = _report_time(report) or _mtime(run_dir / "logs" / name)
        if isinstance(report, dict) and at >= started - 1.0 and newest_beat <= at + 1.0:
            setattr(view, "hang" if name.startswith("hang") else "failure", report)
    for name in ("results.json", "ript_results.json"):
        if view.results is None:
            view.results = read_json(run_dir / name)
    with contextlib.suppress(OSError):  # no checkpoint yet: latest stays ""
        view.latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    view.holder = lock_holder(run_dir)
    return view


def _report_time(report) -> float:
    """When the ranks a report names last published (their heartbeats' times), 0 if it says none."""
    if not isinstance(report, dict):
        return 0.0
    records = list((report.get("ranks") or {}).values()) + [report.get("first")] + list(report.get("failures") or [])
    return max((float(r["time"]) for r in records if isinstance(r, dict) and isinstance(r.get("time"), (int, float))),
               default=0.0)


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0
