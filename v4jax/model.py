"""The DeepSeek-V4 model in Flax NNX (reference §2-§7), with a full-sequence forward and no cache.

Modules hold parameters under the official checkpoint names (`layers.3.attn.wq_a.weight` is
`model.layers[3].attn.wq_a.weight`; routed experts are stacked on a leading E axis), so loading is a
path lookup. The forward runs as a pure function: `nnx.split` once, then jit over the state.
Pieces of each layer (projections, compressor, indexer, output) are separate methods so that the engine's
cached steps reuse exactly the same maths.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from v4jax import layers as L
from v4jax import quant
from v4jax.config import CSA, HCA, SLIDING, ModelConfig

F32 = jnp.float32


class IndexerAux(nnx.Intermediate):
    """Per CSA layer: (indexer log-softmax over causal entries [B, T, S], target distribution [B, T, S])."""


class Buffer(nnx.Variable):
    """A non-trainable array that ships with the checkpoint (the hash-routing table)."""


@dataclasses.dataclass(frozen=True)
class RunOptions:
    """Static numerics switches of a forward pass."""
    quant_sim: bool = False  # the official FP8 KV / FP4 indexer / FP8 activation rounding (reference §9.1)
    attention_impl: str = "xla"  # "xla" | "pallas" (kernels in pallas_kernels/)
    # Training / evaluation only (full-sequence forward):
    indexer_aux: bool = False  # sow IndexerAux (indexer log-probs and the attention-mass target) per CSA layer
    drop_compressed: bool = False  # attend to the window only (to measure what compressed entries earn)


def _normal(rngs, shape, std, dtype):
    return (jax.random.normal(rngs.params(), shape, F32) * std).astype(dtype)


class Table(nnx.Module):
    """A [rows, D] table: the embedding or the output head."""

    def __init__(self, rows: int, d: int, std: float, *, rngs: nnx.Rngs, dtype):
        self.weight = nnx.Param(_normal(rngs, (rows, d), std, dtype))


class Linear(nnx.Module):
    """y = x @ weight.T, weight in checkpoint layout [out, in]."""

    def __init__(self, n_in: int, n_out: int, *, rngs: nnx.Rngs, dtype, fp8: bool = False):
        self.weight = nnx.Param(_normal(rngs, (n_out, n_in), n_in ** -0.5, dtype))
        self.fp8 = fp8  # an FP8/FP4 linear in the release: quant_sim rounds its input (1x128 blocks)

    def __call__(self, x, opts: RunOptions | None = None):
        if opts is not None and opts.quant_sim and self.fp8:
            x = quant.fp8_roundtrip(x, 128)
        return L.linear(x, self.weight[...])


def _rows_of(state, meta):
    """The step's rows of a per-slot state pool (meta.slot None: every slot, in order)."""
    return state if meta.slot is None else state[meta.slot]


def _set_rows(state, meta, new):
    return new if meta.slot is None else state.at[meta.slot].set(new)


class RMSNorm(nnx.Module):
    def __init__(self, n: int, eps: float, *, rngs: nnx.Rngs):
        self.weight = nnx.Param(jnp.ones((n,), F32))
        self.eps = eps

    def __call__(self, x):
        return L.rms_norm(x, self.weight[...], self.eps)


class Compressor(nnx.Module):
    """Softmax-gated pooling of each window of `ratio` tokens into one entry (overlapping for CSA)."""

    def __init__(self, cfg: ModelConfig, ratio: int, head_dim: int, overlap: bool, *, rngs, dtype):
        coff = 2 if overlap else 1
        self.ratio, self.head_dim, self.overlap = ratio, head_dim, overlap
        self.wkv = Linear(cfg.dim, coff * head_dim, rngs=rngs, dtype=dtype)
        self.wgate = Linear(cfg.dim, coff * head_dim, rngs=rngs, dtype=dtype)
        self.ape = nnx.Param(_normal(rngs, (ratio, coff * head_dim), 1.0, F32))
        self.norm = RMSNorm(head_dim, cfg.norm_eps, rngs=rngs)

    def project(self, x, positions):
        """x [B, T, D] -> (a, z) [B, T, coff*K] f32; z includes ape[t mod m]. Run in f32 (official)."""
        xf = x.astype(F32)
        a = L.linear(xf, self.wkv.weight[...].astype(F32))
        z = L.linear(xf, self.wgate.weight[...].astype(F32)) + self.ape[...][positions % self.ratio]
        return a, z

    def finish(self, pooled, cos, sin, dtype):
        """Pooled windows [..., K] f32 -> entries: RMS norm (after a cast to the activation dtype), RoPE."""
        c = self.norm(pooled.astype(dtype))
        return L.apply_rope(c, cos, sin)


