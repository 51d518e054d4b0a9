"""Preflight for a multi-node launch: everything the deepspeed launcher assumes, checked per host.

Every host is probed in parallel over `ssh -o BatchMode=yes -o ConnectTimeout=N` (argv lists only;
host names were validated by the hostfile parser and never enter a shell string). One probe runs
the launcher's own Python on the host and reports its path and version, the versions of every package
the run imports (run_packages: ds_train's declared dependencies, and the optional ones the run's config
turns on), whether the working directory exists and, on the master host, the first free port.
compare_versions() names each host and package that differs from this machine. It
also lists the host's GPUs (`nvidia-smi --query-gpu`, no CUDA context) and the CUDA runtime and NCCL
versions torch was built with; a host without nvidia-smi has no GPUs (DeepSpeed's CPU accelerator
then runs one process per slot). check_gpus() compares them with the slots the launch gives each
host, the memory plan's per-GPU peak (`needed_gib`, computed by the caller) and the other hosts.
check_identity() refuses two hostfile names that reach one machine (same boot id and host name, as
each machine itself reports them: an ssh alias need not resolve here), which would start two sets
of ranks on its GPUs, unless DS_TRAIN_ONE_MACHINE lists both (a test cluster on one machine,
scripts/local_cluster.sh). Every problem on every host is reported at once.

How many ranks each node runs is read from the hostfile as the deepspeed launcher will run it
(`node_ranks`, a `NodeRanks`): the slots --include/--exclude leave, or --num_gpus on every node whatever its
slots=; the ranks numbered node by node in hostfile order, each rank's LOCAL_SIZE its own node's count
(deepspeed/launcher/launch.py). A hostfile whose nodes differ is said so, node by node; a job split into
trainer and rollout ranks (ript.rollout_ranks_per_node) on such nodes, or on a node too small to keep a
trainer, is refused in one line naming the node, its hostfile line and slots, before any ssh.
"""

from __future__ import annotations

import json
import math
import platform
import re
import shlex
import subprocess
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Mapping

from ds_train.errors import UserError
from ds_train.launch.hostfile import Host, is_ip_address
from ds_train.launch.packages import import_problem, local_versions, run_packages
from ds_train.launch.probe import PACKAGES, PORT_TRIES, PROBE

# Seconds a probe may take beyond the ssh connect timeout: it imports torch, which takes seconds
# from a local disk and can take tens of seconds from a cold shared file system.
PROBE_TIME_S = 60
MiB_PER_GiB = 1024  # nvidia-smi reports memory in MiB
# Hostfile names (comma-separated) that are one machine on purpose: a test cluster on loopback addresses.
ONE_MACHINE_ENV = "DS_TRAIN_ONE_MACHINE"


# What passes through the deepspeed launcher's pdsh command line unchanged: it writes the working
# directory and Python path unquoted, and an argument without a space as it is.
_SHELL_SAFE = re.compile(r"[\w@%+=:,./-]+")
# An argument with a space goes inside double quotes, where these stay live.
_LIVE_IN_DOUBLE_QUOTES = re.compile(r'[$`\\\n\r]')


@dataclass(frozen=True)
class Node:
    """One node of the launch: its host, the ranks the deepspeed launcher starts there and its hostfile line."""

    host: str
    ranks: int  # processes started there: the slots a filter left, or --num_gpus
    slots: int  # its hostfile line's slots=
    where: str  # `hostfile:LINE`


