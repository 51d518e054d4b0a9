"""Where environments, tools and verifiers run, apart from the engine and the trainer: in worker processes
(ript.env_workers=N, the default), or, for trusted code only, on threads of the rank's own process
(ript.env_workers=0). Either way the steps of a batch run concurrently: the rollout starts every live
episode's request (`begin`), then collects each (`finish`), each within ript.env_step_timeout_s of the moment
it started running.

A request is (op, episode id, payload):

    open    (record,)                     build the environment (`Class()`) and reset it: its first messages
    step    turn message                  env.step(turn): (messages, reward, done, info)
    tools   [(name, args), ...]           each tool called in order: their results
    verify  (completion, answer, record)  the task's verifier: the episode's reward
    close   ()                            the episode is over: env.close() when it has one, the environment dropped

and its reply (reason, value): reason "" when it went right, else one of sampler.REASONS. Whatever user code
returns is checked here, where it runs (`execute`): messages are lists of {role, content: str} (each content cut
to Limits.message_chars, all of a reply within Limits.episode_chars), a reward any real number (numpy's
included) and finite, `done` a bool (numpy's too). Every fault is a reason; nothing user code does raises here.

Worker processes. A worker is `python -m ds_train.ript.env_room SPEC` (SPEC: JSON of the environment, the tools,
the verifier's factory and the limits), a fresh interpreter in a session of its own (start_new_session): nothing
of the trainer's process (its threads, its process group, its GPU) is forked into it, and its whole process tree
is killed with it (killpg, and any descendant that left the group, found by the DS_TRAIN_ENV_ROOM mark it
inherited). It limits itself before loading user code (RLIMIT_AS, RLIMIT_FSIZE, RLIMIT_NPROC: Limits), is
recycled after Limits.episodes_per_worker episodes, and ends when its stdin closes or the rank dies
(PR_SET_PDEATHSIG). Each worker has one request at a time: the rank queues the others, so a request's time is
its own step's, never the queue's; the worker measures its step and says so in the reply's header (8 bytes,
written before the body, so a reply that was in time is known in time even while the rank was generating). Pipes
are non-blocking on the rank's side and pumped with select: no write or read can block the rank. What user code
prints goes to the rank's stderr through a thread of the worker that forwards Limits.log_chars bytes at most.

Threads (ript.env_workers=0) are for trusted code only: a request past its time is abandoned (a thread cannot be
killed; its environment is closed when it returns), and a tool that calls os._exit, or holds the GIL in C,
stops or stalls the rank. What it prints through sys.stdout / sys.stderr is capped too.
"""

from __future__ import annotations

import atexit
import json
import math
import numbers
import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any, Callable

Request = tuple[str, int, Any]
Reply = tuple[str, Any]
MARK = "DS_TRAIN_ENV_ROOM"  # every process of a worker's tree inherits it: how a daemon that left the group is found
HEADER = struct.Struct("<Qd")  # a reply's size and the seconds its step took
TRANSFER_S = 30.0  # a reply's body, once its header came: the worker is only writing
STARTUP_S = 120.0  # a worker's start (an interpreter, the user's modules) until it says it is ready; not a step's


@dataclass(frozen=True)
class Limits:
    """What a room allows user code (ript.env_*; docs/post_training.md "Environments and tools")."""

    step_timeout_s: float = 30.0
    message_chars: int = 16384  # each message's content; longer is cut on truncation_side
    episode_chars: int = 262144  # all the messages of an episode together; past it: env_overlong
    truncation_side: str = "right"  # right: a long message's end is cut; left: its start
    memory_mb: int = 16384  # a worker's address space (RLIMIT_AS); 0: none
    file_mb: int = 1024  # the largest file a worker writes (RLIMIT_FSIZE); 0: none
    processes: int = 0  # RLIMIT_NPROC (Linux counts every process of the user); 0: none
    episodes_per_worker: int = 256  # a worker is recycled after this many episodes
    log_chars: int = 65536  # what a worker's user code prints, forwarded to the rank's log, at most


