"""`v4jax bench kernels`: each Pallas kernel vs its jnp/XLA reference and vs the memory-bandwidth roofline.

  v4jax bench kernels [--small] [--out DIR] [--only NAME ...] [--iters N] [--repeats R] [--harness H]
  python -m v4jax.bench kernels ...            (same arguments)

For every case: check the Pallas path against the reference on the same inputs (exact for top-k; tolerances
for floating outputs) -- a mismatch is reported in the table and makes the script exit with status 1 after
writing its results; time both (the kernel runs `--iters` times in a chain inside ONE jitted call, the median
over `--repeats` calls divided by iters is reported); the roofline is the bytes the kernel must move divided by
the HBM bandwidth measured here with a large copy (and, where compute matters, FLOPs / measured bf16 matmul
rate). Writes bench_kernels.json and bench_kernels.md to --out (default: $OUT, else the current directory).

--small: tiny shapes that run anywhere (on CPU the Pallas kernels run in interpret mode), to check the script
end to end; the numbers mean nothing there.
"""
from __future__ import annotations

import dataclasses
import importlib
import json
import os
import platform
import sys
import tempfile
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_kernels import _compat
from pallas_kernels import compressor as C
from pallas_kernels import indexer as IX
from pallas_kernels.sparse_attention import sparse_attention, sparse_attention_ref
from v4jax.bench.decode import measure_bandwidth as decode_bandwidth_probe
from v4jax.bench.flops import measure_matmul_rate
from v4jax.bench.profile import device_events

TK = importlib.import_module("pallas_kernels.topk")

F32, BF16 = jnp.float32, jnp.bfloat16


# --------------------------------------------------------------------------------------------------------------
# timing
# --------------------------------------------------------------------------------------------------------------

def _touch(args, dep):
  """args with one element of the first float array nudged by `dep` (always 0, but XLA cannot prove it): makes
  every loop iteration's inputs depend on the previous iteration's outputs, so the call cannot be hoisted out of
  the loop (loop-invariant code motion) nor overlapped with the next one. An in-place one-element update."""
  leaves, tree = jax.tree_util.tree_flatten(args)
  for i, x in enumerate(leaves):
    if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating) and x.size:
      # a dynamic_update_slice of one element, done in place; `x.at[0].add(...)` was lowered by XLA GPU as a full
      # pass over x (measured on the H200: 50 us per call on a 64 MB input, and half the copy probe's bandwidth)
      corner = lax.slice(x, (0,) * x.ndim, (1,) * x.ndim) + (dep * 0).astype(x.dtype)
      leaves[i] = lax.dynamic_update_slice(x, corner, (0,) * x.ndim)
      break
  return jax.tree_util.tree_unflatten(tree, leaves)


def _consume(out):
  """A scalar that depends on every element of every output (a full reduction), so no part of a call can be
  skipped; a partial read (e.g. element 0) lets XLA compute only that element of a fused elementwise op."""
  leaves = [x for x in jax.tree_util.tree_leaves(out) if hasattr(x, "dtype")]
  return sum(jnp.sum(x.astype(F32)) for x in leaves)


def time_fn(fn: Callable, args: tuple, *, iters: int, repeats: int, carry: Callable | None = None,
            consume: bool = True, harness: str = "unrolled") -> float:
  """Median seconds per call of fn(*args): `iters` dependent calls in one jitted function (dispatch overhead is
  paid once). Each call's inputs depend on the previous call's outputs through a zero-valued scalar (`_touch`,
  `_consume`), so XLA can neither hoist, merge, overlap nor partially compute a call. `carry(args, out)` may
  thread outputs into the next call's inputs (e.g. an updated state).

  harness="unrolled": the calls written out one after another; "loop": a `lax.fori_loop` over them. They
  disagree on the H200 (JAX 0.11.2) and neither is exact for kernels of tens of microseconds: each loop
  iteration costs 30-40 us by itself (measured with an almost empty fn; the host waits for the loop predicate,
  then enqueues the iteration), while unrolled chains let XLA fuse elementwise work across calls (a chained
  copy read 37 TB/s), so only opaque kernels (Pallas calls, sorts) are timed faithfully unrolled. BENCHMARKS.md
  reports both where they matter. (A first version chained calls through optimisation barriers and read one
  element of the last output; it reported a 70 TB/s copy bandwidth: work was being elided.)"""

  def one(args, dep):
    args = _touch(args, dep)
    out = fn(*args)
    if carry is not None:
      args = carry(args, out)
    return args, (dep + _consume(out)) if consume else dep

  def many(args):
    dep = jnp.zeros((), F32)
    if harness == "loop":
      return lax.fori_loop(0, iters, lambda _, c: one(*c), (args, dep))
    if harness != "unrolled":
      raise ValueError(f"harness must be 'unrolled' or 'loop', got {harness!r}")
    for _ in range(iters):
      args, dep = one(args, dep)
    return args, dep          # the final args are returned: all live

  return _time_single(many, (args,), repeats) / iters


