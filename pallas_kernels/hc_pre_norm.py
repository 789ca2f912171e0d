"""mHC's collapse of the streams and the RMS norm after it (reference §5, then the layer's attention or FFN norm) as
one GPU kernel for a decode step's few tokens.

XLA runs the pair as three launches per mHC at one to 64 tokens: the collapse u = sum_n pre_n X_n (a reduce
fusion), the norm's sum of squares (a second reduce) and the normalisation with its weight (a loop fusion): 24 of a
flash-slice decode step's ~280 launches at batch 1 (`v4jax bench gpu-launches`), each a few microseconds over a few
tens of kilobytes. Here one program per token reads its N streams once, collapses them, rounds u to the streams'
dtype as the model does, and normalises it with the layer's norm weight, read from the weight stack at the layer's
row in place (a slice handed to a kernel is a copy of its own, one more launch).

  x [M, N, D], pre [M, N] f32, weight [n, D] f32 (the stack) or [D], layer int32 -> [M, D] in x's dtype, rounded as
  v4jax.model.layers.hc_pre then rms_norm: u = sum_n pre_n x_n in f32 (n in order) rounded to x's dtype; then
  u * rsqrt(mean(u^2) + eps) * weight, rounded. Only the order of the D-term sum of squares differs from XLA's.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from . import _compat
from ._compat import TritonCompilerParams

F32 = jnp.float32
MAX_TOKENS = 64  # a decode step's rows; a prefill chunk's many tokens keep XLA's fusions (they run at bandwidth)


def supported(x, weight) -> bool:
    """x [M, N, D] with M <= MAX_TOKENS and N, D powers of two (Triton's block shapes); weight [n, D] or [D]."""
    m, n, d = x.shape if x.ndim == 3 else (None, None, None)
    pow2 = lambda v: v is not None and v >= 1 and v & (v - 1) == 0  # noqa: E731
    return (x.ndim == 3 and m <= MAX_TOKENS and pow2(n) and pow2(d) and d >= 16 and weight.ndim in (1, 2)
            and weight.shape[-1] == d)


def _kernel(layer_ref, x_ref, pre_ref, w_ref, o_ref, *, n: int, eps: float):
    dt = o_ref.dtype
    u = pre_ref[0, 0] * x_ref[0, 0, :].astype(F32)
    for j in range(1, n):
        u = u + pre_ref[0, j] * x_ref[0, j, :].astype(F32)
    u = u.astype(dt).astype(F32)
    inv = jax.lax.rsqrt(jnp.mean(u * u) + eps)
    w = w_ref[layer_ref[0], :]
    o_ref[0, :] = (u * inv * w).astype(dt)


def hc_pre_norm(x, pre, weight, layer=None, *, eps: float, interpret=None, num_warps: int = 4):
    """The Pallas form of rms_norm(hc_pre's collapse): x [M, N, D], pre [M, N], weight a stack [n, D] read at
    `layer` (a [D] weight without) -> [M, D] in x's dtype. Shapes must pass `supported`."""
    if interpret is None:
        interpret = _compat.backend() == "cpu"
    if not supported(x, weight):
        raise ValueError(f"x {x.shape}, weight {weight.shape}: expected [M <= {MAX_TOKENS}, N, D] with N and D "
                         "powers of two and a weight [n, D] or [D]")
    m, n, d = x.shape
    w = weight.astype(F32).reshape(-1, d)
    layer = jnp.zeros((1,), jnp.int32) if layer is None else jnp.asarray(layer, jnp.int32).reshape(1)
    full = lambda a: pl.BlockSpec(a.shape, lambda i: (0,) * a.ndim)  # noqa: E731
    kw = dict(interpret=True) if interpret else dict(compiler_params=TritonCompilerParams(num_warps=num_warps,
                                                                                         num_stages=1))
    return pl.pallas_call(
        functools.partial(_kernel, n=n, eps=eps),
        out_shape=jax.ShapeDtypeStruct((m, d), x.dtype), grid=(m,),
        in_specs=[full(layer), pl.BlockSpec((1, n, d), lambda i: (i, 0, 0)), pl.BlockSpec((1, n), lambda i: (i, 0)),
                  full(w)],
        out_specs=pl.BlockSpec((1, d), lambda i: (i, 0)), name="v4_hc_pre_norm", **kw,
    )(layer, x, pre.astype(F32), w)
