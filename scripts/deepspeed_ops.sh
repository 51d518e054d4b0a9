#!/usr/bin/env bash
# DeepSpeed's CPU ops prebuilt: the shared-memory all-reduce every multi-process CPU run loads, and, with the
# argument cpu_adam, CPU Adam for optimizer offload as well (the tests; the quickstart needs the all-reduce only).
# Unbuilt, each run JIT-compiles them on first use into its install's extensions directory
# (scripts/extensions_dir.sh): ~4 CPU-minutes for both, for every new .venv on the machine.
# Here they are compiled once per machine into a DeepSpeed wheel (DS_BUILD_SHM_COMM, DS_BUILD_CPU_ADAM),
# kept in ~/.cache/ds_train/wheels under the Python and torch versions and this CPU's instruction sets
# (the ops are built for this CPU: -march=native), with a -shm suffix where it holds the all-reduce alone,
# and installed into .venv; a later .venv installs the same wheel in seconds (the wheel with both ops
# serves either call). Only where torch is a CPU build: a CUDA host builds its ops when a run needs
# them (docs/config.md). A build that fails leaves the JIT path, with one line. Run by scripts/setup.sh, first
# with --build-only (the wheel into the cache, nothing installed: beside the pip install of the requirements).
set -euo pipefail
cd "$(dirname "$0")/.."
py=.venv/bin/python
"$py" -c 'import sys, torch
sys.exit(torch.version.cuda is not None or torch.version.hip is not None)' >/dev/null 2>&1 || exit 0
adam=0 build_only=0
for arg in "$@"; do
  case $arg in
    cpu_adam) adam=1 ;;
    --build-only) build_only=1 ;;
    *) echo "usage: bash scripts/deepspeed_ops.sh [cpu_adam] [--build-only]" >&2; exit 2 ;;
  esac
done
# the installed DeepSpeed's version, or requirements.txt's pin before it is installed (--build-only)
version=$("$py" -c 'import importlib.metadata as m; print(m.version("deepspeed"))' 2>/dev/null ||
          sed -n 's/^deepspeed==//p' requirements.txt)
if "$py" -c 'import sys; from deepspeed.git_version_info import installed_ops as o
sys.exit(not (o.get("deepspeed_shm_comm") and (o.get("cpu_adam") or sys.argv[1] == "0")))' "$adam" \
   >/dev/null 2>&1; then
  exit 0  # installed with them already
fi
key=$("$py" -c 'import hashlib, importlib.metadata as m, sys
flags = next((line.split(":", 1)[1].split() for line in open("/proc/cpuinfo") if line.startswith("flags")), [])
print("py%d.%d-torch%s-cpu%s" % (sys.version_info[0], sys.version_info[1], m.version("torch"),
                                 hashlib.sha256(" ".join(sorted(flags)).encode()).hexdigest()[:10]))')
cache="${XDG_CACHE_HOME:-$HOME/.cache}/ds_train/wheels"
wheels="$cache/$key"  # both ops
wheel=$(ls "$wheels"/deepspeed-"$version"-*.whl 2>/dev/null | head -1 || true)
if [ -z "$wheel" ] && [ "$adam" = 0 ]; then
  wheels="$cache/$key-shm"
  wheel=$(ls "$wheels"/deepspeed-"$version"-*.whl 2>/dev/null | head -1 || true)
fi
if [ -z "$wheel" ]; then
  ops="shared-memory all-reduce"
  [ "$adam" = 1 ] && ops="$ops and CPU Adam"
  echo "setup: compiling DeepSpeed $version's $ops once for this machine (log: .venv/ops.log)"
  tmp=$(mktemp -d)
  # ninja (a requirement of DeepSpeed's, from .venv/bin) compiles an op's sources in parallel
  if ! PATH="$PWD/.venv/bin:$PATH" DS_ENABLE_NINJA=1 DS_ACCELERATOR=cpu DS_BUILD_OPS=0 DS_BUILD_SHM_COMM=1 \
       DS_BUILD_CPU_ADAM=$adam "$py" -m pip wheel --no-deps --no-build-isolation --no-cache-dir -w "$tmp" "deepspeed==$version" \
       > .venv/ops.log 2>&1; then
    rm -rf "$tmp"
    echo "setup: could not prebuild DeepSpeed's CPU ops (log: .venv/ops.log); runs JIT-build them on first use" \
      >&2
    exit 0
  fi
  mkdir -p "$wheels"
  built=$(ls "$tmp"/deepspeed-*.whl)
  wheel="$wheels/$(basename "$built")"
  mv "$built" "$wheel.part" && mv "$wheel.part" "$wheel"  # whole or absent, for a setup beside this one
  rm -rf "$tmp"
fi
[ "$build_only" = 1 ] || "$py" -m pip install --no-deps --force-reinstall "$wheel" >> .venv/pip.log 2>&1
