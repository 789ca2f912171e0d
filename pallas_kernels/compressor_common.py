"""The compressor's maths shared by its portable kernels and references (compressor.py) and the GPU decode kernel
(compressor_gpu.py): the f32 projections, an entry's norm and RoPE, the state's dimensions."""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from ._common import F32

HI = lax.Precision.HIGHEST


def project_f32(x, w):
    """x [..., Dm] @ w [N, Dm].T in f32. bf16 x bf16 runs as a bf16 matmul with f32 accumulation (the products are
    exact in f32, so this is the official f32 projection up to summation order); anything else in f32 at full
    precision. (f32 HIGHEST on bf16 data made the H200 prefill compressor 1.41 ms for 97 us of matmul.)"""
    if x.dtype == w.dtype == jnp.bfloat16:
        return lax.dot_general(x, w, (((x.ndim - 1,), (1,)), ((), ())), preferred_element_type=F32)
    return lax.dot_general(x.astype(F32), w.astype(F32), (((x.ndim - 1,), (1,)), ((), ())), precision=HI)


def finish_entry(pooled, norm_w, cos, sin, *, eps, entry_dtype=F32):
    """RMSNorm(norm_w, eps) then interleaved (GPT-J) RoPE on the last rd = 2 * cos.shape[-1] dims.
    pooled [..., d] f32, cos/sin [..., rd/2] -> [..., d] f32. The pooled window and the normed entry are rounded
    to entry_dtype on the way, as the model (and the official code) do in the activation dtype, so that with bf16
    activations the entries match the XLA path's up to the pooling's f32 summation order."""
    c = pooled.astype(entry_dtype).astype(F32)
    c = c * lax.rsqrt(jnp.mean(c * c, axis=-1, keepdims=True) + eps) * norm_w.astype(F32)
    c = c.astype(entry_dtype).astype(F32)
    half = cos.shape[-1]
    if half == 0:
        return c
    d = c.shape[-1]
    rd = 2 * half
    r = c[..., d - rd:].reshape(*c.shape[:-1], half, 2)
    x0, x1 = r[..., 0], r[..., 1]
    cos, sin = cos.astype(F32), sin.astype(F32)
    y = jnp.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], axis=-1).reshape(*c.shape[:-1], rd)
    return jnp.concatenate([c[..., :d - rd], y], axis=-1)


def state_dims(kv_state, norm_w, ratio, overlap):
    m = int(ratio)
    coff = 2 if overlap else 1
    d = norm_w.shape[0]
    if kv_state.shape[-2:] != (coff * m, coff * d):
        raise ValueError(f"state shape {kv_state.shape} does not match ratio={m}, overlap={overlap}, d={d}")
    return m, coff, d
