"""mHC's collapse of a decode step's streams (reference §5, v4jax.model.layers.hc_pre) in two launches.

XLA runs it as about a dozen small kernels per call (the mix's reduce and matmul, the sigmoids, the softmax, the
Sinkhorn kernel and its layout copies, the weighted sum): two calls a layer, ~145 us of a flash-slice decode step
on the H100 (FP8 profile, `docs/results/h100-fp8-decode-profile/`), each kernel moving a few KB.

  mix    grid (S,): program s takes columns s*cols .. of the flattened streams x [M, N*D] (all M <= MAX_TOKENS
         tokens), and writes its partial mix x @ fn.T [TB, R] (fn [n_mix, N*D] f32; rows past n_mix masked to 0)
         and its partial sum of squares [TB].
  finish grid (D / BD,): every program sums the S partials, forms pre / post / comb as the reference does (the
         sigmoids, comb's row softmax, then the Sinkhorn loop of pallas_kernels.sinkhorn on the N*N entries as
         vectors of tokens), and writes u = sum_n pre_n x_n for its BD columns; program 0 also writes post and comb.

The arithmetic is the reference's, summed in another order: f32 throughout (the mix's matmul at full f32
precision), u rounded to x's dtype once.

  x [M, N, D] (any float dtype), fn [(2 + N) * N, N * D] f32, base [(2 + N) * N] f32, scale [3] f32
  -> u [M, D] in x's dtype, post [M, N] f32, comb [M, N, N] f32.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from ._common import mm_nt, next_pow2, pow2_block
from . import _compat
from ._compat import TritonCompilerParams, pltriton
from .sinkhorn import normalise

F32, I32 = jnp.float32, jnp.int32
MAX_TOKENS = 64  # tokens a call takes (one [TB, .] tile): a decode step's; prefill chunks take XLA's form
CHUNK = 128      # columns of x per loop step of the mix (a [TB, 128] and an [R, 128] f32 tile)
MAX_SPLITS = 32  # programs of the mix: Flash's 16,384 columns as 32 x 512
BLOCK_D = 512    # columns of u per finishing program


def _splits(nk: int) -> int | None:
    """Programs of the mix: a power of two (the finishing kernel loads their partials as one tile) dividing the
    column chunks, at most MAX_SPLITS."""
    if nk % CHUNK:
        return None
    chunks = nk // CHUNK
    s = 1
    while s * 2 <= MAX_SPLITS and chunks % (s * 2) == 0:
        s *= 2
    return s


def supported(x, fn) -> bool:
    """x [M, N, D] with M <= MAX_TOKENS, N * D a multiple of CHUNK, D of a power-of-two block of >= 16."""
    return (x.ndim == 3 and x.shape[0] <= MAX_TOKENS and _splits(x.shape[1] * x.shape[2]) is not None
            and pow2_block(x.shape[2], BLOCK_D) is not None and fn.shape[-1] == x.shape[1] * x.shape[2])


def _mix_kernel(x_ref, fn_ref, mix_ref, sq_ref, *, m, tb, n_mix, rpad, per_split):
    s = pl.program_id(0)
    rows = lax.broadcasted_iota(I32, (tb, 1), 0)
    frows = lax.broadcasted_iota(I32, (rpad, 1), 0)

    def body(c, carry):
        acc, sq = carry
        col = (s * per_split + c) * CHUNK + lax.broadcasted_iota(I32, (1, CHUNK), 1)
        x = pltriton.load(x_ref.at[rows, col], mask=rows < m, other=0.0).astype(F32)      # [TB, CHUNK]
        f = pltriton.load(fn_ref.at[frows, col], mask=frows < n_mix, other=0.0)           # [R, CHUNK]
        return acc + mm_nt(x, f), sq + jnp.sum(x * x, axis=1)

    acc, sq = lax.fori_loop(0, per_split, body, (jnp.zeros((tb, rpad), F32), jnp.zeros((tb,), F32)))
    mix_ref[...] = acc
    sq_ref[...] = sq


def _finish_kernel(mix_ref, sq_ref, base_ref, scale_ref, x_ref, u_ref, post_ref, comb_ref, *, m, tb, n, d, bd,
                   iters, hc_eps, norm_eps):
    c = pl.program_id(0)
    inv = lax.rsqrt(jnp.sum(sq_ref[...], axis=0) / (n * d) + norm_eps)                    # [TB]
    mix = lambda j: jnp.sum(mix_ref[:, :, j], axis=0) * inv                              # column j of the mix
    pre = [jax.nn.sigmoid(mix(j) * scale_ref[0] + base_ref[j]) + hc_eps for j in range(n)]
    rows = lax.broadcasted_iota(I32, (tb, 1), 0)
    cols = c * bd + lax.broadcasted_iota(I32, (1, bd), 1)
    u = sum(pre[j][:, None] * pltriton.load(x_ref.at[rows, j * d + cols], mask=rows < m, other=0.0).astype(F32)
            for j in range(n))
    pltriton.store(u_ref.at[rows, cols], u.astype(u_ref.dtype), mask=rows < m)

    @pl.when(c == 0)
    def _():
        tok = lax.broadcasted_iota(I32, (tb,), 0)
        ok = tok < m
        for j in range(n):
            post = 2.0 * jax.nn.sigmoid(mix(n + j) * scale_ref[1] + base_ref[n + j])
            pltriton.store(post_ref.at[tok, j], post, mask=ok)
        logits = [[mix(2 * n + i * n + j) * scale_ref[2] + base_ref[2 * n + i * n + j] for j in range(n)]
                  for i in range(n)]
        entries = []
        for row in logits:                       # each row's softmax, then + eps (the reference's order)
            top = functools.reduce(jnp.maximum, row)
            e = [jnp.exp(v - top) for v in row]
            total = functools.reduce(lambda a, b: a + b, e)
            entries += [v / total + hc_eps for v in e]
        for k, v in enumerate(normalise(entries, n, iters, hc_eps)):
            pltriton.store(comb_ref.at[tok, k], v, mask=ok)


def hc_pre(x, fn, base, scale, *, iters: int, hc_eps: float, norm_eps: float, interpret=None,
           num_warps: int = 4):
    """The Pallas form of v4jax.model.layers.hc_pre for a decode step's tokens: x [M, N, D] (callers flatten their
    leading axes) -> (u [M, D], post [M, N], comb [M, N, N])."""
    if interpret is None:
        interpret = _compat.backend() == "cpu"
    if not supported(x, fn):
        raise ValueError(f"x {x.shape}, fn {fn.shape}: expected [M <= {MAX_TOKENS}, N, D] and [n_mix, N * D] with "
                         f"N * D a multiple of {CHUNK}")
    m, n, d = x.shape
    n_mix, nk = fn.shape
    tb, rpad = max(16, next_pow2(m)), max(16, next_pow2(n_mix))
    s = _splits(nk)
    bd = pow2_block(d, BLOCK_D)
    flat = x.reshape(m, nk)
    full = lambda a: pl.BlockSpec(a.shape, lambda *_: (0,) * a.ndim)
    kw = dict(interpret=True) if interpret else dict(
        compiler_params=TritonCompilerParams(num_warps=num_warps, num_stages=1))
    mix, sq = pl.pallas_call(
        functools.partial(_mix_kernel, m=m, tb=tb, n_mix=n_mix, rpad=rpad, per_split=nk // CHUNK // s),
        out_shape=(jax.ShapeDtypeStruct((s, tb, rpad), F32), jax.ShapeDtypeStruct((s, tb), F32)), grid=(s,),
        in_specs=[full(flat), full(fn)],
        out_specs=(pl.BlockSpec((None, tb, rpad), lambda i: (i, 0, 0)), pl.BlockSpec((None, tb), lambda i: (i, 0))),
        name="v4_hc_mix", **kw,
    )(flat, fn.astype(F32))
    base, scale = base.astype(F32), scale.astype(F32)
    u, post, comb = pl.pallas_call(
        functools.partial(_finish_kernel, m=m, tb=tb, n=n, d=d, bd=bd, iters=iters, hc_eps=hc_eps,
                          norm_eps=norm_eps),
        out_shape=(jax.ShapeDtypeStruct((m, d), x.dtype), jax.ShapeDtypeStruct((m, n), F32),
                   jax.ShapeDtypeStruct((m, n * n), F32)),
        grid=(d // bd,), in_specs=[full(mix), full(sq), full(base), full(scale), full(flat)],
        out_specs=tuple(full(jax.ShapeDtypeStruct(sh, F32)) for sh in ((m, d), (m, n), (m, n * n))),
        name="v4_hc_pre", **kw,
    )(mix, sq, base, scale, flat)
    return u, post, comb.reshape(m, n, n)
