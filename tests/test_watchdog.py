"""The watchdog: heartbeats, fault injection, and hangs, stragglers and failures through the real
deepspeed launcher with 2 processes (watchdog.debug_fault). The reports themselves: test_reports.py."""

from __future__ import annotations

import json
import re
import socket
import time

import pytest

from conftest import ROOT, deepspeed_args, deepspeed_train, reap, spawn, tiny_config, write_config
from ds_train.checkpoint.rundir import read_metrics
from ds_train.observe.doctor import diagnose
from test_monitor import frame


def test_a_heartbeat_file_is_written_and_a_stall_in_one_process_is_reported(tmp_path):
    """One process, no store: the watchdog writes the heartbeat, and a stall ends the process with
    exit 5, its stacks and the report (in a child process, since the watchdog ends it). A scoring longer than
    stall_s, waiting for rank 0's lm-eval scores, is not one."""
    import subprocess
    import sys

    code = f"""
import time
from pathlib import Path
from ds_train.checkpoint.rundir import RunPaths
from ds_train.observe.watchdog import Heartbeat, Watchdog
hb = Heartbeat(0, 0, "h0")
w = Watchdog(hb, RunPaths({str(tmp_path)!r}), 1, stall_s=1.5, heartbeat_s=0.2).start()
hb.beat(1, "data")
w.arm()
hb.beat(1, "wait-scores")
time.sleep(2.5)  # waiting past stall_s for rank 0's lm-eval scores: untimed
hb.beat(1, "forward")
def stuck_in_forward():
    time.sleep(30)
stuck_in_forward()
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 5, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("ds-train: error: hang: no progress for 1.5 s (watchdog.stall_s): rank 0 on node 0 (h0) "
                           "stalled in phase forward of step 1"), last
    stacks = (tmp_path / "logs" / "stacks_rank_0.txt").read_text()
    assert "in stuck_in_forward" in stacks and "--- thread MainThread ---" in stacks
    beat = json.loads((tmp_path / "heartbeats" / "rank_0.json").read_text())
    assert beat["status"] == "hang" and beat["phase"] == "forward" and beat["step"] == 1 and beat["rss_gib"] > 0
    assert json.loads((tmp_path / "logs" / "hang_report.json").read_text())["never_arrived"] == [0]


# --- through the launcher ----------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_stalled_rank_is_named_with_its_stack_and_the_job_ends_in_time(tiny_data, tmp_path):
    """Rank 1 stops at step 4 (before its forward); rank 0 goes on into backward and waits in the
    gradient all-reduce. Within stall_s + 30 s the job ends with exit 5 and a report that tells the
    rank that never arrived from the one waiting in the collective."""
    cfg = write_config(tmp_path / "run.yaml", tiny_config(tiny_data, tmp_path / "run", train={"max_steps": 50}))
    stall_s = 6
    res = deepspeed_train(cfg, "zero2.json", f"watchdog.stall_s={stall_s}", "watchdog.debug_fault=stall:1:4",
                          timeout=200)  # start-up, 4 steps, stall_s and the report; a job that hangs fails here
    assert res.returncode == 5, res.out[-4000:]
    run, host = tmp_path / "run", socket.gethostname()
    report = [line for line in res.out.splitlines() if line.startswith("ds-train: error: hang")]
    assert len(report) == 1, res.out[-4000:]
    assert report[0].startswith(f"ds-train: error: hang: no progress for {stall_s} s (watchdog.stall_s): rank 1 on "
                                f"node 0 ({host}) stalled in phase data of step 4"), report[0]
    assert f"Waiting for it: rank 0 on node 0 ({host}) waits in all_reduce in deepspeed/runtime/zero/" in report[0]
    stacks1 = (run / "logs" / "stacks_rank_1.txt").read_text()
    assert "in _injected_stall" in stacks1 and "in train_loop" in stacks1 and "a collective: no" in stacks1
    stacks0 = (run / "logs" / "stacks_rank_0.txt").read_text()
    assert re.search(r"in a collective: all_reduce in deepspeed/runtime/zero/\S+ \(\w+\)", stacks0), stacks0[:500]
    assert "in all_reduce" in stacks0 and "in backward" in stacks0
    beats = {r: json.loads((run / "heartbeats" / f"rank_{r}.json").read_text()) for r in (0, 1)}
    assert beats[0]["status"] == beats[1]["status"] == "hang"
    assert beats[1]["step"] == 4 and beats[1]["phase"] == "data" and beats[0]["phase"] == "backward"
    hang = json.loads((run / "logs" / "hang_report.json").read_text())
    assert hang["never_arrived"] == [1] and hang["waiting"] == [0] and hang["silent"] == []
    # logs on disk: each rank's console output, timestamped with host and rank; rank 0's console
    rank0 = (run / "logs" / "rank_0.log").read_text()
    assert re.search(rf"^\d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{{3}} {host} rank0 out: step 3: train/loss", rank0, re.M)
    assert re.search(rf"^\S+ \S+ {host} rank0 err: ds-train: error: hang", rank0, re.M)
    assert re.search(rf"^\S+ \S+ {host} rank1 log: pid \d+ host {host}", (run / "logs" / "rank_1.log").read_text(),
                     re.M)
    console = (run / "logs" / "train.log").read_text().splitlines()
    assert "step 3: train/loss" in "\n".join(console) and console[-1] == report[0]
    assert console[-2] == f"diagnose: ds-train doctor {run}   (what went wrong, and what to do)"
    # what the monitor and the doctor make of it, from the directory alone
    text = frame(run)
    assert "HUNG" in text and f"rank 1 ({host}, node 0, phase data of step 4): stalled" in text, text
    assert re.search(r"^\s*1\s+\S+\s+4\s+data\s+\d+s\s+[\d.]+\s+-\s+-\s+STALLED$", text, re.M), text
    findings = diagnose(str(run))
    assert findings[0].cls == "hang" and findings[0].where == f"rank 1 on {host}", findings


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_process_group_timeout_fires_and_names_the_collective_and_the_rank_it_waited_for(tiny_data, tmp_path):
    """The watchdog off (stall_s=0), dist.timeout_s=10: rank 1 stops at step 3 and rank 0 waits in
    the gradient all-reduce (a group DeepSpeed made after start-up, which took torch's 30-minute
    default before: the timeout never fired). 10 s later it fires; the job ends with one line
    naming the timeout, the collective and where rank 1 was, and no traceback."""
    cfg = write_config(tmp_path / "run.yaml", tiny_config(tiny_data, tmp_path / "run", train={"max_steps": 50},
                                                          watchdog={"stall_s": 0}, dist={"timeout_s": 10}))
    res = deepspeed_train(cfg, "zero2.json", "watchdog.debug_fault=stall:1:3", timeout=150)
    assert res.returncode == 1, res.out[-4000:]
    host, run = socket.gethostname(), tmp_path / "run"
    assert "Traceback" not in res.out, res.out[-4000:]
    lines = res.out.splitlines()
    i = max(j for j, line in enumerate(lines) if line.startswith("ds-train"))
    last = lines[i - 1:i + 1]  # the doctor's pointer, then the line that says how the job ended
    assert last[1].startswith(f"ds-train: error: the process-group timeout fired: rank 0 on node 0 ({host}) waited "
                              f"10 s (dist.timeout_s) in all_reduce in deepspeed/runtime/zero/"), res.out[-3000:]
    assert (f"at step 3; the rank(s) it waited for: rank 1 on node 0 ({host}) in phase data of step 3, not in a "
            f"collective") in last[1]
    assert last[0] == f"diagnose: ds-train doctor {run}   (what went wrong, and what to do)"
    assert (run / "logs" / "train.log").read_text().splitlines()[-1] == last[1]  # rank 0's console ends with it
    failure = json.loads((run / "logs" / "failure.json").read_text())
    assert (failure["kind"], failure["timeout_s"], failure["rank"], failure["step"]) == ("timeout", 10, 0, 3)
    assert failure["collective"].startswith("all_reduce in deepspeed/runtime/zero/")
    findings = diagnose(str(run))
    assert findings[0].cls == "nccl_timeout" and "the process-group timeout fired" in findings[0].evidence[0]


@pytest.mark.alone
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_slow_rank_is_reported_as_a_straggler_and_an_even_run_reports_none(tiny_data, tmp_path):
    """Steps 1-8 even; from step 9 rank 1 sleeps 0.3 s in its data phase every step. Logging every
    4 steps: the first window (one-time costs) is never reported, the even one (step 8) reports
    none, the slow ones name rank 1 with its ratio in the console, its log and the metrics.
    watchdog.straggler_ratio=2: tiny CPU steps of two ranks sharing two cores (and the test) jitter
    by 30% under load, so the default 1.3 would flag noise here; the slowed rank is 3x and more."""
    run = tmp_path / "run"
    cfg = write_config(tmp_path / "run.yaml", tiny_config(tiny_data, run, train={"max_steps": 16},
                                                          log={"every": 4}))
    proc = spawn(deepspeed_args(cfg, "zero2.json", "watchdog.debug_fault=slow:1:0.3:9", "watchdog.straggler_ratio=2"))
    live = ""
    try:  # `ds-train monitor` on the live run: both ranks, the straggler marked
        deadline = time.monotonic() + 180
        while proc.poll() is None and time.monotonic() < deadline and "slow " not in live:
            time.sleep(0.3)
            if any(r["step"] == 12 for r in read_metrics(run / "metrics.jsonl")):
                live = frame(run)
    finally:
        res = reap(proc, 200)
    assert res.returncode == 0, res.out[-4000:]
    assert "RUNNING" in live and re.search(r"^\s*0\s+\S+/0\s+\d+\s", live, re.M), live
    assert re.search(r"^\s*1\s+\S+/0\s+\d+\s.*slow [\d.]+x$", live, re.M), live
    assert "FINISHED" in frame(run)
    host = socket.gethostname()
    lines = [line for line in res.out.splitlines() if "straggler:" in line]
    assert [line.split(":")[0] for line in lines] == ["step 12", "step 16"], res.out[-3000:]
    m = re.fullmatch(rf"step 12: straggler: rank 1 on node 0 \({host}\) takes ([\d.]+)x the median compute time per "
                     rf"step of the other ranks \(([\d.]+) s vs ([\d.]+) s\)", lines[0])
    assert m and float(m.group(1)) > 3 and float(m.group(2)) >= 0.3, lines[0]
    metrics = {m["step"]: m for m in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())}
    assert metrics[8]["perf/straggler_ratio"] < 2, metrics[8]  # the even window
    assert all(metrics[s]["perf/slowest_rank"] == 1 and metrics[s]["perf/straggler_ratio"] > 3 for s in (12, 16))
    log1 = (tmp_path / "run" / "logs" / "rank_1.log").read_text()
    assert "log: step 12: straggler: rank 1" in log1


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_ranks_that_never_join_are_named_with_their_node_and_host(tiny_data, tmp_path):
    """World size 3 with only ranks 0 and 1 started (a node whose launcher never ran): both stop at
    dist.join_timeout_s, and rank 0 names rank 2, its node and the host the launcher gave it. Not
    `alone`: the two ranks start together and wait; a timeout of 20 s leaves a loaded machine's
    start-up skew between them (a few seconds) far inside it."""
    import subprocess
    import sys

    from conftest import free_port

    cfg = write_config(tmp_path / "run.yaml", tiny_config(tiny_data, tmp_path / "run", train={"global_batch_size": 6},
                                                          dist={"join_timeout_s": 20}))
    port = free_port()
    env = {"WORLD_SIZE": "3", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "DS_TRAIN_HOSTS": "nodeA,nodeB", "PYTHONWARNINGS": "ignore"}
    import os

    procs = [subprocess.Popen([sys.executable, "-m", "ds_train", "train", "--config", str(cfg), "--ds-config",
                               str(ROOT / "ds_configs" / "zero2.json")], cwd=ROOT,
                              env={**os.environ, **env, "RANK": str(r), "LOCAL_RANK": str(r), "NODE_RANK": "0"},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    outs = [p.communicate(timeout=120) for p in procs]  # join_timeout_s=20: a rank still waiting fails here
    assert [p.returncode for p in procs] == [5, 5], outs
    errors = [outs[0][1].strip().splitlines()[-1], outs[1][1].strip()]
    assert errors[0] == (f"ds-train: error: start-up: rank 2 (node 1, nodeB) did not reach the rendezvous at "
                         f"127.0.0.1:{port} within dist.join_timeout_s=20 s (2 of 3 ranks did); their launcher did "
                         f"not start them, or they failed or hung before it (see that node's output)"), outs[0]
    assert "ds-train" not in errors[1]  # the others found the same: rank 0 alone says it
    assert not (tmp_path / "run").exists()  # nothing written before every rank is there
