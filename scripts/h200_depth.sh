#!/usr/bin/env bash
# The full-depth numbers of BENCHMARKS.md "Depth", in two device calls (each well inside the 10-minute limit):
#   bash scripts/h200_depth.sh 1   flash-1gpu (43 layers): first-generate compile, decode rows (jit + engine loop,
#                                  kernel launches per layer from a profiler trace), generate at 4K
#   bash scripts/h200_depth.sh 2   GPU tests; flash-slice: decode rows, mHC Sinkhorn loop vs unrolled
#                                  (launches), generate rows and the 128K prefill
# Everything lands under $OUT (at most 8 files come back: logs and the JSON / markdown of each stage).
set -u
out=${OUT:-./h200_out}
mkdir -p "$out"
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
quiet() { grep -v "Warn\|^[EW][0-9]\{4\} \|slow_operation\|^\*\*\*\|Very slow\|^$\|warn(" ; }
t0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
if [ "${1:-1}" = 1 ]; then
  stamp "flash-1gpu generate"
  timeout 200 python3 -W ignore -m v4jax.bench generate --model flash-1gpu --batches 1 --contexts 4K --new 32 \
    --out "$out/g1" 2>&1 | quiet | tail -12
  stamp "flash-1gpu decode"
  timeout 330 python3 -W ignore -m v4jax.bench decode --model flash-1gpu --batches 1,32 --contexts 4K,128K \
    --long-b1 "" --hf off --iters 5 --gen-iters 2 --profile --deadline-s 300 --out "$out/d1" 2>&1 | quiet \
    | grep "^|\|Error\|error" | tail -8
  python3 - "$out/d1/decode.json" <<'EOF' 2>&1 | tail -12
import json, sys
d = json.load(open(sys.argv[1]))
for r in d["rows"]:
    p = r.get("profile") or {}
    print(r["batch"], r["context"], "ms/step", round(r.get("ms_per_step", -1), 3), "engine", r.get("generate_step_ms_per_step"),
          "compile", round(r.get("compile_s", -1), 1), "kernels/layer/step", p.get("kernels_per_layer_step"),
          "copies", p.get("copies"), "copy_ms", p.get("copy_ms"))
    for name, n, ms in (p.get("top") or [])[:6]:
        print("   ", name, n, round(ms, 3))
EOF
else
  stamp "gpu tests"
  timeout 330 python3 -m pytest -q -m gpu tests/test_kernels_gpu.py tests/test_engine_gpu.py -p no:cacheprovider \
    > "$out/pytest_gpu.log" 2>&1; echo "gpu tests rc=$?"; tail -3 "$out/pytest_gpu.log"
  stamp "flash-slice decode"
  timeout 150 python3 -W ignore -m v4jax.bench decode --model flash-slice --batches 1,32 --contexts 4K,128K \
    --long-b1 "" --hf off --iters 5 --gen-iters 2 --profile --deadline-s 130 --out "$out/d2" 2>&1 | quiet \
    | grep "^|" | tail -6
  stamp "flash-slice Sinkhorn unrolled"
  timeout 60 python3 -W ignore -m v4jax.bench decode --model flash-slice --batches 1 --contexts 4K --long-b1 "" \
    --hf off --iters 5 --gen-iters 0 --profile --sinkhorn-unroll --out "$out/d2s" 2>&1 | quiet | grep "^|" | tail -2
  stamp "flash-slice generate"
  timeout 200 python3 -W ignore -m v4jax.bench generate --model flash-slice --batches 1,32 --contexts 4K \
    --prefill 128K --new 32 --deadline-s 180 --out "$out/g2" 2>&1 | quiet | tail -10
fi
stamp done