@dataclass(frozen=True)
class NodeRanks:
    """Each node's ranks, in rank order, as the deepspeed launcher starts them (pure): node after node in
    hostfile order, node i's ranks following node i-1's, each rank's LOCAL_SIZE its own node's count."""

    nodes: tuple[Node, ...]

    @property
    def world_size(self) -> int:
        return sum(n.ranks for n in self.nodes)

    @property
    def even(self) -> bool:
        return len({n.ranks for n in self.nodes}) == 1

    @property
    def per_node(self) -> int:
        """What divides every node's ranks (each node's count when they are even)."""
        return math.gcd(*(n.ranks for n in self.nodes))

    def describe(self) -> str:
        """`node1: 4 (ranks 0-3), node2: 2 (ranks 4-5)`."""
        parts, first = [], 0
        for n in self.nodes:
            ranks = f"rank {first}" if n.ranks == 1 else f"ranks {first}-{first + n.ranks - 1}"
            parts.append(f"{n.host}: {n.ranks} ({ranks})")
            first += n.ranks
        return ", ".join(parts)

    def problems(self, rollout_per_node: int = 0, key: str = "ript.rollout_ranks_per_node") -> list[str]:
        """A job split into trainer and rollout ranks (the last `rollout_per_node` of every node generate,
        ds_train/topology.py split_job) that these nodes cannot run: one line, naming the nodes."""
        if rollout_per_node <= 0:
            return []
        small = [n for n in self.nodes if n.ranks <= rollout_per_node]
        if small:
            rest = NodeRanks(tuple(n for n in self.nodes if n not in small))
            leave = (f", leave {'it' if len(small) == 1 else 'them'} out (--exclude {'@'.join(n.host for n in small)})"
                     if rest.nodes and not rest.problems(rollout_per_node, key) else "")  # a fix only where it is one
            least = min(n.ranks for n in small)
            fewest = f"set {key} below {least}" if least > 1 else f"leave {key} out (no rollout ranks)"
            return [f"{key}={rollout_per_node}: {_named(small)} {'runs' if len(small) == 1 else 'run'} no more ranks "
                    f"than that, and the last {rollout_per_node} of every node are rollout ranks: none would be left "
                    f"to train there; start {rollout_per_node + 1} or more ranks on every node (slots=, --num_gpus, "
                    f"--include){leave}, or {fewest}"]
        if not self.even:
            most = max(n.ranks for n in self.nodes)
            fewer = [n for n in self.nodes if n.ranks != most]
            return [f"{key}={rollout_per_node}: {_named(fewer)} {'runs' if len(fewer) == 1 else 'run'} fewer ranks "
                    f"than {_named([n for n in self.nodes if n.ranks == most])}, and a split job needs the same number "
                    f"on every node (the last {rollout_per_node} of each are rollout ranks, each side numbered node by "
                    f"node); give every node the same slots=, or start {min(n.ranks for n in self.nodes)} on each with "
                    f"--num_gpus {min(n.ranks for n in self.nodes)}"]
        return []

    def notes(self) -> list[str]:
        """Nodes that differ, and --num_gpus starting more ranks on a node than its slots=."""
        notes = []
        if not self.even:
            notes.append(f"the nodes run different numbers of ranks: {self.describe()}; the deepspeed launcher "
                         f"numbers them node by node and gives each rank its own node's count (LOCAL_SIZE): a number "
                         f"that must divide every node's ranks (ript.vllm_tensor_parallel_size) must divide "
                         f"{self.per_node}, and a split job (ript.rollout_ranks_per_node) cannot run")
        over = [n for n in self.nodes if n.ranks > n.slots]
        if over:
            notes.append(f"--num_gpus {over[0].ranks} starts {over[0].ranks} ranks on {_named(over)} too (the "
                         f"deepspeed launcher gives every node --num_gpus ranks, whatever its slots=)")
        return notes


def _named(nodes: list[Node]) -> str:
    """`hostfile:2 (node2: slots=2, 2 ranks)`, joined by ` and `."""
    return " and ".join(f"{n.where} ({n.host}: slots={n.slots}, {n.ranks} rank{'s' if n.ranks != 1 else ''})"
                        for n in nodes)


def node_ranks(pool: Mapping[str, list[int]], hosts: list[Host], hostfile: str = "hostfile") -> NodeRanks:
    """Each node's ranks from the launch's pool (hostfile.select_hosts: the slot ids the launcher uses per host,
    in hostfile order) and the hostfile's lines."""
    lines = {h.name: h for h in hosts}
    return NodeRanks(tuple(Node(name, len(slots), lines[name].slots if name in lines else len(slots),
                                f"{hostfile}:{lines[name].line}" if name in lines else hostfile)
                           for name, slots in pool.items()))


