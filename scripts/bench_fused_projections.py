"""Does one launch per group of decode projections that share an input beat one launch per projection? (It did:
the ops table's `project` runs them so.)

A Flash decode step launched `pallas_kernels/layer_linear.py` ~10 times per layer, and each launch of a narrow
projection is followed by an XLA sum of its split-D partials; run K's profile put the projections at 2.9 TB/s
against 3.65 for a copy, and ~300 small kernels per flash-slice step. This measures, on the Flash shapes, a
group of projections of one input (a CSA layer's wq_a, wkv and the two compressors' wkv / wgate; the shared
expert's w1 / w3) as separate launches on separate layer stacks (today's form) against one launch on the stacks
concatenated along the outputs (what loading the checkpoint into concatenated stacks would give) and one launch
on the separate stacks (`layer_linears`: a program picks its weight by its block index), each over a
stack of layers one after another (HBM, not L2), at 1 and 32 tokens: wall time per layer (median of calls) and,
on a GPU, kernel time and launches per layer from a profiler trace (v4jax.bench.profile.time_call).

  python scripts/bench_fused_projections.py --out $OUT/fused        (H200, ~1 min)
  python scripts/bench_fused_projections.py --small --out /tmp/fused  (CPU smoke test: interpret mode)
"""
import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp
from jax import lax

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from pallas_kernels import layer_linear as LL  # noqa: E402
from v4jax.bench.profile import said, time_call  # noqa: E402

D = 4096
# (group, [(projection, O)]) of one Flash layer's decode step that read the same [tokens, D] input
GROUPS = [("CSA attention input", [("wq_a", 1024), ("wkv", 512), ("compressor wkv", 1024), ("compressor wgate", 1024),
                                   ("indexer compressor wkv", 256), ("indexer compressor wgate", 256)]),
          ("HCA attention input", [("wq_a", 1024), ("wkv", 512), ("compressor wkv", 512), ("compressor wgate", 512)]),
          ("shared expert", [("w1", 2048), ("w3", 2048)])]


def stacks(outs, d, m, small):
    total = sum(outs)
    layers = 2 if small else max(4, -(-(512 << 20) // (total * d * 2)))  # >= 512 MB per variant: past the L2
    key = jax.random.split(jax.random.key(total + m), len(outs) + 1)
    sep = [(0.05 * jax.random.normal(k, (layers, o, d), jnp.float32)).astype(jnp.bfloat16)
           for k, o in zip(key[1:], outs)]
    cat = jnp.concatenate(sep, axis=1)
    x = jax.random.normal(key[0], (m, d), jnp.bfloat16)
    return x, sep, cat, layers


def separate(x, sep, layers):
    def body(i, acc):
        return acc + sum(jnp.sum(LL.layer_linear(x, w, i)[:, :8], axis=0) for w in sep)
    return lax.fori_loop(0, layers, body, jnp.zeros((8,), jnp.float32))


def fused(x, cat, outs, layers):
    def body(i, acc):
        y = LL.layer_linear(x, cat, i)
        starts = [sum(outs[:j]) for j in range(len(outs))]
        return acc + sum(jnp.sum(y[:, s:s + 8], axis=0) for s in starts)
    return lax.fori_loop(0, layers, body, jnp.zeros((8,), jnp.float32))


def multi(x, sep, layers):
    def body(i, acc):
        return acc + sum(jnp.sum(y[:, :8], axis=0) for y in LL.layer_linears(x, sep, i))
    return lax.fori_loop(0, layers, body, jnp.zeros((8,), jnp.float32))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--small", action="store_true")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    d = 256 if a.small else D
    groups = [(g, [(n, o // 16) for n, o in p]) for g, p in GROUPS[:1]] if a.small else GROUPS
    rows = []
    for (group, projs), m in [(g, m) for g in groups for m in ((1,) if a.small else (1, 32))]:
        outs = [o for _, o in projs]
        x, sep, cat, layers = stacks(outs, d, m, a.small)
        mb = sum(outs) * d * 2 / 1e6
        f_sep = jax.jit(lambda x, sep: separate(x, sep, layers))
        f_cat = jax.jit(lambda x, cat: fused(x, cat, outs, layers))
        f_multi = jax.jit(lambda x, sep: multi(x, sep, layers))
        ref, got = f_sep(x, sep), f_cat(x, cat)  # equal to rounding (the split of D follows the output count)
        row = {"group": group, "projections": [n for n, _ in projs], "outs": outs, "D": d, "tokens": m,
               "layers": layers, "MB_per_layer": mb, "max_abs_diff": float(jnp.max(jnp.abs(ref - got))),
               "max_abs_diff_multi": float(jnp.max(jnp.abs(ref - f_multi(x, sep))))}
        variants = (("separate", lambda: f_sep(x, sep)), ("fused", lambda: f_cat(x, cat)),
                    ("multi", lambda: f_multi(x, sep)))
        for name, fn in variants:
            row[name] = time_call(fn, 3 if a.small else 20, per=layers, mb=mb)
        rows.append(row)
        print(f"{group} x{m} ({mb:.0f} MB/layer), per layer: " + "; ".join(said(n, row[n]) for n, _ in variants),
              flush=True)
        with open(os.path.join(a.out, "bench_fused_projections.json"), "w") as f:
            json.dump({"rows": rows, "device": str(jax.devices()[0])}, f, indent=1, default=str)


if __name__ == "__main__":
    main()