RLIMITS = {"memory_mb": ("RLIMIT_AS", 1 << 20), "file_mb": ("RLIMIT_FSIZE", 1 << 20), "processes": ("RLIMIT_NPROC", 1)}
KEYS = {"memory_mb": "ript.env_worker_memory_mb", "file_mb": "ript.env_worker_file_mb",
        "processes": "ript.env_worker_processes"}


def limit_problems(limits: Limits, workers: int) -> list[str]:
    """What this OS would refuse of `limits` for `workers` workers: a limit above its hard limit, more workers
    than file descriptors (three each on the rank's side), a timeout past what select and threads take."""
    import resource

    errs = []
    for field, (name, unit) in RLIMITS.items():
        value = getattr(limits, field) * unit
        hard = resource.getrlimit(getattr(resource, name))[1]
        if value and hard != resource.RLIM_INFINITY and value > hard:
            errs.append(f"{KEYS[field]}: {getattr(limits, field)} is above this machine's hard limit "
                        f"({hard // unit}, {name}); lower it, or 0 for none")
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft != resource.RLIM_INFINITY and workers * 3 + 64 > soft:
        errs.append(f"ript.env_workers: {workers} workers need {workers * 3} file descriptors and this process may "
                    f"open {soft} (ulimit -n); lower env_workers to {max(0, (soft - 64) // 3)} or raise ulimit -n")
    if limits.step_timeout_s * 64 > threading.TIMEOUT_MAX:
        errs.append(f"ript.env_step_timeout_s: {limits.step_timeout_s:g} is past what this OS waits "
                    f"({threading.TIMEOUT_MAX / 64:g} s); lower it")
    return errs


def check_kind(obj: Any, kind: str, spec: str, where: str) -> str:
    """'' when `obj` (loaded from `spec`) is what `kind` needs, else one line saying what it is and what to give:
    env, a class with reset(sample) and step(turn) built with no arguments; tool, a function (not a class);
    verifier, a function taking (completion, answer, record)."""
    import inspect

    if kind == "env":
        if not inspect.isclass(obj):
            return (f"{where}: {spec!r} is {_what(obj)}, not a class; name a class with reset(sample) and "
                    f"step(turn) (module:Class), built anew for each episode")
        missing = [m for m in ("reset", "step") if not callable(getattr(obj, m, None))]
        if missing:
            return f"{where}: {spec!r} has no {' or '.join(missing)} method; an environment has reset(sample) and step(turn)"
        if not _takes(obj, 0):
            return f"{where}: {spec!r} cannot be built with no arguments (Class()); give its arguments defaults"
        return ""
    if inspect.isclass(obj) or not callable(obj):
        return f"{where}: {spec!r} is {_what(obj)}; name a function (module:function)"
    if kind == "verifier" and not _takes(obj, 3):
        return f"{where}: {spec!r} does not take (completion, answer, record); a verifier is function(completion, answer, record)"
    return ""


def _what(obj: Any) -> str:
    import inspect

    return ("a class" if inspect.isclass(obj) else "a function" if inspect.isroutine(obj)
            else f"an instance of {type(obj).__name__}")


def _takes(fn: Callable, n: int) -> bool:
    import inspect

    try:
        inspect.signature(fn).bind(*[None] * n)
    except TypeError:
        return False
    except ValueError:  # no signature to read (a builtin): let it be
        pass
    return True


def clip(text: str, most: int, side: str) -> str:
    """`text` cut to `most` characters: its end cut (side right), or its start (left)."""
    return text if len(text) <= most else text[:most] if side == "right" else text[len(text) - most:]


def _numpy_bool(x: Any) -> bool:
    return type(x).__module__ == "numpy" and type(x).__name__ in ("bool", "bool_")  # numpy 2 and 1


def real(x: Any) -> float | None:
    """A reward as a float: any real number (numbers.Real: int, float, numpy's scalars, a bool as 0 / 1) and
    numpy's bool; None for anything else. Non-finite values come back as they are (the caller's reason)."""
    if not (isinstance(x, numbers.Real) or _numpy_bool(x)):
        return None
    try:
        return float(x)
    except Exception:  # noqa: BLE001 - a Real whose __float__ raises: not a number after all
        return None