@dataclass(frozen=True)
class SshOptions:
    timeout_s: int = 10
    extra: tuple[str, ...] = ()  # PDSH_SSH_ARGS_APPEND (e.g. -F config) and -p from --ssh_port

    @classmethod
    def from_env(cls, environ: Mapping[str, str], timeout_s: int, ssh_port: int | None = None) -> "SshOptions":
        """The ssh options pdsh will use: PDSH_SSH_ARGS_APPEND, plus --ssh_port as DeepSpeed adds it."""
        try:
            extra = shlex.split(environ.get("PDSH_SSH_ARGS_APPEND", ""))
        except ValueError as e:
            raise UserError(f"environment: PDSH_SSH_ARGS_APPEND cannot be split into ssh options ({e}); "
                            f"fix its quoting") from None
        if ssh_port is not None:
            extra += ["-p", str(ssh_port)]
        return cls(timeout_s, tuple(extra))

    def argv(self, host: str, remote: list[str]) -> list[str]:
        """ssh argv for one host; the remote command is quoted for the remote shell word by word."""
        return ["ssh", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={self.timeout_s}", *self.extra,
                "--", host, shlex.join(remote)]


@dataclass
class HostProbe:
    host: str
    info: dict | None = None
    problem: str | None = None
    unreachable: bool = False


@dataclass
class PreflightResult:
    master_addr: str
    master_port: int
    world_size: int
    notes: list[str] = field(default_factory=list)
    on_gpu: bool = False  # the hosts have GPUs (the ranks run on CUDA)


def compare_versions(here: Mapping[str, str | None], hosts: Mapping[str, Mapping[str, str | None]]) -> list[str]:
    """One line per package and version that differs from this machine's, naming the hosts (pure).

    `here`: name -> version on this machine (None: not installed), "Python" among them; `hosts`: the
    same per host. A host that does not report a name counts as not having it.
    """
    found: dict[tuple[str, str | None], list[str]] = {}
    for host, theirs in hosts.items():
        for name, mine in here.items():
            if theirs.get(name) != mine:
                found.setdefault((name, theirs.get(name)), []).append(host)
    problems = []
    for (name, value), names in found.items():
        mine = here[name]
        if name == "Python":
            fix = f"use the same Python ({mine}) and environment on every node"
        elif mine is None:
            fix = f"install the same versions on every node (this machine has no {name}: pip uninstall {name} there)"
        else:
            fix = f"install the same versions on every node (pip install {name}=={mine} there)"
        problems.append(f"{', '.join(names)}: {name} {value or 'missing'} (this machine: {mine or 'missing'}); {fix}")
    return problems


def probe_host(host: str, ssh: SshOptions, python: str, cwd: str, port: int,
               packages: tuple[str, ...] = PACKAGES) -> HostProbe:
    """Run PROBE on `host` with `python`; a failure becomes a one-line problem, never an exception."""
    argv = ssh.argv(host, [python, "-c", PROBE, cwd, str(port), *packages])  # quoted word by word
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, stdin=subprocess.DEVNULL,
                              timeout=ssh.timeout_s + PROBE_TIME_S)
    except subprocess.TimeoutExpired:
        return HostProbe(host, problem=f"{host}: no answer within {ssh.timeout_s + PROBE_TIME_S} s over ssh",
                         unreachable=True)
    except FileNotFoundError:
        raise UserError("ssh: command not found; install the OpenSSH client (apt-get install "
                        "openssh-client)") from None
    last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    if proc.returncode == 255:
        return HostProbe(host, problem=f"{host}: not reachable by password-less ssh ({last})", unreachable=True)
    if proc.returncode == 127:
        return HostProbe(host, problem=f"{host}: {python} not found there; the launcher runs this same "
                                       f"Python path on every node: install the environment at that path")
    if proc.returncode != 0:
        return HostProbe(host, problem=f"{host}: the probe with {python} failed (exit {proc.returncode}: {last})")
    try:
        return HostProbe(host, info=json.loads(proc.stdout.strip().splitlines()[-1]))
    except (json.JSONDecodeError, IndexError):
        return HostProbe(host, problem=f"{host}: unreadable probe output {proc.stdout[-200:]!r} "
                                       f"(does the login shell print something?)")