def time_trace(fn: Callable, args: tuple, *, repeats: int) -> tuple[float, dict[str, float]]:
  """Device time per call from a profiler trace: (seconds the GPU spent in kernels per call, {kernel name:
  seconds per call}). Each call is one plain jitted call (no chaining, so nothing to fuse across calls and no
  harness work inside the time); launch gaps between a call's kernels are excluded, which is the point: this
  judges the kernels against their roofline, while the unrolled/loop harnesses give what a caller waits for.
  Memory copies between host and device are not counted. Where the trace has no GPU plane (CPU), the host's
  wall time of a call is returned and the breakdown is empty."""
  f = jax.jit(fn)
  jax.block_until_ready(f(*args))
  with tempfile.TemporaryDirectory() as d:
    with jax.profiler.trace(d):
      for _ in range(repeats):
        jax.block_until_ready(f(*args))
    paths = [os.path.join(r, n) for r, _, ns in os.walk(d) for n in ns if n.endswith(".xplane.pb")]
    events = _device_events(paths[0]) if paths else []
  if not events:
    return _time_single(fn, args, repeats), {}
  per_kernel: dict[str, float] = {}
  for name, dur_ns in events:
    per_kernel[name] = per_kernel.get(name, 0.0) + dur_ns * 1e-9 / repeats
  return sum(per_kernel.values()), dict(sorted(per_kernel.items(), key=lambda kv: -kv[1]))


def _device_events(xplane_path: str) -> list[tuple[str, float]]:
  """(kernel name, duration ns) of every kernel and memset on the GPU's stream lines, once each (no memcpy)."""
  return [(name, ns) for name, ns, _ in device_events(xplane_path) if "memcpy" not in name.lower()]


def _time_single(fn, args, repeats):
  """Median seconds of one jitted call after a warm-up (compile) call."""
  f = jax.jit(fn)
  jax.block_until_ready(f(*args))
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(f(*args))
    times.append(time.perf_counter() - t0)
  return float(np.median(times))


def measure_bandwidth(nbytes: int, *, repeats: int) -> float:
  """HBM bandwidth (bytes/s): `v4jax bench decode`'s copy probe, so both benchmarks hold kernels to one figure."""
  return decode_bandwidth_probe(nbytes, reps=repeats)["copy_GBps"] * 1e9


# --------------------------------------------------------------------------------------------------------------
# cases
# --------------------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Case:
  kernel: str
  config: str
  pallas: Callable
  ref: Callable
  args: tuple
  bytes: float
  check: Callable            # (pallas_out, ref_out) -> (ok: bool, detail: str)
  flops: float = 0.0
  carry: Callable | None = None
  note: str = ""


def _allclose_check(rtol, atol):
  def check(out, ref):
    outs, refs = jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(ref)
    worst = 0.0
    for o, r in zip(outs, refs):
      o, r = np.asarray(o, np.float64), np.asarray(r, np.float64)
      if o.shape != r.shape:
        return False, f"shape {o.shape} vs {r.shape}"
      same_inf = np.array_equal(np.isinf(o), np.isinf(r)) and not np.any(np.isnan(o))
      fin = np.isfinite(r)
      err = np.abs(o[fin] - r[fin]) - rtol * np.abs(r[fin])
      worst = max(worst, float(np.max(err / atol)) if err.size else 0.0)
      if not same_inf:
        return False, "inf/nan pattern differs"
    return worst <= 1.0, f"max err/tol {worst:.3g}"
  return check


def _exact_check(out, ref):
  o, r = np.asarray(out), np.asarray(ref)
  n_bad = int(np.sum(np.any(o != r, axis=-1)))
  return n_bad == 0, "exact" if n_bad == 0 else f"{n_bad} rows differ"


