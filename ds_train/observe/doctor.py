"""`ds-train doctor RUN_DIR | LOGFILE`: what went wrong, and what to do, from a run directory or any
log (a pdsh or SLURM output file).

Every line of the logs is given at most one class (the most specific pattern that matches it);
the run directory's own records add the watchdog's hang and failure reports and a non-finite
loss. Findings are ranked with causes before their consequences (a missing module before the
connection errors it leaves on the other ranks), each with fixes in order. A CUDA OOM in a run
directory gets the memory plan's fix: the cheapest change the planner says fits.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from ds_train.checkpoint.rundir import RunPaths, read_run
from ds_train.errors import UserError
from ds_train.observe.doctor_fixes import fixes
from ds_train.observe.rl_findings import RL_TITLES, rl_findings, rl_statistics

# (class, title, pattern). Order: most specific first; a line takes the first class that matches.
PATTERNS: list[tuple[str, str, str]] = [
    ("cuda_oom", "CUDA out of memory",
     r"CUDA out of memory|OutOfMemoryError: CUDA|CUBLAS_STATUS_ALLOC_FAILED|out of GPU memory; the plan|"
     r"CUDA error: out of memory"),
    ("op_build", "a DeepSpeed op could not be built (its JIT compile)",
     r"deepspeed/ops/op_builder/|Unable to JIT load the \w+ op|MissingCUDAException|"
     r"CUDA_HOME (environment variable is not set|does not exist)|Ninja is required to load C\+\+ extensions|"
     r"Error building extension '|DeepSpeed JIT builder for '|nvcc fatal|nvcc: (not found|command not found)"),
    ("cpu_oom", "host (CPU) memory exhausted",
     r"DefaultCPUAllocator: can't allocate memory|std::bad_alloc|\bMemoryError\b|Cannot allocate memory|"
     r"oom[-_]kill(ed)? event|OOM Killed|Out of memory: Killed process|Memory cgroup out of memory"),
    ("disk_full", "disk full", r"No space left on device|ENOSPC|Disk quota exceeded|\[Errno 28\]|"
                               r"PytorchStreamWriter failed writing|needs about [\d.]+ \w+, [\d.]+ \w+ free"),
    ("missing_module", "a Python module or version missing on a node",
     r"ModuleNotFoundError: No module named|ImportError: cannot import name|No module named '|"
     r"install the same versions on every node|differs from this machine's|"
     r"^(\S+: )?\S*(python|deepspeed|ds-train)\S*: (command not found|No such file or directory)$"),
    ("wandb_login", "Weights & Biases login", r"wandb.*(api[_ ]key|API key|wandb login|not logged in)|"
                                              r"wandb\.errors\.(AuthenticationError|UsageError|CommError)|"
                                              r"wandb: (ERROR|Network error).*(connect|resolve|retry|timed out)"),
    ("port_in_use", "address or port in use",
     r"[Aa]ddress already in use|EADDRINUSE|errno: 98|cannot listen on .*another job holds the port"),
    ("ssh", "ssh / pdsh could not reach a node",
     r"not reachable by password-less ssh|^\s*unreachable: |^(pdsh@\S+: )?[\w.-]+: ssh: |"
     r"ssh exited with exit code 255|Permission denied \((publickey|password)|Host key verification failed|"
     r"was not reachable via ssh|'ssh', .*exit status 255"),
    ("nccl_timeout", "NCCL collective timed out",
     r"Watchdog caught collective operation timeout|ran for \d+ milliseconds before timing out|"
     r"NCCL.*[Tt]imeout|collective operation timeout|the process-group timeout fired"),
    ("nccl_error", "NCCL error", r"NCCL error|nccl\w*Error|NCCL WARN|NET/IB|ncclSystemError|ncclInternalError|"
                                 r"ncclRemoteError|ncclUnhandledCudaError|ncclInvalidUsage"),
    ("cuda_error", "a CUDA error: a kernel or the GPU failed",
     r"CUDA error: |device-side assert triggered|AcceleratorError|illegal memory access|unspecified launch failure|"
     r"uncorrectable ECC error|CUBLAS_STATUS_(EXECUTION_FAILED|INTERNAL_ERROR|NOT_INITIALIZED|ARCH_MISMATCH)|"
     r"CUDNN_STATUS_(EXECUTION_FAILED|INTERNAL_ERROR|MAPPING_ERROR)|NVRM: Xid|\.cu:\d+: .*Assertion `|"
     r"CUDA driver version is insufficient|no CUDA GPUs are available"),
    ("rendezvous", "rendezvous (TCPStore / libuv) failed",
     r"DistStoreError|libuv|did not reach the rendezvous|could not reach the rendezvous|"
     r"Rendezvous(Timeout|Connection|Closed)Error|waiting for clients|rendezvous at .* ended before|"
     r"DistNetworkError|(client|server) socket has (failed|timed out)|failed to connect to .*\d+\.\d+\.\d+\.\d+"),
    ("nonfinite", "non-finite loss or gradients",
     r"consecutive steps with non-finite gradients|NonFiniteStop|loss (is )?(nan|inf)\b|non-finite weights"),
    ("hang", "a hang: ranks stopped making progress", r"hang: no progress for|watchdog\.stall_s\)"),
    ("killed_rank", "a rank was killed", r"died without an error|killed by SIGKILL|exits with return code = -9|"
                                        r"\bKilled\b|signal 9\b|SIGKILL|return code = -(9|15)\b|"
                                        r"ssh exited with exit code 247|log ends without a word"),
    ("config_error", "bad input (config, batch math, command line)",
     r"ds-train(\[rank \d+\])?: error: (?!hang:|rank \d+ on node|the job ended|start-up:|preflight:|the process-group)|"
     r"global_batch_size.*(divisible|must be)|unknown key"),
    ("rank_error", "an exception on a rank", r"failed first, in phase|^(\S+: )?(\[rank\d+\]: )?Traceback \(most recent|"
                                             r"^(\S+: )?(\[rank\d+\]: )?(\w+\.)*\w+(Error|Exception): "),
]
# Causes before consequences: the finding of the class listed first heads the report.
PRIORITY = ["config_error", "missing_module", "op_build", "ssh", "port_in_use", "wandb_login", "disk_full", "cuda_oom",
            "cuda_error", "cpu_oom", "nccl_error", "nccl_timeout", "rendezvous", "nonfinite", "hang", "killed_rank",
            "rank_error", "rl_env_failing", "rl_truncated", "rl_no_signal", "rl_stale_dropped", "rl_trainer_starved",
            "rollout_mismatch", "router_collapse"]
COMPILED = [(cls, title, re.compile(p)) for cls, title, p in PATTERNS]
RANK_ERROR = next(p for cls, _, p in COMPILED if cls == "rank_error")
# Findings of a post-training run's statistics (metrics.jsonl), not of its logs.
TITLES = {cls: title for cls, title, _ in PATTERNS} | RL_TITLES | {
    "router_collapse": "a collapsed mixture-of-experts router: one expert takes most of a layer's tokens"}
ROUTER_RECENT = 5  # the logged steps a collapsed router must show it on, each
ROUTER_COLLAPSED = 0.5  # the share of a layer's tokens choosing one expert (and 2x a uniform router's) that is collapse
# Lines that look alarming and are not: DeepSpeed's and torch's routine warnings.
BENIGN = re.compile(r"\[WARNING\].*(get_lr|Setting accelerator|real_accelerator)|UserWarning|FutureWarning|"
                    r"DeprecationWarning|^\s*warnings\.warn")
# A C++ stack frame of a torch error (its class names say nothing of the cause).
NATIVE_FRAME = re.compile(r"^(\S+: )?(\[rank\d+\]:)?\s*frame #\d+: ")
# What a rank prints when another rank died: connection errors, the store of a dead rank 0.
CONSEQUENCE = re.compile(r"Connection (closed|reset) by peer|stopped answering|remote worker crashing|Broken pipe|"
                         r"Failed to recv, got 0 bytes")
# Who said it: a pdsh prefix (host:), torch's [rankN]: prefix, or our rank log's `HOST rankN`.
PDSH_HOST = re.compile(r"^(?:pdsh@\S+: )?([\w.-]+): ")
TORCH_RANK = re.compile(r"\[rank(\d+)\]")
RANK_LOG = re.compile(r"^\d{4}-\d\d-\d\d [\d:.]+ (\S+) rank(\d+) ")
RANK_LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\d [\d:.]+ \S+ rank\d+ (out|err|log|[A-Z]+): ")  # what the rank printed


@dataclass
class Finding:
    cls: str
    title: str
    evidence: list[str] = field(default_factory=list)  # `file:line: text`, the first few
    fixes: list[str] = field(default_factory=list)
    where: str = ""  # host / rank when the lines say
    context: list[str] = field(default_factory=list)  # the lines after the first evidence


@dataclass
class Source:
    name: str
    lines: list[str]
    offset: int = 0  # lines skipped before these (line numbers stay the file's)


# The first line a rank writes to its log in each attempt (run.py): earlier lines are history.
ATTEMPT = re.compile(r"^\S+ \S+ \S+ rank\d+ log: pid \d+ host ")


def read_sources(path: Path) -> list[Source]:
    """The logs to read: a file; or a run directory's rank logs (from the start of the last attempt:
    a resumed run appends), train.log where there are none, and any *.log / *.out saved in it (a
    console or SLURM output)."""
    if path.is_file():
        files = [path]
    else:
        logs = RunPaths(path).logs
        files = sorted(logs.glob("rank_*.log")) or sorted(logs.glob("*.log"))
        files += sorted(p for p in path.glob("*") if p.suffix in (".log", ".out") and p.is_file())
    out = []
    for f in files:
        try:
            data = f.read_bytes()
        except OSError as e:
            raise UserError(f"doctor: cannot read {f} ({e.strerror or e})") from None
        if path.is_file() and b"\0" in data[:1 << 16]:  # a checkpoint, a core, an archive: no log has NUL bytes
            raise UserError(f"doctor: {f} is not a log (binary data: a NUL byte at offset {data.index(0)}); give a "
                            f"run directory (output_dir) or a text log (a console, pdsh or SLURM output)")
        lines = data.decode(errors="replace").splitlines()
        start = max((i for i, line in enumerate(lines) if ATTEMPT.match(line)), default=0)
        name = str(f.relative_to(path)) if path.is_dir() else str(f)
        out.append(Source(name, lines[start:], offset=start))
    return out


def classify_line(line: str) -> str | None:
    if BENIGN.search(line) or NATIVE_FRAME.match(line):
        return None
    if CONSEQUENCE.search(line):  # another rank died: at most an exception on this one, never a cause
        return "rank_error" if RANK_ERROR.search(line) else None
    for cls, _, pattern in COMPILED:
        if pattern.search(line):
            return cls
    return None


def who(line: str) -> str:
    m = RANK_LOG.match(line)
    if m:
        return f"rank {m.group(2)} on {m.group(1)}"
    host = PDSH_HOST.match(line)
    if host and re.search(r"(Error|Exception|Warning|Exit)$|^(File|Traceback|frame)$", host.group(1)):
        host = None  # `RuntimeError: ...` is not a host's output
    rank = TORCH_RANK.search(line)
    host_name = host.group(1) if host and not host.group(1).startswith(("ds-train", "[")) else ""
    if rank:
        return f"rank {rank.group(1)}" + (f" on {host_name}" if host_name else "")
    return host_name


def scan(sources: list[Source]) -> dict[str, Finding]:
    found: dict[str, Finding] = {}
    for src in sources:
        for i, line in enumerate(src.lines, src.offset + 1):
            cls = classify_line(RANK_LOG_LINE.sub("", line))
            if cls is None:
                continue
            f = found.setdefault(cls, Finding(cls, TITLES[cls]))
            if not f.evidence:
                f.context = src.lines[i - src.offset:i - src.offset + 5]  # the lines after the first one
            if len(f.evidence) < 3 and not any(line.strip()[:120] in e for e in f.evidence):
                f.evidence.append(f"{src.name}:{i}: {line.strip()[:300]}")
            if not f.where:
                f.where = who(line)
    return found


def diagnose(*path_args: str) -> list[Finding]:
    """The findings for run directories and log files (a run directory, the launcher's console,
    `dmesg` of a node: one job), most likely cause first."""
    sources, views, found = [], [], {}
    for path_arg in path_args:
        path = Path(path_arg)
        if not path.exists():
            raise UserError(f"doctor: {path_arg!r} does not exist; give a run directory (output_dir) or a log file")
        these = read_sources(path)
        view = read_run(path) if path.is_dir() else None
        if view is not None and not these and not view.metrics and not view.heartbeats:
            raise UserError(f"doctor: {path_arg} holds no logs (logs/*.log, *.log, *.out) and no run records; give "
                            f"a run directory or the launcher's console output (a pdsh or SLURM log)")
        sources += these
        views += [view] if view is not None else []
    for cls, f in scan(sources).items():
        found[cls] = f
    errors = [e for e in found["rank_error"].evidence if "Error" in e] if "rank_error" in found else []
    if errors and all(CONSEQUENCE.search(e) for e in errors):
        found["rank_error"].title = "connection errors after another rank died (consequences)"
    for view in views:
        _from_records(view, found)
        _silent_ranks([s for s in sources if s.name.startswith("logs/")], found)
    view = views[0] if views else None
    for f in found.values():
        f.fixes = fixes(f, view)
    return sorted(found.values(), key=lambda f: PRIORITY.index(f.cls))


def _from_records(view, found: dict[str, Finding]) -> None:
    """What the run directory's records say beyond its logs."""
    if view.hang:
        f = found.setdefault("hang", Finding("hang", TITLES["hang"]))
        f.evidence.insert(0, f"logs/hang_report.json: {view.hang.get('line', '')[:300]}")
        ranks = view.hang.get("ranks") or {}
        culprits = [ranks.get(str(r)) for r in view.hang.get("never_arrived", []) + view.hang.get("silent", [])]
        f.where = ", ".join(f"rank {c['rank']} on {c.get('addr') or c.get('host')}" for c in culprits if c)
    if view.failure:
        cls = {"killed": "killed_rank", "timeout": "nccl_timeout"}.get(view.failure.get("kind"), "rank_error")
        f = found.setdefault(cls, Finding(cls, TITLES[cls]))
        f.evidence.insert(0, f"logs/failure.json: {view.failure.get('line', '')[:300]}")
        first = view.failure.get("first") or {}
        f.where = f"rank {first.get('rank')} on {first.get('addr') or first.get('host')}" if first else f.where
    if not view.hang and view.state()[0] in ("dead", "not started") and view.heartbeats:
        _stuck_without_report(view, found)
    if view.kind.name == "ript":  # the statistics of a post-training run (ds_train/observe/rl_findings.py)
        for cls, evidence, context in rl_findings(view.metrics):
            f = found.setdefault(cls, Finding(cls, TITLES[cls]))
            f.evidence += evidence
            f.context += context
    _router_collapse(view, found)
    losses = [r.get("train/loss") for r in view.metrics[-3:]]
    bad = [x for x in losses if isinstance(x, float) and not math.isfinite(x)]
    if bad:
        f = found.setdefault("nonfinite", Finding("nonfinite", TITLES["nonfinite"]))
        f.evidence.append(f"metrics.jsonl: train/loss {bad[-1]} at step {view.metrics[-1]['step']}")


