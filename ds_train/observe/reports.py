"""Reports on a job that went wrong, as pure functions of what its ranks published: which ranks
of a hang never arrived and which wait in a collective, which rank failed first, which rank
straggles; plus reading a thread's stack (the collective it waits in, every thread's frames).

ds_train/observe/watchdog.py gathers the ranks' records (heartbeats, failures) and calls these; `ds-train
launch` prints the line they make as the job's last.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import threading
import traceback
from pathlib import Path

# torch.distributed / deepspeed.comm functions that block until the other ranks take part.
COLLECTIVES = {"all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "broadcast",
               "broadcast_object_list", "barrier", "monitored_barrier", "reduce", "reduce_scatter",
               "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "gather", "gather_object",
               "scatter", "send", "recv", "inference_all_reduce", "all_reduce_coalesced",
               "allreduce_coalesced", "reduce_scatter_fn", "all_gather_coalesced"}
# The bridge between trainer and rollout ranks (ds_train/dist/bridge.py) calls its process groups' methods
# directly, below any torch.distributed frame: its own methods are its collectives.
BRIDGE_COLLECTIVES = {"send_weights", "receive_weights", "_broadcast", "exchange"}
# Phases in which a rank waits for another outside any collective, and for what: it waits, it did not stall
# (ds_train/train/benchmarks.py: the other ranks poll the rendezvous store for rank 0's lm-eval scores).
STORE_WAITS = {"wait-scores": "for rank 0's lm-eval scores"}
_COMM_FILES = re.compile(r"torch/distributed/|deepspeed/comm/|ds_train/dist/bridge\.py")
# Exceptions a rank gets because another rank died (a secondary failure, not the cause).
PEER_LOSS = re.compile(r"connection (closed|reset)|broken pipe|peer|socket|NCCL communicator was aborted|"
                       r"ProcessGroup.*(abort|shut)|Connection refused|Gloo|"
                       r"Failed to (recv|send)|Connection was likely closed", re.I)  # the TCPStore's host gone


# A collective that waited past the process group's timeout (gloo; NCCL's watchdog).
TIMED_OUT = re.compile(r"Timed out waiting (\d+) ?ms|timed out after (\d+) ?ms|Timeout\(ms\)=(\d+)", re.I)


def main_frame():
    """The current frame of the main thread (None if it cannot be read)."""
    return sys._current_frames().get(threading.main_thread().ident)


def collective_of(frame) -> str | None:
    """`all_reduce in deepspeed/runtime/engine.py:2100 (allreduce_bucket)` when the frame's thread is
    inside a collective call, else None."""
    name, caller = None, None
    while frame is not None:
        code = frame.f_code
        if _COMM_FILES.search(code.co_filename):
            if code.co_name in COLLECTIVES or code.co_name in BRIDGE_COLLECTIVES:
                name = code.co_name  # keep the outermost one: deepspeed.comm's name over torch's
        elif name is not None:
            caller = f"{short_path(code.co_filename)}:{frame.f_lineno} ({code.co_name})"
            break
        frame = frame.f_back
    return f"{name} in {caller}" if name and caller else name


def collective_in(exc: BaseException) -> str | None:
    """The collective an exception came out of (its innermost frames), else None."""
    tb, last = exc.__traceback__, None
    while tb is not None:
        last, tb = tb.tb_frame, tb.tb_next
    return collective_of(last)


def short_path(path: str) -> str:
    """A path from its package on: ds_train/train/loop.py, deepspeed/runtime/engine.py."""
    m = re.search(r"(ds_train|deepspeed|torch|transformers)/.*$", path)
    return m.group(0) if m else Path(path).name


def format_stacks(header: str) -> str:
    """Every thread's Python stack, the main thread first."""
    frames = sys._current_frames()
    frames.pop(threading.get_ident(), None)  # the thread writing this
    names = {t.ident: t.name for t in threading.enumerate()}
    main = threading.main_thread().ident
    parts = [header]
    for ident in sorted(frames, key=lambda i: i != main):
        parts.append(f"\n--- thread {names.get(ident, ident)} ---\n" +
                     "".join(traceback.format_stack(frames[ident])))
    return "\n".join(parts)


def native_stacks(pid: int, timeout_s: float = 20) -> str:
    """py-spy's dump with native frames, where py-spy is installed ('' otherwise)."""
    exe = shutil.which("py-spy")
    if not exe:
        return ""
    try:
        proc = subprocess.run([exe, "dump", "--native", "--pid", str(pid)], capture_output=True, text=True,
                              timeout=timeout_s)
        return f"\n--- py-spy dump --native ---\n{proc.stdout}{proc.stderr}"
    except (OSError, subprocess.SubprocessError) as e:
        return f"\n--- py-spy failed: {e} ---\n"


