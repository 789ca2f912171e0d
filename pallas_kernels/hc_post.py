"""mHC's expansion X'_k = post_k * f + sum_j comb[j, k] X_j (reference §5) as one memory-bound GPU kernel.

In XLA it is a per-token [N, N] x [N, D] matmul: on the H200 86 ms of a 128K flash-slice prefill (about a quarter
of the bandwidth its bytes allow) and two kernels per call in decode. Written for XLA as N multiply-adds it made
XLA:GPU (JAX 0.11.2) fail to compile the batch-1 4096-token prefill (v4jax.model.layers.hc_post); a Triton kernel does
not go through XLA's emitters.

  grid (M / BM, D / BD): program (i, c) reads f [BM, BD] and the N streams x[:, j, BD] of its BM tokens once, with
  post [BM, N] and comb [BM, N, N], and writes the N output streams. Rounded as v4jax.model.layers.hc_post (HF's):
  post and comb cast to x's dtype, post_k * f rounded, the sum over j accumulated in f32 and rounded, then added.
  Blocks past M (M not a multiple of BM) are masked by Pallas.

  f [M, D], x [M, N, D] (same dtype), post [M, N] f32, comb [M, N, N] f32 -> [M, N, D] in x's dtype.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ._common import next_pow2, pow2_block
from . import _compat
from ._compat import TritonCompilerParams

F32 = jnp.float32
# 16 x 128 keeps the six f32 [BM, BD] values of a program (f, four streams, the sum) at ~96 registers a thread with
# 4 warps. H200 (v4jax bench kernels --sweep hc_post, Flash D = 4096): 151 us at 8192 tokens (4.0 TB/s; XLA's
# form 798 us), 2.0 us at 32 (XLA 5.4 in two launches); 16 x 256 and 8 x 512 with 8 warps within 2 %, 32 x 128
# slower
BLOCK_TOKENS, BLOCK_D = 16, 128


def supported(f, x) -> bool:
    """D divisible by a power-of-two block of >= 16."""
    return f.ndim == 2 and x.ndim == 3 and pow2_block(x.shape[-1], BLOCK_D) is not None


def _kernel(f_ref, x_ref, post_ref, comb_ref, o_ref, *, n: int):
    dt = o_ref.dtype
    rnd = lambda v: v.astype(dt).astype(F32)
    f = f_ref[...].astype(F32)
    xs = [x_ref[:, j, :].astype(F32) for j in range(n)]
    for k in range(n):
        mixed = rnd(comb_ref[:, 0, k])[:, None] * xs[0]
        for j in range(1, n):
            mixed = mixed + rnd(comb_ref[:, j, k])[:, None] * xs[j]
        o_ref[:, k, :] = (rnd(rnd(post_ref[:, k])[:, None] * f) + rnd(mixed)).astype(dt)


def hc_post(f, x, post, comb, *, interpret=None, block_tokens: int = BLOCK_TOKENS, block_d: int = BLOCK_D,
            num_warps: int = 4):
    """The Pallas form of v4jax.model.layers.hc_post (the reference) for f [M, D], x [M, N, D] (callers flatten
    their leading axes)."""
    if interpret is None:
        interpret = _compat.backend() == "cpu"
    if not supported(f, x):
        raise ValueError(f"f {f.shape}, x {x.shape}: expected [M, D] and [M, N, D] with D a multiple of a power-of-two "
                         f"block of at least 16")
    m, n, d = x.shape
    bm = min(block_tokens, next_pow2(m))
    bd = pow2_block(d, block_d)
    kw = dict(interpret=True) if interpret else dict(compiler_params=TritonCompilerParams(num_warps=num_warps,
                                                                                         num_stages=1))
    return pl.pallas_call(
        functools.partial(_kernel, n=n),
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(pl.cdiv(m, bm), d // bd),
        in_specs=[pl.BlockSpec((bm, bd), lambda i, c: (i, c)), pl.BlockSpec((bm, n, bd), lambda i, c: (i, 0, c)),
                  pl.BlockSpec((bm, n), lambda i, c: (i, 0)), pl.BlockSpec((bm, n, n), lambda i, c: (i, 0, 0))],
        out_specs=pl.BlockSpec((bm, n, bd), lambda i, c: (i, 0, c)), name="v4_hc_post", **kw,
    )(f, x, post.astype(F32), comb.astype(F32))
