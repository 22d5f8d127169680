#!/bin/bash
# The Triton kernels on the H200, without an engine bundle (the device image has torch 2.11 +
# Triton 3.6): what one device call should run first when device time is scarce. Every step
# logs to $OUT (or ./gpu_out), and a failing step does not stop the next.
#
#   bash tools/gpu/run_kernels.sh tests   the Triton kernel tests (tests/kernels/triton: runtime,
#                                         planes; tests/models/qwen3_next/triton: bf16 and fp8
#                                         K1/K2, the backend), ~4 min
#   bash tools/gpu/run_kernels.sh fp8     only the fp8 cases (reader, K1, K2 tiny and 80B), ~2 min
#   bash tools/gpu/run_kernels.sh host    benchmarks/bench_host.py: mono_ext's host time per step
#                                         with CUDA health copies and per device call (writes
#                                         $OUT/host_h200.json, the profile to
#                                         $OUT/host_h200_profile.txt), then with engine work
#                                         between steps ($OUT/host_h200_engine_work.json), ~25 s
#   bash tools/gpu/run_kernels.sh stream  benchmarks/bench_stream.py: one weight plane streamed by plain
#                                         Triton vs the Gluon TMA ring at 44/88/132 CTAs (writes
#                                         $OUT/stream_h200.json), then bench_stream_fp8.py: one fp8
#                                         block-128 plane widened vs e4m3 MMA (writes
#                                         $OUT/stream_fp8_h200.json), ~2.5 min
#   bash tools/gpu/run_kernels.sh bench   bench_k2 bf16 + fp8 block-128 (torch stock arm; add
#                                         PYTHONPATH=/tmp/site after run_vllm_e2e.sh install for
#                                         the vLLM arms) and the bench_k1 sweep, ~8 min
#   bash tools/gpu/run_kernels.sh sweep   bench_k2 bf16 over K2Config variants (the L2 prefetches,
#                                         router K splits, reduce columns, task rows, PDL) at
#                                         widths 1-16, checked against the default first;
#                                         writes $OUT/k2_sweep.csv and
#                                         the stage traces $OUT/k2_trace.json, ~4 min
#   bash tools/gpu/run_kernels.sh k1sweep bench_k1's K1Config sweep, both fronts, at widths 1, 4,
#                                         16 (writes $OUT/k1_sweep.csv), ~1.5 min
#   bash tools/gpu/run_kernels.sh k1trace bench_k1 at widths 1-16 (vLLM arms where it imports),
#                                         then both fronts traced at widths 1 and 16: per CTA
#                                         start, rows normed, S1 done, first S2 words, end
#                                         (writes $OUT/k1_vllm.csv, $OUT/k1_trace.json), ~2 min
#   bash tools/gpu/run_kernels.sh k1once  K1Config.norm_once_above: its GPU tests (bits equal to
#                                         the default build's, batch invariance across the
#                                         switch), then bench_k1 traced at widths 1-16 with
#                                         norm_once_above 0, 4, 0 with the first chunks'
#                                         L2 prefetch, and the default, one call (writes
#                                         $OUT/k1_once_{0,4,0pre,default}.csv and traces), ~3 min
#   bash tools/gpu/run_kernels.sh a8      K2's fp8_activations build: the fp8 tests (its own
#                                         included), the one-plane probe, then bench_k2 fp8
#                                         block-128 "k2" vs "k2 a8" at widths 1-16 with both
#                                         traced (writes $OUT/k2_a8.csv, $OUT/k2_a8_trace.json;
#                                         PYTHONPATH=/tmp/site after run_vllm_e2e.sh install adds
#                                         the vLLM arms), ~5 min
#   bash tools/gpu/run_kernels.sh k1ab    test_k1.py on this tree, then bench_k1 (torch stock arm,
#                                         widths 1-16, traced at 1 and 16) alternating between
#                                         the src/ tree in $BASE_SRC (the baseline: e.g. HEAD's,
#                                         carried) and this one, twice each (writes
#                                         $OUT/k1_{base,new}_{1,2}.csv and traces), ~3.5 min
#   bash tools/gpu/run_kernels.sh k2ab    test_k2_sync.py and test_k2.py's bf16 checks on this tree,
#                                         then bench_k2 (torch stock arm, widths 1-16, traced at 1
#                                         and 16) alternating between $BASE_SRC and this tree,
#                                         twice each; this tree also times $K2AB_VARIANTS
#                                         (default "k2"; writes $OUT/k2_{base,new}_{1,2}.csv)
#   bash tools/gpu/run_kernels.sh k2reps  bench_k2 (torch stock arm, widths 1-16) over
#                                         $K2_VARIANTS (first: the base, default the default
#                                         build), $REPS passes (default 6), each a process of its
#                                         own, the order reversed every other pass; then
#                                         benchmarks/ab_paired.py: each variant against the base
#                                         of its pass (writes $OUT/k2_reps.csv, $OUT/k2_reps.md).
#                                         A pass is 5-40 s on a warm Triton cache (H100)
#   bash tools/gpu/run_kernels.sh handoff benchmarks/bench_handoff.py: how long a full grid
#                                         takes to see a few CTAs' tagged words (K2's picks),
#                                         with the bounded wait of $BASE_SRC and of this tree
#                                         (writes $OUT/handoff_{base,new}.json), ~1 min
#   bash tools/gpu/run_kernels.sh k1stream the attention front on the stream engine's deal
#                                         (k1_stream, Gluon): its tests, then
#                                         bench_k1's attention front with the k1-stream arm
#                                         beside K1 (vLLM arms where vLLM imports),
#                                         widths 1-16, each build of $STREAM_CONFIGS (a JSON
#                                         list of StreamConfig overrides; default:
#                                         StreamConfig's defaults, chunks_before_norm,
#                                         parts_at_once, both (held after 1 or 0 chunks, 3
#                                         or 4 slots), 64 x 256 chunks), each traced by a
#                                         twin at widths 1 and 16
#                                         (writes $OUT/k1_stream.csv, $OUT/k1_stream_trace.json,
#                                         the K1 front's trace too), ~3 min; a launch that hangs
#                                         is killed
#   bash tools/gpu/run_kernels.sh layer   benchmarks/bench_layer.py: eight decoder layers per step,
#                                         K1 + K2 vs vLLM's own layer code, eager and compiled,
#                                         widths 1-16 (needs PYTHONPATH=/tmp/site after
#                                         run_vllm_e2e.sh install; writes $OUT/layer_vllm.json)
# Results go into docs/results/ (device, date, commit, command); docs/perf.md cites them.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" CUDA_DEVICE_MAX_CONNECTIONS=32
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv > "$OUT/device.txt" 2>&1
# the device returns only a few files per call: everything also goes back as one archive
trap 'tar -czf "$OUT/all.tgz" -C "$OUT" --exclude all.tgz . 2>/dev/null' EXIT
run() {  # name, command...
  local name=$1; shift
  echo "== $name: $*" | tee -a "$OUT/steps.log"
  local t0=$SECONDS
  "$@" > "$OUT/$name.log" 2>&1
  echo "   rc=$? in $((SECONDS - t0)) s" | tee -a "$OUT/steps.log"
  tail -n 5 "$OUT/$name.log"
}
k1_arms() {  # prefix, then "arm|src/ tree|K1Config JSON" per arm: bench_k1 at widths 1-16,
  # traced, every arm twice, the arms alternating
  local prefix=$1 rep spec arm src cfg; shift
  for rep in 1 2; do
    for spec in "$@"; do
      IFS='|' read -r arm src cfg <<< "$spec"
      run "${prefix}_${arm}_$rep" env PYTHONPATH="$src" python3 benchmarks/bench_k1.py \
        --widths 1,2,4,8,16 --stock torch --config "$cfg" --trace \
        --results-csv "$OUT/${prefix}_${arm}_$rep.csv" \
        --trace-json "$OUT/${prefix}_${arm}_${rep}_trace.json"
    done
  done
}
case "${1:-tests}" in
k1ab|k2ab|handoff)  # a baseline that is not a src/ tree fails every base run
  [ -d "${BASE_SRC:?BASE_SRC: the baseline src/ tree}/mono_ext" ] ||
    { echo "BASE_SRC=$BASE_SRC holds no mono_ext/: name the baseline's src/ folder" >&2; exit 2; } ;;
