"""mHC's collapse with the norm after it (reference §5), as two GPU kernels in place of XLA's chain.

A layer runs it twice (before attention, before the MoE): mix = fn @ flat(x) scaled by flat(x)'s RMS, pre / post /
comb from mix (sigmoid, softmax, Sinkhorn), u = sum_n pre_n x_n, then the RMS norm of u that feeds the next part.
XLA runs that as about eight launches of a microsecond or two at decode sizes (the mix's reduction, the RMS, the
sigmoids and softmax, Sinkhorn with its pad and transpose, the collapse, the norm's two): on the H200 a flash-slice
decode step at batch 1 spent ~0.12 ms in 72 reduce fusions alone (docs/results/h200-spec-fixed).

  mix kernel, grid (M / BM, D / BD): program (i, c) reads x[BM, N, BD] and fn's columns of that slice of every
  stream ([MIX, N, BD] f32), and writes its partial sums of the MIX mix rows and of x^2: [M, D / BD, 32]. fn
  (1.5 MB f32 at Flash's sizes) is the largest read: split over D it is read by D / BD programs at once, where one
  program per token would read it alone.

  finish kernel, grid (M,): one token a program sums its partials, forms pre / post / comb and runs Sinkhorn on
  scalars (pallas_kernels.sinkhorn's arithmetic), collapses its N streams over all of D in registers (N x D = 16K
  values at Flash's sizes: 64 a thread with 8 warps) and writes norm(u) * w, post and comb.

A form measured on the H200 and not kept (v4jax.model.ops._sinkhorn_pallas says how) fused the part after the mix's
matmul, without the norm, four tokens a program, loading the streams after the Sinkhorn loop: 10 us a launch at
batch 1 and 23 at 32 against ~16 for XLA's kernels, and no faster step. This one also takes the matmul (split over
D, so fn's read is spread) and the norm, one token a program (batch 32 runs 32 programs side by side), and issues
the streams' loads before the scalar work so they overlap it. It is a candidate until the sweep times it.

Rounded as the model (v4jax.model.layers.hc_pre_norm: hc_pre, then rms_norm): everything in f32, u cast to x's
dtype before its norm, the norm's output cast to x's dtype. The sums run in another order than XLA's (f32 rounding
apart).

  x [M, N, D], fn [(2 + N) * N, N * D] f32, base [(2 + N) * N] f32, scale [3] f32, norm_w [D] f32
  -> y [M, D] in x's dtype, post [M, N] f32, comb [M, N, N] f32.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ._common import next_pow2, pow2_block
from ._compat import TritonCompilerParams, backend
from .sinkhorn import normalise

F32 = jnp.float32
PARTIAL = 32  # columns of a partial row: the MIX (24 at N = 4) mix sums, then the sum of squares
# Not yet timed on a GPU (v4jax bench kernels --sweep hc_pre): 16 tokens x 128 dims keeps a mix program's x block at
# 64 f32 registers a thread with 4 warps, and gives Flash's D 32 programs at batch 1.
BLOCK_TOKENS, BLOCK_D = 16, 128
FINISH_WARPS = 8


def supported(x, fn) -> bool:
    """x [M, N, D] with N a power of two, D a power of two (the finish kernel holds a token's whole row), the mix
    rows and a sum of squares within a partial row; fn [..., MIX, N * D] (a layer's, or a stack)."""
    if x.ndim != 3:
        return False
    _, n, d = x.shape
    mix = fn.shape[-2]
    return (n & (n - 1) == 0 and d >= 16 and d & (d - 1) == 0 and mix == (2 + n) * n and mix < PARTIAL
            and fn.shape[-1] == n * d)


def _mix_kernel(layer_ref, x_ref, fn_ref, o_ref, *, mix: int, bd: int):
    x = x_ref[...].astype(F32)  # [BM, N, BD]
    li, cols = layer_ref[0], pl.ds(pl.program_id(1) * bd, bd)
    for o in range(mix):
        o_ref[:, 0, o] = jnp.sum(jnp.sum(x * fn_ref[li, o, :, cols][None], axis=2), axis=1)
    o_ref[:, 0, mix] = jnp.sum(jnp.sum(x * x, axis=2), axis=1)


def _sigmoid(v):
    return 1.0 / (1.0 + jnp.exp(-v))


def _finish_kernel(layer_ref, p_ref, x_ref, base_ref, scale_ref, w_ref, y_ref, post_ref, comb_ref, *, n: int,
                   iters: int, hc_eps: float, norm_eps: float):
    mix, d, li = (2 + n) * n, x_ref.shape[-1], layer_ref[0]
    xs = [x_ref[0, k, :].astype(F32) for k in range(n)]  # issued first: the loads overlap the scalar work below
    tot = [jnp.sum(p_ref[0, :, j]) for j in range(mix + 1)]
    inv = jax.lax.rsqrt(tot[mix] / (n * d) + norm_eps)
    m = [t * inv for t in tot[:mix]]
    pre = [_sigmoid(m[k] * scale_ref[li, 0] + base_ref[li, k]) + hc_eps for k in range(n)]
    post = [2.0 * _sigmoid(m[n + k] * scale_ref[li, 1] + base_ref[li, n + k]) for k in range(n)]
    logits = [[m[2 * n + i * n + j] * scale_ref[li, 2] + base_ref[li, 2 * n + i * n + j] for j in range(n)]
              for i in range(n)]
    comb = []
    for row in logits:  # softmax over j, as jax.nn.softmax: exp(v - max) / sum
        top = functools.reduce(jnp.maximum, row)
        e = [jnp.exp(v - top) for v in row]
        s = functools.reduce(lambda a, b: a + b, e)
        comb += [v / s + hc_eps for v in e]
    comb = normalise(comb, n, iters, hc_eps)
    u = pre[0] * xs[0]
    for k in range(1, n):
        u = u + pre[k] * xs[k]
    dt = y_ref.dtype
    u = u.astype(dt).astype(F32)
    r = jax.lax.rsqrt(jnp.sum(u * u) / d + norm_eps)
    y_ref[0, :] = (u * r * w_ref[li, :]).astype(dt)
    for k in range(n):
        post_ref[0, k] = post[k]
    for k in range(n * n):
        comb_ref[0, k // n, k % n] = comb[k]


def hc_pre_norm(x, fn, base, scale, norm_w, layer=None, *, iters: int, hc_eps: float, norm_eps: float,
                interpret=None, block_tokens: int = BLOCK_TOKENS, block_d: int = BLOCK_D, num_warps: int = 4,
                finish_warps: int = FINISH_WARPS):
    """The Pallas form of v4jax.model.layers.hc_pre_norm (hc_pre, then the RMS norm of its output) for x [M, N, D]
    (callers flatten their leading axes). norm_eps is both the mix's and the norm's epsilon (the model's
    cfg.norm_eps), hc_eps mHC's. With `layer` (a scalar), fn, base, scale and
    norm_w are layer stacks ([n, ...]) and the kernels read layer `layer`'s in place: inside the layer loop a slice
    of a stack fed to a kernel is a copy, a launch each (eight a layer here)."""
    if interpret is None:
        interpret = backend() == "cpu"
    if layer is None:
        fn, base, scale, norm_w = fn[None], base[None], scale[None], norm_w[None]
        layer = 0
    layer = jnp.asarray(layer, jnp.int32).reshape(1)
    if not supported(x, fn):
        raise ValueError(f"x {x.shape}, fn {fn.shape}: expected x [M, N, D] with N and D powers of two (D >= 16) "
                         f"and fn [(2 + N) * N, N * D]")
    m, n, d = x.shape
    layers, mix = fn.shape[:2]
    bm = min(block_tokens, next_pow2(m))
    bd = pow2_block(d, block_d)
    nb = d // bd
    kw = lambda warps: (dict(interpret=True) if interpret
                        else dict(compiler_params=TritonCompilerParams(num_warps=warps, num_stages=1)))
    full = lambda a: pl.BlockSpec(a.shape, lambda *_: (0,) * a.ndim)
    fn = fn.astype(F32).reshape(layers, mix, n, d)
    partial = pl.pallas_call(
        functools.partial(_mix_kernel, mix=mix, bd=bd),
        out_shape=jax.ShapeDtypeStruct((m, nb, PARTIAL), F32), grid=(pl.cdiv(m, bm), nb),
        in_specs=[full(layer), pl.BlockSpec((bm, n, bd), lambda i, c: (i, 0, c)), full(fn)],
        out_specs=pl.BlockSpec((bm, 1, PARTIAL), lambda i, c: (i, c, 0)), name="v4_hc_mix", **kw(num_warps),
    )(layer, x, fn)
    base, scale, norm_w = base.astype(F32), scale.astype(F32), norm_w.astype(F32)
    return pl.pallas_call(
        functools.partial(_finish_kernel, n=n, iters=iters, hc_eps=hc_eps, norm_eps=norm_eps),
        out_shape=(jax.ShapeDtypeStruct((m, d), x.dtype), jax.ShapeDtypeStruct((m, n), F32),
                   jax.ShapeDtypeStruct((m, n, n), F32)),
        grid=(m,),
        in_specs=[full(layer), pl.BlockSpec((1, nb, PARTIAL), lambda i: (i, 0, 0)),
                  pl.BlockSpec((1, n, d), lambda i: (i, 0, 0)), full(base), full(scale), full(norm_w)],
        out_specs=(pl.BlockSpec((1, d), lambda i: (i, 0)), pl.BlockSpec((1, n), lambda i: (i, 0)),
                   pl.BlockSpec((1, n, n), lambda i: (i, 0, 0))),
        name="v4_hc_finish", **kw(finish_warps),
    )(layer, partial, x, base, scale, norm_w)
