"""ds-train monitor: the frame it draws from a run directory (the live 2-process runs it watches
are in test_watchdog.py)."""

from __future__ import annotations

import json

from conftest import ds_train
from ds_train.checkpoint.rundir import read_run
from ds_train.observe.monitor import duration, eta_s, rank_marks, render, sparkline
from test_rundir import make_run


def frame(path, width=120) -> str:
    from rich.console import Console

    console = Console(width=width, record=True, file=open("/dev/null", "w"))
    console.print(render(read_run(path)))
    return console.export_text()


def test_sparkline_and_duration():
    assert sparkline([1, 2, 3, 4]) == "▁▃▆█"
    assert sparkline([2, 2]) == "▄▄" and sparkline([]) == ""
    assert sparkline([1.0, float("nan"), 3.0]) == "▁█"
    assert len(sparkline(list(range(100)), width=10)) == 10
    assert (duration(59), duration(61), duration(3700)) == ("59s", "1m01s", "1h01m")


def test_eta_from_the_pace_of_the_latest_records(tmp_path):
    view = read_run(make_run(tmp_path / "r", steps=(10, 20, 30), target=50))  # 10 s per 10 steps
    assert abs(eta_s(view) - 20.0) < 0.5
    recs = view.metrics
    recs.append({**recs[0], "step": 12, "time": recs[-1]["time"] + 5})  # a resume: steps go back
    assert eta_s(view) is None


def test_a_running_run_shows_progress_curves_and_every_rank(tmp_path):
    run = make_run(tmp_path / "run", steps=(10, 20), target=40)
    text = frame(run)
    assert "RUNNING" in text and "step 20 of 40" in text and "ETA " in text
    assert "50%" in text
    curves = {line.split()[1]: line.split()[2:-1] for line in text.splitlines() if line.startswith("│ ")}
    assert curves["loss"] == ["4", "█▁"] and curves["tokens/s"] == ["1,001", "▁█"], text
    rows = [line.split() for line in text.splitlines() if line.strip().startswith(("0 ", "1 "))]
    assert [(r[0], r[1]) for r in rows] == [("0", "n0/0"), ("1", "n1/1")], text


def test_stalled_waiting_and_straggling_ranks_are_marked(tmp_path):
    hang = {"kind": "hang", "line": "hang: no progress for 6 s (watchdog.stall_s): rank 1 ...",
            "never_arrived": [1], "waiting": [0], "silent": []}
    text = frame(make_run(tmp_path / "h", hang=hang))
    assert "HUNG" in text and "hang: no progress for 6 s" in text
    assert "STALLED" in text and "rank 1 (n1, node 1, phase forward of step 20): stalled" in text
    assert "rank 0 (n0, node 0, phase forward of step 20): waits in a collective" in text

    run = make_run(tmp_path / "s")
    with open(run / "metrics.jsonl", "a") as fh:
        fh.write(json.dumps({"step": 21, "perf/slowest_rank": 1, "perf/straggler_ratio": 2.5}) + "\n")
    marks = rank_marks(read_run(run))
    assert marks[1][0] == "slow 2.50x" and 0 not in marks

    quiet = make_run(tmp_path / "q")
    beat = json.loads((quiet / "heartbeats" / "rank_1.json").read_text())
    (quiet / "heartbeats" / "rank_1.json").write_text(json.dumps({**beat, "idle_s": 45.0}))
    beat0 = json.loads((quiet / "heartbeats" / "rank_0.json").read_text())
    (quiet / "heartbeats" / "rank_0.json").write_text(json.dumps(
        {**beat0, "idle_s": 44.0, "collective": "all_reduce in deepspeed/runtime/engine.py:2100 (allreduce_bucket)"}))
    marks = rank_marks(read_run(quiet))
    assert marks[1][0] == "NO PROGRESS" and marks[0][0] == "all_reduce"


def test_once_prints_one_frame_and_a_dead_run_says_why(tmp_path):
    run = make_run(tmp_path / "run", beat_age=300)
    res = ds_train("monitor", str(run), "--once", timeout=60)
    assert res.returncode == 0, res.out
    assert "DEAD" in res.out and "no heartbeat from rank(s) 0, 1" in res.out
    assert res.out.strip().splitlines()[-1].startswith(f"monitor: {run}: dead, no heartbeat from rank(s) 0, 1 for ")
    done = make_run(tmp_path / "done", steps=(10, 20), target=20, statuses=("ended", "ended"), results={"steps": 20})
    res = ds_train("monitor", str(done), "--interval", "0.1", timeout=60)  # live: ends when the run has ended
    assert res.returncode == 0 and res.out.strip().splitlines()[-1] == f"monitor: {done}: finished, reached step 20"
    bad = ds_train("monitor", str(tmp_path / "missing"), "--once", timeout=60)
    assert bad.returncode == 2 and "is not a directory; give a run's output_dir" in bad.out


