"""Built-in tools for environment tasks (`tools: [ds_train.ript.tools:run_python]` in a ript.tasks entry).

Whatever a model sends, a tool answers with text: a value, or `error: ...` that the model reads, as a calculator
shows it. No input makes a tool raise, hang or flood; a limit its program reaches is its answer, not a fault of
the episode.

`calculator` evaluates arithmetic (numbers, + - * / // % **, parentheses) by walking its syntax tree with a stack
of its own: no `eval`, nothing but arithmetic reachable, no recursion. Expressions longer than EXPRESSION_CHARS
and any intermediate result of more than RESULT_DIGITS digits are refused (a power before it is computed), so an
answer takes milliseconds; a non-string argument, NUL bytes or lone surrogates are an `error:` too.

`run_python` runs the model's program in a fresh interpreter (`python -I`: no user site, no PYTHONPATH, the
trainer's environment variables dropped), with no stdin, in a new session and a temporary working directory.
What it printed (the last OUTPUT_CHARS), or what stopped it, is the tool's result. The isolation is decided once
per process (`isolation()`: the first of these modes whose trial call works):

1. namespaced (util-linux `unshare`: network, pid, IPC and mount namespaces of its own, and its own /proc where
   the host allows that mount). The trainer root, the program runs as a uid of its own (UID_BASE + ..., in no
   group, no user of the host); not root, in a user namespace, as the trainer's user.
2. plain, as a uid of its own (the trainer root, namespaces refused).
3. plain, as the trainer's user (no namespaces and not root, or root with an interpreter only root may read,
   as pyenv under /root is, where a uid of its own cannot run).

What a program can touch:
- reading: as a uid of its own, what everyone may read; namespaced, the host's /tmp, /var/tmp and /dev/shm are
  out of its sight and the directories others may not enter above the interpreter (/root) show the
  interpreter only. As the trainer's user: whatever that user may read.
- writing and deleting: namespaced, its working directory, /tmp, /var/tmp and /dev/shm are tmpfs of its own,
  DISK_MB and FILES files each, gone when it ends. As a uid of its own: besides those, only world-writable files and
  directories (plain: /tmp and the like, where what it writes stays after it); nothing of the trainer's. As
  the trainer's user: whatever that user may write or delete.
- network: namespaced, none (a network namespace with only its loopback, down: even 127.0.0.1 is unreachable;
  abstract unix sockets are its own); a unix socket file it may open is reachable. Plain: the host's network.
- processes and daemons: PROCESSES processes and threads at once (RLIMIT_NPROC; unbounded plain as the
  trainer's user). Everything it started, daemons, double forks and new sessions included, is killed when it
  ends or is stopped: namespaced, its pid namespace ends with it; plain as a uid of its own, every process of
  that uid is killed; plain as the trainer's user, only its process group, and a process that left the group
  outlives it. Namespaced it can signal only its own processes, and with its own /proc see only them; as a uid
  of its own it can signal none of the trainer's; plain as the trainer's user it can signal (kill) them all.
- time: `seconds` (TIME_S) of wall time for all of it, as much CPU time for each process.
- memory: MEMORY_MB of address space for each process, so at most PROCESSES x MEMORY_MB, and its tmpfs.
- disk: files of at most FILE_MB (RLIMIT_FSIZE), OPEN_FILES descriptors, no core dumps; plain, as many files as
  it can write in its time.
- output: stdout and stderr are read as they come; past OUTPUT_BYTES of both it is stopped.
Numerical libraries are asked for one thread (OMP_NUM_THREADS and the like): threads count as processes.
"""

from __future__ import annotations

import ast
import contextlib
import math
import operator
import os
import resource
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import NamedTuple

TIME_S = 10  # CPU and wall-clock seconds a program may take
MEMORY_MB = 1024  # the address space of each of its processes
PROCESSES = 32  # processes and threads at once (RLIMIT_NPROC)
FILE_MB = 64  # the largest file it may write (RLIMIT_FSIZE)
DISK_MB = 256  # namespaced: its directory, /tmp, /var/tmp and /dev/shm are each a tmpfs of this size
FILES = 10_000  # and of at most this many files and directories
OPEN_FILES = 256  # its file descriptors (RLIMIT_NOFILE)
OUTPUT_BYTES = 1 << 20  # stdout and stderr together: past this it is stopped
OUTPUT_CHARS = 2000  # the end of what it printed that the model reads
CODE_BYTES = 100_000  # the longest program (one argument of exec may hold 128 KiB)
UID_BASE = 1_800_000_000  # as root, each call runs as UID_BASE + (pid * _SLOTS + slot): no user of a host
_SLOTS = 64  # calls at once in one process (pid_max is at most 2**22: the uids stay below 2**31)
_KEEP_BYTES = 16 << 10  # the tail of stdout and of stderr kept while reading
_DRAIN_S = 0.2  # after the program's process ended, how long what it left behind may hold the pipes
_THREADS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMEXPR_NUM_THREADS")
_SHARED = ("/tmp", "/var/tmp", "/dev/shm")  # the world-writable directories made private (namespaced)
_PROBE = ("import json; print(json.dumps([1]))", "[1]\n")  # a call that must work in a mode before it is used


