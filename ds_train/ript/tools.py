"""Built-in tools for environment tasks (`tools: [ds_train.ript.tools:run_python]` in a ript.tasks entry).

`run_python` runs the model's code in a fresh interpreter (`python -I`: no user site, no PYTHONPATH, the
trainer's environment variables dropped), in a temporary directory, with its own process group, no stdin,
and limits on its CPU time, wall time and memory (RLIMIT_CPU, a timeout, RLIMIT_AS). What it printed, or what
stopped it, is the tool's result: a limit reached is an answer the model reads, not a fault of the episode.
It is not a sandbox against hostile code (the program can read what the trainer's user can); run untrusted
policies in a container.
"""

from __future__ import annotations

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