def _router_collapse(view, found: dict[str, Finding]) -> None:
    """A mixture-of-experts layer whose router sent most tokens to one expert on each of the last
    ROUTER_RECENT logged steps (ds_train/model/routers.py's metrics)."""
    recent = [r for r in view.metrics if r.get("moe/tokens_per_expert")][-ROUTER_RECENT:]
    if len(recent) < ROUTER_RECENT:
        return
    limit = min(1.0, max(ROUTER_COLLAPSED, 2 * recent[-1].get("moe/uniform_share", 0.0)))
    for layer in range(len(recent[-1]["moe/layer_top_share"])):
        shares = [r["moe/layer_top_share"][layer] for r in recent if layer < len(r["moe/layer_top_share"])]
        if len(shares) < len(recent) or min(shares) < limit:
            continue
        row = recent[-1]["moe/tokens_per_expert"][layer]
        f = found.setdefault("router_collapse", Finding("router_collapse", TITLES["router_collapse"]))
        f.evidence.append(f"metrics.jsonl: steps {recent[0]['step']}-{recent[-1]['step']}: MoE layer {layer}'s expert "
                          f"{row.index(max(row))} was chosen by {min(shares):.0%}-{max(shares):.0%} of its tokens "
                          f"(a uniform router: {recent[-1].get('moe/uniform_share', 0.0):.0%})")


