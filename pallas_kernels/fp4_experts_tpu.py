"""The routed experts on a TPU with the weights as the release stores them (FP4 e2m1 codes, two a byte, one ue8m0
scale per 1 x 32), each chosen expert's codes read in place from the layer stack and widened in VMEM (Mosaic): a
decode step's few tokens and a prefill chunk's alike.

Why: XLA-TPU widens the experts in HBM before its matmuls. Compiled with libtpu for v5e (no TPU attached), the XLA
forms of v4jax.model.layers.routed_experts on a 2-layer stack of 64 Flash-sized experts (I 2048, D 4096), 6
active: 1.0 GB of temporaries at one token (the gather form) and 5.4 GB at 32 (the grouped form), against 75 MB of
codes for the 6 experts one token reads; Flash's 256-token prefill chunk on a v6e-8 slice did not fit for them.

The maths is the gather form's with the release's rounding (act_quant): for each (token, expert) pair p,
  h_p = swiglu(x_t @ W1_e.T, x_t @ W3_e.T)          [I] f32
  y_t = sum_p  W2_e @ round_fp8(weight_p * h_p)     [D] f32
and every weight is an e2m1 value times a power of two, exact in bf16, so the products are the reference's; only
the order of the f32 sums differs.

  The pairs are laid out in row tiles of TM rows, each tile one expert's pairs (padded with zero rows; TM 8 for a
  decode step, 32 for a prefill chunk), tiles of one expert consecutive. One kernel, run three times (w1, w3, w2):
  out[tile] = a[tile] @ W_{tile_expert}.T over a layer stack of codes [n, E, O, K/2] and scales [n, E, O, K/32].
  Grid (O/BO, T): program (j, t) takes the tile's rows of a as their even and odd columns (a byte's low nibble is
  the even column, its high nibble the odd one), the codes tile [BO, K/2] of its expert (layer and expert are
  prefetched scalars, so the tile is DMA'd from the stack where it lies; the next tile of the same expert finds it
  in VMEM) and the tile's scales, and over chunks of KC bytes
      s  = scales [BO, K/32] @ expand[:, chunk]        [BO, KC] f32 (expand: 0/1, column j of chunk <- scale j // 16;
                                                        exact: one power of two per sum; scales of fewer than
                                                        128 columns come as [K/32, BO] blocks, contracted on
                                                        their rows: see tile_matmul)
      out[t, j-tile] += a_even[chunk] @ (e2m1(low nibbles) * s).T + a_odd[chunk] @ (e2m1(high nibbles) * s).T
  The scale expansion runs on the MXU: spreading a lane across 16 lanes has no cheap vector form. Each tile widens
  its codes tile again (an expert with more pairs than TM widens once per tile). Not yet timed on a TPU.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from . import _compat
from ._common import ue8m0_to_f32
from .experts_tpu import tile_rows, tiles

F32 = jnp.float32
SCALE_COLS = 32  # logical columns per ue8m0 scale
BLOCK_OUT = 256  # outputs per program
CHUNK = 512  # code bytes (1024 columns) widened at a time: [BO, CHUNK] f32 values in VMEM
# Rows per tile: experts_tpu.tile_rows (a tile widens its codes tile again, so fewer, fuller tiles widen less)


def supported(x, w1_codes, w2_codes) -> bool:
    """x [M, D] in bf16 or f32; codes [..., O, K/2] uint8 with O a
    multiple of its block (BLOCK_OUT, or all of a smaller O) and K/2 of its chunk, w1's K the width of x."""
    def fits(codes):
        o, half = codes.shape[-2:]
        return codes.dtype == jnp.uint8 and o % _block_out(o) == 0 and half % _chunk(half) == 0
    return (x.ndim == 2 and x.dtype in (jnp.bfloat16, F32)
            and x.shape[-1] == 2 * w1_codes.shape[-1] and fits(w1_codes) and fits(w2_codes))


def _chunk(half: int) -> int:
    return min(CHUNK, half)


def _block_out(o: int) -> int:
    return min(BLOCK_OUT, o)


def _e2m1(c):
    """4-bit e2m1 codes (int32) -> their values in f32: magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6, sign bit 8."""
    k = c & 7
    kf = k.astype(F32)
    mag = jnp.where(k < 4, 0.5 * kf, jnp.where(k < 6, kf - 2.0, 2.0 * kf - 8.0))
    return jnp.where((c & 8) != 0, -mag, mag)


