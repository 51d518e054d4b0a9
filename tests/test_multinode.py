"""Multi-node through real pdsh and ssh: two "nodes" on loopback addresses (scripts/local_cluster.sh).

    bash scripts/local_cluster.sh up     # sshd on 127.0.0.2 and 127.0.0.3, its own keys and ssh config

Not skipped when pdsh or sshd are missing: the test fails and says to run scripts/test.sh, which
installs them. Every launch runs in its own process session with a timeout; remote ranks (started
by sshd, outside that session) are found by the test's tmp_path in their command line.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import stat
import socket
import sys
import time
import uuid
from pathlib import Path

import pytest

from conftest import (TESTS_ON_PATH, ROOT, free_port, losses_by_step, pids_with, reap, ript_config, run_cmd, spawn, tiny_config,
                      write_config)
from ds_train.checkpoint import commit as checkpoint
from ds_train.observe.doctor import diagnose

pytestmark = pytest.mark.slow

NODES = ("127.0.0.2", "127.0.0.3")
ZERO2 = str(ROOT / "ds_configs" / "zero2.json")


def _kill_leftovers(marker: str) -> list[int]:
    left = pids_with(marker)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return left


def _assert_nothing_left(marker: str, grace_s: float = 10) -> None:
    """No rank outlives its job; stragglers are killed (by pid) and fail the test."""
    deadline = time.monotonic() + grace_s
    while pids_with(marker) and time.monotonic() < deadline:
        time.sleep(0.5)
    left = _kill_leftovers(marker)
    assert not left, f"processes still running after the job ended: {left}"


@pytest.fixture(autouse=True)
def _no_stray_ranks(tmp_path):
    """Whatever happens in a test, no process of its run (all mention tmp_path) survives it."""
    yield
    _kill_leftovers(str(tmp_path))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """The local two-node cluster, up for this module and always down at the end."""
    missing = [name for name, ok in (("pdsh", shutil.which("pdsh")), ("ssh", shutil.which("ssh")),
                                     ("/usr/sbin/sshd", os.access("/usr/sbin/sshd", os.X_OK))) if not ok]
    if missing:
        pytest.fail(f"{', '.join(missing)} not installed: run `bash scripts/test.sh`, which installs pdsh "
                    f"and openssh-server (or apt-get install -y pdsh openssh-server)")
    state = tmp_path_factory.mktemp("cluster")
    script_env = {"DS_TRAIN_CLUSTER_DIR": str(state), "DS_TRAIN_CLUSTER_PORT": str(free_port())}
    up = run_cmd(["bash", str(ROOT / "scripts" / "local_cluster.sh"), "up"], timeout=60, env=script_env)
    try:
        assert up.returncode == 0, up.out
        env = {}
        for line in up.lines("export "):  # what a user would eval
            for word in shlex.split(line)[1:]:
                key, _, value = word.partition("=")
                env[key] = value
        assert env["PDSH_SSH_ARGS_APPEND"] == f"-F {state}/ssh_config", up.out
        yield {"env": env, "hostfile": Path(env["DS_TRAIN_CLUSTER_HOSTFILE"])}
    finally:
        down = run_cmd(["bash", str(ROOT / "scripts" / "local_cluster.sh"), "down"], timeout=60, env=script_env)
        assert down.returncode == 0, down.out
        assert not state.exists()


@pytest.fixture(scope="module")
def node_local_cluster(tmp_path_factory):
    """Two nodes whose output_dir is each node's own (node-local disks): one sshd per node, each
    in its own mount namespace with <state>/node<i> mounted over the run directory."""
    state = tmp_path_factory.mktemp("nl_cluster")
    run_dir = tmp_path_factory.mktemp("nl") / "run"
    script_env = {"DS_TRAIN_CLUSTER_DIR": str(state), "DS_TRAIN_CLUSTER_PORT": str(free_port()),
                  "DS_TRAIN_CLUSTER_NODE_LOCAL": str(run_dir)}
    up = run_cmd(["bash", str(ROOT / "scripts" / "local_cluster.sh"), "up"], timeout=60, env=script_env)
    try:
        assert up.returncode == 0, up.out
        env = dict(word.partition("=")[::2] for line in up.lines("export ") for word in shlex.split(line)[1:])
        yield {"env": env, "hostfile": Path(env["DS_TRAIN_CLUSTER_HOSTFILE"]), "run": run_dir,
               "nodes": (state / "node0", state / "node1")}
    finally:
        down = run_cmd(["bash", str(ROOT / "scripts" / "local_cluster.sh"), "down"], timeout=60, env=script_env)
        assert down.returncode == 0, down.out


@pytest.fixture(scope="module")
def straight_run(straight_zero2) -> dict[int, float]:
    """The losses of conftest's uninterrupted 12-step run (2 processes, one machine): what a run
    stopped and resumed on two nodes must give, bitwise (checkpoints and logging change no number)."""
    return losses_by_step(straight_zero2)


def launch_args(hostfile: Path, config: Path, *extra: str, overrides: tuple[str, ...] = (),
                command: str = "train") -> list[str]:
    return [sys.executable, "-m", "ds_train", "launch", "--hostfile", str(hostfile), *extra, "--",
            command, "--config", str(config), "--ds-config", ZERO2, *overrides]


def _signal_at_step(proc, beat: Path, step: int, signum: int) -> None:
    """`signum` to the launch (its supervisor alone) once `beat` says `step`; on any failure the whole tree is
    killed first."""
    try:
        _wait_for_step(beat, step, proc)
        os.kill(proc.pid, signum)
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise


def _wait_for_step(beat: Path, step: int, proc, timeout_s: float = 180) -> None:
    """Until the heartbeat file says the rank reached `step` (the job must still be running)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if json.loads(beat.read_text())["step"] >= step:
                return
        except (OSError, ValueError):
            pass
        assert proc.poll() is None and time.monotonic() < deadline, f"{beat} never reached step {step}"
        time.sleep(0.2)


