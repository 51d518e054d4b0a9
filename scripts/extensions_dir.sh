#!/usr/bin/env bash
# Prints the directory DeepSpeed JIT-builds its CPU ops into (the shared-memory comm op on the first
# multi-process run, CPU Adam for offload; a few minutes on a 2-core CPU): one per user, per Python /
# torch / DeepSpeed version and per DeepSpeed install. torch rebuilds an op whose build file changed,
# and that file names the install's sources: two virtualenvs sharing one directory rebuilt each other's
# ops on every turn (a fresh clone's tests beside the main checkout's paid ~35 s a launch). Each install
# builds once. torch locks an op's directory while it builds it, so two runs never build over each
# other; a lock left by a build that was killed would stall every later run, so a lock older than any
# build here (15 minutes) is removed.
# Run after scripts/setup.sh (it reads the versions from .venv).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  echo "extensions: no .venv/bin/python in $PWD: run scripts/setup.sh first" >&2
  exit 1
fi
key=$(.venv/bin/python -c 'import hashlib, importlib.metadata as m, importlib.util, os, sys
v = sys.version_info
where = os.path.realpath(importlib.util.find_spec("deepspeed").submodule_search_locations[0])
print("py%d.%d-torch%s-deepspeed%s-%s" % (v[0], v[1], m.version("torch"), m.version("deepspeed"),
                                         hashlib.sha256(where.encode()).hexdigest()[:8]))')
dir="${XDG_CACHE_HOME:-$HOME/.cache}/ds_train/torch_extensions/$key"
mkdir -p "$dir"
find "$dir" -mindepth 2 -maxdepth 2 -name lock -mmin +15 -print -delete | sed 's/^/extensions: removed a stale build lock /' >&2
echo "$dir"
