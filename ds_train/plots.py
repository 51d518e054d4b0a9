"""Plots of one run or several overlaid, from their metrics.jsonl (matplotlib, headless).

Training: loss and eval loss against steps and tokens, lr, tokens/s, memory per rank. RIPT:
success per task and held-out success against iterations. `figures` builds the figures (tests read
their axes and lines); `write_plots` saves them as PNGs.
"""

from __future__ import annotations

import re
from pathlib import Path

from ds_train.rundir import series

TASK_SUCCESS = re.compile(r"^task/(.+)/success_rate$")
HELDOUT_TASK = re.compile(r"^eval/(.+)/success$")


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # headless: no display on a cluster node
    import matplotlib.pyplot as plt

    return plt


def _keys(records: list[dict], pattern: re.Pattern) -> list[str]:
    return sorted({k for rec in records for k in rec if pattern.match(k)})


def _rank_series(records: list[dict], key: str) -> dict[int, tuple[list, list]]:
    """Per-rank values logged as one list per step (mem/rank_rss_gib: [rank 0, rank 1, ...])."""
    out: dict[int, tuple[list, list]] = {}
    for rec in records:
        values = rec.get(key)
        if isinstance(values, list):
            for r, v in enumerate(values):
                if isinstance(v, (int, float)):
                    xs, ys = out.setdefault(r, ([], []))
                    xs.append(rec["step"])
                    ys.append(float(v))
    return out


def figures(runs: list[tuple[str, list[dict]]], kind: str = "train") -> dict:
    """{name: Figure} for runs given as (label, metrics records); several runs are overlaid."""
    plt = _pyplot()
    figs = {}
    labelled = len(runs) > 1

    def name(label: str, what: str) -> str:
        return f"{label}: {what}" if labelled else what

    def line(ax, xs, ys, label, **kw) -> None:
        if xs:
            ax.plot(xs, ys, label=label, marker="." if len(xs) < 30 else None, **kw)

    def finish(fig, axes, title: str) -> None:
        for ax in axes:
            if ax.get_lines():
                ax.legend(fontsize="small")
            ax.grid(alpha=0.3)
        fig.suptitle(title)
        fig.tight_layout()

    if kind == "ript":
        fig, ax = plt.subplots(figsize=(7, 4))
        for label, recs in runs:
            line(ax, *series(recs, "ript/success_rate"), name(label, "all tasks"), linewidth=2)
            for key in _keys(recs, TASK_SUCCESS):
                line(ax, *series(recs, key), name(label, TASK_SUCCESS.match(key).group(1)))
        ax.set(xlabel="iteration", ylabel="success rate (rollouts)", ylim=(-0.02, 1.02))
        finish(fig, [ax], "RIPT: rollout success per task")
        figs["success"] = fig
        fig, ax = plt.subplots(figsize=(7, 4))
        for label, recs in runs:
            line(ax, *series(recs, "eval/success"), name(label, "held-out"), linewidth=2)
            for key in _keys(recs, HELDOUT_TASK):
                line(ax, *series(recs, key), name(label, f"held-out {HELDOUT_TASK.match(key).group(1)}"),
                     linestyle="--")
        ax.set(xlabel="iteration", ylabel="success rate (held-out)", ylim=(-0.02, 1.02))
        finish(fig, [ax], "RIPT: held-out success")
        figs["heldout"] = fig
        return figs

    fig, (by_step, by_tokens) = plt.subplots(1, 2, figsize=(11, 4))
    for label, recs in runs:
        line(by_step, *series(recs, "train/loss"), name(label, "train"))
        line(by_step, *series(recs, "eval/loss"), name(label, "eval"), linestyle="--")
        line(by_tokens, *series(recs, "train/loss", x="train/tokens"), name(label, "train"))
        eval_x = {r["step"]: r.get("train/tokens") for r in recs}
        steps, losses = series(recs, "eval/loss")
        tokens = [eval_x.get(s) for s in steps]
        line(by_tokens, [t for t in tokens if t is not None], [l for t, l in zip(tokens, losses) if t is not None],
             name(label, "eval"), linestyle="--")
    by_step.set(xlabel="step", ylabel="loss")
    by_tokens.set(xlabel="tokens", ylabel="loss")
    finish(fig, [by_step, by_tokens], "loss")
    figs["loss"] = fig

    for fig_name, key, what, ylabel, title in (("lr", "optim/lr", "lr", "learning rate", "learning rate"),
                                               ("throughput", "perf/tokens_per_s", "tokens/s",
                                                "tokens/s (all ranks)", "throughput")):
        fig, ax = plt.subplots(figsize=(7, 4))
        for label, recs in runs:
            line(ax, *series(recs, key), name(label, what))
        ax.set(xlabel="step", ylabel=ylabel)
        finish(fig, [ax], title)
        figs[fig_name] = fig

    fig, ax = plt.subplots(figsize=(7, 4))
    for label, recs in runs:
        for key, what in (("mem/rank_gpu_gib", "GPU"), ("mem/rank_rss_gib", "RSS")):
            for rank, (xs, ys) in sorted(_rank_series(recs, key).items()):
                if what == "RSS" or any(ys):
                    line(ax, xs, ys, name(label, f"rank {rank} {what}"))
        if not _rank_series(recs, "mem/rank_rss_gib"):  # older runs: the maximum over ranks only
            line(ax, *series(recs, "mem/max_rank_rss_gib"), name(label, "max over ranks RSS"))
    ax.set(xlabel="step", ylabel="GiB")
    finish(fig, [ax], "memory per rank")
    figs["memory"] = fig
    return figs


def write_plots(runs: list[tuple[str, list[dict]]], out_dir: Path, kind: str = "train") -> list[Path]:
    """PNG files, one per figure, in out_dir."""
    plt = _pyplot()
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for fig_name, fig in figures(runs, kind).items():
        path = out_dir / f"{fig_name}.png"
        tmp = path.with_name(f".{path.name}.tmp.png")
        fig.savefig(tmp, dpi=100)
        tmp.replace(path)
        plt.close(fig)
        paths.append(path)
    return paths