def _stuck_without_report(view, found: dict[str, Finding]) -> None:
    """A job that ended (no live heartbeat) while its ranks had stopped moving, and no watchdog said
    so (watchdog.stall_s=0, or killed from outside first): the heartbeats tell who waited for whom."""
    from ds_train.observe.reports import classify, where

    quiet = max(60.0, 30 * view.heartbeat_s)
    records = view.heartbeats
    if not all(float(hb.get("idle_s") or 0) > quiet for hb in records.values()):
        return
    verdict = classify(records, set(records))
    culprits = verdict["never_arrived"] or sorted(records)
    f = found.setdefault("hang", Finding("hang", TITLES["hang"]))
    for r in culprits:
        hb = records[r]
        f.evidence.insert(0, f"heartbeats/rank_{r}.json: {where(hb)} made no progress for {hb['idle_s']:.0f} s in "
                             f"phase {hb['phase']} of step {hb['step']}, outside any collective")
    for r in verdict["waiting"]:
        f.evidence.append(f"heartbeats/rank_{r}.json: {where(records[r])} waited in "
                          f"{records[r].get('collective') or 'a collective'} for {records[r]['idle_s']:.0f} s")
    f.where = ", ".join(f"rank {r} on {records[r].get('addr') or records[r].get('host')}" for r in culprits)


