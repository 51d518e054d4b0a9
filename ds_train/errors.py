"""The exceptions library code raises instead of exiting; the CLI maps each to an exit code.

A `UserError` is bad input: one line (no traceback unless `--debug`), exit 2. A `RunStopped` is an
orderly stop that every rank agreed on (a signal, a run of non-finite steps): the run tears down
normally and the CLI exits with the stop's code. Everything else is a bug and keeps its traceback.
"""


class UserError(Exception):
    """Bad input from the user: config, hostfile, data, checkpoint or command line."""

    exit_code = 2


class AgreedError(UserError):
    """Bad input that every rank found at once, after the ranks compared notes (a checkpoint a rank
    lacks, too little disk space): printed by rank 0 alone."""


class RunStopped(Exception):
    """Every rank stopped at the same step boundary, so collectives in the teardown are safe."""

    exit_code = 1
    is_error = True  # printed as `error:`; a requested stop (a signal) is not


class Preempted(RunStopped):
    """SIGTERM / SIGINT: all ranks saved a checkpoint and stop; exit 128 + the signal number."""

    is_error = False

    def __init__(self, signum: int, step: int, unit: str = "step"):
        self.exit_code = 128 + signum
        super().__init__(f"stopped by signal {signum} at {unit} {step}; checkpoint saved; launch the "
                         f"same command again to resume")


class NonFiniteStop(RunStopped):
    """train.nonfinite=stop: patience ran out (the decision is the same on every rank)."""

    exit_code = 3

    def __init__(self, where: str, in_a_row: int):
        super().__init__(f"{where}: {in_a_row} consecutive steps with non-finite gradients "
                         f"(train.nonfinite=stop, train.nonfinite_patience={in_a_row}); none was "
                         f"applied and no checkpoint was written; resume from the last good one "
                         f"with a lower optim.lr or train.nonfinite=skip")


class Stalled(Exception):
    """A job that stopped moving: ranks that never reached the rendezvous, or a hang the watchdog
    found. Exit 5; the message names the ranks, their hosts, phases and steps."""

    exit_code = 5

    def __init__(self, message: str, agreed: bool = False):
        super().__init__(message)
        self.agreed = agreed  # every rank found the same: rank 0 says it


class PeerFailed(Exception):
    """This rank's collective broke because another rank died or failed: the job's verdict (one
    line) replaces this rank's traceback, which goes to its log. The rank that wrote the verdict
    says it (`say`); the others end quietly. Exit 1."""

    exit_code = 1

    def __init__(self, verdict: str, say: bool):
        super().__init__(verdict)
        self.say = say


class OutOfMemory(Exception):
    """A CUDA out-of-memory on this rank, with the memory plan and ranked fixes as the message."""

    exit_code = 4


# What a failed device allocation says: torch's OutOfMemoryError, and the RuntimeError a raw CUDA call
# or cuBLAS (its workspace, at the first matmul of a nearly full GPU) raises instead.
DEVICE_OOM = ("CUDA out of memory", "CUDA error: out of memory", "CUBLAS_STATUS_ALLOC_FAILED")


def is_device_oom(exc: BaseException | None) -> bool:
    return isinstance(exc, RuntimeError) and any(s in str(exc) for s in DEVICE_OOM)


def device_oom_said(exc: BaseException) -> str:
    """What the device's allocator said, on one line, without its advice: torch's "CUDA out of memory.
    Tried to allocate 2.00 GiB. GPU 0 has a total capacity of ... Of the allocated memory ..."."""
    text = " ".join(str(exc).split())
    return text.split(" If reserved but unallocated")[0].split(" See documentation for Memory Management")[0]


class OneLineParser(__import__("argparse").ArgumentParser):
    """An argparse parser whose errors are bad input like any other: one `ds-train: error:` line
    (exit 2), pointing at --help instead of printing the usage block first."""

    def error(self, message: str):
        raise UserError(f"{message} (see `{self.prog} --help`)")


def load_user_object(spec: str, where: str):
    """`module:attr` named in the config (a verifier, a task, a policy): whatever importing the module or
    looking the name up raises (a syntax error, an exception at import, a missing name) becomes one
    UserError naming `where`, the spec, the error and the file and line that raised it; the original
    traceback is chained to it (printed under --debug)."""
    import pkgutil

    try:
        return pkgutil.resolve_name(spec)
    except (Exception, SystemExit) as e:
        raise UserError(f"{where}: cannot load {spec!r}: {raised_at(e)}") from e


def raised_at(e: BaseException) -> str:
    """`Type: message (file, line N)`: the error and where in the user's code it was raised (the
    deepest frame outside Python's own library and the installed packages, else the deepest outside
    the import machinery; a syntax error's own file and line)."""
    import sysconfig
    import traceback

    said = f"{type(e).__name__}: {e.msg if isinstance(e, SyntaxError) else e}"
    if isinstance(e, SyntaxError) and e.filename:
        return f"{said} ({e.filename}, line {e.lineno})"
    libraries = tuple({sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")})
    frames = [f for f in traceback.extract_tb(e.__traceback__)
              if not f.filename.startswith("<frozen") and not f.filename.endswith(("pkgutil.py", "errors.py"))
              and "/importlib/" not in f.filename]
    frame = next((f for f in reversed(frames) if not f.filename.startswith(libraries)), frames[-1] if frames else None)
    return f"{said} ({frame.filename}, line {frame.lineno})" if frame else said