class Indexer(nnx.Module):
    """Lightning Indexer: scores sum_h w_h relu(q_h . k_s) over its own compressed keys; top-k selection."""

    def __init__(self, cfg: ModelConfig, ratio: int, *, rngs, dtype):
        self.n_heads, self.head_dim, self.topk = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
        self.wq_b = Linear(cfg.q_lora_rank, cfg.index_n_heads * cfg.index_head_dim, rngs=rngs, dtype=dtype, fp8=True)
        self.weights_proj = Linear(cfg.dim, cfg.index_n_heads, rngs=rngs, dtype=dtype)
        self.compressor = Compressor(cfg, ratio, cfg.index_head_dim, overlap=True, rngs=rngs, dtype=dtype)

    def queries(self, qr, cos, sin, opts: RunOptions):
        """qr [B, T, Q] -> indexer queries [B, T, Hi, Ki] (RoPE at the query position)."""
        q = self.wq_b(qr, opts).reshape(*qr.shape[:-1], self.n_heads, self.head_dim)
        q = L.apply_rope(q, cos[..., None, :], sin[..., None, :])
        if opts.quant_sim:
            q = quant.fp4_roundtrip(quant.hadamard_rotate(q), 32)
        return q

    def head_weights(self, x):
        """x [B, T, D] -> w [B, T, Hi] f32 with both scales folded in (Ki^-1/2 for q.k, Hi^-1/2 for the sum)."""
        w = L.linear(x.astype(F32), self.weights_proj.weight[...].astype(F32))
        return w * (self.head_dim ** -0.5) * (self.n_heads ** -0.5)

    def finish_keys(self, pooled, cos, sin, dtype, opts: RunOptions):
        return self.round_keys(self.compressor.finish(pooled, cos, sin, dtype), opts)

    def round_keys(self, k, opts: RunOptions):
        """Finished keys -> the keys the indexer stores (quant_sim: Hadamard rotation, FP4 rounding)."""
        if opts.quant_sim:
            k = quant.fp4_roundtrip(quant.hadamard_rotate(k), 32)
        return k