def _topk_set_check(scores, score_rtol: float = 0.0):
  """Same selection as the reference on the reference scores, up to near ties at the k-th score.

  Without a fused score kernel (score_rtol = 0) only a k-th/(k+1)-th tie within 1e-6 rel is accepted (CONVENTIONS).
  With one (indexer_topk), the Pallas scores carry their own f32 rounding (summation order), so an entry may swap
  across the boundary only if its reference score lies within score_rtol * max|score| of the reference k-th."""
  def check(out, ref):
    o, r, s = np.asarray(out), np.asarray(ref), np.asarray(scores(), np.float64)
    s = s.reshape(-1, s.shape[-1])
    o, r = o.reshape(-1, o.shape[-1]), r.reshape(-1, r.shape[-1])
    bad, swapped = 0, 0
    for n in range(o.shape[0]):
      if np.array_equal(o[n], r[n]):
        continue
      fin = np.sort(s[n][np.isfinite(s[n])])[::-1]
      k = o.shape[1]
      if len(fin) > k and abs(fin[k - 1] - fin[k]) <= 1e-6 * abs(fin[k - 1]):
        continue
      diff = set(o[n][o[n] >= 0].tolist()) ^ set(r[n][r[n] >= 0].tolist())
      band = score_rtol * np.abs(fin).max() if len(fin) else 0.0
      if diff and len(fin) >= k and all(abs(s[n][j] - fin[k - 1]) <= band for j in diff):
        swapped += 1
        continue
      if not diff and score_rtol:  # same set, order of near-equal scores differs
        continue
      bad += 1
    if bad:
      return False, f"{bad} rows differ"
    return True, "same" + (f" ({swapped} rows: boundary swap within the score error)" if swapped else " (or near-tie)")
  return check


def _keys(*shape_seed):
  return jax.random.split(jax.random.key(sum(shape_seed) % (2 ** 31)), 8)


def topk_cases(small: bool, interp: bool):
  out = []
  # 128K prefill / decode rows; a decode step's short rows at 4K / 16K (ranked whole: topk._rank_rows)
  sizes = [(1, 4096, 64), (4, 4096, 64)] if small else [
      (1, 262144, 512), (64, 262144, 512), (1, 1024, 512), (32, 1024, 512), (1, 4096, 512), (32, 4096, 512)]
  for N, S, k in sizes:
    x = jax.random.normal(_keys(N, S)[0], (N, 1, S), F32)
    out.append(Case("topk", f"N={N} S={S} k={k}",
                    lambda s, k=k: TK.topk(s, k, interpret=interp), lambda s, k=k: TK.topk_ref(s, k), (x,),
                    bytes=N * S * 4 + N * k * 4, check=_exact_check))
  return out


