#!/usr/bin/env bash
# One Buildkite GPU step: check the agent has the device the step was written for, install
# mono_ext over the image's own torch (ROCm or CUDA build: a venv with system site packages,
# so pip never swaps it for a PyPI build), then run the GPU tests with JUnit reports.
#
#   bash .buildkite/gpu_step.sh gfx950   MI355X x8: flydsl backend (+ the flydsl tests)
#   bash .buildkite/gpu_step.sh sm_90    H200: triton backend
# The device tests live by component: generic device code (tests/kernels/triton, flydsl), the
# model's backends (tests/models/qwen3_next/triton, flydsl) and the engines (tests/engines);
# the Triton ones skip on a ROCm torch (tests/conftest.py).
set -euo pipefail
cd "$(dirname "$0")/.."
ARCH=${1:?usage: gpu_step.sh gfx950|sm_90}
PY=${PYTHON:-python3}
VENV=.venv-gpu-$ARCH

"$PY" -m venv --system-site-packages "$VENV"
P="$VENV/bin/python -m pip"
$P install -q --upgrade pip
if [ "$ARCH" = gfx950 ]; then
  $P install -q -e '.[test]' 'flydsl>=0.5'
  TESTS=(tests/models/qwen3_next/flydsl tests/kernels/flydsl tests/kernels/triton
    tests/models/qwen3_next/triton tests/engines)
else
  $P install -q -e '.[test]'
  TESTS=(tests/kernels/triton tests/models/qwen3_next/triton tests/engines)
fi

# The device must be the one this step is for, and all its GPUs visible: a step that ran on
# the wrong agent must fail, not skip its way to green.
"$VENV/bin/python" - "$ARCH" "${MONO_EXT_EXPECT_GPUS:-1}" <<'PY'
import sys

import torch

want, gpus = sys.argv[1], int(sys.argv[2])
assert torch.cuda.is_available(), "no GPU visible to torch"
props = torch.cuda.get_device_properties(0)
if torch.version.hip:
    arch = props.gcnArchName.split(":")[0]
else:
    arch = f"sm_{props.major}{props.minor}"
assert arch == want, f"agent has {arch}, this step is for {want}"
assert torch.cuda.device_count() >= gpus, f"{torch.cuda.device_count()} GPUs, need {gpus}"
print(f"{props.name} ({arch}) x{torch.cuda.device_count()}, torch {torch.__version__}")
PY
"$VENV/bin/mono-ext" doctor
# informational: the plan or every refusal at this TP (exit 1 while the backend refuses)
"$VENV/bin/mono-ext" explain qwen3-next-80b-a3b --tp "${MONO_EXT_EXPECT_GPUS:-1}" || true

mkdir -p reports
"$VENV/bin/python" -m pytest -q -p no:cacheprovider -rs --junitxml="reports/$ARCH.xml" "${TESTS[@]}"
