#!/usr/bin/env python
"""Tile-size sweeps and top-k stage timings for the GPU kernels (H200), with the kernel benchmark's harness.

  python scripts/tune_kernels.py --out $OUT/tune        (GPU; ~3 min)
  python scripts/tune_kernels.py --small --out /tmp/t   (CPU smoke test: interpret mode, tiny shapes)

Writes tune_kernels.json: per kernel and shape, microseconds for each tile config (the defaults in the kernel
modules are the winners of this sweep, see the comments there and BENCHMARKS.md), and the top-k pipeline's stages
timed one by one, with the harness's own per-call overhead (an almost empty function) for reference.
"""
import argparse
import functools
import importlib
import itertools
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402

from v4jax.bench import kernels as KB  # noqa: E402
from pallas_kernels import indexer as IX  # noqa: E402

SA = importlib.import_module("pallas_kernels.sparse_attention")
TK = importlib.import_module("pallas_kernels.topk")


def _time(fn, args, a):
  try:
    if a.harness == "trace":
      total, per_kernel = KB.time_trace(fn, args, repeats=a.repeats)
      if len(per_kernel) > 1:
        print("    kernels (us): " + ", ".join(f"{k[:48]} {v * 1e6:.1f}" for k, v in per_kernel.items()), flush=True)
      return total * 1e6
    return KB.time_fn(fn, args, iters=a.iters, repeats=a.repeats, harness=a.harness) * 1e6
  except Exception as e:  # noqa: BLE001 - a config the compiler rejects (registers, shared memory) is reported
    return f"error: {type(e).__name__}: {str(e)[:200]}"


