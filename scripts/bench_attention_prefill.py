"""The GPU sparse-attention kernel on a prefill chunk: the last 8192-token chunk of a 128K prompt, 64 heads x 512,
per tile (heads per program, warps, rows per step, pipeline stages), against the XLA reference's outputs. Two
cases: a CSA layer (each query's 128-token window + 512 selected entries of 32768) and an HCA layer (the window +
every entry closed before the query: 960-1024 of them), and an HCA chunk ending at 72K with rows as wide as the
128K bucket's (where skipping the blocks past a query's last valid row, skip_tail, pays: `sparse_attention`'s
valid_prefix, which the HCA layers set). Device time from a profiler trace; TFLOP/s counts the valid rows (QK and
PV).

    python scripts/bench_attention_prefill.py [T] [CONFIG ...]     (GPU; CONFIG = heads:warps:block:stages:skip_tail)
"""
import functools
import importlib
import itertools
import sys

import jax
import jax.numpy as jnp
import numpy as np

from v4jax.bench import kernels as KB

SA = importlib.import_module("pallas_kernels.sparse_attention")  # the package's name is the function

T = int(sys.argv[1]) if len(sys.argv) > 1 else 8192
configs = [tuple(int(v) for v in c.split(":")) for c in sys.argv[2:]] or \
    [(*c, 0) for c in itertools.product((16, 32), (4, 8), (64,), (2,))] + [(16, 4, 64, 2, 1), (32, 8, 64, 2, 1)]
H, D, W, B, ctx = 64, 512, 128, 1, 131072
ks = jax.random.split(jax.random.key(0), 6)
q = jax.random.normal(ks[0], (B, T, H, D), jnp.bfloat16)
sink = jax.random.normal(ks[1], (H,), jnp.float32)
pos = ctx - T + jnp.arange(T)                                     # the chunk's positions
swa = jax.random.normal(ks[2], (ctx, D), jnp.bfloat16)            # one row per position (a page table of 1s)
win = pos[:, None] - W + 1 + jnp.arange(W)[None, :]
swa_rows = jnp.where(win >= 0, win, -1).astype(jnp.int32)[None]
cases = {}
n_csa = ctx // 4
csa = jax.random.normal(ks[3], (n_csa, D), jnp.bfloat16)
ready = (pos + 1) // 4
sel = jax.random.randint(ks[4], (T, 512), 0, n_csa)
cases["csa"] = (q, swa, swa_rows, csa, jnp.where(sel < ready[:, None], sel, -1).astype(jnp.int32)[None], sink)
n_hca = ctx // 128
hca = jax.random.normal(ks[5], (n_hca, D), jnp.bfloat16)
e = jnp.arange(n_hca)[None, :]
cases["hca"] = (q, swa, swa_rows, hca, jnp.where(e < ((pos + 1) // 128)[:, None], e, -1).astype(jnp.int32)[None],
                sink)
# a chunk in the middle of the prompt (ending at 72K) whose rows are as wide as the 128K page bucket's: only the
# first ~560 of 1024 entries are valid
mid = 73728 - T + jnp.arange(T)
cases["hca-mid"] = (q, swa, jnp.where(mid[:, None] - W + 1 + jnp.arange(W)[None, :] >= 0,
                                      mid[:, None] - W + 1 + jnp.arange(W)[None, :], -1).astype(jnp.int32)[None],
                    hca, jnp.where(e < ((mid + 1) // 128)[:, None], e, -1).astype(jnp.int32)[None], sink)
scale = D ** -0.5
for name, args in cases.items():
  rows = int(np.asarray((args[2] >= 0).sum() + (args[4] >= 0).sum()))
  flops = 4 * rows * H * D
  ref_fn = jax.jit(functools.partial(SA.sparse_attention_ref, scale=scale))
  sl = lambda a, i: a[:, i:i + 512]
  ref = np.concatenate([np.asarray(ref_fn(sl(args[0], i), args[1], sl(args[2], i), args[3], sl(args[4], i),
                                          args[5]).astype(jnp.float32)) for i in range(0, T, 512)], axis=1)
  print(f"{name}: T={T} valid rows {rows / 1e6:.2f} M, {flops / 1e12:.3f} TFLOP", flush=True)
  for hb, nw, blk, ns, skip in configs:
    fn = functools.partial(SA._sparse_attention_gpu, scale=scale, heads=hb, num_warps=nw, block=blk, num_stages=ns,
                           skip_tail=bool(skip))
    tag = f"  {name} heads={hb} warps={nw} block={blk} stages={ns} skip_tail={skip}:"
    try:
      out = np.asarray(jax.jit(fn)(*args).astype(jnp.float32))
      err = float(np.max(np.abs(out - ref)))
      sec, _ = KB.time_trace(fn, args, repeats=3)
      print(f"{tag} {sec * 1e3:7.2f} ms {flops / sec / 1e12:6.1f} TFLOP/s  max err {err:.2e}", flush=True)
    except Exception as ex:  # a tile Triton cannot lower or fit is reported, not fatal
      print(f"{tag} failed {type(ex).__name__}: {str(ex)[:160]}", flush=True)
