"""DeepSpeed hostfiles (`<host> slots=<n>` per line), parsed strictly.

DeepSpeed's own parser accepts any non-blank token as a host and later splices it into pdsh and ssh
command lines; here a host is a host name or an IP address and nothing else, so a name like
`x;touch /tmp/f` or `$(...)` stops at its line number before any command is built. Two lines naming
one host (`node0`, `NODE0.`) are refused here; two names of one machine that only its own answer can
tell apart (an ssh alias and an address) are refused by the preflight (ds_train/launch/preflight.py).
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from pathlib import Path

from ds_train.errors import UserError
from ds_train.fs import check_path

# RFC 1123 labels; `_` is tolerated because ssh aliases (~/.ssh/config Host entries) often use it.
# No label may start with `-`: ssh would read `-oProxyCommand=...` as an option.
_LABEL = r"[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?"
_HOSTNAME = re.compile(rf"{_LABEL}(?:\.{_LABEL})*\.?")
_LINE = re.compile(r"(?P<host>\S+)(?:\s+(?P<rest>.*))?")
_SLOTS = re.compile(r"slots=(?P<n>[+-]?\d+)")


@dataclass(frozen=True)
class Host:
    name: str
    slots: int
    line: int


def is_ip_address(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return False


def is_valid_host(name: str) -> bool:
    """A host name (RFC 1123, `_` allowed) or an IPv4 / IPv6 address: nothing a shell would read."""
    return is_ip_address(name) or (len(name) <= 253 and _HOSTNAME.fullmatch(name) is not None)


def host_key(name: str) -> str:
    """What two spellings of one host share: DNS names are case-insensitive (RFC 4343) and may end in
    `.`; an address is compared by value (`::1` and `0:0::1`)."""
    if is_ip_address(name):
        return ipaddress.ip_address(name).compressed
    return name.lower().rstrip(".")


def _parse_line(text: str, where: str, seen: dict[str, tuple[str, int]],
                lineno: int) -> tuple[Host | None, str | None]:
    body = text.split("#", 1)[0].strip()
    if not body:
        return None, None
    m = _LINE.fullmatch(body)
    host, rest = m.group("host"), (m.group("rest") or "").strip()
    if not is_valid_host(host):
        return None, (f"{where}:{lineno}: {host!r} is not a valid host name or IP address (letters, "
                      f"digits, '-', '_' and '.' only; no spaces, quotes or shell characters); fix the "
                      f"name on line {lineno}")
    slots = _SLOTS.fullmatch(rest)
    if not slots:
        return None, (f"{where}:{lineno}: expected '<host> slots=<n>', got {body!r}; write it as "
                      f"'{host} slots=<processes on that host>'")
    n = int(slots.group("n"))
    if n <= 0:
        return None, f"{where}:{lineno}: slots={n} for {host!r} must be positive; use slots=1 or more"
    first = seen.get(host_key(host))
    if first:
        as_ = f" as {first[0]!r}" if first[0] != host else ""
        return None, (f"{where}:{lineno}: duplicate host {host!r} (first on line {first[1]}{as_}); list "
                      f"each host once with its total slots (names are compared without case)")
    seen[host_key(host)] = (host, lineno)
    return Host(host, n, lineno), None


def parse_hostfile(text: str, where: str = "hostfile") -> list[Host]:
    """Hosts in file order, or a UserError listing every bad line as `WHERE:LINE: problem; fix`."""
    hosts, errors, seen = [], [], {}
    for lineno, line in enumerate(text.splitlines(), 1):
        host, error = _parse_line(line, where, seen, lineno)
        if error:
            errors.append(error)
        elif host:
            hosts.append(host)
    if errors:
        raise UserError(errors[0] if len(errors) == 1 else
                        f"{where}: {len(errors)} bad lines:\n  " + "\n  ".join(errors))
    if not hosts:
        raise UserError(f"{where}: no hosts; add one line per node: '<host> slots=<n>'")
    return hosts


def read_hostfile(path: str | Path) -> list[Host]:
    """A missing hostfile is an error (DeepSpeed only warns and runs on the local machine)."""
    path = Path(path)
    check_path(path, "--hostfile")  # a name the operating system refuses: one line, not a traceback
    if not path.is_file():
        raise UserError(f"{path}: hostfile not found; give an existing file with one '<host> slots=<n>' "
                        f"line per node (see hostfile.example)")
    try:
        text = path.read_text()
    except UnicodeDecodeError:
        raise UserError(f"{path}: not a text file; a hostfile has one '<host> slots=<n>' line per node") \
            from None
    return parse_hostfile(text, str(path))


def select_hosts(hosts: list[Host], num_nodes: int = -1, num_gpus: int = -1, include: str = "",
                 exclude: str = "") -> dict[str, list[int]]:
    """The hosts and slot ids the deepspeed launcher will use, with its own filters.

    --include / --exclude go through DeepSpeed's parser (imported only then: it loads torch), so
    the world size here is the one the launcher computes.
    """
    if (num_nodes >= 0 or num_gpus >= 0) and (include or exclude):
        raise UserError("--num_nodes / --num_gpus cannot be combined with --include / --exclude "
                        "(the deepspeed launcher refuses it); use one or the other")
    pool = {h.name: list(range(h.slots)) for h in hosts}
    if include or exclude:
        from deepspeed.launcher.runner import parse_inclusion_exclusion

        try:
            pool = dict(parse_inclusion_exclusion({h.name: h.slots for h in hosts}, include, exclude))
        except ValueError as e:
            raise UserError(f"--include/--exclude: {e}; name hosts as they appear in the hostfile") from None
    if num_nodes > 0:
        pool = dict(list(pool.items())[:num_nodes])
    if num_gpus > 0:
        pool = {name: list(range(num_gpus)) for name in pool}
    if not pool:
        raise UserError("no hosts left after --include/--exclude/--num_nodes; keep at least one")
    return pool
