"""The reports (pure): a hang's ranks that never arrived told from those waiting in a collective,
the first failure told from its consequences, stragglers against the other ranks, the collective
a thread waits in."""

from __future__ import annotations

import re
import threading

from ds_train.observe import reports as rp
def rec(rank: int, step: int, beats: int, phase: str = "forward", collective: str | None = None, **kw) -> dict:
    return {"rank": rank, "node": rank // 2, "host": f"h{rank // 2}", "step": step, "phase": phase,
            "position": [step, beats], "idle_s": 60.0, "collective": collective, **kw}


# --- verdicts ---------------------------------------------------------------------------------------

def test_the_rank_that_never_arrived_is_told_from_the_ones_waiting_in_a_collective():
    records = {0: rec(0, 5, 3, "backward", "all_reduce in deepspeed/runtime/engine.py:1 (x)"),
               1: rec(1, 5, 1, "data"),
               2: rec(2, 5, 3, "backward", "all_reduce in deepspeed/runtime/engine.py:1 (x)"),
               3: rec(3, 5, 3, "backward")}  # NCCL: waits in a sync, not in the collective's call
    v = rp.classify(records, answered={0, 1, 2, 3})
    assert v == {"never_arrived": [1], "silent": [], "waiting": [0, 2, 3]}
    report = rp.hang_report(records, {0, 1, 2, 3}, 300)
    assert report["line"].startswith(
        "hang: no progress for 300 s (watchdog.stall_s): rank 1 on node 0 (h0) stalled in phase data of step 5 "
        "(60 s without progress) and never reached the collective. Waiting for it: rank 0 on node 0 (h0) waits "
        "in all_reduce in deepspeed/runtime/engine.py:1 (x) (phase backward of step 5)")
    assert report["line"].endswith("Stacks in logs/stacks_rank_<r>.txt on each rank's node")


def test_a_rank_that_does_not_answer_is_named_as_frozen_or_killed():
    records = {0: rec(0, 7, 2, "backward", "barrier"), 1: rec(1, 7, 2, "save", addr="10.0.0.2"), 2: None}
    v = rp.classify(records, answered={0})
    assert v == {"never_arrived": [], "silent": [1, 2], "waiting": [0]}
    line = rp.hang_report(records, {0}, 60)["line"]
    assert "rank 1 on node 0 (10.0.0.2, host h0) stopped answering (frozen or killed; last seen in phase save of step 7)" in line
    assert "rank 2 stopped answering (no heartbeat ever: it never started)" in line


def test_every_rank_inside_a_collective_points_at_a_mismatch():
    records = {r: rec(r, 3, 4, "step", "all_reduce") for r in range(2)}
    line = rp.hang_report(records, {0, 1}, 60)["line"]
    assert "every rank waits inside a collective: they disagree on which" in line


def test_the_first_failure_is_the_first_that_is_not_a_consequence():
    peer = {**rec(0, 3, 2), "error": "RuntimeError: Connection closed by peer", "primary": False, "tail": [], "log": "h0:l0"}
    cause = {**rec(1, 3, 1, "data"), "error": "ValueError: bad batch", "primary": True,
             "tail": ["ds_train/data.py:9 in f", "ValueError: bad batch"], "log": "h0:/r/logs/rank_1.log"}
    report = rp.failure_report([peer, cause])
    assert report["line"] == ("rank 1 on node 0 (h0) failed first, in phase data of step 3: ValueError: bad batch "
                              "(then rank 0); its log (h0:/r/logs/rank_1.log) ends: ds_train/data.py:9 in f | "
                              "ValueError: bad batch")
    # a rank that went silent: SIGKILL, in the step the others wait in (its heartbeat is a step behind)
    watchdog_said = {**peer, "error": "the rendezvous store on rank 0 stopped answering"}  # no traceback
    main_thread = {**peer, "tail": ["torch/distributed/distributed_c10d.py:3252 in all_reduce",
                                    "RuntimeError: Connection closed by peer"]}
    killed = rp.failure_report([watchdog_said, main_thread], silent=[rec(1, 2, 1, "forward")])
    assert killed["line"] == ("rank 1 on node 0 (h0) was killed by SIGKILL in step 3: it ended without an error or a "
                              "handled signal, so kill -9 or the kernel's OOM killer (see `dmesg` on h0); then rank 0 "
                              "lost the connection (RuntimeError: Connection closed by peer)")
    assert (killed["kind"], killed["rank"], killed["host"], killed["signal"], killed["step"], killed["killer"]) == (
        "killed", 1, "h0", "SIGKILL", 3, "unknown")
    oom = rp.failure_report([peer], silent=[rec(1, 3, 1, "forward")], oom="1 OOM kill(s) in this cgroup")
    assert "in step 3, phase forward" in oom["line"] and "so the kernel's OOM killer (1 OOM kill(s) in this cgroup)" \
        in oom["line"] and oom["killer"] == "oom"


