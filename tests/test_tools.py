"""The built-in tools (ds_train/ript/tools.py): the calculator's values and the errors it answers with, for any
input, quickly; the code tool's output, or the limit that stopped it, as the tool's result, in this host's
isolation (namespaced, as root here) and in the plain mode a host without namespaces gets: processes, files,
output, network, the uid it runs as, and nothing left running after it."""

from __future__ import annotations

import os
import random
import resource
import socket
import subprocess
import time

import pytest

from ds_train.ript.tools import (DISK_MB, FILE_MB, FILES, OUTPUT_CHARS, PROCESSES, Isolation, calculator,
                                 decide_isolation, isolation, run_limited)

HOW = isolation()
NAMESPACED = pytest.mark.skipif(not HOW.unshare, reason="this host allows no user/network/pid namespaces")
PROCESSES_BOUND = pytest.mark.skipif(not (HOW.unshare or HOW.own_uid),
                                     reason="the plain mode without root does not bound processes")


@pytest.mark.parametrize("expression,said", [
    ("347 * 86", "29842"), (" (1 + 2) * -3 ", "-9"), ("7 // 2", "3"), ("6 / 3", "2"), ("1 / 8", "0.125"),
    ("2 ** 10", "1024"), ("2.5 * 4", "10"), ("17 % 5", "2"),
    ("1 / 0", "error: division by zero"),
    ("9 ** 9 ** 9", "error: the result has more than 1000 digits"),  # refused before it is computed
    ("2.5 ** 2000", "error: the result is too large"),
    ("(-8) ** (1 / 3)", "error: the result is not a real number"),
    ("347 times 86", "error: '347 times 86' is not an arithmetic expression"),
    ("__import__('os').getcwd()", "error: \"__import__('os').getcwd()\" is not arithmetic (numbers, + - * / // % ** "
                                  "and parentheses)"),
    ("(1).__class__", "error: '1 .__class__' is not arithmetic (numbers, + - * / // % ** and parentheses)"),
    ("True + 1", "error: 'True' is not arithmetic (numbers, + - * / // % ** and parentheses)"),
])
def test_the_calculator_evaluates_arithmetic_and_nothing_else(expression, said):
    from ds_train.ript.environments import tool_schema

    start = time.monotonic()
    assert calculator(expression) == said
    assert time.monotonic() - start < 30  # 9 ** 9 ** 9 is refused, not computed (that would take hours)
    schema = tool_schema(calculator, "tools[0]")  # what the chat template shows the model
    assert schema["function"]["name"] == "calculator" and \
        schema["function"]["parameters"]["required"] == ["expression"], schema


@pytest.mark.parametrize("code,said", [
    ("print(6 * 7)", "42\n"),
    ("print('partial'); raise ValueError('bad')", "partial\n\nerror: ValueError: bad"),
    ("x = bytearray(3 << 30)", "error: the program ran out of memory (its limit is 256 MiB)"),
    ("while True: pass", "error: the program ran past 2 s and was stopped"),
    ("import subprocess, time; subprocess.Popen(['sleep', '60']); time.sleep(60)",
     "error: the program ran past 2 s and was stopped"),
    ("import os; print(sorted(os.environ))",  # none of the trainer's variables
     "['LANG', 'MKL_NUM_THREADS', 'NUMEXPR_NUM_THREADS', 'OMP_NUM_THREADS', 'OPENBLAS_NUM_THREADS', 'PATH']\n"),
    (5, "error: the program must be Python source text, not int"),
    ("print(1)\0", "error: the program holds a NUL byte"),
    ("print('\ud800')", "error: the program is not valid text (it holds a lone surrogate)"),
])
def test_a_program_runs_within_its_limits(code, said):
    start = time.monotonic()
    assert run_limited(code, 2, 256) == said
    assert time.monotonic() - start < 30  # stopped at its 2 s limit, not after the program's 60 s


