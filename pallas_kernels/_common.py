"""Small helpers shared by the kernels: padding of row-id lists, contiguous-run detection for DMA gathers."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

F32 = jnp.float32
NEG_INF = float("-inf")
# A finite "minus infinity" for running maxima, so exp(m_old - m_new) never sees inf - inf.
MASK_FLOOR = -1e30


def round_up(x: int, m: int) -> int:
  return (x + m - 1) // m * m


def next_pow2(x: int) -> int:
  return 1 if x <= 1 else 1 << (int(x) - 1).bit_length()


def pad_last(x: jax.Array, size: int, value) -> jax.Array:
  """Pads the last axis of x up to `size` with `value` (no-op when already that size)."""
  n = x.shape[-1]
  if n == size:
    return x
  if n > size:
    raise ValueError(f"cannot pad {n} down to {size}")
  pad = [(0, 0)] * (x.ndim - 1) + [(0, size - n)]
  return jnp.pad(x, pad, constant_values=value)


def gather_groups(rows: jax.Array, group: int, n_pool_rows: int):
  """For DMA gathers in groups of `group` rows: per group, whether it can be fetched with ONE copy, and from
  which start row.

  A group is one copy when its ids are consecutive valid rows (r, r+1, ..., r+group-1), or when all of its ids
  are -1 (then rows 0..group-1 are fetched, finite pool data that the kernel masks out). Otherwise the kernel
  copies row by row (clamping -1 to row 0). rows [..., n] with n % group == 0. Returns (flag, start), int32
  [..., n // group].
  """
  *lead, n = rows.shape
  rg = rows.reshape(*lead, n // group, group)
  first = rg[..., 0]
  consec = jnp.all(rg == first[..., None] + jnp.arange(group, dtype=rows.dtype), axis=-1)
  consec &= (first >= 0) & (first + group <= n_pool_rows)
  allinv = jnp.all(rg < 0, axis=-1) & (n_pool_rows >= group)
  flag = (consec | allinv).astype(jnp.int32)
  start = jnp.where(consec, first, 0).astype(jnp.int32)
  return flag, start


def dot_f32(a, b, dims):
  """dot_general with f32 accumulation; f32 operands get full precision (no TF32/bf16 passes)."""
  prec = jax.lax.Precision.HIGHEST if (a.dtype == F32 or b.dtype == F32) else None
  return jax.lax.dot_general(a, b, (dims, ((), ())), precision=prec, preferred_element_type=F32)


def mm_nt(a, b):
  """a [M, K] @ b[N, K].T -> [M, N] f32."""
  return dot_f32(a, b, ((1,), (1,)))


def mm_nn(a, b):
  """a [M, K] @ b[K, N] -> [M, N] f32."""
  return dot_f32(a, b, ((1,), (0,)))


def pv_matmul(p, v):
  """p [M, C] f32 @ v [C, N] -> [M, N] f32, accurate to ~2^-17 relative for bf16 v: p is split into a bf16
  high part and a bf16 residual, so both products run on bf16 matrix units with exact products."""
  if v.dtype == jnp.bfloat16:
    p_hi = p.astype(jnp.bfloat16)
    p_lo = (p - p_hi.astype(F32)).astype(jnp.bfloat16)
    return mm_nn(p_hi, v) + mm_nn(p_lo, v)
  return mm_nn(p, v.astype(F32))


def common_compute_dtype(*dtypes):
  """bf16 only if every operand is bf16; f32 otherwise."""
  return jnp.bfloat16 if all(jnp.dtype(d) == jnp.bfloat16 for d in dtypes) else F32


def as_np(x):
  return np.asarray(jax.device_get(x))
