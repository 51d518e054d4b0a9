#!/usr/bin/env bash
# The wheels a bare GPU machine lacks, into .whl/ (git-ignored), at the versions this checkout pins:
# DeepSpeed built from its sdist (pure Python; its ops JIT-compile there with nvcc), and the wheels
# it and ds_train need that the GPU image does not hold (pydantic, hjson, ...), and transformers /
# tokenizers / regex at our pins (the image's are older; its huggingface-hub 1.x satisfies
# transformers, ours (2.x) would need httpx2, which it lacks). Idempotent; about 20 MB.
#   bash bench/gpu/wheels.sh        # here, after scripts/setup.sh
# On the GPU machine (bench/gpu/README.md): bench/gpu/env.sh installs them into /tmp/site.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
mkdir -p .whl
version() { "$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$1"; }
ds=$(version deepspeed)
if ! ls .whl/deepspeed-"$ds"-*.whl >/dev/null 2>&1; then
    "$PY" -m pip wheel -q --no-deps -w .whl "deepspeed==$ds"
fi
specs=()
for name in hjson pydantic pydantic_core annotated-types typing-inspection typing_extensions transformers tokenizers regex; do
    v=$(version "$name")
    specs+=("$name==$v")
    # a wheel of another version, from an earlier pin: env.sh would install both
    find .whl -name "${name//-/_}-*.whl" ! -name "${name//-/_}-$v-*" -delete
done
specs+=("liger-kernel==0.8.5")  # model.liger_kernels (pyproject's `liger` extra); the image has its triton
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "${specs[@]}"
ls -1 .whl
du -sh .whl
