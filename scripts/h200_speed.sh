#!/usr/bin/env bash
# The speed tables of BENCHMARKS.md ("Decode and prefill at depth"), one device call per stage (each inside the
# 10-minute limit), Pallas ops:
#   bash scripts/h200_speed.sh slice   flash-slice (KERNEL_TESTS=1: the top-k / sparse-attention GPU tests first):
#                                      decode at batch 1 / 32 and 4K / 32K / 128K, 1M at batch 1 (jitted call, engine
#                                      loop, a profile at 4K), HF at 4K (batch 1 / 32) and at batch 1 / 32K and 128K;
#                                      generate rows and the 128K prefill; the merged table (v4jax bench table)
#   bash scripts/h200_speed.sh 1gpu    flash-1gpu (43 layers): first generate (compile), generate rows, 32K prefill,
#                                      decode at batch 1 / 32 and 4K / 32K / 128K; the merged table
#   bash scripts/h200_speed.sh graphs  the decode call as one CUDA graph (V4JAX_DECODE_GRAPHS=loop) against XLA's
#                                      default command buffers: jitted call, engine loop and LLM.generate of
#                                      flash-slice at 4K / 128K
#   bash scripts/h200_speed.sh candidates  the one-launch projections and the mHC-expansion kernel against the forms
#                                      they replace: GPU tests and measurements (scripts/bench_fused_projections.py,
#                                      scripts/bench_hc_post.py)
#   bash scripts/h200_speed.sh memory  the decode call's memory plan (scripts/decode_memory.py) with its largest
#                                      temporaries from XLA's buffer assignment (flash-slice), then flash-1gpu's at
#                                      batch 32 and 16K / 64K / 128K (MEM_1GPU=0 skips it)
#   bash scripts/h200_speed.sh engine  the engine GPU tests (Pallas engine = XLA engine, a second generate compiles
#                                      nothing)
#   bash scripts/h200_speed.sh 4k      the GPU kernel tests, then batch 1 / 32 at 4K of flash-slice (with kernels per
#                                      step from a profile) and of flash-1gpu
#   bash scripts/h200_speed.sh tune    the projection kernel's sweep (scripts/bench_layer_linear.py; SWEEP=0
#                                      skips it), the Sinkhorn kernel's sweep, their and the top-k GPU tests,
#                                      batch 1 / 32 at 4K of flash-slice with each kernel's time per line of the
#                                      model
#   bash scripts/h200_speed.sh table   in one call: flash-slice decode (4K profiled, 32K, 128K, 1M at batch 1) and
#                                      generate rows with the 128K prefill, flash-1gpu decode at 4K and 128K
#   bash scripts/h200_speed.sh prefill the prefill kernels' GPU tests, the experts bench (scripts/bench_prefill_experts.py; SWEEP=0 skips),
#                                      then a profile of a 128K flash-slice prompt (scripts/profile_prefill.py)
#   bash scripts/h200_speed.sh sweep   a prefill chunk's top-k per stage and its sparse attention per tile
#                                      (scripts/bench_{topk,attention}_prefill.py; the indexer's is
#                                      scripts/bench_indexer_prefill.py)
#   bash scripts/h200_speed.sh repeat  four generate calls in one process (compiles logged), with and without XLA's
#                                      command buffers, then the engine GPU test (TEST_S=0 skips it)
# Everything lands under $OUT.
set -u
out=${OUT:-./h200_out}
mkdir -p "$out"
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false V4JAX_COMPILATION_CACHE=off
quiet() { grep -v "Warn\|^[EW][0-9]\{4\} \|slow_operation\|^\*\*\*\|Very slow\|^$\|warn(" ; }
t0=$(date +%s)
# flash-1gpu's decode rows let JAX's allocator take 94 % of the GPU (the default, 75 %, is 105 GB; no torch there):
# batch 32 at 128K holds 49 GB of weights and 30 GB of pools, and its decode call asked for a buffer the size of
# its largest pool array (21 GiB) on top (run M: out of memory). The plan aliases every pool with 22 MB of
# temporaries, and a donated 21 GiB array is updated in place (scripts/check_donation.py).
mem_fraction=${MEM_FRACTION:-0.94}
stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
summary() {
  python3 - "$1" <<'EOF' 2>&1 | tail -80
import json, sys
d = json.load(open(sys.argv[1]))
for r in d["rows"]:
    p = r.get("profile") or {}
    print(r["batch"], r["context"], "jit ms/step", round(r.get("ms_per_step", -1), 3), "engine", r.get("generate_step_ms_per_step"),
          "roofline", r.get("roofline_ms"), "kernels/step", p.get("kernels"), "kernels/layer/step",
          p.get("kernels_per_layer_step"), "copies", p.get("copies"), "copy_ms", p.get("copy_ms"))
    for name, n, ms in (p.get("top") or [])[:5]:
        print("   ", name, n, round(ms, 3))
    for name, n, ms in (p.get("by_source") or [])[:30]:
        print("    src", round(ms, 4), n, name)
for h in d.get("hf", []):
    print("hf", h)
EOF
}
case "${1:-slice}" in
slice)
  # one call (timeouts add up to 535 s; KERNEL_TESTS=1 adds the kernels' GPU tests, 90 s more, past one call's
  # limit of 600 s with the rest; run M: 94 s for five decode rows with HF at 4K,
  # the last two past a deadline of 120 s; run L: 88 s for the decode rows with HF at 4K,
  # 63 s for HF at 32K / 128K, 207 s for the generate rows at 4K, 32K and 128K, compiles included): the kernels' GPU
  # tests, every flash-slice decode row (jitted call, engine loop, a profile per row) with HF at 4K, HF at batch 1 /
  # 32K and 128K, the generate rows and the 128K prefill through LLM.generate, the merged table
  if [ "${KERNEL_TESTS:-0}" = 1 ]; then
    stamp "GPU tests of the top-k and sparse attention kernels"
    timeout 90 python3 -m pytest -q -m gpu tests/test_kernels_gpu.py -k "topk or sparse" -p no:cacheprovider 2>&1 \
      | tail -2
  fi
  stamp "flash-slice decode, HF at 4K"
  timeout 165 python3 -W ignore -m v4jax.bench decode --model flash-slice --batches 1,32 --contexts 4K,32K,128K \
    --long-b1 1M --hf on --hf-contexts 4K --iters 5 --gen-iters 3 --profile --attention-impl pallas \
    --deadline-s 155 --out "$out/flash-slice/decode" 2>&1 | quiet | grep "^|" | tail -9
  summary "$out/flash-slice/decode/decode.json" | head -40
  stamp "HF at batch 1, 32K and 128K"
  timeout 100 python3 -W ignore -m v4jax.bench decode --model flash-slice --batches 1 --contexts 32K --long-b1 "" \
    --hf on --hf-contexts 32K,128K --iters 3 --gen-iters 2 --attention-impl pallas --deadline-s 95 \
    --out "$out/flash-slice/hf-long" 2>&1 | quiet | grep "^|" | tail -4
  stamp "flash-slice generate"
  timeout 270 python3 -W ignore -m v4jax.bench generate --model flash-slice --batches 1,32 --contexts 4K \
    --prefill 32K,128K --new 256 --prefill-chunk 8192 --attention-impl pallas --deadline-s 230 \
    --out "$out/flash-slice/generate" 2>&1 | quiet | tail -8
  python3 -m v4jax.bench.table "$out/flash-slice"
  ;;
