"""`ds-train monitor RUN_DIR`: a live terminal view of a run, from its directory alone (read-only).

Progress and ETA, loss / eval loss / lr as small curves, tokens/s and MFU, and a table of the
ranks (host, step, phase, heartbeat age, memory, GPU utilisation) with stalled ranks and
stragglers marked; RIPT runs show success per task and the held-out curve. A finished, stopped,
failed, hung or dead run says so and why, and the live view ends with it.
"""

from __future__ import annotations

import re
import time

from ds_train.checkpoint.rundir import RunView, read_run, series
from ds_train.errors import UserError

SPARKS = "▁▂▃▄▅▆▇█"
ENDED = ("finished", "stopped", "failed", "hung", "dead")
STYLE = {"running": "bold green", "finished": "bold blue", "stopped": "bold yellow", "failed": "bold red",
         "hung": "bold red", "dead": "bold red", "not started": "yellow"}
# A rank with no new phase for this long (and no less than 5 heartbeats) is marked as not moving.
QUIET_S = 10.0


def sparkline(values: list[float], width: int = 32) -> str:
    """The last `width` values as block characters, scaled between their min and max."""
    values = [v for v in values if v == v and abs(v) != float("inf")][-width:]
    if not values:
        return ""
    lo, hi = min(values), max(values)
    if hi - lo < 1e-12:
        return SPARKS[3] * len(values)
    return "".join(SPARKS[min(7, int((v - lo) / (hi - lo) * 8))] for v in values)


