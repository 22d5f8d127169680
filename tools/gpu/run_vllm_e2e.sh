#!/bin/bash
# vLLM 0.26 + mono_ext (triton backend) end to end on the H200: tests/engines/vllm/test_vllm_gpu.py.
#
# Here (CPU box, network):   bash tools/gpu/run_vllm_e2e.sh prepare
#   builds ../shared/engines/build_vllm_gpu_bundle.sh's payload into .gpu_bundle/build (once),
#   re-splits it into .gpu_bundle/part.NN of 40 MiB (a device call carries <= 64 MiB with the
#   repo), builds the mono_ext wheel into .gpu_bundle/whl (entry points for vLLM's plugin
#   loader), and keeps /.gpu_bundle/ out of git (.git/info/exclude).
# On the device, back to back (files under /tmp live only while the machine stays warm):
#   stage              carry [.gpu_bundle/part.00]  (then part.01, ...: copies to /tmp/stage)
#   install            carry [<last part>, .gpu_bundle/whl]: stage, check, unpack to /tmp/site
#   test [PYTEST ARGS] e.g. -k next / -k q35: run the test with -s, log to $OUT/vllm_gpu.log;
#                      each run's raw result lands in $OUT/vllm_runs/, the engine logs in $OUT;
#                      finished engine runs are kept in /tmp/vllm_runs (by source digest), so a
#                      call cut at 600 s continues where it stopped when repeated.
#   e2e [ARGS]         benchmarks/e2e_vllm.py --out /tmp/e2e ARGS (e.g. --quick --check off
#                      --call-budget-s 560) with the device environment; /tmp/e2e is copied
#                      to $OUT/e2e after every call. Repeat it until "remaining plan entries:
#                      none". If the machine went back between calls, copy the last call's
#                      $OUT/e2e/e2e_vllm.json here as .gpu_bundle/e2e_prev.json and carry it
#                      with install: its finished entries are kept (--resume-from), only the
#                      rest run.
set -euo pipefail
cd "$(dirname "$0")/../.."
B=.gpu_bundle S=/tmp/stage SITE=/tmp/site
case "${1:-}" in
prepare)
  grep -qx '/.gpu_bundle/' .git/info/exclude 2>/dev/null || echo '/.gpu_bundle/' >> .git/info/exclude
  mkdir -p $B/whl
  [ -f $B/build/payload.sha256 ] || bash ../shared/engines/build_vllm_gpu_bundle.sh "$PWD/$B/build"
  rm -f $B/part.* $B/whl/*
  (cd $B/build && sha256sum -c payload.sha256 && split -b 40M -d payload.tar.xz ../part.)
  cp $B/build/payload.sha256 $B/whl/
  python3 -m pip wheel -q --no-deps -w $B/whl .
  ls -la $B $B/whl
  echo "device calls: stage with carry [$B/part.NN] for every part but the last," \
    "then install with carry [$B/<last part>, $B/whl], then test -k next, test -k q35" ;;
stage)
  mkdir -p $S && cp -f $B/part.* $S/ 2>/dev/null || true
  [ -d $B/whl ] && cp -f $B/whl/* $S/ || true
  ls -la $S ;;
install)
  bash "$0" stage
  export PIP_ROOT_USER_ACTION=ignore
  cd $S && cat part.* > payload.tar.xz && sha256sum -c payload.sha256
  rm -rf $SITE && mkdir -p $SITE && tar -xJf payload.tar.xz -C $SITE && rm payload.tar.xz
  python3 -m pip install -q --no-index --no-deps --no-compile --target $SITE $SITE/wheels/*.whl
  python3 -m pip install -q --no-index --no-deps --no-compile --target $SITE $S/mono_ext-*.whl
  touch $SITE/.ok
  PYTHONPATH=$SITE python3 -c "import vllm, torch; print('vllm', vllm.__version__, torch.__version__)" ;;
test)
  shift
  [ -f $SITE/.ok ] || { echo "run install first (machine not warm?)" >&2; exit 1; }
  export PYTHONPATH=$PWD/src:$SITE PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 NCCL_NVLS_ENABLE=0 \
    VLLM_USE_FLASHINFER_SAMPLER=0 TRITON_CACHE_AUTOTUNING=1 MONO_EXT_GPU_RUNS=/tmp/vllm_runs
  L=${OUT:-/tmp}/vllm_gpu.log
  nvidia-smi --query-gpu=name,memory.used --format=csv | tee "$L"
  rc=0
  python3 -m pytest -s -q -p no:cacheprovider tests/engines/vllm/test_vllm_gpu.py "$@" 2>&1 | tee -a "$L" ||
    rc=$?
  [ -z "${OUT:-}" ] || cp -r /tmp/pytest-of-*/pytest-current/vllm-e2e*/*.log "$OUT"/ 2>/dev/null || true
  exit "$rc" ;;
e2e)
  shift
  [ -f $SITE/.ok ] || { echo "run install first (machine not warm?)" >&2; exit 1; }
  resume=()
  [ -f $B/e2e_prev.json ] && resume=(--resume-from "$PWD/$B/e2e_prev.json")
  export PYTHONPATH=$PWD/src:$SITE PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 NCCL_NVLS_ENABLE=0 \
    VLLM_USE_FLASHINFER_SAMPLER=0 TRITON_CACHE_AUTOTUNING=1 CUDA_DEVICE_MAX_CONNECTIONS=32
  rc=0
  python3 benchmarks/e2e_vllm.py --out /tmp/e2e "${resume[@]}" "$@" > /tmp/e2e.log 2>&1 || rc=$?
  grep -v '^INFO\|^WARNING\|^(EngineCore' /tmp/e2e.log | tail -n 80
  if [ -n "${OUT:-}" ]; then cp -r /tmp/e2e "$OUT"/ && cp /tmp/e2e.log "$OUT"/e2e/; fi
  exit "$rc" ;;
*) echo "usage: $0 prepare|stage|install|test [pytest args]|e2e [e2e_vllm args]" >&2; exit 2 ;;
esac
