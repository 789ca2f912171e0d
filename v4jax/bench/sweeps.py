"""Tile sweeps of the GPU kernels: `v4jax bench kernels --tune` and `v4jax bench kernels --sweep NAME`.

The block sizes, warps and stages in pallas_kernels/ are the winners of these sweeps (see the comments there and
BENCHMARKS.md). Each sweep prints one line per config; a config the compiler rejects (registers, shared memory)
is reported, not fatal.

  --tune [--only topk indexer attention hc_weights]   decode-sized sweeps with the kernel benchmark's harness
                                                    (--harness, --iters, --repeats), and the top-k pipeline's
                                                    stages timed one by one          -> OUT/tune_kernels.json
  --sweep layer_linear        the decode projections (pallas_kernels/layer_linear.py) over blocks, warps, stages
                              and split-K target, Flash shapes at 1 and 32 tokens -> OUT/bench_layer_linear.json
  --sweep fused_projections   several projections of one input as one launch against one launch each
                                                                                 -> OUT/bench_fused_projections.json
  --sweep hc_post             mHC's expansion: XLA's form against the Pallas kernel -> OUT/bench_hc_post.json
  --sweep experts             few-token routed experts: XLA's gather form against pallas_kernels.experts
                                                                                 -> OUT/experts.json
  --sweep prefill_experts     a prefill chunk's routed experts: XLA dense / grouped against the Hopper ragged
                              matmul (--tokens M, default 8192)                 -> OUT/prefill_experts.json
  --sweep topk_prefill        the top-k of a prefill chunk's indexer scores (--tokens N --keys S --k K)
  --sweep attention_prefill   sparse attention on a prefill chunk per tile (--tokens T, --configs
                              HEADS:WARPS:BLOCK:STAGES:SKIP_TAIL ... for the per-query kernel,
                              prefix:TQ:HEADS:BLOCK:WARPS:STAGES[:PV_SPLIT] ... for the HCA layers'
                              dense_prefix_attention)                         -> OUT/attention_prefill.json
  --sweep indexer_prefill     indexer scores on a prefill chunk per tile (--tokens T --keys S)
  --sweep kv_formats          decode's sparse attention and indexer at 128K, batch 1 and 32 (--tokens B[,B]), on
                              bf16 pools against the FP8-entry / FP4-key byte pools (kv_cache_dtype="fp8")
                                                                                 -> OUT/kv_formats.json
  --sweep stored_weights      decode-sized projections (e4m3) and routed experts (FP4) as the release stores them,
                              against bf16                                       -> OUT/stored_weights.json
  --sweep streaming           the decode's weight-streaming kernels (projections, routed experts) against XLA's
                              matmul on the same bytes                        -> OUT/streaming.json
  --sweep fp4_experts         the FP4 routed experts a program an expert (dots) against a program a pair (token,
                              expert; no dot), over blocks and warps, at 1 / 4 / 32 tokens -> OUT/fp4_experts.json

`--small` (tune, layer_linear, fused_projections, hc_post, kv_formats, attention_prefill): tiny
shapes in interpret mode on a CPU, to check the code end to end; the numbers mean nothing there.
The other sweeps run on a GPU only.
Times are GPU kernel time from a profiler trace unless said otherwise.
"""
from __future__ import annotations

import functools
import importlib
import itertools
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

F32, BF16 = jnp.float32, jnp.bfloat16


class _RowLog:
    """A sweep's rows, the file `path` rewritten after each one (a run cut short by its time limit keeps what it
    measured) with the device, the JAX version and the sweep's own `fields`."""

    def __init__(self, path: str, **fields):
        self.path, self.fields, self.rows = path, fields, []

    def add(self, row: dict) -> None:
        self.rows.append(row)
        with open(self.path, "w") as fh:
            json.dump(dict(device=jax.devices()[0].device_kind, jax=jax.__version__, **self.fields, rows=self.rows),
                      fh, indent=1)

    def failed(self, row: dict, ex: Exception, tag: str) -> None:
        """A config the compiler cannot lower or fit: reported in its row, not fatal."""
        row["error"] = f"{type(ex).__name__}: {str(ex)[:300]}"
        print(f"{tag} failed {row['error'][:200]}", flush=True)
        self.add(row)


def _kb():
    from v4jax.bench import kernels
    return kernels


# ---- --tune: decode-sized tile sweeps with the kernel benchmark's harness ------------------------------------------

def _time(fn, args, a):
    KB = _kb()
    try:
        if a.harness == "trace":
            total, per_kernel = KB.time_trace(fn, args, repeats=a.repeats)
            if len(per_kernel) > 1:
                print("    kernels (us): " + ", ".join(f"{k[:48]} {v * 1e6:.1f}" for k, v in per_kernel.items()),
                      flush=True)
            return total * 1e6
        return KB.time_fn(fn, args, iters=a.iters, repeats=a.repeats, harness=a.harness) * 1e6
    except Exception as e:  # noqa: BLE001 - a config the compiler rejects (registers, shared memory) is reported
        return f"error: {type(e).__name__}: {str(e)[:200]}"


def _us(us, gbps=None):
    if isinstance(us, str):
        return us
    return f"{us:8.1f} us" + (f" {gbps:6.0f} GB/s" if gbps is not None else "")