def _paged_rows(key, B, S, page, R_pages):
  """Rows of B requests with S entries each in a pool of pages of `page` rows, pages drawn at random."""
  n_pages = -(-S // page)
  perm = jax.random.permutation(key, R_pages)[: B * n_pages].reshape(B, n_pages)
  rows = perm[:, :, None] * page + jnp.arange(page)[None, None, :]
  return rows.reshape(B, -1)[:, :S].astype(jnp.int32)


def indexer_cases(small: bool, interp: bool):
  out = []
  if small:
    grid = [(2, 1024, 16, 32, 64)]
  else:
    grid = [(B, ctx, 64, 128, 512) for B in (32, 64) for ctx in (65536, 131072)]
  for B, ctx, Hi, Di, k in grid:
    S = ctx // 4
    ks = _keys(B, ctx, 1)
    page = 64
    R = B * S
    q = jax.random.normal(ks[0], (B, 1, Hi, Di), BF16)
    w = jax.random.normal(ks[1], (B, 1, Hi), F32) * (Hi * Di) ** -0.5
    pool = jax.random.normal(ks[2], (R, Di), BF16)
    rows = _paged_rows(ks[3], B, S, page, R // page)
    n_valid = jnp.full((B, 1), S, jnp.int32)
    args = (q, w, pool, rows, n_valid)
    key_bytes = B * S * Di * 2 + B * S * 4
    cfg = f"B={B} ctx={ctx} S={S} Hi={Hi} Di={Di}"
    out.append(Case("indexer_scores", cfg, lambda *a: IX.indexer_scores(*a, interpret=interp),
                    IX.indexer_scores_ref, args, bytes=key_bytes + B * S * 4, check=_allclose_check(1e-3, 1e-3),
                    flops=2 * B * Hi * Di * S))
    scores = lambda a=args: IX.indexer_scores_ref(*a)
    out.append(Case("indexer_topk", cfg + f" k={k}",
                    lambda *a, k=k: IX.indexer_topk(*a, k, impl="pallas", interpret=interp),
                    lambda *a, k=k: IX.indexer_topk(*a, k, impl="xla"), args, bytes=key_bytes + B * k * 4,
                    check=_topk_set_check(scores, score_rtol=1e-5), flops=2 * B * Hi * Di * S,
                    note="roofline: keys + ids only (scores kept on chip)"))
  return out


def attention_cases(small: bool, interp: bool):
  out = []
  if small:
    grid = [("csa", 2, 1, 8, 128, 16, 32, 256)]
  else:
    grid = []
    for B in (32, 64):
      for ctx in (65536, 131072):
        grid.append(("csa", B, 1, 64, 512, 128, 512, ctx))
      grid.append(("hca", B, 1, 64, 512, 128, 131072 // 128, 131072))
    grid.append(("csa", 32, 2, 64, 512, 128, 512, 131072))    # speculative decoding: 2 queries per slot
  for kind, B, T, H, D, W, K, ctx in grid:
    ks = _keys(B, T, K, ctx)
    n_cmp = ctx // 4 if kind == "csa" else ctx // 128
    q = jax.random.normal(ks[0], (B, T, H, D), BF16)
    swa = jax.random.normal(ks[1], (B * W, D), BF16)
    cmp = jax.random.normal(ks[2], (B * n_cmp, D), BF16)
    ring = (jnp.arange(W)[None, None, :] + jnp.arange(T)[None, :, None]) % W
    swa_rows = (jnp.arange(B)[:, None, None] * W + ring).astype(jnp.int32)
    if kind == "csa":
      sel = jax.random.randint(ks[3], (B, T, K), 0, n_cmp)
    else:
      sel = jnp.broadcast_to(jnp.arange(K)[None, None, :], (B, T, K))
    cmp_rows = (jnp.arange(B)[:, None, None] * n_cmp + sel).astype(jnp.int32)
    sink = jax.random.normal(ks[4], (H,), F32)
    args = (q, swa, swa_rows, cmp, cmp_rows, sink)
    scale = D ** -0.5
    nbytes = B * T * (W + K) * (D * 2 + 4) + 2 * B * T * H * D * 2
    out.append(Case("sparse_attention", f"{kind} B={B} T={T} H={H} D={D} W={W} K={K} ctx={ctx}",
                    lambda *a, s=scale: sparse_attention(*a, scale=s, interpret=interp),
                    lambda *a, s=scale: sparse_attention_ref(*a, scale=s), args, bytes=nbytes,
                    check=_allclose_check(2e-2, 2e-2), flops=4 * B * T * H * (W + K) * D))
  return out


def compressor_cases(small: bool, interp: bool):
  out = []
  if small:
    grid = [("csa", 4, True, 128, 64, 3), ("hca", 16, False, 128, 64, 3)]
  else:
    grid = [(n, m, ov, d, 4096, B) for B in (32, 64)
            for n, m, ov, d in (("csa-main", 4, True, 512), ("hca", 128, False, 512), ("csa-indexer", 4, True, 128))]
  for name, m, ov, d, Dm, B in grid:
    coff = 2 if ov else 1
    rd = 64 if d >= 128 else 16
    ks = _keys(m, d, B)
    x = jax.random.normal(ks[0], (B, Dm), BF16)
    wkv = (jax.random.normal(ks[1], (coff * d, Dm), F32) * Dm ** -0.5).astype(BF16)
    wg = (jax.random.normal(ks[2], (coff * d, Dm), F32) * Dm ** -0.5).astype(BF16)
    ape = jax.random.normal(ks[3], (m, coff * d), F32) * 0.1
    norm_w = jnp.ones((d,), F32)
    pos = jax.random.randint(ks[4], (B,), 10 * m, 1000 * m).astype(jnp.int32)
    kv = jax.random.normal(ks[5], (B, coff * m, coff * d), F32)
    sc = jax.random.normal(ks[6], (B, coff * m, coff * d), F32)
    cos = jnp.ones((B, rd // 2), F32)
    sin = jnp.zeros((B, rd // 2), F32)
    kw = dict(ratio=m, overlap=ov, eps=1e-6)
    args = (x, pos, kv, sc, wkv, wg, ape, norm_w, (cos, sin))
    close_frac = 1.0 / m
    nbytes = (2 * coff * d * Dm * 2 + B * Dm * 2 + B * 2 * coff * d * 4 * 2
              + close_frac * B * 2 * (coff * m) * coff * d * 4 * (2 if ov else 1) + B * d * 4)

    def carry(a, o):   # next token: positions + 1, updated states
      return (a[0], a[1] + 1, o[2], o[3]) + a[4:]

    out.append(Case("compressor_decode", f"{name} m={m} d={d} Dm={Dm} B={B}",
                    lambda *a, kw=kw: C.compressor_decode(*a, **kw, interpret=interp),
                    lambda *a, kw=kw: C.compressor_decode_ref(*a, **kw), args, bytes=nbytes,
                    check=_allclose_check(1e-3, 1e-3), flops=2 * B * Dm * 2 * coff * d, carry=carry,
                    note="state carried across iterations"))
  # prefill: one chunk per config
  pre = [("csa-main", 4, True, 128, 64, 2, 16)] if small else [("csa-main", 4, True, 512, 4096, 4, 1024),
                                                               ("hca", 128, False, 512, 4096, 4, 1024)]
  for name, m, ov, d, Dm, B, T in pre:
    coff = 2 if ov else 1
    rd = 64 if d >= 128 else 16
    ks = _keys(m, d, B, T)
    x = jax.random.normal(ks[0], (B, T, Dm), BF16)
    wkv = (jax.random.normal(ks[1], (coff * d, Dm), F32) * Dm ** -0.5).astype(BF16)
    wg = (jax.random.normal(ks[2], (coff * d, Dm), F32) * Dm ** -0.5).astype(BF16)
    ape = jax.random.normal(ks[3], (m, coff * d), F32) * 0.1
    norm_w = jnp.ones((d,), F32)
    sp = jax.random.randint(ks[4], (B,), 0, 1000).astype(jnp.int32)
    nt = jnp.full((B,), T, jnp.int32)
    kv = jax.random.normal(ks[5], (B, coff * m, coff * d), F32)
    sc = jax.random.normal(ks[6], (B, coff * m, coff * d), F32)
    E = T // m + 2
    cos = jnp.ones((B, E, rd // 2), F32)
    sin = jnp.zeros((B, E, rd // 2), F32)
    kw = dict(ratio=m, overlap=ov, eps=1e-6)
    args = (x, sp, nt, kv, sc, wkv, wg, ape, norm_w, cos, sin)
    nbytes = 2 * coff * d * Dm * 2 + B * T * Dm * 2 + 4 * B * coff * m * coff * d * 4 + B * E * d * 4
    out.append(Case("compressor_prefill", f"{name} m={m} d={d} Dm={Dm} B={B} T={T}",
                    lambda *a, kw=kw: C.compressor_prefill(*a, **kw, interpret=interp),
                    lambda *a, kw=kw: C.compressor_prefill_ref(*a, **kw), args, bytes=nbytes,
                    check=_allclose_check(1e-3, 1e-3), flops=2 * B * T * Dm * 2 * coff * d,
                    note="GPU: the XLA path (compute-bound)"))
  return out


ALL = {"topk": topk_cases, "indexer": indexer_cases, "attention": attention_cases, "compressor": compressor_cases}


# --------------------------------------------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------------------------------------------

def run(args) -> int:
  be = _compat.backend()
  interp = be == "cpu"
  small = args.small
  iters = args.iters or (2 if small else 10)
  repeats = args.repeats or (2 if small else 7)
  bw_bytes = (64 << 20) if small else (4 << 30)
  bw = measure_bandwidth(bw_bytes, repeats=max(repeats, 5))
  mm = measure_matmul_rate(512 if small else 8192, reps=max(repeats, 5))   # the generate benchmark's probe
  if args.harness == "trace":
    timer = lambda fn, a, carry=None: time_trace(fn, a, repeats=repeats)
  else:
    timer = lambda fn, a, carry=None: (time_fn(fn, a, iters=iters, repeats=repeats, harness=args.harness,
                                               carry=carry), {})
  # what the harness itself costs per chained call (the _touch update, the _consume reduction, the loop step):
  # it is inside every timing below, and matters for the few-microsecond kernels (trace: one tiny kernel)
  overhead, _ = timer(lambda x: x[:1] + 1, (jnp.ones((1024,), F32),))
  print(f"backend={be} device={jax.devices()[0].device_kind} jax={jax.__version__} "
        f"HBM copy bandwidth={bw / 1e9:.0f} GB/s bf16 matmul={mm / 1e12:.1f} TFLOP/s "
        f"harness overhead={overhead * 1e6:.1f} us/call", flush=True)
  rows, failed = [], []
  for name in args.only or list(ALL):
    for case in ALL[name](small, interp):
      out = jax.jit(case.pallas)(*case.args)
      ref = jax.jit(case.ref)(*case.args)
      ok, detail = case.check(out, ref)
      t_p, k_p = timer(case.pallas, case.args, carry=case.carry)
      t_r, k_r = timer(case.ref, case.args, carry=case.carry)
      roof = max(case.bytes / bw, case.flops / mm)
      row = dict(kernel=case.kernel, config=case.config, pallas_us=t_p * 1e6, xla_us=t_r * 1e6,
                 speedup=t_r / t_p, bytes=case.bytes, roofline_us=roof * 1e6,
                 bw_fraction=(case.bytes / bw) / t_p, roofline_fraction=roof / t_p, check=detail, ok=ok,
                 note=case.note, pallas_kernels_us={k: v * 1e6 for k, v in k_p.items()},
                 xla_kernels_us={k: v * 1e6 for k, v in k_r.items()})
      rows.append(row)
      print(f"{case.kernel:18s} {case.config:55s} pallas {row['pallas_us']:9.1f} us  xla {row['xla_us']:9.1f} us "
            f" x{row['speedup']:5.2f}  roofline {row['roofline_us']:8.1f} us ({100 * row['roofline_fraction']:5.1f}%)"
            f"  {'OK' if ok else 'MISMATCH'} {detail}", flush=True)
      if not ok:
        failed.append(f"{case.kernel} {case.config}: {detail}")
  meta = dict(backend=be, device=jax.devices()[0].device_kind, jax=jax.__version__, python=platform.python_version(),
              hbm_bandwidth_GBps=bw / 1e9, bf16_matmul_TFLOPs=mm / 1e12, harness_overhead_us=overhead * 1e6,
              iters=iters, repeats=repeats, harness=args.harness,
              small=small, command=" ".join([os.path.basename(sys.argv[0])] + sys.argv[1:]))
  out_dir = args.out or os.environ.get("OUT") or "."
  os.makedirs(out_dir, exist_ok=True)
  with open(os.path.join(out_dir, "bench_kernels.json"), "w") as f:
    json.dump(dict(meta=meta, results=rows), f, indent=1)
  with open(os.path.join(out_dir, "bench_kernels.md"), "w") as f:
    f.write(_markdown(meta, rows))
  print(f"wrote {out_dir}/bench_kernels.json and bench_kernels.md")
  if failed:
    print("MISMATCH against the reference:\n  " + "\n  ".join(failed), file=sys.stderr)
    return 1
  return 0


def _markdown(meta, rows):
  if meta["harness"] == "trace":
    how = (f"GPU kernel time per call from a profiler trace, mean of {meta['repeats']} calls (launch gaps "
           f"excluded; one tiny kernel: {meta['harness_overhead_us']:.1f} us)")
  else:
    how = (f"median of {meta['repeats']} calls of {meta['iters']} chained kernel runs in one jit, {meta['harness']} "
           f"(harness overhead {meta['harness_overhead_us']:.1f} us per run, included)")
  lines = [f"Device: {meta['device']} ({meta['backend']}), JAX {meta['jax']}; measured HBM copy bandwidth "
           f"{meta['hbm_bandwidth_GBps']:.0f} GB/s, bf16 matmul {meta['bf16_matmul_TFLOPs']:.0f} TFLOP/s; {how}."
           + (" **--small: shapes for a smoke test, numbers meaningless.**" if meta["small"] else ""), "",
           "| kernel | config | Pallas (us) | XLA ref (us) | speedup | MB moved | roofline (us) | % of roofline | check |",
           "|---|---|---:|---:|---:|---:|---:|---:|---|"]
  for r in rows:
    lines.append(f"| {r['kernel']} | {r['config']} | {r['pallas_us']:.1f} | {r['xla_us']:.1f} | {r['speedup']:.2f}x | "
                 f"{r['bytes'] / 1e6:.1f} | {r['roofline_us']:.1f} | {100 * r['roofline_fraction']:.0f}% | "
                 f"{'ok' if r['ok'] else '**MISMATCH**'} ({r['check']}){'; ' + r['note'] if r['note'] else ''} |")
  broken = [r for r in rows if r.get("pallas_kernels_us")]
  if broken:
    lines += ["", "Kernels per call (us), from the trace:", ""]
    for r in broken:
      for side in ("pallas", "xla"):
        parts = ", ".join(f"{k[:60]} {v:.1f}" for k, v in r[f"{side}_kernels_us"].items())
        lines.append(f"- {r['kernel']} {r['config']} [{side}]: {parts}")
  return "\n".join(lines) + "\n"
