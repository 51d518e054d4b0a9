#!/usr/bin/env bash
# The README's test command: set up .venv (the main job's part, then the test tools, CPU Adam and vLLM:
# scripts/setup.sh), then run the whole suite (unit and multi-process tests).
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -k config`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# tests/test_multinode.py starts a two-node cluster on loopback addresses (scripts/local_cluster.sh):
# it needs pdsh and sshd. tests/test_slurm.py submits jobs to a one-node SLURM (scripts/local_slurm.sh
# starts it): slurmctld, slurmd, munge. Installed once, non-interactively, where missing.
if ! command -v pdsh >/dev/null || [ ! -x /usr/sbin/sshd ] || ! command -v ssh-keygen >/dev/null ||
   [ ! -x /usr/sbin/slurmctld ] || [ ! -x /usr/sbin/slurmd ] || ! command -v sbatch >/dev/null ||
   [ ! -x /usr/sbin/munged ]; then
  sudo=""
  [ "$(id -u)" = 0 ] || sudo="sudo"
  echo "test: installing pdsh, openssh-server, slurm and munge (log: .venv/apt.log)"
  if ! { $sudo env DEBIAN_FRONTEND=noninteractive apt-get update -q &&
         $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
           pdsh openssh-server openssh-client slurmd slurmctld slurm-client munge; } > .venv/apt.log 2>&1; then
    tail -20 .venv/apt.log
    echo "test: could not install pdsh / openssh-server / slurm / munge (full log: .venv/apt.log)" >&2
    exit 1
  fi
fi
export PATH="$PWD/.venv/bin:$PATH"
# DeepSpeed JIT-builds its CPU ops once per user, version and install (scripts/extensions_dir.sh says where).
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$(bash scripts/extensions_dir.sh)}"
# The suite starts some 500 Python processes that import ds_train: let them cache its bytecode (a host
# may set PYTHONDONTWRITEBYTECODE; __pycache__/ is ignored by git).
unset PYTHONDONTWRITEBYTECODE
# The import contract first (pyproject.toml [tool.importlinter]): a wrong import fails in a second.
lint-imports --no-cache > .venv/lint-imports.log 2>&1 || { cat .venv/lint-imports.log; exit 1; }
# Two workers, a test file to each, the longest files first (tests/conftest.py says how they share the
# machine): a launch's start-up is one process importing while the other worker's ranks compute.
# `-n 0` runs in one process.
exec python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder "$@"
