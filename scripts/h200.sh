#!/usr/bin/env bash
# The one device driver: the tables of BENCHMARKS.md are re-made by its stages, one device call per stage (each
# inside the 10-minute limit). Everything lands under $OUT (default ./h200_out).
#   bash scripts/h200.sh STAGE [N]
# Decode and prefill at depth (Pallas ops; V4JAX_COMPILATION_CACHE=off):
#   slice      flash-slice (KERNEL_TESTS=1: the top-k / sparse-attention GPU tests first): decode at batch 1 / 32 and
#              4K / 32K / 128K, 1M at batch 1 (jitted call, engine loop, a profile at 4K), HF at 4K (batch 1 / 32)
#              and at batch 1 / 32K and 128K; generate rows and the 128K prefill; the merged table (v4jax bench table)
#   1gpu       flash-1gpu (43 layers): first generate (compile), generate rows, 32K prefill, decode at batch 1 / 32
#              and 4K / 32K / 128K; the merged table
#   table      in one call: flash-slice decode (4K profiled, 32K, 128K, 1M at batch 1) and generate rows with the
#              128K prefill, flash-1gpu decode at 4K and 128K
#   4k         the GPU kernel tests, then batch 1 / 32 at 4K of flash-slice (with kernels per step from a profile)
#              and of flash-1gpu
#   engine     the engine GPU tests (Pallas engine = XLA engine, a second generate compiles nothing)
#   memory     the decode call's memory plan (v4jax bench decode --memory-plan) with its largest temporaries from
#              XLA's buffer assignment (flash-slice), then flash-1gpu's at batch 32 and 16K / 64K / 128K
#              (MEM_1GPU=0 skips it; MEM_CONTEXTS sets its contexts)
#   repeat     four generate calls in one process (v4jax bench generate --repeat-check; compiles logged), with and
#              without XLA's command buffers, then the engine GPU test (TEST_S=0 skips it)
#   prefill    the prefill kernels' GPU tests, the experts sweep (v4jax bench kernels --sweep prefill_experts;
#              SWEEP=0 skips), a profile of a 128K flash-slice prompt (v4jax bench generate --profile-prefill),
#              the 128K prefill through generate
#   prefillkv  a profile of the 128K flash-slice prefill per cache entry format (KVS="auto fp8"; QUANT: weights)
#   defaults   LLM.generate at default options on a 32-slot flash-slice engine: the warm-up's programs and time,
#              batch 1 / 32 at 4K, the 128K prefill (PREFILL_CHUNK=N another chunk)
#   ab BASE [slice|quick|prefill|burst|1gpu]  the decode and prefill rows of `slice` (`quick`: its decode rows at 4K,
#              QUANT=fp8 in the release's formats, PROFILE=1 with kernels;
#              `prefill`: its 128K prefill; `burst`: 32 fresh 4K prompts through LLM.generate at default options;
#              `1gpu`: flash-1gpu's decode rows) in a second tree BASE (e.g.
#              `git archive COMMIT -- . ':!v4jax/default_model' | tar -x -C base`) and in this one, one after the other
#              in one call, then both in one table: what a change costs, on the same machine
#   flags      XLA_FLAGS variants against XLA's defaults, each in its own process (FLAGS: variants separated by ';',
#              the first the baseline; default: none, CONCURRENT command-buffer scheduling, PDL, both): mHC's GPU
#              kernel tests (STEPS has "kernels"), the greedy tokens of scripts/greedy_tokens.py against the
#              baseline's (STEPS has "tokens"), then flash-slice's decode rows at 4K (STEPS has "decode"; ROUNDS
#              passes, the variants alternating; MODEL=flash-1gpu for its rows) -> $OUT/flags/
# Kernels:
#   check      GPU tests (kernels, engine), the kernel table from profiler traces ($OUT/k/bench_kernels.{md,json}),
#              engine decode with XLA and Pallas attention at batch 32 / 128K ($OUT/d{xla,pallas})
#   tune       the projection kernel's sweep (--sweep layer_linear; SWEEP=0 skips it), the Sinkhorn sweep (--tune
#              --only sinkhorn), their and the top-k GPU tests, batch 1 / 32 at 4K of flash-slice with each
#              kernel's time per line of the model
#   sweep      a prefill chunk's top-k per stage and its sparse attention per tile (--sweep topk_prefill /
#              attention_prefill; ATTN_CONFIGS="HEADS:WARPS:BLOCK:STAGES:SKIP_TAIL ..." picks the per-query
#              kernel's tiles, "prefix:TQ:HEADS:BLOCK:WARPS:STAGES:PV_SPLIT ..." the HCA query-block kernel's; the
#              indexer's is v4jax bench kernels --sweep indexer_prefill)
#   ncu        Nsight Compute on the sparse attention and indexer kernels (NCU="attention indexer experts_fp4" picks;
#              experts_fp4: the FP4 experts at one token) -> $OUT/ncu_<kernel>.txt
#   kvformats  the sparse attention and indexer kernels on FP8 entries / FP4 keys: their and the engine's GPU tests
#              (TESTS=0 skips), then decode at 128K, batch 1 / 32, bf16 pools against the byte formats
#              (--sweep kv_formats; SWEEP=0 skips, BATCHES="1 32", SWEEP_S=180 a batch) -> $OUT/kv_b<B>/kv_formats.json
# Depth (BENCHMARKS.md "Depth"):
#   depth1     flash-1gpu: first-generate compile, decode rows (jit + engine loop, kernel launches per layer from a
#              profiler trace), generate at 4K
#   depth2     GPU tests; flash-slice: decode rows, mHC Sinkhorn loop vs unrolled (launches), generate rows and
#              the 128K prefill
# Serving and meshes:
#   serve      `v4jax serve` and `v4jax bench serve` on one machine (carry [".whl"]: the server's wheels, those of
#              fastapi, starlette, uvicorn, pydantic, pydantic-core, annotated-types, typing-inspection and
#              opentelemetry-api for Python 3.12: `pip download --no-deps --python-version 3.12 --only-binary=:all:
#              -d .whl NAME==VERSION` at the versions of this venv; fastapi 0.165 imports opentelemetry), then
#              SIGTERM and a check that the server drained and exited 0 -> $OUT/server.log, $OUT/metrics.txt,
#              $OUT/r<RATE>/serve_bench.{md,json}. MODEL, SERVE_ARGS, RATES, BENCH_ARGS, WARMUP, PORT override;
#              a CPU dry run of the default model: SKIP_WHEELS=1 MODEL= SERVE_ARGS="--max-model-len 512" RATES="4"
#              WARMUP=4 BENCH_ARGS="--num-requests 16 --prompt-len 32 --output-len 16 --vocab 2048" \
#              bash scripts/h200.sh serve
#   precision  the release's formats (FP8/FP4 weights, FP8 cache entries) against bf16: LLM.generate at batch 1 / 32, 4K,
#              against the roofline of the bytes stored (MODEL, CONFIGS="QUANT:KV ...", BATCHES, CONTEXTS="4K,128K",
#              PREFILL=128K for a 128K prefill row, NEW, ROW_S a configuration's limit)
#   sampling   the sampler's top-p cut sorted against searched per batch (scripts/sampling_probe.py --search-from;
#              PROBE_BATCHES), then LLM.generate with a frequency penalty (PENALTY, 0.5) against without (flash-slice,
#              BATCHES "1,32", 4K, 64 new; ROW_S a row's limit) -> $OUT/cut.jsonl, $OUT/pen_<P>
#   spec       speculative decoding (MTP) against plain decoding, drafts kept at forced ACCEPT rates, batches
#              BATCHES, k KS (v4jax bench spec); PROFILE=1: each row's device kernels per token position (TAIL=200)
#   compile    one engine's prefill and decode programs compiled with XLA's options and with GPU autotuning off,
#              each timed (scripts/compile_probe.py -> $OUT/compile.json; MODEL (flash-1gpu), CHUNK, PAGES, COMPILE_S)
#   firstgen   a cold engine's first LLM.generate of one long prompt (no warm-up, cache off), with the later chunks'
#              and decode calls' programs compiled ahead in the background against each compiled by its step
#              (scripts/first_generate.py, each form in its own process -> $OUT/first_generate.jsonl; MODEL
#              (flash-slice), PROMPT (131072), CHUNK (8192), FIRSTGEN_S)
#   width      the page-table width buckets against one width (scripts/width_probe.py): ms/step and prefill per row,
#              programs compiled, programs a warm-up would compile -> $OUT/width.jsonl (MODEL, ROWS_W, NEW, WIDTH_S)
#   startup    `v4jax serve` per --warmup mode (carry [".whl"]; v4jax bench startup, compilation cache off): seconds to
#              ready, the first load's TTFT / TPOT / ITL and longest gap, compiles waited for or done in the background
#              -> $OUT/startup (MODEL, MODES ("cover none": the cover first; its load of 96 requests at 2/s lasts
#              long enough for background compiles to end and exact programs to take over), SERVE_ARGS, BENCH_ARGS,
#              STARTUP_S, SKIP_WHEELS); CPU dry run of the default model (3 min): SKIP_WHEELS=1 MODEL= SERVE_ARGS="--max-model-len 512" BENCH_ARGS="--rate 2
#              --num-requests 6 --prompt-len 8:300 --output-len 8:16 --vocab 2048" bash scripts/h200.sh startup
#   hisparse   the offload's tests on the GPU, then host offload of the C4 KV against the pool on the device
#              (v4jax bench hisparse), rows of a pair: flash-slice at 128K (ROWS: 512K / 1M, flash-1gpu), with and
#              without offload: the requests that fit, prefill s, decode ms/step, tokens/s, hit rate, bytes fetched
#              per step -> $OUT/hisparse.jsonl and a table (ROWS, MODES, DEVICE_PAGES, CHUNK (8192), PROFILE=1: a
#              decode step's and a late prefill chunk's kernels, their wall against kernel and copy ms, TESTS=0, KV=fp8
#              the release's cache entries); CPU dry
#              run: TESTS=0 ROWS=tiny:2048:2:600 DEVICE_PAGES=8 PROFILE=1 bash scripts/h200.sh hisparse
#   load       LLM.generate and `v4jax serve` (carry [".whl"]) on the same 64-slot engine options, 1 / 8 / 32 / 64
#              prompts (streams) of 1024 tokens, 256 new -> $OUT/generate, $OUT/s<N>; LONG_NUM=4 adds LONG_STREAMS
#              streams with LONG_NUM prompts of LONG_PROMPT tokens arriving among them -> $OUT/long; SWITCH_MS="5 0.5"
#              a server per Python thread switch interval (ms; others -> $OUT/switch_<MS>); CPU dry run: SKIP_WHEELS=1
#              MODEL=tiny ENGINE_ARGS="--max-num-seqs 8 --max-model-len 512 --dtype float32" STREAMS="1 4" PROMPT=64
#              NEW=16 VOCAB=500 bash scripts/h200.sh load
#   pd         prefill/decode disaggregation on one GPU (carry [".whl"]): `v4jax bench pd` (one request's state between
#              two engines at 4K / 16K / 32K, bytes and GB/s by transport, jax and http), then one load through a
#              colocated `v4jax serve` and through `v4jax router` in front of a prefill and a decode server (two
#              processes on the GPU): short streams decoding while long prompts arrive (v4jax bench serve --long-num),
#              TTFT / TPOT / ITL per class, an unmeasured pass first -> $OUT/pd_bench.json, pd_colocated.json,
#              pd_disagg.json, pd.md, pd_logs.txt. STEPS ("transfer colocated disagg"), MODEL, PD_ARGS, ENGINE_ARGS,
#              LOAD_ARGS, TRANSPORT (jax | http; default jax unless bench pd's jax rows failed), WARM=0, BUDGET_S
#              (540 in all), PD_S / WARM_S / LOAD_S (a step's limit), PORT override; CPU dry run of the default model
#              (minutes of compiling on CPU):
#              SKIP_WHEELS=1 MODEL= BUDGET_S=3000 PD_S=900 WARM_S=900 LOAD_S=600 PD_ARGS="--prompt-len 64 256 1000 \
#              --repeats 3" ENGINE_ARGS="--max-num-seqs 8 --max-model-len 512 --prefill-chunk 64" \
#              LOAD_ARGS="--num-requests 12 --max-concurrency 4 --rate inf --prompt-len 16 --output-len 32:48 \
#              --vocab 2048 --long-num 3 --long-rate 2 --long-start 0.2 --long-prompt-len 384 --long-output-len 4" \
#              bash scripts/h200.sh pd
#   multigpu N decode on N = 2 / 4 / 8 GPUs against one (v4jax bench mesh; kind nvidia-h200-xN) ->
#              $OUT/mesh_<model>/mesh.json. CPU dry run: v4jax bench mesh --model tiny --dtype float32 \
#              --meshes "tensor=2;expert=2" --batches 1,4 --context 64
set -u
stage=${1:-slice}
out=${OUT:-./h200_out}
mkdir -p "$out"
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
case $stage in
check|depth1|depth2|serve|load|multigpu|ncu) ;;  # these keep the compilation cache on
*) export V4JAX_COMPILATION_CACHE=off ;;
esac
gpu="gpu and not slow"   # the GPU tests of a stage (the slow ones: python -m pytest -q -m "gpu and slow" tests)
quiet() { grep -v "Warn\|^[EW][0-9]\{4\} \|slow_operation\|^\*\*\*\|Very slow\|^$\|warn(" ; }
t0=$(date +%s)
# flash-1gpu's decode rows let JAX's allocator take 94 % of the GPU (the default, 75 %, is 105 GB; no torch there):
# batch 32 at 128K holds 49 GB of weights and 30 GB of pools, and its decode call asked for a buffer the size of
# its largest pool array (21 GiB) on top (run M: out of memory). The plan aliases every pool with 22 MB of
# temporaries, and a donated 21 GiB array is updated in place (run M8).
mem_fraction=${MEM_FRACTION:-0.94}
stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
# The first thing every stage does: import the tree with the machine's JAX and say which (an import error shows at
# once, not minutes into a stage: importing v4jax once failed on JAX 0.11.2)
imports() { python3 -c "import jax, v4jax; print('jax', jax.__version__, '- v4jax imports')" || exit 1; }
# The server stages' wheels (carry [".whl"], see `serve` in the header), unless SKIP_WHEELS is set
wheels() {
  if [ -z "${SKIP_WHEELS:-}" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      .whl/*.whl || { echo "wheel install failed"; exit 1; }
    export PYTHONPATH=/tmp/site:.
  fi
}
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
case "$stage" in
slice)
  imports
  # one call (timeouts add up to 535 s; KERNEL_TESTS=1 adds the kernels' GPU tests, 90 s more, past one call's
  # limit of 600 s with the rest; run M: 94 s for five decode rows with HF at 4K,
  # the last two past a deadline of 120 s; run L: 88 s for the decode rows with HF at 4K,
  # 63 s for HF at 32K / 128K, 207 s for the generate rows at 4K, 32K and 128K, compiles included): the kernels' GPU
  # tests, every flash-slice decode row (jitted call, engine loop, a profile per row) with HF at 4K, HF at batch 1 /
  # 32K and 128K, the generate rows and the 128K prefill through LLM.generate, the merged table
  if [ "${KERNEL_TESTS:-0}" = 1 ]; then
    stamp "GPU tests of the top-k and sparse attention kernels"
    timeout 90 python3 -m pytest -q -m "$gpu" tests/test_kernels_gpu.py -k "topk or sparse" -p no:cacheprovider 2>&1 \
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
    --out "$out/flash-slice/generate" 2>&1 | quiet | tail -12
  python3 -m v4jax.bench.table "$out/flash-slice"
  ;;
1gpu)
  imports
  # one call (timeouts add up to 550 s; run K: init + first generate 52 s, the batch-1 4K row ~70 s, batch 32 ~100
  # s, decode at batch 1 ~95 s): flash-1gpu's first generate (compile), generate rows and the 32K prefill, decode
  # at batch 1 / 32 and 4K / 32K / 128K, the merged table. 256 new tokens: batch 32's prompts take 16 prefill
  # steps, and its first requests decode 8 tokens in each, so with 128 they finished before the last one started
  # (no steady window in run K)
  stamp "flash-1gpu generate"
  timeout 310 python3 -W ignore -m v4jax.bench generate --model flash-1gpu --batches 1,32 --contexts 4K \
    --prefill 32K --new 256 --prefill-chunk 8192 --attention-impl pallas --deadline-s 225 \
    --out "$out/flash-1gpu/generate" 2>&1 | quiet | tail -16
  stamp "flash-1gpu decode"
  XLA_PYTHON_CLIENT_MEM_FRACTION=$mem_fraction timeout 240 python3 -W ignore -m v4jax.bench decode \
    --model flash-1gpu --batches 1,32 --contexts 4K,32K,128K \
    --long-b1 "" --hf off --iters 3 --gen-iters 2 --attention-impl pallas --deadline-s 200 \
    --out "$out/flash-1gpu/decode" 2>&1 | quiet | grep "^|\|Error\|error" | tail -8
  summary "$out/flash-1gpu/decode/decode.json" | head -20
  python3 -m v4jax.bench.table "$out/flash-1gpu"
  ;;
defaults)
  imports
  # LLM.generate at default options on one many-slot engine (flash-slice, 32 slots): the warm-up (every program,
  # at a 16K context), batch 1 / 32 at 4K, and the 128K prefill; PREFILL_CHUNK sets the chunk (default: the LLM's)
  chunk=${PREFILL_CHUNK:+--prefill-chunk $PREFILL_CHUNK}
  stamp "warm-up and decode at 4K, 32 slots"
  timeout ${WARM_S:-300} python3 -W ignore -m v4jax.bench generate --model flash-slice --max-num-seqs 32 \
    --max-model-len 16384 $chunk --warmup --batches 1,32 --contexts 4K --new 64 --out "$out/d16k" 2>&1 | quiet | tail -25
  stamp "the 128K prefill and batch 32 at 4K, 32 slots, a 131584-token context"
  timeout ${LONG_S:-240} python3 -W ignore -m v4jax.bench generate --model flash-slice --max-num-seqs 32 \
    --max-model-len 131584 $chunk --batches 32 --contexts 4K --prefill 128K --new 64 --out "$out/d128k" 2>&1 \
    | quiet | tail -12
  ;;
sampling)
  imports
  # The sampler's top-p cut by sort against by search at each batch (where SEARCH_FROM_ROWS belongs), then the
  # penalties' program form through LLM.generate against the form without, one engine each (flash-slice, 4K)
  for from in 1 100000; do
    stamp "top-p 0.9, the cut searched from $from rows"
    timeout ${PROBE_S:-120} python3 -W ignore scripts/sampling_probe.py --forms top_p --batches ${PROBE_BATCHES:-1,4,8,12,16,24,32} \
      --search-from $from --out "$out/cut.jsonl" 2>&1 | quiet | tail -8
  done
  for pen in 0 ${PENALTY:-0.5}; do
    stamp "frequency penalty $pen"
    timeout ${ROW_S:-200} python3 -W ignore -m v4jax.bench generate --model flash-slice --max-num-seqs 32 \
      --max-model-len 8192 --batches ${BATCHES:-1,32} --contexts 4K --new 64 --frequency-penalty $pen \
      --out "$out/pen_$pen" 2>&1 | quiet | tail -6
  done
  ;;
precision)
  imports
  # The release's formats against bf16 (flash-slice; MODEL=flash-1gpu for the full depth), LLM.generate on one
  # 32-slot engine at 4K: weights as bf16 / FP8 linears + FP4 experts, cache entries bf16 / FP8 + FP4 indexer
  # keys, each against the roofline of the bytes it stores; CONFIGS picks "QUANT:KV ..."
  MODEL=${MODEL:-flash-slice}
  # flash-h200's 113.6 GiB of weights need more than XLA's default 75 % of the card
  [ "$MODEL" = flash-h200 ] && export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.95}
  for cfgs in ${CONFIGS:-none:auto fp8:auto none:fp8 fp8:fp8}; do
    q=${cfgs%%:*}; kv=${cfgs##*:}
    stamp "$MODEL: quantization $q, kv_cache_dtype $kv"
    # NEW 160: a batch of 32 4K prompts starts over 64 prefill steps at the default chunk (2,048), the first
    # requests finishing before the last start; each row's "prompts cached" rate has them start together. On an
    # H100 a configuration at BATCHES=1,32 CONTEXTS=4K PREFILL=128K took 229 s (bf16) and over 285 s (FP8 / FP4:
    # the 128K row's first pass compiled for 150 s): ROW_S=300, one configuration a call. flash-1gpu at BATCHES=1
    # CONTEXTS=4K CTX_LEN=8192 did not finish in 110 s a configuration on an H100 (init 9-21 s, first generate
    # 20-30 s, then the 4K prompt's programs): ROW_S=300 there too
    timeout ${ROW_S:-150} python3 -W ignore -m v4jax.bench generate --model "$MODEL" --max-num-seqs 32 \
      ${CTX_LEN:+--max-model-len $CTX_LEN} --quantization $q --kv-cache-dtype $kv --batches ${BATCHES:-1,32} \
      --contexts ${CONTEXTS:-4K} ${PREFILL:+--prefill $PREFILL} --new ${NEW:-160} --out "$out/p_${q}_${kv}" 2>&1 \
      | quiet | tail -8
  done
  ;;
spec)
  imports
  # Speculative decoding with the MTP block through LLM.generate (flash-slice, random weights: drafts kept by a coin
  # at rates ACCEPT, one engine of the largest batch per (k, rate), 4K prompts) against plain decoding
  MODEL=${MODEL:-flash-slice}
  stamp "$MODEL: k ${KS:-1,3}, forced acceptance ${ACCEPT:-0.6,0.8}, batches ${BATCHES:-1,8,32}"
  timeout ${SPEC_S:-560} python3 -W ignore -m v4jax.bench spec --model "$MODEL" --dtype bfloat16 --context 4096 \
    --new ${NEW:-64} --k ${KS:-1,3} --accept ${ACCEPT:-0.6,0.8} --batch ${BATCHES:-1,8,32} --out "$out/spec.json" \
    ${PROFILE:+--profile} 2>&1 | quiet | tee "$out/spec.log" | tail -${TAIL:-30}  # the log keeps each row as it ends
  ;;
width)
  imports
  # one width for every table would make the programs per shape one (flash-slice at 16 slots x 8,448 tokens: 242
  # programs with 7 widths); measured here before the engine chooses it
  stamp "${MODEL:-flash-slice}: power-of-two width buckets against one width"
  timeout ${WIDTH_S:-560} python3 -W ignore scripts/width_probe.py --model "${MODEL:-flash-slice}" \
    --rows ${ROWS_W:-1x4096 32x4096 1x131072} --new ${NEW:-32} --out "$out/width.jsonl" 2>&1 | quiet | tail -20
  ;;
compile)
  imports
  # where a program's compile time goes (flash-1gpu: 30-47 s a prefill program): autotuning off first, so the
  # default compile after it autotunes from nothing
  stamp "${MODEL:-flash-1gpu}: prefill rows 1 x ${CHUNK:-2048}, ${PAGES:-8} pages, and decode: compile times"
  timeout ${COMPILE_S:-500} python3 -W ignore scripts/compile_probe.py --model "${MODEL:-flash-1gpu}" \
    --chunk ${CHUNK:-2048} --pages ${PAGES:-8} --max-model-len ${MAX_LEN:-4352} --options autotune0,default --out "$out/compile.json" 2>&1 | quiet | tail -8
  ;;
firstgen)
  imports
  stamp "${MODEL:-flash-slice}: first generate of ${PROMPT:-131072} tokens, programs compiled ahead, then not"
  timeout ${FIRSTGEN_S:-400} python3 -W ignore scripts/first_generate.py --model "${MODEL:-flash-slice}" \
    --prompt ${PROMPT:-131072} --chunk ${CHUNK:-8192} --max-model-len $(( ${PROMPT:-131072} + 512 )) --new 40 \
    2>&1 | grep "^{" | tee "$out/first_generate.jsonl"
  ;;
startup)
  imports
  # `v4jax serve` per --warmup mode (carry [".whl"]), the compilation cache off: seconds to /health, then a first
  # load of varied prompt lengths with nothing sent before it; the compiles every stream waited for against those
  # done in the background (v4jax bench startup)
  wheels
  model=${MODEL-flash-slice}
  stamp "${model:-the default model}: v4jax serve --warmup ${MODES:-cover none}"
  timeout ${STARTUP_S:-560} python3 -W ignore -m v4jax.cli bench startup --model "$model" \
    --modes ${MODES:-cover none} --serve-args "${SERVE_ARGS:---max-num-seqs 16 --max-model-len 4096}" \
    --bench-args "${BENCH_ARGS:---rate 2 --num-requests 96 --prompt-len 16:3000 --output-len 16:128 --vocab 129280}" \
    --ready-timeout 300 --load-timeout 300 --out "$out/startup" 2>&1 | quiet | tail -20
  ;;
hisparse)
  imports
  # Host offload of the C4 KV against the pool on the device, a pair of runs a row: LLM.generate of CONCURRENCY
  # random prompts of CONTEXT tokens in all (64 of them new), the C4 KV on the host (a hot buffer of DEVICE_PAGES
  # pages' entries per CSA layer) or on the device. Each row: the requests of that context the device's free memory
  # (and with offload the host's) would hold, C4 bytes on the device and the host, the prompts' prefill seconds,
  # decode ms/step and tokens/s, hit rate and bytes fetched per step (v4jax bench hisparse); PROFILE=1: a decode
  # step's kernels by family too. ROWS="MODEL:CONTEXT:CONCURRENCY:TIMEOUT_S ..." overrides (TIMEOUT_S for the pair:
  # half each); MODES="host" or "device" runs one. On an H100 the pairs took 108 s (flash-slice 128K x 2), 180 s
  # (512K x 2), 195 s (1M x 1) and 190 s (flash-1gpu 128K x 1) when prefill fetched by blocks of 64 queries; on an
  # H200 with whole reads 206 s (flash-1gpu 128K) and 167 s (flash-slice 512K x 2), compiles included. TESTS=0
  # skips the offload's tests run first
  ROWS=${ROWS:-flash-slice:131072:2:540}   # flash-slice:524288:2:540, flash-slice:1048576:1:540, flash-1gpu:131072:1:540
  rm -f "$out/hisparse.jsonl"
  if [ "${TESTS:-1}" = 1 ]; then  # the offload's own tests on this device first: pinned_host rows, the fetch, a layer
    stamp "offload tests (the row cache and one CSA layer against the device's)"
    timeout 45 python3 -m pytest -q tests/test_hisparse.py -k "memory_kinds or fetch_reads or attention_core" \
      -p no:cacheprovider 2>&1 | tail -2
  fi
  for row in $ROWS; do
    IFS=: read -r model ctx conc limit <<< "$row"
    for mode in ${MODES:-host device}; do
      flag=$([ $mode = device ] && echo --no-offload || echo "--device-pages ${DEVICE_PAGES:-512}")
      stamp "$model, $ctx tokens x $conc, C4 KV on the $mode"
      XLA_PYTHON_CLIENT_MEM_FRACTION=$mem_fraction timeout $(( limit / $(wc -w <<< "${MODES:-host device}") )) \
        python3 -W ignore -m v4jax.bench hisparse --model "$model" --dtype bfloat16 --context "$ctx" --concurrency "$conc" --new-tokens 64 \
        --prefill-chunk ${CHUNK:-8192} $flag $([ "${PROFILE:-0}" = 1 ] && echo --profile) ${KV:+--kv-cache-dtype $KV} --json \
        2> "$out/hisparse_${model}_${ctx}_$mode.err" | grep "^{" \
        >> "$out/hisparse.jsonl" || { echo "  no row (failed or timed out):"; quiet < "$out/hisparse_${model}_${ctx}_$mode.err" | tail -3; }
    done
  done
  python3 - "$out/hisparse.jsonl" <<'EOF'
import json, sys
lines = [json.loads(line) for line in open(sys.argv[1])]
rows = [r for r in lines if "ms_per_step" in r]  # the measured rows; PROFILE=1 adds a line of profiles after each
print("| model | context | C4 KV | requests that fit | ran | C4 device bytes | C4 host bytes | prefill, s | ms / step "
      "| tok/s | hit rate | fetched / step |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|")
num = lambda x, p=1: "-" if x is None else f"{x:,.{p}f}"
for r in rows:
    where = f"host, {r['device_rows']} rows on device" if r["offload"] else "device"
    hit = "-" if r.get("hit_rate") is None else f"{100 * r['hit_rate']:.1f} %"
    fetched = "-" if r.get("fetched_bytes_per_step") is None else f"{r['fetched_bytes_per_step']:,.0f} B"
    ctx = f"{r['context'] // 1024}K" if r["context"] % 1024 == 0 else r["context"]
    print(f"| {r['model']} | {ctx} | {where} | {r['fit_requests']} | {r['concurrency']} | "
          f"{r['c4_device_bytes']:,} | {r['c4_host_bytes']:,} | {num(r.get('prefill_s'))} | {num(r['ms_per_step'], 2)} "
          f"| {num(r['tokens_per_s'])} | {hit} | {fetched} |")
for r in rows:  # what the prefill fetched from the host (whole reads of its rows, or fetches by blocks of queries)
    if r["offload"]:
        print(f"  {r['model']} {r['context']} prefill: {r['prefill_fetched_bytes'] / 1e6:,.1f} MB fetched, "
              f"{r['prefill_transferred_bytes'] / 1e6:,.1f} MB moved, hit rate {100 * r['prefill_hit_rate']:.1f} %")
for r in lines:  # PROFILE=1: a decode step's and a late prefill chunk's wall time against its kernels' and copies'
    for what, key in (("decode step", "profile_decode_ms"), ("prefill chunk", "profile_prefill_ms")):
        if r.get(key):
            print(f"  {r['model']} {r['context']} {'host' if r['offload'] else 'device'} {what}, ms: "
                  + ", ".join(f"{k} {v:,.2f}" for k, v in r[key].items() if v is not None))
for r in lines:  # PROFILE=1: the heaviest kernel families of a decode step and of a late prefill chunk
    for what, top in (("decode step", r.get("profile")), ("prefill chunk", r.get("profile_prefill"))):
        for name, n, ms in (top or [])[:12]:
            print(f"  {r['model']} {r['context']} {'host' if r['offload'] else 'device'} {what}: {name[:50]:50s} "
                  f"{n:6.1f} {1e3 * ms:9.1f} us")
EOF
  ;;
load)
  imports
  # The server against its own engine, same batches, one call (carry [".whl"]): LLM.generate on one 64-slot
  # engine at default options with 1 / 8 / 32 / 64 prompts of 1024 tokens and 256 new (its programs go into the
  # persistent compilation cache), then `v4jax serve` with the same options, the cache warm, under 1 / 8 / 32 / 64
  # concurrent streams of the same shapes (v4jax bench serve --rate inf); SIGTERM, exit code. Greedy;
  # TEMPERATURE=1 samples as vLLM's and OpenAI's defaults, in both
  wheels
  # outside $OUT: a device call brings back only a few of $OUT's files, and the cache's hundreds crowded out the
  # per-load results
  export V4JAX_COMPILATION_CACHE=${V4JAX_COMPILATION_CACHE:-/tmp/v4jax-load-cache}
  MODEL=${MODEL-flash-slice}
  ENGINE_ARGS=${ENGINE_ARGS:---max-num-seqs 64 --max-model-len 2048}
  STREAMS=${STREAMS:-1 8 32 64}
  PROMPT=${PROMPT:-1024}; NEW=${NEW:-256}; PORT=${PORT:-8123}
  stamp "LLM.generate: batches ${STREAMS// /,} x $PROMPT tokens, $NEW new"
  timeout ${GEN_S:-330} python3 -W ignore -m v4jax.bench generate --model "$MODEL" $ENGINE_ARGS --cache on \
    --batches "${STREAMS// /,}" --contexts "$PROMPT" --new "$NEW" ${TEMPERATURE:+--temperature $TEMPERATURE} \
    --out "$out/generate" 2>&1 | quiet | tail -13
  # SWITCH_MS="5 0.5": one server per value of Python's thread switch interval (5 ms is CPython's default), each
  # under the same streams. A thread that returns from a blocking call (the engine thread's wait on the device)
  # waits for the GIL until the holder's interval ends: on a 2-core CPU, with two threads doing 3 ms of Python work
  # at a time, a 10 ms sleep woke 2.6 ms late on average at 5 ms and 0.95 ms at 0.5 ms. At 64 streams the server's
  # engine steps took 9.4 ms longer than LLM.generate's, 6.3 of them "on the device": how much of that is the GIL
  first=1
  for sw in ${SWITCH_MS:-5}; do
  if [ "$sw" = 5 ]; then sdir=$out; else sdir=$out/switch_$sw; mkdir -p "$sdir"; fi
  stamp "starting v4jax serve $MODEL (thread switch interval $sw ms)"
  python3 -W ignore -c "import sys; sys.setswitchinterval($sw / 1e3); from v4jax.cli import main; sys.exit(main())" \
    serve $MODEL --port "$PORT" --no-access-log $ENGINE_ARGS > "$sdir/server.log" 2>&1 &
  pid=$!
  python3 - "$PORT" "$pid" <<'EOF' || { stamp "server did not come up"; tail -20 "$sdir/server.log"; kill -9 "$pid"; exit 1; }
import os, sys, time, httpx
port, pid = int(sys.argv[1]), int(sys.argv[2])
deadline = time.monotonic() + 120
while time.monotonic() < deadline:
    try:
        os.kill(pid, 0)
    except OSError:
        sys.exit(1)
    try:
        if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
            sys.exit(0)
    except httpx.HTTPError:
        pass
    time.sleep(0.5)
sys.exit(1)
EOF
  stamp "server up"
  # the event loop runs on the server's main thread: its CPU seconds over each load (utime + stime of task $pid)
  loop_cpu() { awk -v hz="$(getconf CLK_TCK)" '{sub(/.*\) /, ""); print ($12 + $13) / hz}' "/proc/$pid/task/$pid/stat"; }
  for n in $STREAMS; do
    stamp "bench serve: $n streams"
    lc0=$(loop_cpu); lt0=$(date +%s.%N)
    # the warm-up's steps ran on covering programs while the exact ones compiled in the background (an H100 run
    # measured 32 streams with 3 still compiling: TTFT p50 2.5 s against 0.47 at 64): up to SETTLE_S for them first
    timeout ${SERVE_S:-150} python3 -W ignore -m v4jax.cli bench serve --url "http://127.0.0.1:$PORT" --rate inf \
      --num-requests "$n" --prompt-len "$PROMPT" --output-len "$NEW" --vocab ${VOCAB:-129280} \
      ${TEMPERATURE:+--temperature $TEMPERATURE} --warmup-requests "$n" --warmup-settle-s ${SETTLE_S:-60} --seed "$n" --out "$sdir/s$n" 2>&1 \
      | grep -v "^ \|^{\|^}\|^$" | tail -6
    awk -v c0="$lc0" -v c1="$(loop_cpu)" -v t0="$lt0" -v t1="$(date +%s.%N)" 'BEGIN {printf "event loop thread: " \
      "%.2f s of CPU in %.1f s (warm-up requests included)\n", c1 - c0, t1 - t0}' | tee -a "$sdir/s$n/loop_cpu.txt"
  done
  # LONG_NUM > 0 (the first server only): LONG_STREAMS streams decoding while LONG_NUM prompts of LONG_PROMPT
  # tokens arrive among them (the streams' ITL while a long prompt prefills against otherwise); on an H100 16
  # streams of 256 tokens end in under a second, so the long prompts come from 0.2 s (from 1 s they arrived after
  # the streams had ended)
  if [ "${LONG_NUM:-0}" -gt 0 ] && [ $first = 1 ]; then
    stamp "bench serve: ${LONG_STREAMS:-16} streams, $LONG_NUM prompts of ${LONG_PROMPT:-1920} among them"
    timeout ${SERVE_S:-150} python3 -W ignore -m v4jax.cli bench serve --url "http://127.0.0.1:$PORT" --rate inf \
      --num-requests "${LONG_STREAMS:-16}" --prompt-len "$PROMPT" --output-len "$NEW" --vocab ${VOCAB:-129280} \
      --long-num "$LONG_NUM" --long-prompt-len "${LONG_PROMPT:-1920}" --long-output-len 16 --long-rate 8 \
      --long-start 0.2 --warmup-requests "${LONG_STREAMS:-16}" --warmup-settle-s ${SETTLE_S:-60} --seed 1000 \
      --out "$sdir/long" 2>&1 | grep -v "^ \|^{\|^}" | tail -8
  fi
  first=0
  stamp "SIGTERM"
  kill -TERM "$pid"
  for _ in $(seq 1 60); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
  if kill -0 "$pid" 2>/dev/null; then stamp "server still running 30 s after SIGTERM"; kill -9 "$pid"; fi
  wait "$pid"; stamp "server exit code $?"
  # the server against LLM.generate per batch, both end to end (generate: tokens over the wall of one call,
  # prefill included), with each one's engine ms a step
  echo "thread switch interval $sw ms:"
  python3 - "$out" "$sdir" $STREAMS <<'EOF'
import json, os, sys
out, sdir, streams = sys.argv[1], sys.argv[2], [int(n) for n in sys.argv[3:]]
gen = {r["batch"]: r for r in json.load(open(os.path.join(out, "generate", "generate.json")))["rows"] if "wall_s" in r}
print("| streams | server out tok/s | LLM.generate out tok/s | server / generate | engine ms a step, server / generate "
      "| steps (prefill / decode), server / generate |")
print("|---:|---:|---:|---:|---|---|")
mix = lambda e: f"{e['steps']:.0f} ({e['prefill_steps']:.0f} / {e['decode_calls']:.0f})" if "prefill_steps" in e else "-"
for n in streams:
    path = os.path.join(sdir, f"s{n}", "serve_bench.json")
    if n not in gen or not os.path.exists(path):
        continue
    rep, g = json.load(open(path)), gen[n]
    srv, ref = rep["summary"]["output_throughput"], g["tokens"] / g["wall_s"]
    es = rep.get("engine_steps") or {}
    eng = f"{1e3 * es['step_seconds'] / es['steps']:.2f}" if es.get("steps") else "-"
    ge = f"{g['engine_step_ms']:.2f}" if "engine_step_ms" in g else "-"
    print(f"| {n} | {srv:,.0f} | {ref:,.0f} | {srv / ref:.0%} | {eng} / {ge} | {mix(es)} / {mix(g.get('engine_steps', {}))} |")
EOF
  done
  ;;
ab)
  imports
  base=${2:?usage: bash scripts/h200.sh ab BASE_DIR [slice|quick|prefill|burst|1gpu]}
  what=${3:-slice}
  # QUANT=fp8: the decode rows (quick, 1gpu) in the release's formats (FP8 / FP4 weights, KV=fp8 entries); PROFILE=1
  # adds each row's kernels
  quant="${QUANT:+--quantization $QUANT --kv-cache-dtype ${KV:-fp8}} ${PROFILE:+--profile}"
  for tree in "$base" .; do
    name=$([ "$tree" = . ] && echo new || echo base)
    (cd "$tree" && imports) || exit 1
    dir=$(cd "$out" && pwd)/ab-$name
    if [ "$what" = quick ]; then
      stamp "$name: flash-slice decode at 4K"
      (cd "$tree" && PYTHONPATH=. timeout 150 python3 -W ignore -m v4jax.bench decode --model flash-slice --batches 1,32 \
        --contexts 4K --long-b1 "" --hf off --iters 5 --gen-iters 3 --attention-impl pallas --deadline-s 140 \
        $quant --out "$dir/decode" 2>&1 | quiet | grep "^|" | tail -3)
    elif [ "$what" = slice ]; then
      stamp "$name: flash-slice decode"
      (cd "$tree" && PYTHONPATH=. timeout 120 python3 -W ignore -m v4jax.bench decode --model flash-slice --batches 1,32 \
        --contexts 4K,32K,128K --long-b1 "" --hf off --iters 5 --gen-iters 3 --attention-impl pallas --deadline-s 110 \
        --out "$dir/decode" 2>&1 | quiet | grep "^|" | tail -7)
      stamp "$name: flash-slice generate and the 128K prefill"
      (cd "$tree" && PYTHONPATH=. timeout 170 python3 -W ignore -m v4jax.bench generate --model flash-slice \
        --batches 1,32 --contexts 4K --prefill 128K --new 256 --prefill-chunk 8192 --attention-impl pallas \
        --deadline-s 160 --out "$dir/generate" 2>&1 | quiet | grep "^|" | tail -5)
    elif [ "$what" = burst ]; then
      stamp "$name: flash-slice, 32 fresh prompts of 4K at default options (their starts, then decode)"
      (cd "$tree" && PYTHONPATH=. timeout 280 python3 -W ignore -m v4jax.bench generate --model flash-slice \
        --max-num-seqs 32 --max-model-len 131584 --batches ${BATCHES:-1,32} --contexts 4K --new 160 --deadline-s 270 \
        --out "$dir/generate" 2>&1 | quiet | grep "^|" | tail -4)
    elif [ "$what" = prefill ]; then
      stamp "$name: flash-slice prefill of a 128K prompt"
      (cd "$tree" && PYTHONPATH=. timeout 170 python3 -W ignore -m v4jax.bench generate --model flash-slice \
        --batches 1 --contexts "" --prefill 128K --new 256 --prefill-chunk 8192 --attention-impl pallas \
        --deadline-s 165 --out "$dir/generate" 2>&1 | quiet | grep "^|" | tail -5)
    else
      stamp "$name: flash-1gpu decode"
      (cd "$tree" && PYTHONPATH=. XLA_PYTHON_CLIENT_MEM_FRACTION=$mem_fraction timeout 250 python3 -W ignore -m v4jax.bench \
        decode --model flash-1gpu --batches 1,32 --contexts 4K,128K --long-b1 "" --hf off --iters 3 --gen-iters 2 \
        --attention-impl pallas --deadline-s 240 $quant --out "$dir/decode" 2>&1 | quiet | grep "^|" | tail -5)
    fi
  done
  python3 -m v4jax.bench.table "$out/ab-base=base" "$out/ab-new=new"
  ;;
flags)
  imports
  IFS=';' read -ra variants <<< "${FLAGS:-;--xla_gpu_command_buffer_scheduling_mode=CONCURRENT;--xla_gpu_enable_pdl=true;--xla_gpu_command_buffer_scheduling_mode=CONCURRENT --xla_gpu_enable_pdl=true}"
  model=${MODEL:-flash-slice}
  steps=${STEPS:-kernels tokens decode}
  mkdir -p "$out/flags"
  if [[ $steps == *kernels* ]]; then  # the decode step's newest kernels (mHC, top-k) on this GPU first
    timeout 150 python3 -m pytest -q -m "$gpu" tests/test_kernels_gpu.py -k "${KTESTS:-hc_ or topk}" \
      -p no:cacheprovider 2>&1 | tail -3
  fi
  if [[ $steps == *tokens* ]]; then
    for i in "${!variants[@]}"; do
      stamp "tokens, XLA_FLAGS='${variants[$i]}'"
      against=$([ "$i" = 0 ] || echo "--against $out/flags/tokens_0.json")
      XLA_FLAGS="${variants[$i]}" timeout ${TOKENS_S:-150} python3 -W ignore scripts/greedy_tokens.py --model "$model" \
        --out "$out/flags/tokens_$i.json" $against 2>&1 | quiet | tail -2
    done
  fi
  if [[ $steps == *decode* ]]; then
    batches=$([ "$model" = flash-1gpu ] && echo 1 || echo 1,32)
    for round in $(seq "${ROUNDS:-1}"); do
      for i in "${!variants[@]}"; do
        stamp "decode, round $round, XLA_FLAGS='${variants[$i]}'"
        XLA_PYTHON_CLIENT_MEM_FRACTION=$mem_fraction XLA_FLAGS="${variants[$i]}" timeout ${DECODE_S:-150} python3 -W ignore \
          -m v4jax.bench decode --model "$model" --batches $batches --contexts 4K --long-b1 "" --hf off --iters 5 \
          --gen-iters 3 --attention-impl pallas --deadline-s $(( ${DECODE_S:-150} - 10 )) \
          --out "$out/flags/v${i}_r$round" 2>&1 | quiet | grep "^|" | tail -2
      done
    done
  fi
  ;;
memory)
  imports
  # the decode call's memory plan at flash-slice batch 32 / 128K (v4jax bench decode --memory-plan) and, from XLA's
  # buffer
  # assignment, the largest values of its temporary allocation: what asks for a second copy of a pool array
  stamp "decode memory plan"
  XLA_FLAGS="--xla_dump_to=/tmp/xla_dump --xla_dump_hlo_module_re=jit__decode" timeout 150 python3 -W ignore \
    -m v4jax.bench decode --memory-plan --model flash-slice --batches 32 --contexts 128K --attention-impl pallas \
    > "$out/decode_memory.json" 2>&1
  tail -3 "$out/decode_memory.json"
  # flash-1gpu at batch 32 (its CSA compressed-KV stack: 1.4G / 5.6G / 11.3G elements; run M7: every plan aliases
  # its pools, 17-22 MB of temporaries), then the instructions that make or take an array of the stack's size
  [ "${MEM_1GPU:-1}" = 1 ] && XLA_FLAGS="--xla_dump_to=/tmp/xla_dump_1gpu --xla_dump_hlo_module_re=jit__decode" \
    timeout 240 python3 -W ignore -m v4jax.bench decode --memory-plan --model flash-1gpu --batches 32 \
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
  imports
  stamp "engine GPU tests"
  timeout "${TEST_S:-400}" python3 -m pytest -q -m gpu tests/test_engine_gpu.py -p no:cacheprovider \
    > "$out/pytest_gpu.log" 2>&1
  echo "engine gpu test rc=$?"; tail -3 "$out/pytest_gpu.log"
  ;;
table)
  imports
  # one call (timeouts add up to 590 s): the flash-slice decode and generate rows and flash-1gpu decode at 4K /
  # 128K (HF columns: the slice stage; HF's code does not change with this tree)
  timeout 40 python3 -m pytest -q -m "$gpu" tests/test_kernels_gpu.py -k sinkhorn -p no:cacheprovider 2>&1 | tail -1
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
    2>&1 | quiet | tail -12
  stamp "flash-1gpu decode at 4K / 128K"
  XLA_PYTHON_CLIENT_MEM_FRACTION=$mem_fraction timeout 160 python3 -W ignore -m v4jax.bench decode \
    --model flash-1gpu --batches 1,32 --contexts 4K,128K \
    --long-b1 "" --hf off --iters 3 --gen-iters 2 --attention-impl pallas --deadline-s 145 \
    --out "$out/d_1gpu" 2>&1 | quiet | grep "^|\|Error\|error" | tail -6
  ;;
prefill)
  imports
  stamp "GPU tests of the grouped experts, sparse attention and indexer kernels"
  timeout 150 python3 -m pytest -q -m "$gpu" tests/test_kernels_gpu.py -k "grouped or sparse or indexer" \
    -p no:cacheprovider --tb=short 2>&1 | grep -v "^  \|^$" | tail -15
  stamp "prefill experts bench"
  [ "${SWEEP:-1}" = 1 ] && timeout 150 python3 -W ignore -m v4jax.bench kernels --sweep prefill_experts \
    --tokens 8192 --out "$out" 2>&1 | quiet \
    | grep "^M=" | cut -c1-220
  stamp "128K flash-slice prefill profile"
  timeout 240 python3 -W ignore -m v4jax.bench generate --profile-prefill --model flash-slice --prefill 128K \
    --prefill-chunk 8192 --attention-impl pallas 2>&1 | quiet \
    | tee "$out/profile_prefill.txt" | head -50
  stamp "128K flash-slice prefill through generate"
  timeout 170 python3 -W ignore -m v4jax.bench generate --model flash-slice --batches 1 --contexts 4K \
    --prefill 128K --new 16 --prefill-chunk 8192 --attention-impl pallas --deadline-s 160 --out "$out/gen_slice" \
    > "$out/gen_slice.log" 2>&1
  echo "rc=$?"; grep -i "check fail\|^F[0-9]\|error\|Traceback\|^|" "$out/gen_slice.log" | grep -v "^E[0-9]" | head -20
  ;;
prefillkv)
  imports
  # where the 128K prefill's time goes with each cache entry format (KVS), flash-slice, chunk 8192, one profile a
  # format in the same call (v4jax bench generate --profile-prefill)
  for kv in ${KVS:-auto fp8}; do
    stamp "128K flash-slice prefill profile, kv_cache_dtype $kv"
    timeout ${PROFILE_S:-280} python3 -W ignore -m v4jax.bench generate --profile-prefill --model flash-slice \
      --prefill 128K --prefill-chunk 8192 --attention-impl pallas --quantization ${QUANT:-none} --kv-cache-dtype $kv \
      2>&1 | quiet | tee "$out/profile_prefill_$kv.txt" | head -${TAIL:-30}
  done
  ;;
sweep)
  imports
  stamp "top-k on a prefill chunk"
  timeout 120 python3 -W ignore -m v4jax.bench kernels --sweep topk_prefill 2>&1 | quiet \
    | tee "$out/topk_prefill.txt" | tail -6
  stamp "sparse attention on a prefill chunk"
  timeout 440 python3 -W ignore -m v4jax.bench kernels --sweep attention_prefill --tokens 8192 \
    ${ATTN_CONFIGS:+--configs $ATTN_CONFIGS} 2>&1 | quiet | tee "$out/attention_prefill.txt" \
    | tail -40
  ;;
kvformats)
  # The kernels reading the release's cache formats (FP8 entries, FP4 indexer keys): their GPU tests against the
  # reference and the engine on them against the XLA path (TESTS=0 skips), then decode's sparse attention and
  # indexer at 128K, batch 1 / 32, on bf16 pools against the byte formats (SWEEP=0 skips). Within one call's
  # 600 s: tests 180 s, each batch's sweep SWEEP_S (200) s
  if [ "${TESTS:-1}" = 1 ]; then
    stamp "GPU tests of the sparse attention on FP8 entries, the indexer on FP4 keys, the engine on both"
    timeout 180 python3 -m pytest -q -m "$gpu" tests/test_kernels_gpu.py tests/test_engine_gpu.py \
      -k "sparse_attention_fp8 or indexer_scores_fp4 or fp8_cache" \
      -p no:cacheprovider --tb=short 2>&1 \
      | grep -v "^  \|^$" | tail -15
  fi
  if [ "${SWEEP:-1}" = 1 ]; then
    for b in ${BATCHES:-1 32}; do   # one run a batch, each under its own limit, each writing what it measured
      stamp "batch $b: bf16 pools against the byte formats (v4jax bench kernels --sweep kv_formats --tokens $b)"
      timeout ${SWEEP_S:-200} python3 -W ignore -m v4jax.bench kernels --sweep kv_formats --tokens $b \
        --out "$out/kv_b$b" 2>&1 | quiet | tail -14
    done
  fi
  ;;
repeat)
  imports
  stamp "repeated generate calls: what the second one traces or compiles"
  timeout 100 python3 -W ignore -m v4jax.bench generate --repeat-check --model flash-slice \
    --attention-impl pallas > "$out/repeat.log" 2>&1
  grep "^====\|Compiling\|Error" "$out/repeat.log" | cut -c1-200 | tail -30
  # the same with XLA's command buffers (CUDA graphs) off: a graph is recorded on a thunk's second run
  stamp "again, command buffers off"
  XLA_FLAGS="--xla_gpu_enable_command_buffer=" timeout 100 python3 -W ignore -m v4jax.bench generate \
    --repeat-check --model flash-slice --attention-impl pallas > "$out/repeat_nocb.log" 2>&1
  grep "^====\|Error" "$out/repeat_nocb.log" | cut -c1-200 | tail -10
  [ "${TEST_S:-300}" = 0 ] && exit 0
  stamp "engine GPU test"
  timeout "${TEST_S:-300}" python3 -m pytest -q -m gpu tests/test_engine_gpu.py -p no:cacheprovider > "$out/pytest_gpu.log" 2>&1
  echo "engine gpu test rc=$?"; tail -3 "$out/pytest_gpu.log"
  ;;
tune)
  imports
  stamp "GPU tests of the projection and top-k kernels"
  timeout 150 python3 -m pytest -q -m "$gpu" tests/test_kernels_gpu.py -k "layer_linear or topk or sinkhorn" -p no:cacheprovider \
    2>&1 | tail -3
  if [ "${SWEEP:-1}" = 1 ]; then
    stamp "projection kernel sweep"
    timeout 240 python3 -W ignore -m v4jax.bench kernels --sweep layer_linear --out "$out/ll" 2>&1 | quiet | tail -14
  fi
  stamp "Sinkhorn sweep"
  timeout 120 python3 -W ignore -m v4jax.bench kernels --tune --only sinkhorn --harness trace --repeats 3 \
    --out "$out/sinkhorn" 2>&1 | quiet | grep "sinkhorn M"
  stamp "flash-slice decode at 4K"
  timeout 150 python3 -W ignore -m v4jax.bench decode --model flash-slice --batches 1,32 --contexts 4K --long-b1 "" \
    --hf off --iters 5 --gen-iters 3 --profile --attention-impl pallas --deadline-s 130 --out "$out/slice_4k" 2>&1 \
    | quiet | grep "^|" | tail -4
  summary "$out/slice_4k/decode.json"
  ;;
4k)
  imports
  stamp "GPU kernel tests"
  timeout 240 python3 -m pytest -q -m "$gpu" tests/test_kernels_gpu.py -p no:cacheprovider 2>&1 | tail -3
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
check)
  imports
  # ~9 of the 10 minutes, in order of importance, each under its own time limit: the GPU tests (kernels vs
  # references, engine greedy Pallas == XLA), the kernel table from profiler traces, engine decode at batch 32 / 128K
  # with XLA and with Pallas attention
  timeout 330 python3 -m pytest -q -m "$gpu" tests/test_kernels_gpu.py tests/test_engine_gpu.py -p no:cacheprovider \
    > "$out/pytest_gpu.log" 2>&1; echo "gpu tests rc=$?"; tail -3 "$out/pytest_gpu.log"
  timeout 170 python3 -W ignore -m v4jax.bench kernels --harness trace --repeats 3 --out "$out/k" 2>&1 \
    | grep "pallas\|backend\|MISMATCH"
  for impl in xla pallas; do
    timeout 65 python3 -W ignore -m v4jax.bench decode --attention-impl $impl --batches 32 --contexts 128K \
      --long-b1 "" --hf off --iters 5 --deadline-s 50 --out "$out/d$impl" 2>&1 | quiet | grep "^|" | tail -2
  done
  ;;
depth1)
  imports
  stamp "flash-1gpu generate"
  timeout 200 python3 -W ignore -m v4jax.bench generate --model flash-1gpu --batches 1 --contexts 4K --new 32 \
    --out "$out/g1" 2>&1 | quiet | tail -16
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
  ;;
depth2)
  imports
  stamp "gpu tests"
  timeout 330 python3 -m pytest -q -m "$gpu" tests/test_kernels_gpu.py tests/test_engine_gpu.py -p no:cacheprovider \
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
    --prefill 128K --new 32 --deadline-s 180 --out "$out/g2" 2>&1 | quiet | tail -14
  ;;
serve)
  imports
  # `v4jax serve` and `v4jax bench serve` on one machine, then SIGTERM and a check that the server drained and
  # exited 0 (the variables: see the header)
  MODEL=${MODEL-flash-slice}
  SERVE_ARGS=${SERVE_ARGS:---max-num-seqs 32 --max-model-len 1024 --prefill-chunk 512}
  RATES=${RATES:-8 16}
  BENCH_ARGS=${BENCH_ARGS:---num-requests 160 --prompt-len 512 --output-len 64:256 --vocab 129280}
  WARMUP=${WARMUP:-8}  # requests of the same shapes before the first measured run: they compile its buckets
  PORT=${PORT:-8123}
  wheels
  python3 -c "import jax, fastapi, uvicorn; print('jax', jax.__version__, jax.devices(), 'fastapi', fastapi.__version__)" \
    || exit 1
  stamp "starting v4jax serve ${MODEL:-(default model)}"
  python3 -W ignore -m v4jax.cli serve $MODEL --port "$PORT" --no-access-log $SERVE_ARGS > "$out/server.log" 2>&1 &
  pid=$!
  python3 - "$PORT" "$pid" <<'EOF' || { stamp "server did not come up"; tail -20 "$out/server.log"; kill -9 "$pid"; exit 1; }
import os, sys, time, httpx
port, pid = int(sys.argv[1]), int(sys.argv[2])
deadline = time.monotonic() + 240
while time.monotonic() < deadline:
    try:
        os.kill(pid, 0)
    except OSError:
        sys.exit(1)
    try:
        if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
            sys.exit(0)
    except httpx.HTTPError:
        pass
    time.sleep(0.5)
sys.exit(1)
EOF
  stamp "server up"
  for rate in $RATES; do
    stamp "bench serve: Poisson $rate/s"
    timeout 150 python3 -W ignore -m v4jax.cli bench serve --url "http://127.0.0.1:$PORT" --rate "$rate" $BENCH_ARGS \
      --warmup-requests "$WARMUP" --out "$out/r$rate" 2>&1 | grep -v "^ \|^{\|^}"
    WARMUP=0  # compiled once is enough
  done
  python3 -c "import httpx, sys; open(sys.argv[2], 'w').write(httpx.get(f'http://127.0.0.1:{sys.argv[1]}/metrics').text)" \
    "$PORT" "$out/metrics.txt"
  grep -E "^v4jax_(pool_used_pages|num_requests|request_finished|generation_tokens_total|prompt_tokens_total)" \
    "$out/metrics.txt" | grep -v _created
  stamp "SIGTERM"
  kill -TERM "$pid"
  for _ in $(seq 1 60); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
  if kill -0 "$pid" 2>/dev/null; then stamp "server still running 30 s after SIGTERM"; kill -9 "$pid"; fi
  wait "$pid"; stamp "server exit code $?"
  tail -5 "$out/server.log"
  ;;
pd)
  imports
  # Prefill/decode disaggregation on one GPU, one call (the variables: see the header). Every step has its own limit
  # within BUDGET_S from the stage's start and writes its results as it ends, so a step cut short leaves the ones
  # before it. The servers share one persistent compilation cache: the disaggregated servers load most of what the
  # colocated one compiled (same engine options), and an unmeasured pass of the load (WARM=0 skips it) compiles the
  # rest before the measured one.
  wheels
  export V4JAX_COMPILATION_CACHE=${PD_CACHE:-/tmp/v4jax-pd-cache}
  MODEL=${MODEL-flash-slice}
  STEPS=${STEPS:-transfer colocated disagg}
  # default options but 16 slots of 8448 tokens: a long prompt (8192) and its output in 33 pages, a short one in 4
  # (few page buckets: few programs to compile)
  ENGINE_ARGS=${ENGINE_ARGS:---max-num-seqs 16 --max-model-len 8448}
  PD_ARGS=${PD_ARGS:---prompt-len 4096 16384 32768 --prefill-chunk 8192 --repeats 3}
  # 8 short streams at a time (a closed loop: a slot freed is taken again at once), 6 long prompts at 1/s among them
  LOAD_ARGS=${LOAD_ARGS:---num-requests 48 --max-concurrency 8 --rate inf --prompt-len 512 --output-len 256:480 \
--vocab 129280 --long-num 6 --long-rate 1 --long-start 0.5 --long-prompt-len 8192 --long-output-len 8}
  TRANSPORT=${TRANSPORT:-auto}  # auto: jax, unless bench pd's jax rows failed here
  PORT=${PORT:-8130}  # the colocated server and the router; the prefill server +1, the decode server +2
  pdlogs=/tmp/v4jax-pd-logs; rm -rf "$pdlogs"; mkdir -p "$pdlogs"
  lim() { local l=$(( ${BUDGET_S:-540} - $(date +%s) + t0 )); [ "$l" -gt "$1" ] && l=$1; echo $(( l > 1 ? l : 1 )); }
  wait_up() {  # URL PID SECONDS: /health answers 200 while PID lives
    python3 - "$@" <<'EOF'
import os, sys, time, httpx
url, pid, limit = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
deadline = time.monotonic() + limit
while time.monotonic() < deadline:
    try:
        os.kill(pid, 0)
    except OSError:
        sys.exit(1)
    try:
        if httpx.get(url + "/health", timeout=2).status_code == 200:
            sys.exit(0)
    except httpx.HTTPError:
        pass
    time.sleep(0.5)
sys.exit(1)
EOF
  }
  stop() {  # SIGTERM, 30 s to drain, then SIGKILL; each one's exit code
    for p in "$@"; do kill -TERM "$p" 2>/dev/null; done
    for p in "$@"; do
      for _ in $(seq 1 60); do kill -0 "$p" 2>/dev/null || break; sleep 0.5; done
      kill -0 "$p" 2>/dev/null && { echo "  $p still running 30 s after SIGTERM"; kill -9 "$p"; }
      wait "$p"; echo "  pid $p exit code $?"
    done
  }
  compiled() {  # ENGINE_URL...: each engine server's step programs compiled so far, and their seconds (/metrics)
    python3 - "$@" <<'EOF'
import sys, httpx
for url in sys.argv[1:]:
    try:
        text = httpx.get(url + "/metrics", timeout=5).text
    except httpx.HTTPError as e:
        print(f"  {url}: /metrics failed ({e})"); continue
    got = {l.split()[0]: float(l.split()[1]) for l in text.splitlines() if l.startswith("v4jax_program")}
    print(f"  {url}: {got.get('v4jax_programs_compiled_total', 0):.0f} programs compiled, "
          f"{got.get('v4jax_program_compile_seconds_total', 0):.1f} s")
EOF
  }
  drive() {  # NAME URL ENGINE_URL...: the unmeasured pass (another seed), then the measured one -> $out/pd_NAME.json
    local name=$1 target=$2; shift 2
    if [ "${WARM:-1}" = 1 ]; then
      stamp "$name: unmeasured pass"
      timeout "$(lim ${WARM_S:-240})" python3 -W ignore -m v4jax.cli bench serve --url "$target" $LOAD_ARGS --seed 1 \
        --out "$pdlogs/warm_$name" > "$pdlogs/warm_$name.log" 2>&1; echo "  rc=$?"
    fi
    compiled "$@"  # a count that grows during the measured pass is a compile every stream waited for
    stamp "$name: measured pass"
    timeout "$(lim ${LOAD_S:-120})" python3 -W ignore -m v4jax.cli bench serve --url "$target" $LOAD_ARGS \
      --out "$pdlogs/$name" > "$pdlogs/load_$name.log" 2>&1; echo "  rc=$?"
    compiled "$@"
    grep "^|\|^errors\|Error\|^programs compiled" "$pdlogs/load_$name.log"
    cp "$pdlogs/$name/serve_bench.json" "$out/pd_$name.json" 2>/dev/null || echo "  no results for $name"
  }
  url=http://127.0.0.1
  rm -f "$out"/pd_bench.json "$out"/pd_colocated.json "$out"/pd_disagg.json
  for step in $STEPS; do
    case $step in
    transfer)
      stamp "bench pd $PD_ARGS, transports jax and http"
      timeout "$(lim ${PD_S:-200})" python3 -W ignore -m v4jax.cli bench pd ${MODEL:+--model $MODEL} --path jax http \
        $PD_ARGS --out "$out" > "$pdlogs/bench_pd.log" 2>&1; echo "  rc=$?"
      grep "^| [a-z0-9]* | [0-9]\|^model\|Error" "$pdlogs/bench_pd.log" | grep -v "| total |\|^| [0-9]* | [a-z]" \
        | head -30
      ;;
    colocated)
      stamp "colocated: v4jax serve ${MODEL:-(default model)} $ENGINE_ARGS"
      python3 -W ignore -m v4jax.cli serve $MODEL --port "$PORT" --no-access-log $ENGINE_ARGS \
        > "$pdlogs/colocated.log" 2>&1 &
      pid=$!
      if wait_up "$url:$PORT" "$pid" "$(lim 180)"; then
        stamp "server up"; drive colocated "$url:$PORT" "$url:$PORT"
      else
        stamp "server did not come up"; tail -n 20 "$pdlogs/colocated.log"
      fi
      stop "$pid"
      ;;
    disagg)
      if [ "$TRANSPORT" = auto ]; then
        TRANSPORT=$(python3 -c "import json, sys
try:
    rows = json.load(open(sys.argv[1]))['rows']
except OSError:
    rows = []
print('http' if any(r['path'] == 'jax' and r['error'] for r in rows) else 'jax')" "$out/pd_bench.json")
      fi
      stamp "disaggregated: a prefill and a decode server (transport $TRANSPORT) behind a router, on one GPU"
      for role in prefill decode; do
        p=$(( PORT + $([ $role = prefill ] && echo 1 || echo 2) ))
        # two processes on one GPU: each allocates as it goes, within its share
        XLA_PYTHON_CLIENT_MEM_FRACTION=${PD_MEM_FRACTION:-0.45} python3 -W ignore -m v4jax.cli serve $MODEL \
          --port "$p" --no-access-log $ENGINE_ARGS --disaggregation-mode $role --pd-transport "$TRANSPORT" \
          > "$pdlogs/$role.log" 2>&1 &
        eval "pid_$role=$!"
      done
      python3 -W ignore -m v4jax.cli router --prefill "$url:$((PORT + 1))" --decode "$url:$((PORT + 2))" \
        --port "$PORT" --log-level warning > "$pdlogs/router.log" 2>&1 &
      pid_router=$!
      if wait_up "$url:$((PORT + 1))" "$pid_prefill" "$(lim 180)" \
          && wait_up "$url:$((PORT + 2))" "$pid_decode" "$(lim 180)" && wait_up "$url:$PORT" "$pid_router" "$(lim 30)"
      then
        stamp "servers up"; drive disagg "$url:$PORT" "$url:$((PORT + 1))" "$url:$((PORT + 2))"
        python3 -c "import httpx, sys; print(httpx.get(sys.argv[1] + '/metrics').text)" "$url:$((PORT + 2))" \
          | grep -E "^v4jax_pd_transfer" | grep -v "_created\|_bucket" | head -12
      else
        stamp "servers did not come up"; tail -n 15 "$pdlogs/prefill.log" "$pdlogs/decode.log" "$pdlogs/router.log"
      fi
      stop "$pid_router" "$pid_prefill" "$pid_decode"
      ;;
    *) echo "pd: unknown step $step (transfer, colocated, disagg)" ;;
    esac
  done
  for f in "$pdlogs"/*.log; do echo "== $f"; tail -n 25 "$f"; done > "$out/pd_logs.txt"
  python3 - "$out" <<'EOF' | tee "$out/pd.md"
import json, os, sys
from v4jax.bench import pd, serve
out = sys.argv[1]
load = lambda name: json.load(open(os.path.join(out, name))) if os.path.exists(os.path.join(out, name)) else None
b = load("pd_bench.json")
if b:
    print(f"Transfer ({b['model']}, {b['dtype']}, median of {b['repeats']}):\n")
    print(pd.markdown(b["sizes"], b["rows"]) + "\n")
runs = [(label, r) for label, r in (("colocated", load("pd_colocated.json")),
                                    ("disaggregated", load("pd_disagg.json"))) if r]
if runs:
    print(f"Load: {runs[0][1]['load']}\n")
    print(serve.class_table(runs))
EOF
  ;;
multigpu)
  imports
  # decode on N = 2 / 4 / 8 GPUs against one (v4jax bench mesh), one device call per machine kind
  export NCCL_NVLS_ENABLE=0
  case ${2:-2} in
  2) meshes="tensor=2;expert=2;data=2" ;;
  4) meshes="tensor=4;expert=4;data=2,tensor=2" ;;
  8) meshes="tensor=8;expert=8;data=2,tensor=2,expert=2;data=4,tensor=2" ;;
  *) echo "multigpu: N is 2, 4 or 8"; exit 2 ;;
  esac
  for model in flash-slice flash-1gpu; do
    timeout 280 python3 -W ignore -m v4jax.bench mesh --model $model --meshes "$meshes" --batches 1,32,128 \
      --context 4096 --new 32 --out "$out/mesh_$model" 2>&1 | grep "^|\|x gpu\|Error" | tail -16
  done
  ;;
ncu)
  imports
  # Nsight Compute on the sparse attention and indexer kernels (the H200 machine is Firecracker, where ncu reads the
  # hardware counters): registers, spills (local-memory sectors), global-load sectors per request (is the row
  # gather vectorised?), DRAM bytes and time, occupancy and stall reasons
  metrics=gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,launch__registers_per_thread,\
l1tex__t_sectors_pipe_lsu_mem_local_op_ld.sum,l1tex__t_sectors_pipe_lsu_mem_local_op_st.sum,\
l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum,l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum,\
smsp__inst_executed.sum,sm__warps_active.avg.pct_of_peak_sustained_active,launch__grid_size,launch__block_size,\
launch__shared_mem_per_block_dynamic,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active
  ncu_run() {  # name, kernel regex, launches, arguments of v4jax bench kernels...
    local name=$1 regex=$2 count=$3; shift 3
    timeout 200 ncu --clock-control none -k "regex:$regex" --launch-count "$count" --metrics "$metrics" \
      --section WarpStateStats python3 -W ignore -m v4jax.bench kernels "$@" > "$out/ncu_$name.txt" 2>&1
    echo "$name rc=$?"; grep -E "^  [a-z_]+.*\(|gpu__time|registers|local_op|global_op|dram__bytes|Stall|warps_active|hmma" \
      "$out/ncu_$name.txt" | head -60
  }
  # NCU="attention indexer experts_fp4" picks (default: the first two); experts_fp4: the FP4 experts kernels at 16
  # experts and one token in the form routed_experts_fp4 picks there (FP4_FORM=experts: the expert-a-program form)
  for what in ${NCU:-attention indexer}; do
    case $what in
      attention) ncu_run attention "sparse" 4 --tune --only attention --harness trace --repeats 1 \
        --attention-configs 64:16:4:2:1 32:64:8:2:1 32:16:4:3:1 16:64:4:2:1 ;;
      indexer) ncu_run indexer "indexer" 2 --only indexer --harness trace --repeats 1 ;;
      # experts_fp4: its own process (the sweep's profiler trace and ncu both take CUPTI: the process crashed)
      experts_fp4)
        timeout 200 ncu --clock-control none -k "regex:experts_(up|down)_fp4" --launch-count 2 --metrics "$metrics" \
          --section WarpStateStats --section MemoryWorkloadAnalysis --section LaunchStats python3 -W ignore - \
          > "$out/ncu_experts_fp4.txt" 2>&1 <<'EOF'
import os
import jax
from pallas_kernels import experts as X
from v4jax.bench.sweeps import experts_case
from v4jax.model import quant
x, wt, ex, w1, w2, w3 = experts_case(1, 6, 16, 2048, 4096)
st = [quant.quantize(w, "fp4") for w in (w1, w2, w3)]
f = jax.jit(lambda x, wt, ex, a1, a2, a3: X.routed_experts_fp4(
    x, wt, ex, a1, a2, a3, 10.0, lambda h, w: quant.fp8_roundtrip((h * w).astype(jax.numpy.bfloat16), 128),
    form=os.environ.get("FP4_FORM", "auto")))
for _ in range(3):
    jax.block_until_ready(f(quant.fp8_roundtrip(x, 128), wt, ex, *st))
EOF
        echo "experts_fp4 rc=$?"; grep -E "^  [a-z_]+.*\(|gpu__time|registers|local_op|global_op|dram__bytes|Stall|\
warps|Throughput|Occupancy|Duration|Waves|Theoretical" "$out/ncu_experts_fp4.txt" | head -80 ;;
    esac
  done
  ;;
*)
  sed -n '2,/^set -u/p' "$0" | sed '$d'
  exit 2
  ;;
esac
stamp done