1gpu)
  # one call (timeouts add up to 550 s; run K: init + first generate 52 s, the batch-1 4K row ~70 s, batch 32 ~100
  # s, decode at batch 1 ~95 s): flash-1gpu's first generate (compile), generate rows and the 32K prefill, decode
  # at batch 1 / 32 and 4K / 32K / 128K, the merged table. 256 new tokens: batch 32's prompts take 16 prefill
  # steps, and its first requests decode 8 tokens in each, so with 128 they finished before the last one started
  # (no steady window in run K)
  stamp "flash-1gpu generate"
  timeout 310 python3 -W ignore -m v4jax.bench generate --model flash-1gpu --batches 1,32 --contexts 4K \
    --prefill 32K --new 256 --prefill-chunk 8192 --attention-impl pallas --deadline-s 225 \
    --out "$out/flash-1gpu/generate" 2>&1 | quiet | tail -12
  stamp "flash-1gpu decode"
  XLA_PYTHON_CLIENT_MEM_FRACTION=$mem_fraction timeout 240 python3 -W ignore -m v4jax.bench decode \
    --model flash-1gpu --batches 1,32 --contexts 4K,32K,128K \
    --long-b1 "" --hf off --iters 3 --gen-iters 2 --attention-impl pallas --deadline-s 200 \
    --out "$out/flash-1gpu/decode" 2>&1 | quiet | grep "^|\|Error\|error" | tail -8
  summary "$out/flash-1gpu/decode/decode.json" | head -20
  python3 -m v4jax.bench.table "$out/flash-1gpu"
  ;;