def _kernel(layer_ref, expert_ref, ae_ref, ao_ref, c_ref, s_ref, ex_ref, o_ref, *, half: int, kc: int,
            scales_t: bool):
    del layer_ref, expert_ref  # used by the index maps
    dt = ae_ref.dtype
    s = ue8m0_to_f32(s_ref[...]).astype(jnp.bfloat16)  # a power of two: exact; [BO, K/32] or (scales_t) [K/32, BO]
    s_dim = 0 if scales_t else 1

    def chunk(q, acc):
        col = pl.multiple_of(q * kc, kc)
        sx = lax.dot_general(s, ex_ref[:, pl.ds(col, kc)], (((s_dim,), (0,)), ((), ())),
                             preferred_element_type=F32)                                    # [BO, KC]
        c = c_ref[:, pl.ds(col, kc)].astype(jnp.int32)
        lo = (_e2m1(c & 15) * sx).astype(dt)
        hi = (_e2m1((c >> 4) & 15) * sx).astype(dt)
        nt = (((1,), (1,)), ((), ()))
        acc = acc + lax.dot_general(ae_ref[:, pl.ds(col, kc)], lo, nt, preferred_element_type=F32)
        return acc + lax.dot_general(ao_ref[:, pl.ds(col, kc)], hi, nt, preferred_element_type=F32)

    o_ref[...] = lax.fori_loop(0, half // kc, chunk, jnp.zeros(o_ref.shape, F32))


def _expand_matrix(half: int):
    """[K/32, K/2] bf16: entry (b, j) is 1 where code byte j's columns (2j, 2j + 1) have scale b."""
    return (jnp.arange(half)[None, :] // (SCALE_COLS // 2) == jnp.arange(half * 2 // SCALE_COLS)[:, None]).astype(
        jnp.bfloat16)


def tile_matmul(a, codes, scales, layer, tile_expert, tm: int, *, interpret=None):
    """out[t*TM : (t+1)*TM] = a[t*TM : (t+1)*TM] @ W[layer, tile_expert[t]].T in f32, for W as stored: codes
    [n, E, O, K/2] uint8, scales [n, E, O, K/32] ue8m0; a [T * TM, K] in bf16 or f32 (row tiles of one expert
    each); tile_expert [T] int32 -> [T * TM, O] f32."""
    if interpret is None:
        interpret = _compat.backend() != "tpu"
    _, _, o, half = codes.shape
    t = tile_expert.shape[0]
    ae, ao = a[:, 0::2], a[:, 1::2]
    kb = scales.shape[-1]
    bo = _block_out(o)
    # Scales of fewer than 128 columns a row (w2's K/32 under tensor=8: 8) are lane-sparse: a TPU lays such a stack
    # out with its rows minor, and the kernel's row-major operand was a padded copy of the whole stack every call
    # (libtpu AOT, v6e, Flash's 21-layer stack: 2.8 GB of temporaries). Read transposed, [K/32, O] blocks, they
    # are a view of that layout.
    scales_t = kb % 128 != 0
    if scales_t:
        scales = jnp.swapaxes(scales, -1, -2)
        s_spec = pl.BlockSpec((None, None, kb, bo), lambda j, i, lr, er: (lr[0], er[i], 0, j))
    else:
        s_spec = pl.BlockSpec((None, None, bo, kb), lambda j, i, lr, er: (lr[0], er[i], j, 0))
    lay = jnp.asarray(layer, jnp.int32).reshape(1)
    return pl.pallas_call(
        functools.partial(_kernel, half=half, kc=_chunk(half), scales_t=scales_t),
        out_shape=jax.ShapeDtypeStruct((t * tm, o), F32),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            # row tiles innermost: a tile of the same expert as the one before it reuses the codes tile in VMEM
            # (Pallas fetches a block only when its index changes between consecutive programs)
            grid=(o // bo, t),
            in_specs=[pl.BlockSpec((tm, half), lambda j, i, lr, er: (i, 0)),
                      pl.BlockSpec((tm, half), lambda j, i, lr, er: (i, 0)),
                      pl.BlockSpec((None, None, bo, half), lambda j, i, lr, er: (lr[0], er[i], j, 0)),
                      s_spec,
                      pl.BlockSpec((kb, half), lambda j, i, lr, er: (0, 0))],
            out_specs=pl.BlockSpec((tm, bo), lambda j, i, lr, er: (i, j))),
        compiler_params=_compat.TPUCompilerParams(dimension_semantics=("parallel", "parallel")),
        interpret=_compat.interpret_arg(interpret, "hlo"),
        name="v4_fp4_experts_tpu",
    )(lay, tile_expert.astype(jnp.int32), ae, ao, codes, scales, _expand_matrix(half))


def routed_experts_fp4(x, weights, experts, w1, w2, w3, limit, w2_input, *, layer=None, interpret=None):
    """The routed experts' sum for any number of tokens, weights as stored: x [M, D] (rounded to FP8 as the
    release does), weights / experts [M, k] (-1: none, weight 0); w1, w2, w3 (codes, scales) pairs of stacks
    [n, E, ...] (without `layer`: [E, ...]); w2_input(h, weight) the release's input of w2 (the routing weight
    times the SwiGLU, rounded to FP8). -> [M, D] f32."""
    from .experts import swiglu
    if layer is None:
        w1, w2, w3 = ((c[None], s[None]) for c, s in (w1, w2, w3))
        layer = 0
    m, k = experts.shape
    n_exp = w1[0].shape[1]
    if not supported(x, w1[0], w2[0]):
        raise ValueError(f"x {x.shape} {x.dtype}, {m} tokens x {k} experts, codes {w1[0].shape} / {w2[0].shape}: "
                         f"see supported")
    tm = tile_rows(m * k)
    row, tile_expert, t = tiles(experts, n_exp, tm)
    rows = t * tm
    # x's rows and the routing weights in the tiled layout (pairs of no expert dropped; padding rows are 0)
    token = jnp.arange(m * k, dtype=jnp.int32) // k
    a = jnp.zeros((rows, x.shape[-1]), x.dtype).at[row].set(x[token], mode="drop")
    wt = jnp.zeros((rows, 1), F32).at[row].set(jnp.where(experts >= 0, weights, 0.0).reshape(-1, 1), mode="drop")
    mm = functools.partial(tile_matmul, layer=layer, tile_expert=tile_expert, tm=tm, interpret=interpret)
    h = swiglu(mm(a, *w1), mm(a, *w3), limit)                                           # [rows, I] f32
    y = mm(w2_input(h, wt), *w2)                                                          # [rows, D] f32; 0 rows: 0
    return jnp.zeros((m, y.shape[-1]), F32).at[token].add(y.at[row].get(mode="fill", fill_value=0.0))
