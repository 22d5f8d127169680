#!/bin/bash
# SGLang 0.5.17 + mono_ext (--monokernel-backend triton) end to end on the H200:
# tests/engines/sglang/test_sglang_gpu.py.
#
# Here (CPU box, network):   bash tools/gpu/run_sglang_e2e.sh prepare
#   runs ../shared/engines/build_sglang_gpu_bundle.sh (PART=40M) into .gpu_bundle_sglang/build
#   (once; ~3 min), copies its parts to .gpu_bundle_sglang/part.NN (<= 40 MiB each; a device
#   call carries <= 64 MiB with the repo), builds the mono_ext wheel into
#   .gpu_bundle_sglang/whl (entry point for SGLang's plugin loader), and keeps
#   /.gpu_bundle_sglang/ out of git (.git/info/exclude).
# On the device, back to back (files under /tmp live only while the machine stays warm):
#   stage              carry [.gpu_bundle_sglang/part.00] (the repo is ~16 MiB: the parts do
#                      not fit one call together): copies it to /tmp/sgl_stage
#   install            carry [.gpu_bundle_sglang/part.01, .gpu_bundle_sglang/whl]: stage, check,
#                      unpack to /tmp/sgl_site, pip-install the small wheels and mono_ext there.
#   test [PYTEST ARGS] e.g. -k next / -k q35: run the test with -s, log to $OUT/sglang_gpu.log;
#                      each run's raw result lands in $OUT/sglang_runs/, the engine logs in $OUT;
#                      finished engine runs are kept in /tmp/sgl_runs (by source digest), so a
#                      call cut at 600 s continues where it stopped when repeated.
#   bench [ARGS]       benchmarks/e2e_sglang.py (flag off vs --monokernel-backend triton, 80B-A3B
#                      shapes; e.g. --quick, --model q35) into /tmp/e2e_sgl with a 540 s call
#                      budget; /tmp/e2e_sgl is copied to $OUT after every call. Repeat the same
#                      command until it exits 0 (3: entries left for the next call).
#   failstop           tests/engines/sglang/test_sglang_gpu_failstop.py (waits cut to 1 ns mid-decode;
#                      overlap scheduler, decode graphs), log to $OUT/sglang_failstop.log.
set -euo pipefail
cd "$(dirname "$0")/../.."
B=.gpu_bundle_sglang S=/tmp/sgl_stage SITE=/tmp/sgl_site
case "${1:-}" in
prepare)
  grep -qx "/$B/" .git/info/exclude 2>/dev/null || echo "/$B/" >> .git/info/exclude
  mkdir -p $B/whl
  if [ ! -f $B/build/out/payload.sha256 ]; then
    PART=40M bash ../shared/engines/build_sglang_gpu_bundle.sh "$PWD/$B/build"
  fi
  rm -f $B/part.* $B/whl/*
  for p in $B/build/out/payload.part.*; do cp "$p" "$B/part.${p##*.}"; done
  # the builder's checksums name payload.part.NN: keep them for the parts under those names
  cp $B/build/out/payload.sha256 $B/build/out/MANIFEST.txt $B/whl/
  (cd $B/build/out && sha256sum -c --ignore-missing payload.sha256)
  python3 -m pip wheel -q --no-deps -w $B/whl .
  big=$(find $B -maxdepth 1 -name 'part.*' -size +40M)
  [ -z "$big" ] || { echo "parts over 40 MiB: $big" >&2; exit 1; }
  ls -la $B $B/whl
  echo "device calls: stage with carry [$B/part.NN] for every part but the last," \
    "then install with carry [$B/<last part>, $B/whl], then test -k next, test -k q35" ;;
stage)
  mkdir -p $S
  for p in $B/part.*; do [ -f "$p" ] && cp -f "$p" "$S/payload.part.${p##*.}"; done
  [ -d $B/whl ] && cp -f $B/whl/* $S/ || true
  ls -la $S ;;
install)
  bash "$0" stage
  export PIP_ROOT_USER_ACTION=ignore
  cd $S && cat payload.part.* > payload.tar.xz && sha256sum -c payload.sha256
  rm -rf $SITE && mkdir -p $SITE
  tar -xJf payload.tar.xz -C $SITE ||
    python3 -c "import tarfile; tarfile.open('payload.tar.xz').extractall('$SITE', filter='tar')"
  rm payload.tar.xz
  python3 -m pip install -q --no-index --no-deps --no-compile --target $SITE $SITE/wheels/*.whl
  python3 -m pip install -q --no-index --no-deps --no-compile --target $SITE $S/mono_ext-*.whl
  touch $SITE/.ok
  cd /tmp && PYTHONPATH=$SITE python3 -c "import sglang, sgl_kernel, torch, importlib.metadata as m
print('sglang', sglang.__version__, 'torch', torch.__version__, torch.cuda.get_device_name())
print('plugins', [e.name for e in m.entry_points(group='sglang.srt.plugins')])" ;;
test)
  shift
  [ -f $SITE/.ok ] || { echo "run install first (machine not warm?)" >&2; exit 1; }
  export PYTHONPATH=$PWD/src:$SITE PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 NCCL_NVLS_ENABLE=0 \
    TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 TRITON_CACHE_AUTOTUNING=1 \
    MONO_EXT_GPU_RUNS=/tmp/sgl_runs
  L=${OUT:-/tmp}/sglang_gpu.log
  nvidia-smi --query-gpu=name,memory.used --format=csv | tee "$L"
  rc=0
  python3 -m pytest -s -q -p no:cacheprovider tests/engines/sglang/test_sglang_gpu.py "$@" 2>&1 | tee -a "$L" ||
    rc=$?
  [ -z "${OUT:-}" ] || cp -r /tmp/pytest-of-*/pytest-current/sglang-gpu*/*.log "$OUT"/ 2>/dev/null || true
  exit "$rc" ;;
bench)
  shift
  [ -f $SITE/.ok ] || { echo "run install first (machine not warm?)" >&2; exit 1; }
  export PYTHONPATH=$PWD/src:$SITE PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 NCCL_NVLS_ENABLE=0 \
    TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 TRITON_CACHE_AUTOTUNING=1
  nvidia-smi --query-gpu=name,memory.used --format=csv
  rc=0
  python3 benchmarks/e2e_sglang.py --out /tmp/e2e_sgl --call-budget-s 540 "$@" || rc=$?
  [ -z "${OUT:-}" ] || cp -r /tmp/e2e_sgl "$OUT"/
  exit "$rc" ;;
failstop)
  shift
  [ -f $SITE/.ok ] || { echo "run install first (machine not warm?)" >&2; exit 1; }
  export PYTHONPATH=$PWD/src:$SITE PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 NCCL_NVLS_ENABLE=0 \
    TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 TRITON_CACHE_AUTOTUNING=1
  L=${OUT:-/tmp}/sglang_failstop.log
  nvidia-smi --query-gpu=name,memory.used --format=csv | tee "$L"
  rc=0
  python3 -m pytest -s -q -p no:cacheprovider tests/engines/sglang/test_sglang_gpu_failstop.py "$@" 2>&1 |
    tee -a "$L" || rc=$?
  [ -z "${OUT:-}" ] || cp -r /tmp/pytest-of-*/pytest-current/sglang-fault*/*.{log,json} "$OUT"/ \
    2>/dev/null || true
  exit "$rc" ;;
*) echo "usage: $0 prepare|stage|install|test [pytest args]|bench [args]|failstop" >&2; exit 2 ;;
esac
