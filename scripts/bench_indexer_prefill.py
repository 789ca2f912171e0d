"""The GPU indexer-scores kernel on a prefill chunk: the last 8192-token chunk of a 128K prompt (T=8192 queries,
S=32768 compressed keys, 64 heads x 128, each query's keys up to its causal n_valid), per tile,
against the XLA reference's outputs. Device time from a profiler trace; TFLOP/s counts valid (query, key) pairs.

    python scripts/bench_indexer_prefill.py [T] [S]      (GPU)
"""
import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np

from v4jax.bench import kernels as KB
from pallas_kernels import indexer as IX

T = int(sys.argv[1]) if len(sys.argv) > 1 else 8192
S = int(sys.argv[2]) if len(sys.argv) > 2 else 32768
Hi, Di, B = 64, 128, 1
ks = jax.random.split(jax.random.key(0), 4)
q = jax.random.normal(ks[0], (B, T, Hi, Di), jnp.bfloat16)
w = jax.random.normal(ks[1], (B, T, Hi), jnp.float32) * Hi ** -0.5
pool = jax.random.normal(ks[2], (S, Di), jnp.bfloat16)
rows = jnp.arange(S, dtype=jnp.int32)[None]
pos = 4 * S - T + jnp.arange(T)                        # the chunk's positions; 4x-compressed keys closed so far
n_valid = ((pos + 1) // 4).astype(jnp.int32)[None]
args = (q, w, pool, rows, n_valid)
pairs = int(np.asarray(n_valid).sum())
flops = 2 * pairs * Hi * Di
ref_fn = jax.jit(IX.indexer_scores_ref)   # by slices of queries: the whole chunk's logits would be 68 GB
ref = np.concatenate([np.asarray(ref_fn(q[:, i:i + 512], w[:, i:i + 512], pool, rows, n_valid[:, i:i + 512]))
                      for i in range(0, T, 512)], axis=1)
ok = np.isfinite(ref)
print(f"T={T} S={S} valid pairs {pairs / 1e6:.1f} M, {flops / 1e12:.3f} TFLOP", flush=True)
grid = [dict(tq=tq, num_warps=nw, num_stages=ns) for tq in (16, 32, 64) for nw in (4, 8) for ns in (2, 3)]
for cfg in grid:
  fn = functools.partial(IX._indexer_scores_gpu, **cfg)
  try:
    out = np.asarray(jax.jit(fn)(*args))
    err = float(np.max(np.abs(out[ok] - ref[ok]))) if ok.any() else 0.0
    same_mask = bool(np.array_equal(np.isfinite(out), ok))
    sec, _ = KB.time_trace(fn, args, repeats=3)
    print(f"{cfg}: {sec * 1e3:7.2f} ms {flops / sec / 1e12:6.1f} TFLOP/s  max err {err:.2e} mask {same_mask}",
          flush=True)
  except Exception as e:  # a config Triton cannot lower is reported, not fatal
    print(f"{cfg}: failed {type(e).__name__}: {str(e)[:200]}", flush=True)
