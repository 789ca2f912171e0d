"""mHC's expansion X'_k = post_k * f + sum_j comb[j, k] X_j (reference §5) as one memory-bound GPU kernel.

In XLA it is a per-token [N, N] x [N, D] matmul: on the H200 86 ms of a 128K flash-slice prefill (about a quarter
of the bandwidth its bytes allow) and two kernels per call in decode. Written for XLA as N multiply-adds it made
XLA:GPU (JAX 0.11.2) fail to compile the batch-1 4096-token prefill (v4jax.model.layers.hc_post); a Triton kernel does
not go through XLA's emitters.

  grid (M / BM, D / BD): program (i, c) reads f [BM, BD] and the N streams x[:, j, BD] of its BM tokens once, with
  post [BM, N] and comb [BM, N, N], and writes the N output streams. Rounded as v4jax.model.layers.hc_post (HF's):
  post and comb cast to x's dtype, post_k * f rounded, the sum over j accumulated in f32 and rounded, then added.
  Blocks past M (M not a multiple of BM) are masked by Pallas.

  f [M, D], x [M, N, D] (same dtype), post [M, N] f32, comb [M, N, N] f32 -> [M, N, D] in x's dtype. f may come
  as the f32 partial sums [S, M, D] of the projection that made it (pallas_kernels.layer_linear, summed=False):
  the program adds them up and rounds them to x's dtype (in XLA that was a launch of its own on decode's chain).

`collapse_norm` is the other end of mHC for a decode step's few tokens: the collapse u = sum_i pre_i X_i and the
RMS norm of u with the next sublayer's weight, in one launch where XLA ran three (the collapse, the norm's sum of
squares, its scaling), each on the layer's dependency chain. The weight is read from its layer stack in place.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from ._common import layer_operand, next_pow2, pow2_block
from . import _compat
from ._compat import TritonCompilerParams

F32 = jnp.float32
# 16 x 128 keeps the six f32 [BM, BD] values of a program (f, four streams, the sum) at ~96 registers a thread with
# 4 warps. H200 (v4jax bench kernels --sweep hc_post, Flash D = 4096): 151 us at 8192 tokens (4.0 TB/s; XLA's
# form 798 us), 2.0 us at 32 (XLA 5.4 in two launches); 16 x 256 and 8 x 512 with 8 warps within 2 %, 32 x 128
# slower
BLOCK_TOKENS, BLOCK_D = 16, 128


def supported(f, x) -> bool:
    """f [M, D] or partial sums [S, M, D], x [M, N, D]; D divisible by a power-of-two block of >= 16."""
    return f.ndim in (2, 3) and x.ndim == 3 and pow2_block(x.shape[-1], BLOCK_D) is not None


def _options(interpret, num_warps: int) -> dict:
    """pallas_call's options: the HLO interpreter (interpret=None: on CPU), else Triton with `num_warps`."""
    if interpret or (interpret is None and _compat.backend() == "cpu"):
        return dict(interpret=True)
    return dict(compiler_params=TritonCompilerParams(num_warps=num_warps, num_stages=1))


def _kernel(f_ref, x_ref, post_ref, comb_ref, o_ref, *, n: int):
    dt = o_ref.dtype
    rnd = lambda v: v.astype(dt).astype(F32)
    f = f_ref[0].astype(F32)
    for part in range(1, f_ref.shape[0]):  # partial sums, added in order
        f = f + f_ref[part].astype(F32)
    f = rnd(f)
    xs = [x_ref[:, j, :].astype(F32) for j in range(n)]
    for k in range(n):
        mixed = rnd(comb_ref[:, 0, k])[:, None] * xs[0]
        for j in range(1, n):
            mixed = mixed + rnd(comb_ref[:, j, k])[:, None] * xs[j]
        o_ref[:, k, :] = (rnd(rnd(post_ref[:, k])[:, None] * f) + rnd(mixed)).astype(dt)


