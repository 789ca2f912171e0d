"""The routed experts on a TPU with bf16 (or f32) weights: each chosen expert's weights read in place from the
layer stack (Mosaic), a decode step's few tokens and a prefill chunk's alike; and the row tiles of one expert each
that this kernel and the FP4 one (pallas_kernels.fp4_experts_tpu) share.

Why: XLA-TPU takes a layer of the stack as a slice and materializes it before its matmuls. Compiled with libtpu for
v5p (no TPU attached), the bf16 Flash decode step on `tensor=8` held 512 MB slices of the expert stacks as
temporaries (`bf16[256, 256, 4096]`, a layer's w1, w2 or w3 on one device): every layer's experts written and read
again each step, where a step needs only the chosen experts' rows.

  The pairs (token, expert) are laid out in row tiles of TM rows, each tile one expert's pairs (padded with zero
  rows), tiles of one expert consecutive (`tiles`). One kernel, run three times (w1, w3, w2):
      out[tile] = a[tile] @ W[layer, tile_expert].T           [TM, BO] f32 per program
  over a layer stack [n, E, O, K]; grid (O/BO, T), row tiles innermost, so a tile of the same expert as the one
  before it finds the weight tile in VMEM (Pallas fetches a block only when its index changes). Layer and expert
  are prefetched scalars: the tile is DMA'd from the stack where it lies. Not yet timed on a TPU.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from . import _compat

F32 = jnp.float32
BLOCK_OUT = 256  # outputs per program: a [256, K] weight tile (K 4096 in bf16: 2 MB of VMEM, twice buffered)
# Rows per tile (each tile one expert's pairs, padded): a decode step's pairs are mostly one to an expert; a
# prefill chunk's (2048 tokens x 6 of 256 experts: ~48 to an expert) fill tiles of 32.
DECODE_TILE, PREFILL_TILE = 8, 32
DECODE_PAIRS = 512  # pairs of a call up to which it takes DECODE_TILE


def tile_rows(pairs: int) -> int:
    return DECODE_TILE if pairs <= DECODE_PAIRS else PREFILL_TILE


def tiles(experts, n_exp: int, tm: int):
    """Pairs (token, expert) laid out in row tiles of TM rows of one expert each: (row [P] of each pair in the
    tiled layout (pairs of no expert: row T * TM, dropped), tile_expert [T] (the tiles past the last used one
    repeat its expert: their blocks are not fetched again), T). T is static: enough for any routing of P pairs."""
    m, k = experts.shape
    p = m * k
    flat = experts.reshape(p)
    real = flat >= 0
    e = jnp.where(real, flat, 0)
    counts = jnp.zeros((n_exp,), jnp.int32).at[e].add(real.astype(jnp.int32))
    padded = (counts + tm - 1) // tm * tm
    start = jnp.cumsum(padded) - padded                                   # each expert's first row
    order = jnp.argsort(jnp.where(real, flat, n_exp), stable=True)
    sorted_e = e[order]
    rank = jnp.arange(p) - (jnp.cumsum(counts) - counts)[sorted_e]       # place among its expert's pairs
    t = -(-(p + min(n_exp, p) * (tm - 1)) // tm)
    row_sorted = jnp.where(real[order], start[sorted_e] + rank, t * tm)
    row = jnp.zeros((p,), jnp.int32).at[order].set(row_sorted.astype(jnp.int32))
    used = jnp.sum(padded) // tm
    # tile i's expert: the first whose rows end past the tile's first row (the unused tiles: the last used one's)
    first_row = jnp.minimum(jnp.arange(t), jnp.maximum(used - 1, 0)) * tm
    owner = jnp.searchsorted(start + padded, first_row, side="right").astype(jnp.int32)
    tile_expert = jnp.minimum(owner, n_exp - 1)
    return row, tile_expert, t


def supported(x, w1, w2) -> bool:
    """x [M, D] and the stacks [..., O, K] in bf16 or f32, each O a multiple of its block (BLOCK_OUT, or all of a
    smaller O), w1's K the width of x."""
    def fits(w):
        o = w.shape[-2]
        return w.dtype in (jnp.bfloat16, F32) and o % min(BLOCK_OUT, o) == 0
    return x.ndim == 2 and x.dtype in (jnp.bfloat16, F32) and x.shape[-1] == w1.shape[-1] and fits(w1) and fits(w2)


