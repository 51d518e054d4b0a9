"""A run directory: its layout (every file name, for the writers and every reader), the kinds of
run that write one, and how it is read from outside the run, read-only (`ds-train monitor`,
`doctor`, `plot`, the launcher's last line).

`RunPaths` names every file: config.yaml, ds_config.json, env.json, metrics.jsonl, heartbeats/,
logs/ (rank_<r>.log, train.log, hang_report.json, failure.json, stacks_rank_<r>.txt), the results
file of its kind, checkpoints/ (and its `latest`), plots/, tensorboard/, hf_model/, init_model/ and
the lock. `RunKind` says what differs between the commands that write one (train, ript): what the
loop counts, where the last step is configured, the results file, what the console, the monitor and
the plots show; env.json records the kind's name. Reading works from another terminal or another
node with the directory mounted; a file being written (a torn last line, a heartbeat replaced
under us) is skipped, never an error.
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

LATEST = "latest"  # the file of a checkpoints directory that names its newest tag (DeepSpeed's)


@dataclass(frozen=True)
class RunPaths:
    """Every path of a run directory: what the run writes and what every reader reads."""

    root: Path

    # name -> "file" or "dir": what a run directory holds (anything else under these names is in the way)
    ENTRIES = {"config.yaml": "file", "ds_config.json": "file", "env.json": "file", "metrics.jsonl": "file",
               "results.json": "file", "ript_results.json": "file", "completions.jsonl": "file",
               "checkpoints": "dir", "logs": "dir", "heartbeats": "dir", "hf_model": "dir", "tensorboard": "dir",
               "plots": "dir"}

    def __post_init__(self):
        object.__setattr__(self, "root", Path(self.root))

    config = property(lambda self: self.root / "config.yaml")  # the resolved run config
    ds_config = property(lambda self: self.root / "ds_config.json")  # the DeepSpeed config used
    env = property(lambda self: self.root / "env.json")  # the command, versions, hosts, layout
    metrics = property(lambda self: self.root / "metrics.jsonl")
    completions = property(lambda self: self.root / "completions.jsonl")  # RIPT's rollouts (ript.log_completions)
    logs = property(lambda self: self.root / "logs")
    console_log = property(lambda self: self.root / "logs" / "train.log")  # rank 0's console
    hang_report = property(lambda self: self.root / "logs" / "hang_report.json")
    failure = property(lambda self: self.root / "logs" / "failure.json")
    heartbeats = property(lambda self: self.root / "heartbeats")
    checkpoints = property(lambda self: self.root / "checkpoints")
    latest = property(lambda self: self.root / "checkpoints" / LATEST)
    plots = property(lambda self: self.root / "plots")
    tensorboard = property(lambda self: self.root / "tensorboard")
    hf_model = property(lambda self: self.root / "hf_model")  # config, generation config, tokenizer
    init_model = property(lambda self: self.root / "init_model")  # a ds_train run given as model.path, exported
    lock = property(lambda self: self.root / ".ds_train.lock")
    dry_run = property(lambda self: self.root / "dry_run.json")

    def rank_log(self, rank: int) -> Path:
        return self.logs / f"rank_{rank}.log"

    def stacks(self, rank: int) -> Path:
        return self.logs / f"stacks_rank_{rank}.txt"

    def heartbeat(self, rank: int) -> Path:
        return self.heartbeats / f"rank_{rank}.json"

    def results(self, kind: "RunKind") -> Path:
        return self.root / kind.results

    def hf_export(self, tag: str) -> Path:
        return self.root / f"hf_export_{tag}"


@dataclass(frozen=True)
class RunKind:
    """What differs between the commands that write a run directory, in one place: the run spec
    carries it, env.json records its name, and the readers look it up by that name."""

    name: str  # the command: env.json "command", the checkpoint marker's "kind"
    unit: str  # what the loop counts, in messages
    last_key: str  # the config key of the loop's last step
    results: str  # the results file's name
    console_keys: tuple[str, ...]  # what the console prints per logged step
    curves: tuple[tuple[str, str], ...]  # the monitor's metric rows: (label, metric key)
    figures: tuple[str, ...]  # the plots a finished run writes (ds_train.observe.plots.FIGURES)
    progress: tuple[str, str]  # the metric the progress bar shows, and its label
    per_task: bool = False  # the monitor shows success per task

    def last(self, config: dict) -> int:
        """The loop's last step in a run config (as a dict, config.yaml); 0 when it says none."""
        section, key = self.last_key.split(".")
        value = (config.get(section) or {}).get(key)
        return value if isinstance(value, int) and not isinstance(value, bool) else 0


