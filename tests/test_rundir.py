"""Reading a run directory from outside the run: tolerant of files being written, and the run's
state (running, finished, stopped, failed, hung, dead) from its records alone."""

from __future__ import annotations

import fcntl
import json
import os
import time

import yaml

from ds_train.checkpoint.rundir import RIPT, TRAIN, lock_holder, read_metrics, read_run, series


def make_run(path, steps=(10, 20), target=40, statuses=("running", "running"), beat_age=0.0, kind="train",
             results=None, hang=None, failure=None):
    """A run directory as a run leaves it: config.yaml, env.json, metrics.jsonl, heartbeats, logs."""
    (path / "heartbeats").mkdir(parents=True)
    (path / "logs").mkdir()
    section = {"ript": {"iterations": target}} if kind == "ript" else {"train": {"max_steps": target}}
    (path / "config.yaml").write_text(yaml.safe_dump({**section, "watchdog": {"heartbeat_s": 2.0,
                                                                             "straggler_ratio": 1.3}}))
    (path / "env.json").write_text(json.dumps({"command": kind, "world_size": len(statuses)}))
    now = time.time()
    with open(path / "metrics.jsonl", "w") as fh:
        for i, s in enumerate(steps):
            fh.write(json.dumps({"step": s, "time": now - 10 * (len(steps) - i), "train/loss": 5.0 - i,
                                 "optim/lr": 1e-3, "perf/tokens_per_s": 1000.0 + i}) + "\n")
    for r, status in enumerate(statuses):
        (path / "heartbeats" / f"rank_{r}.json").write_text(json.dumps(
            {"rank": r, "node": r, "host": f"n{r}", "addr": "", "step": steps[-1] if steps else 0, "phase": "forward",
             "status": status, "position": [steps[-1] if steps else 0, 2], "idle_s": 0.1, "time": now - beat_age,
             "collective": None, "rss_gib": 1.5}))
    if results is not None:
        (path / ("ript_results.json" if kind == "ript" else "results.json")).write_text(json.dumps(results))
    for name, report in (("hang_report.json", hang), ("failure.json", failure)):
        if report is not None:
            (path / "logs" / name).write_text(json.dumps(report))
    return path


def test_metrics_survive_a_line_being_written_and_keep_non_finite_values(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "train/loss": 2.0}\n{"step": 2, "train/loss": "nan", "optim/lr": 0.1}\n'
                    '{"step": 3, "train/lo')
    recs = read_metrics(path)
    assert [r["step"] for r in recs] == [1, 2]
    assert recs[1]["train/loss"] != recs[1]["train/loss"]  # nan came back as a float
    assert series(recs, "optim/lr") == ([2], [0.1])
    assert read_metrics(tmp_path / "missing.jsonl") == []


def test_the_state_of_a_run_from_its_records(tmp_path):
    running = read_run(make_run(tmp_path / "a"))
    assert running.state() == ("running", "step 20 of 40") and running.kind == TRAIN and running.step == 20
    done = read_run(make_run(tmp_path / "b", steps=(20, 40), statuses=("ended", "ended"), results={"steps": 40}))
    assert done.state() == ("finished", "reached step 40")
    stopped = make_run(tmp_path / "c", statuses=("stopped", "stopped"))
    (stopped / "checkpoints").mkdir()
    (stopped / "checkpoints" / "latest").write_text("step_00000020")
    state, why = read_run(stopped).state()
    assert state == "stopped" and "checkpoint step_00000020 saved" in why
    dead_state, why = read_run(make_run(tmp_path / "d", beat_age=120)).state()
    assert dead_state == "dead" and "no heartbeat from rank(s) 0, 1 for 120 s" in why
    hung = read_run(make_run(tmp_path / "e", hang={"kind": "hang", "line": "hang: no progress for 6 s", "never_arrived": [1]}))
    assert hung.state() == ("hung", "hang: no progress for 6 s")
    failed = read_run(make_run(tmp_path / "f", failure={"kind": "failure", "line": "rank 1 on node 1 (n1) failed first"}))
    assert failed.state()[0] == "failed"
    ript = read_run(make_run(tmp_path / "g", kind="ript", target=5, steps=(5,), statuses=("ended",),
                             results={"iteration": 5}))
    assert ript.kind == RIPT and ript.target == 5 and ript.state() == ("finished", "reached iteration 5")
    assert read_run(tmp_path / "nothing").state()[0] == "not started"


def test_a_report_of_an_earlier_attempt_does_not_mark_a_resumed_run(tmp_path):
    run = make_run(tmp_path / "r", hang={"kind": "hang", "line": "hang: earlier", "never_arrived": [1]})
    old = time.time() - 100
    os.utime(run / "logs" / "hang_report.json", (old, old))  # the attempt that hung
    assert read_run(run).state()[0] == "running"  # env.json (this attempt) is newer


def test_a_run_holding_its_directory_lock_is_not_called_dead(tmp_path):
    run = make_run(tmp_path / "r", beat_age=120)
    assert lock_holder(run) is None
    with open(run / ".ds_train.lock", "w") as fh:
        fh.write("pid 1 on n0 since now")
        fh.flush()
        fcntl.flock(fh, fcntl.LOCK_EX)
        view = read_run(run)
        assert view.holder == "pid 1 on n0 since now" and view.state()[0] == "running"
    assert read_run(run).state()[0] == "dead"


def test_one_layout_names_every_file_for_the_writers_and_the_readers(tmp_path):
    from ds_train.checkpoint.rundir import KINDS, RunPaths

    paths = RunPaths(tmp_path)
    assert paths.metrics == tmp_path / "metrics.jsonl" and paths.rank_log(3) == tmp_path / "logs" / "rank_3.log"
    assert paths.heartbeat(1) == tmp_path / "heartbeats" / "rank_1.json" and paths.latest.parent == paths.checkpoints
    assert {paths.results(k).name for k in KINDS.values()} == {"results.json", "ript_results.json"}
    named = {getattr(paths, a) for a in dir(RunPaths) if isinstance(getattr(RunPaths, a), property)}
    named |= {paths.results(k) for k in KINDS.values()}
    assert {tmp_path / name for name in RunPaths.ENTRIES} <= named  # every entry the run checks has a path
    # the readers take the kind from env.json: its unit, its last step, what the monitor shows
    assert KINDS["ript"].last({"ript": {"iterations": 7}}) == 7 and KINDS["train"].last({"train": {}}) == 0
    assert KINDS["train"].unit == "step" and KINDS["ript"].per_task and not KINDS["train"].per_task