def _hostile_expressions(rng: random.Random) -> list:
    """Inputs a model (or a fuzzer) may send: random text of arithmetic, unicode, NULs and lone surrogates of any
    length, deep nests, power towers, chains of big products, factorials and floor divisions, non-strings."""
    atoms = ["9", "99", "10**999", "9**999", "0x" + "f" * 300, "1e308", "2", "(-8)", "0", "0.5", "7"]
    ops = ["+", "-", "*", "/", "//", "%", "**"]
    alphabet = "0123456789+-*/%().e xj_,é\0\ud800\U0001f600"
    said = [5, 2.5, None, ["1 + 1"], {"expression": "1"}, b"1 + 1", True,
            "9**999*" * 140 + "9", "*".join(["99999"] * 150), "*".join(str(i) for i in range(1, 300)),
            "(" + "**".join(["9"] * 150) + ")", "10**10**6", "(10**999)**2", "(10**999)*(10**999)//7",
            "-" * 999 + "1", "1+" * 499 + "1", "(" * 150 + "1" + ")" * 150, "(" * 300 + "1" + ")" * 300,
            "(" * 10 ** 5, "1" * 4301, "7" * 10 ** 6, "f(" + "-" * 400 + "1)", "1\0", "\ud800", "\udc80 + 1"]
    for _ in range(300):
        said.append(rng.choice(atoms) + "".join(rng.choice(ops) + rng.choice(atoms) for _ in range(rng.randint(1, 60))))
        said.append("".join(rng.choice(alphabet) for _ in range(rng.choice([1, 10, 100, 999, 5000]))))
    return said


def test_the_calculator_answers_every_input_quickly():
    for expression in _hostile_expressions(random.Random(0)):
        start = time.monotonic()
        said = calculator(expression)
        took = time.monotonic() - start
        assert isinstance(said, str) and took < 5, (repr(expression)[:200], took)  # answered, never computed for hours
        if not said.startswith("error: "):
            float(said)  # a number, never longer than the digits it may have
            assert len(said) <= 1001, repr(expression)[:200]
        said.encode()  # no lone surrogate to break the tokenizer


@PROCESSES_BOUND
@pytest.mark.parametrize("code", [
    "import os\nwhile True:\n    os.fork()",  # the bomb
    # a flood of sleepers from one process: without the limit it ends ('forked'), so the test fails instead of
    # the machine
    f"import os, time\nfor _ in range({4 * PROCESSES}):\n    if os.fork() == 0:\n        time.sleep(30)\n"
    "        os._exit(0)\nprint('forked')",
], ids=["bomb", "flood"])
def test_a_fork_bomb_is_stopped_and_answered(code):
    start = time.monotonic()
    said = run_limited(code, 5, 256)
    assert said.endswith(f"(a program may run at most {PROCESSES} processes and threads)"), said[-300:]
    assert time.monotonic() - start < 10, said[-300:]


def _hows_here() -> list:
    hows = [HOW]
    if os.geteuid() == 0:
        hows.append(Isolation(None, True))  # the plain mode as root: every process of its uid is killed
    return hows


@pytest.mark.parametrize("how", _hows_here(), ids=str)
@pytest.mark.parametrize("stopped", [False, True], ids=["ended", "stopped"])
def test_what_a_program_started_is_killed_with_it_even_out_of_its_session(how, stopped):
    """A child left in the program's group, one in a new session (setsid) and a double fork's grandchild."""
    if not (how.unshare or how.own_uid):
        pytest.skip("the plain mode without root cannot find a process that left the group")
    marker = f"61.{os.getpid()}{int(stopped)}"
    code = ("import os, time\n"  # os only: in the plain mode as root this host's stdlib is root's (/root/.pyenv)
            "def sleep(n, session):\n    if os.fork() == 0:\n        if session:\n            os.setsid()\n"
            f"        os.execv('/bin/sleep', ['sleep', '{marker}' + n])\n"
            "sleep('1', False)\nsleep('2', True)\n"
            "if os.fork() == 0:\n    os.setsid()\n    sleep('3', True)\n    os._exit(0)\n"
            "time.sleep(0.3)\nprint('started', flush=True)\n" + ("time.sleep(60)\n" if stopped else ""))
    said = run_limited(code, 2, 256, how)
    assert said == ("started\n\nerror: the program ran past 2 s and was stopped" if stopped else "started\n"), said
    time.sleep(0.2)
    left = [line for line in subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
            .splitlines() if marker in line]
    assert not left, left


def test_a_file_past_its_size_limit_is_answered():
    said = run_limited(f"open('big', 'wb').write(b'x' * ({FILE_MB + 1} << 20))", 10, 512)
    assert said == f"error: OSError: [Errno 27] File too large (a file may be at most {FILE_MB} MiB)", said


