"""mHC's mix fn @ flat(X) and the streams' mean square (reference §5) for a decode step's rows, reading the layer's
fn from its stack in place.

From two rows up XLA:GPU runs fn @ flat(X) (fn [C, N*D] f32: 24 x 16384 for Flash, 1.5 MB) as a split-K GEMM, which
takes the layer's slice of the fn stack as a copy of its own, then sums the GEMM's splits, and the mean square as
a third reduce: four launches per mHC, 3 MB of the copy among them (flash-slice at 16-32 rows: 32 of a step's
~290 launches, `v4jax bench gpu-launches`). At one row XLA fuses the slice into a reduce and needs no copy; the
model keeps XLA's form there.

  grid (S,): program s reads columns s*K/S .. of the rows' flat streams x [M, K] (x's dtype, widened to f32) and of
  the C rows of fn[layer], and writes its f32 partial sums [M, C] of x * fn and [M] of x * x; XLA adds the S parts.
  Exact f32 products; only the order of the sums differs from XLA's HIGHEST-precision matmul.

  x [M, K], fn [n, C, K] f32 (a stack) or [C, K], layer int32 -> (dot [M, C] f32, mean square [M] f32)
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from . import _compat
from ._common import next_pow2
from ._compat import TritonCompilerParams

F32 = jnp.float32
MAX_TOKENS = 64
COLS = 256  # columns a chunk
SPLITS = 64  # programs: 256 columns each at Flash's K = 16384


def supported(x, fn) -> bool:
    """x [M, K] with M <= MAX_TOKENS and K a multiple of COLS; fn [n, C, K] or [C, K] of the same K."""
    return (x.ndim == 2 and x.shape[0] <= MAX_TOKENS and x.shape[1] % COLS == 0 and fn.ndim in (2, 3)
            and fn.shape[-1] == x.shape[1])


def _kernel(layer_ref, x_ref, fn_ref, o_ref, *, c: int, chunks: int):
    s = pl.program_id(0)
    layer = layer_ref[0]
    accs = None
    for k in range(chunks):  # static: a program's few chunks
        col = (s * chunks + k) * COLS
        xs = x_ref[:, pl.ds(col, COLS)].astype(F32)
        parts = [jnp.sum(xs * fn_ref[layer * c + j, pl.ds(col, COLS)][None, :], axis=1) for j in range(c)]
        parts.append(jnp.sum(xs * xs, axis=1))
        accs = parts if accs is None else [a + p for a, p in zip(accs, parts)]
    for j, a in enumerate(accs):
        o_ref[0, :, j] = a


def hc_mix(x, fn, layer=None, *, interpret=None, splits: int = SPLITS, num_warps: int = 4):
    """(x @ fn[layer].T in f32, the mean of x^2 over K) for x [M, K] (any float dtype) and fn a stack [n, C, K] read
    at `layer` (a [C, K] fn without). Shapes must pass `supported`."""
    if interpret is None:
        interpret = _compat.backend() == "cpu"
    if not supported(x, fn):
        raise ValueError(f"x {x.shape}, fn {fn.shape}: expected x [M <= {MAX_TOKENS}, K] with K a multiple of {COLS} "
                         "and fn [n, C, K] or [C, K]")
    m, k = x.shape
    c = fn.shape[-2]
    n_chunks = k // COLS
    splits = max(1, min(splits, n_chunks))
    while n_chunks % splits:
        splits -= 1
    tb = next_pow2(m)
    x2 = jnp.pad(x, ((0, tb - m), (0, 0)))
    f2 = fn.astype(F32).reshape(-1, k)
    layer = jnp.zeros((1,), jnp.int32) if layer is None else jnp.asarray(layer, jnp.int32).reshape(1)
    width = next_pow2(c + 1)  # the C sums and the mean square, padded to a power of two (Triton's block shapes)
    full = lambda a: pl.BlockSpec(a.shape, lambda *_: (0,) * a.ndim)  # noqa: E731
    kw = dict(interpret=True) if interpret else dict(compiler_params=TritonCompilerParams(num_warps=num_warps,
                                                                                         num_stages=1))
    parts = pl.pallas_call(
        functools.partial(_kernel, c=c, chunks=n_chunks // splits),
        out_shape=jax.ShapeDtypeStruct((splits, tb, width), F32), grid=(splits,),
        in_specs=[full(layer), full(x2), full(f2)],
        out_specs=pl.BlockSpec((1, tb, width), lambda s: (s, 0, 0)), name="v4_hc_mix", **kw,
    )(layer, x2, f2)
    total = jnp.sum(parts, axis=0)[:m]
    return total[:, :c], total[:, c] / k
