"""GPU kernel time of the decode projections (`pallas_kernels/layer_linear.py`) over its block sizes, warps, stages
and split-K target, for the Flash projection shapes at 1 and 32 tokens, from a profiler trace. Each case reads a
stack of layers one after another (as the layer scan does), so that the weights come from HBM, not L2; bytes =
one layer's weight. Writes the table and the best config per case.

  python scripts/bench_layer_linear.py --out $OUT/ll            (H200, ~3 min)
  python scripts/bench_layer_linear.py --small --out /tmp/ll    (CPU smoke test: interpret mode, two configs)
"""
import argparse
import itertools
import json
import os
import sys

import jax
import jax.numpy as jnp
from jax import lax

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from pallas_kernels import layer_linear as LL  # noqa: E402
from v4jax.bench.profile import summarize  # noqa: E402

# (name, O, D, groups) of the Flash projections a decode step runs per layer
# (wkv [512, 4096] and the indexer's wq_b [8192, 1024] have the shapes of the first and third, halved / quartered)
SHAPES = [("wq_a / compressor", 1024, 4096, 1), ("wq_b", 32768, 1024, 1), ("wo_a (8 groups)", 8192, 4096, 8),
          ("wo_b", 4096, 8192, 1), ("shared w1 / w3", 2048, 4096, 1), ("shared w2", 4096, 2048, 1)]


def stack_for(o, d, groups, m, small):
  layers = 2 if small else max(4, -(-(256 << 20) // (o * d * 2)))  # >= 256 MB per stack: more than the L2
  k = jax.random.split(jax.random.key(o + d + m), 2)
  w = (0.05 * jax.random.normal(k[0], (layers, o, d), jnp.float32)).astype(jnp.bfloat16)
  x = jax.random.normal(k[1], (m, groups, d) if groups > 1 else (m, d), jnp.bfloat16)
  return x, w, layers


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", required=True)
  ap.add_argument("--small", action="store_true")
  a = ap.parse_args()
  os.makedirs(a.out, exist_ok=True)
  if a.small:
    shapes, tokens = [("small", 64, 256, 1), ("small grouped", 64, 256, 2)], [1]
    configs = [(16, 128, 4, 2, 264), (32, 128, 4, 2, 132)]
  else:
    shapes, tokens = SHAPES, [1, 32]
    configs = list(itertools.product([16, 32, 64], [256, 512, 1024], [4, 8], [2], [264])) + \
        [(16, 512, 4, 3, 264), (32, 256, 4, 3, 264), (16, 512, 4, 2, 132), (16, 512, 4, 2, 528),
         (32, 256, 4, 2, 132), (32, 256, 4, 2, 528)]
  rows, best = [], {}
  for (name, o, d, g), m in itertools.product(shapes, tokens):
    x, w, layers = stack_for(o, d, g, m, a.small)
    mb = o * d * 2 / 1e6
    for r, c, nw, ns, mp in configs:
      def run(x, w, r=r, c=c, nw=nw, ns=ns, mp=mp):
        def body(i, acc):
          y = LL.layer_linear(x, w, i, g, rows=r, cols=c, num_warps=nw, num_stages=ns, min_programs=mp)
          return acc + y.reshape(-1)[:8].astype(jnp.float32)
        return lax.fori_loop(0, layers, body, jnp.zeros((8,), jnp.float32))
      fn = jax.jit(run)
      cfg = f"rows {r} cols {c} warps {nw} stages {ns} programs {mp}"
      try:
        s = summarize(lambda: jax.block_until_ready(fn(x, w)), repeats=2, top=4)
      except Exception as e:  # a block shape Triton refuses: say so, go on
        rows.append({"shape": name, "tokens": m, "config": cfg, "error": str(e)[:200]})
        continue
      if "kernel_ms" not in s:
        rows.append({"shape": name, "tokens": m, "config": cfg, **s})
        continue
      us = s["kernel_ms"] * 1e3 / layers
      row = {"shape": name, "O": o, "D": d, "groups": g, "tokens": m, "config": cfg, "us_per_layer": us,
             "GB/s": mb / us * 1e3, "kernels_per_layer": s["kernels"] / layers}
      rows.append(row)
      key = f"{name} x{m}"
      if key not in best or us < best[key]["us_per_layer"]:
        best[key] = row
      print(f"{key}: {cfg}: {us:.1f} us, {mb / us * 1e3:.0f} GB/s", flush=True)
    save(a.out, rows, best)
  save(a.out, rows, best)
  print("best per case:")
  for k, r in best.items():
    print(f"  {k}: {r['config']}: {r['us_per_layer']:.1f} us, {r['GB/s']:.0f} GB/s")


def save(out, rows, best):  # after every case: a call cut short by its time limit keeps what it measured
  with open(os.path.join(out, "bench_layer_linear.json"), "w") as f:
    json.dump({"rows": rows, "best": best, "device": str(jax.devices()[0])}, f, indent=1)


if __name__ == "__main__":
  main()