def hc_post(f, x, post, comb, *, interpret=None, block_tokens: int = BLOCK_TOKENS, block_d: int = BLOCK_D,
            num_warps: int = 4):
    """The Pallas form of v4jax.model.layers.hc_post (the reference) for f [M, D] (or its partial sums [S, M, D],
    added in order), x [M, N, D] (callers flatten their leading axes)."""
    if not supported(f, x):
        raise ValueError(f"f {f.shape}, x {x.shape}: expected [M, D] or [S, M, D] and [M, N, D] with D a multiple of "
                         f"a power-of-two block of at least 16")
    m, n, d = x.shape
    f = f.reshape((-1,) + f.shape[-2:])
    bm = min(block_tokens, next_pow2(m))
    bd = pow2_block(d, block_d)
    kw = _options(interpret, num_warps)
    return pl.pallas_call(
        functools.partial(_kernel, n=n),
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(pl.cdiv(m, bm), d // bd),
        in_specs=[pl.BlockSpec((f.shape[0], bm, bd), lambda i, c: (0, i, c)),
                  pl.BlockSpec((bm, n, bd), lambda i, c: (i, 0, c)), pl.BlockSpec((bm, n), lambda i, c: (i, 0)),
                  pl.BlockSpec((bm, n, n), lambda i, c: (i, 0, 0))],
        out_specs=pl.BlockSpec((bm, n, bd), lambda i, c: (i, 0, c)), name="v4_hc_post", **kw,
    )(f, x, post.astype(F32), comb.astype(F32))


COLLAPSE_MAX_TOKENS = 64  # a decode step's rows (one program a token); a prefill chunk keeps XLA's fusions


def collapse_supported(pre, x) -> bool:
    """At most COLLAPSE_MAX_TOKENS tokens; N and D powers of two (a program holds a token's whole [N, D])."""
    m, n, d = x.shape if x.ndim == 3 else (0, 0, 0)
    pow2 = lambda v: v >= 1 and v & (v - 1) == 0  # noqa: E731
    return x.ndim == 3 and pre.shape == (m, n) and 0 < m <= COLLAPSE_MAX_TOKENS and pow2(n) and pow2(d) and d >= 16


def _collapse_kernel(layer_ref, pre_ref, x_ref, w_ref, o_ref, *, n: int, eps: float):
    dt = o_ref.dtype
    u = pre_ref[:, 0][:, None] * x_ref[:, 0, :].astype(F32)      # [1, D]: the reference's sum over i, in order
    for i in range(1, n):
        u = u + pre_ref[:, i][:, None] * x_ref[:, i, :].astype(F32)
    u = u.astype(dt).astype(F32)                                  # the collapse is rounded to x's dtype, then
    r = lax.rsqrt(jnp.mean(u * u, axis=1, keepdims=True) + eps)   # normed in f32 (layers.rms_norm)
    w = w_ref[pl.ds(layer_ref[0], 1), :]                          # [1, D] the layer's weight, in place
    o_ref[...] = ((u * r) * w).astype(dt)


def collapse_norm(pre, x, weight, eps: float, layer=None, *, interpret=None, num_warps: int = 4):
    """rms_norm(sum_i pre_i X_i, weight[layer], eps) as v4jax.model.layers computes it (layers.collapse, then
    layers.rms_norm): pre [M, N] f32, x [M, N, D] -> [M, D] in x's dtype; weight [D] f32, or a stack [n, D] read at
    `layer`. Shapes must pass `collapse_supported`."""
    if not collapse_supported(pre, x):
        raise ValueError(f"pre {pre.shape}, x {x.shape}: expected [M, N] and [M, N, D], M <= {COLLAPSE_MAX_TOKENS}, "
                         f"N and D powers of two")
    m, n, d = x.shape
    w = weight.reshape(-1, d).astype(F32)
    layer = layer_operand(layer)
    full = lambda a: pl.BlockSpec(a.shape, lambda i: (0,) * a.ndim)  # noqa: E731
    kw = _options(interpret, num_warps)
    return pl.pallas_call(
        functools.partial(_collapse_kernel, n=n, eps=float(eps)),
        out_shape=jax.ShapeDtypeStruct((m, d), x.dtype), grid=(m,),
        in_specs=[full(layer), pl.BlockSpec((1, n), lambda i: (i, 0)), pl.BlockSpec((1, n, d), lambda i: (i, 0, 0)),
                  full(w)],
        out_specs=pl.BlockSpec((1, d), lambda i: (i, 0)), name="v4_hc_collapse", **kw,
    )(layer, pre.astype(F32), x, w)
