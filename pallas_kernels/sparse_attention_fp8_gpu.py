"""Decode sparse attention over FP8 cache entries (kv_format.Fp8Entry) on a GPU (Pallas Triton): the entries are
gathered as 32-bit words, decoded in registers and scaled, and each block of rows takes ONE q.k product and ONE p.v
product; the contract of `sparse_attention.sparse_attention_ref(..., entry_format=fmt)`.

Why words: the Triton form that read the entries as bytes (removed in 9712134) decoded each 64-dim scale block into
its own piece of the row and ran a product per piece (eight for the Flash entry), which made it 1.7-2.6x slower than
XLA's gather and decode on the H200. Here a row's first dim / 4 words are one contiguous load, so are the words of
the RoPE dims past them, and the decode (shifts, the hardware's e4m3 conversion, a power-of-two scale) fills a
whole [rows, dim] k in a fixed permutation of the dims, the column order:

  column b * P + i (P = dim / 4, b = 0..3, i = 0..P-1) holds
    i <  nope / 4:  NoPE dim 4i + b          (byte b of code word i, times the ue8m0 scale of its 64 dims)
    i >= nope / 4:  a RoPE dim in bf16       (half b % 2 of word i + (b // 2) * (P - nope / 4))

(the TPU-style kernels' `Fp8Entry.planar` order puts each byte plane's nope / 4 dims together, widths Triton's
power-of-two tensors cannot hold for the Flash entry: 112). q is read in this order and o written back from it by
the kernel's own index loads and stores, so nothing outside the kernel permutes them. Per block of rows:
  lo = words 0 .. P-1              [C, P]   (the codes, then the first RoPE words)
  hi = words P .. P + rope/4 - 1   [C, P]   (the other RoPE words, loaded into columns nope/4 .. P-1 only)
  k  = decode(lo or hi, column)    [C, 4P]  ("planes": a [C, 4, P] tensor reshaped; "columns": lo and hi loaded at
                                             [C, 4P] column indices, each word four times, no reshape)
then s = q k^T, online softmax with the sink, acc += p k, exactly as `sparse_attention._gpu_kernel` on a bf16 pool
(grid (head block, b*t, split); few (b, t) programs split the rows and XLA merges the partial states).

The pools may be passed as the uint8 entries [R, nbytes] (viewed as words by `kv_format.as_words` in the call) or
already as those words, uint32 [R, nbytes / 4]: whether XLA makes the view a copy of the pool on a GPU is measured
by `v4jax bench kernels --sweep kv_formats`.
"""
from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
from jax import lax

from . import _compat, kv_format, sparse_attention
from ._common import F32

# Untimed defaults. Rows per step: half the bf16 pool kernel's 64, as a block's words, scales and k are in registers
# at once beside acc (64 rows on 4 warps: ~350 32-bit values a thread by count, past the 255 registers);
# v4jax bench kernels --sweep kv_formats also times 64 rows on 8 warps.
_BLOCK = 32
_WARPS = 4
_HEADS = 16        # heads per program (>= 16 for tensor-core dots)
EXPANDS = ("planes", "columns")
U32 = jnp.uint32