def test_a_collective_past_the_process_group_timeout_is_named_with_the_ranks_it_waited_for():
    waited = {**rec(0, 3, 2, "backward"), "collective": "all_reduce in deepspeed/runtime/zero/stage_1_and_2.py:2384 "
              "(allreduce_bucket)", "error": "RuntimeError: [../gloo/transport/tcp/unbound_buffer.cc:81] Timed out "
              "waiting 20000ms for recv operation to complete", "primary": False, "tail": [], "log": "h0:l0"}
    stuck = {**rec(1, 3, 1, "data"), "collective": None}
    report = rp.failure_report([waited], records={0: waited, 1: stuck})
    assert report["line"].startswith(
        "the process-group timeout fired: rank 0 on node 0 (h0) waited 20 s (dist.timeout_s) in all_reduce in "
        "deepspeed/runtime/zero/stage_1_and_2.py:2384 (allreduce_bucket) at step 3; the rank(s) it waited for: rank 1 "
        "on node 0 (h0) in phase data of step 3, not in a collective; set watchdog.stall_s below dist.timeout_s")
    assert (report["kind"], report["timeout_s"], report["rank"]) == ("timeout", 20.0, 0)
    nccl = {**waited, "error": "DistBackendError: [Rank 0] Watchdog caught collective operation timeout: "
            "WorkNCCL(SeqNum=9, OpType=ALLREDUCE, Timeout(ms)=600000) ran for 600047 milliseconds"}
    assert rp.failure_report([nccl], records={0: nccl, 1: stuck})["timeout_s"] == 600.0


def test_secondary_errors_are_recognised():
    assert rp.is_secondary(RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer"))
    assert rp.is_secondary(RuntimeError("NCCL communicator was aborted on rank 0"))
    # the rendezvous store's host (rank 0) killed: torch's DistNetworkError on the others' next store call
    assert rp.is_secondary(RuntimeError("Failed to recv, got 0 bytes. Connection was likely closed. Did the remote "
                                        "server shutdown or crash?"))
    assert not rp.is_secondary(ValueError("token id 70000 >= vocab size"))


def test_stragglers_are_measured_against_the_median():
    assert rp.stragglers([1.0, 1.0, 1.1, 3.0], 1.3) == (3, 3.0, 1.0, [3])
    assert rp.stragglers([0.02, 0.32], 1.3) == (1, 16.0, 0.02, [1])  # two ranks: against the other
    assert rp.stragglers([0.1, 0.1], 1.3) == (0, 1.0, 0.1, [])
    assert rp.stragglers([0.021, 0.028], 1.3)[3] == []  # 1.33x, but 7 ms: noise on a tiny step
    assert rp.stragglers([2.0, 1.0, 1.0, 1.0, 9.0], 1.3)[3] == [0, 4]
    assert rp.stragglers([0.0, 0.0], 1.3)[3] == [] and rp.stragglers([0.5], 1.3) == (0, 1.0, 0.5, [])


def test_the_collective_a_thread_waits_in_is_named_with_its_caller():
    import torch.distributed as tdist  # noqa: F401  (the module the frame walk recognises)

    inside = threading.Event()
    release = threading.Event()

    def all_reduce():  # stands in for torch.distributed's: same file pattern is not needed for the caller
        inside.set()
        release.wait()

    all_reduce.__code__ = all_reduce.__code__.replace(co_filename="/x/torch/distributed/distributed_c10d.py")

    def caller():
        all_reduce()

    t = threading.Thread(target=caller, daemon=True)
    t.start()
    inside.wait()
    import sys

    try:
        frame = sys._current_frames()[t.ident]
        assert re.fullmatch(r"all_reduce in (tests/)?test_reports\.py:\d+ \(caller\)", rp.collective_of(frame)), \
            rp.collective_of(frame)
    finally:
        release.set()
        t.join()
    assert rp.collective_of(sys._current_frames()[threading.get_ident()]) is None
