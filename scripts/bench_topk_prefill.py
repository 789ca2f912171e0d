"""The GPU top-k on a prefill chunk's indexer scores: the last 8192-token chunk of a 128K prompt (8192 rows of
32768 scores, each row's scores past its causal n_valid -inf, k = 512), per stage (threshold, compaction, redo,
ordering), with the candidates ordered by one XLA sort of each row's (what `topk` does from 64 rows on) and by the
rank-and-scatter kernel (what it does for fewer rows). Both checked against the reference (one sort of every
row). Device time from a profiler trace.

    python scripts/bench_topk_prefill.py [N] [S] [K]      (GPU)
"""
import importlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

from v4jax.bench import kernels as KB

TK = importlib.import_module("pallas_kernels.topk")

N = int(sys.argv[1]) if len(sys.argv) > 1 else 8192
S = int(sys.argv[2]) if len(sys.argv) > 2 else 32768
K = int(sys.argv[3]) if len(sys.argv) > 3 else 512
x = jax.random.normal(jax.random.key(0), (1, N, S), jnp.float32)
n_valid = (4 * S - N + jnp.arange(N) + 1) // 4
scores = jnp.where(jnp.arange(S)[None, None, :] < n_valid[None, :, None], x, -jnp.inf)
ref = np.asarray(jax.jit(TK.topk_ref, static_argnums=1)(scores, K))
for name, sort_rows in (("threshold + sort of the candidates (now: from TK._SORT_ROWS rows)", TK._SORT_ROWS),
                        ("threshold + rank-and-scatter", N + 1)):
  TK._SORT_ROWS = sort_rows                      # read when traced: each form is a fresh function
  fn = lambda s: TK.topk(s, K)
  out = np.asarray(jax.jit(fn)(scores))
  sec, per_kernel = KB.time_trace(fn, (scores,), repeats=3)
  stages = ", ".join(f"{k[:40]} {v * 1e3:.2f}" for k, v in sorted(per_kernel.items(), key=lambda kv: -kv[1])[:6])
  print(f"{name}: {sec * 1e3:7.2f} ms  equal to the reference: {bool(np.array_equal(out, ref))}\n"
        f"    ms by kernel: {stages}", flush=True)
