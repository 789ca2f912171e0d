#!/bin/bash
# The CPU server (default model, 8 slots, chunk 64) under 24 streams of 160 tokens with 4 long prompts arriving
# among them; one tree a run. usage: VENV=/path/to/venv serve_ab.sh TREE NAME PORT
tree=$1; name=$2; port=$3
cd "$tree"
. "${VENV:-.venv}/bin/activate"
PYTHONPATH=. python -W ignore -m v4jax.cli serve --max-model-len 1024 --prefill-chunk 64 --port $port --no-access-log > /tmp/serve_$name.log 2>&1 &
pid=$!
for i in $(seq 1 120); do curl -sf http://127.0.0.1:$port/health >/dev/null && break; sleep 2; done
PYTHONPATH=. python -W ignore -m v4jax.cli bench serve --url http://127.0.0.1:$port --num-requests 24 --max-concurrency 8 \
  --rate inf --prompt-len 32 --output-len 160 --vocab 2048 --warmup-requests 4 \
  --long-num 4 --long-rate 1 --long-prompt-len 768 --long-output-len 8 --long-start 1 --out /tmp/serve_$name > /tmp/bench_$name.txt 2>&1
echo "rc=$?" >> /tmp/bench_$name.txt
kill $pid; wait $pid 2>/dev/null
