"""mHC's Sinkhorn normalisation (reference §5) as one kernel.

XLA runs the loop as one small reduce fusion and one divide fusion per half-step: 2 x 19 iterations x 2 per
layer (hc_attn and hc_ffn), about 80 launches of a few microseconds each over [tokens, 4, 4] floats (measured on
the H200: a third of the decode step's kernels). Unrolling does not help: fusing the unrolled chain recomputes
each entry's producers per consumer, and the compile grows exponentially with the iterations.

Here the N*N entries of each token are N*N separate vectors of a block of tokens (the input is laid out
entry-major, [N*N, M]), and the whole loop runs on them in registers: one launch per mHC. The arithmetic is the
reference's (v4jax.model.layers.sinkhorn), in the same order (sums over the row or column left to right), so the
result matches it to rounding.
"""
from __future__ import annotations

import functools
import operator

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from . import _compat
from ._compat import TritonCompilerParams, interpret_arg

BLOCK = 128  # tokens per program on TPU: one lane row
# on GPU a thread runs one token's serial iterations: 32 tokens per one-warp program (H200, v4jax bench kernels
# --tune --only sinkhorn: 4.6-4.9 us at 1, 32 and 256 tokens; 128 tokens per one-warp program took 10.6-14.9 us)
GPU_BLOCK = 32


def normalise(entries: list, n: int, iters: int, eps: float) -> list:
    """The reference's loop on the N*N entries of comb (row-major, each a vector of tokens or a scalar): one
    column normalisation, then iters - 1 (row, column) normalisations, sums left to right."""
    def cols(c):
        s = [functools.reduce(operator.add, [c[i][j] for i in range(n)]) for j in range(n)]
        return [[c[i][j] / (s[j] + eps) for j in range(n)] for i in range(n)]

    def rows(c):
        s = [functools.reduce(operator.add, c[i]) for i in range(n)]
        return [[c[i][j] / (s[i] + eps) for j in range(n)] for i in range(n)]

    flat = lambda c: tuple(v for r in c for v in r)
    grid = lambda f: [list(f[i * n:(i + 1) * n]) for i in range(n)]
    c = cols(grid(list(entries)))
    return list(jax.lax.fori_loop(0, iters - 1, lambda _, f: flat(cols(rows(grid(f)))), flat(c)))


def _kernel(x_ref, o_ref, *, n: int, iters: int, eps: float):
    out = normalise([x_ref[k, :] for k in range(n * n)], n, iters, eps)
    for k in range(n * n):
        o_ref[k, :] = out[k]


def sinkhorn(comb, iters: int, eps: float, *, interpret=None, gpu: bool | None = None, block: int | None = None,
             num_warps: int = 1):
    """The Pallas version of v4jax.model.layers.sinkhorn (same signature): comb [..., N, N] f32, one column
    normalisation, then iters - 1 (row, column) normalisations. interpret=None: interpret on CPU; gpu=None: a
    Triton kernel when this process runs on a GPU (set it to lower for another platform). block: tokens per
    program (a power of two; default GPU_BLOCK on GPU, BLOCK otherwise)."""
    if interpret is None:
        interpret = _compat.backend() == "cpu"
    if gpu is None:
        gpu = _compat.backend() == "gpu"
    block = block or (GPU_BLOCK if gpu and not interpret else BLOCK)
    *lead, n, _ = comb.shape
    m = 1
    for d in lead:
        m *= d
    mp = -(-m // block) * block
    x = jnp.pad(comb.reshape(m, n * n).astype(jnp.float32).T, ((0, 0), (0, mp - m)), constant_values=1.0)
    spec = pl.BlockSpec((n * n, block), lambda i: (0, i))
    kw = {}
    if interpret:
        kw["interpret"] = interpret_arg(interpret, "hlo")
    elif gpu:
        kw["compiler_params"] = TritonCompilerParams(num_warps=num_warps, num_stages=1)
    out = pl.pallas_call(functools.partial(_kernel, n=n, iters=iters, eps=eps),
                         out_shape=jax.ShapeDtypeStruct((n * n, mp), jnp.float32),
                         grid=(mp // block,), in_specs=[spec], out_specs=spec, name="v4_sinkhorn", **kw)(x)
    return out[:, :m].T.reshape(comb.shape)
