"""Attention of a DeepSeek-V4 layer (reference §3-§4): the compressors, the Lightning Indexer, the attention
module with its full-sequence form (the reference) and its cached form over the pools, and `attention_core`, one
layer's pool writes and attention over the rows a shard holds (v4jax.model.transformer runs it per shard on a mesh).
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from pallas_kernels import kv_format
from sharding import context
from sharding.rules import POOL_AXES
from v4jax.config import CSA, SLIDING, ModelConfig
from v4jax.model import layers as L
from v4jax.model import offload, quant
from v4jax.model.layers import Linear, RMSNorm, RunOptions, init_normal
from v4jax.model.ops import Ops, on_shards


# offload's names -> the LayerPool fields holding them (v4jax.cache.pools.HOT_FIELDS; the model does not import
# the cache, a test checks they agree)
HOT_FIELDS = {"hot": "kv_hot", "table": "hot_table", "owner": "hot_owner", "used": "hot_used", "clock": "hot_clock",
              "counts": "hot_counts"}


def pending_of(state_field: str) -> str:
    """The pool field holding a verify step's compressor inputs for the state `state_field` (v4jax.cache.pools)."""
    return state_field.replace("state", "pending")


def boundary_of(state_field: str) -> str:
    """The pool field holding a prefill step's compressor inputs before the chunk's inner page boundaries, for the
    state `state_field` (v4jax.cache.pools; the engine saves them as those boundaries' states)."""
    return state_field.replace("state", "boundary")


def _before_ends(x, proj, meta, m: int):
    """x [B, T, D] (and the caller's projections of it) at the m positions before each of meta.page_ends [B, NB]:
    (x [B, NB*m, D], their positions [B, NB*m], proj or None). Ends of -1 give clamped rows (never saved)."""
    b, nb = meta.page_ends.shape
    pos = (meta.page_ends[:, :, None] - m + jnp.arange(m)[None, None, :]).reshape(b, nb * m)
    at = jnp.clip(pos - meta.start[:, None], 0, x.shape[1] - 1)[..., None]
    take = lambda v: jnp.take_along_axis(v, at, axis=1)  # noqa: E731
    return take(x), pos, None if proj is None else tuple(take(v) for v in proj)


F32 = jnp.float32


def _rows_of(state, li, meta):
    """The step's rows of layer li's per-slot state [n, slots, ...] (meta.slot None: every slot, in order)."""
    return L.layer_slice(state, li) if meta.slot is None else state[li, meta.slot]


def _set_rows(state, li, meta, new):
    return state.at[li].set(new) if meta.slot is None else state.at[li, meta.slot].set(new)


def _flat(pool):
    """A stacked pool [n, R, K] as the flat rows [n * R, K] of all its layers (a free reshape)."""
    return pool.reshape(-1, pool.shape[-1])