def test_two_nodes_train_through_pdsh_and_ssh_and_sigusr1_saves_and_resumes_exactly(cluster, straight_run, tiny_data,
                                                                                   tmp_path):
    """SIGUSR1 (SLURM's warning before the time limit) to `ds-train launch` reaches the ranks on
    both nodes through the rendezvous store: every rank saves, the job exits 138 and its last line
    names the checkpoint; the same command continues, and its losses equal a straight run's."""
    sections = dict(train={"max_steps": 12}, launch={"env": ["DS_TRAIN_TEST_TOKEN"]})
    config = write_config(tmp_path / "run.yaml", tiny_config(tiny_data, tmp_path / "run", **sections))
    env = {**cluster["env"], "WANDB_API_KEY": "must-not-travel", "DS_TRAIN_TEST_TOKEN": "listed"}
    assert cluster["hostfile"].read_text() == "127.0.0.2 slots=1\n127.0.0.3 slots=1\n"
    proc = spawn(launch_args(cluster["hostfile"], config, "--master_port", str(free_port()),
                             overrides=("watchdog.debug_fault=slow:0:1.0",)), env=env)
    _signal_at_step(proc, tmp_path / "run" / "heartbeats" / "rank_1.json", 3, signal.SIGUSR1)
    res = reap(proc, 120)
    assert res.returncode == 138, res.out[-4000:]
    _assert_nothing_left(str(config))
    run = tmp_path / "run"
    saved = (run / "checkpoints" / "latest").read_text()
    step = int(saved.split("_")[1])
    assert 3 <= step < 12
    assert res.out.strip().splitlines()[-1] == (f"ds-train: stopped by signal 10; checkpoint {saved} saved; the same "
                                                f"command resumes from it"), res.out[-2000:]
    for rank in (0, 1):
        assert f"exit 138: stopped by signal 10 at step {step}" in (run / "logs" / f"rank_{rank}.log").read_text()

    res = run_cmd(launch_args(cluster["hostfile"], config, "--master_port", str(free_port())), timeout=240, env=env)
    assert res.returncode == 0, res.out[-6000:]
    _assert_nothing_left(str(config))
    assert f"resumed from {run / 'checkpoints' / saved} at step {step}" in res.out
    assert res.lines("127.0.0.2: train: done, 12 steps, final loss ")  # rank 0's last line, through pdsh
    assert res.out.strip().splitlines()[-1] == f"launch: done, every rank exited 0; run directory {run.resolve()}"
    host = socket.gethostname()
    assert f"hosts: node0 {host} -> ranks 0; node1 {host} -> ranks 1" in res.out
    assert res.lines("127.0.0.3: ") and res.lines("127.0.0.2: ")  # pdsh's per-node prefixes
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, 13))
    assert [m["loss"] for m in metrics] == [straight_run[s] for s in range(1, 13)]  # bitwise, before and after the save
    assert all(m["world_size"] == 2 for m in metrics)
    assert json.loads((run / "env.json").read_text())["hosts"] == [
        {"node": 0, "host": host, "ranks": [0]}, {"node": 1, "host": host, "ranks": [1]}]
    for rank in (0, 1):
        assert f" node {rank} world 2 launcher deepspeed" in (run / "logs" / f"rank_{rank}.log").read_text()
    env_file = (run / ".deepspeed_env").read_text()
    assert "\n\n" not in env_file and "WANDB_MODE=offline\n" in env_file
    assert "DS_TRAIN_TEST_TOKEN=listed\n" in env_file and "WANDB_API_KEY" not in env_file