class Isolation(NamedTuple):
    """How run_python's programs are isolated (see the module): decided once per process by `isolation()`."""
    unshare: str | None  # the util-linux `unshare` that makes the namespaces; None: the plain mode
    own_uid: bool  # the trainer is root and each program runs as a uid of its own
    own_proc: bool = False  # namespaced: /proc shows its own processes only (a container may refuse the mount)


_isolation: Isolation | None = None
_isolation_lock = threading.Lock()
_free_slots = list(range(_SLOTS))
_slots_changed = threading.Condition()


def isolation() -> Isolation:
    """The isolation this process gives its programs (module docstring), decided at its first call."""
    global _isolation
    with _isolation_lock:
        if _isolation is None:
            _isolation = decide_isolation(shutil.which("unshare"), os.geteuid() == 0)
        return _isolation


def decide_isolation(unshare: str | None, root: bool) -> Isolation:
    """The first of these whose trial call works: namespaced (a uid of its own as root), plain with a uid of its
    own (root), plain. A host that allows no namespaces, or whose interpreter only root can read, gets a weaker
    mode, never an error."""
    tried = [Isolation(unshare, root, True), Isolation(unshare, root)] if unshare else []
    tried += [Isolation(None, True)] if root else []
    return next((how for how in tried if run_limited(_PROBE[0], 10, MEMORY_MB, how) == _PROBE[1]),
                Isolation(None, False))


def _namespaces(how: Isolation) -> list[str]:
    if not how.unshare:
        return []
    # as root, made as root: the program's pid 1 mounts what its uid must reach, then the program drops to it
    user = [] if how.own_uid else ["--map-root-user"]
    proc = ["--mount-proc"] if how.own_proc else []
    return [how.unshare, *user, "--net", "--pid", "--ipc", "--mount", *proc, "--fork", "--kill-child"]


@contextlib.contextmanager
def _own_uid(wanted: bool):
    """A uid no other call of any process has while this one runs (None when not `wanted`)."""
    if not wanted:
        yield None
        return
    with _slots_changed:
        while not _free_slots:
            _slots_changed.wait()
        slot = _free_slots.pop()
    try:
        yield UID_BASE + os.getpid() * _SLOTS + slot
    finally:
        with _slots_changed:
            _free_slots.append(slot)
            _slots_changed.notify()


def _mounts(cwd: str, uid: int | None) -> list[tuple[str, str, list[str]]]:
    """What the program's pid 1 mounts in its mount namespace, each (a directory, its tmpfs's options, the
    interpreter's directories under it, bound back): the world-writable /tmp, /var/tmp and /dev/shm private and
    DISK_MB each; as root, the directories a uid of no group may not enter above the interpreter's (pyenv in
    /root) empty; its working directory last, DISK_MB, its own."""
    needed = {os.path.realpath(p) for p in (sys.base_prefix, sys.base_exec_prefix, sys.prefix, sys.exec_prefix,
                                              os.path.dirname(os.path.realpath(sys.executable)), *sys.path)
              if os.path.isabs(p) and os.path.isdir(p)}
    needed = {p for p in needed if not any(p.startswith(q + os.sep) for q in needed)}
    hidden = {d: f"mode=1777,size={DISK_MB}m,nr_inodes={FILES}" for d in _SHARED
              if os.path.isdir(d) and not os.path.islink(d)}
    for path in sorted(needed) if uid is not None else []:
        parts = path.split(os.sep)
        for i in range(2, len(parts)):
            above = os.sep.join(parts[:i])
            if not os.stat(above).st_mode & 0o001:  # others may not enter it
                hidden.setdefault(above, "mode=755,size=64k")
                break
    hidden = {d: o for d, o in hidden.items() if not any(d.startswith(e + os.sep) for e in hidden)}
    owner = "" if uid is None else f",uid={uid},gid={uid}"
    return [*((d, o, sorted(p for p in needed if p.startswith(d + os.sep))) for d, o in sorted(hidden.items())),
            (os.path.realpath(cwd), f"mode=700,size={DISK_MB}m,nr_inodes={FILES}{owner}", [])]