def attention_core(blocks: dict, q, sink, pools: dict, writes: dict, reads: dict, li, *, ops: Ops, scale: float,
                   window: int, topk: int, formats: dict | None = None, row_axes: tuple[str, ...] = (),
                   hot: dict | None = None):
    """One layer's pool writes and attention over the rows this shard holds (all of them on one device).

    blocks: pool name -> context.RowBlock, the rows of `pools[name]` ([n, R, K], the stack's n layers) held here;
    writes: name -> (rows of layer li [B, E], values [B, E, K]); reads: the window's rows and positions, the
    query positions, and on compressed layers the entries' rows [B, S] with n_ready (and the indexer's queries
    and head weights on CSA layers). formats: pool name -> its entry format (pallas_kernels.kv_format) where the
    pool stores bytes (kv_cache_dtype="fp8"): writes are encoded, the ops decode what they read (a prefill step
    decodes the rows its queries share once, `_union_pays`). Rows are global
    (one layer's ids, -1 = none); each shard keeps those of its block. The indexer's top-k over the shards'
    candidates and the shards' partial softmaxes are merged so that the result is the single-device one
    (sharding/context.py). row_axes: mesh axes the B rows are split over (a shard has its own rows, whose entries
    lie in its blocks along those axes: nothing to merge over them).
    hot: on one device, the hot buffer of `pools["kv"]` held in host memory (v4jax.model.offload): writes go to
    both, the selected rows are made resident and read from the buffer. Returns (o [B, T, H, K], pools), pools with
    the offload state under "hot" when given."""
    merge = tuple(dict.fromkeys(a for b in blocks.values() for a in b.axes if a not in row_axes))
    formats = formats or {}

    def local(name, rows):  # global rows of layer li -> rows of this shard's flat view (-1 = elsewhere / none)
        r = blocks[name].local(rows)
        return jnp.where(r >= 0, r + li * blocks[name].rows, -1)

    def counted(name, rows):  # the rows this shard adds to the softmax: a pool held whole along a merge axis
        return jnp.where(context.first_along(tuple(a for a in merge if a not in blocks[name].axes)),
                         local(name, rows), -1)

    flat = {}
    for name, pool in pools.items():
        rows, values = writes[name]
        dst = _flat(pool)
        r = local(name, rows).reshape(-1)
        values = values.reshape(-1, values.shape[-1])
        values = formats[name].encode(values) if name in formats else values.astype(dst.dtype)
        if hot is not None and name == "kv":
            hot, flat[name] = offload.write(hot, pool, li, rows.reshape(-1), values,  # [n, R, K] on the host
                                            largest=rows.shape[-1])
            continue
        flat[name] = L.set_rows(dst, r, values)
    kv = flat.get("kv") if hot is None else _flat(hot["hot"])
    hca_rows = sel_rows = None
    if "idx" in flat:
        rows = reads["rows"]
        keys, key_rows, key_format = flat["idx"], local("idx", rows), formats.get("idx")
        if key_format is not None and _keys_decoded_once(reads["iq"], key_rows):
            keys, key_rows = _decoded_union(keys, key_rows, key_format, reads["iq"].dtype)
            key_format = None
        scores, at = _select(ops, reads["iq"], reads["w"], keys, key_rows, reads["n_ready"], topk, key_format)
        _, at = context.merge_topk(scores, at, topk, tuple(a for a in blocks["idx"].axes if a not in row_axes))
        picked = jnp.take_along_axis(jnp.broadcast_to(rows[:, None, :], (*at.shape[:2], rows.shape[1])),
                                     jnp.maximum(at, 0), axis=2)
        if hot is None:
            sel_rows = counted("kv", jnp.where(at >= 0, picked, -1))
        else:
            win = dict(reads, win_rows=local("swa", reads["win_rows"]))  # rows of the SWA pool's flat view
            attend = dict(ops=ops, scale=scale, window=window, entry_format=formats.get("swa"))
            group = offload.whole_read_rows(*rows.shape, at.shape[1], topk, hot["hot"].shape[1])
            if group:  # the rows' whole C4 KV, `group` rows at a time
                o, hot = _attend_whole(q, sink, flat, hot, win, li, rows, at, group, **attend)
                # the last token's selections made resident: the next decode step selects mostly the same rows
                hot, _ = offload.fetch(hot, flat["kv"], li, jnp.where(at[:, -1:] >= 0, picked[:, -1:], -1))
            else:  # in blocks of query tokens whose selections fit the hot buffer: fetched, then read from it
                o, hot = _attend_offloaded(q, sink, flat, hot, win, li, jnp.where(at >= 0, picked, -1), **attend)
            return o, _unflat(flat, pools, hot)
    elif kv is not None:
        hca_rows = counted("kv", reads["rows"])
    swa, win_rows, entry_format = flat["swa"], counted("swa", reads["win_rows"]), formats.get("swa")
    if entry_format is not None and _union_pays(q, win_rows, None if kv is None else reads["rows"],
                                                hca_rows is None, window, topk):
        # the chunk's rows decoded once, then read by the kernels of bf16 pools (their doc)
        swa, win_rows = _decoded_union(swa, win_rows, entry_format, q.dtype)
        if kv is not None:
            kv, union = _decoded_union(kv, local("kv", reads["rows"]) if hca_rows is None else hca_rows,
                                       entry_format, q.dtype)
            if hca_rows is None:  # a CSA layer: its selections are positions in the union
                s = reads["rows"].shape[1]
                sel_rows = jnp.where(sel_rows >= 0, jnp.arange(q.shape[0])[:, None, None] * s + at, -1)
            else:
                hca_rows = union
        entry_format = None
    o = ops.attend(q, jnp.where(context.first_along(merge), sink, -jnp.inf), scale, swa, win_rows,
                   reads["win_pos"], reads["pos"], window, kv, hca_rows, reads.get("n_ready"), sel_rows,
                   with_lse=bool(merge), entry_format=entry_format)
    if merge:
        o = context.merge_softmax(*o, merge)
    return o, _unflat(flat, pools, hot)


# the rows a chunk's attention reads, decoded from FP8 entries at once: at most this many bytes (a 1M context's C4
# union is 256 MiB a row in bf16); above it the kernels decode the rows each query gathers
DECODED_UNION_BYTES = 1 << 30


def _union_pays(q, win_rows, rows, csa: bool, window: int, topk: int) -> bool:
    """Whether a step reading FP8 entries decodes the rows its queries share once (the window union [B, U] and the
    layer's compressed rows [B, S]) and attends with the kernels of bf16 pools, rather than letting every query
    gather and decode its own rows (pallas_kernels.sparse_attention on bytes).
    Decided by the shapes: when the union holds fewer rows than the queries gather (prefill chunks; never a decode
    step, whose window union is its window). flash-slice's 128K prefill on an H100 with FP8 entries: 3.59 s
    before this, 1.93 s with it (bf16 entries: 1.62 s)."""
    b, t = q.shape[:2]
    u = win_rows.shape[1]
    s = 0 if rows is None else rows.shape[1]
    gathered = t * (window + (min(topk, s) if csa else s))
    return u + s < gathered and b * (u + s) * q.shape[-1] * q.dtype.itemsize <= DECODED_UNION_BYTES