def topk_stages(a, interp):
    TK = importlib.import_module("pallas_kernels.topk")
    rows = []
    shapes = [(1, 4096, 64), (4, 4096, 64)] if a.small else [(1, 262144, 512), (64, 262144, 512)]
    for N, S, k in shapes:
        x = jax.random.normal(jax.random.key(N), (N, S), F32)
        n_groups, cap = TK._threshold_params(S, k)
        c = -(-S // n_groups)
        gmax = jnp.max(x.reshape(N, c, n_groups), axis=1)
        tau = TK._kth_largest(gmax, k, interpret=interp)
        chunk = min(1024, n_groups)
        vals, idx, cnt = TK._compact(x, tau, cap, interpret=interp, chunk=chunk)
        eq = jnp.zeros_like(x)  # every score equal: every row overflows the buffer on ties at tau
        tau_eq = TK._kth_largest(jnp.max(eq.reshape(N, c, n_groups), axis=1), k, interpret=interp)
        eq_cands = TK._compact(eq, tau_eq, cap, interpret=interp, chunk=chunk)
        stages = {
            "harness overhead (x[:, :1] + 1)": (lambda x: x[:, :1] + 1, (x,)),
            "full pipeline (topk)": (lambda x: TK._topk_threshold(x, k, interpret=interp), (x,)),
            "lax.top_k (values + indices)": (lambda x: lax.top_k(x, k), (x,)),
            "topk_ref (XLA path)": (lambda x: TK.topk_ref(x[:, None], k), (x,)),
            "stage 1: strided group maxima": (lambda x: jnp.max(x.reshape(N, c, n_groups), axis=1), (x,)),
            "stage 2: k-th of group maxima (Pallas bisection)":
                (lambda g: TK._kth_largest(g, k, interpret=interp), (gmax,)),
            "alt stage 2: k-th of group maxima (lax.top_k)": (lambda g: lax.top_k(g, k)[0][:, k - 1], (gmax,)),
            "stage 3: compaction kernel":
                (lambda x, t: TK._compact(x, t, cap, interpret=interp, chunk=chunk), (x, tau)),
            "stage 4: overflow redo kernel (no row overflows)":
                (lambda x, t, v, i, n: TK._redo_overflow(x, t, v, i, n, k, interpret=interp, chunk=chunk),
                 (x, tau, vals, idx, cnt)),
            "stage 4: overflow redo kernel (every score equal)":
                (lambda x, t, v, i, n: TK._redo_overflow(x, t, v, i, n, k, interpret=interp, chunk=chunk),
                 (eq, tau_eq, *eq_cands)),
            "full pipeline (topk), every score equal": (lambda x: TK._topk_threshold(x, k, interpret=interp), (eq,)),
            "stage 5: rank-scatter kernel": (lambda v, i, n: TK._rank_scatter(v, i, n, k, interpret=interp),
                                             (vals, idx, cnt)),
            "alt stage 4+5: lax.cond(overflow) + lax.sort of the candidates":
                (lambda v, i, n: lax.cond(jnp.any(n > cap), lambda _: TK._order_and_pad(v * 2, i, k),
                                          lambda _: TK._order_and_pad(v, i, k), None), (vals, idx, cnt)),
        }
        for name, (fn, args) in stages.items():
            us = _time(fn, args, a)
            rows.append(dict(kernel="topk", shape=f"N={N} S={S} k={k}", config=name, us=us))
            print(f"topk N={N:3d} {name:62s} {_us(us)}", flush=True)
    return rows


def _ref_row(rows, case, a):
    us = _time(case.ref, case.args, a)
    rows.append(dict(kernel=case.kernel, shape=case.config, config="XLA reference", us=us,
                     GBps=case.bytes / (us * 1e3) if not isinstance(us, str) else None))
    print(f"{case.kernel} {case.config}: XLA reference {_us(us)}", flush=True)


def indexer_sweep(a, interp):
    IX = importlib.import_module("pallas_kernels.indexer")
    rows = []
    cases = [c for c in _kb().indexer_cases(a.small, interp) if c.kernel == "indexer_scores"
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
            print(f"indexer_scores {case.config:40s} sb={sb:3d} w={nw} s={ns} inner={ni}: {_us(us, gbps)}",
                  flush=True)
    return rows


def attention_sweep(a, interp):
    SA = importlib.import_module("pallas_kernels.sparse_attention")
    rows = []
    cases = _kb().attention_cases(a.small, interp)
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
                  f"{_us(us, gbps)}", flush=True)
    return rows


def hc_weights_sweep(a, interp):
    """mHC's weights from its mix at decode sizes (pallas_kernels.sinkhorn.hc_weights): tokens per program and warps
    (one token is a thread's 20 serial Sinkhorn iterations)."""
    SK = importlib.import_module("pallas_kernels.sinkhorn")
    rows = []
    grid = [(32, 1)] if a.small else list(itertools.product((32, 64, 128), (1, 2, 4)))
    for m in ((2,) if a.small else (1, 32, 256)):
        k = jax.random.split(jax.random.key(m), 4)
        args = (jax.random.normal(k[0], (m, 24), F32), 16384 * jnp.exp(0.3 * jax.random.normal(k[1], (m, 1), F32)),
                jax.random.normal(k[2], (3,), F32), jax.random.normal(k[3], (24,), F32))
        for block, nw in grid:
            if nw * 32 > block and not a.small:
                continue
            fn = functools.partial(lambda d, q, s, b, **kw: SK.hc_weights(d, q, 16384, 1e-6, s, b, **kw), n=4,
                                   iters=20, eps=1e-6, block=block, num_warps=nw, interpret=interp or None)
            us = _time(fn, args, a)
            rows.append(dict(kernel="hc_weights", shape=f"M={m}", config=dict(block=block, num_warps=nw), us=us))
            print(f"hc_weights M={m:4d} block={block:3d} w={nw}: {_us(us)}", flush=True)
    return rows


TUNE = {"topk": topk_stages, "indexer": indexer_sweep, "attention": attention_sweep,
        "hc_weights": hc_weights_sweep}


def tune(a, out_dir: str) -> int:
    """`--tune`: the sweeps of TUNE (a.only picks), written to out_dir/tune_kernels.json."""
    interp = jax.default_backend() == "cpu"
    t0 = time.time()
    bw = _kb().measure_bandwidth((64 << 20) if a.small else (4 << 30), repeats=5)
    print(f"device={jax.devices()[0].device_kind} jax={jax.__version__} copy bandwidth {bw / 1e9:.0f} GB/s",
          flush=True)
    rows = []
    for name, f in TUNE.items():
        if not a.only or name in a.only:
            rows += f(a, interp)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "tune_kernels.json"), "w") as fh:
        json.dump(dict(device=jax.devices()[0].device_kind, jax=jax.__version__, copy_GBps=bw / 1e9, iters=a.iters,
                       harness=a.harness, repeats=a.repeats, seconds=time.time() - t0, rows=rows), fh, indent=1)
    print(f"wrote {out_dir}/tune_kernels.json in {time.time() - t0:.0f} s")
    return 0


# ---- --sweep layer_linear -------------------------------------------------------------------------------------------

# (name, O, D, groups) of the Flash projections a decode step runs per layer
# (wkv [512, 4096] and the indexer's wq_b [8192, 1024] have the shapes of the first and third, halved / quartered)
LAYER_LINEAR_SHAPES = [("wq_a / compressor", 1024, 4096, 1), ("wq_b", 32768, 1024, 1),
                       ("wo_a (8 groups)", 8192, 4096, 8), ("wo_b", 4096, 8192, 1), ("shared w1 / w3", 2048, 4096, 1),
                       ("shared w2", 4096, 2048, 1)]


