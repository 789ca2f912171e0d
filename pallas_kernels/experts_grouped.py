"""The routed experts of a prefill chunk on Hopper GPUs: (token, expert) pairs sorted by expert, each expert's
rows multiplied by its own weights in one grouped matmul (JAX's Mosaic-GPU ragged matmul,
jax.experimental.pallas.ops.gpu.ragged_dot_mgpu: wgmma tiles, TMA loads, a persistent grid over the SMs).

Why: XLA:GPU has no grouped matmul. Its `lax.ragged_dot` runs every sorted row against every expert, so the
model's prefill used the dense form instead (every expert over every token, weighted by the mostly-zero combine
weights): E / k = 16 / 6 times the FLOPs the routing asks for (flash-slice, 8192-token chunk: see
v4jax bench kernels --sweep prefill_experts and BENCHMARKS "Prefill").

  x [M, D]; weights, experts [M, k] (an id outside [0, E), e.g. -1, is no expert: weight 0); w1, w3 [E, I, D];
  w2 [E, D, I]; with `layer`, layer stacks [n, E, ...] (the layer's experts are sliced out: a copy of ~0.8 GB,
  small against the chunk's matmuls). Returns sum_k weights * FFN(x) in f32 [M, D]; the matmuls' outputs are
  rounded to x's dtype (the kernel writes x's dtype), the SwiGLU and the combine run in f32.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from . import _compat
from .experts import swiglu

F32 = jnp.float32
MIN_TOKENS = 512  # below this a chunk's experts are few rows each: the other forms (measured: bench script)


@dataclasses.dataclass(frozen=True)
class Blocks:
    """The ragged matmul's tiles: rows and columns per output tile, the contraction step, pipeline depth, and how
    many column tiles one SM walks before the next rows (L2 reuse of the rows)."""
    m: int = 128
    n: int = 128
    k: int = 64
    steps: int = 4
    grid_n: int = 8  # 4.73 ms vs 4.90 with 4 for an 8192-token chunk (--sweep prefill_experts)


BLOCKS = Blocks()


def _ragged_dot_mgpu():
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu
    return ragged_dot_mgpu.ragged_dot


def supported(x, w1) -> bool:
    """On a Hopper GPU (wgmma), for a chunk of at least MIN_TOKENS tokens, bf16 weights, widths in whole k-steps."""
    if _compat.backend() != "gpu" or x.ndim != 2 or x.shape[0] < MIN_TOKENS:
        return False
    if not str(jax.devices()[0].compute_capability).startswith("9."):
        return False
    whole = math.lcm(BLOCKS.n, BLOCKS.k)  # D and I are each a matmul's output width in one, contraction in another
    return x.dtype == w1.dtype == jnp.bfloat16 and x.shape[-1] % whole == 0 and w1.shape[-2] % whole == 0


def grouped_matmul(rows, w, sizes, blocks: Blocks = BLOCKS):
    """rows [R, K] sorted by group, sizes [G] (sum = R), w [G, N, K] -> [R, N] in rows' dtype: row r of group g
    times w[g]^T."""
    fn = _ragged_dot_mgpu()
    return fn(rows, w, group_sizes=sizes, block_m=blocks.m, block_n=blocks.n, block_k=blocks.k,
              max_concurrent_steps=blocks.steps, grid_block_n=blocks.grid_n, transpose_rhs=True)


def routed_experts(x, weights, experts, w1, w2, w3, limit, layer=None, *, blocks: Blocks = BLOCKS,
                   matmul=None, w2_input=None):
    """See the module docstring. `matmul(rows, w, sizes)`: the grouped matmul (default the Mosaic-GPU kernel;
    tests on CPU pass an XLA one). `w2_input(h, w)`: the release's numerics (h the f32 SwiGLU [R, I], w each
    row's routing weight [R, 1]; the caller scales and rounds it, as the official expert does before w2), the
    outputs then summed unweighted; None: h in x's dtype, the outputs weighted."""
    matmul = matmul or functools.partial(grouped_matmul, blocks=blocks)
    if layer is not None:
        w1, w2, w3 = (jax.lax.dynamic_index_in_dim(w, layer, 0, keepdims=False) for w in (w1, w2, w3))
    m, k = experts.shape
    n_exp = w1.shape[0]
    dt = x.dtype
    chosen = (experts >= 0) & (experts < n_exp)
    # a pair of no expert goes to expert 0 with weight 0 (the sizes must cover every row)
    flat_e = jnp.where(chosen, experts, 0).reshape(-1)
    flat_w = jnp.where(chosen, weights, 0.0).reshape(-1)
    order = jnp.argsort(flat_e, stable=True)
    tok = order // k
    # rows padded to whole row tiles, the padding in the last expert's group (zero rows, weight 0): every tile the
    # kernel loads and stores lies inside the arrays (its partial-last-tile path is not what we test)
    pad = -(m * k) % blocks.m
    sizes = jnp.bincount(flat_e, length=n_exp).astype(jnp.int32).at[-1].add(pad)
    xs = jnp.pad(x[tok], ((0, pad), (0, 0)))                                 # [M*k + pad, D]
    h = swiglu(matmul(xs, w1, sizes).astype(F32), matmul(xs, w3, sizes).astype(F32), limit)
    if w2_input is None:
        y = matmul(h.astype(dt), w2, sizes)                                   # [M*k + pad, D] sorted
    else:
        sorted_w = jnp.pad(flat_w[order], (0, pad))[:, None]
        y = matmul(w2_input(h, sorted_w).astype(dt), w2, sizes)
    # back to (token, k) order by a gather, summed over k in the reference's order (a scatter-add of the
    # sorted rows was 42 ms of a 128K prefill's kernel time)
    unsort = jnp.zeros((m * k,), jnp.int32).at[order].set(jnp.arange(m * k, dtype=jnp.int32))
    y = y[unsort].astype(F32).reshape(m, k, -1)
    return jnp.sum(y, axis=1) if w2_input is not None else jnp.sum(y * flat_w.reshape(m, k, 1), axis=1)