# the union's rows [B, N] decoded as a pool of their own [B * N, K], and their places in it (-1 kept)
_decoded_union = kv_format.decoded_pool

# a step's queries above which the indexer reads its FP4 keys decoded once (`_keys_decoded_once`): the GPU
# kernel's block of queries (pallas_kernels.indexer._GPU_TQ), within which each key is decoded once anyway
KEYS_DECODED_ONCE_ABOVE = 32


def _keys_decoded_once(iq, key_rows) -> bool:
    """Whether a step reading FP4 indexer keys decodes the keys of its rows [B, S] once, as a pool of their own in
    the queries' dtype read by the kernel of bf16 keys, rather than letting the kernel decode them for every block
    of queries (a prefill chunk of 8,192 queries decoded each key 256 times). The same decoded values either way.
    H100, flash-slice's 128K prefill: the indexer took 267 ms of kernel time on FP4 keys against 192 on bf16 keys."""
    b, t = iq.shape[:2]
    return t > KEYS_DECODED_ONCE_ABOVE and b * key_rows.shape[1] * iq.shape[-1] * iq.dtype.itemsize \
        <= DECODED_UNION_BYTES


# a step's indexer scores (f32, [B, T, S]) held at once: at most this many bytes. The page table is as wide as the
# program's page bucket (the covering programs': the whole context), so a prefill chunk of 8,192 at 1M held 8 GiB
# of scores; an H100's flash-1gpu prefill of a 1M prompt ran out of memory on a 10.6 GiB step temporary.
SELECT_SCORES_BYTES = 1 << 30


