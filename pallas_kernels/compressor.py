"""KV compressor (reference §3.4, §4.2): project, gate, softmax-pool over a window, RMSNorm, RoPE.

m = ratio; coff = 2 for the overlapping (CSA) compressor, 1 otherwise (HCA); d = head dim of the entries.
State per slot (official layout, f32): kv_state [B, coff*m, coff*d] (init 0), score_state [B, coff*m, coff*d]
(init -inf). CSA: slots [0, m) hold the previous window's rows, [m, 2m) the current window's; HCA: slots [0, m).

Per token at position p: a = x @ wkv.T, z = x @ wgate.T + ape[p % m] (f32); written to slot off + p % m
(off = m for CSA, 0 for HCA). When (p + 1) % m == 0 the window closes and entry p // m is emitted:
  CSA: per channel c < d, softmax over 8 slots of (z[0:m, c], z[m:2m, d + c]) weighting (a[0:m, c], a[m:2m, d+c]);
  HCA: softmax over the m slots of z weighting a;
  then RMSNorm(norm_w, eps) and interleaved RoPE on the last rd dims (cos/sin for position p + 1 - m, computed
  by the caller); CSA then copies slots [m, 2m) to [0, m).

Implementations:
  * `compressor_decode_ref` / `compressor_prefill_ref`: jnp (the XLA path). The prefill reference is vectorised
    (window-aligned rows built from the carried state and the chunk), equal to running decode token by token.
  * TPU-style Pallas decode: grid over 128-channel blocks; one step projects all B tokens for its channels
    (both halves, kv and gate), writes each active slot's row into the state in HBM by DMA (the state is
    aliased in place: only the written rows move), and for the slots whose window closes reads that slot's
    state block, pools, and (CSA) shifts. RMSNorm + RoPE on the pooled [B, d] run in XLA (a tiny epilogue).
  * TPU-style Pallas prefill: the projections are one XLA matmul over the chunk (compute-bound, where XLA is
    already at peak); the kernel (grid (B, channel blocks)) DMAs the chunk's rows window-aligned behind the
    carried state rows, pools every window with strided loads, and writes the new state.
  * GPU: decode is a Pallas Triton kernel (projection + state write + pooling + shift in one pass, grid over
    16-channel blocks); prefill uses the XLA path (compute-bound matmul plus a small pooling fusion).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from . import _compat
from . import compressor_gpu
from ._common import F32, common_compute_dtype, mm_nt, round_up
# finish_entry and project_f32 are part of this module's interface too
from .compressor_common import finish_entry, project_f32, state_dims  # noqa: F401


# --------------------------------------------------------------------------------------------------------------
# Shared maths
# --------------------------------------------------------------------------------------------------------------

def _project(x, wkv, wgate):
    """x [..., Dm] -> (a, z) [..., coff*d] f32 (z without ape)."""
    return project_f32(x, wkv), project_f32(x, wgate)


def _pool(kv, sc, *, m, overlap, d):
    """kv/sc [..., coff*m, coff*d] (slot rows) -> pooled [..., d] (per-channel softmax over the slots)."""
    if overlap:
        A = jnp.concatenate([kv[..., :m, :d], kv[..., m:, d:]], axis=-2)       # [..., 2m, d]
        Z = jnp.concatenate([sc[..., :m, :d], sc[..., m:, d:]], axis=-2)
    else:
        A, Z = kv, sc
    mx = jnp.max(Z, axis=-2, keepdims=True)
    mx = jnp.where(mx > -jnp.inf, mx, 0.0)
    e = jnp.exp(Z - mx)
    num = jnp.sum(e * A, axis=-2)
    den = jnp.sum(e, axis=-2)
    return num / jnp.where(den > 0, den, 1.0)


# --------------------------------------------------------------------------------------------------------------
# Decode: reference
# --------------------------------------------------------------------------------------------------------------

def compressor_decode_ref(x, pos, kv_state, score_state, wkv, wgate, ape, norm_w, cos_sin, *, ratio, overlap,
                          eps, entry_dtype=F32):
    """One token per slot. x [B, Dm], pos [B] int32 (< 0: inactive slot, state untouched).
    Returns (entry [B, d] f32 (0 where not emitted), emitted [B] bool, kv_state', score_state')."""
    m, coff, d = state_dims(kv_state, norm_w, ratio, overlap)
    off = m if overlap else 0
    pos = pos.astype(jnp.int32)
    a, z = _project(x, wkv, wgate)
    r = jnp.mod(pos, m)
    z = z + ape.astype(F32)[r]
    active = pos >= 0
    slot = off + r
    hit = (jnp.arange(coff * m)[None, :] == slot[:, None]) & active[:, None]          # [B, coff*m]
    kv1 = jnp.where(hit[..., None], a[:, None, :], kv_state)
    sc1 = jnp.where(hit[..., None], z[:, None, :], score_state)
    close = active & (jnp.mod(pos + 1, m) == 0)
    pooled = _pool(kv1, sc1, m=m, overlap=overlap, d=d)
    cos, sin = cos_sin
    entry = jnp.where(close[:, None], finish_entry(pooled, norm_w, cos, sin, eps=eps, entry_dtype=entry_dtype), 0.0)
    if overlap:
        shifted_kv = jnp.concatenate([kv1[:, m:], kv1[:, m:]], axis=1)
        shifted_sc = jnp.concatenate([sc1[:, m:], sc1[:, m:]], axis=1)
        kv1 = jnp.where(close[:, None, None], shifted_kv, kv1)
        sc1 = jnp.where(close[:, None, None], shifted_sc, sc1)
    return entry, close, kv1, sc1


# --------------------------------------------------------------------------------------------------------------
# Prefill: reference
# --------------------------------------------------------------------------------------------------------------

def prefill_entry_positions(start_pos, T, m):
    """Start positions (entry * m) of the T//m + 2 candidate entries of a prefill chunk of T tokens starting at
    start_pos [B]: entries[:, i] of `compressor_prefill*` is entry start_pos // m + i. [B, T//m + 2] int32.
    (Compute cos/sin for these positions; `prefill_entry_count` says how many are emitted.)"""
    m = int(m)
    first = jnp.maximum(start_pos.astype(jnp.int32), 0) // m
    return (first[:, None] + jnp.arange(T // m + 2, dtype=jnp.int32)[None, :]) * m


def prefill_entry_count(start_pos, n_tokens, m):
    """Number of entries a chunk of n_tokens [B] starting at start_pos [B] emits (the n_emitted of prefill)."""
    p0, n = _prefill_bounds(start_pos, n_tokens)
    return (p0 + n) // int(m) - p0 // int(m)


def _prefill_bounds(start_pos, n_tokens):
    p0 = start_pos.astype(jnp.int32)
    n = jnp.where(p0 >= 0, jnp.maximum(n_tokens.astype(jnp.int32), 0), 0)
    return jnp.maximum(p0, 0), n


def _prefill_rows(a, z, kv_state, score_state, ape, p0, *, m, coff, T):
    """Window-aligned rows for a chunk: row i of [B, L, coff*d] (L = (T//m + 2) * m) is position (p0//m)*m + i.
    Rows before p0 come from the state's current slots, rows from p0 on from the chunk (a, z + ape)."""
    B = a.shape[0]
    E = T // m + 2
    L = E * m
    off = (coff - 1) * m
    r0 = p0 % m
    i = jnp.arange(L, dtype=jnp.int32)[None, :]
    tok = i - r0[:, None]                                                        # chunk token of row i
    tok_c = jnp.clip(tok, 0, T - 1)
    ape_rows = ape.astype(F32)[jnp.mod(i, m)]                                    # [1, L, coff*d]
    a_c = jnp.take_along_axis(a, tok_c[..., None], axis=1)
    z_c = jnp.take_along_axis(z, tok_c[..., None], axis=1) + ape_rows
    st_idx = off + jnp.clip(i, 0, m - 1)                                         # only used for rows i < r0 < m
    kv_s = jnp.take_along_axis(kv_state, jnp.broadcast_to(st_idx, (B, L))[..., None], axis=1)
    sc_s = jnp.take_along_axis(score_state, jnp.broadcast_to(st_idx, (B, L))[..., None], axis=1)
    from_state = (tok < 0)[..., None]
    return jnp.where(from_state, kv_s, a_c), jnp.where(from_state, sc_s, z_c)


def _prefill_new_state(A, Z, kv_state, score_state, p0, n, *, m, coff):
    """State after the chunk, from the window-aligned rows A/Z [B, L, coff*d] (see _prefill_rows)."""
    off = (coff - 1) * m
    base = (p0 // m) * m
    p1 = p0 + n
    j = jnp.arange(m, dtype=jnp.int32)[None, :]
    P = p1[:, None] - 1 - jnp.mod(p1[:, None] - 1 - j, m)                        # last position < p1 in slot j
    wrote = P >= p0[:, None]
    row = jnp.clip(P - base[:, None], 0, A.shape[1] - 1)
    cur_kv = jnp.where(wrote[..., None], jnp.take_along_axis(A, row[..., None], axis=1), kv_state[:, off:off + m])
    cur_sc = jnp.where(wrote[..., None], jnp.take_along_axis(Z, row[..., None], axis=1),
                       score_state[:, off:off + m])
    if coff == 1:
        return cur_kv, cur_sc
    n_emit = p1 // m - p0 // m
    last = jnp.clip((n_emit - 1)[:, None] * m + j, 0, A.shape[1] - 1)
    emitted = (n_emit > 0)[:, None, None]
    prev_kv = jnp.where(emitted, jnp.take_along_axis(A, last[..., None], axis=1), kv_state[:, :m])
    prev_sc = jnp.where(emitted, jnp.take_along_axis(Z, last[..., None], axis=1), score_state[:, :m])
    return jnp.concatenate([prev_kv, cur_kv], axis=1), jnp.concatenate([prev_sc, cur_sc], axis=1)


def compressor_prefill_ref(x, start_pos, n_tokens, kv_state, score_state, wkv, wgate, ape, norm_w, cos, sin, *,
                           ratio, overlap, eps, entry_dtype=F32):
    """A chunk of T tokens per slot. x [B, T, Dm], start_pos [B], n_tokens [B] (<= T), cos/sin [B, T//m+2, rd/2]
    for the candidate entries (see prefill_entry_positions). Returns (entries [B, T//m+2, d] f32 (0 past
    n_emitted), n_emitted [B] int32, first_entry [B] int32, kv_state', score_state')."""
    m, coff, d = state_dims(kv_state, norm_w, ratio, overlap)
    B, T, _ = x.shape
    E = T // m + 2
    p0, n = _prefill_bounds(start_pos, n_tokens)
    a, z = _project(x, wkv, wgate)
    A, Z = _prefill_rows(a, z, kv_state, score_state, ape, p0, m=m, coff=coff, T=T)
    Aw = A.reshape(B, E, m, coff * d)
    Zw = Z.reshape(B, E, m, coff * d)
    if overlap:
        prevA = jnp.concatenate([kv_state[:, None, :m], Aw[:, :-1]], axis=1)
        prevZ = jnp.concatenate([score_state[:, None, :m], Zw[:, :-1]], axis=1)
        kv_w = jnp.concatenate([prevA, Aw], axis=2)                                 # [B, E, 2m, 2d]
        sc_w = jnp.concatenate([prevZ, Zw], axis=2)
    else:
        kv_w, sc_w = Aw, Zw
    pooled = _pool(kv_w, sc_w, m=m, overlap=overlap, d=d)                        # [B, E, d]
    n_emit = (p0 + n) // m - p0 // m
    ok = jnp.arange(E)[None, :] < n_emit[:, None]
    entries = jnp.where(ok[..., None], finish_entry(pooled, norm_w, cos, sin, eps=eps, entry_dtype=entry_dtype), 0.0)
    kv_new, sc_new = _prefill_new_state(A, Z, kv_state, score_state, p0, n, m=m, coff=coff)
    return entries, n_emit.astype(jnp.int32), (p0 // m).astype(jnp.int32), kv_new, sc_new


# --------------------------------------------------------------------------------------------------------------
# Decode: TPU-style Pallas kernel
# --------------------------------------------------------------------------------------------------------------

_TPU_CB = 128   # channels per grid step


def _tpu_decode_kernel(pos_smem, x_ref, wkv_ref, wg_ref, ape_ref, kv_in, sc_in, pooled_ref, kv_out, sc_out,
                       new_kv, new_sc, kbuf, sbuf, rsem, wsem, *, m, coff, cb, nb):
    del kv_out, sc_out  # aliased with kv_in / sc_in: rows are written through the input refs' buffers
    j = pl.program_id(0)
    off = (coff - 1) * m
    ch = pl.ds(pl.multiple_of(j * cb, cb), cb)
    cdt = common_compute_dtype(x_ref.dtype, wkv_ref.dtype)
    x = x_ref[...].astype(cdt)
    for h in range(coff):
        new_kv[h] = mm_nt(x, wkv_ref[h].astype(cdt))                             # [B, cb]
        new_sc[h] = mm_nt(x, wg_ref[h].astype(cdt)) + ape_ref[h]
    pooled_ref[...] = jnp.zeros_like(pooled_ref)

    def info(b):
        p = pos_smem[b]
        return p, p >= 0, (p >= 0) & (lax.rem(p + 1, m) == 0), off + lax.rem(jnp.maximum(p, 0), m)

    def row_copies(b, slot):
        cps = []
        for h in range(coff):
            cps.append(pltpu.make_async_copy(new_kv.at[h, pl.ds(b, 1)], kv_in.at[b, pl.ds(slot, 1), h, ch], wsem))
            cps.append(pltpu.make_async_copy(new_sc.at[h, pl.ds(b, 1)], sc_in.at[b, pl.ds(slot, 1), h, ch], wsem))
        return cps

    def block_reads(b):
        cps = []
        for h in range(coff):
            cps.append(pltpu.make_async_copy(kv_in.at[b, :, h, ch], kbuf.at[b, h], rsem.at[b]))
            cps.append(pltpu.make_async_copy(sc_in.at[b, :, h, ch], sbuf.at[b, h], rsem.at[b]))
        return cps

    def shift_copies(b):   # CSA: the (updated) current window becomes the previous one
        cps = []
        for h in range(coff):
            cps.append(pltpu.make_async_copy(kbuf.at[b, h, pl.ds(m, m)], kv_in.at[b, pl.ds(0, m), h, ch], wsem))
            cps.append(pltpu.make_async_copy(sbuf.at[b, h, pl.ds(m, m)], sc_in.at[b, pl.ds(0, m), h, ch], wsem))
        return cps

    # Phase A: closing slots start reading their state block; other active slots start writing their row.
    def phase_a(b, carry):
        _, active, close, slot = info(b)

        @pl.when(close)
        def _():
            for cp in block_reads(b):
                cp.start()

        @pl.when(active & jnp.logical_not(close))
        def _():
            for cp in row_copies(b, slot):
                cp.start()

        return carry

    lax.fori_loop(0, nb, phase_a, 0)
    row_ids = lax.broadcasted_iota(jnp.int32, (nb, 1), 0)
    slot_ids = lax.broadcasted_iota(jnp.int32, (coff * m, 1), 0)

    # Phase B: closing slots pool (with their new row substituted), write the row, and shift (CSA).
    def phase_b(b, carry):
        _, _, close, slot = info(b)

        @pl.when(close)
        def _():
            for cp in block_reads(b):
                cp.wait()
            sel = row_ids == b
            kvs, scs = [], []
            for h in range(coff):
                kv_row = jnp.sum(jnp.where(sel, new_kv[h], 0.0), axis=0, keepdims=True)   # [1, cb]
                sc_row = jnp.sum(jnp.where(sel, new_sc[h], 0.0), axis=0, keepdims=True)
                cur = slot_ids == off + m - 1
                kv_h = jnp.where(cur, kv_row, kbuf[b, h])                                  # [coff*m, cb]
                sc_h = jnp.where(cur, sc_row, sbuf[b, h])
                kbuf[b, h] = kv_h
                sbuf[b, h] = sc_h
                kvs.append(kv_h)
                scs.append(sc_h)
            if coff == 2:
                parts = [(kvs[0][:m], scs[0][:m]), (kvs[1][m:], scs[1][m:])]
            else:
                parts = [(kvs[0], scs[0])]
            mx = functools.reduce(jnp.maximum, [jnp.max(s, axis=0, keepdims=True) for _, s in parts])
            mx = jnp.where(mx > -jnp.inf, mx, 0.0)
            num = sum(jnp.sum(jnp.exp(s - mx) * a, axis=0, keepdims=True) for a, s in parts)
            den = sum(jnp.sum(jnp.exp(s - mx), axis=0, keepdims=True) for _, s in parts)
            pooled = num / jnp.where(den > 0, den, 1.0)                                   # [1, cb]
            pooled_ref[...] = jnp.where(sel, pooled, pooled_ref[...])
            for cp in row_copies(b, slot) + (shift_copies(b) if coff == 2 else []):
                cp.start()

        return carry

    lax.fori_loop(0, nb, phase_b, 0)

    # Phase C: wait for every write.
    def phase_c(b, carry):
        _, active, close, slot = info(b)

        @pl.when(active)
        def _():
            for cp in row_copies(b, slot):
                cp.wait()

        if coff == 2:
            @pl.when(close)
            def _():
                for cp in shift_copies(b):
                    cp.wait()

        return carry

    lax.fori_loop(0, nb, phase_c, 0)


def _compressor_decode_tpu(x, pos, kv_state, score_state, wkv, wgate, ape, norm_w, cos_sin, *, ratio, overlap,
                           eps, entry_dtype=F32, interpret=False):
    m, coff, d = state_dims(kv_state, norm_w, ratio, overlap)
    B, Dm = x.shape
    cb = _TPU_CB if d % _TPU_CB == 0 else d
    pos = pos.astype(jnp.int32)
    ape_rows = ape.astype(F32)[jnp.mod(pos, m)].reshape(B, coff, d).transpose(1, 0, 2)    # [coff, B, d]
    kv4 = kv_state.reshape(B, coff * m, coff, d)
    sc4 = score_state.reshape(B, coff * m, coff, d)
    kernel = functools.partial(_tpu_decode_kernel, m=m, coff=coff, cb=cb, nb=B)
    pooled, kv4, sc4 = pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((B, d), F32), jax.ShapeDtypeStruct(kv4.shape, F32),
                   jax.ShapeDtypeStruct(sc4.shape, F32)),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(d // cb,),
            in_specs=[
                pl.BlockSpec((B, Dm), lambda j, p: (0, 0)),
                pl.BlockSpec((coff, cb, Dm), lambda j, p: (0, j, 0)),
                pl.BlockSpec((coff, cb, Dm), lambda j, p: (0, j, 0)),
                pl.BlockSpec((coff, B, cb), lambda j, p: (0, 0, j)),
                pl.BlockSpec(memory_space=_compat.ANY),
                pl.BlockSpec(memory_space=_compat.ANY),
            ],
            out_specs=(pl.BlockSpec((B, cb), lambda j, p: (0, j)),
                       pl.BlockSpec(memory_space=_compat.ANY),
                       pl.BlockSpec(memory_space=_compat.ANY)),
            scratch_shapes=[
                pltpu.VMEM((coff, B, cb), F32), pltpu.VMEM((coff, B, cb), F32),
                pltpu.VMEM((B, coff, coff * m, cb), F32), pltpu.VMEM((B, coff, coff * m, cb), F32),
                pltpu.SemaphoreType.DMA((B,)), pltpu.SemaphoreType.DMA(()),
            ]),
        input_output_aliases={5: 1, 6: 2},
        compiler_params=_compat.TPUCompilerParams(dimension_semantics=("arbitrary",),
                                                  vmem_limit_bytes=96 * 2**20),
        interpret=_compat.interpret_arg(interpret, "tpu"),
        name="v4_compressor_decode",
    )(pos, x, wkv.reshape(coff, d, Dm), wgate.reshape(coff, d, Dm), ape_rows, kv4, sc4)
    close = (pos >= 0) & (jnp.mod(pos + 1, m) == 0)
    cos, sin = cos_sin
    entry = jnp.where(close[:, None], finish_entry(pooled, norm_w, cos, sin, eps=eps, entry_dtype=entry_dtype), 0.0)
    return entry, close, kv4.reshape(kv_state.shape), sc4.reshape(score_state.shape)


# --------------------------------------------------------------------------------------------------------------
# Prefill: TPU-style Pallas kernel (pooling + state; projections in XLA)
# --------------------------------------------------------------------------------------------------------------

def _tpu_prefill_kernel(p0_smem, n_smem, a_hbm, z_hbm, kv_ref, sc_ref, pooled_ref, kv_out, sc_out,
                        abuf, zbuf, sem, *, m, coff, cb, T, E):
    b = pl.program_id(0)
    j = pl.program_id(1)
    ch = pl.ds(pl.multiple_of(j * cb, cb), cb)
    off = (coff - 1) * m        # CSA: the buffers start with the previous window
    p0 = p0_smem[b]
    n = n_smem[b]
    r0 = lax.rem(p0, m)
    # buffers [coff, off + L, cb]: rows [0, off) = previous window (CSA), then window-aligned rows: the state's
    # current slots first (covering positions before p0 in p0's window), then the chunk from row off + r0.
    cps = []
    for h in range(coff):
        cps.append(pltpu.make_async_copy(a_hbm.at[b, :, h, ch], abuf.at[h, pl.ds(off + r0, T)], sem))
        cps.append(pltpu.make_async_copy(z_hbm.at[b, :, h, ch], zbuf.at[h, pl.ds(off + r0, T)], sem))
    for cp in cps:
        cp.start()
    for cp in cps:
        cp.wait()
    # then the state rows below the chunk (a select after the copies landed: no store/DMA write ordering needed)
    below = lax.broadcasted_iota(jnp.int32, (coff * m, 1), 0) < off + r0
    for h in range(coff):
        abuf[h, pl.ds(0, coff * m)] = jnp.where(below, kv_ref[h], abuf[h, pl.ds(0, coff * m)])
        zbuf[h, pl.ds(0, coff * m)] = jnp.where(below, sc_ref[h], zbuf[h, pl.ds(0, coff * m)])

    # Pool every candidate window: slot s of window i is row off + i*m + s (own, half coff-1) and, for CSA,
    # row i*m + s (previous window, half 0).
    def slot_rows(buf, h, start):
        return buf[h, pl.ds(start, E, stride=m), :]                                # [E, cb]

    parts = []
    if coff == 2:
        parts.append((0, 0))
        parts.append((1, off))
    else:
        parts.append((0, 0))

    def mx_body(s, mx):
        for h, base in parts:
            mx = jnp.maximum(mx, slot_rows(zbuf, h, base + s))
        return mx

    mx = lax.fori_loop(0, m, mx_body, jnp.full((E, cb), -jnp.inf, F32))
    mx = jnp.where(mx > -jnp.inf, mx, 0.0)

    def acc_body(s, carry):
        num, den = carry
        for h, base in parts:
            e = jnp.exp(slot_rows(zbuf, h, base + s) - mx)
            num = num + e * slot_rows(abuf, h, base + s)
            den = den + e
        return num, den

    zero = jnp.zeros((E, cb), F32)
    num, den = lax.fori_loop(0, m, acc_body, (zero, zero))
    pooled_ref[...] = num / jnp.where(den > 0, den, 1.0)

    # New state. Current slot s: the last position P < p0 + n with P % m == s if P >= p0 (buffer row
    # off + P - base), else the old row. CSA previous slots: the last emitted window's rows, else the old ones.
    p1 = p0 + n
    base = p0 - r0
    for h in range(coff):
        for buf, src, dst in ((abuf, kv_ref, kv_out), (zbuf, sc_ref, sc_out)):
            rows = []
            if coff == 2:
                n_emit = p1 // m - p0 // m
                last = off + jnp.maximum(n_emit - 1, 0) * m
                rows.append(jnp.where(n_emit > 0, buf[h, pl.ds(last, m), :], src[h, pl.ds(0, m), :]))
            for s in range(m):
                P = p1 - 1 - lax.rem(p1 - 1 - s + m * (T + m), m)
                row = off + jnp.maximum(P - base, 0)
                rows.append(jnp.where(P >= p0, buf[h, pl.ds(row, 1), :], src[h, pl.ds(off + s, 1), :]))
            dst[h] = jnp.concatenate(rows, axis=0)


def _compressor_prefill_tpu(x, start_pos, n_tokens, kv_state, score_state, wkv, wgate, ape, norm_w, cos, sin, *,
                            ratio, overlap, eps, entry_dtype=F32, interpret=False):
    m, coff, d = state_dims(kv_state, norm_w, ratio, overlap)
    B, T, _ = x.shape
    E = T // m + 2
    L = E * m
    cb = _TPU_CB if d % _TPU_CB == 0 else d
    p0, n = _prefill_bounds(start_pos, n_tokens)
    a, z = _project(x, wkv, wgate)
    pos = p0[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
    z = z + ape.astype(F32)[jnp.mod(pos, m)]
    a4 = a.reshape(B, T, coff, d)
    z4 = z.reshape(B, T, coff, d)
    # state as [B, coff(half), coff*m(slot), d] so a half's slots are contiguous rows in VMEM
    kvT = kv_state.reshape(B, coff * m, coff, d).transpose(0, 2, 1, 3)
    scT = score_state.reshape(B, coff * m, coff, d).transpose(0, 2, 1, 3)
    rows = round_up((coff - 1) * m + L + m, 8)
    kernel = functools.partial(_tpu_prefill_kernel, m=m, coff=coff, cb=cb, T=T, E=E)
    st_spec = pl.BlockSpec((None, coff, coff * m, cb), lambda b, j, *_: (b, 0, 0, j))
    pooled, kvT, scT = pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((B, E, d), F32), jax.ShapeDtypeStruct(kvT.shape, F32),
                   jax.ShapeDtypeStruct(scT.shape, F32)),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(B, d // cb),
            in_specs=[pl.BlockSpec(memory_space=_compat.ANY), pl.BlockSpec(memory_space=_compat.ANY),
                      st_spec, st_spec],
            out_specs=(pl.BlockSpec((None, E, cb), lambda b, j, *_: (b, 0, j)), st_spec, st_spec),
            scratch_shapes=[pltpu.VMEM((coff, rows, cb), F32), pltpu.VMEM((coff, rows, cb), F32),
                            pltpu.SemaphoreType.DMA(())]),
        compiler_params=_compat.TPUCompilerParams(dimension_semantics=("parallel", "parallel"),
                                                  vmem_limit_bytes=96 * 2**20),
        interpret=_compat.interpret_arg(interpret, "tpu"),
        name="v4_compressor_prefill",
    )(p0, n, a4, z4, kvT, scT)
    n_emit = (p0 + n) // m - p0 // m
    ok = jnp.arange(E)[None, :] < n_emit[:, None]
    entries = jnp.where(ok[..., None], finish_entry(pooled, norm_w, cos, sin, eps=eps, entry_dtype=entry_dtype), 0.0)
    kv_new = kvT.transpose(0, 2, 1, 3).reshape(kv_state.shape)
    sc_new = scT.transpose(0, 2, 1, 3).reshape(score_state.shape)
    return entries, n_emit.astype(jnp.int32), (p0 // m).astype(jnp.int32), kv_new, sc_new


# --------------------------------------------------------------------------------------------------------------
# Public entry points
# --------------------------------------------------------------------------------------------------------------

def compressor_decode(x, pos, kv_state, score_state, wkv, wgate, ape, norm_w, cos_sin, *, ratio, overlap, eps,
                      entry_dtype=F32, interpret=False):
    """Pallas compressor decode; same contract as `compressor_decode_ref`. Donate the states at the jit
    boundary: the kernels update them in place (otherwise XLA copies them first)."""
    be = _compat.backend()
    kw = dict(ratio=ratio, overlap=overlap, eps=eps, entry_dtype=entry_dtype)
    if be == "gpu" and not interpret:
        if compressor_gpu.decode_supported(x, kv_state, norm_w, ratio, overlap):
            return compressor_gpu.compressor_decode_gpu(x, pos, kv_state, score_state, wkv, wgate, ape, norm_w,
                                                        cos_sin, **kw)
        return compressor_decode_ref(x, pos, kv_state, score_state, wkv, wgate, ape, norm_w, cos_sin, **kw)
    return _compressor_decode_tpu(x, pos, kv_state, score_state, wkv, wgate, ape, norm_w, cos_sin, **kw,
                                  interpret=interpret or be != "tpu")


def compressor_prefill(x, start_pos, n_tokens, kv_state, score_state, wkv, wgate, ape, norm_w, cos, sin, *,
                       ratio, overlap, eps, entry_dtype=F32, interpret=False):
    """Pallas compressor prefill; same contract as `compressor_prefill_ref` (GPU: the XLA path, see module doc)."""
    be = _compat.backend()
    kw = dict(ratio=ratio, overlap=overlap, eps=eps, entry_dtype=entry_dtype)
    if be == "gpu" and not interpret:
        return compressor_prefill_ref(x, start_pos, n_tokens, kv_state, score_state, wkv, wgate, ape, norm_w, cos,
                                      sin, **kw)
    return _compressor_prefill_tpu(x, start_pos, n_tokens, kv_state, score_state, wkv, wgate, ape, norm_w, cos,
                                   sin, **kw, interpret=interpret or be != "tpu")
