"""The routed experts of a decode step: each expert's weights read once, in place, for all its tokens.

Two costs of the XLA forms, measured on the H200 (flash-slice, 16 experts of 3 x 2048 x 4096, 6 active):
* inside the layer `lax.scan` the layer's expert weights are a dynamic slice of the stack; a matmul that cannot
  fuse the slice gets a copy of all of them every step (batch 32: 2.1 ms of a 4.8 ms step; batch 1, with the
  weights handed to a custom call: 1.6 ms);
* at batch 1 the gather form writes the selected experts' weights to a new buffer and reads it again (0.20 ms
  per layer against 0.08 ms here).
Here the kernels read the stack itself at the layer's offset, and only the experts some token chose.

Pairs (token, expert) are sorted by expert; expert e's pairs are rows offs[e] .. offs[e+1] of the sorted list
(at most TB of them: a token picks distinct experts, so TB >= M suffices). A pair of no expert (an id outside
[0, E), e.g. -1 for another shard's expert on a mesh) sorts last, in no expert's rows, and adds nothing.
  up   grid (E, I/bi): program (e, j) multiplies its <= TB tokens [TB, D] by rows j*bi .. of w1 and w3 of expert e
       (in chunks of D), applies the clamped SwiGLU, writes h [E, TB, I] (rounded to x's dtype).
  down grid (E, D/bd): program (e, j) multiplies h[e] [TB, I] by rows j*bd .. of w2 of expert e: y [E, TB, D].
Experts nobody chose are skipped (their outputs are never read). The combine (weights, sum over the k experts of
each token) runs in XLA, in the reference's order.

  x [M, D]; weights, experts [M, k] (-1 = none); w1, w3 [E, I, D] or a layer stack [n, E, I, D] with `layer`;
  w2 likewise [E, D, I] / [n, E, D, I].
The jnp reference is the gather form of v4jax.model.layers.routed_experts (pairs of no expert given expert 0 and
weight 0), which takes `swiglu` from here.
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from ._common import e2m1_to_f32, layer_operand, mm_nt, next_pow2, pow2_block as _pow2_block, ue8m0_to_f32
from . import _compat
from ._compat import TritonCompilerParams, pltriton

F32 = jnp.float32

MAX_TOKENS = 64  # tokens per step the kernels take (one [TB, .] tile per expert); more: XLA's grouped forms
# Block sizes (rows per program, columns per loop step) and pipeline stages: an H100 sweep of Flash's experts (16 of
# 3 x 2048 x 4096, 6 chosen a token; `v4jax bench kernels --sweep streaming`): 32 x 256 in 3 stages read 2.66 TB/s at
# one token and 2.70 at 32 (113.7 / 298.5 us a layer), where 16 x 512 in 2 stages (an earlier H200 sweep's choice)
# read 2.34 / 2.53 (128.9 / 317.8 us); 4 stages and 8 warps were slower. Past 32 tokens 2 stages (a 64-token x tile
# per stage).
UP_ROWS, UP_COLS = 32, 256
DOWN_ROWS, DOWN_COLS = 32, 256
STAGES, STAGES_PAST_32 = 3, 2


def swiglu(h1, h3, limit):
    """Clamped SwiGLU in f32 (the model's, v4jax.model.layers.swiglu): silu(min(h1, limit)) * clip(h3, -limit,
    limit)."""
    return jax.nn.silu(jnp.minimum(h1, limit)) * jnp.clip(h3, -limit, limit)


def supported(x, w1) -> bool:
    """What the kernels take: at most MAX_TOKENS tokens; D and I divisible by power-of-two blocks of >= 16. Any
    weight array size: Pallas' Triton lowering switches to 64-bit offsets past 2**32 bytes (checked on the H200
    against float64 for a 256-expert layer of exactly 2**31 elements and stacks of 1.25 and 3 x 2**31:
    tests/test_kernels_gpu.py -k large_stacks, a slow GPU test)."""
    i, d = w1.shape[-2:]
    return x.shape[0] <= MAX_TOKENS and all(
        b is not None for b in (_pow2_block(i, UP_ROWS), _pow2_block(d, UP_COLS),
                                _pow2_block(d, DOWN_ROWS), _pow2_block(i, DOWN_COLS)))


def _expert_tokens(tok_ref, start, count, tb):
    """An expert's slots of the sorted pairs, [start, start + count), as a tile of tb: (valid [TB], the token each
    valid slot reads [TB], 0 elsewhere)."""
    slot = lax.broadcasted_iota(jnp.int32, (tb,), 0)
    valid = slot < count
    return valid, pltriton.load(tok_ref.at[jnp.where(valid, start + slot, 0)], mask=valid, other=0)


def _up_kernel(layer_ref, offs_ref, tok_ref, x_ref, w1_ref, w3_ref, h_ref, *, n_exp, n_inner, rows, cols, tb,
               limit):
    e, j = pl.program_id(0), pl.program_id(1)
    start, count = offs_ref[e], offs_ref[e + 1] - offs_ref[e]

    @pl.when(count > 0)
    def _():
        valid, tok = _expert_tokens(tok_ref, start, count, tb)
        row0 = (layer_ref[0] * n_exp + e) * n_inner + j * rows  # this block's first row of w [n*E*I, D]
        cdt = x_ref.dtype

        def body(c, acc):
            a1, a3 = acc
            cid = c * cols + lax.broadcasted_iota(jnp.int32, (1, cols), 1)
            xb = pltriton.load(x_ref.at[tok[:, None], cid], mask=valid[:, None], other=0.0)  # [TB, cols]
            a1 += mm_nt(xb, w1_ref[pl.ds(row0, rows), pl.ds(c * cols, cols)].astype(cdt))
            a3 += mm_nt(xb, w3_ref[pl.ds(row0, rows), pl.ds(c * cols, cols)].astype(cdt))
            return a1, a3

        zero = jnp.zeros((tb, rows), F32)
        a1, a3 = lax.fori_loop(0, x_ref.shape[1] // cols, body, (zero, zero))
        h_ref[...] = swiglu(a1, a3, limit).astype(h_ref.dtype)


def _down_kernel(layer_ref, offs_ref, h_ref, w2_ref, y_ref, *, n_exp, n_out, rows, cols, tb):
    e, j = pl.program_id(0), pl.program_id(1)

    @pl.when(offs_ref[e + 1] > offs_ref[e])
    def _():
        row0 = (layer_ref[0] * n_exp + e) * n_out + j * rows  # first row of this block in w2 [n*E*D, I]

        def body(c, acc):
            hb = h_ref[:, pl.ds(c * cols, cols)]  # [TB, cols]
            return acc + mm_nt(hb, w2_ref[pl.ds(row0, rows), pl.ds(c * cols, cols)].astype(hb.dtype))

        y_ref[...] = lax.fori_loop(0, h_ref.shape[1] // cols, body, jnp.zeros((tb, rows), F32))


def routed_experts(x, weights, experts, w1, w2, w3, limit, *, layer=None, interpret=None, num_warps: int = 4,
                   num_stages: int | None = None, up=(UP_ROWS, UP_COLS), down=(DOWN_ROWS, DOWN_COLS)):
    """sum_k weights[m, k] * FFN_{experts[m, k]}(x[m]) in f32 [M, D] over the pairs of an expert (ids in [0, E)),
    the hidden activation rounded to x's dtype, as two Pallas kernels (Triton on GPU; interpret=None: the HLO
    interpreter on CPU).
    With `layer` (an int32 scalar), w1/w2/w3 are layer stacks and layer `layer`'s experts are read in place.
    Shapes must pass `supported`."""
    if interpret is None:
        interpret = _compat.backend() == "cpu"
    m, k = experts.shape
    n_exp, n_inner, d = w1.shape[-3:]
    if not supported(x, w1):
        raise ValueError(f"{m} tokens (at most {MAX_TOKENS}), expert weights {w1.shape} (power-of-two blocks of "
                         f"at least 16): not for these kernels")
    ur, uc = _pow2_block(n_inner, up[0]), _pow2_block(d, up[1])
    dr, dc = _pow2_block(d, down[0]), _pow2_block(n_inner, down[1])
    tb = max(16, next_pow2(m))
    num_stages = num_stages or (STAGES if tb <= 32 else STAGES_PAST_32)
    layer = layer_operand(layer)
    w1f, w3f, w2f = w1.reshape(-1, d), w3.reshape(-1, d), w2.reshape(-1, n_inner)

    pairs = _group_pairs(experts, n_exp)

    full = lambda a: pl.BlockSpec(a.shape, lambda *_: (0,) * a.ndim)
    kw = dict(interpret=True) if interpret else dict(
        compiler_params=TritonCompilerParams(num_warps=num_warps, num_stages=num_stages))
    h = pl.pallas_call(
        functools.partial(_up_kernel, n_exp=n_exp, n_inner=n_inner, rows=ur, cols=uc, tb=tb, limit=limit),
        out_shape=jax.ShapeDtypeStruct((n_exp, tb, n_inner), x.dtype), grid=(n_exp, n_inner // ur),
        in_specs=[full(layer), full(pairs.offs), full(pairs.tokens), full(x), full(w1f), full(w3f)],
        out_specs=pl.BlockSpec((None, tb, ur), lambda e, j: (e, 0, j)), name="v4_experts_up", **kw,
    )(layer, pairs.offs, pairs.tokens, x, w1f, w3f)
    y = pl.pallas_call(
        functools.partial(_down_kernel, n_exp=n_exp, n_out=d, rows=dr, cols=dc, tb=tb),
        out_shape=jax.ShapeDtypeStruct((n_exp, tb, d), F32), grid=(n_exp, d // dr),
        in_specs=[full(layer), full(pairs.offs), pl.BlockSpec((None, tb, n_inner), lambda e, j: (e, 0, 0)),
                  full(w2f)],
        out_specs=pl.BlockSpec((None, tb, dr), lambda e, j: (e, 0, j)), name="v4_experts_down", **kw,
    )(layer, pairs.offs, h, w2f)
    y_pairs = pairs.outputs(y).reshape(m, k, d)
    return jnp.sum(y_pairs * weights[..., None], axis=1)  # f32 multiply-add (a matmul would round to TF32)


# ---- routed experts as the release stores them: FP4 e2m1 codes, two a byte, one ue8m0 scale per 1 x 32 --------
FP4_BLOCK = 32  # values per scale along a weight row (16 bytes)
# Blocks (rows per program, logical columns per loop step), from an H200 sweep (v4jax bench kernels --sweep
# stored_weights, Flash sizes): 32 x 256 took 0.18 ms at 16 experts / 1 token, 0.26 at 256 / 1 and 4.2 at 256 / 32,
# against 0.25, 0.40 and 5.6 for the bf16 kernels' 16 x 512, 0.45-11.2 for 16 x 1024, and 8 warps were slower
# everywhere. Decoding the codes costs more than the bytes saved: the bf16 kernels took 0.12, 0.15 and 2.2 ms
# (a 256-entry byte table in place of the bit arithmetic: 0.42, 0.58, 9.0 ms).
FP4_UP, FP4_DOWN = (32, 256), (32, 256)


class ExpertPairs(NamedTuple):
    """The pairs (token, expert) of a step grouped by expert, in the order a stable sort by expert gives, the pairs
    of no expert (ids outside [0, E)) last. P = M * k pairs in (token, k) order."""
    ids: jax.Array     # [P] int32: each pair's expert, E for none
    slot: jax.Array    # [P] int32: each pair's row in its expert's tile (its earlier pairs of the same expert)
    order: jax.Array   # [P] int32: the pair at each place of the grouped list
    offs: jax.Array    # [E + 2] int32: expert e's pairs are places offs[e] .. offs[e + 1]
    tokens: jax.Array  # [P] int32: the token of the pair at each place

    def weights(self, weights, tb: int):
        """Each (expert, tile row) pair's routing weight [E, TB, 1]; rows past the expert's count weigh 0."""
        n_exp = self.offs.shape[0] - 2
        n_pairs = weights.size
        pair = jnp.minimum(self.offs[:n_exp, None] + jnp.arange(tb)[None, :], n_pairs - 1)
        live = jnp.arange(tb)[None, :] < (self.offs[1:n_exp + 1] - self.offs[:n_exp])[:, None]
        return jnp.where(live, weights.reshape(-1)[self.order][pair], 0.0)[..., None]

    def outputs(self, y):
        """The experts' tiles y [E, TB, D] read back in (token, k) order [P, D]: a pair's row is its slot in its
        expert's tile; pairs of no expert give 0 (their rows were never written)."""
        n_exp = y.shape[0]
        rows = y[jnp.minimum(self.ids, n_exp - 1), self.slot]
        return jnp.where((self.ids < n_exp)[:, None], rows, 0.0)


