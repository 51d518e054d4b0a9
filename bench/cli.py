"""The entry point every script under bench/ shares: a failure says so in one line, never in a traceback.

    if __name__ == "__main__":
        sys.exit(cli.run(main))

Bad input (ds_train's UserError) is its own line and exit code (2); any other error is one line
naming the script, the error and where it was raised, exit 1. `--debug` anywhere on the command
line shows the traceback instead (it is taken off the command line before the script parses it).
A script that stops with `sys.exit("...")` has said what went wrong itself.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def ArgumentParser(*args, **kwargs):
    """argparse's parser, whose errors are bad input like any other: one line (exit 2), no usage block."""
    from ds_train.errors import OneLineParser

    return OneLineParser(*args, **kwargs)


def run(main, *args) -> int:
    """main(*args)'s exit code; an exception as one line on stderr (see the module's doc)."""
    debug = "--debug" in sys.argv[1:]
    if debug:
        sys.argv.remove("--debug")
    try:
        return main(*args) or 0
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # a bench's failure, whatever raised it: one line (the traceback under --debug)
        if debug:
            raise
        from ds_train.errors import RunStopped, UserError, raised_at

        said = str(e) if isinstance(e, (UserError, RunStopped)) else f"{raised_at(e)} (--debug shows the traceback)"
        print(f"{script_name()}: error: {one_line(said)}", file=sys.stderr, flush=True)
        return getattr(e, "exit_code", 1)


def fail(message: str) -> SystemExit:
    """`raise cli.fail("...")`: stop with one line naming the script."""
    return SystemExit(f"{script_name()}: {one_line(message)}")


def saved_output(text: str, name: str) -> Path:
    """A failed child's whole output, kept where the one line can point at it."""
    import tempfile

    path = Path(tempfile.mkdtemp(prefix="ds_train_bench_")) / f"{name}.log"
    path.write_text(text)
    return path


def script_name() -> str:
    path = Path(sys.argv[0]).resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.name


def one_line(text: str, limit: int = 600) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit - 3] + "..."
