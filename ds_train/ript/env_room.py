"""Where environments and tools run, apart from the engine and the trainer: in the trainer's process on
threads (ript.env_workers=0), or in worker processes (ript.env_workers=N), which a step past its time
limit can be killed in. Either way the steps of a batch run concurrently: the rollout starts every live
episode's step (`begin`), then collects each (`finish`), each within ript.env_step_timeout_s.

A request is (op, episode id, payload):

    open   (record,)            build the environment (`Class()`) and reset it: its first messages
    step   turn message          env.step(turn): (messages, reward, done, info)
    tools  [(name, args), ...]   each tool called in order: their results
    close  ()                    the episode is over: its environment dropped

and its reply (reason, value): reason "" when it went right, else one of sampler.REASONS.

A worker is `python -m ds_train.ript.env_room ENV TOOLS` (module:Class, and a JSON list of module:function),
a fresh interpreter: nothing of the trainer's process (its threads, its process group, its GPU) is forked
into it. It reads pickled requests on stdin and answers on the stdout it was started with; what the
environment prints goes to stderr. It ends when its stdin closes (the trainer ended or died).
"""

from __future__ import annotations

import atexit
import json
import os
import pickle
import select
import struct
import subprocess
import sys
import threading
import time
from typing import Any, Callable

Request = tuple[str, int, Any]
Reply = tuple[str, Any]


def _messages(value: Any) -> bool:
    """A list of {role, content: str}, as the protocol has an environment's messages."""
    return isinstance(value, list) and all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                           and isinstance(m.get("content"), str) for m in value)


def execute(envs: dict, env_class: Callable | None, tools: dict[str, Callable], request: Request) -> Reply:
    """One request against this room's environments (`envs`: episode id -> environment)."""
    op, sid, payload = request
    if op == "close":
        envs.pop(sid, None)
        return "", None
    if op == "tools":
        results = []
        for name, args in payload:
            fn = tools.get(name)
            if fn is None:
                return "unknown_tool", None
            try:
                value = fn(**args)
            except TypeError:  # arguments the tool does not take (or a TypeError inside it)
                return "malformed_call", None
            except Exception:  # noqa: BLE001 - the episode's reason, never the run's end
                return "tool_error", None
            results.append(value if isinstance(value, str) else json.dumps(value, default=str))
        return "", results
    try:
        if op == "open":
            envs[sid] = env_class()
            got = envs[sid].reset(*payload)
            return ("", got) if _messages(got) and got else ("env_malformed", None)
        got = envs[sid].step(payload)
    except Exception:  # noqa: BLE001 - the environment's fault ends its episode
        return "env_error", None
    ok = (isinstance(got, tuple) and len(got) == 4 and _messages(got[0]) and isinstance(got[1], (int, float))
          and not isinstance(got[1], bool))
    return ("", (got[0], float(got[1]), bool(got[2]))) if ok else ("env_malformed", None)


def late_reason(op: str) -> str:
    return "tool_timeout" if op == "tools" else "env_timeout"


class Threads:
    """Environments in this process: each request on a thread of its own. A request past its time is
    left behind (a daemon thread cannot be killed), its episode ended."""

    def __init__(self, env_class: Callable | None, tools: dict[str, Callable], timeout_s: float):
        self.env_class, self.tools, self.timeout_s = env_class, tools, timeout_s
        self.envs: dict = {}

    def begin(self, request: Request, calls: int = 1):
        out: dict = {}

        def run() -> None:
            out["reply"] = execute(self.envs, self.env_class, self.tools, request)

        thread = threading.Thread(target=run, daemon=True, name="ds_train-env")
        thread.start()
        return request, thread, out, time.monotonic() + self.timeout_s * max(calls, 1)

    def finish(self, ticket) -> Reply:
        request, thread, out, deadline = ticket
        thread.join(max(0.0, deadline - time.monotonic()))
        return out["reply"] if "reply" in out else (late_reason(request[0]), None)

    def close(self) -> None:
        self.envs.clear()


def _write(stream, obj) -> None:
    data = pickle.dumps(obj)
    stream.write(struct.pack("<Q", len(data)) + data)
    stream.flush()


def _read_exact(fd: int, n: int) -> bytes:
    chunks, left = [], n
    while left:
        chunk = os.read(fd, left)
        if not chunk:
            raise EOFError
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


