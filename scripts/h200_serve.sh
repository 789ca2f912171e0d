#!/usr/bin/env bash
# One device call: `v4jax serve` and `v4jax bench serve` on one machine, then SIGTERM and a check that the server
# drained and exited 0. Carry the server's wheels (.whl: fastapi, starlette, uvicorn, pydantic, pydantic-core,
# ... as BENCHMARKS.md "Serving" lists; the image has none of them, or other versions).
# Usage (device tool, carry [".whl"]):  bash scripts/h200_serve.sh
#   -> $OUT/server.log, $OUT/metrics.txt, $OUT/r<RATE>/serve_bench.{md,json} per rate
# Local dry run (CPU, the default model):
#   SKIP_WHEELS=1 MODEL= SERVE_ARGS="--max-model-len 512" RATES="4" WARMUP=4 BENCH_ARGS="--num-requests 16 \
#   --prompt-len 32 --output-len 16 --vocab 2048" bash scripts/h200_serve.sh
set -u
out=${OUT:-./h200_out}
mkdir -p "$out"
MODEL=${MODEL-flash-slice}
SERVE_ARGS=${SERVE_ARGS:---max-num-seqs 32 --max-model-len 1024 --prefill-chunk 512}
RATES=${RATES:-8 16}
BENCH_ARGS=${BENCH_ARGS:---num-requests 160 --prompt-len 512 --output-len 64:256 --vocab 129280}
WARMUP=${WARMUP:-8}  # requests of the same shapes before the first measured run: they compile its buckets
PORT=${PORT:-8123}
t0=$(date +%s)
say() { echo "[$(( $(date +%s) - t0 ))s] $*"; }

if [ -z "${SKIP_WHEELS:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "wheel install failed"; exit 1; }
  export PYTHONPATH=/tmp/site:.
else
  export PYTHONPATH=.
fi
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
python3 -c "import jax, fastapi, uvicorn; print('jax', jax.__version__, jax.devices(), 'fastapi', fastapi.__version__)" \
  || exit 1

say "starting v4jax serve ${MODEL:-(default model)}"
python3 -W ignore -m v4jax.cli serve $MODEL --port "$PORT" --no-access-log $SERVE_ARGS > "$out/server.log" 2>&1 &
pid=$!
python3 - "$PORT" "$pid" <<'EOF' || { say "server did not come up"; tail -20 "$out/server.log"; kill -9 "$pid"; exit 1; }
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
say "server up"

for rate in $RATES; do
  say "bench serve: Poisson $rate/s"
  timeout 150 python3 -W ignore -m v4jax.cli bench serve --url "http://127.0.0.1:$PORT" --rate "$rate" $BENCH_ARGS \
    --warmup-requests "$WARMUP" --out "$out/r$rate" 2>&1 | grep -v "^ \|^{\|^}"
  WARMUP=0  # compiled once is enough
done

python3 -c "import httpx, sys; open(sys.argv[2], 'w').write(httpx.get(f'http://127.0.0.1:{sys.argv[1]}/metrics').text)" \
  "$PORT" "$out/metrics.txt"
grep -E "^v4jax_(pool_used_pages|num_requests|request_finished|generation_tokens_total|prompt_tokens_total)" \
  "$out/metrics.txt" | grep -v _created

say "SIGTERM"
kill -TERM "$pid"
for _ in $(seq 1 60); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
if kill -0 "$pid" 2>/dev/null; then say "server still running 30 s after SIGTERM"; kill -9 "$pid"; fi
wait "$pid"; say "server exit code $?"
tail -5 "$out/server.log"