def probe_hosts(hosts: list[str], ssh: SshOptions, python: str, cwd: str, master_port: int,
                packages: tuple[str, ...] = PACKAGES) -> list[HostProbe]:
    """All hosts at once; the first one (the master) also looks for a free port."""
    with ThreadPoolExecutor(max_workers=min(32, len(hosts))) as pool:
        futures = [pool.submit(probe_host, host, ssh, python, cwd, master_port if i == 0 else 0, packages)
                   for i, host in enumerate(hosts)]
        return [f.result() for f in futures]


def check_probes(probes: list[HostProbe], python: str, cwd: str, versions: Mapping[str, str | None],
                 python_version: str, modules: tuple[tuple[str, str, str], ...] = ()) -> list[str]:
    """Problems with the environment on each host (pure: takes the probes' answers). `modules`: the
    run's (module, distribution, fix) the probes imported (packages.run_modules)."""
    problems = [p.problem for p in probes if p.problem]
    unreachable = [p.host for p in probes if p.unreachable]
    if unreachable:
        problems.append(f"unreachable: {', '.join(unreachable)}; check the names, that sshd runs there and "
                        f"that `ssh -o BatchMode=yes HOST true` works from this machine without a password "
                        f"(ssh options reach pdsh and this check through PDSH_SSH_ARGS_APPEND)")
    for p in probes:
        if p.info and p.info["python"] != python:
            problems.append(f"{p.host}: Python {p.info['python']} differs from this machine's {python}; the "
                            f"launcher runs this same path on every node: use the same environment everywhere")
    here = {"Python": python_version, **versions}
    problems += compare_versions(here, {p.host: {"Python": p.info["python_version"], **p.info["versions"]}
                                        for p in probes if p.info})
    for p in probes:
        if not p.info:
            continue
        if not p.info["cwd_exists"]:
            problems.append(f"{p.host}: working directory {cwd} does not exist there; the launcher runs "
                            f"`cd {cwd}` on every node: use a shared file system or the same checkout path")
        for module, dist, fix in modules:
            if module in (p.info.get("import_errors") or {}):
                problems.append(import_problem(module, dist, fix, p.info["import_errors"][module], f"{p.host}: "))
    return problems


def one_machine_hosts(environ: Mapping[str, str]) -> frozenset[str]:
    """The hostfile names DS_TRAIN_ONE_MACHINE says are one machine on purpose."""
    return frozenset(name.strip() for name in environ.get(ONE_MACHINE_ENV, "").split(",") if name.strip())


def check_identity(probes: list[HostProbe], where: Mapping[str, str] | None = None,
                   one_machine: frozenset[str] = frozenset()) -> tuple[list[str], list[str]]:
    """Problems and notes: hosts whose probes report one machine (pure: takes the probes' answers).

    `where`: host -> its hostfile line (`hostfile:3`), to name it by; `one_machine`: names allowed to
    share a machine (DS_TRAIN_ONE_MACHINE), said in a note instead.
    """
    where = where or {}
    machines: dict[tuple[str, str], list[str]] = {}
    for p in probes:
        if p.info and p.info.get("boot_id"):  # no /proc there: nothing to compare
            machines.setdefault((p.info["boot_id"], p.info.get("hostname", "")), []).append(p.host)
    problems, notes = [], []
    for (boot, hostname), hosts in machines.items():
        if len(hosts) < 2:
            continue
        if set(hosts) <= one_machine:
            notes.append(f"{', '.join(hosts)} are one machine ({hostname}), as {ONE_MACHINE_ENV} says")
            continue
        named = " and ".join(f"{where[h]} ({h})" if h in where else h for h in hosts)
        problems.append(f"{named} are one machine (host {hostname}, boot id {boot[:8]}): the launch would start "
                        f"a set of ranks per name on its GPUs; list it once with its total slots (a test cluster "
                        f"on one machine on purpose: {ONE_MACHINE_ENV}={','.join(hosts)})")
    return problems, notes