ENDED = re.compile(r" rank\d+ log: (run ended|exit \d+)")
SAID_ERROR = re.compile(r" rank\d+ err: .*(Error|error|Exception|Killed)")


def _silent_ranks(sources: list[Source], found: dict[str, Finding]) -> None:
    """A rank whose log (this attempt) ends without its exit line or any error, while another rank's
    says how it ended: it died without a word (SIGKILL: the OOM killer, kill -9, its node)."""
    logs = {s.name: s for s in sources if re.fullmatch(r"logs/rank_\d+\.log", s.name)}
    spoke = {name for name, s in logs.items() if any(ENDED.search(l) or SAID_ERROR.search(l) for l in s.lines)}
    if not spoke or spoke == set(logs) or set(found) - {"rank_error", "killed_rank"}:
        return  # nobody ended, or everybody did, or a cause is known (a hang, an OOM, ...)
    causes = [l for s in logs.values() for l in s.lines if SAID_ERROR.search(l) and RANK_ERROR.search(
        RANK_LOG_LINE.sub("", l)) and not CONSEQUENCE.search(l)]
    if causes:
        return  # a rank raised: the silent ones were stopped by the launcher after it
    for name in sorted(set(logs) - spoke):
        src = logs[name]
        last = src.lines[-1] if src.lines else ""
        known = "killed_rank" in found  # the launcher's exit code or the failure report said it first
        f = found.setdefault("killed_rank", Finding("killed_rank", TITLES["killed_rank"]))
        f.evidence.insert(len(f.evidence) if known else 0,
                          f"{name}:{src.offset + len(src.lines)}: the log ends without a word (no exit line, no "
                          f"error) while other ranks' say how they ended; its last line: {last[:160]}")
        f.where = f.where or who(last)


def format_findings(target: str, findings: list[Finding]) -> str:
    """The findings, causes first; the last line says what was found (or that nothing was)."""
    if not findings:
        return f"ds-train doctor: {target}: nothing wrong found"
    lines = [f"ds-train doctor: {target}: {len(findings)} finding(s), the most likely cause first"]
    named = [f"{f.title}{f' ({f.where})' if f.where else ''} [{f.cls}]" for f in findings]
    for i, (f, name) in enumerate(zip(findings, named), 1):
        lines.append(f"{i}. {name}")
        lines += [f"   seen: {e}" for e in f.evidence[:2]]
        lines += [f"   fix: {x}" for x in f.fixes]
    lines.append(f"ds-train doctor: {target}: {len(findings)} finding(s); the most likely cause: {named[0]}")
    return "\n".join(lines)


def doctor(paths: list[str]) -> int:
    findings = diagnose(*paths)
    for path in paths:  # a post-training run's numbers, whatever was found
        view = read_run(path) if Path(path).is_dir() else None
        said = rl_statistics(view.metrics) if view is not None and view.kind.name == "ript" else ""
        if said:
            print(f"ds-train doctor: {path}: {said}")
    print(format_findings(" ".join(paths), findings))
    return 1 if findings else 0