graphs)
  # XLA's command buffers over the whole decode call (V4JAX_DECODE_GRAPHS=loop: the k-step loop and the layer scan
  # as one CUDA graph) against XLA's default set (xla): the jitted call and the engine loop at batch 1 / 32 and 4K /
  # 128K, and LLM.generate at 4K, of flash-slice; then a side-by-side summary
  for mode in xla loop; do
    stamp "decode graphs: $mode"
    V4JAX_DECODE_GRAPHS=$mode timeout 120 python3 -W ignore -m v4jax.bench decode --model flash-slice \
      --batches 1,32 --contexts 4K,128K --long-b1 "" --hf off --iters 5 --gen-iters 3 --attention-impl pallas \
      --deadline-s 110 --out "$out/graphs-$mode/decode" 2>&1 | quiet | grep "^|" | tail -4
    V4JAX_DECODE_GRAPHS=$mode timeout 110 python3 -W ignore -m v4jax.bench generate --model flash-slice \
      --batches 1,32 --contexts 4K --new 128 --prefill-chunk 8192 --attention-impl pallas --deadline-s 100 \
      --out "$out/graphs-$mode/generate" 2>&1 | quiet | grep "^|" | tail -2
  done
  python3 -m v4jax.bench.table "$out/graphs-xla=graphs-xla" "$out/graphs-loop=graphs-loop" 2>&1 | grep "^|" \
    | cut -d'|' -f2-9
  ;;
candidates)
  # ~70 s: several projections of one input in one launch (scripts/bench_fused_projections.py), mHC's expansion as a
  # Pallas kernel (scripts/bench_hc_post.py), their GPU tests
  stamp "GPU tests of the projection and mHC-expansion kernels"
  timeout 120 python3 -m pytest -q -m gpu tests/test_kernels_gpu.py -k "layer_linear or hc_post" \
    -p no:cacheprovider 2>&1 | tail -2
  stamp "projections of one input"
  timeout 150 python3 -W ignore scripts/bench_fused_projections.py --out "$out/fused" 2>&1 | quiet | tail -6
  stamp "mHC expansion"
  timeout 90 python3 -W ignore scripts/bench_hc_post.py --out "$out/hc_post" 2>&1 | quiet | tail -3
  ;;
