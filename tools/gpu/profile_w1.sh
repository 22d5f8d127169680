#!/bin/bash
# Where K1 (GDN front) and K2 spend their time at width 1, per SASS instruction: Nsight
# Compute's full set with source counters and warp-stall sampling, one launch of each, plus
# bench_k1 / bench_k2 at widths 1, 4, 16 (traced) as the same card's baseline. Writes
# $OUT/profile.tgz (the reports' source pages as CSV, the details pages, the bench tables).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/gpu_out}
W=/tmp/profile_w1
mkdir -p "$OUT" "$W"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" CUDA_DEVICE_MAX_CONNECTIONS=32
export PYTHONUNBUFFERED=1
trap 'tar -czf "$OUT/profile.tgz" -C "$W" . 2>/dev/null' EXIT
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv > "$W/device.txt" 2>&1
step() {  # name, command...
  local name=$1; shift
  local t0=$SECONDS
  "$@" > "$W/$name.log" 2>&1
  echo "== $name rc=$? $((SECONDS - t0)) s"
  tail -n 12 "$W/$name.log"
}
step k1_base python3 benchmarks/bench_k1.py --widths 1,4,16 --stock torch --trace \
  --trace-widths 1,16 --results-csv "$W/k1_base.csv" --trace-json "$W/k1_base_trace.json"
step k2_base python3 benchmarks/bench_k2.py --widths 1,4,16 --stock torch --variants k2 \
  --trace --csv "$W/k2_base.csv" --trace-json "$W/k2_base_trace.json"
ncu_one() {  # name, kernel regex, skip, command...
  local name=$1 kern=$2 skip=$3; shift 3
  step "ncu_$name" ncu --clock-control none --set full --import-source yes \
    -k "regex:$kern" -s "$skip" -c 1 -f -o "$W/$name" "$@"
  ncu -i "$W/$name.ncu-rep" --page source --csv --print-source sass > "$W/${name}_sass.csv" \
    2> "$W/${name}_sass.err"
  ncu -i "$W/$name.ncu-rep" --page details > "$W/${name}_details.txt" 2>&1
  gzip -f "$W/${name}_sass.csv"
  rm -f "$W/$name.ncu-rep"
}
ncu_one k1gdn k1_gdn_kernel 2 python3 benchmarks/bench_k1.py --ncu
ncu_one k2 k2_kernel 12 python3 benchmarks/bench_k2.py --ncu k2
ls -la "$W"