# Run by the program's interpreter before the program. Namespaced, it is pid 1 of the pid namespace: it mounts
# (_mounts), forks the program, reports how it ended and exits, which kills whatever the program left. Then, in
# the program: its own uid, the limits.
_START = """def _start():
    import os, resource, sys
    del globals()["_start"]
    code = sys.argv.pop(1)
    report, uid, mounts = {report}, {uid}, {mounts}
    if mounts:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        def mount(source, target, kind, flags, data):
            if libc.mount(source.encode(), target.encode(), kind.encode(), flags, data.encode()):
                raise OSError(ctypes.get_errno(), "mount " + target)
        for target, options, kept in mounts:
            fds = [os.open(path, os.O_PATH) for path in kept]
            os.makedirs(target, exist_ok=True)
            mount("tmpfs", target, "tmpfs", 6, options)
            for path, fd in zip(kept, fds):
                os.makedirs(path, 0o755, exist_ok=True)
                mount("/proc/self/fd/%d" % fd, path, "", 4096 | 16384, "")
                os.close(fd)
        os.chdir(mounts[-1][0])
    if report >= 0:
        program = os.fork()
        if program:
            while True:
                pid, status = os.wait()
                if pid == program:
                    os.write(report, str(os.waitstatus_to_exitcode(status)).encode())
                    os._exit(0)
        os.close(report)
    if uid >= 0:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    for kind, value in {limits}:
        hard = resource.getrlimit(kind)[1]
        value = value if hard == resource.RLIM_INFINITY else min(value, hard)
        resource.setrlimit(kind, (value, value))
    return code
exec(compile(_start(), "<string>", "exec"))
"""


def run_limited(code: str, seconds: float = TIME_S, memory_mb: int = MEMORY_MB,
                how: Isolation | None = None) -> str:
    """`code` in a fresh interpreter within the limits (module docstring): its output, or why it stopped.
    `how` is `isolation()` unless given (a test hands the plain mode in)."""
    if not isinstance(code, str):
        return f"error: the program must be Python source text, not {type(code).__name__}"
    try:
        source = code.encode()
    except UnicodeEncodeError:
        return "error: the program is not valid text (it holds a lone surrogate)"
    if b"\0" in source:
        return "error: the program holds a NUL byte"
    if len(source) > CODE_BYTES:
        return f"error: the program is longer than {CODE_BYTES} bytes"
    how = how or isolation()
    try:
        with _own_uid(how.own_uid) as uid, tempfile.TemporaryDirectory(prefix="ds_train_code_",
                                                                        ignore_cleanup_errors=True) as cwd:
            if uid is not None and not how.unshare:  # namespaced, its directory is a tmpfs of its uid
                os.chown(cwd, uid, uid)
            return _run(source, seconds, memory_mb, how, uid, cwd)
    except OSError as e:  # the host's: no directory, no process, no pipe to be had
        return f"error: the program could not be started ({e})"


def _run(source: bytes, seconds: float, memory_mb: int, how: Isolation, uid: int | None, cwd: str) -> str:
    limits = [(resource.RLIMIT_CPU, int(seconds) + 1), (resource.RLIMIT_AS, memory_mb << 20),
              (resource.RLIMIT_FSIZE, FILE_MB << 20), (resource.RLIMIT_NOFILE, OPEN_FILES), (resource.RLIMIT_CORE, 0)]
    if how.unshare or uid is not None:  # counted in its own namespace, or for its own uid: not the trainer's
        limits.append((resource.RLIMIT_NPROC, PROCESSES))
    report_r, report_w = os.pipe() if how.unshare else (-1, -1)
    mounts = _mounts(cwd, uid) if how.unshare else []
    start = _START.format(report=report_w, uid=-1 if uid is None else uid, mounts=mounts, limits=limits)
    env = {"PATH": os.defpath, "LANG": "C.UTF-8", **dict.fromkeys(_THREADS, "1")}
    try:
        proc = subprocess.Popen([*_namespaces(how), sys.executable, "-I", "-c", start, source], cwd=cwd, env=env,
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True, pass_fds=(report_w,) if how.unshare else ())
    except OSError:
        if report_r >= 0:
            os.close(report_r)
        raise
    finally:
        if report_w >= 0:
            os.close(report_w)
    try:
        out, err, stopped = _read(proc, seconds)
    finally:
        _end(proc, how, uid)
        proc.stdout.close()
        proc.stderr.close()
        status = proc.returncode
        if report_r >= 0:
            told = os.read(report_r, 64)
            os.close(report_r)
            status = int(told) if told else None  # no report: the program's pid 1 was killed, by us
    out_text = out.decode(errors="replace")[-OUTPUT_CHARS:]
    if stopped is None and status == 0:
        return out_text
    return (out_text + "\n" if out_text else "") + (stopped or _why(err.decode(errors="replace"), status,
                                                                   seconds, memory_mb, how))


