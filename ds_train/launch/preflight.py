"""Preflight for a multi-node launch: everything the deepspeed launcher assumes, checked per host.

Every host is probed in parallel over `ssh -o BatchMode=yes -o ConnectTimeout=N` (argv lists only;
host names were validated by the hostfile parser and never enter a shell string). One probe runs
the launcher's own Python on the host and reports its path, the ds_train / deepspeed / torch
versions, whether the working directory exists and, on the master host, the first free port.
Every problem on every host is reported at once.
"""

from __future__ import annotations

import importlib.metadata
import json
import platform
import re
import shlex
import subprocess
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Mapping

from ds_train.errors import UserError
from ds_train.launch.hostfile import is_ip_address

PACKAGES = ("ds_train", "deepspeed", "torch")
PORT_TRIES = 10  # the master port and the next nine

# Runs on each host as `<python> -c PROBE <cwd> <port>`; port 0 means "not the master".
PROBE = r"""
import importlib.metadata as md, json, os, platform, socket, subprocess, sys
cwd, port = sys.argv[1], int(sys.argv[2])
def version(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None
def free(p):
    # The rendezvous store binds every interface with SO_REUSEADDR: a listener on any address
    # of this host blocks it, a socket in TIME_WAIT does not.
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", p))
            return True
        except OSError:
            return False
try:
    addresses = subprocess.run(["hostname", "-I"], capture_output=True, text=True, timeout=5).stdout.split()
except (OSError, subprocess.SubprocessError):
    addresses = []
print(json.dumps({
    "python": sys.executable, "python_version": platform.python_version(),
    "versions": {name: version(name) for name in %(packages)r},
    "cwd_exists": os.path.isdir(cwd), "hostname": socket.gethostname(), "addresses": addresses,
    "free_port": next((p for p in range(port, port + %(tries)d) if free(p)), None) if port else None}))
""" % {"packages": PACKAGES, "tries": PORT_TRIES}

# What passes through the deepspeed launcher's pdsh command line unchanged: it writes the working
# directory and Python path unquoted, and an argument without a space as it is.
_SHELL_SAFE = re.compile(r"[\w@%+=:,./-]+")
# An argument with a space goes inside double quotes, where these stay live.
_LIVE_IN_DOUBLE_QUOTES = re.compile(r'[$`\\\n\r]')


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


def local_versions() -> dict[str, str | None]:
    out = {}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def probe_host(host: str, ssh: SshOptions, python: str, cwd: str, port: int) -> HostProbe:
    """Run PROBE on `host` with `python`; a failure becomes a one-line problem, never an exception."""
    argv = ssh.argv(host, [python, "-c", PROBE, cwd, str(port)])
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, stdin=subprocess.DEVNULL,
                              timeout=ssh.timeout_s + 20)
    except subprocess.TimeoutExpired:
        return HostProbe(host, problem=f"{host}: no answer within {ssh.timeout_s + 20} s over ssh",
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


def probe_hosts(hosts: list[str], ssh: SshOptions, python: str, cwd: str, master_port: int) -> list[HostProbe]:
    """All hosts at once; the first one (the master) also looks for a free port."""
    with ThreadPoolExecutor(max_workers=min(32, len(hosts))) as pool:
        futures = [pool.submit(probe_host, host, ssh, python, cwd, master_port if i == 0 else 0)
                   for i, host in enumerate(hosts)]
        return [f.result() for f in futures]


def check_probes(probes: list[HostProbe], python: str, cwd: str, versions: Mapping[str, str | None],
                 python_version: str) -> list[str]:
    """Problems with the environment on each host (pure: takes the probes' answers)."""
    problems = [p.problem for p in probes if p.problem]
    unreachable = [p.host for p in probes if p.unreachable]
    if unreachable:
        problems.append(f"unreachable: {', '.join(unreachable)}; check the names, that sshd runs there and "
                        f"that `ssh -o BatchMode=yes HOST true` works from this machine without a password "
                        f"(ssh options reach pdsh and this check through PDSH_SSH_ARGS_APPEND)")
    for p in probes:
        if not p.info:
            continue
        if p.info["python"] != python or p.info["python_version"] != python_version:
            problems.append(f"{p.host}: Python {p.info['python']} ({p.info['python_version']}) differs from "
                            f"this machine's {python} ({python_version}); use the same environment everywhere")
        diff = [f"{name} {p.info['versions'].get(name) or 'missing'} (here {versions[name] or 'missing'})"
                for name in versions if p.info["versions"].get(name) != versions[name]]
        if diff:
            problems.append(f"{p.host}: {', '.join(diff)}; install the same versions on every node")
        if not p.info["cwd_exists"]:
            problems.append(f"{p.host}: working directory {cwd} does not exist there; the launcher runs "
                            f"`cd {cwd}` on every node: use a shared file system or the same checkout path")
    return problems


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
                  master_addr: str, master_port: int) -> PreflightResult:
    """Probe every host; raise one UserError naming every problem, else the master and world size."""
    hosts = list(pool)
    probes = probe_hosts(hosts, ssh, python, cwd, master_port)
    problems = check_probes(probes, python, cwd, local_versions(), platform.python_version())
    if problems:
        raise UserError(f"preflight: {len(problems)} problem{'s' if len(problems) > 1 else ''}:\n  " +
                        "\n  ".join(problems))
    addr, port, notes = pick_master(probes[0], master_addr, master_port)
    return PreflightResult(addr, port, sum(len(slots) for slots in pool.values()), notes)
