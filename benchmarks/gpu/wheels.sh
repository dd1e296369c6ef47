#!/usr/bin/env bash
# Wheels that benchmarks/gpu_check.sh needs on a GPU machine whose image has PyTorch but
# not the trainer's other dependencies, saved to .whl/ (ignored by git) for the device to
# install offline:
#     benchmarks/gpu/wheels.sh [PYTHON_VERSION]      # default 3.12, the device image's
# Then, on the GPU machine, from the repository root (gpu_check.sh does this itself when
# .whl/ exists, into a private --target directory, so the image's packages stay as they are):
#     bash benchmarks/gpu_check.sh
# Versions are the ones this checkout's .venv runs (pip freeze), so the GPU check runs the
# code the CPU suite tested. Torch, numpy and the rest of the image's stack are not carried:
# the image's CUDA torch must stay the torch that is imported.
set -euo pipefail
cd "$(dirname "$0")/../.."
PYVER=${1:-3.12}
VENV_PY=${VENV_PY:-.venv/bin/python}
# The trainer's import closure (trainer.segment, storage on file://, spec, common) minus
# what the device image already holds (its package list: the device notes, KINDS.md).
NEEDED=(deepspeed hjson pydantic pydantic_core annotated-types typing-inspection
        typing_extensions structlog opentelemetry-api opentelemetry-sdk
        opentelemetry-semantic-conventions)
freeze=$("$VENV_PY" -m pip freeze 2>/dev/null)
pins=()
for name in "${NEEDED[@]}"; do
  key=$(echo "$name" | tr '_' '-' | tr '[:upper:]' '[:lower:]')
  pin=$(echo "$freeze" | awk -F'==' -v k="$key" '{n=tolower($1); gsub("_","-",n); if (n==k) print $0}')
  [[ -n "$pin" ]] || { echo "gpu_wheels: $name is not installed in $VENV_PY; run make install" >&2; exit 2; }
  pins+=("$pin")
done
rm -rf .whl && mkdir -p .whl
# DeepSpeed publishes only an sdist: build its wheel (pure Python, no ops prebuilt: they are
# JIT-built where used) without build isolation, against this venv's torch.
ds=$(printf '%s\n' "${pins[@]}" | grep -i '^deepspeed==')
DS_BUILD_OPS=0 "$VENV_PY" -m pip wheel -q --no-deps --no-build-isolation -w .whl "$ds"
others=$(printf '%s\n' "${pins[@]}" | grep -vi '^deepspeed==')
# shellcheck disable=SC2086
"$VENV_PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .whl $others
ls .whl
du -sh .whl