def _column_dims(fmt, c):
    """The dim that column c (int array) of a decoded row holds (the module doc's order)."""
    P, nw = fmt.dim // 4, fmt.nope // 4
    b, i = c // P, c % P
    rope_word = i + (b // 2) * (P - nw) - nw
    return jnp.where(i < nw, 4 * i + b, fmt.nope + 2 * rope_word + b % 2)


def word_order(fmt) -> np.ndarray:
    """The dims in the kernel's column order: k[:, j] is dim word_order(fmt)[j] of the entry."""
    return np.asarray(_column_dims(fmt, np.arange(fmt.dim)))


def supported(q, swa_pool, cmp_pool, fmt) -> bool:
    """Entry formats and pools the kernel reads: dim a power of two >= 64 (a plane of P = dim / 4 columns is a
    Triton tensor dim), NoPE dims a multiple of 4, pools of fmt's entries as bytes or words."""
    D = q.shape[-1]
    P = D // 4
    pow2 = P >= 16 and (P & (P - 1)) == 0
    shapes = {(jnp.dtype(jnp.uint8), fmt.nbytes), (jnp.dtype(U32), fmt.nbytes // 4)}
    pools_ok = all(p is None or (jnp.dtype(p.dtype), p.shape[-1]) in shapes for p in (swa_pool, cmp_pool))
    return fmt.dim == D and pow2 and fmt.nope % 4 == 0 and pools_ok


def _words(pool):
    return pool if pool.dtype == U32 else kv_format.as_words(pool)


def _scales(load, i, fmt):
    """ue8m0 scales of NoPE word columns i [1, n] (block i // 16) -> f32 [C, n]; rows not loaded: 0."""
    blk = i // (kv_format.FP8_BLOCK // 4)
    first = (fmt.nope + 2 * fmt.rope) // 4          # the word of scale 0 (nope + 2 rope is a multiple of 4)
    sw = None
    for j in range(-(-fmt.n_scales // 4)):          # four scale bytes a word, [C, 1] each, chosen per column
        wj = load(jnp.full((1, 1), first + j, jnp.int32))
        sw = wj if sw is None else jnp.where(blk // 4 == j, wj, sw)
    byte = (sw >> (8 * (blk % 4)).astype(U32)) & 0xFF
    return lax.bitcast_convert_type(byte << 23, F32)


def _decode(w, scale, b, rope, dtype):
    """Words w (broadcast against the column's plane b and whether it is a RoPE column) -> values in dtype: byte b
    as e4m3 times scale, or half b % 2 as bf16. Exact in bf16, as the reference decodes them."""
    x = w >> jnp.where(rope, 16 * (b % 2), 8 * b).astype(U32)
    code = lax.bitcast_convert_type((x & 0xFF).astype(jnp.uint8), jnp.float8_e4m3fn)
    nope_v = code.astype(F32) * scale
    rope_v = lax.bitcast_convert_type(x << 16, F32)
    return jnp.where(rope, rope_v, nope_v).astype(dtype)


def _gather_rows(pool_ref, ids, valid, fmt, dtype, expand):
    """Entries ids (masked by valid: other rows read as 0) of the word pool pool_ref [R, nbytes / 4] -> k [C, dim] in
    dtype, the dims in the column order."""
    C = ids.shape[0]
    P, nw = fmt.dim // 4, fmt.nope // 4
    G = P - nw                                      # RoPE words past word P - 1
    safe = jnp.where(valid, ids, 0)[:, None]
    row_ok = valid[:, None]
    load = lambda cols, mask=row_ok: _compat.pltriton.load(pool_ref.at[safe, cols], mask=mask, other=0)
    if expand == "planes":
        i = lax.broadcasted_iota(jnp.int32, (1, P), 1)
        lo = load(i)                                                    # [C, P]
        hi = load(i + G, row_ok & (i >= nw))
        scale = _scales(load, i, fmt)
        b = lax.broadcasted_iota(jnp.int32, (1, 4, 1), 1)
        rope = lax.broadcasted_iota(jnp.int32, (1, 1, P), 2) >= nw
        w = jnp.where(rope & (b >= 2), hi[:, None, :], lo[:, None, :])   # [C, 4, P]
        return _decode(w, scale[:, None, :], b, rope, dtype).reshape(C, 4 * P)
    c = lax.broadcasted_iota(jnp.int32, (1, 4 * P), 1)
    b, i = c // P, c % P
    rope = i >= nw
    upper = rope & (b >= 2)                        # the columns whose word is in hi; lo and hi masked apart
    w = load(i, row_ok & ~upper) | load(i + G, row_ok & upper)
    return _decode(w, _scales(load, i, fmt), b, rope, dtype)


def _kernel(q_ref, sink_ref, rows_w_ref, rows_c_ref, used_c_ref, swa_ref, cmp_ref, *out_refs, fmt, scale, block,
            n_w_blocks, n_c_blocks, n_split, final, skip_tail, expand):
    hb, D = q_ref.shape
    cdt = q_ref.dtype        # entries decode exactly to bf16 (or f32)
    heads = lax.broadcasted_iota(jnp.int32, (hb, 1), 0)
    dims = _column_dims(fmt, lax.broadcasted_iota(jnp.int32, (1, D), 1))
    q = _compat.pltriton.load(q_ref.at[heads, dims])                   # [hb, D] in the column order
    m, l, acc = sparse_attention.attend_rows_gpu(
        q, lambda pool_ref, ids, valid: _gather_rows(pool_ref, ids, valid, fmt, cdt, expand), sink_ref, rows_w_ref,
        rows_c_ref, used_c_ref, swa_ref, cmp_ref, scale=scale, block=block, n_w_blocks=n_w_blocks,
        n_c_blocks=n_c_blocks, n_split=n_split, final=final, skip_tail=skip_tail)
    # o (or acc) back to the dims' order
    sparse_attention.write_rows_out_gpu(out_refs, m, l, acc, final,
                                        lambda ref, x: _compat.pltriton.store(ref.at[heads, dims], x))


def sparse_attention_gpu_words(q, swa_pool, swa_rows, cmp_pool, cmp_rows, sink, *, scale, entry_format,
                               interpret=False, n_split=None, block=_BLOCK, heads=_HEADS, num_warps=_WARPS,
                               num_stages=2, return_lse=False, skip_tail=False, expand="planes"):
    """Sparse attention with sink over FP8 entries, the contract of `sparse_attention_ref(..., entry_format=...)`.

    q [B, T, H, D] (bf16 or f32: the compute dtype); swa_pool, cmp_pool: entries in entry_format (kv_format.Fp8Entry
    with dim D), uint8 [R, nbytes] or their words uint32 [R, nbytes / 4]; rows [B, T, J] int32 (-1 = none); sink [H].
    skip_tail: each query's valid compressed rows are a prefix (HCA, `sparse_attention(valid_prefix=True)`); the loop
    stops after its last valid block. expand: how a block's words become k (module doc). The rest as
    `sparse_attention._sparse_attention_gpu`. Returns o [B, T, H, D] (q's dtype; f32 with return_lse, and lse
    [B, T, H])."""
    fmt = entry_format
    if not supported(q, swa_pool, cmp_pool, fmt) or expand not in EXPANDS:
        raise ValueError(f"sparse_attention_gpu_words: {fmt} with q {q.shape} {q.dtype}, pools "
                         f"{swa_pool.shape} {swa_pool.dtype}, expand={expand!r} not supported")
    has_cmp = cmp_pool is not None and cmp_rows is not None and cmp_rows.shape[-1] > 0
    return sparse_attention.run_rows_kernel_gpu(
        functools.partial(_kernel, fmt=fmt, expand=expand), "v4_sparse_attention_gpu_words", q, _words(swa_pool),
        swa_rows, _words(cmp_pool) if has_cmp else None, cmp_rows, sink, scale=scale, interpret=interpret,
        n_split=n_split, block=block, heads=heads, num_warps=num_warps, num_stages=num_stages,
        return_lse=return_lse, skip_tail=skip_tail)
