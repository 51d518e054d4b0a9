"""Plots of one run or several overlaid, from their metrics.jsonl (matplotlib, headless).

Training: loss and eval loss against steps and tokens, lr, tokens/s, memory per rank. RIPT:
success per task and held-out success against iterations. `figures` builds the figures (tests read
their axes and lines); `write_plots` saves them as PNGs.
"""

from __future__ import annotations

import re
from pathlib import Path

from ds_train.checkpoint.rundir import TRAIN, RunKind, series

TASK_SUCCESS = re.compile(r"^task/(.+)/success_rate$")
HELDOUT_TASK = re.compile(r"^eval/(.+)/success$")
BENCH = re.compile(r"^bench/(.+)$")  # lm-evaluation-harness scores: bench/<task>/<metric>,<filter>


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


class _Plotter:
    """Figures of runs given as (label, metrics records), several overlaid."""

    def __init__(self, runs: list[tuple[str, list[dict]]]):
        self.plt, self.runs, self.labelled = _pyplot(), runs, len(runs) > 1

    def name(self, label: str, what: str) -> str:
        return f"{label}: {what}" if self.labelled else what

    @staticmethod
    def line(ax, xs, ys, label, **kw) -> None:
        if xs:
            ax.plot(xs, ys, label=label, marker="." if len(xs) < 30 else None, **kw)

    @staticmethod
    def finish(fig, axes, title: str):
        for ax in axes:
            if ax.get_lines():
                ax.legend(fontsize="small")
            ax.grid(alpha=0.3)
        fig.suptitle(title)
        fig.tight_layout()
        return fig

    def loss(self):
        fig, (by_step, by_tokens) = self.plt.subplots(1, 2, figsize=(11, 4))
        for label, recs in self.runs:
            self.line(by_step, *series(recs, "train/loss"), self.name(label, "train"))
            self.line(by_step, *series(recs, "eval/loss"), self.name(label, "eval"), linestyle="--")
            self.line(by_tokens, *series(recs, "train/loss", x="train/tokens"), self.name(label, "train"))
            eval_x = {r["step"]: r.get("train/tokens") for r in recs}
            steps, losses = series(recs, "eval/loss")
            tokens = [eval_x.get(s) for s in steps]
            self.line(by_tokens, [t for t in tokens if t is not None],
                      [l for t, l in zip(tokens, losses) if t is not None], self.name(label, "eval"), linestyle="--")
        by_step.set(xlabel="step", ylabel="loss")
        by_tokens.set(xlabel="tokens", ylabel="loss")
        return self.finish(fig, [by_step, by_tokens], "loss")

    def _one(self, key: str, what: str, ylabel: str, title: str):
        fig, ax = self.plt.subplots(figsize=(7, 4))
        for label, recs in self.runs:
            self.line(ax, *series(recs, key), self.name(label, what))
        ax.set(xlabel="step", ylabel=ylabel)
        return self.finish(fig, [ax], title)

    def lr(self):
        return self._one("optim/lr", "lr", "learning rate", "learning rate")

    def throughput(self):
        return self._one("perf/tokens_per_s", "tokens/s", "tokens/s (all ranks)", "throughput")

    def memory(self):
        fig, ax = self.plt.subplots(figsize=(7, 4))
        for label, recs in self.runs:
            for key, what in (("mem/rank_gpu_gib", "GPU"), ("mem/rank_rss_gib", "RSS")):
                for rank, (xs, ys) in sorted(_rank_series(recs, key).items()):
                    if what == "RSS" or any(ys):
                        self.line(ax, xs, ys, self.name(label, f"rank {rank} {what}"))
            if not _rank_series(recs, "mem/rank_rss_gib"):  # older runs: the maximum over ranks only
                self.line(ax, *series(recs, "mem/max_rank_rss_gib"), self.name(label, "max over ranks RSS"))
        ax.set(xlabel="step", ylabel="GiB")
        return self.finish(fig, [ax], "memory per rank")

    def experts(self):
        """A mixture-of-experts run's router load per layer (None for a dense run: no figure)."""
        if not any(r.get("moe/layer_load_max_mean") for _, recs in self.runs for r in recs):
            return None
        fig, (top, bottom) = self.plt.subplots(2, 1, figsize=(7, 6), sharex=True)
        for label, recs in self.runs:
            layers = max((len(r.get("moe/layer_load_max_mean") or []) for r in recs), default=0)
            for layer in range(layers):
                logged = [r for r in recs if len(r.get("moe/layer_load_max_mean") or []) > layer]
                self.line(top, [r["step"] for r in logged], [r["moe/layer_load_max_mean"][layer] for r in logged],
                          self.name(label, f"layer {layer}"))
            self.line(bottom, *series(recs, "moe/aux_loss"), self.name(label, "aux loss"))
        top.set(ylabel="busiest expert's load / mean (1: balanced)")
        bottom.set(xlabel="step", ylabel="router aux loss")
        return self.finish(fig, [top, bottom], "mixture of experts: router load per layer")

    def success(self):
        fig, ax = self.plt.subplots(figsize=(7, 4))
        for label, recs in self.runs:
            self.line(ax, *series(recs, "ript/success_rate"), self.name(label, "all tasks"), linewidth=2)
            for key in _keys(recs, TASK_SUCCESS):
                self.line(ax, *series(recs, key), self.name(label, TASK_SUCCESS.match(key).group(1)))
        ax.set(xlabel="iteration", ylabel="success rate (rollouts)", ylim=(-0.02, 1.02))
        return self.finish(fig, [ax], "RIPT: rollout success per task")

    def heldout(self):
        fig, ax = self.plt.subplots(figsize=(7, 4))
        for label, recs in self.runs:
            self.line(ax, *series(recs, "eval/success"), self.name(label, "held-out"), linewidth=2)
            for key in _keys(recs, HELDOUT_TASK):
                self.line(ax, *series(recs, key), self.name(label, f"held-out {HELDOUT_TASK.match(key).group(1)}"),
                          linestyle="--")
        ax.set(xlabel="iteration", ylabel="success rate (held-out)", ylim=(-0.02, 1.02))
        return self.finish(fig, [ax], "RIPT: held-out success")


    def rewards(self):
        fig, (top, bottom) = self.plt.subplots(2, 1, figsize=(7, 6), sharex=True)
        for label, recs in self.runs:
            xs, mean = series(recs, "ript/reward_mean")
            _, std = series(recs, "ript/reward_std")
            self.line(top, xs, mean, self.name(label, "reward mean"), linewidth=2)
            if len(std) == len(mean) and mean:
                top.fill_between(xs, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)],
                                 alpha=0.2)
            for key, what in (("ript/frac_reward_zero_std", "groups with equal rewards"),
                              ("ript/truncated_frac", "truncated rollouts"), ("policy/kl", "KL to the reference")):
                self.line(bottom, *series(recs, key), self.name(label, what))
        top.set(ylabel="reward (rollouts; band: +- std)")
        bottom.set(xlabel="iteration", ylabel="fraction / KL per token")
        return self.finish(fig, [top, bottom], "post-training: rewards, filtering, truncation, KL")


    def benchmarks(self):
        """lm-evaluation-harness scores by step (None where the run scored none: no figure)."""
        if not any(_keys(recs, BENCH) for _, recs in self.runs):
            return None
        fig, ax = self.plt.subplots(figsize=(7, 4))
        for label, recs in self.runs:
            for key in _keys(recs, BENCH):
                self.line(ax, *series(recs, key), self.name(label, BENCH.match(key).group(1)))
        ax.set(xlabel="step or iteration", ylabel="score (lm-eval)")
        return self.finish(fig, [ax], "lm-evaluation-harness: the live model's scores")


FIGURES = ("loss", "lr", "throughput", "memory", "experts", "success", "heldout", "rewards",
           "benchmarks")  # what a RunKind may name


def figures(runs: list[tuple[str, list[dict]]], kind: RunKind = TRAIN) -> dict:
    """{name: Figure} of the kind's figures for runs given as (label, metrics records); several
    runs are overlaid."""
    plotter = _Plotter(runs)
    drawn = {name: getattr(plotter, name)() for name in kind.figures}
    return {name: fig for name, fig in drawn.items() if fig is not None}  # None: nothing to draw (a dense run)


def write_plots(runs: list[tuple[str, list[dict]]], out_dir: Path, kind: RunKind = TRAIN) -> list[Path]:
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