def messages(value: Any, limits: Limits) -> list[dict] | str:
    """An environment's messages as plain dicts ({role, content[, name]}: str), each content cut to
    message_chars; or the reason they cannot be (env_malformed, env_overlong)."""
    if not isinstance(value, list):
        return "env_malformed"
    out, chars = [], 0
    for m in value:
        if not (isinstance(m, dict) and type(m.get("role")) is str and isinstance(m.get("content"), str)):
            return "env_malformed"
        kept = {"role": m["role"], "content": clip(str(m["content"]), limits.message_chars, limits.truncation_side)}
        if isinstance(m.get("name"), str):
            kept["name"] = m["name"][:200]
        chars += len(kept["content"])
        if chars > limits.episode_chars:
            return "env_overlong"
        out.append(kept)
    return out


def _result(value: Any, limits: Limits) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return clip(str(text), limits.message_chars, limits.truncation_side)


def execute(envs: dict, room: "Room", request: Request) -> Reply:
    """One request against this room's environments (`envs`: episode id -> environment). User code's faults,
    whatever they raise (SystemExit too), are the reply's reason."""
    op, sid, payload = request
    try:
        return _execute(envs, room, op, sid, payload)
    except BaseException:  # noqa: BLE001 - SystemExit and the like from user code: its episode's end
        return {"tools": "tool_error", "verify": "verifier_error"}.get(op, "env_error"), None


def _execute(envs: dict, room: "Room", op: str, sid: int, payload: Any) -> Reply:
    limits = room.limits
    if op == "close":
        env = envs.pop(sid, None)
        if callable(getattr(env, "close", None)):
            env.close()
        return "", None
    if op == "tools":
        results = []
        for name, args in payload:
            fn = room.tools.get(name)
            if fn is None:
                return "unknown_tool", None
            try:
                value = fn(**args)
            except TypeError:  # arguments the tool does not take (or a TypeError inside it)
                return "malformed_call", None
            except BaseException:  # noqa: BLE001 - the episode's reason, never the run's end
                return "tool_error", None
            results.append(_result(value, limits))
        if sum(map(len, results)) > limits.episode_chars:
            return "env_overlong", None
        return "", results
    if op == "verify":
        try:
            got = room.verifier(*payload)
        except BaseException:  # noqa: BLE001
            return "verifier_error", None
        reward = real(got)
        if reward is None:
            return "verifier_error", None
        return ("", reward) if math.isfinite(reward) else ("verifier_nonfinite", None)
    try:
        if op == "open":
            envs[sid] = room.env_class()
            got = envs[sid].reset(*payload)
            said = messages(got, limits)
            return ("", said) if isinstance(said, list) and said else (said or "env_malformed", None)
        got = envs[sid].step(payload)
    except BaseException:  # noqa: BLE001 - the environment's fault ends its episode
        return "env_error", None
    if not (isinstance(got, tuple) and len(got) == 4):
        return "env_malformed", None
    said, reward, done = messages(got[0], limits), real(got[1]), got[2]
    if isinstance(said, str) or reward is None or not (isinstance(done, bool) or _numpy_bool(done)):
        return (said if isinstance(said, str) else "env_malformed"), None
    if not math.isfinite(reward):
        return "env_nonfinite", None
    return "", (said, reward, bool(done))


def late_reason(op: str) -> str:
    return {"tools": "tool_timeout", "verify": "verifier_timeout"}.get(op, "env_timeout")


@dataclass
class Room:
    """What a room runs: the environment class, the tools by name, the verifier, the limits; and its workers
    (0: threads). `spec` is how a worker process loads the same (JSON: module:name strings)."""

    env_class: Callable | None
    tools: dict
    verifier: Callable | None
    limits: Limits
    workers: int = 0
    spec: dict | None = None


class Ticket:
    __slots__ = ("request", "calls", "reply", "sent", "deadline", "worker", "thread")

    def __init__(self, request: Request, calls: int):
        self.request, self.calls, self.reply = request, max(calls, 1), None
        self.sent = self.deadline = 0.0
        self.worker = self.thread = None


