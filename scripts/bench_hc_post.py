"""mHC's expansion: the XLA form (a per-token [4, 4] x [4, D] matmul, v4jax.model.layers.hc_post) against the Pallas kernel
(pallas_kernels/hc_post.py, over a few block shapes), at decode batches and on a prefill chunk of Flash's width,
bf16: wall time per call (median) and, on a GPU, kernel time and launches per call from a profiler trace, with the
bandwidth the bytes (f and x read, the output written) allow (v4jax.bench.profile.time_call). The same inputs
every call: at decode sizes they sit in the L2, as in the model, where the previous kernel has just written them;
a prefill chunk's 600 MB do not.

  python scripts/bench_hc_post.py --out $OUT/hc_post          (H200, ~1 min)
  python scripts/bench_hc_post.py --small --out /tmp/hc_post  (CPU smoke test: interpret mode)
"""
import argparse
import functools
import json
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from pallas_kernels import hc_post as HP  # noqa: E402
from v4jax.model import layers as L  # noqa: E402
from v4jax.bench.profile import said, time_call  # noqa: E402


BLOCKS = [(16, 128, 4), (32, 128, 4), (16, 256, 8), (8, 512, 8)]  # (tokens, columns, warps) per program


def inputs(m, d):
    k = jax.random.split(jax.random.key(m), 4)
    f = jax.random.normal(k[0], (m, d), jnp.bfloat16)
    x = jax.random.normal(k[1], (m, 4, d), jnp.bfloat16)
    post = 2 * jax.nn.sigmoid(jax.random.normal(k[2], (m, 4)))
    comb = jax.nn.softmax(jax.random.normal(k[3], (m, 4, 4)), axis=-1)
    return f, x, post, comb


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--small", action="store_true")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    d = 256 if a.small else 4096
    rows = []
    for m in ((1, 5) if a.small else (1, 32, 8192)):
        args = inputs(m, d)
        mb = m * 9 * d * 2 / 1e6  # f and x read, the output written
        row = {"tokens": m, "D": d, "MB_per_call": mb}
        variants = [("xla", L.hc_post)] + [
            (f"pallas {bm}x{bd} w{w}", functools.partial(HP.hc_post, block_tokens=bm, block_d=bd, num_warps=w))
            for bm, bd, w in (BLOCKS[:1] if a.small else BLOCKS)]
        for name, fn in variants:
            run = jax.jit(fn)
            row[name] = time_call(lambda run=run: run(*args), 3 if a.small else 10, mb=mb)
        rows.append(row)
        print(f"tokens {m}: " + "; ".join(said(n, row[n]) for n, _ in variants), flush=True)
        with open(os.path.join(a.out, "bench_hc_post.json"), "w") as fh:
            json.dump({"rows": rows, "device": str(jax.devices()[0])}, fh, indent=1, default=str)


if __name__ == "__main__":
    main()