def test_ript_on_two_nodes_through_pdsh_and_ssh(cluster, tiny_policy, tmp_path):
    """`ds-train launch -- ript`: the same preflight, .deepspeed_env and pdsh launch as training;
    one task per node, counts summed over the nodes, results written by rank 0."""
    config = ript_config(tmp_path, tiny_policy, tasks=["copy", "sort"])
    env = {**cluster["env"], **TESTS_ON_PATH}  # PYTHONPATH reaches the nodes through .deepspeed_env
    res = run_cmd(launch_args(cluster["hostfile"], config, "--master_port", str(free_port()), command="ript"),
                  timeout=240, env=env)
    assert res.returncode == 0, res.out[-6000:]
    _assert_nothing_left(str(config))
    assert "preflight: batch: global 24 seqs = micro 4 x accum 3 x world 2" in res.out
    run = tmp_path / "run"
    results = json.loads((run / "ript_results.json").read_text())
    assert results["world_size"] == 2 and results["shards"] == {"rank0": ["copy"], "rank1": ["sort"]}
    assert results["iteration"] == 2 and [e["iteration"] for e in results["evals"]] == [0, 2]
    assert all(results["train_counts"][t]["rollouts"] > 0 for t in ("copy", "sort"))
    host = socket.gethostname()
    assert json.loads((run / "env.json").read_text())["hosts"] == [
        {"node": 0, "host": host, "ranks": [0]}, {"node": 1, "host": host, "ranks": [1]}]
    assert checkpoint.latest_complete(run / "checkpoints") == "step_00000002"