esac
case "${1:-tests}" in
tests)
  run kernels python3 -m pytest -q -p no:cacheprovider -s tests/kernels/triton \
    tests/models/qwen3_next/triton ;;
fp8)
  run fp8 python3 -m pytest -q -p no:cacheprovider -s tests/kernels/triton/test_fp8_planes.py \
    tests/models/qwen3_next/triton/test_k1.py tests/models/qwen3_next/triton/test_k2_tiny.py \
    tests/models/qwen3_next/triton/test_k2.py -k "fp8 or qdot" ;;
host)
  run host python3 benchmarks/bench_host.py --json "$OUT/host_h200.json" \
    --profile "$OUT/host_h200_profile.txt"
  run host_engine_work python3 benchmarks/bench_host.py --engine-work 3000 \
    --json "$OUT/host_h200_engine_work.json" ;;
stream)
  # a ring that deadlocks must not take the rest of the call with it
  run stream timeout -s KILL 300 python3 benchmarks/bench_stream.py --json "$OUT/stream_h200.json" \
    --only "flat R64 bk256 ns3 w4 c,flat R32 bk256 ns4 w4 c,tma R64 bk128 ns6 w4 c,ring"
  run stream_fp8 timeout -s KILL 120 python3 benchmarks/bench_stream_fp8.py \
    --json "$OUT/stream_fp8_h200.json" ;;