def duration(seconds: float) -> str:
    seconds = int(max(0, seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s" if m else f"{s}s"


def eta_s(view: RunView) -> float | None:
    """Seconds to the last step at the pace of the latest records (one attempt: times that go back
    or steps that repeat after a resume start the window afresh)."""
    recent = []
    for rec in view.metrics:
        t = rec.get("time")
        if not isinstance(t, (int, float)):
            continue
        if recent and (t <= recent[-1][1] or rec["step"] <= recent[-1][0]):
            recent = []
        recent.append((rec["step"], t))
    recent = recent[-6:]
    if len(recent) < 2 or not view.target:
        return None
    (s0, t0), (s1, t1) = recent[0], recent[-1]
    per_step = (t1 - t0) / (s1 - s0)
    return max(0, view.target - view.step) * per_step


BAD, WARN = "bold red", "yellow"


def rank_marks(view: RunView) -> dict[int, tuple[str, str, str]]:
    """What to flag per rank, as (tag, what, style): the hang report's verdict, the rank that
    failed first, a straggler, or a rank not moving now."""
    marks: dict[int, tuple[str, str, str]] = {}
    if view.hang:
        for r in view.hang.get("never_arrived", []):
            marks[r] = ("STALLED", "stalled: never reached the collective the others wait in", BAD)
        for r in view.hang.get("silent", []):
            marks[r] = ("SILENT", "stopped answering: frozen or killed", BAD)
        for r in view.hang.get("waiting", []):
            marks[r] = ("waiting", "waits in a collective for the stalled rank", WARN)
    if view.failure and isinstance(view.failure.get("first"), dict):
        first = view.failure["first"]
        marks[first.get("rank")] = ("FAILED", "failed first: " + str(first.get("error", "")), BAD)
    last = next((r for r in reversed(view.metrics) if "perf/slowest_rank" in r), None)
    ratio = float((view.config.get("watchdog") or {}).get("straggler_ratio") or 1.3)
    if last and isinstance(last.get("perf/straggler_ratio"), (int, float)) and last["perf/straggler_ratio"] > ratio:
        marks.setdefault(int(last["perf/slowest_rank"]), (
            f"slow {last['perf/straggler_ratio']:.2f}x", f"straggler: {last['perf/straggler_ratio']:.2f}x the median "
            f"compute time per step of the other ranks (step {last['step']})", WARN))
    quiet = max(QUIET_S, 5 * view.heartbeat_s)
    for r, hb in view.heartbeats.items():
        if r in marks or hb.get("status") != "running":
            continue
        idle = float(hb.get("idle_s") or 0) + view.heartbeat_age(r)
        if view.stale(r):
            marks[r] = ("NO BEAT", f"no heartbeat for {duration(view.heartbeat_age(r))}: gone?", BAD)
        elif idle > quiet:
            marks[r] = ((hb["collective"].split(" in ")[0], f"in {hb['collective']} for {duration(idle)}", WARN)
                        if hb.get("collective") else ("NO PROGRESS", f"no progress for {duration(idle)}", BAD))
    return marks


def _gib(value) -> str:
    return f"{value:.2f}" if isinstance(value, (int, float)) else "-"


def render(view: RunView):
    """One frame (a rich renderable): the header, the curves, what RL's episodes met, per-task success, the ranks."""
    from rich.console import Group
    from rich.panel import Panel
    from rich.text import Text

    parts = _header(view)
    curves = _curves(view)
    if curves.row_count:
        parts.append(Panel(curves, title="metrics (latest, curve)", title_align="left"))
    parts += _episode_lines(view) + _benchmark_lines(view)
    if view.kind.per_task:
        parts.append(_task_table(view))
    marks = rank_marks(view)
    if view.heartbeats:
        parts.append(_rank_table(view, marks))
    for r, (_, mark, style) in sorted(marks.items()):
        if r in view.heartbeats:
            hb = view.heartbeats[r]
            parts.append(Text(f"rank {r} ({hb.get('addr') or hb.get('host', '?')}, node {hb.get('node', '?')}, "
                              f"phase {hb.get('phase')} of step {hb.get('step')}): {mark}", style=style))
    return Group(*parts)


def _header(view: RunView) -> list:
    """The run, its state, progress and ETA; the progress bar; why it is not running, where it is not."""
    from rich.progress_bar import ProgressBar
    from rich.table import Table
    from rich.text import Text

    state, why = view.state()
    hosts = {hb.get("host") for hb in view.heartbeats.values()}
    head = Text()
    head.append(f"{view.path}  ", style="bold")
    head.append(f"{view.kind.name} · ")
    head.append(state.upper(), style=STYLE.get(state, ""))
    head.append(f" · {view.kind.unit} {view.step} of {view.target or '?'}")
    eta = eta_s(view) if state == "running" else None
    if eta is not None:
        head.append(f" · ETA {duration(eta)}")
    if view.heartbeats:
        head.append(f" · {len(view.heartbeats)} rank(s) on {len(hosts)} host(s)")
    parts = [head]
    if view.target:
        bar = Table.grid(padding=(0, 1))
        bar.add_row(ProgressBar(total=view.target, completed=min(view.step, view.target), width=50),
                    f"{min(view.step, view.target) / view.target:.0%}")
        parts.append(bar)
    if state != "running":  # running: the header says it all
        parts.append(Text(why, style=STYLE.get(state, "")))
    return parts


def _curves(view: RunView):
    from rich.table import Table

    curves = Table.grid(padding=(0, 2))
    curves.add_column(style="bold")
    curves.add_column(justify="right")
    curves.add_column()
    for label, key in view.kind.curves:
        _, ys = series(view.metrics, key)
        if ys:
            value = f"{ys[-1]:,.0f}" if abs(ys[-1]) >= 1000 else f"{ys[-1]:.4g}"
            curves.add_row(label, value, sparkline(ys))
    return curves


def _episode_lines(view: RunView) -> list:
    """RL: the faults that ended episodes (environments), and the rollout ranks' staleness, queue and drops."""
    from rich.text import Text

    parts = []
    faults = next((r for r in reversed(view.metrics) if "ript/env_failed_frac" in r), {})
    if any(k.startswith("ript/env_failed/") for k in faults):
        parts.append(Text(f"episodes ended by a fault at iteration {faults.get('step')}: " + ", ".join(
            f"{k.rsplit('/', 1)[1]} {v:g}" for k, v in sorted(faults.items(), key=lambda x: -x[1]
                                                                if isinstance(x[1], (int, float)) else 0)
            if k.startswith("ript/env_failed/"))))
    fed = next((r for r in reversed(view.metrics) if "async/stale_dropped" in r), {})
    if fed:
        ages = sorted((int(k.rsplit("_", 1)[1]), v) for k, v in fed.items()
                      if k.startswith("async/staleness_") and k.rsplit("_", 1)[1].isdigit())
        parts.append(Text(f"rollout ranks at iteration {fed.get('step')}: episodes by staleness "
                          + (", ".join(f"{a}: {n:g}" for a, n in ages) or "none kept")
                          + f"; batches held ahead {fed.get('async/queue_depth', 0):g}; dropped as stale "
                            f"{fed.get('async/stale_dropped', 0):g}"))
    return parts


def _benchmark_lines(view: RunView) -> list:
    """lm-evaluation-harness: the latest scoring (the benchmarks section), under the tasks' own metric names."""
    from rich.text import Text

    scored = next((r for r in reversed(view.metrics) if any(k.startswith("bench/") for k in r)), None)
    if scored is None:
        return []
    scores = ", ".join(f"{k.removeprefix('bench/')} {v:.4g}" for k, v in sorted(scored.items())
                       if k.startswith("bench/") and isinstance(v, (int, float)))
    return [Text(f"lm-eval at {view.kind.unit} {scored.get('step')}: {scores}")]


def _rank_table(view: RunView, marks: dict):
    from rich import box
    from rich.table import Table
    from rich.text import Text

    ranks = Table(title="ranks", title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False,
                  collapse_padding=True)
    for col in ("rank", "host", "step", "phase", "beat", "RSS GiB", "GPU GiB", "GPU %"):
        ranks.add_column(col, no_wrap=True, justify="left" if col in ("host", "phase") else "right")
    ranks.add_column("status", no_wrap=True)
    for r, hb in sorted(view.heartbeats.items()):
        gpu = (f"{_gib(hb.get('gpu_allocated_gib'))}/{_gib(hb.get('gpu_reserved_gib'))}"
               if hb.get("gpu_allocated_gib") is not None else "-")
        util = f"{hb['gpu_util_pct']:.0f}" if isinstance(hb.get("gpu_util_pct"), (int, float)) else "-"
        tag, _, style = marks.get(r, ("" if hb.get("status") == "running" else str(hb.get("status", "")), "", ""))
        host = hb.get("addr") or hb.get("host", "?")
        ranks.add_row(str(r), f"{host}/{hb.get('node', '?')}", str(hb.get("step", "")), str(hb.get("phase", "")),
                      f"{view.heartbeat_age(r):.0f}s", _gib(hb.get("rss_gib")), gpu, util,
                      Text(tag, style=style))
    return ranks


def _task_table(view: RunView):
    from rich.table import Table

    pattern = re.compile(r"^task/(.+)/success_rate$")
    last: dict[str, float] = {}
    for rec in view.metrics:
        for key, value in rec.items():
            m = pattern.match(key)
            if m and isinstance(value, (int, float)):
                last[m.group(1)] = value
    held = {}
    for rec in view.metrics:
        for key, value in rec.items():
            m = re.match(r"^eval/(.+)/success$", key)
            if m and isinstance(value, (int, float)):
                held.setdefault(m.group(1), []).append(value)
    from rich import box

    table = Table(title="tasks", title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    for col in ("task", "success (rollouts)", "held-out", "held-out curve"):
        table.add_column(col, justify="left" if col in ("task", "held-out curve") else "right")
    for name in sorted(set(last) | set(held)):
        h = held.get(name, [])
        table.add_row(name, f"{last[name]:.3f}" if name in last else "-", f"{h[-1]:.3f}" if h else "-",
                      sparkline(h, 20))
    return table


def monitor(run_dir: str, interval: float = 2.0, once: bool = False) -> int:
    from pathlib import Path

    from rich.console import Console
    from rich.live import Live

    path = Path(run_dir)
    if not path.is_dir():
        raise UserError(f"monitor: {run_dir!r} is not a directory; give a run's output_dir")
    if interval <= 0:
        raise UserError(f"monitor: --interval {interval:g} must be positive")
    console = Console()
    view = read_run(path)
    if once:
        console.print(render(view))
        console.print(outcome(view), markup=False, highlight=False, soft_wrap=True)
        return 0
    watching = True
    with Live(render(view), console=console, refresh_per_second=4, screen=False) as live:
        try:
            while True:
                view = read_run(path)
                live.update(render(view))
                if view.state()[0] in ENDED:
                    break
                time.sleep(interval)
        except KeyboardInterrupt:  # Ctrl-C: the user has seen enough; the run goes on
            watching = False
    if not console.is_terminal:  # rich ends the last frame with a newline on a terminal only
        console.line()
    console.print(outcome(view) + ("" if watching else "; stopped watching (Ctrl-C), the run goes on"), markup=False,
                  highlight=False, soft_wrap=True)
    return 0


def outcome(view: RunView) -> str:
    """The monitor's last line: the run's state and why (`monitor: runs/x: finished, reached step 200`)."""
    state, why = view.state()
    return f"monitor: {view.path}: {state}, {why}"
