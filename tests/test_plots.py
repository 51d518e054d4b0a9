"""Plots: the figures' axes and series, asserted from the matplotlib objects; PNGs on disk; the
`ds-train plot` command (a finished run's own plots are asserted in test_trainer.py)."""

from __future__ import annotations

import json

from conftest import ds_train
from ds_train.checkpoint.rundir import RIPT
from ds_train.observe.plots import figures, write_plots


def train_records(scale=1.0, steps=(2, 4, 6, 8)):
    recs = []
    for i, s in enumerate(steps):
        rec = {"step": s, "train/loss": scale * (6 - i), "train/tokens": s * 512, "optim/lr": 1e-3 * (i + 1),
               "perf/tokens_per_s": 1000.0 + i, "mem/rank_rss_gib": [1.0 + i, 1.5 + i], "mem/rank_gpu_gib": [0.0, 0.0]}
        if s % 4 == 0:
            rec["eval/loss"] = scale * (6.5 - i)
        recs.append(rec)
    return recs


def lines_of(ax) -> dict[str, tuple[list, list]]:
    return {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in ax.get_lines()}


def test_training_figures_hold_the_series_against_steps_and_tokens():
    figs = figures([("run", train_records())])
    assert set(figs) == {"loss", "lr", "throughput", "memory"}
    by_step, by_tokens = figs["loss"].axes
    assert (by_step.get_xlabel(), by_step.get_ylabel()) == ("step", "loss")
    assert (by_tokens.get_xlabel(), by_tokens.get_ylabel()) == ("tokens", "loss")
    assert lines_of(by_step)["train"] == ([2, 4, 6, 8], [6.0, 5.0, 4.0, 3.0])
    assert lines_of(by_step)["eval"] == ([4, 8], [5.5, 3.5])
    assert lines_of(by_tokens)["train"][0] == [1024, 2048, 3072, 4096]
    assert lines_of(by_tokens)["eval"] == ([2048, 4096], [5.5, 3.5])
    assert lines_of(figs["lr"].axes[0])["lr"][1] == [1e-3, 2e-3, 3e-3, 4e-3]
    assert figs["throughput"].axes[0].get_ylabel() == "tokens/s (all ranks)"
    mem = lines_of(figs["memory"].axes[0])
    assert set(mem) == {"rank 0 RSS", "rank 1 RSS"}  # GPU memory all zero (a CPU run): not drawn
    assert mem["rank 1 RSS"] == ([2, 4, 6, 8], [1.5, 2.5, 3.5, 4.5])


def test_several_runs_are_overlaid_and_labelled_by_run():
    figs = figures([("a", train_records()), ("b", train_records(scale=0.5))])
    labels = set(lines_of(figs["loss"].axes[0]))
    assert labels == {"a: train", "a: eval", "b: train", "b: eval"}
    assert lines_of(figs["loss"].axes[0])["b: train"][1] == [3.0, 2.5, 2.0, 1.5]
    assert {t.get_text() for t in figs["loss"].axes[0].get_legend().get_texts()} == labels


def test_ript_figures_show_success_per_task_held_out_and_the_reward_statistics():
    recs = [{"step": 0, "eval/success": 0.25, "eval/arith/success": 0.2},
            {"step": 1, "ript/success_rate": 0.3, "task/arith/success_rate": 0.2, "task/guess/success_rate": 0.4,
             "ript/reward_mean": 0.3, "ript/reward_std": 0.1, "ript/frac_reward_zero_std": 0.5,
             "ript/truncated_frac": 0.25, "policy/kl": 0.01},
            {"step": 2, "ript/success_rate": 0.5, "task/arith/success_rate": 0.4, "task/guess/success_rate": 0.6,
             "eval/success": 0.5, "eval/arith/success": 0.45, "ript/reward_mean": 0.5, "ript/reward_std": 0.2,
             "ript/frac_reward_zero_std": 0.25, "ript/truncated_frac": 0.0, "policy/kl": 0.02}]
    figs = figures([("r", recs)], kind=RIPT)
    assert set(figs) == {"success", "heldout", "rewards"}
    top, bottom = (lines_of(ax) for ax in figs["rewards"].axes)
    assert top["reward mean"] == ([1, 2], [0.3, 0.5])
    assert bottom["groups with equal rewards"] == ([1, 2], [0.5, 0.25])
    assert bottom["truncated rollouts"] == ([1, 2], [0.25, 0.0]) and bottom["KL to the reference"] == ([1, 2], [0.01, 0.02])
    success = lines_of(figs["success"].axes[0])
    assert success["all tasks"] == ([1, 2], [0.3, 0.5]) and success["guess"] == ([1, 2], [0.4, 0.6])
    held = lines_of(figs["heldout"].axes[0])
    assert held["held-out"] == ([0, 2], [0.25, 0.5]) and held["held-out arith"] == ([0, 2], [0.2, 0.45])
    assert figs["heldout"].axes[0].get_xlabel() == "iteration"


def test_pngs_are_written(tmp_path):
    paths = write_plots([("run", train_records())], tmp_path / "plots")
    assert sorted(p.name for p in paths) == ["loss.png", "lr.png", "memory.png", "throughput.png"]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in paths)
    assert not list((tmp_path / "plots").glob(".*"))  # no temporary file left


def test_the_plot_command_overlays_runs_and_refuses_what_is_not_a_run(tmp_path):
    for name, scale in (("a", 1.0), ("b", 0.5)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in train_records(scale)))
    res = ds_train("plot", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "cmp"), timeout=120)
    assert res.returncode == 0, res.out
    assert sorted(p.name for p in (tmp_path / "cmp").iterdir()) == ["loss.png", "lr.png", "memory.png", "throughput.png"]
    assert res.out.strip().splitlines()[-1] == "plot: wrote " + ", ".join(
        str(tmp_path / "cmp" / f"{name}.png") for name in ("loss", "lr", "throughput", "memory"))
    one = ds_train("plot", str(tmp_path / "a"), timeout=120)
    assert one.returncode == 0 and (tmp_path / "a" / "plots" / "loss.png").is_file()
    bad = ds_train("plot", str(tmp_path / "nothing"), timeout=120)
    assert bad.returncode == 2 and "holds no metrics.jsonl records" in bad.out