class Threads:
    """Environments in this process: each request on a thread of its own. A request past its time is left
    behind (a daemon thread cannot be killed), its episode ended, its environment closed when it returns."""

    def __init__(self, room: Room):
        self.room, self.envs, self.abandoned = room, {}, set()
        self.lock = threading.Lock()
        _cap_printing(room.limits.log_chars)

    def begin(self, request: Request, calls: int = 1) -> Ticket:
        ticket = Ticket(request, calls)

        def run() -> None:
            reply = execute(self.envs, self.room, request)
            with self.lock:
                late = request[1] in self.abandoned
            if late and request[0] != "close":  # its episode ended without it: release its environment
                execute(self.envs, self.room, ("close", request[1], ()))
            ticket.reply = reply

        ticket.thread = threading.Thread(target=run, daemon=True, name="ds_train-env")
        ticket.deadline = time.monotonic() + self.room.limits.step_timeout_s * ticket.calls
        ticket.thread.start()
        return ticket

    def finish(self, ticket: Ticket) -> Reply:
        ticket.thread.join(max(0.0, ticket.deadline - time.monotonic()))
        if ticket.thread.is_alive():
            with self.lock:
                self.abandoned.add(ticket.request[1])
            return late_reason(ticket.request[0]), None
        return ticket.reply if ticket.reply is not None else ("env_lost", None)

    def close(self) -> None:
        for sid in list(self.envs):
            execute(self.envs, self.room, ("close", sid, ()))


class _Printing:
    """sys.stdout / sys.stderr for thread mode: what the room's threads write goes through, up to a budget;
    other threads' writes are untouched."""

    def __init__(self, stream, budget: list):
        self.stream, self.budget = stream, budget

    def write(self, text: str) -> int:
        if threading.current_thread().name != "ds_train-env":
            return self.stream.write(text)
        with _PRINT_LOCK:
            left = self.budget[0]
            self.budget[0] = max(0, left - len(text))
        if left > 0:
            self.stream.write(text[:left])
        if len(text) >= left > 0:
            self.stream.write("\n[ds_train: environments' output past ript.env_log_chars dropped]\n")
        return len(text)

    def __getattr__(self, name: str):
        return getattr(self.stream, name)


_PRINT_LOCK = threading.Lock()


def _cap_printing(chars: int) -> None:
    if not isinstance(sys.stdout, _Printing):
        budget = [chars]
        sys.stdout, sys.stderr = _Printing(sys.stdout, budget), _Printing(sys.stderr, budget)