def _read(proc: subprocess.Popen, seconds: float) -> tuple[bytearray, bytearray, str | None]:
    """stdout's and stderr's tails as the program prints them, until both close (and its process ended),
    the time is up, or it printed OUTPUT_BYTES."""
    deadline = time.monotonic() + seconds
    tails = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}
    printed, ended = 0, None
    try:
        exits = os.pidfd_open(proc.pid)  # readable when the process ends (Linux 5.3)
    except (AttributeError, OSError):
        exits = None  # polled instead
    with selectors.DefaultSelector() as selector:
        for fd in [*tails, *([] if exits is None else [exits])]:
            selector.register(fd, selectors.EVENT_READ)
        try:
            while any(fd in selector.get_map() for fd in tails):
                now = time.monotonic()
                if now >= deadline:
                    return *tails.values(), f"error: the program ran past {seconds:g} s and was stopped"
                if ended is None and exits is None and proc.poll() is not None:
                    ended = now
                if ended is not None and now - ended > _DRAIN_S:
                    break  # the plain mode: a process it left behind holds the pipes; killed in _end
                wait = deadline - now if ended is None else ended + _DRAIN_S - now
                for key, _ in selector.select(min(wait, 0.05) if exits is None else wait):
                    if key.fd == exits:
                        ended = time.monotonic()
                        selector.unregister(exits)
                        continue
                    chunk = os.read(key.fd, 1 << 16)
                    if not chunk:
                        selector.unregister(key.fd)
                        continue
                    printed += len(chunk)
                    tail = tails[key.fd]
                    tail += chunk
                    del tail[:-_KEEP_BYTES]
                if printed > OUTPUT_BYTES:
                    return *tails.values(), (f"error: the program printed more than {OUTPUT_BYTES >> 10} KiB "
                                             "and was stopped")
        finally:
            if exits is not None:
                os.close(exits)
    try:
        proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:  # it closed its output and went on
        return *tails.values(), f"error: the program ran past {seconds:g} s and was stopped"
    return *tails.values(), None


def _end(proc: subprocess.Popen, how: Isolation, uid: int | None) -> None:
    """Kills what is left of the program: its session's group (and in the namespaced mode its pid namespace
    with it), in the plain mode as root every process of its uid."""
    if proc.returncode is None or not how.unshare:  # namespaced and ended: its namespace ended with it
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    if uid is not None and not how.unshare:
        _kill_uid(uid)


def _kill_uid(uid: int) -> None:
    for _ in range(100):  # a process forking as it is killed: a few rounds end it (RLIMIT_NPROC bounds them)
        alive = []
        for name in os.listdir("/proc"):
            with contextlib.suppress(OSError, ValueError, IndexError):
                if name.isdigit() and os.stat(f"/proc/{name}").st_uid == uid:
                    with open(f"/proc/{name}/stat") as stat:
                        if stat.read().rsplit(")", 1)[1].split()[0] != "Z":
                            alive.append(int(name))
        if not alive:
            return
        for pid in alive:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.01)


_HINTS = (("[Errno 27]", f"a file may be at most {FILE_MB} MiB"),
          ("BlockingIOError: [Errno 11]", f"a program may run at most {PROCESSES} processes and threads"),
          ("can't start new thread", f"a program may run at most {PROCESSES} processes and threads"))