def layer_linear(a, out_dir: str) -> int:
    """The decode projections over their block sizes, warps, stages and split-K target. Each case reads a stack of
    layers one after another (as the layer scan does), so that the weights come from HBM, not L2; bytes = one
    layer's weight. Writes the table and the best config per case (after every case: a call cut short by its time
    limit keeps what it measured)."""
    from pallas_kernels import layer_linear as LL
    from v4jax.bench.profile import summarize

    def stack_for(o, d, groups, m):
        layers = 2 if a.small else max(4, -(-(256 << 20) // (o * d * 2)))  # >= 256 MB per stack: past the L2
        k = jax.random.split(jax.random.key(o + d + m), 2)
        w = (0.05 * jax.random.normal(k[0], (layers, o, d), F32)).astype(BF16)
        x = jax.random.normal(k[1], (m, groups, d) if groups > 1 else (m, d), BF16)
        return x, w, layers

    def save():
        with open(os.path.join(out_dir, "bench_layer_linear.json"), "w") as f:
            json.dump({"rows": rows, "best": best, "device": str(jax.devices()[0])}, f, indent=1)

    if a.small:
        shapes, tokens = [("small", 64, 256, 1), ("small grouped", 64, 256, 2)], [1]
        configs = [(16, 128, 4, 2, 264), (32, 128, 4, 2, 132)]
    else:
        shapes, tokens = LAYER_LINEAR_SHAPES, [1, 32]
        configs = list(itertools.product([16, 32, 64], [256, 512, 1024], [4, 8], [2], [264])) + \
            [(16, 512, 4, 3, 264), (32, 256, 4, 3, 264), (16, 512, 4, 2, 132), (16, 512, 4, 2, 528),
             (32, 256, 4, 2, 132), (32, 256, 4, 2, 528)]
    rows, best = [], {}
    for (name, o, d, g), m in itertools.product(shapes, tokens):
        x, w, layers = stack_for(o, d, g, m)
        mb = o * d * 2 / 1e6
        for r, c, nw, ns, mp in configs:
            def run(x, w, r=r, c=c, nw=nw, ns=ns, mp=mp, g=g, layers=layers):
                def body(i, acc):
                    y = LL.layer_linear(x, w, i, g, rows=r, cols=c, num_warps=nw, num_stages=ns, min_programs=mp)
                    return acc + y.reshape(-1)[:8].astype(F32)
                return lax.fori_loop(0, layers, body, jnp.zeros((8,), F32))
            fn = jax.jit(run)
            cfg = f"rows {r} cols {c} warps {nw} stages {ns} programs {mp}"
            try:
                s = summarize(lambda: jax.block_until_ready(fn(x, w)), repeats=2, top=4)
            except Exception as e:  # noqa: BLE001 - a block shape Triton refuses: say so, go on
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
        save()
    save()
    print("best per case:")
    for k, r in best.items():
        print(f"  {k}: {r['config']}: {r['us_per_layer']:.1f} us, {r['GB/s']:.0f} GB/s")
    return 0


# ---- --sweep fused_projections --------------------------------------------------------------------------------------

# (group, [(projection, O)]) of one Flash layer's decode step that read the same [tokens, D] input
FUSED_GROUPS = [("CSA attention input", [("wq_a", 1024), ("wkv", 512), ("compressor wkv", 1024),
                                         ("compressor wgate", 1024), ("indexer compressor wkv", 256),
                                         ("indexer compressor wgate", 256)]),
                ("HCA attention input", [("wq_a", 1024), ("wkv", 512), ("compressor wkv", 512),
                                         ("compressor wgate", 512)]),
                ("shared expert", [("w1", 2048), ("w3", 2048)])]


def fused_projections(a, out_dir: str) -> int:
    """Does one launch per group of decode projections that share an input beat one launch per projection? (It
    did: the ops table's `project` runs them so.) A group of projections of one input (a CSA layer's wq_a, wkv and
    the two compressors' wkv / wgate; the shared expert's w1 / w3) as separate launches on separate layer stacks,
    against one launch on the stacks concatenated along the outputs and one launch on the separate stacks
    (`layer_linears`: a program picks its weight by its block index), each over a stack of layers one after
    another (HBM, not L2), at 1 and 32 tokens: wall time per layer (median of calls) and, on a GPU, kernel time
    and launches per layer from a profiler trace (v4jax.bench.profile.time_call)."""
    from pallas_kernels import layer_linear as LL
    from v4jax.bench.profile import said, time_call

    def stacks(outs, d, m):
        total = sum(outs)
        layers = 2 if a.small else max(4, -(-(512 << 20) // (total * d * 2)))  # >= 512 MB per variant
        key = jax.random.split(jax.random.key(total + m), len(outs) + 1)
        sep = [(0.05 * jax.random.normal(k, (layers, o, d), F32)).astype(BF16) for k, o in zip(key[1:], outs)]
        return jax.random.normal(key[0], (m, d), BF16), sep, jnp.concatenate(sep, axis=1), layers

    def separate(x, sep, layers):
        def body(i, acc):
            return acc + sum(jnp.sum(LL.layer_linear(x, w, i)[:, :8], axis=0) for w in sep)
        return lax.fori_loop(0, layers, body, jnp.zeros((8,), F32))

    def fused(x, cat, outs, layers):
        def body(i, acc):
            y = LL.layer_linear(x, cat, i)
            starts = [sum(outs[:j]) for j in range(len(outs))]
            return acc + sum(jnp.sum(y[:, s:s + 8], axis=0) for s in starts)
        return lax.fori_loop(0, layers, body, jnp.zeros((8,), F32))

    def multi(x, sep, layers):
        def body(i, acc):
            return acc + sum(jnp.sum(y[:, :8], axis=0) for y in LL.layer_linears(x, sep, i))
        return lax.fori_loop(0, layers, body, jnp.zeros((8,), F32))

    d = 256 if a.small else 4096
    groups = [(g, [(n, o // 16) for n, o in p]) for g, p in FUSED_GROUPS[:1]] if a.small else FUSED_GROUPS
    rows = []
    for (group, projs), m in [(g, m) for g in groups for m in ((1,) if a.small else (1, 32))]:
        outs = [o for _, o in projs]
        x, sep, cat, layers = stacks(outs, d, m)
        mb = sum(outs) * d * 2 / 1e6
        f_sep = jax.jit(lambda x, sep, layers=layers: separate(x, sep, layers))
        f_cat = jax.jit(lambda x, cat, outs=outs, layers=layers: fused(x, cat, outs, layers))
        f_multi = jax.jit(lambda x, sep, layers=layers: multi(x, sep, layers))
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
        with open(os.path.join(out_dir, "bench_fused_projections.json"), "w") as f:
            json.dump({"rows": rows, "device": str(jax.devices()[0])}, f, indent=1, default=str)
    return 0


# ---- --sweep hc_post ------------------------------------------------------------------------------------------------

HC_POST_BLOCKS = [(16, 128, 4), (32, 128, 4), (16, 256, 8), (8, 512, 8)]  # (tokens, columns, warps) per program


def hc_post(a, out_dir: str) -> int:
    """mHC's expansion: the XLA form (a per-token [4, 4] x [4, D] matmul, v4jax.model.layers.hc_post) against the
    Pallas kernel (pallas_kernels/hc_post.py, over a few block shapes), at decode batches and on a prefill chunk
    of Flash's width, bf16: wall time per call (median) and, on a GPU, kernel time and launches per call from a
    profiler trace, with the bandwidth the bytes (f and x read, the output written) allow. The same inputs every
    call: at decode sizes they sit in the L2, as in the model; a prefill chunk's 600 MB do not."""
    from pallas_kernels import hc_post as HP
    from v4jax.bench.profile import said, time_call
    from v4jax.model import layers as L

    d = 256 if a.small else 4096
    rows = []
    for m in ((1, 5) if a.small else (1, 32, 8192)):
        k = jax.random.split(jax.random.key(m), 4)
        args = (jax.random.normal(k[0], (m, d), BF16), jax.random.normal(k[1], (m, 4, d), BF16),
                2 * jax.nn.sigmoid(jax.random.normal(k[2], (m, 4))),
                jax.nn.softmax(jax.random.normal(k[3], (m, 4, 4)), axis=-1))
        mb = m * 9 * d * 2 / 1e6  # f and x read, the output written
        row = {"tokens": m, "D": d, "MB_per_call": mb}
        variants = [("xla", L.hc_post)] + [
            (f"pallas {bm}x{bd} w{w}", functools.partial(HP.hc_post, block_tokens=bm, block_d=bd, num_warps=w))
            for bm, bd, w in (HC_POST_BLOCKS[:1] if a.small else HC_POST_BLOCKS)]
        for name, fn in variants:
            run = jax.jit(fn)
            row[name] = time_call(lambda run=run: run(*args), 3 if a.small else 10, mb=mb)
        rows.append(row)
        print(f"tokens {m}: " + "; ".join(said(n, row[n]) for n, _ in variants), flush=True)
        with open(os.path.join(out_dir, "bench_hc_post.json"), "w") as fh:
            json.dump({"rows": rows, "device": str(jax.devices()[0])}, fh, indent=1, default=str)
    return 0


def experts_case(M, k, E, I, D):
    """Tokens, uniform routing (k distinct experts per token) and the weights of E experts of Flash's sizes."""
    ks = jax.random.split(jax.random.key(0), 6)
    x = jax.random.normal(ks[0], (M, D), BF16)
    w1, w3 = (0.05 * jax.random.normal(kk, (E, I, D), BF16) for kk in ks[1:3])
    w2 = 0.05 * jax.random.normal(ks[3], (E, D, I), BF16)
    ex = jax.vmap(lambda kk: jax.random.permutation(kk, E)[:k])(jax.random.split(ks[4], M)).astype(jnp.int32)
    return x, jax.random.uniform(ks[5], (M, k)), ex, w1, w2, w3


def experts(a, out_dir: str) -> int:
    """Few-token routed experts (flash sizes: D 4096, I 2048, 6 active; E = 16 and 256, M = 1, 4, 32): XLA's gather
    form against pallas_kernels.experts over block sizes and warps. Bytes = each routed (token, expert) pair's
    three weight matrices once."""
    from pallas_kernels import experts as X
    from v4jax.bench.profile import summarize
    from v4jax.model import layers as L

    rows = []
    k, I, D = 6, 2048, 4096
    for E, M in [(16, 1), (256, 1), (256, 4), (256, 32)]:
        args = experts_case(M, k, E, I, D)
        gbytes = M * k * 3 * I * D * 2 / 1e9
        forms = {"xla_gather": jax.jit(lambda *a: L.routed_experts(*a, 10.0, form="gather"))}
        for (ur, uc), (dr, dc), nw, ns in itertools.product([(16, 512), (32, 256), (8, 1024)],
                                                            [(16, 512), (32, 256)], [4, 8], [2]):
            forms[f"pallas up{ur}x{uc} down{dr}x{dc} w{nw} s{ns}"] = jax.jit(
                lambda *a, u=(ur, uc), d=(dr, dc), nw=nw, ns=ns: X.routed_experts(
                    *a, 10.0, up=u, down=d, num_warps=nw, num_stages=ns))
        for name, fn in forms.items():
            try:
                s = summarize(lambda: jax.block_until_ready(fn(*args)), repeats=5, top=4)
            except Exception as e:  # noqa: BLE001 - a block shape Triton refuses: say so, go on
                rows.append({"E": E, "M": M, "form": name, "error": str(e)[:200]})
                continue
            ms = s.get("kernel_ms", float("nan"))
            rows.append({"E": E, "M": M, "form": name, "kernel_ms": ms, "kernels": s.get("kernels"),
                         "GB/s": gbytes / ms * 1e3 if ms else None, "top": s.get("top")})
            print(f"E={E} M={M} {name}: {ms:.4f} ms, {gbytes / ms * 1e3:.0f} GB/s", flush=True)
    with open(os.path.join(out_dir, "experts.json"), "w") as f:
        json.dump(rows, f, indent=1)
    return 0


def prefill_experts(a, out_dir: str) -> int:
    """A prefill chunk's routed experts (flash sizes: D 4096, I 2048, 16 experts, 6 active; --tokens M, default
    8192) with skewed routing (as a router gives): XLA's dense form (every expert over every token) and grouped
    form against the grouped form on JAX's Hopper ragged matmul (ragged_dot_mgpu, block sizes swept); FLOPs = the
    routed (token, expert) pairs' three matmuls."""
    from pallas_kernels import experts_grouped as G
    from v4jax.bench.profile import summarize
    from v4jax.model import layers as L

    def case(M, k, E, I, D):
        x, _, _, w1, w2, w3 = experts_case(M, k, E, I, D)
        ks = jax.random.split(jax.random.key(1), 2)
        logits = jax.random.normal(ks[0], (M, E)) + 2.0 * jax.random.normal(ks[1], (E,))
        w, ex = jax.lax.top_k(jax.nn.softmax(logits), k)
        return x, w, ex.astype(jnp.int32), w1, w2, w3

    k, E, I, D = 6, 16, 2048, 4096
    rows = []
    for M in a.tokens or [8192]:
        args = case(M, k, E, I, D)
        tflop = M * k * 3 * 2 * I * D / 1e12
        ref = jax.jit(lambda *a: L.routed_experts(*a, 10.0, form="dense"))(*args)
        forms = {"xla_dense": jax.jit(lambda *a: L.routed_experts(*a, 10.0, form="dense")),
                 "xla_grouped": jax.jit(lambda *a: L.routed_experts(*a, 10.0, form="grouped"))}
        for bm, bn, steps, gbn in [(128, 128, 4, 4), (128, 128, 4, 8), (128, 128, 4, 16), (128, 128, 6, 4),
                                   (128, 128, 3, 8), (128, 64, 4, 8), (64, 128, 4, 8)]:
            cfg = G.Blocks(bm, bn, 64, steps, gbn)
            forms[f"mgpu m{bm} n{bn} s{steps} g{gbn}"] = jax.jit(
                lambda *a, cfg=cfg: G.routed_experts(*a, 10.0, blocks=cfg))
        for name, fn in forms.items():
            try:
                out = fn(*args)
                err = float(jnp.max(jnp.abs(out - ref)) / jnp.max(jnp.abs(ref)))
                s = summarize(lambda: jax.block_until_ready(fn(*args)), repeats=3, top=6)
            except Exception as e:  # noqa: BLE001 - a block shape the compiler refuses (shared memory)
                rows.append({"M": M, "form": name, "error": str(e)[:300]})
                print(f"M={M} {name}: error {str(e)[:200]}", flush=True)
                continue
            ms = s.get("kernel_ms", float("nan"))
            rows.append({"M": M, "form": name, "kernel_ms": ms, "TFLOP/s": tflop / ms * 1e3, "rel_err": err,
                         "top": s.get("top")})
            print(f"M={M} {name}: {ms:.3f} ms, {tflop / ms * 1e3:.0f} TFLOP/s (routed FLOPs), rel err {err:.2e}",
                  flush=True)
    with open(os.path.join(out_dir, "prefill_experts.json"), "w") as f:
        json.dump({"device": str(jax.devices()[0]), "jax": jax.__version__, "rows": rows}, f, indent=1)
    return 0


# ---- --sweep topk_prefill, attention_prefill, indexer_prefill -------------------------------------------------------

def topk_prefill(a, out_dir: str) -> int:
    """The GPU top-k on a prefill chunk's indexer scores: by default the last 8192-token chunk of a 128K prompt
    (--tokens 8192 rows of --keys 32768 scores, each row's scores past its causal n_valid -inf, --k 512), with the
    candidates ordered by one XLA sort of each row's (what `topk` does from _SORT_ROWS rows on) and by the
    rank-and-scatter kernel (what it does for fewer rows), per kernel. Both checked against the reference."""
    TK = importlib.import_module("pallas_kernels.topk")
    N = (a.tokens or [8192])[0]
    S, K = a.keys or 32768, a.k or 512
    x = jax.random.normal(jax.random.key(0), (1, N, S), F32)
    n_valid = (4 * S - N + jnp.arange(N) + 1) // 4
    scores = jnp.where(jnp.arange(S)[None, None, :] < n_valid[None, :, None], x, -jnp.inf)
    ref = np.asarray(jax.jit(TK.topk_ref, static_argnums=1)(scores, K))
    sort_rows = TK._SORT_ROWS
    try:
        for name, rows in (("threshold + sort of the candidates (now: from TK._SORT_ROWS rows)", sort_rows),
                           ("threshold + rank-and-scatter", N + 1)):
            TK._SORT_ROWS = rows                      # read when traced: each form is a fresh function
            fn = lambda s: TK.topk(s, K)  # noqa: E731
            out = np.asarray(jax.jit(fn)(scores))
            sec, per_kernel = _kb().time_trace(fn, (scores,), repeats=3)
            stages = ", ".join(f"{k[:40]} {v * 1e3:.2f}"
                               for k, v in sorted(per_kernel.items(), key=lambda kv: -kv[1])[:6])
            print(f"{name}: {sec * 1e3:7.2f} ms  equal to the reference: {bool(np.array_equal(out, ref))}\n"
                  f"    ms by kernel: {stages}", flush=True)
    finally:
        TK._SORT_ROWS = sort_rows
    return 0


def _prefill_configs(specs, small):
    """--configs of attention_prefill: HEADS:WARPS:BLOCK:STAGES:SKIP_TAIL (the per-query kernel) and
    prefix:TQ:HEADS:BLOCK:WARPS:STAGES[:PV_SPLIT] (dense_prefix_attention); default: a built-in grid."""
    today, prefix = [], []
    for c in specs or []:
        if c.startswith("prefix:"):
            v = [int(x) for x in c.split(":")[1:]]
            prefix.append(tuple(v) + (1,) * (6 - len(v)))
        else:
            today.append(tuple(int(x) for x in c.split(":")))
    if specs:
        return today, prefix
    if small:
        return [(16, 4, 16, 2, 0), (16, 4, 16, 2, 1)], [(4, 16, 16, 4, 2, 1), (2, 8, 16, 4, 2, 0)]
    # around the H200's best (docs/results/h200-attention-prefill): the split p @ v (PV_SPLIT 1) and 64 heads a
    # program spilled (35-96 ms against 5-10), so the grid holds neither
    today = [(16, 4, 64, 2, 0), (32, 8, 64, 2, 0), (16, 4, 64, 2, 1), (32, 8, 64, 2, 1)]
    prefix = [(4, 16, 64, 8, 2, 0), (4, 16, 64, 4, 2, 0), (4, 16, 64, 8, 3, 0), (2, 16, 64, 4, 2, 0),
              (8, 16, 64, 8, 2, 0), (2, 32, 64, 8, 2, 0), (4, 16, 32, 8, 2, 0), (8, 8, 64, 8, 2, 0)]
    return today, prefix


def attention_prefill(a, out_dir: str) -> int:
    """The GPU sparse-attention kernels on a prefill chunk: by default the last 8192-token chunk (--tokens) of a
    128K prompt, 64 heads x 512, per tile, against the XLA reference's outputs. Three cases: a CSA layer (each
    query's 128-token window + 512 selected entries of 32768), an HCA layer (the window + every entry closed before
    the query: 960-1024 of them, n_ready rising along the chunk, valid as a prefix), and an HCA chunk ending at 72K
    with rows as wide as the 128K bucket's (where skipping the blocks past a query's last valid row, skip_tail,
    pays). Kernels: the per-query `_sparse_attention_gpu` (--configs HEADS:WARPS:BLOCK:STAGES:SKIP_TAIL) on every
    case and, on the HCA cases, `dense_prefix_attention` (--configs prefix:TQ:HEADS:BLOCK:WARPS:STAGES[:PV_SPLIT]),
    each as the model calls it: on an HCA case the per-query kernel's rows are built from the chunk's window union
    and n_ready inside the timed call (`dense_prefix_rows`, what ops._attend_pallas does), the kernel's own time
    reported beside. Each output is checked against the reference (max |err|) and, for dense_prefix_attention,
    against the per-query kernel's with skip_tail (max |diff|). TFLOP/s counts the valid rows (QK and PV).
    --small: tiny shapes in interpret mode on a CPU (numbers meaningless). -> OUT/attention_prefill.json"""
    SA = importlib.import_module("pallas_kernels.sparse_attention")
    interp = jax.default_backend() == "cpu"
    if a.small:
        T, H, D, W, ctx, n_sel, ratio = (a.tokens or [64])[0], 20, 64, 16, 2048, 32, 128
    else:
        T, H, D, W, ctx, n_sel, ratio = (a.tokens or [8192])[0], 64, 512, 128, 131072, 512, 128
    today_cfgs, prefix_cfgs = _prefill_configs(a.configs, a.small)
    repeats = a.repeats or (1 if a.small else 3)
    B = 1
    ks = jax.random.split(jax.random.key(0), 6)
    q = jax.random.normal(ks[0], (B, T, H, D), BF16)
    sink = jax.random.normal(ks[1], (H,), F32)
    swa = jax.random.normal(ks[2], (ctx, D), BF16)                    # one row per position (a page table of 1s)

    def union(end):   # the window union of the chunk ending at `end`: positions end - T - W + 1 .. end - 1
        p = end - T - W + 1 + jnp.arange(T + W - 1)
        return jnp.where(p >= 0, p, -1).astype(jnp.int32)[None]

    n_csa, n_hca = ctx // 4, ctx // ratio
    csa = jax.random.normal(ks[3], (n_csa, D), BF16)
    sel = jax.random.randint(ks[4], (T, n_sel), 0, n_csa)
    hca = jax.random.normal(ks[5], (n_hca, D), BF16)
    hca_rows = jnp.arange(n_hca, dtype=jnp.int32)[None]
    pos = ctx - T + jnp.arange(T)                                     # the chunk's positions
    mid = ctx * 9 // 16 - T + jnp.arange(T)   # a chunk ending at 72K (of 128K) whose rows are as wide as 128K's
    csa_win, _ = SA.dense_prefix_rows(union(ctx), hca_rows, jnp.zeros((B, T), jnp.int32), T, W)
    # HCA: (q, swa, win_rows [B, T+W-1], kv, hca_rows [B, S], n_ready [B, T], sink), as ops.attend gets them
    hca_cases = {"hca": (q, swa, union(ctx), hca, hca_rows, ((pos + 1) // ratio).astype(jnp.int32)[None], sink),
                 "hca-mid": (q, swa, union(ctx * 9 // 16), hca, hca_rows,
                             ((mid + 1) // ratio).astype(jnp.int32)[None], sink)}
    scale = D ** -0.5
    log = _RowLog(os.path.join(out_dir, "attention_prefill.json"), tokens=T, heads=H, dim=D, window=W, context=ctx,
                  repeats=repeats)
    rows_out = log.rows

    def measure(row, fn, args, flops, ref, other=None):
        """Runs fn(*args), checks it against ref (and other), times it; one row of the JSON. Returns the output."""
        tag = f"  {row['case']} {row['kernel']} " + " ".join(f"{k}={v}" for k, v in row["config"].items()) + ":"
        try:
            out = np.asarray(jax.jit(fn)(*args).astype(F32))
            row["max_err"] = float(np.max(np.abs(out - ref)))
            if other is not None:
                row["max_diff_per_query_kernel"] = float(np.max(np.abs(out - other)))
            sec, per_kernel = _kb().time_trace(fn, args, repeats=repeats)
        except Exception as ex:  # noqa: BLE001 - a tile Triton cannot lower or fit is reported, not fatal
            log.failed(row, ex, tag)
            return None
        top = max(per_kernel.items(), key=lambda kv: kv[1]) if per_kernel else ("", sec)
        row.update(ms=sec * 1e3, kernel_ms=top[1] * 1e3, tflops=flops / sec / 1e12,
                   kernels_ms={k: v * 1e3 for k, v in per_kernel.items()})
        diff = f"  vs per-query {row['max_diff_per_query_kernel']:.2e}" if other is not None else ""
        print(f"{tag} {sec * 1e3:7.2f} ms (kernel {top[1] * 1e3:7.2f}) {flops / sec / 1e12:6.1f} TFLOP/s  "
              f"max err {row['max_err']:.2e}{diff}", flush=True)
        log.add(row)
        return out

    cases = {"csa": None, **hca_cases}
    for name in cases:
        if name == "csa":
            rc = jnp.where(sel < ((pos + 1) // 4)[:, None], sel, -1).astype(jnp.int32)[None]
            rows_args = (q, swa, csa_win, csa, rc, sink)
            to_rows = None
        else:
            _, _, win, kv, hr, nr, _ = hca_cases[name]
            rw, rc = SA.dense_prefix_rows(win, hr, nr, T, W)
            rows_args = (q, swa, rw, kv, rc, sink)

            def to_rows(f):   # the per-query kernel on an HCA chunk as ops._attend_pallas calls it
                def g(q, swa, win, kv, hr, nr, sink):
                    rw, rc = SA.dense_prefix_rows(win, hr, nr, T, W)
                    return f(q, swa, rw, kv, rc, sink)
                return g
        n_rows = int(np.asarray((rows_args[2] >= 0).sum() + (rows_args[4] >= 0).sum()))
        flops = 4 * n_rows * H * D
        ref_fn = jax.jit(functools.partial(SA.sparse_attention_ref, scale=scale))
        sl = lambda x, i: x[:, i:i + 512]  # noqa: E731
        ref = np.concatenate([np.asarray(ref_fn(sl(rows_args[0], i), rows_args[1], sl(rows_args[2], i), rows_args[3],
                                                sl(rows_args[4], i), rows_args[5]).astype(F32))
                              for i in range(0, T, 512)], axis=1)
        print(f"{name}: T={T} valid rows {n_rows / 1e6:.2f} M, {flops / 1e12:.3f} TFLOP", flush=True)
        per_query = None
        for hb, nw, blk, ns, skip in today_cfgs:
            fn = functools.partial(SA._sparse_attention_gpu, scale=scale, heads=hb, num_warps=nw, block=blk,
                                   num_stages=ns, skip_tail=bool(skip), interpret=interp)
            row = dict(case=name, kernel="per-query",
                       config=dict(heads=hb, warps=nw, block=blk, stages=ns, skip_tail=skip))
            if to_rows is None:
                measure(row, fn, rows_args, flops, ref)
            else:
                out = measure(row, to_rows(fn), hca_cases[name], flops, ref)
                if skip and per_query is None:
                    per_query = out
        if to_rows is None:
            continue
        if per_query is None:   # the per-query kernel as the model runs it, to compare with
            fn = to_rows(functools.partial(SA._sparse_attention_gpu, scale=scale, skip_tail=True, interpret=interp))
            per_query = np.asarray(jax.jit(fn)(*hca_cases[name]).astype(F32))
        for tq, hb, blk, nw, ns, split in prefix_cfgs:
            fn = functools.partial(SA.dense_prefix_attention, scale=scale, window=W, q_block=tq, heads=hb, block=blk,
                                   num_warps=nw, num_stages=ns, pv_split=bool(split), interpret=interp)
            row = dict(case=name, kernel="dense-prefix",
                       config=dict(q_block=tq, heads=hb, block=blk, warps=nw, stages=ns, pv_split=split))
            measure(row, fn, hca_cases[name], flops, ref, per_query)

    print("\nbest per case (ms, the whole call):")
    ok = True
    for name in cases:
        for kern in ("per-query", "dense-prefix"):
            got = [r for r in rows_out if r["case"] == name and r["kernel"] == kern and "ms" in r]
            if got:
                best = min(got, key=lambda r: r["ms"])
                print(f"  {name:8s} {kern:13s} {best['ms']:7.2f} ms  {best['config']}", flush=True)
        ok = ok and all("error" not in r for r in rows_out if r["case"] == name)
    print(f"wrote {out_dir}/attention_prefill.json")
    return 0 if ok or not a.small else 1


def indexer_prefill(a, out_dir: str) -> int:
    """The GPU indexer-scores kernel on a prefill chunk: by default the last 8192-token chunk (--tokens) of a 128K
    prompt (--keys 32768 compressed keys, 64 heads x 128, each query's keys up to its causal n_valid), per tile,
    against the XLA reference's outputs. TFLOP/s counts valid (query, key) pairs."""
    IX = importlib.import_module("pallas_kernels.indexer")
    T = (a.tokens or [8192])[0]
    S = a.keys or 32768
    Hi, Di, B = 64, 128, 1
    ks = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(ks[0], (B, T, Hi, Di), BF16)
    w = jax.random.normal(ks[1], (B, T, Hi), F32) * Hi ** -0.5
    pool = jax.random.normal(ks[2], (S, Di), BF16)
    rows = jnp.arange(S, dtype=jnp.int32)[None]
    pos = 4 * S - T + jnp.arange(T)                    # the chunk's positions; 4x-compressed keys closed so far
    n_valid = ((pos + 1) // 4).astype(jnp.int32)[None]
    args = (q, w, pool, rows, n_valid)
    pairs = int(np.asarray(n_valid).sum())
    flops = 2 * pairs * Hi * Di
    ref_fn = jax.jit(IX.indexer_scores_ref)   # by slices of queries: the whole chunk's logits would be 68 GB
    ref = np.concatenate([np.asarray(ref_fn(q[:, i:i + 512], w[:, i:i + 512], pool, rows, n_valid[:, i:i + 512]))
                          for i in range(0, T, 512)], axis=1)
    ok = np.isfinite(ref)
    print(f"T={T} S={S} valid pairs {pairs / 1e6:.1f} M, {flops / 1e12:.3f} TFLOP", flush=True)
    for cfg in [dict(tq=tq, num_warps=nw, num_stages=ns) for tq in (16, 32, 64) for nw in (4, 8) for ns in (2, 3)]:
        fn = functools.partial(IX._indexer_scores_gpu, **cfg)
        try:
            out = np.asarray(jax.jit(fn)(*args))
            err = float(np.max(np.abs(out[ok] - ref[ok]))) if ok.any() else 0.0
            same_mask = bool(np.array_equal(np.isfinite(out), ok))
            sec, _ = _kb().time_trace(fn, args, repeats=3)
            print(f"{cfg}: {sec * 1e3:7.2f} ms {flops / sec / 1e12:6.1f} TFLOP/s  max err {err:.2e} "
                  f"mask {same_mask}", flush=True)
        except Exception as e:  # noqa: BLE001 - a config Triton cannot lower is reported, not fatal
            print(f"{cfg}: failed {type(e).__name__}: {str(e)[:200]}", flush=True)
    return 0


def stored_weights(a, out_dir: str) -> int:
    """Weights as the release stores them against bf16 (flash sizes), the device time of each kernel call:
    the routed experts (D 4096, I 2048, 6 active; E = 16 and 256, M = 1 and 32) through pallas_kernels.experts'
    bf16 kernels and its FP4 kernels (block sizes, warps), and the few-token projection (pallas_kernels.layer_linear)
    on bf16 and on e4m3 stacks. (Measured and dropped: widening the codes through f16 bit placement, with the
    scales broadcast in registers (its up kernel 0.43 ms a call in a flash-slice step at batch 1) or on each scale
    block's dot, in jnp or inline PTX (routed_experts_fp4's doc); the codes decoded through a 256-entry byte table,
    1.7-2.1x the bit form's time.) GB/s = the bytes each form reads as stored (the routed pairs' weights once)."""
    from pallas_kernels import experts as X
    from pallas_kernels import layer_linear as LL
    from v4jax.bench.profile import summarize
    from v4jax.model import quant

    def timed(name, fn, args, gbytes, **key):
        try:
            s = summarize(lambda: jax.block_until_ready(fn(*args)), repeats=5, top=4)
        except Exception as e:  # noqa: BLE001 - a block shape Triton refuses: say so, go on
            rows.append(dict(key, form=name, error=str(e)[:200]))
            print(f"{key} {name}: {str(e)[:200]}", flush=True)
            return
        ms = s.get("kernel_ms", float("nan"))
        rows.append(dict(key, form=name, kernel_ms=ms, kernels=s.get("kernels"), gbps=gbytes / ms * 1e3,
                         top=s.get("top")))
        print(f"{key} {name}: {ms:.4f} ms, {gbytes / ms * 1e3:.0f} GB/s", flush=True)

    rows = []
    k, I, D = 6, 2048, 4096
    w2_input = lambda h, w: quant.fp8_roundtrip((h * w).astype(BF16), 128)
    for E, M in [(16, 1), (16, 32), (256, 1), (256, 32)]:
        x, wt, ex, w1, w2, w3 = experts_case(M, k, E, I, D)
        pairs = len(set(np.asarray(ex).reshape(-1).tolist())) if E == 16 else M * k
        per_expert = 3 * I * D
        timed("bf16", jax.jit(lambda *a: X.routed_experts(*a, 10.0)), (x, wt, ex, w1, w2, w3),
              pairs * per_expert * 2 / 1e9, E=E, M=M)
        st = [quant.Quantized(*quant.quantize(w, "fp4"), "fp4") for w in (w1, w2, w3)]
        st_args = (quant.fp8_roundtrip(x, 128), wt, ex, *[(q.values, q.scale) for q in st])
        del w1, w2, w3
        gb = pairs * per_expert * (0.5 + 1 / 32) / 1e9
        for (ur, uc), (dr, dc), nw in [((32, 256), (32, 256), 4), ((16, 512), (16, 512), 4),
                                      ((64, 128), (64, 128), 4), ((32, 128), (32, 128), 4), ((32, 256), (32, 256), 2)]:
            timed(f"fp4 up{ur}x{uc} down{dr}x{dc} w{nw}", jax.jit(
                lambda x, wt, ex, a1, a2, a3, u=(ur, uc), d=(dr, dc), nw=nw: X.routed_experts_fp4(
                    x, wt, ex, a1, a2, a3, 10.0, w2_input, up=u, down=d, num_warps=nw)), st_args, gb, E=E, M=M)
    for O, Din, G, M in [(1024, 4096, 1, 1), (1024, 4096, 1, 32), (32768, 1024, 1, 1), (8192, 4096, 8, 1),
                         (8192, 4096, 8, 32)]:
        kx, kw = jax.random.split(jax.random.key(1))
        x = quant.fp8_roundtrip(jax.random.normal(kx, (M, G, Din) if G > 1 else (M, Din), jnp.float32), 128)
        w = jax.random.normal(kw, (2, O, Din), jnp.float32) * Din ** -0.5
        q = quant.Quantized(*quant.quantize(w, "fp8"), "fp8")
        key = dict(O=O, D=Din, G=G, M=M)
        timed("linear bf16", jax.jit(lambda x, w: LL.layer_linear(x, w, 1, G)), (x.astype(BF16), w.astype(BF16)),
              O * Din * 2 / 1e9, **key)
        timed("linear fp8", jax.jit(lambda x, v, s: LL.layer_linear(x, v, 1, G, scale=s[1])),
              (x.astype(BF16), q.values, q.scale), O * Din * (1 + 1 / 128 ** 2) / 1e9, **key)
    with open(os.path.join(out_dir, "stored_weights.json"), "w") as f:
        json.dump(rows, f, indent=1)
    return 0


def kv_formats(a, out_dir: str) -> int:
    """Decode reads of the KV pools at 128K, Flash shapes, at batch 1 and 32: the pools in bf16 against the release's
    byte formats (kv_cache_dtype="fp8": FP8 entries of 584 B against 1,024, FP4 indexer keys of 68 B against 256);
    --tokens B[,B] picks the batches.
    Cases: a CSA layer's sparse attention (64 heads x 512; its 128-entry window + 512 of 32,768 entries selected),
    an HCA layer's (the window + all 1,024 entries) and the indexer scores (64 heads x 128 over 32,768 keys in
    pages of 64). Forms: what the model runs on a GPU on each pool (the Triton kernels; on FP8 entries the gathered
    rows decoded by XLA, then the bf16 pools' kernel, see pallas_kernels.sparse_attention), the attention's XLA
    reference on FP8 entries and the indexer's on FP4 keys;
    Each call runs over several
    layers one after another (unrolled: no loop's kernels in the time), their rows apart in one flat pool as the
    model's are, so that >= ~100 MB are read per call and the reads come from HBM, not from the 50 MB L2 (batch 1: 256
    attention / 128 indexer layers); time = GPU kernel time per layer from a profiler trace; GB/s = the bytes a
    layer must read (rows or keys, their ids, q and o or the scores) / time. Every form is checked against the
    reference on the same pools (max |err| relative to max |ref|). --small: tiny shapes in interpret mode on a CPU.
    -> OUT/kv_formats.json"""
    from pallas_kernels import kv_format
    SA = importlib.import_module("pallas_kernels.sparse_attention")
    IX = importlib.import_module("pallas_kernels.indexer")
    interp = jax.default_backend() == "cpu"
    if a.small:
        H, D, rope, W, K, n_c4, Hi, Di, batches, reach, reach_ix = 16, 128, 64, 16, 32, 256, 16, 32, (1,), 2, 2
    else:
        H, D, rope, W, K, n_c4, Hi, Di, batches, reach, reach_ix = 64, 512, 64, 128, 512, 32768, 64, 128, \
            tuple(a.tokens or (1, 32)), 256, 128
    n_hca, page = n_c4 // 32, 64            # 1,024 HCA entries at 128K (one per 128 tokens); 64 keys a 256-token page
    ent, key = kv_format.Fp8Entry(D, rope), kv_format.Fp4Key(Di)
    repeats = a.repeats or (1 if a.small else 3)
    rows_out = []

    def encode(fmt, x):   # by chunks of rows: the whole pool's f32 temporaries would not fit
        n = x.shape[0]
        c = int(np.gcd(n, 4096))
        return jax.jit(lambda x: lax.map(fmt.encode, x.reshape(n // c, c, -1)).reshape(n, fmt.nbytes))(x)

    def save():   # after every form: a run cut short by its time limit keeps what it measured
        with open(os.path.join(out_dir, "kv_formats.json"), "w") as fh:
            json.dump(dict(device=jax.devices()[0].device_kind, jax=jax.__version__, repeats=repeats, rows=rows_out),
                      fh, indent=1)

    def measure(case, B, L, name, fn, args, per_layer, ref):
        """fn(*args) -> one output per layer (the first one checked against ref; the compiled call is timed)."""
        try:
            out = np.asarray(jax.jit(fn)(*args)[0].astype(F32)).astype(np.float64)
            fin = np.isfinite(ref)
            err = float(np.max(np.abs(out[fin] - ref[fin])) / max(np.max(np.abs(ref[fin])), 1e-30))
            same_inf = bool(np.array_equal(np.isfinite(out), fin))
            sec, per_kernel = _kb().time_trace(fn, args, repeats=repeats)
        except Exception as e:  # noqa: BLE001 - a form the compiler rejects is reported, not fatal
            rows_out.append(dict(case=case, batch=B, form=name, error=f"{type(e).__name__}: {str(e)[:300]}"))
            print(f"{case} B={B} {name}: failed {type(e).__name__}: {str(e)[:300]}", flush=True)
            save()
            return
        us = sec / L * 1e6
        top = ", ".join(f"{k[:40]} {v / L * 1e6:.1f}" for k, v in list(per_kernel.items())[:3])
        rows_out.append(dict(case=case, batch=B, form=name, layers=L, us_per_layer=us, MB_per_layer=per_layer / 1e6,
                             GBps=per_layer / us / 1e3, max_rel_err=err, same_inf=same_inf,
                             kernels_us_per_layer={k: v / L * 1e6 for k, v in per_kernel.items()}))
        print(f"{case} B={B:2d} {name:28s} {us:8.1f} us/layer {per_layer / 1e6:7.2f} MB "
              f"{per_layer / us / 1e3:6.0f} GB/s  err {err:.1e}{'' if same_inf else ' INF PATTERN DIFFERS'}  [{top}]",
              flush=True)
        save()

    for B in batches:
        ks = jax.random.split(jax.random.key(B), 12)
        L = max(1, reach // B)
        q = jax.random.normal(ks[0], (B, 1, H, D), BF16)
        sink = jax.random.normal(ks[1], (H,), F32)
        swa = jax.random.normal(ks[2], (L * B * W, D), BF16)
        swa8 = encode(ent, swa)
        req = (jnp.arange(L)[:, None] * B + jnp.arange(B)[None, :])[:, :, None, None]     # [L, B, 1, 1]
        win = (req * W + jnp.arange(W)).astype(jnp.int32)
        for kind, n_cmp in (("csa", n_c4), ("hca", n_hca)):
            cmp = jax.random.normal(ks[3], (L * B * n_cmp, D), BF16)
            cmp8 = encode(ent, cmp)
            sel = (jax.random.randint(ks[4], (L, B, 1, K), 0, n_cmp) if kind == "csa"
                   else jnp.broadcast_to(jnp.arange(n_cmp), (L, B, 1, n_cmp)))
            sel = (req * n_cmp + sel).astype(jnp.int32)
            wins, sels = list(win), list(sel)
            n_rows = W + sel.shape[-1]
            scale = D ** -0.5
            case = f"attention {kind}"
            ref32 = jax.jit(functools.partial(SA.sparse_attention_ref, scale=scale, return_lse=True))
            # as the model calls them (an HCA layer's rows end where its -1s begin: valid_prefix)
            gpu_kw = dict(scale=scale, interpret=interp, skip_tail=kind == "hca")
            forms = [
                ("bf16 pool (Triton)", functools.partial(SA._sparse_attention_gpu, **gpu_kw),
                 swa, cmp, D * 2, ref32(q, swa, wins[0], cmp, sels[0], sink)[0]),
                ("fp8 entries (XLA reference)", functools.partial(SA.sparse_attention_ref, scale=scale,
                                                                  entry_format=ent),
                 swa8, cmp8, ent.nbytes, None),
                ("fp8 entries (decoded, Triton)",   # what a GPU runs: the gathered rows decoded, the bf16 kernel
                 lambda q, sp, w, cp, c, sink: SA._sparse_attention_gpu(
                     q, *kv_format.decoded_pool(sp, w, ent, q.dtype), *kv_format.decoded_pool(cp, c, ent, q.dtype),
                     sink, **gpu_kw),
                 swa8, cmp8, ent.nbytes, None),
            ]
            ref8 = np.asarray(jax.jit(functools.partial(SA.sparse_attention_ref, scale=scale, return_lse=True,
                                                        entry_format=ent))(q, swa8, wins[0], cmp8, sels[0], sink)[0])
            for name, f, sp, cp, row_bytes, ref in forms:
                f = jax.jit(f)   # one layer's call lowered once, not once per layer (a Triton call takes ~0.25 s)
                ref = np.asarray(ref, np.float64) if ref is not None else ref8.astype(np.float64)
                per_layer = B * n_rows * (row_bytes + 4) + 2 * B * H * D * 2
                measure(case, B, L, name,
                        lambda q, sink, sp, cp, wins, sels, f=f: [f(q, sp, w, cp, c, sink) for w, c in zip(wins, sels)],
                        (q, sink, sp, cp, wins, sels), per_layer, ref)
            del cmp, cmp8
        del swa, swa8

        L = max(1, reach_ix // B)
        iq = jax.random.normal(ks[5], (B, 1, Hi, Di), BF16)
        w = jax.random.normal(ks[6], (B, 1, Hi), F32) * Hi ** -0.5
        keys = jax.random.normal(ks[7], (L * B * n_c4, Di), BF16)
        keys4 = encode(key, keys)
        n_pages = B * n_c4 // page              # a layer's pages, drawn at random for its requests
        perm = jnp.argsort(jax.random.uniform(ks[8], (L, n_pages)), axis=-1).reshape(L, B, n_c4 // page)
        krows = ((jnp.arange(L)[:, None, None] * n_pages + perm)[..., None] * page + jnp.arange(page))
        krows = list(krows.reshape(L, B, n_c4).astype(jnp.int32))
        n_valid = jnp.full((B, 1), n_c4, jnp.int32)
        ref = np.asarray(jax.jit(IX.indexer_scores_ref)(iq, w, keys, krows[0], n_valid), np.float64)
        ref4 = np.asarray(jax.jit(functools.partial(IX.indexer_scores_ref, key_format=key))(iq, w, keys4, krows[0],
                                                                                             n_valid), np.float64)
        for name, f, pool, key_bytes, r in [
                ("bf16 keys (Triton)", functools.partial(IX._indexer_scores_gpu, interpret=interp), keys, Di * 2, ref),
                ("fp4 keys (Triton)", functools.partial(IX._indexer_scores_gpu, interpret=interp, key_format=key),
                 keys4, key.nbytes, ref4),
                ("fp4 keys (XLA reference)", functools.partial(IX.indexer_scores_ref, key_format=key), keys4,
                 key.nbytes, ref4)]:
            f = jax.jit(f)
            per_layer = B * n_c4 * (key_bytes + 4 + 4) + B * Hi * (Di * 2 + 4)
            measure("indexer scores", B, L, name,
                    lambda iq, w, pool, krows, nv, f=f: [f(iq, w, pool, r, nv) for r in krows],
                    (iq, w, pool, krows, n_valid), per_layer, r)
        del keys, keys4

    print("\nper layer, us (the bf16 pool's time / the form's): the bf16 pool -> each form on the byte formats")
    for case, B in dict.fromkeys((r["case"], r["batch"]) for r in rows_out):
        done = [r for r in rows_out if r["case"] == case and r["batch"] == B and "us_per_layer" in r]
        if len(done) >= 2 and done[0]["form"].startswith("bf16"):   # one line a case (the forms in order)
            base = done[0]["us_per_layer"]
            print(f"  {case:18s} B={B:2d}: {base:.1f} -> " + ", ".join(
                f"{r['form'].split('(', 1)[-1].rstrip(')')} {r['us_per_layer']:.1f} ({base / r['us_per_layer']:.2f}x)"
                for r in done[1:]), flush=True)
    print(f"wrote {out_dir}/kv_formats.json")
    return 0 if all("error" not in r and r["same_inf"] for r in rows_out) else 1


def fp4_experts(a, out_dir: str) -> int:
    """The FP4 routed experts' two forms at decode sizes (Flash: D 4096, I 2048, 6 active; E = 16 and 256, M = 1,
    4 and 32), device time a call from a profiler trace: a program an expert and a block of rows (tensor-core
    dots over the expert's tokens) against a program a pair (token, expert) and a block of rows (multiply-and-sum,
    no dot) over block sizes and warps. Random codes and scales (no quantization: the 256-expert stacks fit an
    H100). GB/s = the codes and scales of each pair's expert once (a pair form rereads an expert two tokens
    share)."""
    from pallas_kernels import experts as X
    from v4jax.bench.profile import summarize
    from v4jax.model import quant

    rows, k, I, D = [], 6, 2048, 4096
    w2_input = lambda h, w: quant.fp8_roundtrip((h * w).astype(BF16), 128)
    forms = [("experts", dict(form="experts"))] + [
        (f"pairs {r}x{nb} w{nw}", dict(form="pairs", up=(r, nb), down=(r, nb), num_warps=nw))
        for r, nb, nw in [(32, 8, 4), (16, 8, 4), (64, 8, 8)]]
    for E in (16, 256):
        ks = jax.random.split(jax.random.key(E), 4)
        codes = lambda kk, o, c: jax.random.bits(kk, (E, o, c // 2), jnp.uint8)
        scales = lambda o, c: jnp.full((E, o, c // 32), 127 - 6, jnp.uint8).view(jnp.float8_e8m0fnu)
        w1, w3 = ((codes(kk, I, D), scales(I, D)) for kk in ks[:2])
        w2 = (codes(ks[2], D, I), scales(D, I))
        for M in (1, 4, 32):
            kx, kw, ke = jax.random.split(jax.random.fold_in(ks[3], M), 3)
            x = quant.fp8_roundtrip(jax.random.normal(kx, (M, D), jnp.float32), 128).astype(BF16)
            ex = jax.vmap(lambda kk: jax.random.permutation(kk, E)[:k])(jax.random.split(ke, M)).astype(jnp.int32)
            wt = jax.random.uniform(kw, (M, k))
            gb = len(set(np.asarray(ex).reshape(-1).tolist())) * 3 * I * D * (0.5 + 1 / 32) / 1e9
            ref = None
            for name, kw_ in forms:
                f = jax.jit(functools.partial(X.routed_experts_fp4, limit=10.0, w2_input=w2_input, **kw_))
                try:
                    out = jax.block_until_ready(f(x, wt, ex, w1, w2, w3))
                    s = summarize(lambda: jax.block_until_ready(f(x, wt, ex, w1, w2, w3)), repeats=5, top=4)
                except Exception as e:  # noqa: BLE001 - a block shape Triton refuses: say so, go on
                    rows.append(dict(E=E, M=M, form=name, error=str(e)[:300]))
                    print(f"E={E} M={M} {name}: {str(e)[:300]}", flush=True)
                    continue
                ref = out if ref is None else ref
                diff = float(jnp.max(jnp.abs(out - ref)) / jnp.max(jnp.abs(ref)))
                ms = s.get("kernel_ms", float("nan"))
                rows.append(dict(E=E, M=M, form=name, kernel_ms=ms, gbps=gb / ms * 1e3, top=s.get("top"),
                                 max_rel_diff_vs_experts=diff))
                print(f"E={E} M={M} {name}: {ms:.4f} ms, {gb / ms * 1e3:.0f} GB/s, vs experts form {diff:.1e}",
                      flush=True)
    with open(os.path.join(out_dir, "fp4_experts.json"), "w") as f:
        json.dump(rows, f, indent=1)
    return 0


# ---- --sweep streaming ----------------------------------------------------------------------------------------------

def streaming(a, out_dir: str) -> int:
    """The decode step's weight-streaming kernels against XLA's matmul reading the same bytes: GB/s of the
    few-token projection (pallas_kernels.layer_linear) and of the routed experts (pallas_kernels.experts) over
    blocks, warps and stages, beside `x @ w.T` on separate weights of each shape (XLA's own GEMV / GEMM fusion,
    autotuned: the LM head read 3.0 TB/s on an H100 where these kernels read 2.5). Each case reads a stack of layers
    past the L2 -> OUT/streaming.json. (Measured on an H100 and removed from the kernel: at one token a sum over
    each chunk's row, 4 % slower than per-column sums, and the token padded to a 16-row tensor-core dot.)"""
    from pallas_kernels import experts as X
    from pallas_kernels import layer_linear as LL
    from v4jax.bench.profile import summarize

    log = _RowLog(os.path.join(out_dir, "streaming.json"))

    def timed(row, fn, args, mb, per):
        try:
            s = summarize(lambda: jax.block_until_ready(fn(*args)), repeats=2, top=4)
            us = s["kernel_ms"] * 1e3 / per
        except Exception as e:  # noqa: BLE001 - a block shape Triton refuses: say so, go on
            log.failed(row, e, str(row))
            return
        log.add(dict(row, us=us, gbps=mb / us * 1e3, kernels=s["kernels"] / per))
        print(f"{row}: {us:.1f} us, {mb / us * 1e3:.0f} GB/s", flush=True)

    shapes = [("wq_b", 32768, 1024, 1), ("wo_b", 4096, 8192, 1), ("wo_a", 8192, 4096, 8), ("wq_a", 1024, 4096, 1)]
    if a.small:
        shapes = [("small", 64, 256, 1)]
    one = [(32, 256, 4, 2), (16, 512, 4, 2), (16, 256, 4, 2), (32, 256, 8, 3), (16, 1024, 8, 3), (64, 256, 4, 2)]
    many = [(64, 256, 4, 2), (64, 256, 4, 3), (32, 256, 4, 3), (64, 512, 8, 3), (128, 128, 8, 3)]
    if a.small:
        one, many = [(16, 128, 4, 2)], [(16, 128, 4, 2)]
    for (name, o, d, g), m in itertools.product(shapes, [1, 32]):
        layers = 2 if a.small else max(4, -(-(256 << 20) // (o * d * 2)))
        k = jax.random.split(jax.random.key(o + d + m), 2)
        w = (0.05 * jax.random.normal(k[0], (layers, o, d), F32)).astype(BF16)
        x = jax.random.normal(k[1], (m, g, d) if g > 1 else (m, d), BF16)
        mb = o * d * 2 / 1e6
        for r, c, nw, ns in (one if m == 1 else many):
            def run(x, w, r=r, c=c, nw=nw, ns=ns, g=g, layers=layers):
                def body(i, acc):
                    y = LL.layer_linear(x, w, i, g, rows=r, cols=c, num_warps=nw, num_stages=ns)
                    return acc + y.reshape(-1)[:8].astype(F32)
                return lax.fori_loop(0, layers, body, jnp.zeros((8,), F32))
            timed(dict(kernel="layer_linear", shape=name, tokens=m, form="kernel", rows=r, cols=c, warps=nw,
                       stages=ns), jax.jit(run), (x, w), mb, layers)
        ws = [w[i] for i in range(layers)]  # separate arrays: XLA's fusion reads each from HBM, no slice
        xf = x.reshape(m, g, d)

        def xla(xf, ws, g=g):
            outs = [jnp.einsum("mgd,god->mgo", xf, wi.reshape(g, -1, wi.shape[-1]),
                               preferred_element_type=F32) for wi in ws]
            return sum(o.reshape(-1)[:8] for o in outs)
        timed(dict(kernel="layer_linear", shape=name, tokens=m, form="xla"), jax.jit(xla), (xf, ws), mb, layers)
        del w, ws
    ecfg = [((16, 512), (16, 512), 4, 2), ((16, 512), (16, 512), 4, 3), ((16, 512), (16, 512), 4, 4),
            ((32, 256), (32, 256), 4, 3), ((16, 1024), (16, 1024), 4, 3), ((16, 512), (16, 512), 8, 3),
            ((32, 512), (32, 512), 8, 3)]
    if not a.small:
        for m in (1, 32):
            x, wt, ex, w1, w2, w3 = experts_case(m, 6, 16, 2048, 4096)
            pairs = len(set(np.asarray(ex).reshape(-1).tolist()))
            mb = pairs * 3 * 2048 * 4096 * 2 / 1e6
            for up, down, nw, ns in ecfg:
                timed(dict(kernel="experts", tokens=m, up=up, down=down, warps=nw, stages=ns),
                      jax.jit(lambda *args, up=up, down=down, nw=nw, ns=ns: X.routed_experts(
                          *args, 10.0, up=up, down=down, num_warps=nw, num_stages=ns)), (x, wt, ex, w1, w2, w3), mb, 1)
            del w1, w2, w3
    return 0


SWEEPS = {"layer_linear": layer_linear, "fused_projections": fused_projections, "hc_post": hc_post,
          "experts": experts, "prefill_experts": prefill_experts, "topk_prefill": topk_prefill,
          "attention_prefill": attention_prefill, "indexer_prefill": indexer_prefill,
          "stored_weights": stored_weights, "kv_formats": kv_formats, "fp4_experts": fp4_experts,
          "streaming": streaming}
# the sweeps with a --small form
SMALL_SWEEPS = ("layer_linear", "fused_projections", "hc_post", "kv_formats",
                "attention_prefill", "streaming")


def sweep(a, out_dir: str) -> int:
    """`--sweep NAME`: one sweep of SWEEPS, its files written to out_dir."""
    if a.small and a.sweep not in SMALL_SWEEPS:
        raise SystemExit(f"--sweep {a.sweep} runs on a GPU only (--small: {', '.join(SMALL_SWEEPS)})")
    os.makedirs(out_dir, exist_ok=True)
    return SWEEPS[a.sweep](a, out_dir)