def test_ript_runs_show_success_per_task_and_the_reward_statistics(tmp_path):
    run = make_run(tmp_path / "r", kind="ript", target=6, steps=(2,), statuses=("running",))
    with open(run / "metrics.jsonl", "a") as fh:
        for it, (a, b) in enumerate([(0.2, 0.5), (0.4, 0.75)], start=3):
            fh.write(json.dumps({"step": it, "ript/success_rate": (a + b) / 2, "task/arith/success_rate": a,
                                 "task/guess/success_rate": b, "eval/success": a, "eval/arith/success": a,
                                 "ript/reward_mean": a + 0.01, "ript/reward_std": 0.3, "ript/frac_reward_zero_std": b,
                                 "ript/truncated_frac": 0.125, "policy/kl": 0.0625}) + "\n")
    text = frame(run)
    assert "ript" in text and "iteration 4 of 6" in text
    curves = {label: line for label in ("reward mean", "reward std", "zero-std groups", "truncated", "KL")
              for line in text.splitlines() if line.strip("│ ").startswith(label)}
    assert "0.41" in curves["reward mean"] and "0.75" in curves["zero-std groups"], text
    assert "0.125" in curves["truncated"] and "0.0625" in curves["KL"], text
    task_rows = {line.split()[0]: line.split()[1:] for line in text.splitlines() if line.strip().startswith(("arith", "guess"))}
    assert task_rows["arith"][:2] == ["0.400", "0.400"] and task_rows["guess"][:2] == ["0.750", "-"], text


def test_an_environment_runs_turns_tool_calls_faults_and_time_in_environments_show():
    import tempfile
    from pathlib import Path

    tmp = Path(tempfile.mkdtemp())
    run = make_run(tmp / "r", kind="ript", target=6, steps=(2,), statuses=("running",))
    with open(run / "metrics.jsonl", "a") as fh:
        fh.write(json.dumps({"step": 3, "ript/success_rate": 0.25, "ript/turns_mean": 2.5, "ript/tool_calls_mean": 1.25,
                             "ript/env_failed_frac": 0.375, "ript/env_failed/tool_error": 2,
                             "ript/env_failed/malformed_call": 4, "perf/env_frac": 0.125}) + "\n")
    text = frame(run)
    curves = {label: line for label in ("turns / episode", "tool calls / episode", "ended by a fault",
                                        "time in environments")
              for line in text.splitlines() if line.strip("│ ").startswith(label)}
    assert "2.5" in curves["turns / episode"] and "1.25" in curves["tool calls / episode"], text
    assert "0.375" in curves["ended by a fault"] and "0.125" in curves["time in environments"], text
    assert "episodes ended by a fault at iteration 3: malformed_call 4, tool_error 2" in text, text


def test_rollout_ranks_staleness_waits_queue_and_weights_show():
    """Asynchronous RL (ript.rollout_ranks_per_node): the staleness, each side's wait, the weights' send time as
    curves; the episodes by staleness, the batches held ahead and the stale drops of the last log in a line."""
    import tempfile
    from pathlib import Path

    tmp = Path(tempfile.mkdtemp())
    run = make_run(tmp / "r", kind="ript", target=6, steps=(2,), statuses=("running",))
    with open(run / "metrics.jsonl", "a") as fh:
        for step, wait in ((3, 0.5), (4, 0.25)):
            fh.write(json.dumps({"step": step, "ript/success_rate": 0.25, "async/staleness_mean": 1.0,
                                 "async/staleness_max": 1.0, "async/staleness_1": 16.0, "async/stale_dropped": 8.0,
                                 "async/trainer_wait_s": wait, "async/rollout_wait_s": 0.125,
                                 "async/queue_depth": 1.0, "async/weights_send_s": 0.0625}) + "\n")
    text = frame(run)
    curves = {label: line for label in ("staleness (updates)", "trainers waited (s)", "rollout ranks waited (s)",
                                        "weights sent (s)") for line in text.splitlines()
              if line.strip("│ ").startswith(label)}
    assert "0.25" in curves["trainers waited (s)"] and "0.125" in curves["rollout ranks waited (s)"], text
    assert "1" in curves["staleness (updates)"] and "0.0625" in curves["weights sent (s)"], text
    assert ("rollout ranks at iteration 4: episodes by staleness 1: 16; batches held ahead 1; dropped as stale 8"
            in " ".join(text.split())), text
