"""Sparse attention with sink over gathered rows (reference §3.6): sliding-window rows + compressed rows.

o[b,t,h] = sum_j exp(s_j - M) k_j / (sum_j exp(s_j - M) + exp(sink_h - M)),  s_j = scale * q[b,t,h] . k_j (f32),
over the valid rows j (id >= 0) of both sets; K = V (MQA: one kv row shared by all heads). The sink is a virtual
key with zero value that only enters the denominator (sink = -inf: none). If nothing is valid, o = 0.
With return_lse=True every implementation also returns lse[b,t,h] = log(sum_j exp(s_j) + exp(sink_h)) (-inf when
nothing is valid and there is no sink) and o in f32: the partial softmax that shards holding disjoint rows merge
(sharding/context.py).

Implementations behind `sparse_attention`:
  * `sparse_attention_ref`: jnp (the model's XLA path).
  * TPU-style Pallas (portable, interpret-testable, lowers for TPU): grid (B, T); per step the row ids are in
    SMEM, rows are DMA'd from the pools in HBM into a double-buffered VMEM chunk of 128 rows, then one
    online-softmax update per chunk. DMAs move whole HBM tiles (8 rows, 16 for bf16; Mosaic rejects others): a
    tile-aligned run is one copy, any other row comes with its tile and is picked out on chip.
  * GPU (Pallas Triton): grid (B*T, H/hb, splits); rows are gathered with pointer loads; when there are few
    (b, t) programs the entry range is split and the partial softmax states are merged in XLA.
  * `dense_prefix_attention` (GPU, Pallas Triton): an HCA layer's prefill chunk, whose queries all read the same
    compressed rows (each up to its n_ready) and overlapping windows: grid (H/hb, B*T/tq); a program takes tq
    consecutive queries x hb heads as one [tq*hb, D] block and reads each key block once for all of them.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from . import _compat, kv_format
from ._common import (F32, MASK_FLOOR, common_compute_dtype, gather_groups, mm_nn, mm_nt, next_pow2, pad_last,
                      pv_matmul, round_up, tile_rows, tiled_view, tpu_gather_finish, tpu_gather_start)

# --------------------------------------------------------------------------------------------------------------
# Reference
# --------------------------------------------------------------------------------------------------------------

_REF_BYTES_LIMIT = 1 << 28  # chunk the reference over T when the gathered rows would exceed this


def _ref_block(q, sets, sink, scale, fmt=None):
    """q [B, t, H, D]; sets: list of (pool, rows [B, t, J]); fmt: the pools' entry format where they store bytes.
    Returns (o [B, t, H, D] f32, lse [B, t, H] f32)."""
    hi = lax.Precision.HIGHEST
    scores, keys = [], []
    for pool, rows in sets:
        valid = rows >= 0
        k = kv_format.decode_rows(pool, jnp.where(valid, rows, 0), fmt, pool.dtype if fmt is None else q.dtype)
        k = jnp.where(valid[..., None], k, jnp.zeros((), k.dtype))
        s = jnp.einsum("bthd,btjd->bthj", q, k, preferred_element_type=F32, precision=hi) * scale
        scores.append(jnp.where(valid[:, :, None, :], s, -jnp.inf))
        keys.append(k)
    s = jnp.concatenate(scores, axis=-1)
    k = jnp.concatenate(keys, axis=2)
    sink = sink.astype(F32)[None, None, :]
    m = jnp.maximum(jnp.max(s, axis=-1), sink)
    m = jnp.maximum(m, MASK_FLOOR)
    p = jnp.exp(s - m[..., None])
    den = jnp.sum(p, axis=-1) + jnp.exp(sink - m)
    num = jnp.einsum("bthj,btjd->bthd", p, k.astype(F32), precision=hi)
    return jnp.where(den[..., None] > 0, num / jnp.where(den > 0, den, 1.0)[..., None], 0.0), m + jnp.log(den)


def _sets(swa_pool, swa_rows, cmp_pool, cmp_rows):
    sets = [(swa_pool, swa_rows)]
    if cmp_pool is not None and cmp_rows is not None and cmp_rows.shape[-1] > 0:
        sets.append((cmp_pool, cmp_rows))
    return sets


def sparse_attention_ref(q, swa_pool, swa_rows, cmp_pool, cmp_rows, sink, *, scale, return_lse=False,
                         entry_format=None):
    """jnp reference. q [B, T, H, D]; pools [R, D], or uint8 [R, entry_format.nbytes] of the entries in that byte
    format (pallas_kernels.kv_format); rows [B, T, J] int32 (-1 = none); sink [H] f32."""
    B, T, H, D = q.shape
    sets = _sets(swa_pool, swa_rows, cmp_pool, cmp_rows)
    J = sum(r.shape[-1] for _, r in sets)
    per_t = B * J * D * 4 * 2
    tc = T
    if per_t * T > _REF_BYTES_LIMIT:
        tc = max(1, _REF_BYTES_LIMIT // per_t)
        while T % tc:
            tc -= 1
    if tc == T:
        o, lse = _ref_block(q, sets, sink, scale, entry_format)
    else:
        o, lse = _ref_chunked(q, sets, sink, scale, tc, entry_format)
    return (o, lse) if return_lse else o.astype(q.dtype)


def _ref_chunked(q, sets, sink, scale, tc, fmt=None):
    B, T, H, D = q.shape
    n = T // tc

    def split(x):  # [B, T, ...] -> [n, B, tc, ...]
        return jnp.moveaxis(x.reshape(B, n, tc, *x.shape[2:]), 1, 0)

    qs = split(q)
    rows = [split(r) for _, r in sets]
    pools = [p for p, _ in sets]
    o, lse = lax.map(lambda a: _ref_block(a[0], list(zip(pools, a[1])), sink, scale, fmt), (qs, rows))
    return jnp.moveaxis(o, 0, 1).reshape(B, T, H, D), jnp.moveaxis(lse, 0, 1).reshape(B, T, H)


# --------------------------------------------------------------------------------------------------------------
# TPU-style Pallas kernel (portable: interpret mode on CPU, Mosaic on TPU)
# --------------------------------------------------------------------------------------------------------------

_TPU_CHUNK = 128   # rows per online-softmax step (lane-dense scores [H, 128])


def _tpu_kernel(rows_smem, flag_smem, tile_smem, q_ref, sink_ref, rows_vmem, swa_hbm, cmp_hbm, o_ref, lse_ref,
                buf, stage, sem, m_ref, l_ref, acc_ref, *, n_swa_chunks, n_chunks, scale, chunk, fmt):
    def copy(i, slot, wait):
        args = (rows_smem, flag_smem, tile_smem, i * chunk, buf.at[slot], stage.at[slot], sem.at[slot])

        @pl.when(i < n_swa_chunks)
        def _():
            tpu_gather_start(swa_hbm, *args, n=chunk, wait=wait)

        if n_chunks > n_swa_chunks:
            @pl.when(i >= n_swa_chunks)
            def _():
                tpu_gather_start(cmp_hbm, *args, n=chunk, wait=wait)

    sink = sink_ref[...].astype(F32)                     # [H, 1]
    m0 = jnp.maximum(sink, MASK_FLOOR)
    m_ref[...] = m0
    l_ref[...] = jnp.exp(sink - m0)
    acc_ref[...] = jnp.zeros_like(acc_ref)
    q = q_ref[...]
    cdt = common_compute_dtype(q.dtype, buf.dtype)  # f32 for entries stored as bytes
    q = q.astype(cdt)

    copy(0, 0, wait=False)

    def body(i, carry):
        slot = i % 2

        @pl.when(i + 1 < n_chunks)
        def _():
            copy(i + 1, 1 - slot, wait=False)

        copy(i, slot, wait=True)
        ids = rows_vmem[:, pl.ds(pl.multiple_of(i * chunk, chunk), chunk)]   # [1, C]
        tpu_gather_finish(ids, flag_smem, i * chunk, buf.at[slot], stage.at[slot], n=chunk)
        k = buf[slot]                                       # [C, D] (bytes: [C, fmt.nbytes / 4] words)
        if fmt is not None:
            k = fmt.decode_words(k, cdt)                    # the dims in fmt.planar order, as q's
        s = mm_nt(q, k.astype(cdt)) * scale                 # [H, C] f32
        valid = ids >= 0                                    # [1, C]
        s = jnp.where(valid, s, -jnp.inf)
        m_prev = m_ref[...]
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        alpha = jnp.exp(m_prev - m_new)
        p = jnp.exp(s - m_new)
        l_ref[...] = alpha * l_ref[...] + jnp.sum(p, axis=1, keepdims=True)
        acc_ref[...] = alpha * acc_ref[...] + pv_matmul(p, k)
        m_ref[...] = m_new
        return carry

    lax.fori_loop(0, n_chunks, body, 0)
    l = l_ref[...]
    o_ref[...] = jnp.where(l > 0, acc_ref[...] / jnp.where(l > 0, l, 1.0), 0.0).astype(o_ref.dtype)
    lse_ref[...] = m_ref[...] + jnp.log(l)


def _sparse_attention_tpu(q, swa_pool, swa_rows, cmp_pool, cmp_rows, sink, *, scale, interpret=False,
                          return_lse=False, entry_format=None):
    B, T, H, D = q.shape
    if entry_format is not None:  # bytes gathered as 32-bit words (as f32 rows are), decoded in planar order
        swa_pool = kv_format.as_words(swa_pool)
        cmp_pool = None if cmp_pool is None else kv_format.as_words(cmp_pool)
        q = q[..., entry_format.planar]
    E = swa_pool.shape[-1]  # a pool row: D values, or entry_format.nbytes / 4 words
    C = _TPU_CHUNK
    G = tile_rows(swa_pool.dtype)
    sets = _sets(swa_pool, swa_rows, cmp_pool, cmp_rows)
    if len(sets) == 2 and cmp_pool.dtype != swa_pool.dtype:
        cmp_pool = cmp_pool.astype(swa_pool.dtype)
    padded, flags, tiles = [], [], []
    for pool, rows in ((swa_pool, swa_rows),) + (((cmp_pool, cmp_rows),) if len(sets) == 2 else ()):
        r = pad_last(rows.astype(jnp.int32), round_up(max(rows.shape[-1], 1), C), -1)
        f, g = gather_groups(r, G, pool.shape[0])
        padded.append(r), flags.append(f), tiles.append(g)
    swa_pool = tiled_view(swa_pool, G)
    cmp_pool = tiled_view(cmp_pool, G) if len(sets) == 2 else None
    n_swa_chunks = padded[0].shape[-1] // C
    rows = jnp.concatenate(padded, axis=-1)
    flag = jnp.concatenate(flags, axis=-1)
    tile = jnp.concatenate(tiles, axis=-1)
    n_rows = rows.shape[-1]
    n_chunks = n_rows // C
    has_cmp = len(sets) == 2
    cmp_arg = cmp_pool if has_cmp else swa_pool

    kernel = functools.partial(_tpu_kernel, n_swa_chunks=n_swa_chunks, n_chunks=n_chunks, scale=float(scale),
                               chunk=C, fmt=entry_format)
    # SMEM blocks are [1, n] slices of [B*T, 1, n] arrays (TPU block rule: last two dims full or (8, 128)-aligned).
    smem = lambda n: pl.BlockSpec((None, 1, n), lambda b, t: (b * T + t, 0, 0), memory_space=pltpu.SMEM)
    in_specs = [
        smem(n_rows), smem(n_rows // G), smem(n_rows // G),
        pl.BlockSpec((None, None, H, D), lambda b, t: (b, t, 0, 0)),
        pl.BlockSpec((H, 1), lambda b, t: (0, 0)),
        pl.BlockSpec((None, None, 1, n_rows), lambda b, t: (b, t, 0, 0)),
        pl.BlockSpec(memory_space=_compat.ANY),
        pl.BlockSpec(memory_space=_compat.ANY),
    ]
    o, lse = pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((B, T, H, D), F32 if return_lse else q.dtype),
                   jax.ShapeDtypeStruct((B, T, H, 1), F32)),
        grid=(B, T),
        in_specs=in_specs,
        out_specs=(pl.BlockSpec((None, None, H, D), lambda b, t: (b, t, 0, 0)),
                   pl.BlockSpec((None, None, H, 1), lambda b, t: (b, t, 0, 0))),
        scratch_shapes=[
            pltpu.VMEM((2, C, E), swa_pool.dtype),
            pltpu.VMEM((2, C, G, E), swa_pool.dtype),     # the tiles of rows that are not in whole-tile runs
            pltpu.SemaphoreType.DMA((2,)),
            pltpu.VMEM((H, 1), F32),
            pltpu.VMEM((H, 1), F32),
            pltpu.VMEM((H, D), F32),
        ],
        compiler_params=_compat.TPUCompilerParams(dimension_semantics=("parallel", "parallel")),
        interpret=_compat.interpret_arg(interpret, "hlo"),
        name="v4_sparse_attention",
    )(rows.reshape(B * T, 1, n_rows), flag.reshape(B * T, 1, -1), tile.reshape(B * T, 1, -1), q,
      sink.astype(F32).reshape(H, 1), rows.reshape(B, T, 1, n_rows), swa_pool, cmp_arg)
    if entry_format is not None:
        o = o[..., np.argsort(entry_format.planar)]
    return (o, lse[..., 0]) if return_lse else o


# --------------------------------------------------------------------------------------------------------------
# GPU kernel (Pallas Triton backend)
# --------------------------------------------------------------------------------------------------------------

_GPU_BLOCK = 64        # rows per step (H200, v4jax bench kernels --tune: 64 beat 16 and 32 by >= 10 %)
_GPU_HEADS = 16        # heads per program (>= 16 for tensor-core dots)
_GPU_SMS = 132         # H100/H200 SM count (used when the device does not say)


def _gpu_gather_rows(pool_ref, ids, valid):
    """Rows ids (masked by valid; other rows read as 0) of pool_ref [R, D] -> [len(ids), D].
    Both axes use array indexers (a mixed array/slice indexer has no interpret-mode rule)."""
    D = pool_ref.shape[-1]
    cols = lax.broadcasted_iota(jnp.int32, (1, D), 1)
    safe = jnp.where(valid, ids, 0)[:, None]
    return _compat.pltriton.load(pool_ref.at[safe, cols], mask=valid[:, None], other=0.0)


def _gpu_kernel(q_ref, sink_ref, rows_w_ref, rows_c_ref, used_c_ref, swa_ref, cmp_ref, *out_refs, scale, block,
                n_w_blocks, n_c_blocks, n_split, final, skip_tail):
    q = q_ref[...]                                       # [hb, D]
    q = q.astype(common_compute_dtype(q.dtype, swa_ref.dtype))
    m, l, acc = attend_rows_gpu(q, _gpu_gather_rows, sink_ref, rows_w_ref, rows_c_ref, used_c_ref, swa_ref, cmp_ref,
                                scale=scale, block=block, n_w_blocks=n_w_blocks, n_c_blocks=n_c_blocks,
                                n_split=n_split, final=final, skip_tail=skip_tail)
    write_rows_out_gpu(out_refs, m, l, acc, final)


def attend_rows_gpu(q, gather, sink_ref, rows_w_ref, rows_c_ref, used_c_ref, swa_ref, cmp_ref, *, scale, block,
                    n_w_blocks, n_c_blocks, n_split, final, skip_tail):
    """The online softmax with the sink of one (head block, query, split) program over its gathered rows: q [hb, D]
    in the compute dtype; `gather(pool_ref, ids, valid)` -> the block's rows k [C, D] (q.k in q's dtype, p.v in
    k's). Returns the state (m, l, acc) after the window's rows, then the compressed ones."""
    sp = pl.program_id(2)   # grid (head block, b*t, split): the head blocks of one query run side by side (L2 reuse)
    hb, D = q.shape
    if final:
        sink = sink_ref[...].astype(F32)                   # [hb]
        m0 = jnp.maximum(sink, MASK_FLOOR)
        l0 = jnp.exp(sink - m0)
    else:
        m0 = jnp.full((hb,), MASK_FLOOR, F32)
        l0 = jnp.zeros((hb,), F32)
    acc0 = jnp.zeros((hb, D), F32)

    def run(rows_ref, pool_ref, n_blocks, carry, used=None):
        lo = sp * n_blocks // n_split
        hi = (sp + 1) * n_blocks // n_split
        if used is not None:   # the blocks after the query's last valid row hold none: not visited
            hi = jnp.minimum(hi, used)

        def body(j, carry):
            m, l, acc = carry
            ids = rows_ref[pl.ds(j * block, block)]           # [C]
            valid = ids >= 0
            k = gather(pool_ref, ids, valid)                  # [C, D]
            s = mm_nt(q, k.astype(q.dtype)) * scale           # [hb, C]
            s = jnp.where(valid[None, :], s, -jnp.inf)
            m_new = jnp.maximum(m, jnp.max(s, axis=1))
            alpha = jnp.exp(m - m_new)
            p = jnp.exp(s - m_new[:, None])
            l = alpha * l + jnp.sum(p, axis=1)
            acc = alpha[:, None] * acc + pv_matmul(p, k)
            return m_new, l, acc

        return lax.fori_loop(lo, hi, body, carry)

    carry = (m0, l0, acc0)
    carry = run(rows_w_ref, swa_ref, n_w_blocks, carry)
    if n_c_blocks:
        carry = run(rows_c_ref, cmp_ref, n_c_blocks, carry, used_c_ref[...] if skip_tail else None)
    return carry


def write_rows_out_gpu(out_refs, m, l, acc, final, store=None):
    """A program's outputs: o normalised (`final`), else its partial state (acc, m, l) for the merge; `store(ref,
    x)` writes the [hb, D] values (default: the block as it is)."""
    if store is None:
        def store(ref, x):
            ref[...] = x
    if final:
        (o_ref,) = out_refs
        store(o_ref, jnp.where(l[:, None] > 0, acc / jnp.where(l > 0, l, 1.0)[:, None], 0.0).astype(o_ref.dtype))
    else:
        acc_ref, m_ref, l_ref = out_refs
        store(acc_ref, acc)
        m_ref[...] = m
        l_ref[...] = l


# a step's gathered FP8 rows decoded at once on a GPU: at most this many bytes decoded (a decode step of 32 at 128K
# gathers 21 MB a CSA layer and 38 MB an HCA layer); above it (prefill chunks the model's decoded union did not
# take) the reference decodes them by blocks of queries
DECODED_GATHER_BYTES = 256 << 20


def _gathered_fits(q, swa_rows, cmp_rows):
    n = swa_rows.size + (0 if cmp_rows is None else cmp_rows.size)
    return n * q.shape[-1] * q.dtype.itemsize <= DECODED_GATHER_BYTES


def _gpu_supported(q, swa_pool, cmp_pool):
    D = q.shape[-1]
    pow2 = lambda x: x >= 16 and (x & (x - 1)) == 0
    ok = pow2(D) and swa_pool.dtype in (jnp.bfloat16, F32)
    if cmp_pool is not None:
        ok = ok and cmp_pool.dtype == swa_pool.dtype
    return ok


def _sparse_attention_gpu(q, swa_pool, swa_rows, cmp_pool, cmp_rows, sink, *, scale, interpret=False,
                          n_split=None, block=_GPU_BLOCK, heads=_GPU_HEADS, num_warps=4, num_stages=2,
                          return_lse=False, skip_tail=False):
    if cmp_pool is not None and cmp_rows is not None and cmp_rows.shape[-1] > 0 and cmp_pool.dtype != swa_pool.dtype:
        cmp_pool = cmp_pool.astype(swa_pool.dtype)
    return run_rows_kernel_gpu(_gpu_kernel, "v4_sparse_attention_gpu", q, swa_pool, swa_rows, cmp_pool, cmp_rows,
                               sink, scale=scale, interpret=interpret, n_split=n_split, block=block, heads=heads,
                               num_warps=num_warps, num_stages=num_stages, return_lse=return_lse,
                               skip_tail=skip_tail)


def run_rows_kernel_gpu(kernel, name, q, swa_pool, swa_rows, cmp_pool, cmp_rows, sink, *, scale, interpret, n_split,
                        block, heads, num_warps, num_stages, return_lse, skip_tail):
    """The launch of a GPU kernel over each query's gathered rows (`_gpu_kernel`): heads padded to the head block,
    row lists padded to the row block, grid (head blocks, queries, splits), the splits' partial states merged.
    `kernel` takes the refs and scale, block, n_w_blocks, n_c_blocks, n_split, final and skip_tail; the pools as it
    reads them."""
    B, T, H, D = q.shape
    C = block
    hb = heads
    Hp = round_up(H, hb)
    qf = q.reshape(B * T, H, D)
    sinkp = sink.astype(F32)
    if Hp != H:
        qf = jnp.pad(qf, ((0, 0), (0, Hp - H), (0, 0)))
        sinkp = jnp.pad(sinkp, (0, Hp - H))
    has_cmp = cmp_pool is not None and cmp_rows is not None and cmp_rows.shape[-1] > 0
    rw = pad_last(swa_rows.reshape(B * T, -1).astype(jnp.int32), round_up(max(swa_rows.shape[-1], 1), C), -1)
    if has_cmp:
        rc = pad_last(cmp_rows.reshape(B * T, -1).astype(jnp.int32), round_up(cmp_rows.shape[-1], C), -1)
    else:
        cmp_pool, rc = swa_pool, jnp.full((B * T, C), -1, jnp.int32)
    n_w, n_c = rw.shape[-1] // C, (rc.shape[-1] // C if has_cmp else 0)
    # per query, the compressed blocks up to its last valid row (an HCA prefill chunk's rows end at n_ready)
    if skip_tail:
        last = jnp.max(jnp.where(rc >= 0, jnp.arange(1, rc.shape[-1] + 1, dtype=jnp.int32), 0), axis=-1)
        used_c = (last + C - 1) // C                                           # [B*T]
    else:
        used_c = jnp.zeros((B * T,), jnp.int32)                                # (not read)
    n_hb = Hp // hb
    if n_split is None:
        # split the entries only when the (head block, query) programs leave SMs idle: the partial states cost
        # an f32 [H, D] write + read per split
        n_sm = getattr(jax.devices()[0], "core_count", None) or _GPU_SMS
        n_split = max(1, min(int(n_sm / (B * T * n_hb) + 0.5), (n_w + n_c) // 2 or 1))
    final = n_split == 1 and not return_lse  # the partial states carry what lse needs
    kernel = functools.partial(kernel, scale=float(scale), block=C, n_w_blocks=n_w, n_c_blocks=n_c,
                               n_split=n_split, final=final, skip_tail=skip_tail)
    full = lambda x: pl.BlockSpec(x.shape, lambda *_: (0,) * x.ndim)
    in_specs = [
        pl.BlockSpec((None, hb, D), lambda h, i, s: (i, h, 0)),
        pl.BlockSpec((hb,), lambda h, i, s: (h,)),
        pl.BlockSpec((None, rw.shape[-1]), lambda h, i, s: (i, 0)),
        pl.BlockSpec((None, rc.shape[-1]), lambda h, i, s: (i, 0)),
        pl.BlockSpec((None,), lambda h, i, s: (i,)),
        full(swa_pool),
        full(cmp_pool),
    ]
    if final:
        out_shape = jax.ShapeDtypeStruct((B * T, Hp, D), q.dtype)
        out_specs = pl.BlockSpec((None, hb, D), lambda h, i, s: (i, h, 0))
    else:
        out_shape = (jax.ShapeDtypeStruct((B * T, n_split, Hp, D), F32),
                     jax.ShapeDtypeStruct((B * T, n_split, Hp), F32),
                     jax.ShapeDtypeStruct((B * T, n_split, Hp), F32))
        out_specs = (pl.BlockSpec((None, None, hb, D), lambda h, i, s: (i, s, h, 0)),
                     pl.BlockSpec((None, None, hb), lambda h, i, s: (i, s, h)),
                     pl.BlockSpec((None, None, hb), lambda h, i, s: (i, s, h)))
    out = pl.pallas_call(
        kernel, out_shape=out_shape, grid=(n_hb, B * T, n_split), in_specs=in_specs, out_specs=out_specs,
        compiler_params=_compat.TritonCompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=bool(interpret), name=name,
    )(qf, sinkp, rw, rc, used_c, swa_pool, cmp_pool)
    if final:
        o = out
        lse = None
    else:
        acc, m, l = out                                     # [N, S, Hp, D], [N, S, Hp]
        sink_b = sinkp[None, :]
        mx = jnp.maximum(jnp.max(m, axis=1), sink_b)
        w = jnp.exp(m - mx[:, None, :])
        den = jnp.sum(w * l, axis=1) + jnp.exp(sink_b - mx)
        num = jnp.sum(w[..., None] * acc, axis=1)
        o = jnp.where(den[..., None] > 0, num / jnp.where(den > 0, den, 1.0)[..., None], 0.0)
        lse = (jnp.maximum(mx, MASK_FLOOR) + jnp.log(den))[:, :H].reshape(B, T, H)
    o = o[:, :H].reshape(B, T, H, D)
    return (o, lse) if return_lse else o.astype(q.dtype)


# --------------------------------------------------------------------------------------------------------------
# GPU kernel for an HCA layer's prefill chunk: blocks of consecutive queries share their rows
# --------------------------------------------------------------------------------------------------------------

_PREFIX_Q_BLOCK = 4    # queries per program ...
_PREFIX_HEADS = 16     # ... times heads per program: 64 (query, head) rows, one m64 tensor-core tile of the dots
_PREFIX_BLOCK = 64     # rows of a key block
_PREFIX_WARPS = 8
_PREFIX_STAGES = 2
# bf16 pools: one bf16 p in the p @ v dot. H200, 8192 queries x 64 heads x 512 at the end of a 128K prompt (v4jax
# bench kernels --sweep attention_prefill): 5.30 ms against the per-query kernel's 9.0; with p split in two bf16
# parts (pv_matmul) 64.6 ms (two [64, C] x [C, 512] dots and their f32 accumulators spill registers). Max error
# against the f32 reference 1.95e-3 either way (the bf16 output's rounding, as the per-query kernel's).
_PREFIX_PV_SPLIT = False
_PREFIX_MIN_T = 64     # query tokens per batch row from which an HCA layer takes this kernel (decode: the one above)


def dense_prefix_rows(win_rows, hca_rows, n_ready, t, window):
    """An HCA chunk's per-query row lists as `sparse_attention` takes them: query t's window rows
    win_rows[b, t : t + window] -> [B, T, window] (past the end of win_rows: -1), and its compressed rows
    hca_rows[b, e] for e < n_ready[b, t], -1 after -> [B, T, S]."""
    b, u = win_rows.shape
    swa_rows = jnp.take_along_axis(jnp.broadcast_to(win_rows[:, None, :], (b, t, u)),
                                   jnp.arange(t)[None, :, None] + jnp.arange(window)[None, None, :], axis=2)
    e = jnp.arange(hca_rows.shape[1])[None, None, :]
    cmp_rows = jnp.where(e < n_ready[:, :, None], hca_rows[:, None, :], -1)
    return swa_rows, cmp_rows


def dense_prefix_attention_ref(q, swa_pool, win_rows, cmp_pool, hca_rows, n_ready, sink, *, scale, window,
                               return_lse=False):
    """jnp reference of `dense_prefix_attention`: `sparse_attention_ref` over the rows of `dense_prefix_rows`."""
    swa_rows, cmp_rows = dense_prefix_rows(win_rows, hca_rows, n_ready, q.shape[1], window)
    return sparse_attention_ref(q, swa_pool, swa_rows, cmp_pool, cmp_rows, sink, scale=scale, return_lse=return_lse)


def _prefix_kernel(q_ref, sink_ref, nr_ref, win_ref, ncb_ref, hca_ref, swa_ref, cmp_ref, *out_refs, scale, T, H,
                   n_q, tq, hb, window, block, n_w_blocks, pv_split):
    load, store = _compat.pltriton.load, _compat.pltriton.store
    C, M = block, tq * hb
    D = q_ref.shape[-1]
    ib = pl.program_id(1)                                 # grid (head block, b * n_q + query block)
    b = lax.div(ib, n_q)
    t0 = lax.rem(ib, n_q) * tq
    r = lax.broadcasted_iota(jnp.int32, (M,), 0)          # row r of the block: query t0 + r // hb, head r % hb
    t = t0 + lax.div(r, hb)
    h = pl.program_id(0) * hb + lax.rem(r, hb)
    t_ok, h_ok = t < T, h < H
    ok = t_ok & h_ok
    row = (b * T + t) * H + h                             # the row of q (and o) viewed as [B*T*H, D]
    q = _gpu_gather_rows(q_ref, row, ok)                  # [M, D]
    cdt = common_compute_dtype(q.dtype, swa_ref.dtype)
    q = q.astype(cdt)
    sink = load(sink_ref.at[jnp.where(h_ok, h, 0)], mask=h_ok, other=-jnp.inf).astype(F32)      # [M]
    n_ready = load(nr_ref.at[jnp.where(t_ok, b * T + t, 0)], mask=t_ok, other=0)              # [M]
    m0 = jnp.maximum(sink, MASK_FLOOR)
    carry = (m0, jnp.exp(sink - m0), jnp.zeros((M, D), F32))
    cols = lax.broadcasted_iota(jnp.int32, (C,), 0)

    def update(carry, k, valid):                          # k [C, D]; valid [M, C]
        m, l, acc = carry
        s = mm_nt(q, k.astype(cdt)) * scale               # [M, C]
        s = jnp.where(valid, s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        alpha = jnp.exp(m - m_new)
        p = jnp.exp(s - m_new[:, None])
        l = alpha * l + jnp.sum(p, axis=1)
        pv = pv_matmul(p, k) if pv_split or k.dtype != jnp.bfloat16 else mm_nn(p.astype(k.dtype), k)
        return m_new, l, alpha[:, None] * acc + pv

    def window_block(j, carry):                           # union rows t0 + j*C .. : row u is in query t's window
        u0 = t0 + j * C                                   # when t <= u < t + window
        ids = win_ref[pl.ds(u0, C)]
        live = ids >= 0
        d = (u0 + cols)[None, :] - t[:, None]             # [M, C]
        return update(carry, _gpu_gather_rows(swa_ref, ids, live), live[None, :] & (d >= 0) & (d < window))

    def prefix_block(j, carry):                           # entries e = j*C .. : query t sees e < n_ready[t]
        ids = hca_ref[pl.ds(j * C, C)]
        live = ids >= 0
        e = j * C + cols
        return update(carry, _gpu_gather_rows(cmp_ref, ids, live), live[None, :] & (e[None, :] < n_ready[:, None]))

    carry = lax.fori_loop(0, n_w_blocks, window_block, carry)
    carry = lax.fori_loop(0, ncb_ref[...], prefix_block, carry)
    m, l, acc = carry
    o_ref = out_refs[0]
    # rows of no (query, head) point past the output: masked on a GPU, dropped by interpret mode's scatter
    dst = jnp.where(ok, row, o_ref.shape[0])
    o = jnp.where(l[:, None] > 0, acc / jnp.where(l > 0, l, 1.0)[:, None], 0.0)
    store(o_ref.at[dst[:, None], lax.broadcasted_iota(jnp.int32, (1, D), 1)], o.astype(o_ref.dtype),
          mask=jnp.broadcast_to(ok[:, None], (M, D)))
    if len(out_refs) > 1:
        store(out_refs[1].at[dst], m + jnp.log(l), mask=ok)


def dense_prefix_supported(q, swa_pool, cmp_pool):
    """Shapes and dtypes `dense_prefix_attention` takes (bf16 / f32 pools of power-of-two width, 32-bit offsets)."""
    return _gpu_supported(q, swa_pool, cmp_pool) and cmp_pool is not None and q.size < 2 ** 31


def dense_prefix_applies(q, swa_pool, cmp_pool, entry_format=None):
    """Whether the model's HCA attention takes `dense_prefix_attention`: on a GPU, for chunks of at least
    _PREFIX_MIN_T query tokens per row, on pools the kernel reads (FP8 entries: the path of `sparse_attention`)."""
    return (_compat.backend() == "gpu" and entry_format is None and q.shape[1] >= _PREFIX_MIN_T
            and dense_prefix_supported(q, swa_pool, cmp_pool))


def dense_prefix_attention(q, swa_pool, win_rows, cmp_pool, hca_rows, n_ready, sink, *, scale, window,
                           interpret=False, return_lse=False, q_block=_PREFIX_Q_BLOCK, heads=_PREFIX_HEADS,
                           block=_PREFIX_BLOCK, num_warps=_PREFIX_WARPS, num_stages=_PREFIX_STAGES,
                           pv_split=_PREFIX_PV_SPLIT):
    """An HCA layer's attention over a chunk of consecutive queries (GPU, Pallas Triton); the contract of
    `dense_prefix_attention_ref` (= `sparse_attention_ref` on the rows of `dense_prefix_rows`, lse included).

    Shapes (einsum letters): q [b, t, h, d]; swa_pool [r, d], cmp_pool [s', d] (K = V); win_rows [b, u] the SWA rows
    of the chunk's window union, query t's window win_rows[b, t : t + window] (u = t + window - 1 as the model
    builds it); hca_rows [b, s] the compressed rows of each batch row, the SAME for all its queries; n_ready [b, t]
    (query t sees entries e < n_ready[b, t]); sink [h]; -1 rows are none. Returns o [b, t, h, d] (q's dtype; f32
    with return_lse, and lse [b, t, h] f32).

    Why this form: in an HCA layer every query of a batch row reads the same compressed rows (up to its own
    n_ready) and consecutive queries' windows overlap by window - 1 rows, so the per-query kernel above
    (`_sparse_attention_gpu`, one program per (head block, query)) gathers each row once per query and runs
    [16, d] x [d, C] dots. Here a program takes a block of tq consecutive queries x hb heads as one M = tq * hb
    row block ([m, d] with m = (query, head), t-major) and loads each key block once for all of them: the
    FlashAttention shape of a shared-KV (MQA) layer, m = 64 rows being one Hopper m64 tensor-core tile. The loop:
    (1) the union of the block's windows, win_rows[b, t0 : t0 + tq + window - 1], in blocks of C rows, each
    (query, row) pair masked by the query's own window (t <= u < t + window); (2) the compressed rows hca_rows[b, :]
    in blocks of C up to the block's largest n_ready (and the row's last valid entry), masked per query by
    e < n_ready[b, t]. Online softmax in f32 with the sink as the running state's start (as `_gpu_kernel`'s
    `final`), then o = acc / l (0 where l = 0) and lse = m + log(l). q and o are read and written as rows of their
    [b*t*h, d] views (gathered / scattered with row pointers, masked past T and H), so no padded or transposed copy
    of them is made. Heads: hb = min(heads, next_pow2(H)), tq = q_block * heads / hb (the row block's size kept).
    pv_split: p @ v with p split into two bf16 parts (`pv_matmul`, ~2^-17 relative as the reference); False: one
    bf16 p (the FlashAttention rounding, half the PV work). Registers: acc is [m, d] f32 (m = 64, d = 512: 128 KB,
    hence 8 warps); q_block, heads, block, num_warps, num_stages are swept by `v4jax bench kernels --sweep
    attention_prefill`.
    """
    B, T, H, D = q.shape
    C = block
    hb = min(heads, next_pow2(H))
    tq = max(1, q_block * heads // hb)
    n_q, n_hb = -(-T // tq), -(-H // hb)
    n_w = -(-(tq + window - 1) // C)
    if cmp_pool.dtype != swa_pool.dtype:
        cmp_pool = cmp_pool.astype(swa_pool.dtype)
    U = (n_q - 1) * tq + n_w * C                           # the last block's union ends within it
    win = pad_last(win_rows.astype(jnp.int32)[:, :U], U, -1)
    S = hca_rows.shape[1]
    hca = pad_last(hca_rows.astype(jnp.int32), round_up(max(S, 1), C), -1)
    nr = jnp.clip(n_ready.astype(jnp.int32), 0, S)
    # per query block, the compressed blocks up to its largest n_ready and its row's last valid entry
    last = jnp.max(jnp.where(hca_rows >= 0, jnp.arange(1, S + 1, dtype=jnp.int32), 0), axis=-1, initial=0)   # [B]
    top = jnp.max(jnp.pad(nr, ((0, 0), (0, n_q * tq - T))).reshape(B, n_q, tq), axis=-1)                     # [B, n_q]
    ncb = ((jnp.minimum(top, last[:, None]) + C - 1) // C).reshape(B * n_q)
    qf = q.reshape(B * T * H, D)
    full = lambda x: pl.BlockSpec(x.shape, lambda *_: (0,) * x.ndim)
    per_b = lambda n: pl.BlockSpec((None, n), lambda h, i: (lax.div(i, n_q), 0))
    args = (qf, sink.astype(F32), nr.reshape(B * T), win, ncb, hca, swa_pool, cmp_pool)
    in_specs = [full(qf), full(args[1]), full(args[2]), per_b(U), pl.BlockSpec((None,), lambda h, i: (i,)),
                per_b(hca.shape[-1]), full(swa_pool), full(cmp_pool)]
    out_shape = [jax.ShapeDtypeStruct((B * T * H, D), F32 if return_lse else q.dtype)]
    if return_lse:
        out_shape.append(jax.ShapeDtypeStruct((B * T * H,), F32))
    kernel = functools.partial(_prefix_kernel, scale=float(scale), T=T, H=H, n_q=n_q, tq=tq, hb=hb,
                               window=int(window), block=C, n_w_blocks=n_w, pv_split=pv_split)
    out = pl.pallas_call(
        kernel, out_shape=tuple(out_shape), grid=(n_hb, B * n_q), in_specs=in_specs,
        out_specs=tuple(full(s) for s in out_shape),
        compiler_params=_compat.TritonCompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=bool(interpret), name="v4_dense_prefix_attention_gpu",
    )(*args)
    o = out[0].reshape(B, T, H, D)
    return (o, out[1].reshape(B, T, H)) if return_lse else o


# --------------------------------------------------------------------------------------------------------------
# Public entry point
# --------------------------------------------------------------------------------------------------------------

def sparse_attention(q, swa_pool, swa_rows, cmp_pool, cmp_rows, sink, *, scale, interpret=False,
                     return_lse=False, valid_prefix=False, entry_format=None):
    """Pallas sparse attention; same contract as `sparse_attention_ref`.

    entry_format: the pools hold entries as bytes in this format (pallas_kernels.kv_format.Fp8Entry); the TPU-style
    kernel gathers the bytes and decodes them on chip; on a GPU XLA decodes the rows the queries gather into a pool
    of their own, read by the bf16 pools' kernel (`kv_format.decoded_pool`; the reference past
    DECODED_GATHER_BYTES): on an H100 a CSA layer at 128K took 56.8 us at batch 32 against the reference's 116.9
    (HCA 107.5 / 190.8), 20.9 / 20.8 at batch 1. Before that a GPU ran the reference on FP8 entries; measured on the
    H200 (v4jax bench kernels --sweep kv_formats, one CSA layer at 128K): a Triton form gathering the bytes and
    decoding each scale block in registers took 56.8 us at batch 1 and 191 us at batch 32, the reference 22.5 and
    110 us (the bf16 pool's kernel: 14.8 and 38 us), so the Triton form was removed. So was a second one gathering
    the entries as 32-bit words and running one q.k and one p.v product a row block (H100, the same sweep: 36.6 /
    148 us against the reference's 20.8 / 118).

    valid_prefix: a hint that each query's valid compressed rows end where its -1s begin (HCA: every entry before
    n_ready); the GPU kernel then stops each query's loop after its last valid block. On the H200, the last
    8192-token chunk of a 128K prompt's HCA layer (rows as wide as its page bucket, all valid) took 10.1 ms with the
    stop and 9.0 without; a chunk ending at 72K in the same bucket (~55 % valid) 6.3 and 8.9; a CSA layer's
    selected rows (valid almost everywhere, not a prefix) 6.2 and 5.6 (v4jax bench kernels --sweep attention_prefill).

    GPU backend: the Triton kernel. TPU: the Mosaic kernel. interpret=True (or the CPU backend): the TPU-style
    kernel in the HLO interpreter (fast; the tests also run it in the strict TPU interpret mode).
    """
    be = _compat.backend()
    if be == "gpu" and not interpret and entry_format is not None and _gathered_fits(q, swa_rows, cmp_rows):
        swa_pool, swa_rows = kv_format.decoded_pool(swa_pool, swa_rows, entry_format, q.dtype)
        if cmp_rows is not None and cmp_rows.shape[-1] > 0:
            cmp_pool, cmp_rows = kv_format.decoded_pool(cmp_pool, cmp_rows, entry_format, q.dtype)
        entry_format = None
    if be == "gpu" and not interpret and entry_format is None and _gpu_supported(q, swa_pool, cmp_pool):
        return _sparse_attention_gpu(q, swa_pool, swa_rows, cmp_pool, cmp_rows, sink, scale=scale,
                                     return_lse=return_lse, skip_tail=valid_prefix)
    if be == "gpu" and not interpret:
        return sparse_attention_ref(q, swa_pool, swa_rows, cmp_pool, cmp_rows, sink, scale=scale, return_lse=return_lse,
                                    entry_format=entry_format)
    return _sparse_attention_tpu(q, swa_pool, swa_rows, cmp_pool, cmp_rows, sink, scale=scale,
                                 interpret=interpret or be != "tpu", return_lse=return_lse, entry_format=entry_format)
