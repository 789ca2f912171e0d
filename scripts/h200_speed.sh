#!/usr/bin/env bash
# The speed tables of BENCHMARKS.md ("Decode and prefill at depth"), one device call per stage (each inside the
# 10-minute limit):
#   bash scripts/h200_speed.sh main    flash-slice decode (Pallas and XLA ops, profiled), flash-1gpu generate and decode
#   bash scripts/h200_speed.sh slice   GPU tests; flash-slice: decode (jitted call and engine loop, XLA and Pallas
#                                      ops, kernels per step from a profile), HF at 4K, generate rows, 128K prefill
#   bash scripts/h200_speed.sh 1gpu    flash-1gpu (43 layers): first generate (compile), decode rows, 32K prefill
#   bash scripts/h200_speed.sh hf      HF peer of flash-slice at 32K and 128K, and the 1M row at batch 1
# Everything lands under $OUT.
set -u
out=${OUT:-./h200_out}
mkdir -p "$out"
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false V4JAX_COMPILATION_CACHE=off
quiet() { grep -v "Warn\|^[EW][0-9]\{4\} \|slow_operation\|^\*\*\*\|Very slow\|^$\|warn(" ; }
t0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
summary() {
  python3 - "$1" <<'EOF' 2>&1 | tail -20
import json, sys
d = json.load(open(sys.argv[1]))
for r in d["rows"]:
    p = r.get("profile") or {}
    print(r["batch"], r["context"], "jit ms/step", round(r.get("ms_per_step", -1), 3), "engine", r.get("generate_step_ms_per_step"),
          "roofline", r.get("roofline_ms"), "kernels/step", p.get("kernels"), "kernels/layer/step",
          p.get("kernels_per_layer_step"), "copies", p.get("copies"), "copy_ms", p.get("copy_ms"))
    for name, n, ms in (p.get("top") or [])[:5]:
        print("   ", name, n, round(ms, 3))
for h in d.get("hf", []):
    print("hf", h)
EOF
}
case "${1:-slice}" in
main)
  stamp "flash-slice decode pallas"
  timeout 110 python3 -W ignore -m v4jax.bench decode --model flash-slice --batches 1,32 --contexts 4K,128K \
    --long-b1 "" --hf off --iters 5 --gen-iters 3 --profile --attention-impl pallas --deadline-s 90 \
    --out "$out/slice_pallas" 2>&1 | quiet | grep "^|" | tail -6
  summary "$out/slice_pallas/decode.json"
  stamp "flash-slice generate"
  timeout 150 python3 -W ignore -m v4jax.bench generate --model flash-slice --batches 1,32 --contexts 4K \
    --prefill 128K --new 16 --prefill-chunk 8192 --attention-impl pallas --deadline-s 120 --out "$out/gen_slice" \
    2>&1 | quiet | tail -7
  stamp "flash-1gpu decode"
  timeout 130 python3 -W ignore -m v4jax.bench decode --model flash-1gpu --batches 1,32 --contexts 4K,128K \
    --long-b1 "" --hf off --iters 3 --gen-iters 2 --attention-impl pallas --deadline-s 100 \
    --out "$out/d_1gpu" 2>&1 | quiet | grep "^|\|Error\|error" | tail -6
  summary "$out/d_1gpu/decode.json"
  stamp "flash-1gpu generate"
  timeout 150 python3 -W ignore -m v4jax.bench generate --model flash-1gpu --batches 1,32 --contexts 4K \
    --prefill 32K --new 16 --prefill-chunk 8192 --attention-impl pallas --deadline-s 110 --out "$out/gen_1gpu" \
    2>&1 | quiet | tail -8
  ;;
slice)
  stamp "gpu tests"
  timeout 200 python3 -m pytest -q -m gpu tests/test_kernels_gpu.py tests/test_engine_gpu.py -p no:cacheprovider \
    > "$out/pytest_gpu.log" 2>&1; echo "gpu tests rc=$?"; tail -3 "$out/pytest_gpu.log"
  for impl in xla pallas; do
    stamp "flash-slice decode $impl"
    hf=off; [ $impl = xla ] && hf=on
    timeout 150 python3 -W ignore -m v4jax.bench decode --model flash-slice --batches 1,32 --contexts 4K,128K \
      --long-b1 "" --hf $hf --hf-contexts 4K --iters 5 --gen-iters 3 --profile --attention-impl $impl \
      --deadline-s 120 --out "$out/slice_$impl" 2>&1 | quiet | grep "^|" | tail -8
    summary "$out/slice_$impl/decode.json"
  done
  stamp "flash-slice generate (pallas)"
  timeout 170 python3 -W ignore -m v4jax.bench generate --model flash-slice --batches 1,32 --contexts 4K \
    --prefill 128K --new 32 --prefill-chunk 8192 --attention-impl pallas --deadline-s 150 --out "$out/gen_slice" \
    2>&1 | quiet | tail -10
  ;;
1gpu)
  stamp "flash-1gpu generate"
  timeout 260 python3 -W ignore -m v4jax.bench generate --model flash-1gpu --batches 1,32 --contexts 4K \
    --prefill 32K --new 32 --prefill-chunk 8192 --attention-impl pallas --deadline-s 240 --out "$out/gen_1gpu" \
    2>&1 | quiet | tail -12
  stamp "flash-1gpu decode"
  timeout 300 python3 -W ignore -m v4jax.bench decode --model flash-1gpu --batches 1,32 --contexts 4K,128K \
    --long-b1 "" --hf off --iters 5 --gen-iters 2 --profile --attention-impl pallas --deadline-s 260 \
    --out "$out/d_1gpu" 2>&1 | quiet | grep "^|\|Error\|error" | tail -8
  summary "$out/d_1gpu/decode.json"
  ;;
hf)
  stamp "flash-slice HF at long contexts, and 1M"
  timeout 540 python3 -W ignore -m v4jax.bench decode --model flash-slice --batches 1 --contexts 32K,128K \
    --long-b1 1M --hf on --hf-contexts 32K,128K --iters 5 --gen-iters 2 --attention-impl pallas \
    --deadline-s 500 --out "$out/slice_hf" 2>&1 | quiet | grep "^|" | tail -8
  summary "$out/slice_hf/decode.json"
  ;;
esac
stamp done
