#!/usr/bin/env bash
# A CPU venv that compiles the flydsl backend's kernels for gfx950 offline, for the tests marked
# flydsl_compile (tests/models/qwen3_next/flydsl, tests/kernels/flydsl).
#
#   tools/ci/install_flydsl.sh [VENV]            (default: .venv-flydsl; ~1 min, ~1.7 GB)
#   VENV/bin/python -m pytest -q -m flydsl_compile tests   (the compile sweep: minutes on 2 cores)
#
# FlyDSL (PyPI flydsl, cp310+ manylinux wheel, MLIR/LLVM inside) imports torch at start-up
# but needs no GPU with COMPILE_ONLY=1 ARCH=gfx950; its last step links the code object with
# $ROCM_PATH/llvm/bin/ld.lld. There is no ROCm here: ziglang's wheel bundles LLD, and
# mono_ext.kernels.flydsl.toolchain.ensure_lld writes a two-line shim that runs it
# (<venv>/mono_ext-rocm/llvm/bin/ld.lld). No ROCm device library is linked: the kernels
# call intrinsics directly.
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=${1:-.venv-flydsl}
PY=${PYTHON:-python3}

"$PY" -m venv "$VENV"
P="$VENV/bin/python -m pip"
C=(-c tools/ci/constraints/flydsl.txt)  # the versions this environment passed with
$P install -q "${C[@]}" --upgrade pip
$P install -q "${C[@]}" torch==2.13.0  # the CPU build, as in the base venv (FlyDSL imports torch)
$P install -q "${C[@]}" flydsl==0.5.0 ziglang==0.17.1 numpy pytest  # flydsl.expr imports numpy; its wheel does not declare it
$P install -q "${C[@]}" -e .

"$VENV/bin/python" - <<'PY'
import importlib.metadata as md
import subprocess

from mono_ext.kernels.flydsl.toolchain import ensure_lld

lld = ensure_lld() / "llvm" / "bin" / "ld.lld"
ver = subprocess.run([str(lld), "--version"], check=True, capture_output=True, text=True)
print(f"flydsl {md.version('flydsl')}, {ver.stdout.strip()} via {lld}")
PY