def _why(err: str, status: int | None, seconds: float, memory_mb: int, how: Isolation) -> str:
    """What the model reads when its program failed: the last line it wrote to stderr, and the limit it met."""
    lines = err.strip().splitlines()
    if "MemoryError" in err:
        return f"error: the program ran out of memory (its limit is {memory_mb} MiB)"
    if status is None:  # its pid 1 ended before it could say: what it wrote last says why
        return "error: the program was stopped" + (f" ({lines[-1]})" if lines else "")
    if status < 0:
        try:
            name = signal.Signals(-status).name
        except ValueError:
            name = "a real-time signal"
        cpu = f": its CPU limit is {seconds:g} s" if -status in (signal.SIGKILL, signal.SIGXCPU) else ""
        return f"error: the program was stopped by signal {-status} ({name}{cpu})"
    last = lines[-1] if lines else f"exit status {status}"
    hints = [hint for mark, hint in _HINTS if mark in last]
    if how.unshare and ("[Errno 101]" in last or "[Errno 99]" in last or "gaierror" in last):
        hints.append("the program has no network")
    if how.unshare and "[Errno 28]" in last:
        hints.append(f"its directory, /tmp, /var/tmp and /dev/shm may hold {DISK_MB} MiB and {FILES} files each")
    return f"error: {last}" + (f" ({hints[0]})" if hints else "")


def run_python(code: str) -> str:
    """Runs a Python program in a fresh interpreter and returns what it printed.

    Args:
        code: the program; print what you want to see
    """
    return run_limited(code)


_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_SIGNS = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_ARITHMETIC = "numbers, + - * / // % ** and parentheses"
EXPRESSION_CHARS = 1000  # the longest expression
RESULT_DIGITS = 1000  # the longest result, and intermediate result, of an expression
_LARGEST = 10 ** RESULT_DIGITS


class _Refused(Exception):
    """An expression the calculator answers with an error, said in the message."""


def calculator(expression: str) -> str:
    """Evaluates an arithmetic expression and returns its value.

    Args:
        expression: numbers, + - * / // % ** and parentheses, e.g. "347 * 86"
    """
    try:
        return _calculate(expression)
    except Exception as e:  # noqa: BLE001 - whatever it was sent, the model reads an answer
        return f"error: the expression could not be evaluated ({type(e).__name__})"


def _calculate(expression) -> str:
    if not isinstance(expression, str):
        return f'error: the expression must be text such as "347 * 86", not {type(expression).__name__}'
    text = expression.strip()
    if len(text) > EXPRESSION_CHARS:
        return f"error: the expression is longer than {EXPRESSION_CHARS} characters"
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError):  # NUL bytes and lone surrogates (UnicodeEncodeError) too
        return f"error: {_shown(expression)} is not an arithmetic expression"
    except (RecursionError, MemoryError):
        return "error: the expression is nested too deeply"
    try:
        value = _evaluate(tree.body)
    except ZeroDivisionError:
        return "error: division by zero"
    except OverflowError:
        return "error: the result is too large"
    except _Refused as e:
        return f"error: {e}"
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        value = int(value)
    return str(value) if isinstance(value, int) else f"{value:.12g}"


def _evaluate(root: ast.AST) -> int | float:
    """The tree's value, walked with a stack of its own (a deep tree is no RecursionError), every value
    bounded as it is made."""
    todo, values = [(root, False)], []
    while todo:
        node, operands_done = todo.pop()
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            values.append(_bounded(node.value))
        elif isinstance(node, ast.UnaryOp) and type(node.op) in _SIGNS:
            if operands_done:
                values.append(_SIGNS[type(node.op)](values.pop()))
            else:
                todo += [(node, True), (node.operand, False)]
        elif isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            if operands_done:
                right = values.pop()
                left = values.pop()
                values.append(_bounded(_apply(node.op, left, right)))
            else:
                todo += [(node, True), (node.right, False), (node.left, False)]
        else:
            try:
                said = ast.unparse(node)
            except RecursionError:
                said = ast.dump(node)[:60]
            raise _Refused(f"{_shown(said)} is not arithmetic ({_ARITHMETIC})")
    return values.pop()


def _apply(op: ast.operator, left: int | float, right: int | float) -> int | float | complex:
    if isinstance(op, ast.Pow) and isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1:
        # the one operation whose bounded operands can make an unbounded result: refused before it is computed
        if right.bit_length() > 64 or right * math.log10(abs(left)) > RESULT_DIGITS + 1:
            raise _Refused(f"the result has more than {RESULT_DIGITS} digits")
    return _OPS[type(op)](left, right)


def _bounded(value: int | float | complex) -> int | float:
    if isinstance(value, complex):
        raise _Refused("the result is not a real number")
    if isinstance(value, float) and not math.isfinite(value):
        raise OverflowError
    if isinstance(value, int) and not -_LARGEST < value < _LARGEST:
        raise _Refused(f"the result has more than {RESULT_DIGITS} digits")
    return value


def _shown(text: str) -> str:
    """`text` quoted for an error, at most ~80 characters of it."""
    return repr(text if len(text) <= 80 else text[:77] + "...")