def check_gpus(probes: list[HostProbe], pool: Mapping[str, list[int]],
               needed_gib: float | None = None) -> tuple[list[str], list[str]]:
    """GPU problems and notes (pure: takes the probes' answers and the slot ids each host runs).

    `needed_gib` is the memory plan's per-GPU peak; None skips the free-memory check.
    """
    problems: list[str] = []
    with_gpus, without = [], []
    for p in probes:
        if not p.info:
            continue  # check_probes names it
        if p.info.get("gpu_error"):
            problems.append(f"{p.host}: {p.info['gpu_error']}; fix the NVIDIA driver there (`nvidia-smi` must "
                            f"list the GPUs) or leave the host out (--exclude {p.host})")
        else:
            (with_gpus if p.info.get("gpus") else without).append(p)
    for p in with_gpus:
        problems += _host_gpu_problems(p, pool.get(p.host, []), needed_gib)
    if with_gpus and without:
        problems.append(f"GPUs on {', '.join(p.host for p in with_gpus)} but none on "
                        f"{', '.join(p.host for p in without)} (no nvidia-smi there, or it lists no GPU); one job "
                        f"runs on one kind of accelerator: leave those hosts out (--exclude "
                        f"{'@'.join(p.host for p in without)}) or install the NVIDIA driver there")
    problems += _version_mismatches(with_gpus)
    notes = []
    if without and not with_gpus and not problems:
        counts = [len(pool.get(p.host, [])) for p in without]
        processes = (f"{counts[0]} process{'es' if counts[0] != 1 else ''} per node" if len(set(counts)) == 1
                     else "one process per slot (" + ", ".join(f"{p.host}: {n}" for p, n in zip(without, counts)) + ")")
        notes.append(f"no GPUs on any host: DeepSpeed's CPU accelerator runs {processes}")
    elif with_gpus and not without:
        notes.append(_gpu_summary(with_gpus, pool, needed_gib))
    return problems, notes


def _gib(mib: float) -> float:
    return mib / MiB_PER_GiB


def _host_gpu_problems(p: HostProbe, slots: list[int], needed_gib: float | None) -> list[str]:
    """One host with GPUs: torch can use them, each slot has a GPU, each GPU has the memory."""
    info, gpus = p.info, {g["index"]: g for g in p.info["gpus"]}
    problems = []
    if info.get("torch_error"):
        problems.append(f"{p.host}: torch cannot use the GPUs there ({info['torch_error']}); every rank would fail "
                        f"the same way: install a driver that supports torch's CUDA "
                        f"{info.get('torch_cuda') or '?'}, or the torch build that matches the driver")
    elif "torch_cuda" in info and not info["torch_cuda"]:
        problems.append(f"{p.host}: nvidia-smi lists {len(gpus)} GPU(s) but torch there is a CPU-only build "
                        f"(torch.version.cuda is None); install a CUDA build of torch on every node")
    elif info.get("torch_cuda_available") is False:
        problems.append(f"{p.host}: nvidia-smi lists {len(gpus)} GPU(s) but torch.cuda.is_available() is False "
                        f"there; check the driver against torch's CUDA {info['torch_cuda']} (`nvidia-smi` shows "
                        f"the highest CUDA version the driver supports)")
    if len(gpus) < len(slots):
        problems.append(f"{p.host}: {len(gpus)} GPU(s) but the launch puts {len(slots)} process(es) there (its "
                        f"hostfile slots, --num_gpus or --include); lower its slots= to {len(gpus)} in the "
                        f"hostfile, or choose its GPUs with --include {p.host}:{','.join(map(str, sorted(gpus)))}")
    elif any(s not in gpus for s in slots):
        problems.append(f"{p.host}: slot(s) {', '.join(str(s) for s in slots if s not in gpus)} have no GPU "
                        f"(nvidia-smi lists GPUs {', '.join(map(str, sorted(gpus)))}); choose existing GPUs with "
                        f"--include {p.host}:{','.join(map(str, sorted(gpus)))}")
    for s in slots:
        gpu = gpus.get(s)
        if needed_gib is None or gpu is None or None in (gpu["memory_total_mib"], gpu["memory_used_mib"]):
            continue
        total, used = _gib(gpu["memory_total_mib"]), _gib(gpu["memory_used_mib"])
        if total - used >= needed_gib:
            continue
        head = (f"{p.host}: the memory plan needs {needed_gib:.1f} GiB per GPU; GPU {s} on {p.host} has "
                f"{total - used:.1f} GiB free")
        if total >= needed_gib:  # it would fit on the empty GPU
            problems.append(f"{head} (another process holds {used:.1f} GiB: nvidia-smi); stop that process "
                            f"or leave the GPU out (--exclude {p.host}:{s})")
        else:
            problems.append(f"{head} ({total:.1f} GiB in all); lower the per-GPU memory (`ds-train estimate` "
                            f"ranks the changes) or use larger GPUs")
    return problems


