"""Built-in tools for environment tasks (`tools: [ds_train.ript.tools:run_python]` in a ript.tasks entry).

`calculator` evaluates arithmetic (numbers, + - * / // % **, parentheses) by walking its syntax tree: no
`eval`, nothing but arithmetic reachable, powers bounded. A wrong expression is an answer the model reads
(`error: ...`), as a calculator shows it, not a fault of the episode.

`run_python` runs the model's code in a fresh interpreter (`python -I`: no user site, no PYTHONPATH, the
trainer's environment variables dropped), in a temporary directory, with its own process group, no stdin,
and limits on its CPU time, wall time and memory (RLIMIT_CPU, a timeout, RLIMIT_AS). What it printed, or what
stopped it, is the tool's result: a limit reached is an answer the model reads, not a fault of the episode.
It is not a sandbox against hostile code (the program can read what the trainer's user can); run untrusted
policies in a container.
"""

from __future__ import annotations

import ast
import math
import operator
import os
import subprocess
import sys
import tempfile

TIME_S = 10  # CPU and wall-clock seconds a program may take
MEMORY_MB = 1024  # its address space
OUTPUT_CHARS = 2000  # the end of what it printed that the model reads


def run_limited(code: str, seconds: float = TIME_S, memory_mb: int = MEMORY_MB) -> str:
    """`code` in a fresh interpreter within `seconds` and `memory_mb`: its output, or why it stopped."""
    import resource
    import signal

    def limits() -> None:  # in the child, before python starts
        resource.setrlimit(resource.RLIMIT_CPU, (int(seconds) + 1, int(seconds) + 1))
        resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20))

    with tempfile.TemporaryDirectory(prefix="ds_train_code_") as cwd:
        proc = subprocess.Popen([sys.executable, "-I", "-c", code], cwd=cwd, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=limits,
                                start_new_session=True, env={"PATH": os.defpath, "LANG": "C.UTF-8"})
        try:
            out, err = proc.communicate(timeout=seconds)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the program and whatever it started
            proc.communicate()
            return f"error: the program ran past {seconds:g} s and was stopped"
    out = out[-OUTPUT_CHARS:]
    if proc.returncode == 0:
        return out
    lines = err.strip().splitlines()
    if "MemoryError" in err:
        why = f"error: the program ran out of memory (its limit is {memory_mb} MiB)"
    elif proc.returncode < 0:
        why = f"error: the program was stopped by signal {-proc.returncode} (its CPU limit is {seconds:g} s)"
    else:
        why = f"error: {lines[-1] if lines else f'exit status {proc.returncode}'}"
    return (out + "\n" if out else "") + why


def run_python(code: str) -> str:
    """Runs a Python program in a fresh interpreter and returns what it printed.

    Args:
        code: the program; print what you want to see
    """
    return run_limited(code)


_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_SIGNS = {ast.UAdd: operator.pos, ast.USub: operator.neg}
RESULT_DIGITS = 1000  # the longest result a power may give


def calculator(expression: str) -> str:
    """Evaluates an arithmetic expression and returns its value.

    Args:
        expression: numbers, + - * / // % ** and parentheses, e.g. "347 * 86"
    """
    try:
        value = _value(ast.parse(expression.strip(), mode="eval").body)
    except SyntaxError:
        return f"error: {expression!r} is not an arithmetic expression"
    except ZeroDivisionError:
        return "error: division by zero"
    except OverflowError:
        return "error: the result is too large"
    except ValueError as e:
        return f"error: {e}"
    if isinstance(value, complex):
        return "error: the result is not a real number"
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        value = int(value)
    return str(value) if isinstance(value, int) else f"{value:.12g}"


def _value(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _SIGNS:
        return _SIGNS[type(node.op)](_value(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) * math.log10(max(2, abs(left))) > RESULT_DIGITS:
            raise ValueError(f"the result has more than {RESULT_DIGITS} digits")
        return _OPS[type(node.op)](left, right)
    raise ValueError(f"{ast.unparse(node)!r} is not arithmetic (numbers, + - * / // % ** and parentheses)")