def test_rollout_ranks_on_both_nodes_train_stop_and_resume_through_pdsh(cluster, sft_policy, tmp_path):
    """Asynchronous RL over two loopback nodes of 2 slots: each node's second rank generates (its weights from its
    node's trainer), max_staleness 1. SIGUSR1 to `ds-train launch` after iteration 2: the trainers save (with the
    batches the rollout ranks hold) and stop, the rollout ranks leave when told; the same command resumes and
    finishes, and its staleness stays 1."""
    from test_ript_trainer import MODEL_RIPT, MODEL_TRAIN, TEMPLATE

    hostfile = tmp_path / "hostfile"
    hostfile.write_text("127.0.0.2 slots=2\n127.0.0.3 slots=2\n")
    config = ript_config(tmp_path, sft_policy, MODEL_TRAIN, **{**MODEL_RIPT, "iterations": 8, "sync_every": 1,
                                                              "eval_every": 0, "rollout_ranks_per_node": 1,
                                                              "max_staleness": 1, "tis_cap": 2})
    env = {**cluster["env"], **TESTS_ON_PATH}
    overrides = (f"data.chat_template={TEMPLATE}", "watchdog.debug_fault=slow:0:2.0")  # the signal comes mid-run
    run = tmp_path / "run"
    proc = spawn(launch_args(hostfile, config, "--master_port", str(free_port()), overrides=overrides,
                             command="ript"), env=env)
    _signal_at_step(proc, run / "heartbeats" / "rank_1.json", 2, signal.SIGUSR1)
    res = reap(proc, 180)
    assert res.returncode == 138, res.out[-4000:]
    _assert_nothing_left(str(config))
    assert "preflight: batch: global 16 seqs = micro 4 x accum 2 x world 2" in res.out  # the trainers' world
    saved = (run / "checkpoints" / "latest").read_text()
    stopped = int(saved.split("_")[1])
    assert 2 <= stopped < 8

    res = run_cmd(launch_args(hostfile, config, "--master_port", str(free_port()), overrides=overrides[:1],
                              command="ript"), timeout=300, env=env)
    assert res.returncode == 0, res.out[-6000:]
    _assert_nothing_left(str(config))
    assert f"at iteration {stopped}" in res.out and "resumed from" in res.out
    assert "rollout ranks: the last 1 of every node's 2 (2 in all) generate, 2 train; ript.max_staleness 1" in res.out
    metrics = {m["step"]: m for m in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}
    assert sorted(metrics) == list(range(0, 9))
    for it in range(1, 9):
        assert metrics[it]["async/staleness_max"] == min(it - 1, 1) and metrics[it]["async/stale_dropped"] == 0
        assert metrics[it]["async/weights_send_s"] > 0 and metrics[it]["ript/checked"] > 0
    host = socket.gethostname()
    assert json.loads((run / "env.json").read_text())["hosts"] == [
        {"node": 0, "host": host, "ranks": [0]}, {"node": 1, "host": host, "ranks": [1]}]  # the trainers
    assert checkpoint.latest_complete(run / "checkpoints") == "step_00000008"


def test_unreachable_host_is_named_within_30s(cluster, tiny_data, tmp_path):
    config = write_config(tmp_path / "run.yaml", tiny_config(tiny_data, tmp_path / "run",
                                                             train={"global_batch_size": 6}))
    hostfile = tmp_path / "hostfile"
    hostfile.write_text(cluster["hostfile"].read_text() + "127.0.0.4 slots=1\n")
    res = run_cmd(launch_args(hostfile, config, "--check"), timeout=30, env=cluster["env"])  # fails past 30 s
    assert res.returncode == 2, res.out
    assert "127.0.0.4: not reachable by password-less ssh" in res.out
    assert "unreachable: 127.0.0.4;" in res.out
    assert "127.0.0.2:" not in res.out and "127.0.0.3:" not in res.out
    assert not (tmp_path / "run").exists()


def assert_traceback_on_node1_named(res, run: Path, step: int) -> None:
    """Rank 1 on node 1 raised at `step`: its traceback is in node 1's logs/rank_1.log (timestamped,
    host and rank), and the job's last line names rank 1, node 1, the phase, the step and the error,
    not the connection errors the other rank gets after it; the doctor names the raise, not its echo."""
    assert res.returncode == 1, res.out[-4000:]
    host = socket.gethostname()
    last = res.out.strip().splitlines()[-1]
    assert last.startswith(f"ds-train: error: rank 1 on node 1 (127.0.0.3, host {host}) failed first, in phase data of "
                           f"step {step}: RuntimeError: injected failure on rank 1 at step {step} "
                           f"(watchdog.debug_fault); its log ({host}:{run / 'logs' / 'rank_1.log'}) ends: "), last
    log1 = (run / "logs" / "rank_1.log").read_text()
    # (torch prefixes the lines of an uncaught exception with the rank, "[rank1]: ")
    assert re.search(rf"^\S+ \S+ {host} rank1 err: (\[rank1\]: )?Traceback \(most recent call last\):$", log1, re.M), \
        log1[-2000:]
    assert re.search(rf"^\S+ \S+ {host} rank1 err: (\[rank1\]: )?RuntimeError: injected failure on rank 1 at step "
                     rf"{step}", log1, re.M)
    failure = json.loads((run / "logs" / "failure.json").read_text())
    assert failure["first"]["rank"] == 1 and failure["first"]["primary"] and failure["first"]["addr"] == "127.0.0.3"
    found = diagnose(str(run))  # the doctor on this live failure
    assert found[0].cls == "rank_error" and found[0].where == "rank 1 on 127.0.0.3", found
    assert any(f"injected failure on rank 1 at step {step}" in e for e in found[0].evidence), found[0].evidence