def _group_pairs(experts, n_exp) -> ExpertPairs:
    """experts [M, k] -> ExpertPairs, by comparing every pair with every other (P x P, P <= MAX_TOKENS * k) rather
    than sorting: a pair's place is the pairs of lower experts plus its expert's earlier pairs, exactly a stable
    sort's. The XLA sort of the ids was a kernel of its own in every layer's decode step, and the scatter putting
    the outputs back in (token, k) order another; here one gather does that (H100, flash-slice at one token, an
    8-step call: sorts 80 -> 48, scatters 72 -> 8)."""
    k = experts.shape[1]
    ids = experts.reshape(-1).astype(jnp.int32)
    ids = jnp.where((ids >= 0) & (ids < n_exp), ids, n_exp)
    p = ids.shape[0]
    at = jnp.arange(p, dtype=jnp.int32)
    same = ids[None, :] == ids[:, None]                                           # [P, P]: pair j, pair i
    slot = jnp.sum(same & (at[None, :] < at[:, None]), axis=1, dtype=jnp.int32)
    offs = jnp.sum(ids[None, :] < jnp.arange(n_exp + 2, dtype=jnp.int32)[:, None], axis=1, dtype=jnp.int32)
    place = offs[ids] + slot                                                      # a permutation of 0 .. P-1
    order = jnp.sum(jnp.where(place[None, :] == at[:, None], at[None, :], 0), axis=1, dtype=jnp.int32)
    return ExpertPairs(ids=ids, slot=slot, order=order, offs=offs, tokens=order // k)


def _fp4_flat(layer, *weights):
    """The layer index as a [1] array, and each (codes [..., O, C / 2], scales [..., O, C / 32]) stack as rows of
    every layer and expert: (codes [R, C / 2], scale bytes [R, C / 32])."""
    layer = layer_operand(layer)
    flat = lambda a: a.reshape(-1, a.shape[-1])
    return layer, *((flat(c), flat(lax.bitcast_convert_type(sc, jnp.uint8))) for c, sc in weights)


def fp4_supported(x, w1_codes) -> bool:
    """At most MAX_TOKENS tokens; the bytes of a row (D / 2 for w1 / w3, I / 2 for w2) and the rows divisible by
    power-of-two blocks of >= 16. w1_codes [..., I, D / 2]."""
    up, down = FP4_UP, FP4_DOWN
    i, half_d = w1_codes.shape[-2:]
    return x.shape[0] <= MAX_TOKENS and all(
        b is not None for b in (_pow2_block(i, up[0]), _pow2_block(half_d, up[1] // 2),
                                _pow2_block(2 * half_d, down[0]), _pow2_block(i // 2, down[1] // 2)))


def _fp4_tile(w_ref, s_ref, row0, col0, rows, cb, cdt):
    """Rows row0 .. row0 + rows, bytes col0 .. col0 + cb of an FP4 stack [R, C / 2] with scales [R, C / 32]: the
    even and odd columns' values [rows, cb] in cdt (exact: e2m1 times a power of two)."""
    b = w_ref[pl.ds(row0, rows), pl.ds(col0, cb)].astype(jnp.int32)
    r = row0 + lax.broadcasted_iota(jnp.int32, (rows, cb), 0)
    c = (col0 + lax.broadcasted_iota(jnp.int32, (rows, cb), 1)) // (FP4_BLOCK // 2)
    sb = pltriton.load(s_ref.at[r, c]).astype(jnp.int32)  # each byte's block scale (gathered: cached reads)
    s = ue8m0_to_f32(sb)
    return (e2m1_to_f32(b & 15) * s).astype(cdt), (e2m1_to_f32(b >> 4) * s).astype(cdt)


def _fp4_up_kernel(layer_ref, offs_ref, tok_ref, xe_ref, xo_ref, w1_ref, s1_ref, w3_ref, s3_ref, h_ref, *, n_exp,
                   n_inner, rows, cb, tb, limit):
    e, j = pl.program_id(0), pl.program_id(1)
    start, count = offs_ref[e], offs_ref[e + 1] - offs_ref[e]

    @pl.when(count > 0)
    def _():
        valid, tok = _expert_tokens(tok_ref, start, count, tb)
        row0 = (layer_ref[0] * n_exp + e) * n_inner + j * rows
        cdt = xe_ref.dtype

        def body(c, acc):
            a1, a3 = acc
            cid = c * cb + lax.broadcasted_iota(jnp.int32, (1, cb), 1)
            xe = pltriton.load(xe_ref.at[tok[:, None], cid], mask=valid[:, None], other=0.0)  # even columns
            xo = pltriton.load(xo_ref.at[tok[:, None], cid], mask=valid[:, None], other=0.0)
            lo, hi = _fp4_tile(w1_ref, s1_ref, row0, c * cb, rows, cb, cdt)
            a1 += mm_nt(xe, lo) + mm_nt(xo, hi)
            lo, hi = _fp4_tile(w3_ref, s3_ref, row0, c * cb, rows, cb, cdt)
            a3 += mm_nt(xe, lo) + mm_nt(xo, hi)
            return a1, a3

        zero = jnp.zeros((tb, rows), F32)
        a1, a3 = lax.fori_loop(0, xe_ref.shape[1] // cb, body, (zero, zero))
        h_ref[...] = swiglu(a1, a3, limit)  # f32: the caller scales and rounds it as w2's input


def _fp4_down_kernel(layer_ref, offs_ref, he_ref, ho_ref, w2_ref, s2_ref, y_ref, *, n_exp, n_out, rows, cb):
    e, j = pl.program_id(0), pl.program_id(1)

    @pl.when(offs_ref[e + 1] > offs_ref[e])
    def _():
        row0 = (layer_ref[0] * n_exp + e) * n_out + j * rows

        def body(c, acc):
            lo, hi = _fp4_tile(w2_ref, s2_ref, row0, c * cb, rows, cb, he_ref.dtype)
            return acc + mm_nt(he_ref[:, pl.ds(c * cb, cb)], lo) + mm_nt(ho_ref[:, pl.ds(c * cb, cb)], hi)

        y_ref[...] = lax.fori_loop(0, he_ref.shape[1] // cb, body, jnp.zeros(y_ref.shape, F32))


# ---- FP4 experts a pair at a time: few pairs (token, expert) over many experts --------------------------------
# A program multiplies one pair's token by `rows` rows of its expert, over one of `splits` parts of the row, in
# steps of `nb` scale blocks (16 bytes, 32 codes each): codes [rows, nb, 16] decoded in registers, multiplied by the
# token's even and odd columns [nb, 16] and summed, each block's sum times its power-of-two scale. No dot: one
# token fills no tensor-core tile, and the dot forms above spend their time on the 16-row tile (a [16, 256] x tile
# of 15 masked rows), on each code's scale gathered from L1 and on moving the decoded tile into the dot's
# operand layout: H100, Flash's sizes, 16 experts, one token: the up kernel read 53.5 MB in 106 us (525 GB/s) with
# 202 registers a thread and 10 % of the warp slots active (Nsight Compute, `NCU=experts_fp4 bash scripts/h200.sh
# ncu`). A weight is read once per pair, so this form takes the calls where pairs are at most twice the experts.
# Each code is widened through f16 bit placement (five integer operations a code): with the codes decoded as e2m1
# values (about ten) the form ran at 730 GB/s, bound by that arithmetic, and the f16 placement took it to 1,170.
# H100, Flash's sizes, ms a call (`python -m v4jax.bench kernels --sweep fp4_experts`), expert form -> pair form
# (with the e2m1 decode in brackets): 16 experts, 1 token 0.174 -> 0.068 (0.109), 4 tokens 0.300 -> 0.225
# (0.392), 32 tokens 0.535 -> 1.52 (2.80); 256 experts, 1 token 0.264 -> 0.069 (0.109), 4 tokens 0.584 -> 0.227
# (0.394), 32 tokens 3.93 -> 1.53 (2.83). Blocks of 16 and 64 rows (8 warps) were within 10 % of 32 rows.
PAIR_UP, PAIR_DOWN = (32, 8), (32, 8)  # (rows a program, scale blocks a loop step)
PAIR_PROGRAMS = 1056  # splits of the rows are added up to at least this many programs (8 per SM of 132)
PAIRS_PER_EXPERT = 2  # "auto" takes the pair form up to this many pairs an expert


def _fp4_pair_rows(w_ref, s_ref, row0, blk0, rows, nb, xe, xo):
    """Rows row0 .. row0 + rows of an FP4 stack viewed as codes [R, C / 32, 16] and scales [R, C / 32], scale
    blocks blk0 .. blk0 + nb, against a token's even and odd columns of those blocks [nb, 16] f32 -> [rows] f32."""
    b = w_ref[pl.ds(row0, rows), pl.ds(blk0, nb), :].astype(jnp.int32)  # [rows, nb, 16]
    # each code's bits placed in an f16 (e2m1's exponent and mantissa under f16's, its sign on f16's): the code's
    # value times 2^-14 exactly (e = 0: f16's subnormals), five integer operations a code and one widening
    f32 = lambda bits: lax.bitcast_convert_type(bits.astype(jnp.uint16), jnp.float16).astype(F32)
    lo = f32(((b & 7) << 9) | ((b & 8) << 12))
    hi = f32(((b & 0x70) << 5) | ((b & 0x80) << 8))
    part = jnp.sum(lo * xe[None] + hi * xo[None], axis=2) * 2.0 ** 14  # exact products, sums in f32
    return jnp.sum(part * ue8m0_to_f32(s_ref[pl.ds(row0, rows), pl.ds(blk0, nb)]), axis=1)


def _fp4_pair_kernel(layer_ref, ex_ref, xe_ref, xo_ref, *refs, n_exp, n_out, k, rows, nb, chunks, tokens):
    """refs: (codes, scales) of each weight (w1 and w3, or w2), then one output [rows] per weight. `tokens`: x's
    row is the pair's token (p // k); else the pair's own row (w2's input)."""
    n_w = len(refs) // 3
    ws, outs = refs[:2 * n_w], refs[2 * n_w:]
    p, j, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    e = ex_ref[p]
    live = (e >= 0) & (e < n_exp)  # else a pair of no expert (another shard's): zeros

    @pl.when(live)
    def _():
        row0 = (layer_ref[0] * n_exp + e) * n_out + j * rows
        t = p // k if tokens else p

        def body(c, acc):
            blk0 = (s * chunks + c) * nb
            xe = xe_ref[t, pl.ds(blk0, nb), :].astype(F32)
            xo = xo_ref[t, pl.ds(blk0, nb), :].astype(F32)
            return tuple(a + _fp4_pair_rows(ws[2 * i], ws[2 * i + 1], row0, blk0, rows, nb, xe, xo)
                         for i, a in enumerate(acc))

        acc = lax.fori_loop(0, chunks, body, tuple(jnp.zeros((rows,), F32) for _ in range(n_w)))
        for o, a in zip(outs, acc):
            o[...] = a

    @pl.when(~live)
    def _():
        for o in outs:
            o[...] = jnp.zeros((rows,), F32)


def _fp4_pairs_call(name, layer, ex, xe, xo, weights, *, n_exp, n_out, k, tokens, block, interpret, num_warps,
                    num_stages):
    """One launch, a pair a program: ex [P] each pair's expert, x's even / odd columns [T, C / 32, 16] (T: tokens,
    or pairs), weights [(codes [R, C / 32, 16], scale bytes [R, C / 32])] of n_out rows an expert -> each weight's
    products [P, n_out] f32."""
    n_pairs, n_blk = ex.shape[0], xe.shape[1]
    rows, nb = math.gcd(n_out, block[0]), math.gcd(n_blk, block[1])
    steps, splits = n_blk // nb, 1
    while n_pairs * (n_out // rows) * splits < PAIR_PROGRAMS and steps % (2 * splits) == 0:
        splits *= 2
    full = lambda a: pl.BlockSpec(a.shape, lambda *_: (0,) * a.ndim)
    kw = dict(interpret=True) if interpret else dict(
        compiler_params=TritonCompilerParams(num_warps=num_warps, num_stages=num_stages))
    flat = [a for w in weights for a in w]
    outs = pl.pallas_call(
        functools.partial(_fp4_pair_kernel, n_exp=n_exp, n_out=n_out, k=k, rows=rows, nb=nb, chunks=steps // splits,
                          tokens=tokens),
        out_shape=[jax.ShapeDtypeStruct((splits, n_pairs, n_out), F32)] * len(weights),
        grid=(n_pairs, n_out // rows, splits),
        in_specs=[full(a) for a in (layer, ex, xe, xo, *flat)],
        out_specs=[pl.BlockSpec((None, None, rows), lambda p, j, s: (s, p, j))] * len(weights), name=name, **kw,
    )(layer, ex, xe, xo, *flat)
    return [jnp.sum(o, axis=0) for o in outs]


def _routed_experts_fp4_pairs(x, weights, experts, w1, w2, w3, limit, w2_input, *, layer, interpret, num_warps,
                              num_stages, up, down):
    """routed_experts_fp4 a pair a program (see PAIR_UP): the pairs in (token, k) order, no sort."""
    m, k = experts.shape
    c1 = w1[0]
    n_exp, n_inner, half_d = c1.shape[-3:]
    d = 2 * half_d
    layer, *ws = _fp4_flat(layer, w1, w2, w3)
    blocks = lambda c, sc: (c.reshape(c.shape[0], -1, FP4_BLOCK // 2), sc)  # codes [R, C / 32, 16]
    (c1f, s1f), (c2f, s2f), (c3f, s3f) = (blocks(*w) for w in ws)
    ex = experts.reshape(-1).astype(jnp.int32)
    split = lambda a: (a[:, 0::2].reshape(a.shape[0], -1, FP4_BLOCK // 2),  # even / odd columns [T, C / 32, 16]
                       a[:, 1::2].reshape(a.shape[0], -1, FP4_BLOCK // 2))
    common = dict(n_exp=n_exp, k=k, interpret=interpret, num_warps=num_warps, num_stages=num_stages)
    a1, a3 = _fp4_pairs_call("v4_experts_up_fp4_pairs", layer, ex, *split(x), [(c1f, s1f), (c3f, s3f)],
                             n_out=n_inner, tokens=True, block=up, **common)
    # a pair of no expert has a1 = a3 = 0 (its programs write zeros), so h = 0 and it adds nothing
    h2 = w2_input(swiglu(a1, a3, limit), weights.reshape(-1, 1)).astype(x.dtype)  # [P, I]
    (y,) = _fp4_pairs_call("v4_experts_down_fp4_pairs", layer, ex, *split(h2), [(c2f, s2f)], n_out=d,
                           tokens=False, block=down, **common)
    return jnp.sum(y.reshape(m, k, d), axis=1)


def routed_experts_fp4(x, weights, experts, w1, w2, w3, limit, w2_input, *, layer=None, interpret=None,
                       num_warps: int = 4, num_stages: int = 2, up=None, down=None, form: str = "auto"):
    """`routed_experts` for weights as the release stores them: each of w1, w2, w3 a pair (codes uint8 [..., O,
    C / 2], scales ue8m0 [..., O, C / 32]), read in place and decoded in registers, so a step reads ~0.53 byte a
    weight. The release's numerics: x comes rounded to FP8; w2's input is `w2_input(h, w)` (h the f32 SwiGLU
    [E, TB, I], w each pair's routing weight [E, TB, 1]: the caller scales and rounds it, as the official expert
    does before w2) and the outputs of a token's experts are summed unweighted.
    The codes of a row's even columns are the bytes' low halves, the odd ones the high halves: x and w2's input
    are split the same way (in XLA: [M, D] is small) and each chunk is two bf16 products of the codes widened with
    their scales.
    Measured and removed (H200, Flash sizes): e4m3 built from the codes
    by bit placement (an e2m1 code's bits in e4m3's fields are its value times 2^-6) and FP8 dots per 32-column
    scale block, with the activations rounded to e4m3 in the kernel. It was slower at one token (16 experts: 0.19
    against 0.18 ms; 256: 0.25 against 0.26), faster at 32 (0.42 against 0.54; 3.2 against 4.2), and its outputs
    left the reference's by up to 2.3e-2 of the largest (81 % of them beyond 2^-7) where this form agrees to
    rounding: no place in the model for it. Also measured and removed (H100, Flash sizes, ms a call, this form
    first): each code widened to f16 by bit placement (five integer operations a code, or under three in inline
    PTX on four bytes a register) with each 32-column block's scale applied to its dot; 16 experts at one token
    0.176 against 0.268 (0.231 in PTX), 256 at one 0.268 against 0.260 (PTX), 16 at 32 tokens 0.542 against
    0.435 (PTX, 64 rows a program; 0.682 at 32). Fewer integer operations did not make one token faster: at
    decode sizes these kernels wait on something other than the decode's arithmetic (455 GB/s at one token); the
    pair form, which does not, takes the f16 placement.
    form: "experts" (a program an expert and a block of rows, the tokens in a dot tile), "pairs" (a program a
    (token, expert) pair and a block of rows, no dot: see PAIR_UP), or "auto": pairs where the pairs (M * k) are at
    most twice the experts, by the measured crossing (one token: 2.6x faster at 16 experts, 3.8x at 256; 16 experts
    at 4 tokens 1.3x faster, at 32 2.8x slower)."""
    if interpret is None:
        interpret = _compat.backend() == "cpu"
    c1 = w1[0]
    m, k = experts.shape
    n_exp, n_inner, half_d = c1.shape[-3:]
    d = 2 * half_d
    if not fp4_supported(x, c1):
        raise ValueError(f"{m} tokens (at most {MAX_TOKENS}), FP4 expert codes {c1.shape}: not for these kernels")
    if form not in ("auto", "pairs", "experts"):
        raise ValueError(f"form must be 'auto', 'pairs' or 'experts', got {form!r}")
    if form == "pairs" or (form == "auto" and m * k <= PAIRS_PER_EXPERT * n_exp):
        return _routed_experts_fp4_pairs(x, weights, experts, w1, w2, w3, limit, w2_input, layer=layer,
                                         interpret=interpret, num_warps=num_warps, num_stages=num_stages,
                                         up=up or PAIR_UP, down=down or PAIR_DOWN)
    up, down = up or FP4_UP, down or FP4_DOWN
    ur, ucb = _pow2_block(n_inner, up[0]), _pow2_block(half_d, up[1] // 2)
    dr, dcb = _pow2_block(d, down[0]), _pow2_block(n_inner // 2, down[1] // 2)
    tb = max(16, next_pow2(m))
    layer, (c1f, s1f), (c2f, s2f), (c3f, s3f) = _fp4_flat(layer, w1, w2, w3)

    pairs = _group_pairs(experts, n_exp)
    offs = pairs.offs

    full = lambda a: pl.BlockSpec(a.shape, lambda *_: (0,) * a.ndim)
    kw = dict(interpret=True) if interpret else dict(
        compiler_params=TritonCompilerParams(num_warps=num_warps, num_stages=num_stages))
    xe, xo = x[:, 0::2], x[:, 1::2]
    h = pl.pallas_call(
        functools.partial(_fp4_up_kernel, n_exp=n_exp, n_inner=n_inner, rows=ur, cb=ucb, tb=tb, limit=limit),
        out_shape=jax.ShapeDtypeStruct((n_exp, tb, n_inner), F32), grid=(n_exp, n_inner // ur),
        in_specs=[full(a) for a in (layer, offs, pairs.tokens, xe, xo, c1f, s1f, c3f, s3f)],
        out_specs=pl.BlockSpec((None, tb, ur), lambda e, j: (e, 0, j)), name="v4_experts_up_fp4", **kw,
    )(layer, offs, pairs.tokens, xe, xo, c1f, s1f, c3f, s3f)
    h2 = w2_input(h, pairs.weights(weights, tb)).astype(x.dtype)  # [E, TB, I]
    he, ho = h2[..., 0::2], h2[..., 1::2]
    y = pl.pallas_call(
        functools.partial(_fp4_down_kernel, n_exp=n_exp, n_out=d, rows=dr, cb=dcb),
        out_shape=jax.ShapeDtypeStruct((n_exp, tb, d), F32), grid=(n_exp, d // dr),
        in_specs=[full(layer), full(offs), pl.BlockSpec((None, tb, n_inner // 2), lambda e, j: (e, 0, 0)),
                  pl.BlockSpec((None, tb, n_inner // 2), lambda e, j: (e, 0, 0)), full(c2f), full(s2f)],
        out_specs=pl.BlockSpec((None, tb, dr), lambda e, j: (e, 0, j)), name="v4_experts_down_fp4", **kw,
    )(layer, offs, he, ho, c2f, s2f)
    return jnp.sum(pairs.outputs(y).reshape(m, k, d), axis=1)  # unweighted: the weights are inside w2's input
