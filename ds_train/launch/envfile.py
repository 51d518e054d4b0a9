"""`.deepspeed_env`: the variables a job needs on the remote nodes.

The deepspeed launcher forwards only NCCL*/PYTHON*/UCX*/MV2* variables by itself, plus the
`KEY=value` lines of the file named by DS_ENV_FILE. It reads that file with `split('=', 1)` per line
(a blank line crashes it) and exports each value inside double quotes on the remote shell's
command line (`export KEY="value"`), where `$`, backticks, `"` and `\\` are still expanded. So a
value holding one of those, or a newline, is refused by name instead of being written.

Forwarded when set: the job's own variables (DS_ACCELERATOR, WANDB_MODE, WANDB_PROJECT, HF_HOME,
TORCH_EXTENSIONS_DIR, PYTHONPATH), the communication and debugging knobs every rank must agree on
(NCCL_*, TORCH_NCCL_*, TORCH_DISTRIBUTED_DEBUG, GLOO_SOCKET_IFNAME, CUDA_LAUNCH_BLOCKING,
PYTORCH_CUDA_ALLOC_CONF), and the names listed under launch.env; a name that looks like a secret
travels only when listed.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Mapping

from ds_train.errors import UserError
from ds_train.fs import replacing

ENV_FILE = ".deepspeed_env"
# Forwarded when set, unless the name looks like a secret.
FORWARD_NAMES = ("DS_ACCELERATOR", "WANDB_MODE", "WANDB_PROJECT", "HF_HOME", "PYTHONPATH",
                 "TORCH_EXTENSIONS_DIR",
                 # Debugging and allocator knobs: set on the launching shell, they must reach every rank.
                 "TORCH_DISTRIBUTED_DEBUG", "CUDA_LAUNCH_BLOCKING", "PYTORCH_CUDA_ALLOC_CONF",
                 "GLOO_SOCKET_IFNAME")
# NCCL's own variables and PyTorch's NCCL process-group ones (TORCH_NCCL_ASYNC_ERROR_HANDLING,
# TORCH_NCCL_BLOCKING_WAIT, ...).
FORWARD_PREFIXES = ("NCCL_", "TORCH_NCCL_")
# Forwarded by the deepspeed launcher itself from its environment (runner.EXPORT_ENVS, plus the
# CUDA accelerator's NCCL): their values meet the same quoting.
LAUNCHER_PREFIXES = ("MLFLOW", "PYTHON", "MV2", "UCX", "NCCL")
# Forwarded only when listed by name under launch.env.
_SECRET = re.compile(r"API_?KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL|PRIVATE|(^|_)KEY$", re.IGNORECASE)
# What stays live inside the double quotes DeepSpeed puts around a value (bash has no history
# expansion in a non-interactive shell, so `!` is inert).
_UNSAFE = re.compile(r'[$`"\\\n\r\x00]')


def looks_secret(name: str) -> bool:
    return _SECRET.search(name) is not None


def collect_env(environ: Mapping[str, str], listed: list[str], cwd: str) -> dict[str, str]:
    """The variables to write: the defaults that are set and not secret-looking, then `listed`.

    PYTHONPATH gets `cwd` in front, as the launcher itself does before exporting it; the file is
    read after that export and would otherwise drop the working directory from the path.
    """
    out = {}
    for name in sorted(environ):
        if (name in FORWARD_NAMES or name.startswith(FORWARD_PREFIXES)) and not looks_secret(name):
            out[name] = environ[name]
    out["PYTHONPATH"] = cwd + (":" + environ["PYTHONPATH"] if environ.get("PYTHONPATH") else "")
    missing = [name for name in listed if name not in environ]
    if missing:
        raise UserError(f"launch.env: {', '.join(missing)} not set in this environment; set "
                        f"{'it' if len(missing) == 1 else 'them'} before launching or remove "
                        f"{'it' if len(missing) == 1 else 'them'} from launch.env")
    for name in listed:
        out[name] = environ[name]
    return out


def launcher_forwarded(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables the deepspeed launcher exports to the remote nodes without being asked."""
    return {name: value for name, value in environ.items() if name.startswith(LAUNCHER_PREFIXES)}


def check_values(variables: Mapping[str, str]) -> None:
    """Refuse, by name, every value the launcher's quoting would not pass through unchanged."""
    bad = []
    for name, value in variables.items():
        if _UNSAFE.search(value):
            bad.append(f"{name} (contains {sorted(set(_UNSAFE.findall(value)))!r})")
        elif value != value.strip():
            bad.append(f"{name} (leading or trailing whitespace, which the launcher strips)")
    if bad:
        raise UserError(f"environment: cannot forward {'; '.join(bad)} to the remote nodes: the "
                        f"deepspeed launcher exports values inside double quotes on the remote shell, "
                        f"where $, backticks, \" and \\ are expanded and newlines end the command; "
                        f"change the value or drop the variable from the environment / launch.env")


def render(variables: Mapping[str, str]) -> str:
    """`KEY=value` lines, no blank line (the launcher's reader crashes on one)."""
    check_values(variables)
    return "".join(f"{name}={value}\n" for name, value in variables.items())


def write_env_file(path: Path, variables: Mapping[str, str]) -> Path:
    """Write the file readable by its owner only: listed variables may be credentials."""
    text = render(variables)
    path.parent.mkdir(parents=True, exist_ok=True)
    with replacing(path) as tmp:
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
            f.write(text)
    return path.resolve()