def assert_killed_rank_named(res, run: Path, rank: int, step: int) -> None:
    """SIGKILL of `rank` at `step`: the other rank loses the connection and says one line, no
    traceback, naming the killed rank, its node and host, SIGKILL and the step; failure.json too."""
    assert res.returncode != 0, res.out[-4000:]
    assert "Traceback" not in res.out, res.out[-4000:]
    host = socket.gethostname()
    last = res.out.strip().splitlines()[-1]
    assert last.startswith(f"ds-train: error: rank {rank} on node {rank} ({NODES[rank]}, host {host}) was killed "
                           f"by SIGKILL in step {step}"), res.out[-3000:]
    assert f"then rank {1 - rank} lost the connection" in last, last
    failure = json.loads((run / "logs" / "failure.json").read_text())
    assert (failure["rank"], failure["signal"], failure["step"], failure["first"]["addr"]) == (
        rank, "SIGKILL", step, NODES[rank])


def test_ranks_killed_or_raising_on_either_node_are_named_and_each_resume_is_exact(cluster, straight_run, tiny_data,
                                                                                   tmp_path):
    """One job through pdsh, stopped three times and resumed each time by the same command: SIGKILL
    (as the OOM killer sends) of rank 0 on node 0 at step 3 (it serves the rendezvous store: the
    second store, on node 1, carries the verdict); an exception on rank 1 on node 1 at step 5; SIGKILL
    of rank 1 on node 1 at step 7. Each end is named (assert_killed_rank_named,
    assert_traceback_on_node1_named), the newest save is whole, each start resumes from it, and the
    last finishes with the straight run's losses, bitwise."""
    run = tmp_path / "run"
    config = write_config(tmp_path / "run.yaml", tiny_config(tiny_data, run, train={"max_steps": 12},
                                                             checkpoint={"every": 2},
                                                             watchdog={"stall_s": 30, "heartbeat_s": 0.5}))
    resumed_at = None
    for fault, rank, step in (("kill", 0, 3), ("raise", 1, 5), ("kill", 1, 7)):
        res = run_cmd(launch_args(cluster["hostfile"], config, "--master_port", str(free_port()),
                                  overrides=(f"watchdog.debug_fault={fault}:{rank}:{step}",)), timeout=180,
                      env=cluster["env"])
        _assert_nothing_left(str(config))
        if resumed_at:
            assert f"resumed from {run / 'checkpoints' / resumed_at} at step {int(resumed_at[5:])}" in res.out
        if fault == "kill":
            assert_killed_rank_named(res, run, rank, step)
        else:
            assert_traceback_on_node1_named(res, run, step)
        resumed_at = checkpoint.latest_complete(run / "checkpoints")
        assert resumed_at == checkpoint.tag_for(step - 1)

    res = run_cmd(launch_args(cluster["hostfile"], config, "--master_port", str(free_port())), timeout=240,
                  env=cluster["env"])
    assert res.returncode == 0, res.out[-4000:]
    _assert_nothing_left(str(config))
    assert f"resumed from {run / 'checkpoints' / 'step_00000006'} at step 6" in res.out
    losses = losses_by_step(run)
    assert sorted(losses) == list(range(1, 13)) and [losses[s] for s in range(3, 13)] == [
        straight_run[s] for s in range(3, 13)]