def index_scores(q, w, keys):
    """q [B, T, Hi, Ki], w [B, T, Hi], keys [B, S, Ki] -> [B, T, S] f32."""
    s = jnp.einsum("bthk,bsk->bths", q, keys.astype(q.dtype), preferred_element_type=F32)
    return jnp.einsum("bths,bth->bts", jax.nn.relu(s), w)


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
        self.wq_a = Linear(cfg.dim, cfg.q_lora_rank, rngs=rngs, dtype=dtype, fp8=True)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.norm_eps, rngs=rngs)
        self.wq_b = Linear(cfg.q_lora_rank, h * k, rngs=rngs, dtype=dtype, fp8=True)
        self.wkv = Linear(cfg.dim, k, rngs=rngs, dtype=dtype, fp8=True)
        self.kv_norm = RMSNorm(k, cfg.norm_eps, rngs=rngs)
        # wo_a is dequantized to bf16 by the official converter: a plain grouped einsum, no input rounding.
        self.wo_a = Linear(h * k // cfg.o_groups, cfg.o_groups * cfg.o_lora_rank, rngs=rngs, dtype=dtype)
        self.wo_b = Linear(cfg.o_groups * cfg.o_lora_rank, cfg.dim, rngs=rngs, dtype=dtype, fp8=True)
        self.attn_sink = nnx.Param(_normal(rngs, (h,), 1.0, F32))
        self.compressor = (Compressor(cfg, self.ratio, k, overlap=self.kind == CSA, rngs=rngs, dtype=dtype)
                           if self.kind != SLIDING else None)
        self.indexer = Indexer(cfg, self.ratio, rngs=rngs, dtype=dtype) if self.kind == CSA else None

    # -- pieces shared with the cached engine path --
    def rope(self, positions):
        return L.rope_cos_sin(self.inv_freq, positions)

    def queries(self, x, cos, sin, opts: RunOptions):
        """x [B, T, D] -> (q [B, T, H, K], qr [B, T, Q]): low-rank q, unweighted per-head RMS norm, RoPE."""
        cfg = self.cfg
        qr = self.q_norm(self.wq_a(x, opts))
        q = self.wq_b(qr, opts).reshape(*x.shape[:-1], cfg.n_heads, cfg.head_dim)
        q = L.rms_norm(q, None, cfg.norm_eps)
        return L.apply_rope(q, cos[..., None, :], sin[..., None, :]), qr

    def window_kv(self, x, cos, sin, opts: RunOptions):
        """x [B, T, D] -> the shared key/value [B, T, K] of each token."""
        kv = L.apply_rope(self.kv_norm(self.wkv(x, opts)), cos, sin)
        return self.kv_round(kv, opts)

    def kv_round(self, kv, opts: RunOptions):
        if not opts.quant_sim:
            return kv
        nope = self.cfg.nope_head_dim
        return jnp.concatenate([quant.fp8_roundtrip(kv[..., :nope], 64), kv[..., nope:]], axis=-1)

    def output(self, o, cos, sin, opts: RunOptions):
        """o [B, T, H, K] -> [B, T, D]: inverse RoPE at the query position, grouped low-rank projection."""
        cfg = self.cfg
        o = L.apply_rope(o, cos[..., None, :], sin[..., None, :], inverse=True)
        g = cfg.o_groups
        o = o.reshape(*o.shape[:-2], g, -1)  # [B, T, G, (H/G)*K]
        wo_a = self.wo_a.weight[...].reshape(g, cfg.o_lora_rank, -1).astype(o.dtype)
        u = jnp.einsum("btgi,gri->btgr", o, wo_a, preferred_element_type=F32).astype(o.dtype)
        return self.wo_b(u.reshape(*u.shape[:-2], -1), opts)

    # -- the full-sequence forward (no cache): dense masks, the reference for every cached path --
    def __call__(self, x, positions, opts: RunOptions):
        cfg = self.cfg
        b, t, _ = x.shape
        cos, sin = self.rope(positions)
        q, qr = self.queries(x, cos, sin, opts)
        kv = self.window_kv(x, cos, sin, opts)
        pos_q = positions[:, :, None]
        pos_k = positions[:, None, :]
        keys, valid = kv, (pos_k <= pos_q) & (pos_k > pos_q - cfg.window_size)
        if self.compressor is not None:
            entries = self._compressed_entries(self.compressor, x, positions, opts)
            n = entries.shape[1]
            causal = jnp.arange(n)[None, None, :] < ((positions + 1) // self.ratio)[:, :, None]  # [B, T, n]
            keys = jnp.concatenate([kv, entries.astype(kv.dtype)], axis=1)
            if self.indexer is not None and n > 0:
                ikeys = self._compressed_entries(self.indexer.compressor, x, positions, opts)
                iq = self.indexer.queries(qr, cos, sin, opts)
                scores = index_scores(iq, self.indexer.head_weights(x), ikeys)
                if opts.indexer_aux:
                    self._sow_indexer_aux(q, keys, jnp.concatenate([valid, causal], -1), scores, causal)
                causal = topk_mask(scores, causal, cfg.index_topk)
            if opts.drop_compressed:
                causal = jnp.zeros_like(causal)
            valid = jnp.concatenate([valid, causal], axis=-1)
        o = L.attend(q, keys, valid, None, None, self.attn_sink[...], cfg.head_dim ** -0.5)
        return self.output(o, cos, sin, opts)

    # -- the cached path: read and write the pools through row ids (v4jax.cache) --
    def cached(self, x, meta, pool, opts: RunOptions):
        """x [B, T, D] for the tokens of `meta`; returns (out [B, T, D], pool with this step's writes)."""
        cfg = self.cfg
        b, t, _ = x.shape
        pos = meta.positions
        cos, sin = self.rope(pos)
        q, qr = self.queries(x, cos, sin, opts)
        kv = self.window_kv(x, cos, sin, opts)
        swa = pool.swa.at[meta.swa_write.reshape(-1)].set(kv.reshape(b * t, -1).astype(pool.swa.dtype), mode="drop")
        pool = dataclasses.replace(pool, swa=swa)
        if opts.attention_impl == "pallas":
            return self._cached_pallas(x, meta, pool, q, qr, cos, sin, opts)
        win_keys = swa[jnp.maximum(meta.win_rows, 0)]  # [B, U, K]
        wp = meta.win_pos[:, None, :]
        win_valid = (meta.win_rows[:, None, :] >= 0) & (wp <= pos[:, :, None]) & (wp > pos[:, :, None] - cfg.window_size)
        sel_keys = sel_valid = None
        if self.compressor is not None:
            rows = meta.entry_rows[self.ratio]  # [B, S]
            n_ready = (pos + 1) // self.ratio  # entries query t may see
            e_valid = (jnp.arange(rows.shape[1])[None, None, :] < n_ready[:, :, None]) & (rows[:, None, :] >= 0)
            pool = self._compress_into(self.compressor, x, meta, pool, "kv", "state_kv", "state_score", opts)
            if self.indexer is not None:
                pool = self._compress_into(self.indexer.compressor, x, meta, pool, "idx", "idx_state_kv",
                                           "idx_state_score", opts)
                ikeys = pool.idx[jnp.maximum(rows, 0)]  # [B, S, Ki]
                iq = self.indexer.queries(qr, cos, sin, opts)
                scores = index_scores(iq, self.indexer.head_weights(x), ikeys)
                kk = min(cfg.index_topk, rows.shape[1])
                vals, sel = jax.lax.top_k(jnp.where(e_valid, scores, -jnp.inf), kk)  # ties: lower index first
                sel_valid = jnp.isfinite(vals)
                if opts.drop_compressed:
                    sel_valid = jnp.zeros_like(sel_valid)
                sel_rows = jnp.take_along_axis(jnp.broadcast_to(rows[:, None, :], (b, t, rows.shape[1])), sel, axis=2)
                sel_keys = pool.kv[jnp.maximum(sel_rows, 0)]  # [B, T, k, K]
            else:
                hca_valid = e_valid & (not opts.drop_compressed)
                win_keys = jnp.concatenate([win_keys, pool.kv[jnp.maximum(rows, 0)]], axis=1)
                win_valid = jnp.concatenate([win_valid, hca_valid], axis=-1)
        o = L.attend(q, win_keys.astype(q.dtype), win_valid,
                         None if sel_keys is None else sel_keys.astype(q.dtype), sel_valid,
                         self.attn_sink[...], cfg.head_dim ** -0.5)
        return self.output(o, cos, sin, opts), pool

    def _cached_pallas(self, x, meta, pool, q, qr, cos, sin, opts: RunOptions):
        """The same step through pallas_kernels: per-query row lists, gathered inside the kernels."""
        from pallas_kernels import indexer_topk, sparse_attention
        cfg = self.cfg
        b, t, _ = x.shape
        pos = meta.positions
        # Query t's window is win_rows[t : t + W] (win_pos starts at start - W + 1).
        swa_rows = jnp.take_along_axis(
            jnp.broadcast_to(meta.win_rows[:, None, :], (b, t, meta.win_rows.shape[1])),
            jnp.arange(t)[None, :, None] + jnp.arange(cfg.window_size)[None, None, :], axis=2)
        cmp_rows = None
        if self.compressor is not None:
            rows = meta.entry_rows[self.ratio]
            n_ready = (pos + 1) // self.ratio
            pool = self._compress_into_pallas(self.compressor, x, meta, pool, "kv", "state_kv", "state_score",
                                              opts)
            if self.indexer is not None:
                pool = self._compress_into_pallas(self.indexer.compressor, x, meta, pool, "idx", "idx_state_kv",
                                                  "idx_state_score", opts)
                iq = self.indexer.queries(qr, cos, sin, opts)
                sel = indexer_topk(iq, self.indexer.head_weights(x), pool.idx, rows, n_ready, cfg.index_topk,
                                   impl="pallas")
                cmp_rows = jnp.where(sel >= 0, jnp.take_along_axis(
                    jnp.broadcast_to(rows[:, None, :], (b, t, rows.shape[1])), jnp.maximum(sel, 0), axis=2), -1)
            else:
                e = jnp.arange(rows.shape[1])[None, None, :]
                cmp_rows = jnp.where(e < n_ready[:, :, None], rows[:, None, :], -1)
        o = sparse_attention(q, pool.swa, swa_rows, None if cmp_rows is None else pool.kv, cmp_rows,
                             self.attn_sink[...], scale=cfg.head_dim ** -0.5)
        return self.output(o.astype(q.dtype), cos, sin, opts), pool

    def _compress_into(self, comp: Compressor, x, meta, pool, pool_name, st_kv_name, st_sc_name, opts):
        """Run a compressor over the step's tokens from the slot's state; store closed windows' entries."""
        a, z = comp.project(x, meta.positions)
        st_kv = getattr(pool, st_kv_name)
        st_sc = getattr(pool, st_sc_name)
        pooled, ent, ok, nkv, nsc = L.compress_chunk(_rows_of(st_kv, meta), _rows_of(st_sc, meta), a, z,
                                                      meta.start, meta.n_valid, meta.fresh, comp.ratio, comp.overlap)
        cos, sin = self.rope(ent * comp.ratio)
        pooled = jnp.where(ok[..., None], pooled, 0.0)
        if comp is self.compressor:
            entries = self.kv_round(comp.finish(pooled, cos, sin, x.dtype), opts)
        else:
            entries = self.indexer.finish_keys(pooled, cos, sin, x.dtype, opts)
        return self._store(comp, meta, pool, pool_name, st_kv_name, st_sc_name, entries, ent, ok, nkv, nsc)

    def _compress_into_pallas(self, comp: Compressor, x, meta, pool, pool_name, st_kv_name, st_sc_name, opts):
        """`_compress_into` through pallas_kernels.compressor: the decode kernel for one token per slot, the
        prefill kernel for a chunk; entries rounded to the activation dtype where the XLA path rounds them."""
        from pallas_kernels import compressor as pallas_compressor
        t = x.shape[1]
        m = comp.ratio
        st_kv = getattr(pool, st_kv_name)
        st_sc = getattr(pool, st_sc_name)
        # The kernels resume from the state they are given; a slot that starts a new request starts empty.
        fresh = meta.fresh[:, None, None]
        kv0 = jnp.where(fresh, 0.0, _rows_of(st_kv, meta))
        sc0 = jnp.where(fresh, -jnp.inf, _rows_of(st_sc, meta))
        weights = (comp.wkv.weight[...], comp.wgate.weight[...], comp.ape[...], comp.norm.weight[...])
        static = dict(ratio=m, overlap=comp.overlap, eps=comp.norm.eps, entry_dtype=x.dtype)
        if t == 1:
            pos = jnp.where(meta.n_valid > 0, meta.start, -1)  # < 0: padding slot, its state is left alone
            entry, emitted, nkv, nsc = pallas_compressor.compressor_decode(
                x[:, 0], pos, kv0, sc0, *weights, self.rope(pos + 1 - m), **static)
            entries, ent, ok = entry[:, None], (pos // m)[:, None], emitted[:, None]
        else:
            cos, sin = self.rope(pallas_compressor.prefill_entry_positions(meta.start, t, m))
            entries, n_emitted, first, nkv, nsc = pallas_compressor.compressor_prefill(
                x, meta.start, meta.n_valid, kv0, sc0, *weights, cos, sin, **static)
            i = jnp.arange(entries.shape[1])[None, :]
            ent, ok = first[:, None] + i, i < n_emitted[:, None]
        entries = entries.astype(x.dtype)
        if comp is self.compressor:
            entries = self.kv_round(entries, opts)
        else:
            entries = self.indexer.round_keys(entries, opts)
        return self._store(comp, meta, pool, pool_name, st_kv_name, st_sc_name, entries, ent, ok, nkv, nsc)

    def _store(self, comp: Compressor, meta, pool, pool_name, st_kv_name, st_sc_name, entries, ent, ok, nkv, nsc):
        """Scatter finished entries [B, E, K] (entry index ent [B, E], ok: emitted) into their pool rows and the
        slots' new compressor states into the state pools."""
        rows_all = meta.entry_rows[comp.ratio]
        target = getattr(pool, pool_name)
        row = jnp.take_along_axis(rows_all, jnp.clip(ent, 0, rows_all.shape[1] - 1), axis=1)
        row = jnp.where(ok & (ent < rows_all.shape[1]) & (row >= 0), row, target.shape[0])
        target = target.at[row.reshape(-1)].set(entries.reshape(-1, entries.shape[-1]).astype(target.dtype),
                                                mode="drop")
        st_kv = getattr(pool, st_kv_name)
        st_sc = getattr(pool, st_sc_name)
        return dataclasses.replace(pool, **{pool_name: target, st_kv_name: _set_rows(st_kv, meta, nkv),
                                            st_sc_name: _set_rows(st_sc, meta, nsc)})

    def _sow_indexer_aux(self, q, keys, valid_dense, scores, causal):
        """Distillation target for the indexer: each query's attention mass over the compressed entries under
        dense attention (all causal entries), summed over heads and normalised; no gradient flows into it."""
        s = jnp.einsum("bthk,bsk->bths", q, keys, preferred_element_type=F32) * self.cfg.head_dim ** -0.5
        p = jax.nn.softmax(jnp.where(valid_dense[:, :, None, :], s, -jnp.inf), axis=-1)
        mass = jnp.sum(p[..., -causal.shape[-1]:], axis=2)  # [B, T, S]
        target = jax.lax.stop_gradient(mass / jnp.maximum(jnp.sum(mass, -1, keepdims=True), 1e-9))
        logp = jax.nn.log_softmax(jnp.where(causal, scores, -1e30), axis=-1)
        # not "indexer": that is the submodule. One tuple entry per call, as Module.sow kept them.
        prev = getattr(self, "indexer_aux", None)
        if isinstance(prev, IndexerAux):
            prev.set_value(prev.get_value() + ((logp, target),))
        else:
            self.indexer_aux = IndexerAux(((logp, target),))

    def _compressed_entries(self, comp: Compressor, x, positions, opts: RunOptions):
        """All complete windows of a sequence that starts at position 0 -> entries [B, T // m, K]."""
        a, z = comp.project(x, positions)
        pooled = L.compress_windows(a, z, comp.ratio, comp.overlap)
        n = pooled.shape[1]
        cos, sin = self.rope(jnp.arange(n) * comp.ratio)
        if comp is self.compressor:
            return self.kv_round(comp.finish(pooled, cos, sin, x.dtype), opts)
        return self.indexer.finish_keys(pooled, cos, sin, x.dtype, opts)


class Gate(nnx.Module):
    def __init__(self, cfg: ModelConfig, hashed: bool, *, rngs, dtype):
        self.weight = nnx.Param(_normal(rngs, (cfg.n_routed_experts, cfg.dim), cfg.dim ** -0.5, dtype))
        if hashed:
            keys = jax.random.split(rngs.params(), cfg.vocab_size)
            perm = jax.vmap(lambda k: jax.random.permutation(k, cfg.n_routed_experts)[: cfg.n_activated_experts])(keys)
            self.tid2eid, self.bias = Buffer(perm.astype(jnp.int32)), None
        else:
            self.tid2eid, self.bias = None, nnx.Param(_normal(rngs, (cfg.n_routed_experts,), 0.1, F32))


class Experts(nnx.Module):
    """Routed experts stacked on a leading axis: w1/w3 [E, I, D] (gate/up), w2 [E, D, I] (down)."""

    def __init__(self, cfg: ModelConfig, *, rngs, dtype):
        e, i, d = cfg.n_routed_experts, cfg.moe_inter_dim, cfg.dim
        self.w1 = nnx.Param(_normal(rngs, (e, i, d), d ** -0.5, dtype))
        self.w2 = nnx.Param(_normal(rngs, (e, d, i), i ** -0.5, dtype))
        self.w3 = nnx.Param(_normal(rngs, (e, i, d), d ** -0.5, dtype))


class SharedExpert(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs, dtype):
        self.w1 = Linear(cfg.dim, cfg.moe_inter_dim, rngs=rngs, dtype=dtype, fp8=True)
        self.w2 = Linear(cfg.moe_inter_dim, cfg.dim, rngs=rngs, dtype=dtype, fp8=True)
        self.w3 = Linear(cfg.dim, cfg.moe_inter_dim, rngs=rngs, dtype=dtype, fp8=True)

    def __call__(self, x, limit, opts):
        # The current official revision clamps the shared expert too (reference §9.3).
        h = L.swiglu(self.w1(x, opts).astype(F32), self.w3(x, opts).astype(F32), limit)
        return self.w2(h.astype(x.dtype), opts)


class MoE(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, *, rngs, dtype):
        self.cfg = cfg
        self.gate = Gate(cfg, cfg.is_hash_layer(layer_id), rngs=rngs, dtype=dtype)
        self.experts = Experts(cfg, rngs=rngs, dtype=dtype)
        self.shared_experts = SharedExpert(cfg, rngs=rngs, dtype=dtype) if cfg.n_shared_experts else None

    def __call__(self, x, token_ids, opts: RunOptions):
        cfg = self.cfg
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        tid2eid = None if self.gate.tid2eid is None else self.gate.tid2eid[...]
        bias = None if self.gate.bias is None else self.gate.bias[...]
        w, idx = L.route(flat, self.gate.weight[...], bias, tid2eid, token_ids.reshape(-1), cfg)
        xin = quant.fp8_roundtrip(flat, 128) if opts.quant_sim else flat
        y = L.routed_experts(xin, w, idx, self.experts.w1[...], self.experts.w2[...], self.experts.w3[...],
                             cfg.swiglu_limit)
        if self.shared_experts is not None:
            y = y + self.shared_experts(flat, cfg.swiglu_limit, opts).astype(F32)
        return y.astype(x.dtype).reshape(shape)


class Block(nnx.Module):
    """One decoder layer: mHC around attention, mHC around the MoE."""

    def __init__(self, cfg: ModelConfig, layer_id: int, *, rngs, dtype):
        self.cfg = cfg
        n, d = cfg.hc_mult, cfg.dim
        mix = (2 + n) * n
        self.attn_norm = RMSNorm(d, cfg.norm_eps, rngs=rngs)
        self.ffn_norm = RMSNorm(d, cfg.norm_eps, rngs=rngs)
        self.hc_attn_fn = nnx.Param(_normal(rngs, (mix, n * d), (n * d) ** -0.5, F32))
        self.hc_attn_base = nnx.Param(_normal(rngs, (mix,), 0.1, F32))
        self.hc_attn_scale = nnx.Param(jnp.ones((3,), F32))
        self.hc_ffn_fn = nnx.Param(_normal(rngs, (mix, n * d), (n * d) ** -0.5, F32))
        self.hc_ffn_base = nnx.Param(_normal(rngs, (mix,), 0.1, F32))
        self.hc_ffn_scale = nnx.Param(jnp.ones((3,), F32))
        self.attn = Attention(cfg, layer_id, rngs=rngs, dtype=dtype)
        self.ffn = MoE(cfg, layer_id, rngs=rngs, dtype=dtype)

    def hc_attn(self, x):
        return L.hc_pre(x, self.hc_attn_fn[...], self.hc_attn_base[...], self.hc_attn_scale[...], self.cfg)

    def hc_ffn(self, x):
        return L.hc_pre(x, self.hc_ffn_fn[...], self.hc_ffn_base[...], self.hc_ffn_scale[...], self.cfg)

    def ffn_part(self, x, token_ids, opts):
        u, post, comb = self.hc_ffn(x)
        return L.hc_post(self.ffn(self.ffn_norm(u), token_ids, opts), x, post, comb)

    def cached(self, x, meta, token_ids, pool, opts: RunOptions):
        u, post, comb = self.hc_attn(x)
        a, pool = self.attn.cached(self.attn_norm(u), meta, pool, opts)
        x = L.hc_post(a, x, post, comb)
        return self.ffn_part(x, token_ids, opts), pool

    def __call__(self, x, positions, token_ids, opts: RunOptions):
        u, post, comb = self.hc_attn(x)
        x = L.hc_post(self.attn(self.attn_norm(u), positions, opts), x, post, comb)
        return self.ffn_part(x, token_ids, opts)


class MTPBlock(nnx.Module):
    """Multi-token prediction (reference §7): predicts token i+2 from the main streams at i and token i+1."""

    def __init__(self, cfg: ModelConfig, *, rngs, dtype):
        self.cfg = cfg
        n, d = cfg.hc_mult, cfg.dim
        self.e_proj = Linear(d, d, rngs=rngs, dtype=dtype, fp8=True)
        self.h_proj = Linear(d, d, rngs=rngs, dtype=dtype, fp8=True)
        self.enorm = RMSNorm(d, cfg.norm_eps, rngs=rngs)
        self.hnorm = RMSNorm(d, cfg.norm_eps, rngs=rngs)
        self.norm = RMSNorm(d, cfg.norm_eps, rngs=rngs)
        self.hc_head_fn = nnx.Param(_normal(rngs, (n, n * d), (n * d) ** -0.5, F32))
        self.hc_head_base = nnx.Param(_normal(rngs, (n,), 0.1, F32))
        self.hc_head_scale = nnx.Param(jnp.ones((1,), F32))
        self.block = Block(cfg, cfg.n_layers, rngs=rngs, dtype=dtype)

    def streams_in(self, embedded_next, h_main, opts):
        """embedded_next [B, T, D] (embedding of token i+1), h_main [B, T, N, D] -> MTP input streams."""
        e = self.e_proj(self.enorm(embedded_next), opts)
        h = self.h_proj(self.hnorm(h_main), opts)
        return (e[:, :, None, :] + h).astype(h_main.dtype)

    def collapse(self, x):
        y = L.hc_head(x, self.hc_head_fn[...], self.hc_head_base[...], self.hc_head_scale[...], self.cfg)
        return self.norm(y)


class Transformer(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, dtype=jnp.bfloat16, mtp: bool = True):
        self.cfg = cfg
        n, d = cfg.hc_mult, cfg.dim
        self.embed = Table(cfg.vocab_size, d, 1.0, rngs=rngs, dtype=dtype)
        self.layers = nnx.List([Block(cfg, i, rngs=rngs, dtype=dtype) for i in range(cfg.n_layers)])
        self.norm = RMSNorm(d, cfg.norm_eps, rngs=rngs)
        self.hc_head_fn = nnx.Param(_normal(rngs, (n, n * d), (n * d) ** -0.5, F32))
        self.hc_head_base = nnx.Param(_normal(rngs, (n,), 0.1, F32))
        self.hc_head_scale = nnx.Param(jnp.ones((1,), F32))
        self.head = Table(cfg.vocab_size, d, d ** -0.5, rngs=rngs, dtype=dtype)
        self.mtp = nnx.List([MTPBlock(cfg, rngs=rngs, dtype=dtype) for _ in range(cfg.n_mtp_layers if mtp else 0)])

    @property
    def dtype(self):
        return self.embed.weight.dtype

    def embed_streams(self, token_ids):
        e = self.embed.weight[...][token_ids]
        return jnp.broadcast_to(e[..., None, :], (*e.shape[:-1], self.cfg.hc_mult, e.shape[-1]))

    def logits_from_streams(self, x):
        y = L.hc_head(x, self.hc_head_fn[...], self.hc_head_base[...], self.hc_head_scale[...], self.cfg)
        return self.head_logits(self.norm(y))

    def head_logits(self, y):
        # The official head runs in f32; bf16 x bf16 products are exact in f32, so f32 accumulation of the
        # native-dtype operands is the same maths without materialising an f32 copy of the head (measured:
        # XLA hoisted a 2.1 GB f32 head out of the decode loop and read it every step).
        return jnp.einsum("...d,vd->...v", y, self.head.weight[...].astype(y.dtype), preferred_element_type=F32)

    def __call__(self, token_ids, opts: RunOptions = RunOptions(), return_streams: bool = False):
        """Full-sequence forward from position 0, no cache. token_ids [B, T] -> logits [B, T, V] f32."""
        b, t = token_ids.shape
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        x = self.embed_streams(token_ids)
        for layer in self.layers:
            x = layer(x, positions, token_ids, opts)
        logits = self.logits_from_streams(x)
        return (logits, x) if return_streams else logits

    def cached(self, token_ids, meta, pools, opts: RunOptions = RunOptions()):
        """One step over the pools: token_ids [B, T] at meta's positions. Returns (logits [B, V] f32 of each
        row's last valid token, pools with the step's writes)."""
        x = self.embed_streams(token_ids)
        new_layers = []
        for layer, pool in zip(self.layers, pools.layers):
            x, pool = layer.cached(x, meta, token_ids, pool, opts)
            new_layers.append(pool)
        last = jnp.maximum(meta.n_valid - 1, 0)
        x_last = jnp.take_along_axis(x, last[:, None, None, None], axis=1)[:, 0]
        return self.logits_from_streams(x_last), dataclasses.replace(pools, layers=tuple(new_layers))

    def mtp_logits(self, streams, token_ids, opts: RunOptions = RunOptions()):
        """MTP head over a full sequence: position i sees the main streams at i and token i+1 and predicts
        token i+2. Returns [B, T-1, V] for positions 0..T-2."""
        mtp = self.mtp[0]
        b, t = token_ids.shape
        positions = jnp.broadcast_to(jnp.arange(t - 1, dtype=jnp.int32), (b, t - 1))
        e = self.embed.weight[...][token_ids[:, 1:]]
        x = mtp.streams_in(e, streams[:, :-1], opts)
        x = mtp.block(x, positions, token_ids[:, 1:], opts)
        return self.head_logits(mtp.collapse(x))
