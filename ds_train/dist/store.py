"""The rendezvous store every rank of a job meets in (`rendezvous`: the ranks that never arrive named), its backup,
and the side channel over it (small messages between ranks without a collective: heartbeats, alarms, stop
requests). Part of ds_train/dist/, the only package that touches torch.distributed."""

from __future__ import annotations

import os
import socket
from dataclasses import replace

from ds_train.errors import Stalled, UserError
from ds_train.topology import DistEnv, node_hosts


def free_port() -> int:
    """A TCP port free on this host now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def backup_rank(env: DistEnv) -> int:
    """The rank that serves the second store: the first rank of the last node (another host than
    rank 0 where there are several), so that the death of any one rank or host leaves one store."""
    per_node = max(1, env.local_world_size)
    return env.world_size - per_node if env.world_size > per_node else env.world_size - 1


_backup_server: list = []  # kept alive for the life of the process


def _serve_backup(env: DistEnv, store) -> None:
    """Serve the backup store on a free port and tell every rank where, through the first store."""
    import datetime

    from torch.distributed import PrefixStore, TCPStore

    server = TCPStore("0.0.0.0", 0, None, True, timeout=datetime.timedelta(seconds=30), wait_for_workers=False)
    _backup_server.append(server)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:  # the address that reaches rank 0's host
        probe.connect((env.master_addr, 9))
        addr = probe.getsockname()[0]
    PrefixStore(_namespace(), store).set("backup", f"{addr}:{server.port}")


def _namespace() -> str:
    """Store keys of this attempt: a restarted job (torchrun's restarts, a SLURM requeue) reuses
    neither the keys nor the verdicts of the last one."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT") or os.environ.get("SLURM_RESTART_COUNT") or "0"
    return f"ds_train/{attempt}/"


def _open_store(env: DistEnv, port: int, timeout_s: float, server: bool):
    import datetime

    from torch.distributed import TCPStore
    return TCPStore(env.master_addr, port, env.world_size, is_master=server,
                    timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False)