def test_sigkill_of_ds_train_launch_stops_the_ranks_on_both_nodes_with_a_save(cluster, tiny_data, tmp_path):
    """`ds-train launch` SIGKILLed (its PID alone): no process is above the remote rank to notice,
    but its beats in the rendezvous store stop; within GONE_AFTER beats every rank says so, saves at
    the next step and exits 143, and nothing of the job (runner, pdsh, ranks) is left within
    stall_s + 60 s. (A beat of 1 s, DS_TRAIN_LAUNCHER_BEAT_S: gone after 6 s rather than 30.)"""
    run = tmp_path / "run"
    config = write_config(tmp_path / "run.yaml", tiny_config(tiny_data, run, train={"max_steps": 400},
                                                             watchdog={"stall_s": 30}))
    proc = spawn(launch_args(cluster["hostfile"], config, "--master_port", str(free_port()),
                             overrides=("watchdog.debug_fault=slow:0:0.3",)),
                 env={**cluster["env"], "DS_TRAIN_LAUNCHER_BEAT_S": "1"})
    _signal_at_step(proc, run / "heartbeats" / "rank_1.json", 3, signal.SIGKILL)
    reap(proc, 30 + 60)  # every process holding the launch's output pipe (runner, pdsh) has ended
    _assert_nothing_left(str(config), grace_s=1)
    saved = checkpoint.latest_complete(run / "checkpoints")
    assert saved is not None and 3 <= int(saved.split("_")[1]) < 400
    k = int(saved.split("_")[1])
    for rank in (0, 1):
        log = (run / "logs" / f"rank_{rank}.log").read_text()
        assert "the ds-train launch (its beats stopped) that started this job is gone; saving and stopping as for " \
               "SIGTERM" in log, log[-2000:]
        assert f"exit 143: stopped by signal 15 at step {k}" in log, log[-2000:]


def test_a_stalled_rank_on_node1_is_named_through_pdsh(cluster, tiny_data, tmp_path):
    """The hang watchdog across nodes: rank 1 on node 1 stops; within stall_s + 30 s the job ends
    with exit 5 and the last line names rank 1, node 1, its phase and step."""
    config = write_config(tmp_path / "run.yaml", tiny_config(tiny_data, tmp_path / "run", train={"max_steps": 50}))
    proc = spawn(launch_args(cluster["hostfile"], config, "--master_port", str(free_port()),
                             overrides=("watchdog.stall_s=6", "watchdog.debug_fault=stall:1:4")), env=cluster["env"])
    try:
        _wait_for_step(tmp_path / "run" / "heartbeats" / "rank_1.json", 4, proc)
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    res = reap(proc, 6 + 60)  # ends within stall_s + 60 s of the stall, or fails
    assert res.returncode == 5, res.out[-4000:]
    _assert_nothing_left(str(config))
    host = socket.gethostname()
    last = res.out.strip().splitlines()[-1]
    assert last.startswith(f"ds-train: error: hang: no progress for 6 s (watchdog.stall_s): rank 1 on node 1 (127.0.0.3, "
                           f"host {host}) stalled in phase data of step 4"), res.out[-3000:]
    assert f"Waiting for it: rank 0 on node 0 (127.0.0.2, host {host}) waits in all_reduce" in last
    assert "in _injected_stall" in (tmp_path / "run" / "logs" / "stacks_rank_1.txt").read_text()


def test_busy_master_port_moves_to_the_next_free_one(cluster, tiny_data, tmp_path):
    config = write_config(tmp_path / "run.yaml", tiny_config(tiny_data, tmp_path / "run"))
    with socket.socket() as busy:
        busy.bind((NODES[0], 0))
        busy.listen()
        port = busy.getsockname()[1]
        res = run_cmd(launch_args(cluster["hostfile"], config, "--check", "--master_port", str(port)),
                      timeout=30, env=cluster["env"])
    assert res.returncode == 0, res.out
    m = re.search(rf"master port {port} is in use on 127\.0\.0\.2; using (\d+) instead", res.out)
    assert m, res.out
    assert port < int(m.group(1)) < port + 10
    assert f"master 127.0.0.2:{m.group(1)}" in res.out
    last = res.out.strip().splitlines()[-1]
    assert last == "launch: preflight ok on 2 host(s), world size 2; nothing launched (--check)", res.out
    assert "preflight: 127.0.0.2, 127.0.0.3 are one machine" in res.out  # said, as DS_TRAIN_ONE_MACHINE allows
    assert not (tmp_path / "run").exists()  # --check writes nothing
    # Without the cluster's word that both names are this machine, the probes' identity refuses it.
    env = {k: v for k, v in cluster["env"].items() if k != "DS_TRAIN_ONE_MACHINE"}
    res = run_cmd(launch_args(cluster["hostfile"], config, "--check"), timeout=30, env=env)
    assert res.returncode == 2, res.out
    assert (f"{cluster['hostfile']}:1 (127.0.0.2) and {cluster['hostfile']}:2 (127.0.0.3) are one machine (host "
            f"{socket.gethostname()}, boot id ") in res.out
    assert not (tmp_path / "run").exists()


