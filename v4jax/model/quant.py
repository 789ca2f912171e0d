"""The official release's quantisation numerics as jnp round trips (reference §9.1), for `quant_sim=True`.

Values stay in float; each function rounds x exactly as the official kernels store it (FP8 e4m3 with ue8m0
power-of-two block scales, FP4 e2m1 with power-of-two block scales, both round-to-nearest-even)."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from scipy.linalg import hadamard

from pallas_kernels import kv_format

F32 = jnp.float32
FP8_MAX = 448.0
FP4_MAX = 6.0


def _blocks(x, block):
    """View the last axis as [..., n_blocks, block], zero-padding a ragged tail (zeros never raise amax)."""
    k = x.shape[-1]
    pad = (-k) % block
    if pad:
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])
    return x.reshape(*x.shape[:-1], -1, block), k


def _pow2_scale(amax, floor, qmax):
    """2^ceil(log2(max(amax, floor) / qmax)), exactly (the stored formats' scale: pallas_kernels.kv_format)."""
    return kv_format.pow2_scale(amax, floor, qmax)[0]


def fp8_roundtrip(x, block: int):
    """act_quant(..., inplace): s = 2^ceil(log2(max(amax, 1e-4) / 448)); x <- e4m3(clip(x / s)) * s."""
    xb, k = _blocks(x.astype(F32), block)
    s = _pow2_scale(jnp.max(jnp.abs(xb), axis=-1, keepdims=True), 1e-4, FP8_MAX)
    q = jnp.clip(xb / s, -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn).astype(F32) * s
    return q.reshape(*x.shape[:-1], -1)[..., :k].astype(x.dtype)


def _round_e2m1(y):
    """Round |y| <= 6 to the nearest e2m1 value, ties to the even mantissa (hardware RNE), as FP4 keys store it."""
    return kv_format.e2m1_value(kv_format.e2m1_code(y) | jnp.where(y < 0, 8, 0))


def fp4_roundtrip(x, block: int = 32):
    """fp4_act_quant(..., inplace): s = 2^ceil(log2(max(amax, 6*2^-126) / 6)); x <- e2m1(clip(x / s)) * s."""
    xb, k = _blocks(x.astype(F32), block)
    s = _pow2_scale(jnp.max(jnp.abs(xb), axis=-1, keepdims=True), FP4_MAX * 2.0 ** -126, FP4_MAX)
    q = _round_e2m1(jnp.clip(xb / s, -FP4_MAX, FP4_MAX)) * s
    return q.reshape(*x.shape[:-1], -1)[..., :k].astype(x.dtype)


def hadamard_rotate(x):
    """Normalised Walsh-Hadamard transform along the last axis (a power of two): x @ H * n^-0.5."""
    n = x.shape[-1]
    h = jnp.asarray(hadamard(n) * n ** -0.5, F32)
    return jnp.einsum("...i,ij->...j", x.astype(F32), h).astype(x.dtype)
