"""A decode step's routed experts on a TPU with the weights as the release stores them (FP4 e2m1 codes, two a byte,
one ue8m0 scale per 1 x 32), each chosen expert's codes read in place from the layer stack and widened in VMEM
(Mosaic).

Why: XLA-TPU widens the experts in HBM before its matmuls. Compiled with libtpu for v5e (no TPU attached), the XLA
forms of v4jax.model.layers.routed_experts on a 2-layer stack of 64 Flash-sized experts (I 2048, D 4096), 6
active: 1.0 GB of temporaries at one token (the gather form) and 5.4 GB at 32 (the grouped form widens the whole
stack), against 75 MB of codes for the 6 experts one token reads.

The maths is the gather form's with the release's rounding (act_quant): for each (token, expert) pair p,
  h_p = swiglu(x_t @ W1_e.T, x_t @ W3_e.T)          [I] f32
  y_t = sum_p  W2_e @ round_fp8(weight_p * h_p)     [D] f32
and every weight is an e2m1 value times a power of two, exact in bf16, so the products are the reference's; only
the order of the f32 sums differs.

  One kernel, run three times (w1, w3, w2): out[p] = W_{expert[p]} @ a[row[p]] for pairs p, over a layer stack of
  codes [n, E, O, K/2] and scales [n, E, O, K/32]. Grid (P, O/BO): program (p, j) takes the pair's row of a as its
  even and odd columns (a byte's low nibble is the even column, its high nibble the odd one), the codes tile
  [BO, K/2] of its expert (layer, expert and row are prefetched scalars, so the tile is DMA'd from the stack where
  it lies) and the tile's scales, and over chunks of KC bytes
      s  = scales [BO, K/32] @ expand[:, chunk]        [BO, KC] f32 (expand: 0/1, column j of chunk <- scale j // 16;
                                                        exact: one power of two per sum)
      out[p, j-tile] += a_even[chunk] @ (e2m1(low nibbles) * s).T + a_odd[chunk] @ (e2m1(high nibbles) * s).T
  The scale expansion runs on the MXU: spreading a lane across 16 lanes has no cheap vector form. A pair whose
  expert recurs in the step reads that expert again (a step of B tokens reads B * k experts' codes where the GPU
  kernel groups the tokens of an expert); at Flash's 256 experts and batch 32, about 1.4x the distinct experts.
  Not yet timed on a TPU.
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
SCALE_COLS = 32  # logical columns per ue8m0 scale
BLOCK_OUT = 256  # outputs per program
CHUNK = 512  # code bytes (1024 columns) widened at a time: [BO, CHUNK] f32 values in VMEM
MAX_PAIRS = 512  # token x expert pairs of one call (a decode step's; prefill chunks take XLA's forms)


def supported(x, experts, w1_codes, w2_codes) -> bool:
    """x [M, D] in bf16 or f32, at most MAX_PAIRS (token, expert) pairs; codes [..., O, K/2] uint8 with O a
    multiple of its block (BLOCK_OUT, or all of a smaller O) and K/2 of its chunk, w1's K the width of x."""
    def fits(codes):
        o, half = codes.shape[-2:]
        return codes.dtype == jnp.uint8 and o % _block_out(o) == 0 and half % _chunk(half) == 0
    return (x.ndim == 2 and x.dtype in (jnp.bfloat16, F32) and experts.size <= MAX_PAIRS
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


def _scale_f32(scale):
    """ue8m0 scales -> 2^(byte - 127) in f32 (byte 0: 2^-127), exactly."""
    b = lax.bitcast_convert_type(scale, jnp.uint8).astype(jnp.int32)
    return jnp.where(b == 0, jnp.float32(2.0 ** -127), lax.bitcast_convert_type(b << 23, F32))


def _kernel(layer_ref, expert_ref, row_ref, ae_ref, ao_ref, c_ref, s_ref, ex_ref, o_ref, *, half: int, kc: int):
    del layer_ref, expert_ref, row_ref  # used by the index maps
    dt = ae_ref.dtype
    s = _scale_f32(s_ref[...]).astype(jnp.bfloat16)  # a power of two: exact

    def chunk(q, acc):
        col = pl.multiple_of(q * kc, kc)
        sx = lax.dot_general(s, ex_ref[:, pl.ds(col, kc)], (((1,), (0,)), ((), ())),
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


def pair_matvec(a, codes, scales, layer, expert, row, *, interpret=None):
    """out[p] = W[layer, expert[p]] @ a[row[p]] in f32, for W as stored: codes [n, E, O, K/2] uint8, scales
    [n, E, O, K/32] ue8m0; a [R, K] in bf16 or f32; expert, row [P] int32 -> [P, O] f32."""
    if interpret is None:
        interpret = _compat.backend() != "tpu"
    _, _, o, half = codes.shape
    p = expert.shape[0]
    ae = a[:, 0::2].reshape(a.shape[0], 1, half)
    ao = a[:, 1::2].reshape(a.shape[0], 1, half)
    kb = scales.shape[-1]
    bo = _block_out(o)
    lay = jnp.asarray(layer, jnp.int32).reshape(1)
    out = pl.pallas_call(
        functools.partial(_kernel, half=half, kc=_chunk(half)),
        out_shape=jax.ShapeDtypeStruct((p, 1, o), F32),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3,
            # pairs innermost: a pair of the same expert as the one before it reuses the codes tile in VMEM (Pallas
            # fetches a block only when its index changes between consecutive programs)
            grid=(o // bo, p),
            in_specs=[pl.BlockSpec((None, 1, half), lambda j, i, lr, er, rr: (rr[i], 0, 0)),
                      pl.BlockSpec((None, 1, half), lambda j, i, lr, er, rr: (rr[i], 0, 0)),
                      pl.BlockSpec((None, None, bo, half), lambda j, i, lr, er, rr: (lr[0], er[i], j, 0)),
                      pl.BlockSpec((None, None, bo, kb), lambda j, i, lr, er, rr: (lr[0], er[i], j, 0)),
                      pl.BlockSpec((kb, half), lambda j, i, lr, er, rr: (0, 0))],
            out_specs=pl.BlockSpec((None, 1, bo), lambda j, i, lr, er, rr: (i, 0, j))),
        compiler_params=_compat.TPUCompilerParams(dimension_semantics=("parallel", "parallel")),
        interpret=_compat.interpret_arg(interpret, "hlo"),
        name="v4_fp4_experts_tpu",
    )(lay, expert.astype(jnp.int32), row.astype(jnp.int32), ae, ao, codes, scales, _expand_matrix(half))
    return out.reshape(p, o)


def routed_experts_fp4(x, weights, experts, w1, w2, w3, limit, w2_input, *, layer=None, interpret=None):
    """The routed experts' sum for a decode step's few tokens, weights as stored: x [M, D] (rounded to FP8 as the
    release does), weights / experts [M, k] (-1: none, weight 0); w1, w2, w3 (codes, scales) pairs of stacks
    [n, E, ...] (without `layer`: [E, ...]); w2_input(h, weight) the release's input of w2 (the routing weight
    times the SwiGLU, rounded to FP8). -> [M, D] f32."""
    from .experts import swiglu
    if layer is None:
        w1, w2, w3 = ((c[None], s[None]) for c, s in (w1, w2, w3))
        layer = 0
    m, k = experts.shape
    n_exp = w1[0].shape[1]
    pairs = m * k
    if not supported(x, experts, w1[0], w2[0]):
        raise ValueError(f"x {x.shape} {x.dtype}, {m} tokens x {k} experts, codes {w1[0].shape} / {w2[0].shape}: "
                         f"see supported")
    # Pairs sorted by expert, those of no expert (-1: another shard's, weight 0) last and given the last real
    # pair's expert: a run of one expert reads its codes once (pair_matvec's grid), and an empty pair reads none
    flat = experts.reshape(pairs)
    order = jnp.argsort(jnp.where(flat >= 0, flat, n_exp), stable=True)
    expert = flat[order]
    n_real = jnp.sum(flat >= 0)
    expert = jnp.where(expert >= 0, expert, jnp.maximum(expert[jnp.maximum(n_real - 1, 0)], 0)).astype(jnp.int32)
    token = (order // k).astype(jnp.int32)
    mv = functools.partial(pair_matvec, layer=layer, expert=expert, interpret=interpret)
    h = swiglu(mv(x, *w1, row=token), mv(x, *w3, row=token), limit)                      # [P, I] f32
    hin = w2_input(h, jnp.where(flat >= 0, weights.reshape(pairs), 0.0)[order][:, None])  # an empty pair: 0
    y = mv(hin, *w2, row=jnp.arange(pairs, dtype=jnp.int32))                               # [P, D] f32
    return jnp.zeros((m, y.shape[-1]), F32).at[token].add(y)
