#!/usr/bin/env bash
# The README's test command: set up .venv, then run the whole suite (unit and multi-process tests).
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -k config`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH"
exec python -m pytest -q "$@"
