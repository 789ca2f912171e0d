"""Lightning-indexer scores, and scores + exact top-k (reference §3.5; the top-k itself is `topk.py`).

scores[b,t,s] = sum_h w[b,t,h] * relu(q[b,t,h] . key_pool[rows[b,s]])  (f32), -inf where s >= n_valid[b,t] or
rows[b,s] < 0.  topk: positions along S of the k largest, score descending, ties -> lower index first, -inf
positions -> -1 (also the padding when fewer than k are valid, and when k > S).

Implementations:
  * `indexer_scores_ref`: jnp/XLA (the model's XLA path); `indexer_topk(impl="xla")` adds `topk_ref`.
  * `indexer_scores` TPU-style Pallas (portable): grid (B, T-blocks, S-blocks); key rows DMA'd from the pool
    (whole HBM tiles: a tile-aligned run is one copy, other keys come with their tile and are picked out on
    chip); GPU: Pallas Triton, key rows gathered by pointer loads (FP4 keys as bytes, decoded in registers).
  * `indexer_topk(impl="pallas")`: these scores, then `topk.topk` (GPU: threshold selection in Pallas kernels;
    TPU: approx_max_k candidates, verified; both exact, see topk.py).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from . import _compat, kv_format
from ._common import (F32, common_compute_dtype, e2m1_to_f32, gather_groups, mm_nn, mm_nt, next_pow2, pad_last,
                      round_up, tile_rows, tiled_view, tpu_gather_finish, tpu_gather_start)
from .topk import topk, topk_ref

# --------------------------------------------------------------------------------------------------------------
# Scores: reference
# --------------------------------------------------------------------------------------------------------------

_REF_BYTES_LIMIT = 1 << 28


def indexer_scores_ref(q, w, key_pool, rows, n_valid, key_format=None):
    """q [B,T,Hi,Di], w [B,T,Hi] f32, key_pool [R,Di] (or uint8 [R, key_format.nbytes]: keys in that byte format,
    pallas_kernels.kv_format), rows [B,S] int32, n_valid [B,T] int32 -> [B,T,S] f32."""
    B, T, Hi, Di = q.shape
    S = rows.shape[-1]
    valid_row = rows >= 0
    keys = kv_format.decode_rows(key_pool, jnp.where(valid_row, rows, 0), key_format,
                                 key_pool.dtype if key_format is None else q.dtype)    # [B, S, Di]
    hg = Hi
    while hg > 1 and B * T * hg * S * 4 > _REF_BYTES_LIMIT and Hi % (hg // 2) == 0:
        hg //= 2
    w = w.astype(F32)

    def group(h0):
        qg = lax.dynamic_slice_in_dim(q, h0, hg, axis=2)
        wg = lax.dynamic_slice_in_dim(w, h0, hg, axis=2)
        logits = jnp.einsum("bthd,bsd->bths", qg, keys, preferred_element_type=F32,
                            precision=lax.Precision.HIGHEST)
        return jnp.einsum("bth,bths->bts", wg, jnp.maximum(logits, 0.0), precision=lax.Precision.HIGHEST)

    if hg == Hi:
        scores = group(0)
    else:
        scores = lax.fori_loop(0, Hi // hg, lambda i, acc: acc + group(i * hg),
                               jnp.zeros((B, T, S), F32))
    s_idx = jnp.arange(S, dtype=jnp.int32)
    ok = (s_idx[None, None, :] < n_valid[:, :, None]) & valid_row[:, None, :]
    return jnp.where(ok, scores, -jnp.inf)


# --------------------------------------------------------------------------------------------------------------
# Scores: TPU-style Pallas kernel
# --------------------------------------------------------------------------------------------------------------

_TPU_SB = 512     # keys per grid step
_TPU_SUB = 128    # keys per compute sub-chunk (waits are per sub-chunk, so compute overlaps later copies)
_TPU_TQ = 8       # queries per grid step (when T > 8)


def _tpu_scores_kernel(rows_smem, flag_smem, tile_smem, q_ref, w_ref, nv_ref, rows_vmem, pool_hbm, o_ref,
                       buf, stage, sem, *, sb, sub, tq, fmt):
    s_blk = pl.program_id(2)

    def gather(c, wait):
        part = pl.ds(c * sub, sub)
        tpu_gather_start(pool_hbm, rows_smem, flag_smem, tile_smem, c * sub, buf.at[part], stage.at[part], sem.at[c],
                         n=sub, wait=wait)

    n_sub = sb // sub
    for c in range(n_sub):
        gather(c, wait=False)
    cdt = common_compute_dtype(q_ref.dtype, buf.dtype)
    for c in range(n_sub):
        gather(c, wait=True)
        part = pl.ds(c * sub, sub)
        ids = rows_vmem[:, part]                                               # [1, sub]
        tpu_gather_finish(ids, flag_smem, c * sub, buf.at[part], stage.at[part], n=sub)
        keys = buf[part, :]                                                    # [sub, Di] (bytes: as words)
        keys = (keys if fmt is None else fmt.decode_words(keys, cdt)).astype(cdt)  # (planar, as q is)
        s_idx = s_blk * sb + c * sub + lax.broadcasted_iota(jnp.int32, (1, sub), 1)
        row_ok = ids >= 0                                                      # [1, sub]
        for t in range(tq):
            logits = mm_nt(q_ref[t].astype(cdt), keys)                          # [Hi, sub]
            sc = mm_nn(w_ref[pl.ds(t, 1), :].astype(F32), jnp.maximum(logits, 0.0))   # [1, sub]
            ok = row_ok & (s_idx < nv_ref[pl.ds(t, 1), :])
            o_ref[pl.ds(t, 1), part] = jnp.where(ok, sc, -jnp.inf)


def _indexer_scores_tpu(q, w, key_pool, rows, n_valid, *, interpret=False, key_format=None):
    B, T, Hi, Di = q.shape
    if key_format is not None:  # bytes gathered as 32-bit words (as f32 rows are), decoded in planar order
        key_pool = kv_format.as_words(key_pool)
        q = q[..., key_format.planar]
    E = key_pool.shape[-1]  # a pool row: Di values, or key_format.nbytes / 4 words
    S = rows.shape[-1]
    sb = min(_TPU_SB, round_up(S, _TPU_SUB))
    Sp = round_up(S, sb)
    n_s = Sp // sb
    tq = T if T <= _TPU_TQ else _TPU_TQ
    Tp = round_up(T, tq)
    rows_p = pad_last(rows.astype(jnp.int32), Sp, -1)
    G = tile_rows(key_pool.dtype)
    flag, tile = gather_groups(rows_p, G, key_pool.shape[0])
    key_pool = tiled_view(key_pool, G)
    if Tp != T:
        q = jnp.pad(q, ((0, 0), (0, Tp - T), (0, 0), (0, 0)))
        w = jnp.pad(w, ((0, 0), (0, Tp - T), (0, 0)))
        n_valid = jnp.pad(n_valid, ((0, 0), (0, Tp - T)))
    ng = sb // G
    kernel = functools.partial(_tpu_scores_kernel, sb=sb, sub=min(_TPU_SUB, sb), tq=tq, fmt=key_format)
    smem = lambda n: pl.BlockSpec((None, 1, n), lambda b, t, s: (b * n_s + s, 0, 0), memory_space=pltpu.SMEM)
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((B, Tp, Sp), F32),
        grid=(B, Tp // tq, n_s),
        in_specs=[
            smem(sb), smem(ng), smem(ng),
            pl.BlockSpec((None, tq, Hi, Di), lambda b, t, s: (b, t, 0, 0)),
            pl.BlockSpec((None, tq, Hi), lambda b, t, s: (b, t, 0)),
            pl.BlockSpec((None, tq, 1), lambda b, t, s: (b, t, 0)),
            pl.BlockSpec((None, 1, sb), lambda b, t, s: (b, 0, s)),
            pl.BlockSpec(memory_space=_compat.ANY),
        ],
        out_specs=pl.BlockSpec((None, tq, sb), lambda b, t, s: (b, t, s)),
        # one DMA semaphore per sub-chunk: a wait only proves that ITS chunk's bytes arrived
        scratch_shapes=[pltpu.VMEM((sb, E), key_pool.dtype),
                        pltpu.VMEM((sb, G, E), key_pool.dtype),   # tiles of the keys not in whole-tile runs
                        pltpu.SemaphoreType.DMA((sb // min(_TPU_SUB, sb),))],
        compiler_params=_compat.TPUCompilerParams(dimension_semantics=("parallel", "parallel", "parallel")),
        interpret=_compat.interpret_arg(interpret, "hlo"),
        name="v4_indexer_scores",
    )(rows_p.reshape(B * n_s, 1, sb), flag.reshape(B * n_s, 1, ng), tile.reshape(B * n_s, 1, ng),
      q, w.astype(F32), n_valid.astype(jnp.int32).reshape(B, Tp, 1), rows_p.reshape(B, 1, Sp), key_pool)
    return out[:, :T, :S]


# --------------------------------------------------------------------------------------------------------------
# Scores: GPU kernel (Pallas Triton)
# --------------------------------------------------------------------------------------------------------------

_GPU_SB = 128     # keys per program
_GPU_TQ = 32      # queries per program (looped; the prefill bench's 128K chunk: 10.5 ms, 11.9 with 16)


def _gpu_gather_keys(pool_ref, ids, valid, fmt, dtype):
    """Keys ids (masked by valid; other rows read as 0) of pool_ref -> the key pieces in dtype: [keys [n, Di]] of a
    float pool; of FP4 keys (kv_format.Fp4Key, uint8 [R, fmt.nbytes]) decoded in registers, [even dims, odd dims]
    [n, Di / 2] each (the low and the high nibbles of the code bytes as e2m1 values, built from their bits, times the
    ue8m0 scale of their 32 dims: exact in bf16, as the reference decodes them)."""
    safe = jnp.where(valid, ids, 0)[:, None]
    load = lambda c0, n: _compat.pltriton.load(
        pool_ref.at[safe, c0 + lax.broadcasted_iota(jnp.int32, (1, n), 1)], mask=valid[:, None], other=0)
    if fmt is None:
        cols = lax.broadcasted_iota(jnp.int32, (1, pool_ref.shape[-1]), 1)
        return [_compat.pltriton.load(pool_ref.at[safe, cols], mask=valid[:, None], other=0.0).astype(dtype)]
    half = fmt.dim // 2
    codes = load(0, half).astype(jnp.int32)                                    # [n, Di / 2]
    block = lax.broadcasted_iota(jnp.int32, (1, half), 1) // (kv_format.FP4_BLOCK // 2)
    scale = None                                         # each byte's block scale, by selects (no per-byte gather)
    for j in range(fmt.dim // kv_format.FP4_BLOCK):
        sj = lax.bitcast_convert_type(load(half + j, 1).astype(jnp.uint32) << 23, F32)   # [n, 1]; 0 masked
        scale = jnp.broadcast_to(sj, codes.shape) if scale is None else jnp.where(block == j, sj, scale)
    return [(e2m1_to_f32(codes & 15) * scale).astype(dtype),
            (e2m1_to_f32(codes >> 4) * scale).astype(dtype)]


def _gpu_scores_kernel(q_ref, w_ref, nv_ref, rows_ref, pool_ref, o_ref, *, sb, tq, n_inner, fmt):
    s_blk = pl.program_id(2)   # grid (query block, b, key block): query blocks sharing keys run side by side
    Di = q_ref.shape[-1]
    # bytes decode to q's dtype (exact); a float pool computes in bf16 only if both are bf16
    cdt = q_ref.dtype if fmt is not None else common_compute_dtype(q_ref.dtype, pool_ref.dtype)
    pieces = ((0, Di),) if fmt is None else ((0, Di // 2), (Di // 2, Di // 2))   # q's dims in the keys' pieces

    # keys past every query's n_valid are -inf without a load or a matmul: a prefill chunk's causal triangle and
    # the page-bucket padding of the rows (a 128K flash-slice prompt's indexer: 388 -> 293 ms on the H200)
    # (row by row: a block of tq rows need not be a power of two, which Triton's tensors must be)
    nv_max = lax.fori_loop(0, tq, lambda t, m: jnp.maximum(m, nv_ref[t]), jnp.int32(0))

    def masked(i):
        def row(t, carry):
            o_ref[t, pl.ds(i * sb, sb)] = jnp.full((sb,), -jnp.inf, F32)
            return carry
        lax.fori_loop(0, tq, row, 0)

    def block(i, carry):   # n_inner consecutive key blocks per program: the queries stay on chip across them
        s0 = (s_blk * n_inner + i) * sb

        @pl.when(s0 >= nv_max)
        def _():
            masked(i)

        @pl.when(s0 < nv_max)
        def _():
            scores(i)
        return carry

    def scores(i):
        ids = rows_ref[pl.ds(i * sb, sb)]                                      # [sb]
        valid = ids >= 0
        keys = _gpu_gather_keys(pool_ref, ids, valid, fmt, cdt)                  # [[sb, Di]] or the FP4 halves
        s_idx = (s_blk * n_inner + i) * sb + lax.broadcasted_iota(jnp.int32, (sb,), 0)

        def body(t, carry):
            qs = [q_ref[t].astype(cdt)] if fmt is None else \
                [q_ref[t, :, pl.ds(c0, w)].astype(cdt) for c0, w in pieces]     # [Hi, Di] or its halves
            wt = w_ref[t].astype(F32)                                            # [Hi]
            # keys as the matmul's rows: the sum over heads runs along a row, within a warp; with heads as the rows
            # it crossed warps (H200, a 128K prompt's last chunk: 17.1 -> 10.5 ms, 249 -> 407 TFLOP/s;
            # v4jax bench kernels --sweep indexer_prefill)
            logits = functools.reduce(jnp.add, [mm_nt(k, q) for k, q in zip(keys, qs)])   # [sb, Hi]
            sc = jnp.sum(jnp.maximum(logits, 0.0) * wt[None, :], axis=1)        # [sb]
            ok = valid & (s_idx < nv_ref[t])
            o_ref[t, pl.ds(i * sb, sb)] = jnp.where(ok, sc, -jnp.inf)
            return carry

        lax.fori_loop(0, tq, body, 0)

    lax.fori_loop(0, n_inner, block, 0)


def _gpu_scores_supported(q, key_pool, fmt=None):
    pow2 = lambda x: x >= 16 and (x & (x - 1)) == 0
    if fmt is not None:   # FP4 keys: the halves of a key powers of two (Triton's tensors)
        return fmt.dim == q.shape[-1] and pow2(fmt.dim // 2) and key_pool.dtype == jnp.uint8 \
            and key_pool.shape[-1] == fmt.nbytes
    return pow2(q.shape[-1]) and key_pool.dtype in (jnp.bfloat16, F32)


def _indexer_scores_gpu(q, w, key_pool, rows, n_valid, *, interpret=False, sb=_GPU_SB, num_warps=4,
                        num_stages=2, n_inner=1, tq=_GPU_TQ, key_format=None):
    B, T, Hi, Di = q.shape
    if key_format is not None:   # q's even dims, then its odd ones: the keys' low and high nibbles
        q = jnp.concatenate([q[..., 0::2], q[..., 1::2]], axis=-1)
    S = rows.shape[-1]
    Hp = max(16, next_pow2(Hi))
    if Hp != Hi:   # zero-weight padded heads contribute exactly 0
        q = jnp.pad(q, ((0, 0), (0, 0), (0, Hp - Hi), (0, 0)))
        w = jnp.pad(w, ((0, 0), (0, 0), (0, Hp - Hi)))
    tq = min(T, tq)
    Tp = round_up(T, tq)
    if Tp != T:
        q = jnp.pad(q, ((0, 0), (0, Tp - T), (0, 0), (0, 0)))
        w = jnp.pad(w, ((0, 0), (0, Tp - T), (0, 0)))
        n_valid = jnp.pad(n_valid, ((0, 0), (0, Tp - T)))
    n_inner = max(1, min(n_inner, -(-S // sb)))
    sbp = sb * n_inner                                                       # keys per program
    Sp = round_up(S, sbp)
    rows_p = pad_last(rows.astype(jnp.int32), Sp, -1)
    kernel = functools.partial(_gpu_scores_kernel, sb=sb, tq=tq, n_inner=n_inner, fmt=key_format)
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((B, Tp, Sp), F32),
        grid=(Tp // tq, B, Sp // sbp),
        in_specs=[
            pl.BlockSpec((None, tq, Hp, Di), lambda t, b, s: (b, t, 0, 0)),
            pl.BlockSpec((None, tq, Hp), lambda t, b, s: (b, t, 0)),
            pl.BlockSpec((None, tq), lambda t, b, s: (b, t)),
            pl.BlockSpec((None, sbp), lambda t, b, s: (b, s)),
            pl.BlockSpec(key_pool.shape, lambda *_: (0, 0)),
        ],
        out_specs=pl.BlockSpec((None, tq, sbp), lambda t, b, s: (b, t, s)),
        compiler_params=_compat.TritonCompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=bool(interpret),
        name="v4_indexer_scores_gpu",
    )(q, w.astype(F32), n_valid.astype(jnp.int32), rows_p, key_pool)
    return out[:, :T, :S]


def indexer_scores(q, w, key_pool, rows, n_valid, *, interpret=False, key_format=None):
    """Pallas indexer scores; same contract as `indexer_scores_ref`. GPU: Triton kernel; TPU: Mosaic kernel;
    interpret=True or CPU: the TPU-style kernel in the HLO interpreter (tests also use strict TPU interpret).
    key_format: keys stored as bytes (kv_format.Fp4Key: 68 a Flash key against 256 in bf16), gathered as bytes and
    decoded on chip by both kernels."""
    be = _compat.backend()
    if be == "gpu" and not interpret:
        if _gpu_scores_supported(q, key_pool, key_format):
            return _indexer_scores_gpu(q, w, key_pool, rows, n_valid, key_format=key_format)
        return indexer_scores_ref(q, w, key_pool, rows, n_valid, key_format)
    return _indexer_scores_tpu(q, w, key_pool, rows, n_valid, interpret=interpret or be != "tpu",
                               key_format=key_format)


def indexer_topk(q, w, key_pool, rows, n_valid, k, *, impl="xla", interpret=False):
    """Indexer scores + exact top-k positions along S ([B, T, k] int32, -1 padded)."""
    if impl == "xla":
        return topk_ref(indexer_scores_ref(q, w, key_pool, rows, n_valid), k)
    if impl == "pallas":
        return topk(indexer_scores(q, w, key_pool, rows, n_valid, interpret=interpret), k, interpret=interpret)
    raise ValueError(f"impl must be 'xla' or 'pallas', got {impl!r}")