def _kernel(layer_ref, expert_ref, a_ref, w_ref, o_ref):
    del layer_ref, expert_ref  # used by the index maps
    o_ref[...] = lax.dot_general(a_ref[...], w_ref[...].astype(a_ref.dtype), (((1,), (1,)), ((), ())),
                                 preferred_element_type=F32)


def tile_matmul(a, w, layer, tile_expert, tm: int, *, interpret=None):
    """out[t*TM : (t+1)*TM] = a[t*TM : (t+1)*TM] @ w[layer, tile_expert[t]].T in f32: w [n, E, O, K], a [T * TM, K]
    (row tiles of one expert each), tile_expert [T] int32 -> [T * TM, O] f32."""
    if interpret is None:
        interpret = _compat.backend() != "tpu"
    _, _, o, kdim = w.shape
    t = tile_expert.shape[0]
    bo = min(BLOCK_OUT, o)
    lay = jnp.asarray(layer, jnp.int32).reshape(1)
    return pl.pallas_call(
        _kernel,
        out_shape=jax.ShapeDtypeStruct((t * tm, o), F32),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(o // bo, t),
            in_specs=[pl.BlockSpec((tm, kdim), lambda j, i, lr, er: (i, 0)),
                      pl.BlockSpec((None, None, bo, kdim), lambda j, i, lr, er: (lr[0], er[i], j, 0))],
            out_specs=pl.BlockSpec((tm, bo), lambda j, i, lr, er: (i, j))),
        compiler_params=_compat.TPUCompilerParams(dimension_semantics=("parallel", "parallel")),
        interpret=_compat.interpret_arg(interpret, "hlo"),
        name="v4_experts_tpu",
    )(lay, tile_expert.astype(jnp.int32), a, w)


def routed_experts(x, weights, experts, w1, w2, w3, limit, *, layer=None, interpret=None):
    """sum_k weights[m, k] * FFN_{experts[m, k]}(x[m]) in f32 [M, D], the hidden activation rounded to x's dtype
    (v4jax.model.layers.routed_experts without act_quant): x [M, D]; weights / experts [M, k] (-1: none, weight 0);
    w1, w3 [n, E, I, D], w2 [n, E, D, I] (without `layer`: [E, ...])."""
    from .experts import swiglu
    if layer is None:
        w1, w2, w3 = w1[None], w2[None], w3[None]
        layer = 0
    m, k = experts.shape
    if not supported(x, w1, w2):
        raise ValueError(f"x {x.shape} {x.dtype}, weights {w1.shape} {w1.dtype} / {w2.shape}: see supported")
    tm = tile_rows(m * k)
    row, tile_expert, t = tiles(experts, w1.shape[1], tm)
    token = jnp.arange(m * k, dtype=jnp.int32) // k
    a = jnp.zeros((t * tm, x.shape[-1]), x.dtype).at[row].set(x[token], mode="drop")  # padding rows: 0
    mm = functools.partial(tile_matmul, layer=layer, tile_expert=tile_expert, tm=tm, interpret=interpret)
    h = swiglu(mm(a, w1), mm(a, w3), limit).astype(x.dtype)                            # [rows, I]
    y = mm(h, w2).at[row].get(mode="fill", fill_value=0.0)                              # [M * k, D] f32
    wt = jnp.where(experts >= 0, weights, 0.0).reshape(-1, 1).astype(F32)
    return jnp.zeros((m, y.shape[-1]), F32).at[token].add(y * wt)