memory)
  # the decode call's memory plan at flash-slice batch 32 / 128K (scripts/decode_memory.py) and, from XLA's buffer
  # assignment, the largest values of its temporary allocation: what asks for a second copy of a pool array
  stamp "decode memory plan"
  XLA_FLAGS="--xla_dump_to=/tmp/xla_dump --xla_dump_hlo_module_re=jit__decode" timeout 150 python3 -W ignore \
    scripts/decode_memory.py --model flash-slice --batch 32 --contexts 128K --attention-impl pallas \
    > "$out/decode_memory.json" 2>&1
  tail -3 "$out/decode_memory.json"
  # flash-1gpu at batch 32 (its CSA compressed-KV stack: 1.4G / 5.6G / 11.3G elements; run M7: every plan aliases
  # its pools, 17-22 MB of temporaries), then the instructions that make or take an array of the stack's size
  [ "${MEM_1GPU:-1}" = 1 ] && XLA_FLAGS="--xla_dump_to=/tmp/xla_dump_1gpu --xla_dump_hlo_module_re=jit__decode" \
    timeout 240 python3 -W ignore scripts/decode_memory.py --model flash-1gpu --batch 32 \
    --contexts "${MEM_CONTEXTS:-16K,64K,128K}" --attention-impl pallas > "$out/decode_memory_1gpu.json" 2>&1
  tail -4 "$out/decode_memory_1gpu.json"
  for d in /tmp/xla_dump /tmp/xla_dump_1gpu; do
    for f in "$d"/*jit__decode*after_optimizations-buffer-assignment.txt; do
      echo "== $f"
      grep "^allocation" "$f" | sort -t' ' -k4 -n -r | head -6 | cut -c1-200
      grep -o "value: <[0-9]* [^ ]* @[0-9]*> (size=[0-9]*,offset=[0-9]*): [a-z0-9]*\[[0-9,]*\]" "$f" \
        | awk -F'size=' '{split($2,a,","); print a[1], $0}' | sort -n -r | head -25
    done
  done > "$out/decode_buffers.txt"
  # the instructions that make or take an array the size of the largest pool stack, flat or stacked (what copies it)
  for f in /tmp/xla_dump_1gpu/*jit__decode*after_optimizations.txt; do
    echo "== $f"
    grep -n "\[22020096,512\]\|\[21,1048576,512\]\|copy\|cuda_graph\|input_output_alias" "$f" \
      | grep -v "^.*metadata={}$" | cut -c1-400 | head -60
  done > "$out/decode_copies.txt" 2>&1
  head -60 "$out/decode_buffers.txt"
  head -80 "$out/decode_copies.txt"
  ;;
engine)
  stamp "engine GPU tests"
  timeout "${TEST_S:-400}" python3 -m pytest -q -m gpu tests/test_engine_gpu.py -p no:cacheprovider \
    > "$out/pytest_gpu.log" 2>&1
  echo "engine gpu test rc=$?"; tail -3 "$out/pytest_gpu.log"
  ;;
table)
  # one call (timeouts add up to 590 s): the flash-slice decode and generate rows and flash-1gpu decode at 4K /
  # 128K (HF columns: the slice stage; HF's code does not change with this tree)
  timeout 40 python3 -m pytest -q -m gpu tests/test_kernels_gpu.py -k sinkhorn -p no:cacheprovider 2>&1 | tail -1
  stamp "flash-slice decode at 4K, profiled"
  timeout 90 python3 -W ignore -m v4jax.bench decode --model flash-slice --batches 1,32 --contexts 4K --long-b1 "" \
    --hf off --iters 5 --gen-iters 3 --profile --attention-impl pallas --deadline-s 75 --out "$out/slice_4k" 2>&1 \
    | quiet | grep "^|" | tail -4
  summary "$out/slice_4k/decode.json"
  stamp "flash-slice decode at 32K / 128K, and 1M at batch 1"
  timeout 100 python3 -W ignore -m v4jax.bench decode --model flash-slice --batches 1,32 --contexts 32K,128K \
    --long-b1 1M --hf off --iters 5 --gen-iters 3 --attention-impl pallas --deadline-s 85 --out "$out/slice_long" \
    2>&1 | quiet | grep "^|" | tail -7
  stamp "flash-slice generate"
  # (each row's first pass compiles its shapes, ~25 s: the 128K prefill row needs ~170 s from the start)
  timeout 200 python3 -W ignore -m v4jax.bench generate --model flash-slice --batches 1,32 --contexts 4K \
    --prefill 128K --new 64 --prefill-chunk 8192 --attention-impl pallas --deadline-s 180 --out "$out/gen_slice" \
    2>&1 | quiet | tail -8
  stamp "flash-1gpu decode at 4K / 128K"
  XLA_PYTHON_CLIENT_MEM_FRACTION=$mem_fraction timeout 160 python3 -W ignore -m v4jax.bench decode \
    --model flash-1gpu --batches 1,32 --contexts 4K,128K \
    --long-b1 "" --hf off --iters 3 --gen-iters 2 --attention-impl pallas --deadline-s 145 \
    --out "$out/d_1gpu" 2>&1 | quiet | grep "^|\|Error\|error" | tail -6
  ;;
prefill)
  stamp "GPU tests of the grouped experts, sparse attention and indexer kernels"
  timeout 150 python3 -m pytest -q -m gpu tests/test_kernels_gpu.py -k "grouped or sparse or indexer" \
    -p no:cacheprovider --tb=short 2>&1 | grep -v "^  \|^$" | tail -15
  stamp "prefill experts bench"
  [ "${SWEEP:-1}" = 1 ] && timeout 150 python3 -W ignore scripts/bench_prefill_experts.py 8192 2>&1 | quiet \
    | grep "^M=" | cut -c1-220
  stamp "128K flash-slice prefill profile"
  timeout 240 python3 -W ignore scripts/profile_prefill.py flash-slice 131072 8192 pallas 2>&1 | quiet \
    | tee "$out/profile_prefill.txt" | head -50
  stamp "128K flash-slice prefill through generate"
  timeout 170 python3 -W ignore -m v4jax.bench generate --model flash-slice --batches 1 --contexts 4K \
    --prefill 128K --new 16 --prefill-chunk 8192 --attention-impl pallas --deadline-s 160 --out "$out/gen_slice" \
    > "$out/gen_slice.log" 2>&1
  echo "rc=$?"; grep -i "check fail\|^F[0-9]\|error\|Traceback\|^|" "$out/gen_slice.log" | grep -v "^E[0-9]" | head -20
  ;;
sweep)
  stamp "top-k on a prefill chunk"
  timeout 120 python3 -W ignore scripts/bench_topk_prefill.py 2>&1 | quiet | tee "$out/topk_prefill.txt" | tail -6
  stamp "sparse attention on a prefill chunk"
  timeout 440 python3 -W ignore scripts/bench_attention_prefill.py 8192 ${ATTN_CONFIGS:-} 2>&1 | quiet | tee "$out/attention_prefill.txt" \
    | tail -40
  ;;
repeat)
  stamp "repeated generate calls: what the second one traces or compiles"
  timeout 100 python3 -W ignore scripts/check_repeat_generate.py flash-slice pallas > "$out/repeat.log" 2>&1
  grep "^====\|Compiling\|Error" "$out/repeat.log" | cut -c1-200 | tail -30
  # the same with XLA's command buffers (CUDA graphs) off: a graph is recorded on a thunk's second run
  stamp "again, command buffers off"
  XLA_FLAGS="--xla_gpu_enable_command_buffer=" timeout 100 python3 -W ignore scripts/check_repeat_generate.py \
    flash-slice pallas > "$out/repeat_nocb.log" 2>&1
  grep "^====\|Error" "$out/repeat_nocb.log" | cut -c1-200 | tail -10
  [ "${TEST_S:-300}" = 0 ] && exit 0
  stamp "engine GPU test"
  timeout "${TEST_S:-300}" python3 -m pytest -q -m gpu tests/test_engine_gpu.py -p no:cacheprovider > "$out/pytest_gpu.log" 2>&1
  echo "engine gpu test rc=$?"; tail -3 "$out/pytest_gpu.log"
  ;;
tune)
  stamp "GPU tests of the projection and top-k kernels"
  timeout 150 python3 -m pytest -q -m gpu tests/test_kernels_gpu.py -k "layer_linear or topk or sinkhorn" -p no:cacheprovider \
    2>&1 | tail -3
  if [ "${SWEEP:-1}" = 1 ]; then
    stamp "projection kernel sweep"
    timeout 240 python3 -W ignore scripts/bench_layer_linear.py --out "$out/ll" 2>&1 | quiet | tail -14
  fi
  stamp "Sinkhorn sweep"
  timeout 120 python3 -W ignore scripts/tune_kernels.py --only sinkhorn --harness trace --repeats 3 \
    --out "$out/sinkhorn" 2>&1 | quiet | grep "sinkhorn M"
  stamp "flash-slice decode at 4K"
  timeout 150 python3 -W ignore -m v4jax.bench decode --model flash-slice --batches 1,32 --contexts 4K --long-b1 "" \
    --hf off --iters 5 --gen-iters 3 --profile --attention-impl pallas --deadline-s 130 --out "$out/slice_4k" 2>&1 \
    | quiet | grep "^|" | tail -4
  summary "$out/slice_4k/decode.json"
  ;;
4k)
  stamp "GPU kernel tests"
  timeout 240 python3 -m pytest -q -m gpu tests/test_kernels_gpu.py -p no:cacheprovider 2>&1 | tail -3
  stamp "flash-slice decode at 4K"
  timeout 150 python3 -W ignore -m v4jax.bench decode --model flash-slice --batches 1,32 --contexts 4K --long-b1 "" \
    --hf off --iters 5 --gen-iters 3 --profile --attention-impl pallas --deadline-s 130 --out "$out/slice_4k" 2>&1 \
    | quiet | grep "^|" | tail -4
  summary "$out/slice_4k/decode.json"
  stamp "flash-1gpu decode at 4K"
  timeout 220 python3 -W ignore -m v4jax.bench decode --model flash-1gpu --batches 1,32 --contexts 4K --long-b1 "" \
    --hf off --iters 3 --gen-iters 2 --attention-impl pallas --deadline-s 200 --out "$out/1gpu_4k" 2>&1 | quiet \
    | grep "^|\|Error\|error" | tail -4
  ;;
esac
stamp done
