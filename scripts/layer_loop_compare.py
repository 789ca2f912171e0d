"""Compare the two ways the model can run its layer stack (RunOptions.layer_loop): "periods" (scans over the
repeating periods of the layer pattern, irregular head / tail unrolled) and "switch" (one scan over every layer,
a lax.switch on its stack). For each: compile time (lower + compile) and median run time of the cached decode
step (the engine's hot program) and of the full-sequence forward, at the real Flash pattern (2 sliding layers,
then CSA / HCA alternating) and a given depth.

    python scripts/layer_loop_compare.py [--layers 24] [--preset tiny] [--batch 4] [--reps 20]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, ".")
from v4jax import cache as C  # noqa: E402
from v4jax.config import CSA, HCA, SLIDING, preset  # noqa: E402
from v4jax.model import RunOptions, Transformer  # noqa: E402


def flash_pattern(name: str, n: int):
    base = preset(name)
    kinds = (SLIDING, SLIDING) + tuple(CSA if i % 2 == 0 else HCA for i in range(n - 2))
    csa = min(r for k, r in zip(base.layer_types, base.compress_ratios) if k == CSA)
    hca = max(r for k, r in zip(base.layer_types, base.compress_ratios) if k == HCA)
    return base.replace(n_layers=n, layer_types=kinds, n_hash_layers=min(base.n_hash_layers, 1),
                        compress_ratios=tuple({SLIDING: 0, CSA: csa, HCA: hca}[k] for k in kinds))


def timed(fn, *args, reps):
    out = fn(*args)
    jax.block_until_ready(out)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64, help="tokens of the full-sequence forward")
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args(argv)
    cfg = flash_pattern(a.preset, a.layers)
    model = Transformer(cfg, rngs=nnx.Rngs(0), dtype=jnp.float32, mtp=False)
    graphdef, state = nnx.split(model)
    b, pages = a.batch, 2
    p = C.PoolLayout.default_page_size(cfg)
    lay = C.PoolLayout(page_size=p, swa_page_size=64, n_pages=b * pages, n_swa_pages=b * 4 * pages, max_slots=b,
                       max_pages_per_seq=pages, max_swa_pages_per_seq=4 * pages)
    pt = jnp.arange(b * pages, dtype=jnp.int32).reshape(b, pages)
    st = jnp.arange(b * 4 * pages, dtype=jnp.int32).reshape(b, 4 * pages)
    pos = jnp.full((b,), 300, jnp.int32)
    tokens = jnp.full((b, 1), 7, jnp.int32)
    seq = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (1, a.seq)), jnp.int32)
    res = {"config": f"{a.preset} x {a.layers} layers (Flash pattern)", "jax": jax.__version__,
           "device": jax.devices()[0].device_kind}
    for loop in ("periods", "switch"):
        opts = RunOptions(layer_loop=loop)

        def decode(state, pools, tokens, pos):
            meta = C.make_meta(cfg, lay, pos, jnp.ones_like(pos), jnp.zeros(pos.shape, bool), None, pt, st, 1)
            return nnx.merge(graphdef, state).cached(tokens, meta, pools, opts)

        def forward(state, tokens):
            return nnx.merge(graphdef, state)(tokens, opts)

        pools = C.init_pools(cfg, lay, jnp.float32)
        t0 = time.perf_counter()
        dec = jax.jit(decode).lower(state, pools, tokens, pos).compile()
        t1 = time.perf_counter()
        fwd = jax.jit(forward).lower(state, seq).compile()
        t2 = time.perf_counter()
        res[loop] = {"decode_compile_s": t1 - t0, "forward_compile_s": t2 - t1,
                     "decode_ms": 1e3 * timed(dec, state, pools, tokens, pos, reps=a.reps),
                     "forward_ms": 1e3 * timed(fwd, state, seq, reps=a.reps)}
        print(loop, res[loop], flush=True)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