def topk_stages(a, interp):
  rows = []
  shapes = [(1, 4096, 64), (4, 4096, 64)] if a.small else [(1, 262144, 512), (64, 262144, 512)]
  for N, S, k in shapes:
    x = jax.random.normal(jax.random.key(N), (N, S), jnp.float32)
    n_groups, cap = TK._threshold_params(S, k)
    c = -(-S // n_groups)
    gmax = jnp.max(x.reshape(N, c, n_groups), axis=1)
    tau = TK._kth_largest(gmax, k, interpret=interp)
    chunk = min(1024, n_groups)
    vals, idx, cnt = TK._compact(x, tau, cap, interpret=interp, chunk=chunk)
    stages = {
        "harness overhead (x[:, :1] + 1)": (lambda x: x[:, :1] + 1, (x,)),
        "full pipeline (topk)": (lambda x: TK._topk_threshold(x, k, interpret=interp), (x,)),
        "lax.top_k (values + indices)": (lambda x: lax.top_k(x, k), (x,)),
        "topk_ref (XLA path)": (lambda x: TK.topk_ref(x[:, None], k), (x,)),
        "stage 1: strided group maxima": (lambda x: jnp.max(x.reshape(N, c, n_groups), axis=1), (x,)),
        "stage 2: k-th of group maxima (Pallas bisection)":
            (lambda g: TK._kth_largest(g, k, interpret=interp), (gmax,)),
        "alt stage 2: k-th of group maxima (lax.top_k)": (lambda g: lax.top_k(g, k)[0][:, k - 1], (gmax,)),
        "stage 3: compaction kernel": (lambda x, t: TK._compact(x, t, cap, interpret=interp, chunk=chunk), (x, tau)),
        "stage 4: overflow redo kernel (no row overflows)":
            (lambda x, v, i, n: TK._redo_overflow(x, v, i, n, k, interpret=interp, chunk=chunk), (x, vals, idx, cnt)),
        "stage 5: rank-scatter kernel": (lambda v, i, n: TK._rank_scatter(v, i, n, k, interpret=interp),
                                         (vals, idx, cnt)),
        "alt stage 4+5: lax.cond(overflow) + lax.sort of the candidates":
            (lambda v, i, n: lax.cond(jnp.any(n > cap), lambda _: TK._order_and_pad(v * 2, i, k),
                                      lambda _: TK._order_and_pad(v, i, k), None), (vals, idx, cnt)),
    }
    for name, (fn, args) in stages.items():
      us = _time(fn, args, a)
      rows.append(dict(kernel="topk", shape=f"N={N} S={S} k={k}", config=name, us=us))
      print(f"topk N={N:3d} {name:62s} {us if isinstance(us, str) else f'{us:9.1f} us'}", flush=True)
  return rows


def _ref_row(rows, case, a):
  us = _time(case.ref, case.args, a)
  rows.append(dict(kernel=case.kernel, shape=case.config, config="XLA reference", us=us,
                   GBps=case.bytes / (us * 1e3) if not isinstance(us, str) else None))
  print(f"{case.kernel} {case.config}: XLA reference {us if isinstance(us, str) else f'{us:8.1f} us'}", flush=True)


def indexer_sweep(a, interp):
  rows = []
  cases = [c for c in KB.indexer_cases(a.small, interp) if c.kernel == "indexer_scores"
           and (a.small or "B=32 ctx=65536" in c.config or "B=64 ctx=131072" in c.config)]
  grid = [(128, 4, 2, 2)] if a.small else list(itertools.product((128,), (4, 8), (2, 3), (1, 2, 4, 8)))
  for case in cases:
    _ref_row(rows, case, a)
    for sb, nw, ns, ni in grid:
      fn = functools.partial(IX._indexer_scores_gpu, sb=sb, num_warps=nw, num_stages=ns, n_inner=ni,
                             interpret=interp)
      us = _time(fn, case.args, a)
      gbps = case.bytes / (us * 1e3) if not isinstance(us, str) else None
      rows.append(dict(kernel="indexer_scores", shape=case.config,
                       config=dict(sb=sb, num_warps=nw, num_stages=ns, n_inner=ni), us=us, GBps=gbps))
      print(f"indexer_scores {case.config:40s} sb={sb:3d} w={nw} s={ns} inner={ni}: "
            f"{us if isinstance(us, str) else f'{us:8.1f} us {gbps:6.0f} GB/s'}", flush=True)
  return rows


def attention_sweep(a, interp):
  rows = []
  cases = KB.attention_cases(a.small, interp)
  if not a.small:
    cases = [c for c in cases if "T=1" in c.config and "ctx=131072" in c.config and "B=32" in c.config]
  if a.attention_configs:
    grid = [tuple(int(v) for v in c.split(":")) for c in a.attention_configs]
  elif a.small:
    grid = [(32, 16, 4, 2, 2)]
  else:
    grid = list(itertools.product((64,), (16, 32), (4, 8), (2,), (1, 2, 4, 8)))
  for case in cases:
    _ref_row(rows, case, a)
    scale = case.args[0].shape[-1] ** -0.5
    for blk, hb, nw, ns, split in grid:
      fn = functools.partial(SA._sparse_attention_gpu, scale=scale, block=blk, heads=hb, num_warps=nw,
                             num_stages=ns, n_split=split, interpret=interp)
      us = _time(fn, case.args, a)
      gbps = case.bytes / (us * 1e3) if not isinstance(us, str) else None
      rows.append(dict(kernel="sparse_attention", shape=case.config,
                       config=dict(block=blk, heads=hb, num_warps=nw, num_stages=ns, n_split=split), us=us,
                       GBps=gbps))
      print(f"sparse_attention {case.config:50s} blk={blk:2d} hb={hb:2d} w={nw} s={ns} split={split}: "
            f"{us if isinstance(us, str) else f'{us:8.1f} us {gbps:6.0f} GB/s'}", flush=True)
  return rows


def sinkhorn_sweep(a, interp):
  """mHC Sinkhorn at decode sizes: tokens per program and warps (one token is a thread's 20 serial iterations)."""
  SK = importlib.import_module("pallas_kernels.sinkhorn")
  rows = []
  grid = [(128, 1)] if a.small else list(itertools.product((32, 64, 128), (1, 2, 4)))
  for m in ((2,) if a.small else (1, 32, 256)):
    comb = jnp.exp(jax.random.normal(jax.random.key(m), (m, 4, 4), jnp.float32))
    for block, nw in grid:
      if nw * 32 > block and not a.small:
        continue
      fn = functools.partial(SK.sinkhorn, iters=20, eps=1e-6, block=block, num_warps=nw, interpret=interp or None)
      us = _time(fn, (comb,), a)
      rows.append(dict(kernel="sinkhorn", shape=f"M={m}", config=dict(block=block, num_warps=nw), us=us))
      print(f"sinkhorn M={m:4d} block={block:3d} w={nw}: {us if isinstance(us, str) else f'{us:8.1f} us'}",
            flush=True)
  return rows


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--small", action="store_true")
  p.add_argument("--out", default=os.environ.get("OUT", "."))
  p.add_argument("--only", nargs="*", choices=("topk", "indexer", "attention", "sinkhorn"), default=None)
  p.add_argument("--iters", type=int, default=10)
  p.add_argument("--repeats", type=int, default=5)
  p.add_argument("--harness", choices=("unrolled", "loop", "trace"), default="unrolled",
                 help="see pallas_kernels.bench")
  p.add_argument("--attention-configs", nargs="*", default=None, metavar="BLOCK:HEADS:WARPS:STAGES:SPLIT",
                 help="sparse attention configs to sweep (default: a built-in grid)")
  a = p.parse_args(argv)
  if a.small:
    a.iters, a.repeats = 2, 1
  interp = jax.default_backend() == "cpu"
  t0 = time.time()
  bw = KB.measure_bandwidth((64 << 20) if a.small else (4 << 30), repeats=5)
  print(f"device={jax.devices()[0].device_kind} jax={jax.__version__} copy bandwidth {bw / 1e9:.0f} GB/s", flush=True)
  rows = []
  for name, f in (("topk", topk_stages), ("indexer", indexer_sweep), ("attention", attention_sweep),
                  ("sinkhorn", sinkhorn_sweep)):
    if a.only is None or name in a.only:
      rows += f(a, interp)
  os.makedirs(a.out, exist_ok=True)
  with open(os.path.join(a.out, "tune_kernels.json"), "w") as fh:
    json.dump(dict(device=jax.devices()[0].device_kind, jax=jax.__version__, copy_GBps=bw / 1e9, iters=a.iters,
                   harness=a.harness,
                   repeats=a.repeats, seconds=time.time() - t0, rows=rows), fh, indent=1)
  print(f"wrote {a.out}/tune_kernels.json in {time.time() - t0:.0f} s")
  return 0


if __name__ == "__main__":
  sys.exit(main())
