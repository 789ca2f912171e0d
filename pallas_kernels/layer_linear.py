"""y = x @ w[layer].T for a decode step's few tokens, reading layer `layer` of a weight stack in place.

Inside the layer `lax.scan` a layer's weight is a dynamic slice of its stack; on the H200 XLA copies the slice
for every consumer that cannot fuse it (cuBLAS GEMMs and GEMVs, custom calls): 30 copies per flash-slice decode
step at batch 1 (0.36 ms of 2.39), 74 at batch 32 (0.78 of 3.47), and the batch-1 projections that it does fuse
ran as Triton GEMV fusions below bandwidth. This kernel reads the stack at the layer's offset (the pattern of
pallas_kernels.experts).

  grid (O/rows, splits): program (j, s) multiplies the tokens [TB, D] by rows j*rows .. of w[layer] over the s-th
  of `splits` equal parts of D, in chunks of `cols`; the f32 partial sums [splits, TB, O] add up in XLA. Small O
  (a 512-wide projection is 8 row blocks) gets more splits of D so that every SM has programs. One token is a
  multiply-and-sum against the rows (no padded copy of x, no slice of y: at batch 1 those were 44 pad and 22 slice
  launches per flash-slice step, 0.09 ms of 1.8); more tokens are padded to TB >= 16 rows (Triton's smallest dot
  tile) for the tensor cores.
  With G groups (the grouped low-rank output projection), rows g*O/G .. of w multiply x[..., g, :].
  `layer_linears` runs several weights of one input in one launch: the row blocks of each follow the last one's,
  a program picks its weight by its block index.

  x [..., D] (groups: [..., G, D]); w [O, D] or a layer stack [n, O, D] with `layer` -> y [..., O] f32
  (groups: [..., G, O/G]).

  Weights kept as the release stores them (`scale`: w is e4m3, one ue8m0 scale per 128 x 128 block, the layer's
  scales [O/128, D/128]): the kernel reads the e4m3 bytes, widens them to x's dtype in registers (exact: e4m3 has 3
  mantissa bits) and multiplies each 128-column chunk's partial sums by its block's power-of-two scale, so it reads
  half the bytes of the bf16 weight and its products are those of the dequantized weight (x arrives rounded to
  FP8 by the caller, the release's `act_quant`; only the order of the f32 sums differs). With `act_quant` the kernel
  rounds x itself, each 128-column chunk as it loads it (`_common.fp8_round_block`, bit for bit the jnp rounding):
  in XLA the rounding is a reduce and an elementwise launch per projection, 5-6 of flash-1gpu's 106 launches a
  layer in the release formats (0.7 ms of a 16.6 ms step on the H100).
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from ._common import fp8_round_block, layer_operand, mm_nt, next_pow2, pow2_block as _pow2_block, ue8m0_to_f32
from ._compat import TritonCompilerParams, backend

F32 = jnp.float32

MAX_TOKENS = 64  # rows of x the kernel takes (one [TB, .] tile); more: XLA's matmul
# H200 sweep (v4jax bench kernels --sweep layer_linear) over the Flash projections at 1 and 32 tokens: 64 x 256
# blocks read 2.9 TB/s on the 64 MB weights (16 x 512, the experts' blocks: 2.3-2.5) and are within 5 % of the best
# on the rest
ROWS, COLS = 64, 256
# one token (the per-column sums of _kernel): 32 x 256 blocks, the best of 17 forms and blocks at one token on an
# H100 (`--sweep streaming`); 64 rows keep twice the f32 sums in registers
ONE_TOKEN_ROWS = 32
MIN_PROGRAMS = 264  # two per SM of the H200's 132


SCALE_BLOCK = 128  # the release's FP8 weight blocks: one ue8m0 scale per 128 x 128


def supported(x, w, groups: int = 1, scaled: bool = False, act_quant: bool = False) -> bool:
    """At most MAX_TOKENS tokens; O / groups and D divisible by power-of-two blocks of >= 16 (`scaled`, FP8 weights
    with block scales: O / groups and D whole scale blocks; `act_quant`: D whole 128-column blocks)."""
    n_out, d = w.shape[-2:]
    m = x.size // (x.shape[-1] * groups)
    if (scaled and (n_out // groups) % SCALE_BLOCK) or ((scaled or act_quant) and d % SCALE_BLOCK):
        return False
    return (m <= MAX_TOKENS and n_out % groups == 0 and _pow2_block(n_out // groups, ROWS) is not None
            and _pow2_block(d, COLS) is not None)


def _kernel(layer_ref, x_ref, *refs, starts, n_outs, group_rows, rows, cols, chunks, scale_rows, act_quant):
    n_w = len(n_outs)
    if scale_rows is None:
        s_refs, w_refs, y_ref = (None,) * n_w, refs[:n_w], refs[n_w]
    else:  # FP8 weights: each one's scale bytes [(n *) O/128, D/128] (scale_rows: a layer's rows of a stack's, or 0)
        s_refs, w_refs, y_ref = refs[:n_w], refs[n_w:2 * n_w], refs[2 * n_w]
    j, s = pl.program_id(0), pl.program_id(1)
    cdt = x_ref.dtype
    gemv = x_ref.shape[1] == 1
    layer = layer_ref[0]
    # one token, weights without scales: the products summed per column across the chunks and over the row once at
    # the end (H100, Flash's projections, `--sweep streaming`: 26.8-27.6 us a 67 MB layer against 28.0-28.7 with a
    # sum over each chunk's row, 4 % less; XLA's GEMV on plain weights 26.2-26.8). FP8 weights sum each chunk's
    # row to scale it by its block's scale.
    tile_sum = gemv and scale_rows is None

    def project(k, row0, grp):  # weight k's rows row0 .. (of the layer's [O_k, D]) against x[grp]
        w_ref, s_ref = w_refs[k], s_refs[k]

        def body(c, acc):
            col = (s * chunks + c) * cols
            w = w_ref[pl.ds(layer * n_outs[k] + row0, rows), pl.ds(col, cols)]
            xc = x_ref[grp, 0, pl.ds(col, cols)] if gemv else x_ref[grp, :, pl.ds(col, cols)]
            if act_quant:  # cols == 128: one block of each row (exact in cdt: 3 mantissa bits)
                xc = fp8_round_block(xc.astype(F32)).astype(cdt)
            if tile_sum:
                return acc + xc.astype(F32)[None, :] * w.astype(F32)
            if gemv:  # y_ref is [rows]
                part = jnp.sum(xc.astype(F32)[None, :] * w.astype(F32), axis=1)
            else:
                part = mm_nt(xc, w.astype(cdt))
            if s_ref is not None:  # rows row0 .. lie in one 128-row block (rows <= 128), cols in one 128-column block
                part = part * ue8m0_to_f32(s_ref[layer * scale_rows[k] + row0 // SCALE_BLOCK, col // SCALE_BLOCK])
            return acc + part

        if tile_sum:
            y_ref[...] = jnp.sum(lax.fori_loop(0, chunks, body, jnp.zeros((rows, cols), F32)), axis=1)
        else:
            y_ref[...] = lax.fori_loop(0, chunks, body, jnp.zeros(y_ref.shape, F32))

    if n_w == 1:
        project(0, j * rows, j * rows // group_rows)
        return
    for k, (start, n_out) in enumerate(zip(starts, n_outs)):  # blocks start .. start + n_out / rows: weight k's
        @pl.when((j >= start) & (j < start + n_out // rows))
        def _(k=k, start=start):
            project(k, (j - start) * rows, 0)


def _call(x, ws, layer, groups, interpret, num_warps, num_stages, rows, cols, min_programs, scales=None,
          act_quant=False, summed=True):
    """The f32 outputs [M, sum O] of x against every weight of `ws`, in one launch (`scales`: ws are FP8 weights,
    scales their ue8m0 block scales, each a layer's or its stack's; `act_quant`: x rounded to FP8 in 1 x 128 blocks
    first); summed=False: their partial sums [S, M, sum O] over the S splits of D."""
    if interpret is None:
        interpret = backend() == "cpu"
    scaled = scales is not None
    if (not all(supported(x, w, groups, scaled, act_quant) for w in ws) or len({w.shape[-1] for w in ws}) != 1
            or (scaled and len(scales) != len(ws))):
        raise ValueError(f"x {x.shape}, w {[w.shape for w in ws]}, {groups} groups: at most {MAX_TOKENS} tokens, one "
                         f"input width and power-of-two blocks of at least 16 (FP8: whole 128-blocks, a scale each)")
    d = x.shape[-1]
    n_outs = tuple(w.shape[-2] for w in ws)
    m = x.size // (d * groups)
    if m == 1 and not scaled:
        rows = min(rows, ONE_TOKEN_ROWS)
    rows = _pow2_block(math.gcd(*n_outs) // groups, rows)
    cols = _pow2_block(d, cols)
    if scaled:  # a chunk inside one scale block
        rows = min(rows, SCALE_BLOCK)
    if scaled or act_quant:  # a chunk is one 128-column block (of the scales, of x's rounding)
        cols = SCALE_BLOCK
    tb = 1 if m == 1 else max(16, next_pow2(m))
    x2 = jnp.pad(jnp.moveaxis(x.reshape(m, groups, d), 1, 0), ((0, 0), (0, tb - m), (0, 0)))  # [G, TB, D]
    layer = layer_operand(layer)
    wfs = [w.reshape(-1, d) for w in ws]
    total = sum(n_outs)
    starts = tuple(sum(n_outs[:k]) // rows for k in range(len(ws)))
    n_chunks = d // cols
    splits = 1
    while (total // rows) * splits < min_programs and n_chunks % (2 * splits) == 0:
        splits *= 2
    full = lambda a: pl.BlockSpec(a.shape, lambda *_: (0,) * a.ndim)
    kw = dict(interpret=True) if interpret else dict(
        compiler_params=TritonCompilerParams(num_warps=num_warps, num_stages=num_stages))
    # the scales of a stack are read at the layer's rows in place (sliced, each FP8 projection's were a launch of
    # their own: 7.5 of a flash-slice layer's 116 in the release formats, H100 profile)
    extra = [] if not scaled else [lax.bitcast_convert_type(a, jnp.uint8).reshape(-1, a.shape[-1]) for a in scales]
    scale_rows = tuple(a.shape[-2] if a.ndim == 3 else 0 for a in scales) if scaled else None
    parts = pl.pallas_call(
        functools.partial(_kernel, starts=starts, n_outs=n_outs, group_rows=n_outs[0] // groups, rows=rows,
                          cols=cols, chunks=n_chunks // splits, scale_rows=scale_rows, act_quant=act_quant),
        out_shape=jax.ShapeDtypeStruct((splits, tb, total), F32), grid=(total // rows, splits),
        in_specs=[full(layer), full(x2)] + [full(a) for a in extra + wfs],
        out_specs=pl.BlockSpec((None, None if tb == 1 else tb, rows), lambda j, s: (s, 0, j)),
        name="v4_layer_linear_fp8" if scaled else "v4_layer_linear", **kw,
    )(layer, x2, *extra, *wfs)
    parts = parts if tb == m else parts[:, :m]
    if not summed:
        return parts
    return parts[0] if splits == 1 else jnp.sum(parts, axis=0)


def layer_linear(x, w, layer=None, groups: int = 1, *, scale=None, act_quant: bool = False, interpret=None,
                 num_warps: int = 4, num_stages: int = 2, rows: int = ROWS, cols: int = COLS,
                 min_programs: int = MIN_PROGRAMS, summed: bool = True):
    """x @ w[layer].T (w.T without `layer`) in f32, as a Pallas kernel (Triton on GPU; interpret=None: the HLO
    interpreter on CPU); with `groups`, group by group; with `scale` (ue8m0 [O/128, D/128], layer `layer`'s, or the
    stack's [n, O/128, D/128], read at `layer`), w is e4m3 in 128 x 128 blocks; with `act_quant`, x rounded to FP8
    as the release does first (see the module doc); summed=False: the partial sums [S, ...] whose sum that is
    (S >= 1, the kernel's splits of D), for a consumer that adds them itself.
    Shapes must pass `supported`."""
    y = _call(x, [w], layer, groups, interpret, num_warps, num_stages, rows, cols, min_programs,
              None if scale is None else [scale], act_quant, summed)
    lead = () if summed else y.shape[:1]
    n_out = w.shape[-2]
    if groups > 1:
        return y.reshape(*lead, *x.shape[:-2], groups, n_out // groups)
    return y.reshape(*lead, *x.shape[:-1], n_out)


def layer_linears(x, ws, layer=None, *, scales=None, act_quant: bool = False, interpret=None, num_warps: int = 4,
                  num_stages: int = 2, rows: int = ROWS, cols: int = COLS, min_programs: int = MIN_PROGRAMS):
    """[x @ w[layer].T for w in ws] in f32, in one launch (projections of one input; every w [O_k, D] or a stack
    [n, O_k, D] of the same n and D, each passing `supported`; `scales`: FP8 weights, one ue8m0 scale array each as
    `layer_linear` takes it; `act_quant`: x rounded to FP8 first)."""
    y = _call(x, list(ws), layer, 1, interpret, num_warps, num_stages, rows, cols, min_programs,
              None if scales is None else list(scales), act_quant)
    cuts = [sum(w.shape[-2] for w in ws[:k]) for k in range(len(ws) + 1)]
    return [y[:, a:b].reshape(*x.shape[:-1], b - a) for a, b in zip(cuts, cuts[1:])]