def test_shell_metacharacters_in_the_hostfile_are_rejected(cluster, tiny_data, tmp_path):
    config = write_config(tmp_path / "run.yaml", tiny_config(tiny_data, tmp_path / "run"))
    marker = Path(f"/tmp/pwned_{uuid.uuid4().hex}")
    hostfile = tmp_path / "hostfile"
    hostfile.write_text(f"127.0.0.2 slots=1\n127.0.0.3;touch${{IFS}}{marker} slots=1\n")
    res = run_cmd(launch_args(hostfile, config), timeout=30, env=cluster["env"])
    assert res.returncode == 2, res.out
    assert f"{hostfile}:2: '127.0.0.3;touch${{IFS}}{marker}' is not a valid host name" in res.out
    assert not marker.exists() and not (tmp_path / "run").exists()


def _on_node(env: dict, host: str, code: str) -> str:
    """Run Python `code` on `host` over the cluster's ssh (as the preflight probe does): its output."""
    res = run_cmd(["ssh", *shlex.split(env["PDSH_SSH_ARGS_APPEND"]), "--", host,
                   shlex.join([sys.executable, "-c", code])], timeout=60)
    return res.out.strip()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("change", ["missing", "another version"])
def test_preflight_names_node1_whose_transformers_is_missing_or_of_another_version(node_local_cluster, tiny_data,
                                                                                  tmp_path, change):
    """Node 1 (its sshd runs in a mount namespace of its own) gets a site-packages without transformers,
    or with another version of it (an overlayfs layer over the venv's site-packages, mounted in that
    namespace only): `ds-train launch --check` fails before any rank starts, with one line naming the
    host, the package, both versions and the fix; node 0 and this machine are untouched."""
    import importlib.metadata

    c = node_local_cluster
    dist = importlib.metadata.distribution("transformers")
    here, info = dist.version, Path(dist._path)  # site-packages/transformers-<version>.dist-info
    site = info.parent
    other = "4.57.1" if here != "4.57.1" else "4.56.0"
    layer = tmp_path / "layer"
    layer.mkdir()
    hidden = [info.name] + (["transformers"] if change == "missing" else [])
    for name in hidden:  # an overlayfs whiteout: a 0/0 character device hides the lower layer's entry
        os.mknod(layer / name, 0o600 | stat.S_IFCHR, os.makedev(0, 0))
    if change == "another version":
        shutil.copytree(info, layer / f"transformers-{other}.dist-info")
        meta = layer / f"transformers-{other}.dist-info" / "METADATA"
        meta.write_text(re.sub(r"(?m)^Version: .*$", f"Version: {other}", meta.read_text(), count=1))
    node1_sshd = (c["nodes"][1].parent / "sshd1.pid").read_text().strip()
    in_node1 = ["nsenter", "-t", node1_sshd, "-m", "--"]
    config = write_config(tmp_path / "run.yaml", tiny_config(tiny_data, tmp_path / "run"))
    mounted = run_cmd([*in_node1, "mount", "-t", "overlay", "overlay", "-o", f"lowerdir={layer}:{site}", str(site)],
                      timeout=30)
    assert mounted.returncode == 0, mounted.out
    try:
        ask = "import importlib.metadata as m; print(m.version('transformers'))"
        assert _on_node(c["env"], NODES[0], ask) == here
        if change == "missing":  # node 1 really lacks it, as the run would find out after launch
            assert "No module named 'transformers'" in _on_node(c["env"], NODES[1], "import transformers")
        else:
            assert _on_node(c["env"], NODES[1], ask) == other
        res = run_cmd(launch_args(c["hostfile"], config, "--check", "--master_port", str(free_port())),
                      timeout=120, env=c["env"])
    finally:
        unmounted = run_cmd([*in_node1, "umount", str(site)], timeout=30)
        assert unmounted.returncode == 0, unmounted.out
    assert res.returncode == 2, res.out
    lines = res.out.strip().splitlines()
    assert lines[-2:] == [
        "ds-train: error: preflight: 1 problem:",
        f"  127.0.0.3: transformers {other if change == 'another version' else 'missing'} (this machine: {here}); "
        f"install the same versions on every node (pip install transformers=={here} there)"], res.out
    assert "127.0.0.2:" not in res.out and "preflight ok" not in res.out
    assert not (tmp_path / "run").exists()
    assert importlib.metadata.version("transformers") == here  # the mount stayed in node 1's namespace