class Worker:
    """One worker process and the episodes it holds."""

    def __init__(self, env_spec: str, tool_specs: list[str]):
        path = os.pathsep.join(p or os.getcwd() for p in sys.path)  # what the rank imported the environment from
        self.proc = subprocess.Popen([sys.executable, "-m", "ds_train.ript.env_room", env_spec, json.dumps(tool_specs)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": path})
        self.sids: set[int] = set()
        self.pending: list = []  # requests sent, replies not read yet, in order
        self.replies: dict[int, Reply] = {}  # read while waiting for a later one: id(request) -> its reply

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        if self.alive():
            self.proc.kill()
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            stream.close()


class Processes:
    """Environments in `n` worker processes: an episode lives on one (by its id), its requests answered in
    order. A request past its time kills its worker; the other episodes there end as env_lost, and the next
    episode gets a new worker."""

    def __init__(self, n: int, env_spec: str, tool_specs: list[str], timeout_s: float):
        self.env_spec, self.tool_specs, self.timeout_s = env_spec, tool_specs, timeout_s
        self.workers: list[Worker | None] = [None] * n
        self.lost: set[int] = set()
        atexit.register(self.close)  # a run that ends any way leaves no worker behind

    def _worker(self, sid: int) -> Worker:
        i = sid % len(self.workers)
        if self.workers[i] is None or not self.workers[i].alive():
            if self.workers[i] is not None:
                self._drop(i)
            self.workers[i] = Worker(self.env_spec, self.tool_specs)
        return self.workers[i]

    def _drop(self, i: int) -> None:
        worker = self.workers[i]
        self.lost |= worker.sids
        worker.kill()
        self.workers[i] = None

    def begin(self, request: Request, calls: int = 1):
        op, sid, _ = request
        if sid in self.lost:
            return request, None, 0.0
        worker = self._worker(sid)
        if op == "open":
            worker.sids.add(sid)
        try:
            _write(worker.proc.stdin, request)
        except (BrokenPipeError, OSError):  # the worker died: its episodes with it
            self._drop(sid % len(self.workers))
            return request, None, 0.0
        worker.pending.append(request)
        return request, worker, time.monotonic() + self.timeout_s * max(calls, 1)

    def finish(self, ticket) -> Reply:
        request, worker, deadline = ticket
        if worker is None or worker is not self.workers[request[1] % len(self.workers)]:
            return "env_lost", None
        fd = worker.proc.stdout.fileno()
        try:
            while id(request) not in worker.replies:
                ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
                if not ready:
                    self._drop(request[1] % len(self.workers))
                    self.lost.discard(request[1])
                    return late_reason(request[0]), None
                (size,) = struct.unpack("<Q", _read_exact(fd, 8))
                worker.replies[id(worker.pending.pop(0))] = pickle.loads(_read_exact(fd, size))
        except (EOFError, OSError):  # the worker died (an environment that exits, the OOM killer)
            self._drop(request[1] % len(self.workers))
            return "env_lost", None
        if request[0] == "close":
            worker.sids.discard(request[1])
        return worker.replies.pop(id(request))

    def close(self) -> None:
        for i, worker in enumerate(self.workers):
            if worker is not None:
                worker.kill()
                self.workers[i] = None


def _die_with_parent() -> None:
    """Linux: this worker is killed when the rank that started it dies, even inside a hung step (stdin's end
    is only read between steps)."""
    import ctypes
    import signal

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: stdin's end still ends it between steps
        pass
    if os.getppid() == 1:  # the parent died before prctl took
        os._exit(0)


def main(argv: list[str]) -> int:
    """A worker's loop (see the module)."""
    from ds_train.errors import load_user_object

    _die_with_parent()
    protocol = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # what the environment prints goes to stderr, not into the protocol
    sys.stdout = sys.stderr
    env_spec, tool_specs = argv[0], json.loads(argv[1])
    env_class = load_user_object(env_spec, "ript.tasks env") if env_spec else None
    tools = {}
    for spec in tool_specs:
        fn = load_user_object(spec, "ript.tasks tools")
        tools[fn.__name__] = fn
    envs: dict = {}
    source = sys.stdin.buffer.fileno()
    while True:
        try:
            (size,) = struct.unpack("<Q", _read_exact(source, 8))
            request = pickle.loads(_read_exact(source, size))
        except EOFError:
            return 0
        reply = execute(envs, env_class, tools, request)
        try:
            _write(protocol, reply)
        except (pickle.PicklingError, TypeError, AttributeError):  # a value that cannot cross: the env's fault
            _write(protocol, ("env_malformed", None))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