def doctor_hint(run_dir) -> str:
    """The line a failed run ends with: where to look next."""
    return f"diagnose: ds-train doctor {run_dir}   (what went wrong, and what to do)"


# ---- verdicts: pure functions of what the ranks published -------------------------------------

def where(rec: dict) -> str:
    """`rank 1 on node 1 (gpu017)`, or `rank 1 on node 1 (10.0.0.3, host gpu017)` when the hostfile
    names the node otherwise."""
    addr = rec.get("addr")
    named = f"{addr}, host {rec['host']}" if addr and addr != rec["host"] else rec["host"]
    return f"{label(rec)} on node {rec['node']} ({named})"


def label(rec: dict) -> str:
    """`rank 1`, or `rollout rank 0 (job rank 2)` for a rollout rank (ript.rollout_ranks_per_node)."""
    if rec.get("role") == "rollout":
        return f"rollout rank {rec['rank']} (job rank {rec['job_rank']})"
    return f"rank {rec['rank']}"


def classify(records: dict[int, dict | None], answered: set[int]) -> dict[str, list[int]]:
    """Which ranks of a hang wait inside a collective and which never arrived.

    `records`: each rank's last heartbeat (None: it never published one); `answered`: the ranks
    that took part in the alarm (wrote their stacks). A rank that did not answer is frozen or gone.
    Of the others, a rank waits when its main thread is inside a collective or when it got further
    (step, then phases entered in it) than a rank that is not; the ranks furthest behind outside
    any collective never arrived."""
    silent = sorted(r for r in records if r not in answered)
    live = {r: rec for r, rec in records.items() if r in answered and rec is not None}
    outside = {r: rec for r, rec in live.items() if not rec.get("collective") and rec.get("phase") not in STORE_WAITS}
    behind = min((tuple(rec["position"]) for rec in outside.values()), default=None)
    laggards = sorted(r for r, rec in outside.items() if tuple(rec["position"]) == behind)
    return {"never_arrived": laggards, "silent": silent, "waiting": sorted(r for r in live if r not in laggards)}


def _waits_in(rec: dict) -> str:
    if rec.get("collective"):
        return f"in {rec['collective']}"
    return STORE_WAITS.get(rec.get("phase"), "in a collective")


def hang_report(records: dict[int, dict | None], answered: set[int], stall_s: float) -> dict:
    """The hang report: its one line (the job's last) and what it is made of."""
    v = classify(records, answered)
    culprits = []
    for r in v["never_arrived"]:
        rec = records[r]
        culprits.append(f"{where(rec)} stalled in phase {rec['phase']} of step {rec['step']} "
                        f"({rec['idle_s']:.0f} s without progress) and never reached the collective")
    for r in v["silent"]:
        rec = records.get(r)
        culprits.append(f"rank {r} stopped answering (no heartbeat ever: it never started)" if rec is None else
                        f"{where(rec)} stopped answering (frozen or killed; last seen in phase {rec['phase']} "
                        f"of step {rec['step']})")
    if not culprits:
        culprits.append("every rank waits inside a collective: they disagree on which (a code path that "
                        "differs by rank) or the network between them is down")
    waits = "; ".join(f"{where(records[r])} waits {_waits_in(records[r])} (phase "
                      f"{records[r]['phase']} of step {records[r]['step']})" for r in v["waiting"])
    line = (f"hang: no progress for {stall_s:g} s (watchdog.stall_s): " + "; ".join(culprits) +
            (f". Waiting for it: {waits}" if waits and v["never_arrived"] + v["silent"] else
             f". {waits}" if waits else "") +
            ". Stacks in logs/stacks_rank_<r>.txt on each rank's node")
    return {"kind": "hang", "line": line, "stall_s": stall_s, **v,
            "ranks": {str(r): rec for r, rec in sorted(records.items())}}