TRAIN = RunKind(
    "train", "step", "train.max_steps", "results.json",
    console_keys=("train/loss", "rewards/accuracies", "rewards/margins", "eval/loss", "eval/ppl",
                  "eval/rewards/accuracies", "optim/lr", "optim/grad_norm", "perf/tokens_per_s",
                  "perf/step_time_s", "perf/mfu", "mem/max_rank_gib", "mem/max_rank_rss_gib", "moe/load_max_mean",
                  "moe/aux_loss"),
    curves=(("loss", "train/loss"), ("eval loss", "eval/loss"), ("reward accuracy", "rewards/accuracies"),
            ("held-out reward accuracy", "eval/rewards/accuracies"), ("lr", "optim/lr"),
            ("grad norm", "optim/grad_norm"),
            ("tokens/s", "perf/tokens_per_s"), ("MFU", "perf/mfu"), ("expert load max/mean", "moe/load_max_mean"),
            ("router aux loss", "moe/aux_loss")),
    figures=("loss", "lr", "throughput", "memory", "experts", "benchmarks"), progress=("train/loss", "loss"))
RIPT = RunKind(
    "ript", "iteration", "ript.iterations", "ript_results.json",
    console_keys=("ript/success_rate", "ript/reward_mean", "ript/accepted", "ript/rejected", "ript/checked",
                  "ript/truncated_frac", "policy/loss", "policy/kl", "policy/clip_frac", "perf/rollouts_per_s",
                  "eval/success"),
    curves=(("success", "ript/success_rate"), ("held-out", "eval/success"), ("reward mean", "ript/reward_mean"),
            ("reward std", "ript/reward_std"), ("zero-std groups", "ript/frac_reward_zero_std"),
            ("truncated", "ript/truncated_frac"), ("KL", "policy/kl"), ("policy loss", "policy/loss"),
            ("rollouts/s", "perf/rollouts_per_s"), ("turns / episode", "ript/turns_mean"),
            ("tool calls / episode", "ript/tool_calls_mean"), ("ended by a fault", "ript/env_failed_frac"),
            ("time in environments", "perf/env_frac"), ("staleness (updates)", "async/staleness_mean"),
            ("trainers waited (s)", "async/trainer_wait_s"), ("rollout ranks waited (s)", "async/rollout_wait_s"),
            ("weights sent (s)", "async/weights_send_s")),
    figures=("success", "heldout", "rewards", "benchmarks"), progress=("ript/success_rate", "success"), per_task=True)
KINDS = {kind.name: kind for kind in (TRAIN, RIPT)}


# A live rank rewrites its heartbeat every watchdog.heartbeat_s (default 2 s): one this much older
# than that (and older than this floor) belongs to a rank that is gone.
STALE_HEARTBEATS = 5
STALE_FLOOR_S = 30.0


def read_json_or_none(path: Path) -> Any:
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


def read_yaml_or_empty(path: Path) -> dict:
    import yaml

    from ds_train.fs import yaml_load  # bounded: a user-edited config.yaml may hold an alias bomb

    try:
        out = yaml_load(path.read_text())
    except (OSError, ValueError, yaml.YAMLError):
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
        fd = os.open(RunPaths(run_dir).lock, os.O_RDONLY)
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
    def paths(self) -> RunPaths:
        return RunPaths(self.path)

    @property
    def kind(self) -> RunKind:
        """The command that wrote the run (env.json), else the one whose results file is there."""
        if self.env.get("command") in KINDS:
            return KINDS[self.env["command"]]
        return next((k for k in KINDS.values() if self.paths.results(k).is_file()), TRAIN)

    @property
    def target(self) -> int:
        """The last step (train.max_steps) or iteration (ript.iterations) of the run."""
        return self.kind.last(self.config)

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
            return "finished", f"reached {self.kind.unit} {self.target}"
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
    paths = RunPaths(path)
    view = RunView(paths.root, read_at=time.time())
    view.config = read_yaml_or_empty(paths.config)
    view.env = read_json_or_none(paths.env) or {}
    view.metrics = read_metrics(paths.metrics)
    for hb_path in sorted(paths.heartbeats.glob("rank_*.json")):
        rec = read_json_or_none(hb_path)
        if isinstance(rec, dict) and isinstance(rec.get("rank"), int):
            view.heartbeats[rec["rank"]] = rec
    started = float(view.env.get("started") or _mtime(paths.env))
    newest_beat = max((float(hb.get("time") or 0) for hb in view.heartbeats.values()
                       if hb.get("status") == "running"), default=0.0)
    for name, path in (("hang", paths.hang_report), ("failure", paths.failure)):  # this attempt's only
        report = read_json_or_none(path)
        at = _report_time(report) or _mtime(path)
        if isinstance(report, dict) and at >= started - 1.0 and newest_beat <= at + 1.0:
            setattr(view, name, report)
    view.results = read_json_or_none(paths.results(view.kind))
    with contextlib.suppress(OSError):  # no checkpoint yet: latest stays ""
        view.latest = paths.latest.read_text().strip()
    view.holder = lock_holder(paths.root)
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