def missing_ranks_line(missing: list[int], joined: dict[int, dict], env: DistEnv, hosts: list[str],
                       timeout_s: float) -> str:
    """Which ranks never reached the rendezvous, by node and host (a pure function)."""
    per_node = max(1, env.local_world_size)
    by_node: dict[int, list[int]] = {}
    for r in missing:
        by_node.setdefault(r // per_node, []).append(r)
    known = {info["node"]: info["host"] for info in joined.values()}
    parts = []
    for node, ranks in sorted(by_node.items()):
        host = known.get(node) or (hosts[node] if node < len(hosts) else "host unknown")
        parts.append(f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} (node {node}, {host})")
    return (f"start-up: {'; '.join(parts)} did not reach the rendezvous at {env.master_addr}:{env.master_port} "
            f"within dist.join_timeout_s={timeout_s:g} s ({len(joined)} of {env.world_size} ranks did); their "
            f"launcher did not start them, or they failed or hung before it (see that node's output)")


def rendezvous(env: DistEnv, port: int, timeout_s: float, host: str):
    """The store every rank meets in: rank 0 serves it (unless torchrun's agent does); each rank
    announces itself, and waits until all have. Ranks missing at the timeout are named."""
    import json
    import time

    from torch.distributed import DistError, PrefixStore

    server = env.rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
    try:
        store = _open_store(env, port, timeout_s, server)
    except DistError as e:
        if server:
            raise UserError(f"start-up: rank 0 cannot listen on {env.master_addr}:{port} ({str(e).splitlines()[0]}); "
                            f"another job holds the port: choose another master port") from None
        raise Stalled(f"start-up: rank {env.rank} ({host}) could not reach the rendezvous at "
                      f"{env.master_addr}:{port} (rank 0) within dist.join_timeout_s={timeout_s:g} s: rank 0 did "
                      f"not start, or this host cannot reach that address and port (firewall, wrong "
                      f"interface)") from None
    keys = PrefixStore(_namespace(), store)
    keys.set(f"join/{env.rank}", json.dumps({"host": host, "node": env.node_rank, "pid": os.getpid()}))
    wanted = [f"join/{r}" for r in range(env.world_size)]
    deadline, pause = time.monotonic() + timeout_s, 0.05
    try:
        while not keys.check(wanted):
            if keys.check(["join/failed"]):
                keys.add("join/told", 1)
                raise Stalled(keys.get("join/failed").decode(), agreed=True)
            if time.monotonic() > deadline:
                joined = {r: json.loads(keys.get(f"join/{r}")) for r in range(env.world_size)
                          if keys.check([f"join/{r}"])}
                missing = [r for r in range(env.world_size) if r not in joined]
                line = missing_ranks_line(missing, joined, replace(env, master_port=port), node_hosts(), timeout_s)
                if env.rank == 0:  # say it once, and serve the store until the others have read it
                    keys.set("join/failed", line)
                    told = time.monotonic() + 5
                    while keys.add("join/told", 0) < len(joined) - 1 and time.monotonic() < told:
                        time.sleep(0.1)
                raise Stalled(line, agreed=env.rank != 0)
            time.sleep(pause)
            pause = min(2 * pause, 0.25)  # a store check is cheap; a longer pause delays every start-up
    except DistError:  # rank 0 gave up and took the store with it: it says why
        raise Stalled(f"start-up: rank {env.rank}: the rendezvous at {env.master_addr}:{port} ended before every "
                      f"rank joined", agreed=True) from None
    return store


class SideChannel:
    """Small messages between ranks without a collective: a connection of its own to the
    rendezvous store, safe to use from a thread while the main thread waits in a collective (the
    watchdog's heartbeats and alarms, `ds-train launch`'s stop requests). Values are text.

    Rank 0 serves that store, so it goes with rank 0. A second store, served by `backup_rank`,
    keeps the channel: `fail_over` moves to it once the first no longer answers (what `mirror`
    wrote is there already)."""

    def __init__(self, addr: str, port: int, timeout_s: float = 10.0, backup: str | None = None):
        import threading

        self._timeout_s = timeout_s
        self._keys = self._connect(addr, port)
        self.backup = backup  # "addr:port" of the second store, None without one
        self._mirror = None
        self.on_backup = False
        self._lock = threading.Lock()

    def _connect(self, addr: str, port: int):
        import datetime

        from torch.distributed import PrefixStore, TCPStore

        store = TCPStore(addr, port, is_master=False, timeout=datetime.timedelta(seconds=self._timeout_s))
        return PrefixStore(_namespace(), store)

    def _second(self):
        if self._mirror is None and self.backup:
            addr, _, port = self.backup.rpartition(":")
            self._mirror = self._connect(addr, int(port))
        return self._mirror

    def set(self, key: str, value: str) -> None:
        self._keys.set(key, value)

    def mirror(self, key: str, value: str) -> None:
        """Set `key` in both stores (a heartbeat must outlive rank 0)."""
        self._keys.set(key, value)
        if not self.on_backup and self.backup:
            try:
                self._second().set(key, value)
            except Exception:  # the backup's rank is gone: the first store still has it
                self.backup, self._mirror = None, None

    def get(self, key: str) -> str | None:
        """The value, or None when the key is not set (never waits for it)."""
        return self._keys.get(key).decode() if self._keys.check([key]) else None

    def add(self, key: str, amount: int = 1) -> int:
        return int(self._keys.add(key, amount))

    def fail_over(self) -> bool:
        """The first store stopped answering: use the second from now on. False without one (or
        when it is gone too). Safe from several threads: the first caller moves, the rest see it."""
        with self._lock:
            if self.on_backup:
                return True
            try:
                second = self._second()
                second.check(["backup"])  # answers?
            except Exception:
                return False
            if second is None:
                return False
            self._keys, self.on_backup = second, True
            return True


def side_channel(env: DistEnv, timeout_s: float = 30.0) -> SideChannel | None:
    """This rank's side channel (after `init`); None for a single process."""
    if env.world_size == 1:
        return None
    import datetime

    channel = SideChannel(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
    channel._keys.wait(["backup"], datetime.timedelta(seconds=timeout_s))  # backup_rank serves it by now
    channel.backup = channel.get("backup")
    return channel


def send_stop(addr: str, port: int, signum: int, timeout_s: float = 5.0) -> bool:
    """Ask every rank of a running job to save and stop, as if each got `signum` (for `ds-train
    launch`, which may not share a machine with any rank). False when the job cannot be reached."""
    from torch.distributed import DistError

    try:
        channel = SideChannel(addr, port, timeout_s)
        channel.set("signal", str(signum))
        channel.add("alarm", 1)
    except DistError:
        return False
    return True