def failure_report(failures: list[dict], silent: list[dict] = (), oom: str = "",
                   records: dict[int, dict | None] | None = None) -> dict:
    """The first failure, named: the first that is not a consequence of another rank's death; when
    every error is such a consequence, the rank that went silent (`silent`: last heartbeats of
    ranks that died without a word).

    A rank that dies without a word ran no exit of its own: no exception, no signal handler (SIGTERM,
    SIGINT and SIGUSR1 are caught and end in a save). Only SIGKILL ends a process so: kill -9, or
    the kernel's OOM killer (`oom`: the evidence, when the reporting rank shares its host). Its last
    step is the step the other ranks wait in (its last heartbeat may be a step behind)."""
    primary = next((f for f in failures if f["primary"]), None)
    timed_out = next((f for f in failures if TIMED_OUT.search(f["error"])), None)
    if primary is None and timed_out is not None:
        return _timeout_report(timed_out, failures, records or {})
    if primary is None and silent:
        dead = silent[0]
        step = max([dead["step"], min(f["step"] for f in failures)])
        phase = f", phase {dead['phase']}" if dead["step"] == step else ""
        by = f"the kernel's OOM killer ({oom})" if oom else (f"kill -9 or the kernel's OOM killer (see `dmesg` "
                                                               f"on {dead['host']})")
        others = [label(r) for r in silent[1:]]
        lost: dict[str, dict] = {}  # a rank's main-thread error (it has a traceback) over its watchdog's
        for f in sorted(failures, key=lambda f: (f.get("role") == "rollout", f["rank"])):
            if label(f) not in lost or f["tail"] and not lost[label(f)]["tail"]:
                lost[label(f)] = f
        seen = next((f for f in lost.values() if f["tail"]), failures[0])
        line = (f"{where(dead)} was killed by SIGKILL in step {step}{phase}: it ended without an error "
                f"or a handled signal, so {by}; "
                + (f"{', '.join(others)} went silent too; " if others else "")
                + f"then {', '.join(lost)} lost the connection ({seen['error']})")
        return {"kind": "killed", "line": line, "rank": dead["rank"], "host": dead["host"], "signal": "SIGKILL",
                "step": step, "killer": "oom" if oom else "unknown", "first": dead, "silent": silent,
                "failures": failures}
    first = primary or failures[0]
    others = [label(f) for f in failures if f is not first]
    tail = " | ".join(first["tail"])
    line = (f"{where(first)} failed first, in phase {first['phase']} of step {first['step']}: {first['error']}"
            + (f" (then {', '.join(others)})" if others else "") + f"; its log ({first['log']}) ends: {tail}")
    return {"kind": "failure", "line": line, "rank": first["rank"], "host": first["host"], "signal": None,
            "step": first["step"], "first": first, "failures": failures}


def _timeout_report(t: dict, failures: list[dict], records: dict[int, dict | None]) -> dict:
    """The process group's timeout fired in `t`'s collective: where each rank that did not join
    it was (`records`: every rank's last heartbeat)."""
    ms = next(int(g) for g in TIMED_OUT.search(t["error"]).groups() if g)
    failed = {label(f) for f in failures}
    away = [f"{where(r)} in phase {r['phase']} of step {r['step']}"
            + (f", itself in {r['collective']}" if r.get("collective") else ", not in a collective")
            for rank, r in sorted(records.items()) if r and label(r) not in failed]
    line = (f"the process-group timeout fired: {where(t)} waited {ms / 1000:g} s (dist.timeout_s) in "
            f"{t.get('collective') or 'a collective'} at step {t['step']}"
            + (f"; the rank(s) it waited for: {'; '.join(away)}" if away else "")
            + "; set watchdog.stall_s below dist.timeout_s to have a hang named sooner, with every "
              "rank's stack")
    return {"kind": "timeout", "line": line, "rank": t["rank"], "host": t["host"], "signal": None,
            "step": t["step"], "timeout_s": ms / 1000, "collective": t.get("collective"), "first": t,
            "waited_for": [r for rank, r in sorted(records.items()) if r and label(r) not in failed],
            "failures": failures}


# A straggler is also slower by this much a step: below it, the difference is timer noise (a CPU
# step of tiny models takes ~20 ms, and 1.3x of that is scheduling jitter, not a slow rank).
STRAGGLER_MIN_EXCESS_S = 0.01


def stragglers(times: list[float], ratio: float) -> tuple[int, float, float, list[int]]:
    """(the slowest rank, its time over the median of the other ranks, that median, the ranks above
    `ratio` x the median of the others and STRAGGLER_MIN_EXCESS_S over it). Against the others,
    not all: with two ranks a rank ten times slower is 10x the other, but under 2x the median of
    both."""
    n = len(times)
    if n < 2:
        return 0, 1.0, times[0] if times else 0.0, []
    order = sorted(range(n), key=lambda r: times[r])
    position = {r: i for i, r in enumerate(order)}

    def others_median(r: int) -> float:
        skip = position[r]  # the k-th of the others is the k-th of all, or the next one past r
        kth = [times[order[k if k < skip else k + 1]] for k in ((n - 2) // 2, (n - 1) // 2)]
        return sum(kth) / 2

    medians = [others_median(r) for r in range(n)]
    ratios = [times[r] / medians[r] if medians[r] > 0 else 1.0 for r in range(n)]
    slowest = max(range(n), key=lambda r: ratios[r])
    slow = [r for r in range(n) if ratios[r] > ratio and times[r] - medians[r] > STRAGGLER_MIN_EXCESS_S]
    return slowest, ratios[slowest], medians[slowest], slow


def is_secondary(exc: BaseException) -> bool:
    """An error a rank gets because another rank died (its connection went), not a cause."""
    return bool(PEER_LOSS.search(f"{type(exc).__name__}: {exc}"))