@NAMESPACED
def test_what_a_program_writes_is_bounded_and_gone_after_it():
    marker = f"/tmp/ds_train_test_tools_{os.getpid()}"
    said = run_limited(f"open({marker!r}, 'w').write('x')\nfor i in range({DISK_MB // 32 + 2}):\n"
                       "    open(f'f{i}', 'wb').write(b'x' * (32 << 20))", 20, 256)
    assert said == ("error: OSError: [Errno 28] No space left on device (its directory, /tmp, /var/tmp and /dev/shm "
                    f"may hold {DISK_MB} MiB and {FILES} files each)"), said
    assert not os.path.exists(marker)  # its /tmp was its own
    said = run_limited(f"for i in range({FILES + 10}):\n    open(f'/dev/shm/f{{i}}', 'w').close()", 20, 256)
    assert said.endswith(f"may hold {DISK_MB} MiB and {FILES} files each)"), said  # empty files: no inode flood


def test_a_gigabyte_of_output_is_cut_as_it_is_read():
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB
    start = time.monotonic()
    said = run_limited("import sys\nfor _ in range(1 << 14):\n    sys.stdout.write('x' * 65535 + '\\n')", 30, 256)
    took = time.monotonic() - start
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - grown
    assert said.endswith("\nerror: the program printed more than 1024 KiB and was stopped"), said[-200:]
    # cut as it reads, not after its 30 s limit: generous for a loaded 2-core CI
    assert len(said) <= OUTPUT_CHARS + 100 and took < 20 and grown < 64 << 10, (len(said), took, grown)


@NAMESPACED
def test_a_program_has_no_network():
    with socket.socket() as listening:  # the trainer's 127.0.0.1 accepts: the program's does not reach it
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        port = listening.getsockname()[1]
        said = run_limited(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
                           "print('connected')", 5, 256)
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    assert said == "error: OSError: [Errno 101] Network is unreachable (the program has no network)", said


@pytest.mark.skipif(not HOW.own_uid, reason="not root: the program runs as the trainer's user")
def test_a_program_cannot_write_or_delete_what_the_trainer_owns():
    import tempfile

    # not in /tmp (the program's own): beside the tests, which everyone may enter
    with tempfile.TemporaryDirectory(dir=os.path.dirname(os.path.abspath(__file__))) as trainers:
        os.chmod(trainers, 0o755)  # readable by everyone, writable by the trainer only
        kept = os.path.join(trainers, "kept")
        with open(kept, "w") as f:
            f.write("the trainer's")
        said = run_limited(f"import os\nprint(open({kept!r}).read(), os.getuid())\nos.remove({kept!r})", 5, 256)
        assert said.startswith("the trainer's ") and "PermissionError: [Errno 13]" in said, said
        assert int(said.split()[2]) != os.geteuid() and open(kept).read() == "the trainer's"
        said = run_limited(f"open({os.path.join(trainers, 'new')!r}, 'w').write('x')", 5, 256)
        assert "PermissionError: [Errno 13]" in said and os.listdir(trainers) == ["kept"], said
    assert run_limited("open('own', 'w').write('x'); import os; print(os.listdir('.'))", 5, 256) == "['own']\n"


@pytest.mark.skipif(not HOW.own_uid, reason="not root: programs run as the trainer's user")
def test_programs_at_once_each_run_as_a_uid_of_their_own():
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(4) as pool:
        said = list(pool.map(lambda _: run_limited("import os, time; time.sleep(0.5); print(os.getuid())", 10, 256),
                             range(4)))
    assert len(set(said)) == 4 and all(s.strip().isdigit() for s in said), said


@pytest.mark.skipif(not HOW.own_proc, reason="this host refuses a /proc of the program's own")
def test_a_program_sees_only_its_own_processes():
    said = run_limited("import os\nprint(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))", 5, 256)
    assert said == "[1, 2]\n", said  # its pid 1 and itself: none of the trainer's


@NAMESPACED
def test_a_host_that_refuses_part_of_the_isolation_gets_the_rest(tmp_path):
    refusing = tmp_path / "unshare"  # refuses to mount a /proc, as a container's masked /proc does
    refusing.write_text(f'#!/bin/sh\nfor a in "$@"; do [ "$a" = --mount-proc ] && exit 1; done\n'
                        f'exec {HOW.unshare} "$@"\n')
    refusing.chmod(0o755)
    assert decide_isolation(str(refusing), HOW.own_uid) == Isolation(str(refusing), HOW.own_uid, False)


def test_a_host_without_namespaces_gets_the_plain_mode():
    assert decide_isolation(None, False) == Isolation(None, False)
    assert decide_isolation("/bin/false", False) == Isolation(None, False)  # unshare refused: tried once, not used
    assert run_limited("print(6 * 7)", 2, 256, Isolation(None, False)) == "42\n"
    assert run_limited("while True: pass", 1, 256, Isolation(None, False)) == \
        "error: the program ran past 1 s and was stopped"