def test_node_local_output_dirs_resume_exactly_and_a_node_missing_files_is_named(node_local_cluster, straight_run,
                                                                                 tiny_data, tmp_path):
    """Each node sees only its own run directory: every rank writes its own files there, each node
    its marker and `latest`. Killed (SIGKILL on both nodes) right after the save of step 4, the job
    resumes exactly; then node 1 loses a file of the newest tag: the job stops naming it."""
    c = node_local_cluster
    sections = dict(train={"max_steps": 12}, checkpoint={"every": 4, "keep": 2, "debug_fault": "kill:latest:4"})
    cfg = write_config(tmp_path / "run.yaml", tiny_config(tiny_data, c["run"], **sections))

    def launch(*overrides):
        return run_cmd(launch_args(c["hostfile"], cfg, "--master_port", str(free_port()), overrides=overrides),
                       timeout=240, env=c["env"])

    res = launch()
    assert res.returncode != 0, res.out[-4000:]
    _assert_nothing_left(str(cfg))
    assert "output_dir node-local (each node holds its own ranks' checkpoint files)" in res.out
    node0, node1 = c["nodes"]
    for node, rank in ((node0, 0), (node1, 1)):
        tag = node / "checkpoints" / "step_00000004"
        assert checkpoint.read_marker(tag)[0]["storage"] == "node-local"
        assert checkpoint.rank_missing(tag, rank) == [] and not checkpoint.manifest_file(tag, 1 - rank).exists()
        assert (node / "checkpoints" / "latest").read_text() == "step_00000004"
    assert not (c["run"] / "checkpoints").exists()  # nothing outside the nodes' own directories

    res = launch()
    assert res.returncode == 0, res.out[-4000:]
    assert f"resumed from {c['run'] / 'checkpoints' / 'step_00000004'} at step 4" in res.out
    got = {m["step"]: m for m in map(json.loads, (node0 / "metrics.jsonl").read_text().splitlines())}
    assert sorted(got) == list(range(1, 13))
    assert [got[s]["loss"] for s in range(5, 13)] == [straight_run[s] for s in range(5, 13)]  # bitwise
    assert sorted(p.name for p in (node1 / "checkpoints").glob("step_*")) == ["step_00000008", "step_00000012"]

    (node1 / "checkpoints" / "step_00000012" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    res = launch("train.max_steps=14")
    assert res.returncode != 0
    _assert_nothing_left(str(cfg))
    errors = [line for line in res.out.splitlines() if "ds-train" in line and "error:" in line]
    assert len(errors) == 2, res.out[-4000:]  # every rank found it; rank 0 alone says it, then the launch its end
    assert res.out.strip().splitlines()[-1] == errors[1] == (
        f"ds-train: error: the job ended with exit code {res.returncode}: bad input, named in the error line above")
    assert errors[0].endswith(
        f"ds-train: error: checkpoint {c['run'] / 'checkpoints' / 'step_00000012'} (step 12, the newest complete "
        f"save) is incomplete on node 1 ({socket.gethostname()}) rank 1: missing "
        f"zero_pp_rank_1_mp_rank_00_optim_states.pt; restore those files, resume from step_00000008 with "
        f"checkpoint.resume=step_00000008, or start over with checkpoint.resume=restart"), errors[0]
    assert not any(p.name == "step_00000014" for node in (node0, node1) for p in (node / "checkpoints").iterdir())