bench)
  run k2_bf16 python3 benchmarks/bench_k2.py --widths 1,2,4,8,12,16 \
    --variants "k2,k2 gate_up_rows=32,k2 router_k_splits=8" \
    --trace --csv "$OUT/k2_bf16.csv" --host-json "$OUT/k2_host_launch.json"
  run k2_fp8 python3 benchmarks/bench_k2.py --formats fp8_block128 --widths 1,2,4,8,12,16 \
    --variants "k2,k2 a8" --csv "$OUT/k2_fp8.csv"
  run k1_sweep python3 benchmarks/bench_k1.py --sweep ;;
sweep)
  # around the default: the prefetch of all planes, of the shared gate_up too, of nothing,
  # two router K splits, 32 reduce columns (half the norm's sums), 32-row gate_up tasks,
  # PDL, the router tile preloaded; the default and the no-prefetch build traced
  run k2_sweep python3 benchmarks/bench_k2.py --widths 1,2,4,8,16 --stock torch --trace \
    --trace-variants "k2,k2 prefetch_router=false" \
    --variants "k2,k2 prefetch=true,k2 prefetch_shared=true,k2 prefetch_router=false,$(
      )k2 router_k_splits=2,k2 reduce_cols=32,k2 gate_up_rows=32,k2 pdl,$(
      )k2 router_preload=true router_k_splits=8" \
    --csv "$OUT/k2_sweep.csv" --trace-json "$OUT/k2_trace.json" ;;
k1sweep)
  run k1_sweep python3 benchmarks/bench_k1.py --sweep --sweep-widths 1,4,16 --widths 1 \
    --stock torch --csv "$OUT/k1_sweep.csv" ;;
k1trace)
  run k1_trace python3 benchmarks/bench_k1.py --widths 1,2,4,8,16 --trace \
    --results-csv "$OUT/k1_vllm.csv" --trace-json "$OUT/k1_trace.json" ;;
k1once)
  run k1_once_tests python3 -m pytest -q -p no:cacheprovider -s \
    tests/models/qwen3_next/triton/test_k1.py -k "norm_once or batch_invariant"
  for n in 0 4 0pre default; do
    case $n in
      default) cfg=() ;;
      0pre) cfg=(--config '{"norm_once_above": 0, "prefetch_first_chunks": true}') ;;
      *) cfg=(--config "{\"norm_once_above\": $n}") ;;
    esac
    run "k1_once_$n" python3 benchmarks/bench_k1.py --widths 1,2,4,8,16 --trace \
      --trace-widths 1,8,16 "${cfg[@]}" --results-csv "$OUT/k1_once_$n.csv" \
      --trace-json "$OUT/k1_once_${n}_trace.json"
  done ;;
a8)
  bash "$0" fp8
  run stream_fp8 timeout -s KILL 120 python3 benchmarks/bench_stream_fp8.py \
    --json "$OUT/stream_fp8_h200.json"
  run k2_a8 python3 benchmarks/bench_k2.py --formats fp8_block128 --widths 1,2,4,8,16 \
    --variants "k2,k2 a8" --trace --trace-variants "k2,k2 a8" --csv "$OUT/k2_a8.csv" \
    --trace-json "$OUT/k2_a8_trace.json" ;;
