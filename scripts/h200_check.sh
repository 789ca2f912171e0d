#!/usr/bin/env bash
# One device call (~9 of the 10 minutes a call may take) that re-checks the GPU paths and re-takes the numbers
# BENCHMARKS.md reports for the kernels, in order of importance, each stage under its own time limit:
#   1. GPU tests: kernels vs references, engine greedy Pallas == XLA       -> $OUT/pytest_gpu.log
#   2. kernel table, GPU time from profiler traces                          -> $OUT/k/bench_kernels.{md,json}
#   3. engine decode, XLA vs Pallas attention, batch 32 at 128K            -> $OUT/d{xla,pallas}/decode.md
# Usage (device tool):  bash scripts/h200_check.sh            (writes under $OUT; at most 8 files come back)
set -u
out=${OUT:-./h200_out}
mkdir -p "$out"
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
quiet() { grep -v "Warn\|^[EW][0-9]\{4\} \|slow_operation\|^\*\*\*\|Very slow\|^$"; }
timeout 330 python3 -m pytest -q -m gpu tests/test_kernels_gpu.py tests/test_engine_gpu.py -p no:cacheprovider \
  > "$out/pytest_gpu.log" 2>&1; echo "gpu tests rc=$?"; tail -3 "$out/pytest_gpu.log"
timeout 170 python3 -W ignore -m v4jax.bench kernels --harness trace --repeats 3 --out "$out/k" 2>&1 \
  | grep "pallas\|backend\|MISMATCH"
for impl in xla pallas; do
  timeout 65 python3 -W ignore -m v4jax.bench decode --attention-impl $impl --batches 32 --contexts 128K \
    --long-b1 "" --hf off --iters 5 --deadline-s 50 --out "$out/d$impl" 2>&1 | quiet | grep "^|" | tail -2
done