# What must match on every GPU host: (probe key, name in the message).
_MATCHING = (("driver", "NVIDIA driver"), ("torch_cuda", "CUDA runtime (torch.version.cuda)"),
             ("torch_nccl", "NCCL (torch.cuda.nccl.version())"))


def _host_value(info: dict, key: str) -> str:
    if key == "driver":  # one driver per host; nvidia-smi repeats it per GPU
        return ", ".join(sorted({g["driver"] for g in info["gpus"]}))
    return info.get(key) or "none"


def _version_mismatches(with_gpus: list[HostProbe]) -> list[str]:
    problems = []
    for key, what in _MATCHING:
        if key != "driver" and not all(key in p.info for p in with_gpus):
            continue
        hosts_by_value: dict[str, list[str]] = {}
        for p in with_gpus:
            hosts_by_value.setdefault(_host_value(p.info, key), []).append(p.host)
        if len(hosts_by_value) > 1:
            problems.append(f"{what} differs between hosts: " +
                            "; ".join(f"{value} on {', '.join(hosts)}" for value, hosts in hosts_by_value.items()) +
                            "; use the same driver and image (torch build) on every node")
    return problems


def _gpu_summary(with_gpus: list[HostProbe], pool: Mapping[str, list[int]], needed_gib: float | None) -> str:
    """One line: which GPUs on which hosts, the versions, and the least free memory among the used ones."""
    hosts_by_kind: dict[str, list[str]] = {}
    for p in with_gpus:
        names = sorted({g["name"] for g in p.info["gpus"]})
        hosts_by_kind.setdefault(f"{len(p.info['gpus'])} x {' / '.join(names)}", []).append(p.host)
    first = with_gpus[0].info
    line = ("GPUs: " + "; ".join(f"{kind} on {', '.join(hosts)}" for kind, hosts in hosts_by_kind.items()) +
            f" (driver {_host_value(first, 'driver')}, CUDA {_host_value(first, 'torch_cuda')}, "
            f"NCCL {_host_value(first, 'torch_nccl')})")
    free = [_gib(g["memory_total_mib"] - g["memory_used_mib"]) for p in with_gpus for g in p.info["gpus"]
            if g["index"] in pool.get(p.host, []) and None not in (g["memory_total_mib"], g["memory_used_mib"])]
    if needed_gib is not None and free:
        line += f"; the memory plan needs {needed_gib:.1f} GiB per GPU, the least free is {min(free):.1f} GiB"
    return line