def _select(ops: Ops, iq, w, idx, rows, n_ready, topk, key_format):
    """ops.select over the step's query tokens in blocks (the largest power-of-two part of T whose scores fit
    SELECT_SCORES_BYTES; queries select independently, so the blocks give the one-call result): (scores, at)
    [B, T, k]."""
    b, t = n_ready.shape
    tb = t
    while tb % 2 == 0 and b * tb * rows.shape[1] * 4 > SELECT_SCORES_BYTES:
        tb //= 2
    if tb == t:
        return ops.select(iq, w, idx, rows, n_ready, topk, key_format)

    def block(_, j):
        cut = lambda a: jax.lax.dynamic_slice_in_dim(a, j * tb, tb, axis=1)
        return None, ops.select(cut(iq), cut(w), idx, rows, cut(n_ready), topk, key_format)

    _, out = jax.lax.scan(block, None, jnp.arange(t // tb))
    return tuple(jnp.moveaxis(a, 0, 1).reshape(b, t, a.shape[-1]) for a in out)


def _unflat(flat, pools, hot):
    """The written pools in their stacked shapes (the host pool is kept stacked: no reshape of host memory), with
    the offload state under "hot" when given."""
    out = {name: f if f.shape == pools[name].shape else f.reshape(pools[name].shape) for name, f in flat.items()}
    return out if hot is None else dict(out, hot=hot)


def _attend_whole(q, sink, flat, hot, reads, li, rows, at, group: int, *, ops: Ops, scale, window, entry_format):
    """Attention of a CSA layer whose C4 KV is on the host (one device), its B rows `group` at a time: each group's
    rows' whole C4 KV of layer li read from the host at once (offload.read_whole) and its queries' selections read
    from that copy. rows [B, S] layer rows of the entries (-1: none); at [B, T, k] the selected entries (-1: none);
    reads["win_rows"] rows of the SWA pool's flat view. Returns (o [B, T, H, K], hot)."""
    b, s = rows.shape

    def part(hot, j):
        cut = lambda a: jax.lax.dynamic_slice_in_dim(a, j * group, group, axis=0)
        sel = cut(at)
        hot, kv = offload.read_whole(hot, flat["kv"], li, cut(rows), jnp.sum(sel >= 0))
        sel = jnp.where(sel >= 0, jnp.arange(group)[:, None, None] * s + sel, -1)
        swa, win, fmt = flat["swa"], cut(reads["win_rows"]), entry_format
        if fmt is not None and _union_pays(cut(q), win, cut(rows), True, window, at.shape[-1]):
            # the group's whole C4 KV read is its union: decoded once, as attention_core does
            swa, win = _decoded_union(swa, win, fmt, q.dtype)
            kv, fmt = fmt.decode(kv, q.dtype), None
        o = ops.attend(cut(q), sink, scale, swa, win, cut(reads["win_pos"]), cut(reads["pos"]), window, kv, None,
                       cut(reads["n_ready"]), sel, with_lse=False, entry_format=fmt)
        return hot, o

    if group == b:
        hot, o = part(hot, 0)
        return o, hot
    hot, o = jax.lax.scan(part, hot, jnp.arange(b // group))
    return o.reshape(q.shape[:2] + o.shape[3:]), hot


def _attend_offloaded(q, sink, flat, hot, reads, li, sel, *, ops: Ops, scale, window, entry_format):
    """Attention of a CSA layer whose C4 KV is on the host (one device): the query tokens in blocks of tb, each
    block's selected rows made resident (offload.fetch) and read from the hot buffer. Queries are independent given
    the pools, so the blocks give the one-call result; tb (a power of two dividing T) keeps a block's selections,
    B x tb x k rows, within the buffer. sel [B, T, k] layer rows (-1: none); reads["win_rows"] rows of the SWA
    pool's flat view. Returns (o [B, T, H, K], hot)."""
    b, t, k = sel.shape
    h = hot["hot"].shape[1]
    tb = 1 << max((h // (b * k)).bit_length() - 1, 0)  # the engine's layout guarantees b * k <= h
    tb = math.gcd(tb, t)
    w = reads["win_rows"].shape[1] - t  # W - 1: block j's window union is win_rows[j*tb : j*tb + W - 1 + tb]

    def block(hot, j):
        cut = lambda a, n: jax.lax.dynamic_slice_in_dim(a, j * tb, n, axis=1)
        hot, rows = offload.fetch(hot, flat["kv"], li, cut(sel, tb))
        o = ops.attend(cut(q, tb), sink, scale, flat["swa"], cut(reads["win_rows"], w + tb),
                       cut(reads["win_pos"], w + tb), cut(reads["pos"], tb), window, _flat(hot["hot"]), None,
                       cut(reads["n_ready"], tb), rows, with_lse=False, entry_format=entry_format)
        return hot, o

    if tb == t:
        hot, o = block(hot, 0)
        return o, hot
    hot, o = jax.lax.scan(block, hot, jnp.arange(t // tb))
    return jnp.moveaxis(o, 0, 1).reshape(q.shape[:2] + o.shape[3:]), hot


class Compressor(nnx.Module):
    """Softmax-gated pooling of each window of `ratio` tokens into one entry (overlapping for CSA)."""

    def __init__(self, cfg: ModelConfig, ratio: int, head_dim: int, overlap: bool, *, rngs, dtype):
        coff = 2 if overlap else 1
        self.ratio, self.head_dim, self.overlap = ratio, head_dim, overlap
        self.wkv = Linear(cfg.dim, coff * head_dim, ("compress", "embed"), rngs=rngs, dtype=dtype)
        self.wgate = Linear(cfg.dim, coff * head_dim, ("compress", "embed"), rngs=rngs, dtype=dtype)
        self.ape = nnx.Param(init_normal(rngs, (ratio, coff * head_dim), 1.0, F32), logical_axes=("ratio", "compress"))
        self.norm = RMSNorm(head_dim, cfg.norm_eps, "head_dim", rngs=rngs)

    def project(self, x, positions, proj=None):
        """x [B, T, D] -> (a, z) [B, T, coff*K] f32; z includes ape[t mod m]. Run in f32 (official). proj: the
        two projections, computed by the caller."""
        xf = x.astype(F32)
        a, g = proj if proj is not None else (L.linear(xf, self.wkv.weight[...].astype(F32)),
                                              L.linear(xf, self.wgate.weight[...].astype(F32)))
        return a, g + self.ape[...][positions % self.ratio]

    def finish(self, pooled, cos, sin, dtype):
        """Pooled windows [..., K] f32 -> entries: RMS norm (after a cast to the activation dtype), RoPE."""
        c = self.norm(pooled.astype(dtype))
        return L.apply_rope(c, cos, sin)


class Indexer(nnx.Module):
    """Lightning Indexer: scores sum_h w_h relu(q_h . k_s) over its own compressed keys; top-k selection."""

    def __init__(self, cfg: ModelConfig, ratio: int, *, rngs, dtype):
        self.n_heads, self.head_dim, self.topk = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
        self.wq_b = Linear(cfg.q_lora_rank, cfg.index_n_heads * cfg.index_head_dim, ("index_heads", "q_lora"),
                           rngs=rngs, dtype=dtype, fp8=True)
        self.weights_proj = Linear(cfg.dim, cfg.index_n_heads, ("index_heads", "embed"), rngs=rngs, dtype=dtype)
        self.compressor = Compressor(cfg, ratio, cfg.index_head_dim, overlap=True, rngs=rngs, dtype=dtype)

    def queries(self, qr, cos, sin, opts: RunOptions, fp4_keys: bool = False):
        """qr [B, T, Q] -> indexer queries [B, T, Hi, Ki] (RoPE at the query position). Against FP4 keys
        (kv_cache_dtype="fp8") or under quant_sim, Hadamard-rotated and rounded to FP4 as the release scores."""
        q = self.wq_b(qr, opts).reshape(*qr.shape[:-1], self.n_heads, self.head_dim)
        q = L.apply_rope(q, cos[..., None, :], sin[..., None, :])
        if opts.quant_sim or fp4_keys:
            q = quant.fp4_roundtrip(quant.hadamard_rotate(q), 32)
        return q

    def head_weights(self, x, proj=None):
        """x [B, T, D] -> w [B, T, Hi] f32 with both scales folded in (Ki^-1/2 for q.k, Hi^-1/2 for the sum).
        proj: x @ weights_proj.T in f32, computed by the caller."""
        w = L.linear(x.astype(F32), self.weights_proj.weight[...].astype(F32)) if proj is None else proj
        return w * (self.head_dim ** -0.5) * (self.n_heads ** -0.5)

    def round_keys(self, k, opts: RunOptions, fp4_keys: bool = False):
        """Finished keys -> the keys the indexer stores: Hadamard-rotated under quant_sim (then rounded to FP4) and
        for FP4 keys (fp4_keys: rounded as the pool encodes them)."""
        if opts.quant_sim or fp4_keys:
            k = quant.hadamard_rotate(k)
        return quant.fp4_roundtrip(k, 32) if opts.quant_sim else k


def topk_mask(scores, valid, k: int):
    """Boolean [B, T, S]: the top-k valid entries per query (higher score first, then lower index)."""
    s_len = scores.shape[-1]
    kk = min(k, s_len)
    masked = jnp.where(valid, scores, -jnp.inf)
    vals, idx = jax.lax.top_k(masked, kk)
    chosen = jnp.isfinite(vals)
    onehot = jax.nn.one_hot(idx, s_len, dtype=jnp.bool_) & chosen[..., None]
    return jnp.any(onehot, axis=-2) & valid


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, *, rngs, dtype):
        self.cfg = cfg
        self.kind = cfg.layer_type(layer_id)
        self.ratio = cfg.compress_ratio(layer_id)
        self.inv_freq = tuple(float(f) for f in L.rope_inv_freq(cfg, self.kind))
        h, k = cfg.n_heads, cfg.head_dim
        self.wq_a = Linear(cfg.dim, cfg.q_lora_rank, ("q_lora", "embed"), rngs=rngs, dtype=dtype, fp8=True)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.norm_eps, "q_lora", rngs=rngs)
        self.wq_b = Linear(cfg.q_lora_rank, h * k, ("heads", "q_lora"), rngs=rngs, dtype=dtype, fp8=True)
        self.wkv = Linear(cfg.dim, k, ("head_dim", "embed"), rngs=rngs, dtype=dtype, fp8=True)
        self.kv_norm = RMSNorm(k, cfg.norm_eps, "head_dim", rngs=rngs)
        # wo_a is dequantized to bf16 by the official converter: a plain grouped einsum, no input rounding.
        self.wo_a = Linear(h * k // cfg.o_groups, cfg.o_groups * cfg.o_lora_rank, ("o_lora", "group_heads"),
                           rngs=rngs, dtype=dtype, release_fp8=True)
        self.wo_b = Linear(cfg.o_groups * cfg.o_lora_rank, cfg.dim, ("embed", "o_lora"), rngs=rngs, dtype=dtype,
                           fp8=True)
        self.attn_sink = nnx.Param(init_normal(rngs, (h,), 1.0, F32), logical_axes=("heads",))
        self.compressor = (Compressor(cfg, self.ratio, k, overlap=self.kind == CSA, rngs=rngs, dtype=dtype)
                           if self.kind != SLIDING else None)
        self.indexer = Indexer(cfg, self.ratio, rngs=rngs, dtype=dtype) if self.kind == CSA else None

    # -- pieces shared with the cached engine path --
    def rope(self, positions):
        return L.rope_cos_sin(self.inv_freq, positions)

    def queries(self, x, cos, sin, opts: RunOptions, qa=None):
        """x [B, T, D] -> (q [B, T, H, K], qr [B, T, Q]): low-rank q, unweighted per-head RMS norm, RoPE. qa: wq_a's
        output, computed by the caller."""
        cfg = self.cfg
        qr = self.q_norm(self.wq_a(x, opts) if qa is None else qa)
        q = self.wq_b(qr, opts).reshape(*x.shape[:-1], cfg.n_heads, cfg.head_dim)
        q = L.rms_norm(q, None, cfg.norm_eps)
        return L.apply_rope(q, cos[..., None, :], sin[..., None, :]), qr

    def window_kv(self, x, cos, sin, opts: RunOptions, proj=None):
        """x [B, T, D] -> the shared key/value [B, T, K] of each token. proj: wkv's output, computed by the
        caller."""
        kv = L.apply_rope(self.kv_norm(self.wkv(x, opts) if proj is None else proj), cos, sin)
        return self.kv_round(kv, opts)

    def kv_round(self, kv, opts: RunOptions):
        if not opts.quant_sim:
            return kv
        nope = self.cfg.nope_head_dim
        return jnp.concatenate([quant.fp8_roundtrip(kv[..., :nope], 64), kv[..., nope:]], axis=-1)

    def output(self, o, cos, sin, opts: RunOptions, sums: bool = False):
        """o [B, T, H, K] -> [B, T, D]: inverse RoPE at the query position, grouped low-rank projection (sums: may
        come as L.Sums, for the ops table's hc_post)."""
        cfg = self.cfg
        o = L.apply_rope(o, cos[..., None, :], sin[..., None, :], inverse=True)
        g = cfg.o_groups
        o = o.reshape(*o.shape[:-2], g, -1)  # [B, T, G, (H/G)*K]
        u = self.wo_a(o, opts, groups=g)  # [B, T, G, R]
        return self.wo_b(u.reshape(*u.shape[:-2], -1), opts, sums=sums)

    # -- the full-sequence forward (no cache): dense masks, the reference for every cached path --
    def __call__(self, x, positions, opts: RunOptions):
        """Returns (out [B, T, D], indexer aux (logp, target) [B, T, S] on CSA layers when opts.indexer_aux
        else None)."""
        cfg = self.cfg
        cos, sin = self.rope(positions)
        q, qr = self.queries(x, cos, sin, opts)
        kv = self.as_cached("swa", self.window_kv(x, cos, sin, opts), opts)
        pos_q = positions[:, :, None]
        pos_k = positions[:, None, :]
        keys, valid = kv, (pos_k <= pos_q) & (pos_k > pos_q - cfg.window_size)
        aux = None
        if self.compressor is not None:
            entries = self._compressed_entries(self.compressor, x, positions, opts)
            n = entries.shape[1]
            causal = jnp.arange(n)[None, None, :] < ((positions + 1) // self.ratio)[:, :, None]  # [B, T, n]
            keys = jnp.concatenate([kv, entries.astype(kv.dtype)], axis=1)
            if self.indexer is not None and n > 0:
                ikeys = self._compressed_entries(self.indexer.compressor, x, positions, opts)
                iq = self.indexer.queries(qr, cos, sin, opts, fp4_keys=opts.cache_dtype == "fp8")
                scores = L.index_scores(iq, self.indexer.head_weights(x), ikeys)
                if opts.indexer_aux:
                    aux = self._indexer_aux(q, keys, jnp.concatenate([valid, causal], -1), scores, causal)
                causal = topk_mask(scores, causal, cfg.index_topk)
            if opts.drop_compressed:
                causal = jnp.zeros_like(causal)
            valid = jnp.concatenate([valid, causal], axis=-1)
        o, _ = L.attend(q, keys, valid, None, None, self.attn_sink[...], cfg.head_dim ** -0.5)
        return self.output(o.astype(q.dtype), cos, sin, opts), aux

    # -- the cached path: read and write the pools through row ids (v4jax.cache) --
    def cached(self, x, meta, pool, li, ops: Ops, opts: RunOptions):
        """x [B, T, D] for the tokens of `meta`; `pool` is this layer's stack of pools (every array [n, ...]) and
        li this layer's index in it. Returns (out [B, T, D], pool with this step's writes)."""
        pos = meta.positions
        cos, sin = self.rope(pos)
        fp8 = pool.swa.dtype == jnp.uint8  # kv_cache_dtype="fp8": the pools hold bytes (init_pools)
        pre = self._input_projections(x, ops, opts)
        q, qr = self.queries(x, cos, sin, opts, pre.get("wq_a"))
        kv = self.window_kv(x, cos, sin, opts, pre.get("wkv"))
        r_swa = pool.swa.shape[1]
        # pool -> (rows of one layer [B, E] (-1 = none), values [B, E, K]): what the step stores
        writes = {"swa": (jnp.where(meta.swa_write < r_swa, meta.swa_write, -1), kv)}
        reads = {"win_rows": meta.win_rows, "win_pos": meta.win_pos, "pos": pos}
        states = {}
        if self.compressor is not None:
            rows = meta.entry_rows[self.ratio]  # [B, S] rows of entry e in one layer of the ratio's pools
            n_ready = (pos + 1) // self.ratio  # entries query t may see
            reads.update(rows=rows, n_ready=n_ready)
            writes["kv"] = self._compress(self.compressor, x, meta, pool, li, rows, "state_kv", "state_score",
                                          states, ops, opts, pre.get("compressor"), fp8)
            if self.indexer is not None:
                writes["idx"] = self._compress(self.indexer.compressor, x, meta, pool, li, rows, "idx_state_kv",
                                               "idx_state_score", states, ops, opts, pre.get("indexer compressor"),
                                               fp8)
                reads.update(iq=self.indexer.queries(qr, cos, sin, opts, fp4_keys=fp8),
                             w=self.indexer.head_weights(x, pre.get("weights_proj")))
        pools = {name: getattr(pool, name) for name in writes}
        formats = self.entry_formats() if fp8 else {}
        o, pools = self._attend_pools(q, pools, writes, reads, li, ops, opts.mesh_rules, meta.slot is None,
                                      {name: f for name, f in formats.items() if name in pools},
                                      pool.hot_rows() if "idx" in pools else None)
        hot = pools.pop("hot", None)  # the offload state (attention_core with hot)
        if hot is not None:
            pools.update({field: hot[name] for name, field in HOT_FIELDS.items()})
        out = self.output(o.astype(q.dtype), cos, sin, opts, sums=True)  # for ops.hc_post
        return out, dataclasses.replace(pool, **pools, **states)

    def entry_formats(self) -> dict:
        """Pool name -> the entry format it stores under kv_cache_dtype="fp8" (pallas_kernels.kv_format)."""
        cfg = self.cfg
        entry = kv_format.Fp8Entry(cfg.head_dim, cfg.rope_head_dim)
        return {"swa": entry, "kv": entry, "idx": kv_format.Fp4Key(cfg.index_head_dim)}

    def _input_projections(self, x, ops: Ops, opts: RunOptions) -> dict:
        """The projections of the attention input that the ops table runs in one launch (`Ops.project`: a decode
        step off a mesh, Pallas): "wq_a" / "wkv" in x's dtype (as Linear returns them), "compressor" / "indexer
        compressor" (wkv, wgate) and "weights_proj" in f32 (as the compressors and the indexer compute them).
        Missing names: the consumer projects x itself. Empty under quant_sim (wq_a and wkv read x rounded to FP8,
        the others x itself)."""
        if opts.quant_sim:
            return {}
        groups = {"wq_a": [self.wq_a], "wkv": [self.wkv]}
        if self.compressor is not None:
            groups["compressor"] = [self.compressor.wkv, self.compressor.wgate]
        if self.indexer is not None:
            groups["indexer compressor"] = [self.indexer.compressor.wkv, self.indexer.compressor.wgate]
            groups["weights_proj"] = [self.indexer.weights_proj]
        # the release's FP8 weights (wq_a and wkv as stored: x rounded to FP8 in the kernel) in a launch of their own
        stored = {name: ms for name, ms in groups.items() if any(m.scale is not None for m in ms)}
        groups = {name: ms for name, ms in groups.items() if name not in stored}
        pre = {}
        for launch, act_quant in ((groups, False), (stored, True)):
            if not launch:
                continue
            ms_all = [m for ms in launch.values() for m in ms]
            scales = [m.scale.get_value() for m in ms_all] if act_quant else None
            got = iter(ops.project(x, [m.weight.get_value() for m in ms_all], scales, act_quant))
            for name, ms in launch.items():
                ys = [next(got) for _ in ms]
                if all(y is not None for y in ys):
                    pre[name] = tuple(ys) if len(ys) > 1 else ys[0]
        for name in ("wq_a", "wkv"):
            if name in pre:
                pre[name] = pre[name].astype(x.dtype)
        return pre

    def _compress(self, comp: Compressor, x, meta, pool, li, rows, st_kv_name, st_sc_name, states: dict,
                  ops: Ops, opts: RunOptions, proj=None, fp8: bool = False):
        """Run a compressor over the step's tokens from the rows' states (the new states go into `states`); proj:
        its two projections of x, computed by the caller; fp8: the pools store the release's formats. Returns (pool
        rows [B, E] of the windows it closed, -1 = none; their entries, rounded as the layer stores them)."""
        st_kv, st_sc = getattr(pool, st_kv_name), getattr(pool, st_sc_name)
        if meta.slot is None and opts.mesh_rules is None:  # every slot: the ops read the layer's in the stack
            entries, ent, ok, nkv, nsc = ops.compress(comp, x, meta, L.LayerOf(st_kv, li), L.LayerOf(st_sc, li),
                                                      self.rope, proj)
        else:
            entries, ent, ok, nkv, nsc = ops.compress(comp, x, meta, _rows_of(st_kv, li, meta),
                                                      _rows_of(st_sc, li, meta), self.rope, proj)
            nkv, nsc = _set_rows(st_kv, li, meta, nkv), _set_rows(st_sc, li, meta, nsc)
        if comp is self.compressor:
            entries = self.kv_round(entries, opts)
        else:
            entries = self.indexer.round_keys(entries, opts, fp4_keys=fp8)
        pend_kv = getattr(pool, pending_of(st_kv_name))
        if pend_kv is None:
            states.update({st_kv_name: nkv, st_sc_name: nsc})
        else:  # a speculative verify step: keep the states, record the tokens' inputs (v4jax.engine.spec)
            a, z = comp.project(x, meta.positions, proj)
            pend_sc = getattr(pool, pending_of(st_sc_name))
            states.update({pending_of(st_kv_name): pend_kv.at[li].set(a),
                           pending_of(st_sc_name): pend_sc.at[li].set(z)})
        rec_kv = getattr(pool, boundary_of(st_kv_name))
        if rec_kv is not None:  # a prefill step of the prefix cache: the previous window at each inner page boundary
            a, z = comp.project(*_before_ends(x, proj, meta, comp.ratio))
            rec_sc = getattr(pool, boundary_of(st_sc_name))
            states.update({boundary_of(st_kv_name): rec_kv.at[li].set(a),
                           boundary_of(st_sc_name): rec_sc.at[li].set(z)})
        s = rows.shape[1]
        row = jnp.take_along_axis(rows, jnp.clip(ent, 0, s - 1), axis=1)
        return jnp.where(ok & (ent >= 0) & (ent < s), row, -1), entries

    def _attend_pools(self, q, pools, writes, reads, li, ops: Ops, mesh_rules, rows_are_slots: bool, formats: dict,
                      hot: dict | None = None):
        """Store the step's writes into the pools and attend over them (`attention_core`). On a mesh this runs per
        shard: jax.shard_map manual over every mesh axis (Mosaic kernels cannot be partitioned automatically), the
        heads split over `tensor` as the rules table says, every pool's rows in the blocks its sharding gives,
        the shards' top-k and softmaxes merged (sharding/context.py). When row b is slot b (decode) the rows split
        as the slots do (over `data`): by the layout contract a slot's pages lie in its data shard's blocks, so a
        data shard attends for its own slots alone. Returns (o [B, T, H, K], pools)."""
        cfg = self.cfg
        sink = self.attn_sink[...]
        li = jnp.asarray(li, jnp.int32)
        static = dict(ops=ops, scale=cfg.head_dim ** -0.5, window=cfg.window_size, topk=cfg.index_topk,
                      formats=formats)
        if mesh_rules is None:
            blocks = {name: context.RowBlock((), a.shape[1]) for name, a in pools.items()}
            return attention_core(blocks, q, sink, pools, writes, reads, li, hot=hot, **static)
        assert hot is None, "host offload runs on one device (checked when the engine is built)"
        from jax.sharding import PartitionSpec as P
        pool_specs = {name: mesh_rules.spec(POOL_AXES[name], a.shape) for name, a in pools.items()}
        blocks = {}
        for name, a in pools.items():
            axes = context.axes_of(pool_specs[name][1])
            blocks[name] = context.RowBlock(axes, a.shape[1] // math.prod(mesh_rules.mesh.shape[x] for x in axes))
        heads = mesh_rules.spec(("heads",), sink.shape)
        rows = mesh_rules.spec(("slots",), q.shape[:1])[0] if rows_are_slots else None
        if not all(set(context.axes_of(rows)) <= set(b.axes) for b in blocks.values()):
            rows = None  # a pool held whole along the rows' axes: every shard writes every row's entries there
        q_spec = P(rows, None, heads[0], None)

        def by_row(tree):  # every read and write is [B, ...]
            return jax.tree.map(lambda _: P(rows), tree)

        core = functools.partial(attention_core, blocks, row_axes=context.axes_of(rows), **static)
        return on_shards(core, mesh_rules, (q_spec, heads, pool_specs, by_row(writes), by_row(reads), P()),
                         (q_spec, pool_specs))(q, sink, pools, writes, reads, li)

    def _indexer_aux(self, q, keys, valid_dense, scores, causal):
        """Distillation target for the indexer: each query's attention mass over the compressed entries under
        dense attention (all causal entries), summed over heads and normalised; no gradient flows into it.
        Returns (indexer log-softmax, target), both [B, T, S]."""
        s = jnp.einsum("bthk,bsk->bths", q, keys, preferred_element_type=F32) * self.cfg.head_dim ** -0.5
        p = jax.nn.softmax(jnp.where(valid_dense[:, :, None, :], s, -jnp.inf), axis=-1)
        mass = jnp.sum(p[..., -causal.shape[-1]:], axis=2)  # [B, T, S]
        target = jax.lax.stop_gradient(mass / jnp.maximum(jnp.sum(mass, -1, keepdims=True), 1e-9))
        logp = jax.nn.log_softmax(jnp.where(causal, scores, -1e30), axis=-1)
        return logp, target

    def _compressed_entries(self, comp: Compressor, x, positions, opts: RunOptions):
        """All complete windows of a sequence that starts at position 0 -> entries [B, T // m, K]."""
        a, z = comp.project(x, positions)
        pooled = L.compress_windows(a, z, comp.ratio, comp.overlap)
        n = pooled.shape[1]
        cos, sin = self.rope(jnp.arange(n) * comp.ratio)
        entries = comp.finish(pooled, cos, sin, x.dtype)
        if comp is self.compressor:
            return self.as_cached("kv", self.kv_round(entries, opts), opts)
        return self.as_cached("idx", self.indexer.round_keys(entries, opts, fp4_keys=opts.cache_dtype == "fp8"), opts)

    def as_cached(self, pool: str, values, opts: RunOptions):
        """values [..., K] as the pool `pool` ("swa", "kv", "idx") of an engine with kv_cache_dtype
        opts.cache_dtype gives them back (the teacher-forced forward: RunOptions.cache_dtype)."""
        if opts.cache_dtype is None:
            return values
        if opts.cache_dtype != "fp8":
            return values.astype(opts.cache_dtype).astype(values.dtype)
        fmt = self.entry_formats()[pool]
        flat = values.reshape(-1, values.shape[-1])
        return fmt.decode(fmt.encode(flat), values.dtype).reshape(values.shape)