k1ab)
  run k1_tests python3 -m pytest -q -p no:cacheprovider -s tests/models/qwen3_next/triton/test_k1.py
  k1_arms k1 "base|$BASE_SRC|{}" "new|$PWD/src|{}" ;;
k2ab)
  run k2_tests python3 -m pytest -q -p no:cacheprovider -s \
    tests/models/qwen3_next/triton/test_k2_sync.py tests/models/qwen3_next/triton/test_k2.py \
    -k "sync or (every_width and not fp8) or batch_invariance"
  for rep in 1 2; do
    for arm in base new; do
      src=$PWD/src variants=${K2AB_VARIANTS:-k2}
      [ "$arm" = base ] && src=${BASE_SRC:?BASE_SRC: the baseline src/ tree} variants=k2
      run "k2_${arm}_$rep" env PYTHONPATH="$src" python3 benchmarks/bench_k2.py \
        --widths 1,2,4,8,16 --stock torch --trace --variants "$variants" \
        --csv "$OUT/k2_${arm}_$rep.csv" --trace-json "$OUT/k2_${arm}_${rep}_trace.json"
    done
  done ;;
k2reps)
  variants=${K2_VARIANTS:-k2}
  base=${variants%%,*}
  reversed=$(tr ',' '\n' <<< "$variants" | tac | paste -sd, -)
  passes=()
  for rep in $(seq 1 "${REPS:-6}"); do
    v=$variants
    [ $((rep % 2)) -eq 0 ] && v=$reversed
    run "k2_rep_$rep" python3 benchmarks/bench_k2.py --widths 1,2,4,8,16 --stock torch \
      --variants "$v" --csv "$OUT/k2_rep_$rep.csv"
    [ -f "$OUT/k2_rep_$rep.csv" ] && passes+=("$OUT/k2_rep_$rep.csv")
  done
  run k2_reps python3 benchmarks/ab_paired.py --base "$base" --csv-out "$OUT/k2_reps.csv" \
    --md-out "$OUT/k2_reps.md" "${passes[@]}"
  cat "$OUT/k2_reps.md" ;;
k1stream)
  run k1_stream_tests timeout -s KILL 300 python3 -m pytest -q -p no:cacheprovider -s \
    tests/models/qwen3_next/triton/test_k1_stream.py \
    tests/models/qwen3_next/triton/test_k1_stream_fronts.py
  # default: StreamConfig's defaults (3 ring slots of a head's rows x 64 columns); the loader
  # held until the norm's loads are back after 1 chunk; a head's parts loaded at once; both,
  # also held after 0 chunks and with 4 slots; 64 x 256 chunks (K1's chunk) with the parts
  defaults='[{}, {"chunks_before_norm": 1}, {"parts_at_once": true},
    {"chunks_before_norm": 1, "parts_at_once": true},
    {"chunks_before_norm": 0, "parts_at_once": true},
    {"chunks_before_norm": 1, "parts_at_once": true, "stages": 4},
    {"chunk_rows": 64, "k_chunk": 256, "parts_at_once": true}]'
  run k1_stream timeout -s KILL 400 python3 benchmarks/bench_k1.py --no-gdn --stream \
    --stream-configs "${STREAM_CONFIGS:-$defaults}" --widths 1,2,4,8,16 --trace \
    --trace-widths 1,16 --results-csv "$OUT/k1_stream.csv" \
    --trace-json "$OUT/k1_stream_trace.json" ;;
handoff)
  for arm in base new; do
    src=$PWD/src
    [ "$arm" = base ] && src=$BASE_SRC
    run "handoff_$arm" env PYTHONPATH="$src" timeout -s KILL 120 python3 \
      benchmarks/bench_handoff.py --json "$OUT/handoff_$arm.json"
  done ;;
layer)
  run layer python3 benchmarks/bench_layer.py --widths 1,2,4,8,16 --json "$OUT/layer_vllm.json" ;;
*)
  echo "usage: $0 tests|fp8|host|stream|bench|sweep|k1sweep|k1trace|k1once|k1stream|k1ab|k2ab|k2reps|handoff|a8|layer" >&2
  exit 2 ;;
esac