def pick_master(probe: HostProbe, master_addr: str, master_port: int) -> tuple[str, int, list[str]]:
    """Master address and port from the first host's probe; a busy port moves to the next free one."""
    notes = []
    if not master_addr:
        # As the deepspeed launcher does (`hostname -I` on the first host) unless the hostfile already
        # names it by address: a hostfile name may be an ssh alias that does not resolve elsewhere.
        addresses = probe.info.get("addresses") or []
        master_addr = probe.host if is_ip_address(probe.host) or not addresses else addresses[0]
    port = probe.info.get("free_port")
    if port is None:
        raise UserError(f"{probe.host}: master ports {master_port}-{master_port + PORT_TRIES - 1} are all in "
                        f"use; pass --master_port with a free port")
    if port != master_port:
        notes.append(f"master port {master_port} is in use on {probe.host}; using {port} instead")
    return master_addr, port, notes


def check_shell_safe(cwd: str, python: str, train_args: list[str]) -> list[str]:
    """Words the launcher's pdsh command line would not pass through unchanged."""
    problems = []
    for what, value in (("working directory", cwd), ("Python path", python)):
        if not _SHELL_SAFE.fullmatch(value):
            problems.append(f"{what} {value!r}: the deepspeed launcher writes it unquoted into the remote "
                            f"command line; use a path of letters, digits and ._/-")
    for arg in train_args:
        live = _LIVE_IN_DOUBLE_QUOTES.search(arg) if " " in arg else None
        unsafe = live or (" " not in arg and not _SHELL_SAFE.fullmatch(arg))
        if unsafe:
            problems.append(f"argument {arg!r}: the deepspeed launcher passes it to the remote shell "
                            f"{'inside double quotes' if ' ' in arg else 'unquoted'}, which would change it; "
                            f"put the value in the run config YAML instead")
    return problems


def run_preflight(pool: Mapping[str, list[int]], ssh: SshOptions, python: str, cwd: str,
                  master_addr: str, master_port: int, needed_gib: float | Callable[[], float] | None = None,
                  probe: Callable[..., list[HostProbe]] = probe_hosts,
                  packages: tuple[str, ...] | None = None, where: Mapping[str, str] | None = None,
                  one_machine: frozenset[str] = frozenset(),
                  modules: tuple[tuple[str, str, str], ...] = (), nodes: NodeRanks | None = None,
                  rollout_per_node: int = 0) -> PreflightResult:
    """Probe every host; raise one UserError naming every problem, else the master and world size.

    `needed_gib`: the memory plan's per-GPU peak, checked against each used GPU's free memory; a
    callable is asked only when some host has GPUs (the plan takes seconds to build).
    `packages`: whose versions must match this machine's (default run_packages(): a run without wandb
    or TensorBoard). `probe` stands in for probe_hosts (same arguments) in tests. `where` and
    `one_machine`: see check_identity. `modules`: the run's (module, distribution, fix), imported on every
    host (packages.run_modules). `nodes`: each node's ranks (node_ranks); a job split with `rollout_per_node`
    rollout ranks a node (ript.rollout_ranks_per_node) that they cannot run is refused before any ssh.
    """
    nodes = nodes or node_ranks(pool, [])
    split = nodes.problems(rollout_per_node)
    if split:  # the hostfile and the config: nothing to ask the hosts
        raise UserError(f"preflight: {split[0]}")
    hosts = list(pool)
    packages = run_packages() if packages is None else packages
    probes = probe(hosts, ssh, python, cwd, master_port, (*packages, *(f"import:{m[0]}" for m in modules)))
    problems = check_probes(probes, python, cwd, local_versions(packages), platform.python_version(), modules)
    same, same_notes = check_identity(probes, where, one_machine)
    problems += same
    if callable(needed_gib):
        needed_gib = needed_gib() if any(p.info and p.info.get("gpus") for p in probes) else None
    gpu_problems, gpu_notes = check_gpus(probes, pool, needed_gib)
    problems += gpu_problems
    if problems:
        raise UserError(f"preflight: {len(problems)} problem{'s' if len(problems) > 1 else ''}:\n  " +
                        "\n  ".join(problems))
    addr, port, notes = pick_master(probes[0], master_addr, master_port)
    return PreflightResult(addr, port, nodes.world_size, nodes.notes() + same_notes + gpu_notes + notes,
                           any(p.info and p.info.get("gpus") for p in probes))