class Worker:
    """One worker process, the episodes it holds, its one request in flight and the ones queued behind it."""

    def __init__(self, spec: dict, limits: Limits):
        path = os.pathsep.join(p or os.getcwd() for p in sys.path)  # what the rank imported the environment from
        self.mark = f"{os.getpid()}.{id(self)}.{time.monotonic_ns()}"
        self.proc = subprocess.Popen([sys.executable, "-m", "ds_train.ript.env_room", json.dumps(spec)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True,
                                     env={**os.environ, "PYTHONPATH": path, MARK: self.mark})
        self.fd_in, self.fd_out = self.proc.stdin.fileno(), self.proc.stdout.fileno()
        os.set_blocking(self.fd_in, False)
        os.set_blocking(self.fd_out, False)
        self.sids: set[int] = set()
        self.opened = 0
        self.queue: deque[Ticket] = deque()
        self.current: Ticket | None = None
        self.out = b""  # the current request's bytes not written yet
        self.got = b""  # the current reply's bytes read so far
        self.header: tuple[int, float] | None = None
        self.ready = False  # the worker said so (a header of size 0): the first request's time starts after it
        self.born = time.monotonic()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        """The worker and its whole tree: its session's group, and any process that left it carrying the mark."""
        for pid in [-self.proc.pid, *marked(self.mark)]:  # -pid: its group (its session's, start_new_session)
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                stream.close()
            except OSError:
                pass


def marked(mark: str) -> list[int]:
    """The processes whose environment carries MARK=mark (Linux /proc; elsewhere none are found)."""
    found, needle = [], f"{MARK}={mark}\0".encode()
    try:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return found
    for pid in pids:
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if needle in f.read() + b"\0":
                    found.append(pid)
        except OSError:
            continue
    return found


class Processes:
    """Environments in `room.workers` worker processes: an episode lives on one (chosen by its id), its requests
    answered in order, one at a time a worker. A request past its time kills its worker (and its tree); the
    other episodes there end as env_lost, and the next episode gets a new worker."""

    def __init__(self, room: Room):
        self.room, self.limits = room, room.limits
        self.slots: list[Worker | None] = [None] * room.workers
        self.retiring: list[Worker] = []
        self.home: dict[int, Worker] = {}  # episode id -> its worker
        self.lost: set[int] = set()
        atexit.register(self.close)  # a run that ends any way leaves no worker behind

    # -- workers

    def _worker(self, sid: int) -> Worker | None:
        i = sid % len(self.slots)
        worker = self.slots[i]
        if worker is not None and worker.opened >= self.limits.episodes_per_worker:
            self.retiring.append(worker)  # recycled: its episodes finish there, new ones go to a fresh worker
            self.slots[i] = worker = None
        if worker is None or not worker.alive():
            if worker is not None:
                self._drop(worker)
            try:
                worker = Worker(self.room.spec, self.limits)
            except OSError:  # no process could be started (EAGAIN, ENOMEM): this episode's loss, not the run's
                return None
            self.slots[i] = worker
        return worker

    def _drop(self, worker: Worker) -> None:
        """Kill `worker` (and its tree): its request in flight and the ones queued end with env_lost (unless
        answered: the late one), its episodes are lost."""
        self.lost |= worker.sids
        for ticket in ([worker.current] if worker.current else []) + list(worker.queue):
            if ticket.reply is None:
                ticket.reply = ("env_lost", None)
        worker.queue.clear()
        worker.current = None
        worker.kill()
        for i, w in enumerate(self.slots):
            if w is worker:
                self.slots[i] = None
        if worker in self.retiring:
            self.retiring.remove(worker)

    def _workers(self) -> list[Worker]:
        return [w for w in self.slots if w is not None] + self.retiring

    # -- requests

    def begin(self, request: Request, calls: int = 1) -> Ticket:
        op, sid, _ = request
        ticket = Ticket(request, calls)
        if sid in self.lost:
            ticket.reply = ("env_lost", None)
            return ticket
        worker = self.home.get(sid)
        if worker is None:  # an episode's open; or a request of an episode without an environment (tools, verify)
            worker = self._worker(sid)
            if worker is None:
                ticket.reply = ("env_lost", None)
                return ticket
            worker.opened += 1
            if op == "open":
                worker.sids.add(sid)
                self.home[sid] = worker
        ticket.worker = worker
        worker.queue.append(ticket)
        self._pump(0.0)
        return ticket

    def finish(self, ticket: Ticket) -> Reply:
        while ticket.reply is None:
            self._pump(self._wait())
        if ticket.request[0] == "close" or ticket.reply[0]:
            self._release(ticket.request[1])
        return ticket.reply

    def _release(self, sid: int) -> None:
        worker = self.home.pop(sid, None)
        if worker is None:
            return
        worker.sids.discard(sid)
        if worker in self.retiring and not worker.sids and worker.current is None and not worker.queue:
            self.retiring.remove(worker)
            worker.kill()

    def _wait(self) -> float:
        deadlines = [w.current.deadline for w in self._workers() if w.current is not None and w.current.deadline]
        return max(0.0, min(deadlines) - time.monotonic()) if deadlines else 0.05

    def _start(self, worker: Worker) -> None:
        while worker.ready and worker.current is None and worker.queue:
            ticket = worker.queue.popleft()
            if ticket.request[1] in self.lost:
                ticket.reply = ("env_lost", None)
                continue
            try:
                data = pickle.dumps(ticket.request)
            except Exception:  # noqa: BLE001 - a record or turn that cannot cross: the environment's input
                ticket.reply = ("env_malformed", None)
                continue
            worker.current, worker.out, worker.got, worker.header = ticket, struct.pack("<Q", len(data)) + data, b"", None
            ticket.sent, ticket.deadline = time.monotonic(), 0.0

    def _pump(self, timeout: float) -> None:
        """Write what is due, read what came, start what is queued, kill what is late: one select."""
        for worker in self._workers():
            self._start(worker)
        now = time.monotonic()
        for worker in self._workers():
            if not worker.ready and now > worker.born + STARTUP_S:  # it never said it is ready
                self._drop(worker)
        busy = [w for w in self._workers() if w.current is not None or not w.ready]
        for worker in busy:
            if not worker.alive():  # died in its step (os._exit, a signal, a limit): whoever holds its pipe
                self._read(worker)
                if worker.current is not None or not worker.ready:
                    self._drop(worker)
        busy = [w for w in busy if w.current is not None or not w.ready and w.alive()]
        if busy:
            poll, by_fd = select.poll(), {}
            for w in busy:  # poll, not select: a rank's descriptors run past select's 1024
                fd = w.fd_in if w.out else w.fd_out
                poll.register(fd, select.POLLOUT if w.out else select.POLLIN)
                by_fd[fd] = w
            try:
                events = poll.poll(int(math.ceil(timeout * 1000)))
            except OSError:  # EINTR
                events = []
            for fd, _ in events:
                worker = by_fd[fd]
                if worker.current is not None and worker.out:
                    self._write(worker)
                elif worker.current is not None or not worker.ready:
                    self._read(worker)
        elif timeout:
            time.sleep(min(timeout, 0.05))
        now = time.monotonic()
        for worker in self._workers():
            ticket = worker.current
            if ticket is None or not ticket.deadline or now < ticket.deadline:
                continue
            self._read(worker)  # what came while the rank was away, before judging it late
            if worker.current is ticket and now >= ticket.deadline:
                worker.current = None
                ticket.reply = (late_reason(ticket.request[0]) if worker.header is None else "env_lost", None)
                self._drop(worker)

    def _write(self, worker: Worker) -> None:
        try:
            n = os.write(worker.fd_in, worker.out[:1 << 16])
        except BlockingIOError:
            return
        except OSError:  # the worker died
            self._drop(worker)
            return
        worker.out = worker.out[n:]
        if not worker.out:  # the request is the worker's now: its step's time starts
            worker.current.deadline = time.monotonic() + self.limits.step_timeout_s * worker.current.calls

    def _read(self, worker: Worker) -> None:
        while worker.current is not None or not worker.ready:
            try:
                chunk = os.read(worker.fd_out, 1 << 20)
            except BlockingIOError:
                return
            except OSError:
                chunk = b""
            if not chunk:  # the worker died (an environment that exits, the OOM killer, a limit)
                self._drop(worker)
                return
            worker.got += chunk
            if not worker.ready and len(worker.got) >= HEADER.size:  # its first frame: ready
                worker.ready, worker.got = True, worker.got[HEADER.size:]
                self._start(worker)
                if worker.current is not None:
                    self._write(worker)
                continue
            if worker.header is None and len(worker.got) >= HEADER.size:
                worker.header = HEADER.unpack(worker.got[:HEADER.size])
                worker.got = worker.got[HEADER.size:]
                # the body follows: a worker that stops writing it is stuck, not stepping
                worker.current.deadline = time.monotonic() + TRANSFER_S
            if worker.header is not None and len(worker.got) >= worker.header[0]:
                ticket, (size, seconds) = worker.current, worker.header
                try:
                    reply = pickle.loads(worker.got[:size])
                except Exception:  # noqa: BLE001 - not a reply: the protocol is broken, the worker with it
                    self._drop(worker)
                    return
                if seconds > self.limits.step_timeout_s * ticket.calls:  # it ran past its time while unwatched
                    reply = (late_reason(ticket.request[0]), None)
                ticket.reply, worker.current, worker.got, worker.header = reply, None, b"", None
                self._start(worker)
                if worker.current is not None:  # the next request, written at once when it fits
                    self._write(worker)

    def close(self) -> None:
        for worker in self._workers():
            self._drop(worker)
        self.slots = [None] * len(self.slots)
        self.retiring = []


def open_room(room: Room):
    """The room's runner: worker processes, or threads when room.workers is 0."""
    return Processes(room) if room.workers else Threads(room)


# -- the worker's side


def _die_with_parent() -> None:
    """Linux: this worker is killed when the rank that started it dies, even inside a hung step (stdin's end
    is only read between steps)."""
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: stdin's end still ends it between steps
        pass
    if os.getppid() == 1:  # the parent died before prctl took
        os._exit(0)


def _limit(limits: Limits) -> None:
    import resource

    for field, (name, unit) in RLIMITS.items():
        value = getattr(limits, field) * unit
        if value and hasattr(resource, name):
            kind = getattr(resource, name)
            hard = resource.getrlimit(kind)[1]
            value = value if hard == resource.RLIM_INFINITY else min(value, hard)
            try:
                resource.setrlimit(kind, (value, hard))
            except (ValueError, OSError):  # checked at load; a machine that still refuses keeps its own
                pass


def _forward(source: int, sink: int, chars: int) -> None:
    """The worker's stdout and stderr (a pipe) to the rank's stderr, `chars` bytes at most, then a note."""
    left = chars
    while True:
        try:
            chunk = os.read(source, 1 << 16)
        except OSError:
            return
        if not chunk:
            return
        if left > 0:
            try:
                os.write(sink, chunk[:left])
                if len(chunk) >= left:
                    os.write(sink, f"\n[ds_train env worker {os.getpid()}: output past {chars} bytes dropped "
                                   f"(ript.env_log_chars)]\n".encode())
            except OSError:
                pass
        left -= len(chunk)


def _write_reply(protocol: int, reply: Reply, seconds: float, most: int) -> None:
    try:
        data = pickle.dumps(reply)
    except Exception:  # noqa: BLE001 - a value that cannot cross: the environment's fault
        data = pickle.dumps(("env_malformed", None))
    if len(data) > most:
        data = pickle.dumps(("env_overlong", None))
    view = memoryview(HEADER.pack(len(data), seconds) + data)
    while view:
        view = view[os.write(protocol, view):]


def build_room(spec: dict) -> Room:
    """A worker's Room from its JSON spec (the environment, the tools, the verifier's factory and the limits)."""
    from ds_train.errors import load_user_object

    env_class = load_user_object(spec["env"], "ript.tasks env") if spec["env"] else None
    tools = {}
    for name in spec["tools"]:
        fn = load_user_object(name, "ript.tasks tools")
        tools[fn.__name__] = fn
    verifier = None
    if spec.get("verifier"):
        factory, args = spec["verifier"]
        verifier = load_user_object(factory, "ript.tasks verifier")(*args)
    return Room(env_class, tools, verifier, Limits(**spec["limits"]))


def worker_spec(env: str, tools: list[str], verifier: tuple[str, list] | None, limits: Limits) -> dict:
    return {"env": env, "tools": list(tools), "verifier": verifier, "limits": asdict(limits)}


def main(argv: list[str]) -> int:
    """A worker's loop (see the module)."""
    _die_with_parent()
    spec = json.loads(argv[0])
    limits = Limits(**spec["limits"])
    protocol = os.dup(1)
    source = os.dup(0)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)  # user code reads no protocol
    rank_err = os.dup(2)
    r, w = os.pipe()
    os.dup2(w, 1)
    os.dup2(w, 2)  # what user code prints, to the rank's stderr through the forwarder, capped
    os.close(w)
    threading.Thread(target=_forward, args=(r, rank_err, limits.log_chars), daemon=True).start()
    sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
    sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)
    _limit(limits)
    room = build_room(spec)
    os.write(protocol, HEADER.pack(0, -1.0))  # ready: the rank's clock for the first request starts now
    envs: dict = {}
    most = 4 * limits.episode_chars + (1 << 16)
    while True:
        try:
            (size,) = struct.unpack("<Q", _read_exact(source, 8))
            request = pickle.loads(_read_exact(source, size))
        except EOFError:
            return 0
        started = time.monotonic()
        reply = execute(envs, room, request)
        _write_reply(protocol, reply, time.monotonic() - started, most)


def _read_exact(fd: int, n: int) -> bytes:
    chunks, left = [], n
    while left:
        chunk = os.read(fd, left)
        if not chunk:
            raise EOFError
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
