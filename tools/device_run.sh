#!/usr/bin/env bash
# On a GPU host without Bazel, from the repository root, with .device/ carried there
# (tools/stage_device.sh makes it): run the named steps, in order, writing logs to $OUT
# (default .device/out). Steps:
#   tests       every GPU test (pytest -m gpu over tests/*/test_*gpu*.py)
#   runtime     benchmarks/bench_runtime.py (import time, per-kernel loads, 1 vs 8 processes)
#   calibrate   benchmarks/tune_gemm.py --calibrate (writes cubinstore/ops/_gemm_calibration.py; copied to $OUT)
#   gemm        benchmarks/bench_gemm.py (tuning and held-out shapes, host us per call, graph replay; $OUT/gemm.json
#               for bench_gemm.py compare with another run)
#   layouts     benchmarks/bench_gemm.py run --layouts-only (what the layouts ops.gemm copies cost)
#   host        benchmarks/bench_gemm.py run --host-only (host time per call: eager, graph replay, compiled)
#   judge       benchmarks/tune_gemm.py --judge-held-out (the model's picks on held-out shapes vs the best option)
#   timings     benchmarks/tune_gemm.py --calibrate --no-write: the tuning shapes' timings alone, to
#               $OUT/timings.json (a second file for --stability beside a sweep's, say)
#   study       the refit study (docs/gemm.md): calibrate twice (nothing written) and judge;
#               then on any host: tune_gemm.py --stability $OUT/study_a.json $OUT/study_b.json --judge $OUT/study_held.json
#   tgemm       benchmarks/bench_tgemm.py
#   occupancy   benchmarks/gemm_occupancy.py (co-resident clusters of each gemm instantiation)
#   rows        benchmarks/gemm_row_alignment.py (A's and B's rows off the 128-byte lines, each alone)
#   outliers    benchmarks/gemm_split_outliers.py (split launches far slower than their kernel's other splits)
#   splitcost   benchmarks/gemm_split_cost.py run (split launches with parts of their protocol taken out;
#               .device/split_cost, which tools/stage_device.sh builds)
#   clusterk    the same, the reducer-lead and K-cluster variants alone (as_built, even_split, cluster_k2, cluster_k4)
#   sweep       benchmarks/gemm_split_outliers.py --sweep (every tuning and held-out option, slow batches looked
#               at again; the timings to $OUT/sweep_tuning.json and sweep_held.json)
# e.g. tools/device_run.sh tests runtime gemm
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-.device/out}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
export CUBINSTORE_TEST_MANIFEST="$PWD/.device/kernels/manifest.json"
export CUBINSTORE_CUTLASS_INCLUDE="$PWD/.device/cutlass_include"
if [[ ! -f "$CUBINSTORE_TEST_MANIFEST" ]]; then
  echo "device_run: no $CUBINSTORE_TEST_MANIFEST: run tools/stage_device.sh on the build host and carry .device" >&2
  exit 2
fi
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader > "$OUT/gpu.txt" 2>&1 || true
"$PY" -c "import torch; print('torch', torch.__version__)" >> "$OUT/gpu.txt" 2>&1 || true

# The compiled first-load helper (cubinstore/_core/_native.c), for this host's Python, as pip install
# builds it; without it the runtime takes its Python paths and the helper's GPU tests skip.
if ! "$PY" setup.py -q build_ext --inplace > "$OUT/native.log" 2>&1; then
  echo "device_run: the compiled helper did not build (Python paths only); see $OUT/native.log" >&2
fi
"$PY" -c "from cubinstore.internals import native; print('native helper:', native.built())" >> "$OUT/gpu.txt" 2>&1

status=0
step() {  # step NAME COMMAND...: run one step, its output to $OUT/NAME.log and a summary line here
  local name="$1"; shift
  local started=$SECONDS
  "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "== $name: rc=$rc in $((SECONDS - started)) s; last lines:"
  tail -n 25 "$OUT/$name.log"
  [[ $rc -eq 0 ]] || status=1
}

for what in "$@"; do
  case "$what" in
    tests) step tests "$PY" -m pytest -q -p no:cacheprovider -m gpu tests/*/test_*gpu*.py ;;
    runtime) step runtime "$PY" benchmarks/bench_runtime.py --manifest "$CUBINSTORE_TEST_MANIFEST" --json "$OUT/runtime.json" ;;
    calibrate)
      step calibrate "$PY" benchmarks/tune_gemm.py --calibrate --manifest "$CUBINSTORE_TEST_MANIFEST" --measurements "$OUT/gemm_measurements.json"
      cp cubinstore/ops/_gemm_calibration.py "$OUT/" 2>/dev/null || true ;;
    gemm) step gemm "$PY" benchmarks/bench_gemm.py --manifest "$CUBINSTORE_TEST_MANIFEST" --json "$OUT/gemm.json" ;;
    layouts) step layouts "$PY" benchmarks/bench_gemm.py run --layouts-only --manifest "$CUBINSTORE_TEST_MANIFEST" ;;
    host) step host "$PY" benchmarks/bench_gemm.py run --host-only --manifest "$CUBINSTORE_TEST_MANIFEST" ;;
    judge) step judge "$PY" benchmarks/tune_gemm.py --judge-held-out --manifest "$CUBINSTORE_TEST_MANIFEST" --measurements "$OUT/held_out_measurements.json" ;;
    timings) step timings "$PY" benchmarks/tune_gemm.py --calibrate --no-write --manifest "$CUBINSTORE_TEST_MANIFEST" --measurements "$OUT/timings.json" ;;
    study)  # --no-write: both runs time the shipped model's own picks, and the judge judges it
      for run in a b; do
        step "study_$run" "$PY" benchmarks/tune_gemm.py --calibrate --no-write --manifest "$CUBINSTORE_TEST_MANIFEST" --measurements "$OUT/study_$run.json"
      done
      step study_held "$PY" benchmarks/tune_gemm.py --judge-held-out --manifest "$CUBINSTORE_TEST_MANIFEST" --measurements "$OUT/study_held.json" ;;
    tgemm) step tgemm "$PY" benchmarks/bench_tgemm.py --manifest "$CUBINSTORE_TEST_MANIFEST" ;;
    occupancy) step occupancy "$PY" benchmarks/gemm_occupancy.py --manifest "$CUBINSTORE_TEST_MANIFEST" ;;
    rows) step rows "$PY" benchmarks/gemm_row_alignment.py --manifest "$CUBINSTORE_TEST_MANIFEST" ;;
    outliers) step outliers "$PY" benchmarks/gemm_split_outliers.py --manifest "$CUBINSTORE_TEST_MANIFEST" ;;
    splitcost) step splitcost "$PY" benchmarks/gemm_split_cost.py run --manifest "$CUBINSTORE_TEST_MANIFEST" --variants .device/split_cost ;;
    clusterk) step clusterk "$PY" benchmarks/gemm_split_cost.py run --manifest "$CUBINSTORE_TEST_MANIFEST" --variants .device/split_cost \
                --only even_split cluster_k2 cluster_k4 ;;
    sweep) step sweep "$PY" benchmarks/gemm_split_outliers.py --sweep --manifest "$CUBINSTORE_TEST_MANIFEST" --save "$OUT" ;;
    *) echo "device_run: unknown step '$what' (tests, runtime, calibrate, gemm, layouts, host, judge, timings, study, tgemm, occupancy, rows, outliers, splitcost, clusterk, sweep)" >&2; exit 2 ;;
  esac
done
exit $status
