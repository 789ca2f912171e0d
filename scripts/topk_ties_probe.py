"""How the indexer's scores meet the GPU top-k's compaction (pallas_kernels.topk._topk_threshold): the threshold
tau is the k-th largest of 4k strided group maxima, and a row with more than 2k scores >= tau takes the exact redo,
one program scanning the row ~35 times (185 us a CSA layer a step on an H100 at 128K, against ~1 us otherwise).

  python scripts/topk_ties_probe.py                  # the decode bench's synthetic FP4 key pool, random queries:
                                                     # the GPU kernel's scores (on a GPU) and the reference's
  python scripts/topk_ties_probe.py --engine flash-slice --context 131072 [--kv-cache-dtype fp8]
                                                     # the scores a decode step of the decode bench's engine
                                                     # (random weights, synthetic pools) hands its top-k (XLA ops)
  python scripts/topk_ties_probe.py --engine flash-slice --forward 1024   # the full forward's index_scores inputs

Per row: distinct scores, the most repeated value and its count, zeros, tau, the scores >= tau against the buffer.
"""
import argparse

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import indexer as ix
from pallas_kernels import kv_format as F
from pallas_kernels import topk as T


def report(name, x, kk=512):
    x = x[np.isfinite(x)]
    s = x.shape[0]
    ng, cap = T._threshold_params(s, kk)
    if s <= 2 * ng:
        print(name, f"{s} scores: the sort path (no threshold)", flush=True)
        return
    c = -(-s // ng)
    g = np.pad(x, (0, c * ng - s), constant_values=-np.inf).reshape(c, ng).max(0)
    tau = np.sort(g)[::-1][kk - 1]
    vals, counts = np.unique(x, return_counts=True)
    print(name, "scores", s, "distinct", len(vals), "most repeated", int(counts.max()), "at", vals[counts.argmax()],
          "zeros", int(np.sum(x == 0)), "tau", tau, ">= tau", int(np.sum(x >= tau)), "buffer", cap, flush=True)


def synthetic():
    from v4jax.bench.decode import _random_like
    from v4jax.model import quant
    s, di, hi = 32768, 128, 64
    fmt = F.Fp4Key(di)
    for seed in range(2):
        pool = _random_like((2 * s, fmt.nbytes), np.uint8, 1000, seed, (di // 2, 0, di // 32))
        rng = np.random.default_rng(seed)
        q = jnp.asarray(rng.standard_normal((1, 1, hi, di)), jnp.float32)
        q = quant.fp4_roundtrip(quant.hadamard_rotate(q), 32).astype(jnp.bfloat16)
        w = jnp.asarray(rng.standard_normal((1, 1, hi)), jnp.float32)
        rows, nv = jnp.arange(s)[None] + s, jnp.array([[s]], jnp.int32)
        for name, f in (("kernel", ix.indexer_scores), ("reference", ix.indexer_scores_ref)):
            x = jax.jit(lambda q, w, p, r, n: f(q, w, p, r, n, key_format=fmt))(q, w, pool, rows, nv)
            report(f"seed {seed} {name} ({jax.default_backend()}):", np.asarray(x[0, 0]))


def model_of(name: str, quantization: str):
    from flax import nnx

    from v4jax.config import preset
    from v4jax.model import Transformer, quant
    cfg = preset(name)
    weights = quant.RELEASE if quantization == "fp8" else quant.DEQUANTIZED
    return cfg, Transformer(cfg, rngs=nnx.Rngs(0), dtype=jnp.bfloat16, mtp=False, weights=weights)


def watch_scores():
    """Print the magnitudes each index_scores call gets (queries, head weights, keys)."""
    from v4jax.model import layers as L
    index_scores = L.index_scores

    def scored(iq, w, keys):
        jax.debug.print("index_scores: |q| max {a} (nonzero {n}), |w| max {b}, |keys| max {c}, keys nonzero {d}",
                        a=jnp.max(jnp.abs(iq.astype(jnp.float32))), n=jnp.sum(iq != 0),
                        b=jnp.max(jnp.abs(w)), c=jnp.max(jnp.abs(keys.astype(jnp.float32))), d=jnp.sum(keys != 0))
        out = index_scores(iq, w, keys)
        last = jnp.sort(out[0, -1])[::-1]  # the last query's scores, descending (its causal mask is all ones)
        top = last[:min(1024, last.shape[0])]
        jax.debug.print("  last query: {s} scores, zeros {z}, ties among its top {n}: {t}, top {a} .. {b}",
                        s=last.shape[0], z=jnp.sum(last == 0), n=top.shape[0], t=jnp.sum(top[1:] == top[:-1]),
                        a=top[0], b=top[-1])
        return out

    L.index_scores = scored


def forward(model: str, tokens: int, kv: str, quantization: str):
    """The full-sequence forward over random tokens with the keys rounded as the cache stores them."""
    from v4jax.model.layers import RunOptions
    watch_scores()
    cfg, m = model_of(model, quantization)
    ids = jnp.asarray(np.random.default_rng(0).integers(2, cfg.vocab_size, (1, tokens)), jnp.int32)
    jax.block_until_ready(m(ids, RunOptions(cache_dtype=kv if kv == "fp8" else None)))


def engine(model: str, context: int, kv: str, quantization: str):
    from v4jax.bench.decode import JaxDecodeBench
    from v4jax.model.layers import RunOptions
    got = []
    top_k = jax.lax.top_k

    def capture(x, k):  # the XLA ops' selection: lax.top_k over [B, T, S] scores
        jax.debug.callback(lambda a: got.append(np.asarray(a)), x)
        return top_k(x, k)

    jax.lax.top_k = capture
    watch_scores()
    cfg, m = model_of(model, quantization)
    bench = JaxDecodeBench(cfg, m, RunOptions(attention_impl="xla"), 1, context, 1, 0, kv)
    eng = bench.engine
    state, pt, swa = bench.decode_args(context - 2, np.random.default_rng(0))
    jax.block_until_ready(eng.steps.decode(eng.greedy_spec, eng._leaves, eng.pools, eng.store, state, pt, swa))
    for i, a in enumerate(got):
        for b in range(a.shape[0]):
            report(f"call {i} row {b}:", a[b].reshape(-1, a.shape[-1])[-1])


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", default=None, help="a preset: its decode step's scores instead of the synthetic ones")
    ap.add_argument("--forward", type=int, default=0, help="with --engine: instead, the full-sequence forward of "
                    "this many random tokens (what index_scores gets in each CSA layer)")
    ap.add_argument("--context", type=int, default=131072)
    ap.add_argument("--kv-cache-dtype", default="fp8", choices=("auto", "fp8"))
    ap.add_argument("--quantization", default="none", choices=("none", "fp8"))
    a = ap.parse_args()
    if a.engine and a.forward:
        forward(a.engine, a.forward, a.kv_cache_dtype, a.quantization)
    elif a.engine:
        engine(a.engine, a.context, a.kv_cache_dtype, a.quantization)
    else:
        synthetic()
