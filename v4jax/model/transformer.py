"""The DeepSeek-V4 model in Flax NNX (reference §2-§7): a full-sequence forward (the reference) and the cached
step over the pools (v4jax.cache).

The main layers are held in stacks (`config.layer_stacks`): layers of one shape (type, ratio, router kind) have
their parameters stacked on a leading axis, `model.stacks[g]` is one Block whose every parameter is [n_g, ...],
and official layer N is index i of stack g (`layers.3.attn.wq_a.weight` is `model.stacks[g].attn.wq_a.weight[i]`;
routed experts are stacked on a further E axis). Both forwards run the layers as `lax.scan`s over periodic runs
of the pattern (Flash: 3 unrolled layers, then one scan of [HCA, CSA] x 20), so a program's size and its compile
time do not grow with depth. The forward runs as a pure function: `nnx.split` once, then jit over the state.
Pieces of each layer (projections, compressor, indexer, output) are separate methods so that the engine's
cached steps reuse exactly the same maths. On a mesh the cached path's pool writes and attention run per shard
(`attention_core` under jax.shard_map): each shard holds a block of the compressed pools' rows (context
parallelism), and the shards' indexer top-k and partial softmaxes are merged by sharding/context.py. The routed
experts run per shard too, and so do the other entries of a Pallas ops table (`mesh_ops`).

How the layers are run was chosen by measurement (CPU, 2 cores, JAX 0.10.2, `tiny` widths at 24 layers of the Flash
pattern, batch 4): "periods" (scans over repeating periods, irregular head / tail unrolled) compiled the cached
decode step in 3.5 s and ran it in 7.6 ms; "switch" (one scan over every layer, a `lax.switch` on its stack)
compiled in 3.2 s but ran in 35 ms (every stack's pools go through the conditional each layer); the full forward
was 16.7 vs 17.5 ms. A GPU `lax.switch` also reads its branch index on the host. So the layers run as periods.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from sharding import context
from sharding.rules import POOL_AXES
from v4jax.model import layers as L
from v4jax.model import quant
from v4jax.config import CSA, SLIDING, ModelConfig, layer_stacks
from v4jax.model.layers import index_scores  # noqa: F401  (re-exported: the indexer's scores)
from v4jax.model.ops import OPS, Ops, ops_for

F32 = jnp.float32


class IndexerAux(nnx.Intermediate):
    """Per CSA stack: (indexer log-softmax over causal entries [n, B, T, S], target distribution [n, B, T, S]),
    sown by the full-sequence forward under `nnx.capture` when RunOptions.indexer_aux is set."""


class RoutingAux(nnx.Intermediate):
    """The experts each top-k-routed layer chose: "routing" per top-k stack [n, B*T, k] (stacks in order), and
    "mtp_routing" [B*T, k] from the MTP block; sown under `nnx.capture` when RunOptions.routing_aux is set."""


class Buffer(nnx.Variable):
    """A non-trainable array that ships with the checkpoint (the hash-routing table)."""


@dataclasses.dataclass(frozen=True)
class RunOptions:
    """Static numerics switches of a forward pass."""
    quant_sim: bool = False  # the official FP8 KV / FP4 indexer / FP8 activation rounding (reference §9.1)
    attention_impl: str = "xla"  # "xla" | "pallas": the ops table of the cached path (v4jax.model.ops)
    # sharding.MeshRules (mesh + logical-axis table) when the model runs on a mesh: the MoE's routed experts and
    # the Pallas calls run per shard (shard_map) and the steps replicate what the host reads; None = one device
    mesh_rules: Any = None
    # Training / evaluation only (full-sequence forward):
    indexer_aux: bool = False  # sow IndexerAux (indexer log-probs and the attention-mass target) per CSA stack
    routing_aux: bool = False  # sow RoutingAux (the experts of every top-k-routed layer)
    drop_compressed: bool = False  # attend to the window only (to measure what compressed entries earn)


# Logical axes of parameters shared by several modules (sharding/rules.py maps names to mesh axes).
EXPERT_UP_AXES = ("experts", "mlp", "embed")  # routed w1 / w3 [E, I, D]
EXPERT_DOWN_AXES = ("experts", "embed", "mlp")  # routed w2 [E, D, I]
HC_FN_AXES = ("hc_mix", "hc_embed")  # mHC mixing weights [(2 + N) N or N, N D]


def _normal(rngs, shape, std, dtype):
    return (jax.random.normal(rngs.params(), shape, F32) * std).astype(dtype)


class Table(nnx.Module):
    """A [rows, D] table: the embedding or the output head."""

    def __init__(self, rows: int, d: int, std: float, *, rngs: nnx.Rngs, dtype):
        self.weight = nnx.Param(_normal(rngs, (rows, d), std, dtype), logical_axes=("vocab", "embed"))


class Linear(nnx.Module):
    """y = x @ weight.T, weight in checkpoint layout [out, in]."""

    def __init__(self, n_in: int, n_out: int, axes: tuple[str, str], *, rngs: nnx.Rngs, dtype, fp8: bool = False):
        # axes: logical names of (out, in), mapped to mesh axes by sharding/rules.py
        self.weight = nnx.Param(_normal(rngs, (n_out, n_in), n_in ** -0.5, dtype), logical_axes=tuple(axes))
        self.fp8 = fp8  # an FP8/FP4 linear in the release: quant_sim rounds its input (1x128 blocks)

    def __call__(self, x, opts: RunOptions | None = None, groups: int = 1):
        """groups > 1: the grouped form of L.linear (x [..., G, in])."""
        if opts is not None and opts.quant_sim and self.fp8:
            x = quant.fp8_roundtrip(x, 128)
        w = self.weight.get_value()
        if isinstance(w, L.LayerOf):  # inside the layer loop, off a mesh
            return ops_for((opts or RunOptions()).attention_impl).linear(x, w.stack, w.index, groups)
        return L.linear(x, self.weight[...], groups)


_EXPERT_WEIGHTS = {("ffn", "experts", w) for w in ("w1", "w2", "w3")}


def _is_expert_weight(path) -> bool:
    """A Block state's key path (..., "ffn", "experts", "w1" | "w2" | "w3", .value): a routed expert weight."""
    return tuple(getattr(k, "key", None) for k in path[-4:-1]) in _EXPERT_WEIGHTS


def _layer_of(path, stack, li, on_mesh: bool):
    """What layer li of a Block state's leaf is inside the layer loop. The routed experts' weights stay whole (the
    MoE reads layer li's own) and, off a mesh, a Linear's weight [n, O, D] becomes L.LayerOf (the ops table's
    `linear` reads it in place): on the H200 a slice fed to a kernel or a matmul that cannot fuse it is a copy
    every step (all experts of a layer: 2.1 ms of a 4.8 ms flash-slice step at batch 32). The rest is sliced (on a
    mesh the projections are XLA's, partitioned by the rules, and the weights enter shard_maps as arrays)."""
    if _is_expert_weight(path):
        return stack
    if not on_mesh and getattr(path[-2], "key", None) == "weight" and stack.ndim == 3:
        return L.LayerOf(stack, li)
    return L.layer_slice(stack, li)


def _rows_of(state, li, meta):
    """The step's rows of layer li's per-slot state [n, slots, ...] (meta.slot None: every slot, in order)."""
    return L.layer_slice(state, li) if meta.slot is None else state[li, meta.slot]


def _set_rows(state, li, meta, new):
    return state.at[li].set(new) if meta.slot is None else state.at[li, meta.slot].set(new)


def _flat(pool):
    """A stacked pool [n, R, K] as the flat rows [n * R, K] of all its layers (a free reshape)."""
    return pool.reshape(-1, pool.shape[-1])


def on_shards(fn, mesh_rules, in_specs, out_specs):
    """fn over each shard's blocks of its arguments (in_specs, out_specs: PartitionSpecs, pytree prefixes):
    jax.shard_map manual over every mesh axis, as Pallas calls run on a mesh (Mosaic cannot be partitioned
    automatically)."""
    return jax.shard_map(fn, mesh=mesh_rules.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)


def mesh_ops(ops: Ops, mesh_rules, rows_are_slots: bool) -> Ops:
    """The ops table of a step on a mesh. The experts run per shard on the shard's experts (routed_experts); a
    table of Pallas calls (ops.per_shard) also runs compress and sinkhorn per shard, on the step's rows: split as
    the slots are (over `data`) when row b is slot b, whole on every shard otherwise. select and attend run
    inside attention_core's shard_map (Attention._attend_pools)."""
    from jax.sharding import PartitionSpec as P
    experts = functools.partial(routed_experts, ops=ops, mesh_rules=mesh_rules)
    if not ops.per_shard:
        return dataclasses.replace(ops, experts=experts)

    def by_row(b):  # every argument and result of compress and sinkhorn is [B, ...]
        return P(mesh_rules.spec(("slots",), (b,))[0] if rows_are_slots else None)

    def compress(comp, x, meta, st_kv, st_sc, rope, proj=None):
        # The compressor's weights are gathered whole onto every shard (wkv, wgate [coff*K, D] are split over
        # `tensor`; Flash, bf16: 21 MB a CSA layer, 8 MB an HCA layer): the kernels pool channels c and K + c
        # together, and the norm takes all K.
        graphdef, weights = nnx.split(comp)
        rows = by_row(x.shape[0])

        def local(weights, x, meta, st_kv, st_sc, proj):
            return ops.compress(nnx.merge(graphdef, weights), x, meta, st_kv, st_sc, rope, proj)

        return on_shards(local, mesh_rules, (P(), rows, rows, rows, rows, rows), rows)(weights, x, meta, st_kv,
                                                                                        st_sc, proj)

    def sinkhorn(comb, iters, eps):
        rows = by_row(comb.shape[0])
        return on_shards(lambda c: ops.sinkhorn(c, iters, eps), mesh_rules, rows, rows)(comb)

    def hc_post(f, x, post, comb):
        rows = by_row(x.shape[0])
        return on_shards(ops.hc_post, mesh_rules, rows, rows)(f, x, post, comb)

    # `project` stays: on a mesh the weights are arrays, not LayerOf, and it takes none of them
    return dataclasses.replace(ops, compress=compress, sinkhorn=sinkhorn, hc_post=hc_post, experts=experts)


def attention_core(blocks: dict, q, sink, pools: dict, writes: dict, reads: dict, li, *, ops: Ops, scale: float,
                   window: int, topk: int, row_axes: tuple[str, ...] = ()):
    """One layer's pool writes and attention over the rows this shard holds (all of them on one device).

    blocks: pool name -> context.RowBlock, the rows of `pools[name]` ([n, R, K], the stack's n layers) held here;
    writes: name -> (rows of layer li [B, E], values [B, E, K]); reads: the window's rows and positions, the
    query positions, and on compressed layers the entries' rows [B, S] with n_ready (and the indexer's queries
    and head weights on CSA layers). Rows are global (one layer's ids, -1 = none); each shard keeps those of its
    block. The indexer's top-k over the shards' candidates and the shards' partial softmaxes are merged so that
    the result is the single-device one (sharding/context.py). row_axes: mesh axes the B rows are split over (a
    shard has its own rows, whose entries lie in its blocks along those axes: nothing to merge over them).
    Returns (o [B, T, H, K], pools)."""
    merge = tuple(dict.fromkeys(a for b in blocks.values() for a in b.axes if a not in row_axes))

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
        flat[name] = dst.at[jnp.where(r >= 0, r, dst.shape[0])].set(
            values.reshape(-1, values.shape[-1]).astype(dst.dtype), mode="drop")
    kv = flat.get("kv")
    hca_rows = sel_rows = None
    if "idx" in flat:
        rows = reads["rows"]
        scores, at = ops.select(reads["iq"], reads["w"], flat["idx"], local("idx", rows), reads["n_ready"], topk)
        _, at = context.merge_topk(scores, at, topk, tuple(a for a in blocks["idx"].axes if a not in row_axes))
        picked = jnp.take_along_axis(jnp.broadcast_to(rows[:, None, :], (*at.shape[:2], rows.shape[1])),
                                     jnp.maximum(at, 0), axis=2)
        sel_rows = counted("kv", jnp.where(at >= 0, picked, -1))
    elif kv is not None:
        hca_rows = counted("kv", reads["rows"])
    o = ops.attend(q, jnp.where(context.first_along(merge), sink, -jnp.inf), scale, flat["swa"],
                   counted("swa", reads["win_rows"]), reads["win_pos"], reads["pos"], window, kv, hca_rows,
                   reads.get("n_ready"), sel_rows, with_lse=bool(merge))
    if merge:
        o = context.merge_softmax(*o, merge)
    return o, {name: f.reshape(pools[name].shape) for name, f in flat.items()}


class RMSNorm(nnx.Module):
    def __init__(self, n: int, eps: float, axis: str, *, rngs: nnx.Rngs):
        self.weight = nnx.Param(jnp.ones((n,), F32), logical_axes=(axis,))
        self.eps = eps

    def __call__(self, x):
        return L.rms_norm(x, self.weight[...], self.eps)


class Compressor(nnx.Module):
    """Softmax-gated pooling of each window of `ratio` tokens into one entry (overlapping for CSA)."""

    def __init__(self, cfg: ModelConfig, ratio: int, head_dim: int, overlap: bool, *, rngs, dtype):
        coff = 2 if overlap else 1
        self.ratio, self.head_dim, self.overlap = ratio, head_dim, overlap
        self.wkv = Linear(cfg.dim, coff * head_dim, ("compress", "embed"), rngs=rngs, dtype=dtype)
        self.wgate = Linear(cfg.dim, coff * head_dim, ("compress", "embed"), rngs=rngs, dtype=dtype)
        self.ape = nnx.Param(_normal(rngs, (ratio, coff * head_dim), 1.0, F32), logical_axes=("ratio", "compress"))
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

    def queries(self, qr, cos, sin, opts: RunOptions):
        """qr [B, T, Q] -> indexer queries [B, T, Hi, Ki] (RoPE at the query position)."""
        q = self.wq_b(qr, opts).reshape(*qr.shape[:-1], self.n_heads, self.head_dim)
        q = L.apply_rope(q, cos[..., None, :], sin[..., None, :])
        if opts.quant_sim:
            q = quant.fp4_roundtrip(quant.hadamard_rotate(q), 32)
        return q

    def head_weights(self, x, proj=None):
        """x [B, T, D] -> w [B, T, Hi] f32 with both scales folded in (Ki^-1/2 for q.k, Hi^-1/2 for the sum).
        proj: x @ weights_proj.T in f32, computed by the caller."""
        w = L.linear(x.astype(F32), self.weights_proj.weight[...].astype(F32)) if proj is None else proj
        return w * (self.head_dim ** -0.5) * (self.n_heads ** -0.5)

    def finish_keys(self, pooled, cos, sin, dtype, opts: RunOptions):
        return self.round_keys(self.compressor.finish(pooled, cos, sin, dtype), opts)

    def round_keys(self, k, opts: RunOptions):
        """Finished keys -> the keys the indexer stores (quant_sim: Hadamard rotation, FP4 rounding)."""
        if opts.quant_sim:
            k = quant.fp4_roundtrip(quant.hadamard_rotate(k), 32)
        return k


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
                           rngs=rngs, dtype=dtype)
        self.wo_b = Linear(cfg.o_groups * cfg.o_lora_rank, cfg.dim, ("embed", "o_lora"), rngs=rngs, dtype=dtype,
                           fp8=True)
        self.attn_sink = nnx.Param(_normal(rngs, (h,), 1.0, F32), logical_axes=("heads",))
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

    def output(self, o, cos, sin, opts: RunOptions):
        """o [B, T, H, K] -> [B, T, D]: inverse RoPE at the query position, grouped low-rank projection."""
        cfg = self.cfg
        o = L.apply_rope(o, cos[..., None, :], sin[..., None, :], inverse=True)
        g = cfg.o_groups
        o = o.reshape(*o.shape[:-2], g, -1)  # [B, T, G, (H/G)*K]
        u = self.wo_a(o, opts, groups=g)  # [B, T, G, R]
        return self.wo_b(u.reshape(*u.shape[:-2], -1), opts)

    # -- the full-sequence forward (no cache): dense masks, the reference for every cached path --
    def __call__(self, x, positions, opts: RunOptions):
        """Returns (out [B, T, D], indexer aux (logp, target) [B, T, S] on CSA layers when opts.indexer_aux
        else None)."""
        cfg = self.cfg
        cos, sin = self.rope(positions)
        q, qr = self.queries(x, cos, sin, opts)
        kv = self.window_kv(x, cos, sin, opts)
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
                iq = self.indexer.queries(qr, cos, sin, opts)
                scores = index_scores(iq, self.indexer.head_weights(x), ikeys)
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
            if opts.drop_compressed:
                n_ready = jnp.zeros_like(n_ready)
            reads.update(rows=rows, n_ready=n_ready)
            writes["kv"] = self._compress(self.compressor, x, meta, pool, li, rows, "state_kv", "state_score",
                                          states, ops, opts, pre.get("compressor"))
            if self.indexer is not None:
                writes["idx"] = self._compress(self.indexer.compressor, x, meta, pool, li, rows, "idx_state_kv",
                                               "idx_state_score", states, ops, opts, pre.get("indexer compressor"))
                reads.update(iq=self.indexer.queries(qr, cos, sin, opts),
                             w=self.indexer.head_weights(x, pre.get("weights_proj")))
        pools = {name: getattr(pool, name) for name in writes}
        o, pools = self._attend_pools(q, pools, writes, reads, li, ops, opts.mesh_rules, meta.slot is None)
        return self.output(o.astype(q.dtype), cos, sin, opts), dataclasses.replace(pool, **pools, **states)

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
        got = iter(ops.project(x, [m.weight.get_value() for ms in groups.values() for m in ms]))
        pre = {}
        for name, ms in groups.items():
            ys = [next(got) for _ in ms]
            if all(y is not None for y in ys):
                pre[name] = tuple(ys) if len(ys) > 1 else ys[0]
        for name in ("wq_a", "wkv"):
            if name in pre:
                pre[name] = pre[name].astype(x.dtype)
        return pre

    def _compress(self, comp: Compressor, x, meta, pool, li, rows, st_kv_name, st_sc_name, states: dict,
                  ops: Ops, opts: RunOptions, proj=None):
        """Run a compressor over the step's tokens from the rows' states (the new states go into `states`); proj:
        its two projections of x, computed by the caller. Returns (pool rows [B, E] of the windows it closed,
        -1 = none; their entries, rounded as the layer stores them)."""
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
            entries = self.indexer.round_keys(entries, opts)
        states.update({st_kv_name: nkv, st_sc_name: nsc})
        s = rows.shape[1]
        row = jnp.take_along_axis(rows, jnp.clip(ent, 0, s - 1), axis=1)
        return jnp.where(ok & (ent >= 0) & (ent < s), row, -1), entries

    def _attend_pools(self, q, pools, writes, reads, li, ops: Ops, mesh_rules, rows_are_slots: bool):
        """Store the step's writes into the pools and attend over them (`attention_core`). On a mesh this runs per
        shard: jax.shard_map manual over every mesh axis (Mosaic kernels cannot be partitioned automatically), the
        heads split over `tensor` as the rules table says, every pool's rows in the blocks its sharding gives,
        the shards' top-k and softmaxes merged (sharding/context.py). When row b is slot b (decode) the rows split
        as the slots do (over `data`): by the layout contract a slot's pages lie in its data shard's blocks, so a
        data shard attends for its own slots alone. Returns (o [B, T, H, K], pools)."""
        cfg = self.cfg
        sink = self.attn_sink[...]
        li = jnp.asarray(li, jnp.int32)
        static = dict(ops=ops, scale=cfg.head_dim ** -0.5, window=cfg.window_size, topk=cfg.index_topk)
        if mesh_rules is None:
            blocks = {name: context.RowBlock((), a.shape[1]) for name, a in pools.items()}
            return attention_core(blocks, q, sink, pools, writes, reads, li, **static)
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
        if comp is self.compressor:
            return self.kv_round(comp.finish(pooled, cos, sin, x.dtype), opts)
        return self.indexer.finish_keys(pooled, cos, sin, x.dtype, opts)


class Gate(nnx.Module):
    def __init__(self, cfg: ModelConfig, hashed: bool, *, rngs, dtype):
        self.weight = nnx.Param(_normal(rngs, (cfg.n_routed_experts, cfg.dim), cfg.dim ** -0.5, dtype),
                                logical_axes=("router", "embed"))
        if hashed:
            keys = jax.random.split(rngs.params(), cfg.vocab_size)
            perm = jax.vmap(lambda k: jax.random.permutation(k, cfg.n_routed_experts)[: cfg.n_activated_experts])(keys)
            self.tid2eid, self.bias = Buffer(perm.astype(jnp.int32), logical_axes=("hash_tokens", "routed")), None
        else:
            self.tid2eid, self.bias = None, nnx.Param(_normal(rngs, (cfg.n_routed_experts,), 0.1, F32),
                                                      logical_axes=("router",))


class Experts(nnx.Module):
    """Routed experts stacked on a leading axis: w1/w3 [E, I, D] (gate/up), w2 [E, D, I] (down)."""

    def __init__(self, cfg: ModelConfig, *, rngs, dtype):
        e, i, d = cfg.n_routed_experts, cfg.moe_inter_dim, cfg.dim
        self.w1 = nnx.Param(_normal(rngs, (e, i, d), d ** -0.5, dtype), logical_axes=EXPERT_UP_AXES)
        self.w2 = nnx.Param(_normal(rngs, (e, d, i), i ** -0.5, dtype), logical_axes=EXPERT_DOWN_AXES)
        self.w3 = nnx.Param(_normal(rngs, (e, i, d), d ** -0.5, dtype), logical_axes=EXPERT_UP_AXES)


def _mesh_axes(entry) -> tuple[str, ...]:
    """A PartitionSpec entry as a tuple of mesh axes."""
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


DENSE_ROWS_PER_EXPERT = 8


def routed_experts(x, weights, experts, w1, w2, w3, limit, layer=None, *, ops: Ops = OPS["xla"], mesh_rules=None):
    """The ops table's experts (default the XLA forms), on a mesh run per shard (shard_map): a shard holds some
    experts (expert parallel) and a slice of each one's width (tensor), runs its experts on every token routed to
    them, and the partial outputs add up over those mesh axes. Tokens are not dispatched: every shard sees the
    step's (few) tokens, so the only collective is the sum of [M, D]. `layer`: w1/w2/w3 are a layer stack and this
    is the layer's index in it (a kernel reads the shard's stack in place)."""
    if mesh_rules is None:
        return ops.experts(x, weights, experts, w1, w2, w3, limit, layer)
    from jax.sharding import PartitionSpec as P
    stack = () if layer is None else ("layers",)
    up, down = mesh_rules.spec(stack + EXPERT_UP_AXES, w1.shape), mesh_rules.spec(stack + EXPERT_DOWN_AXES, w2.shape)
    e_axes, sum_axes = _mesh_axes(up[-3]), _mesh_axes(up[-3]) + _mesh_axes(up[-2])
    if not sum_axes and not ops.per_shard:
        return ops.experts(x, weights, experts, w1, w2, w3, limit, layer)

    def local(x, weights, experts, w1, w2, w3, layer):
        n_local = w1.shape[-3]
        first = jax.lax.axis_index(e_axes) * n_local if e_axes else 0
        mine = (experts >= first) & (experts < first + n_local)
        # Up to DENSE_ROWS_PER_EXPERT routed rows per local expert: every local expert densely. The grouped
        # matmul inside the decode loop made XLA:TPU hold a second copy of the experts (libtpu AOT of Flash on
        # v5p-16, tensor=4,expert=2, batch 32: 136 GB of temporaries; dense: 0.65 GB; BENCHMARKS "TPU pod plan").
        m, k = experts.shape
        form = "gather" if m * k < n_local else "dense" if m * k <= DENSE_ROWS_PER_EXPERT * n_local else "grouped"
        # Another shard's experts: no expert, weight 0 (the XLA forms give it a local one: no ragged tail).
        y = ops.experts(x, jnp.where(mine, weights, 0.0), jnp.where(mine, experts - first, -1), w1, w2, w3, limit,
                        layer, form)
        return jax.lax.psum(y, sum_axes) if sum_axes else y

    layer = None if layer is None else jnp.asarray(layer, jnp.int32)
    return on_shards(local, mesh_rules, (P(), P(), P(), up, down, up, P()), P())(x, weights, experts, w1, w2, w3,
                                                                                  layer)


class SharedExpert(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs, dtype):
        self.w1 = Linear(cfg.dim, cfg.moe_inter_dim, ("mlp", "embed"), rngs=rngs, dtype=dtype, fp8=True)
        self.w2 = Linear(cfg.moe_inter_dim, cfg.dim, ("embed", "mlp"), rngs=rngs, dtype=dtype, fp8=True)
        self.w3 = Linear(cfg.dim, cfg.moe_inter_dim, ("mlp", "embed"), rngs=rngs, dtype=dtype, fp8=True)

    def __call__(self, x, limit, opts, project=None):
        """project: the ops table's `project` (w1 and w3 in one launch where it takes them)."""
        # The current official revision clamps the shared expert too (reference §9.3).
        xq = quant.fp8_roundtrip(x, 128) if opts.quant_sim else x  # as Linear rounds the input of w1 and w3
        h1, h3 = (project or OPS["xla"].project)(xq, [self.w1.weight.get_value(), self.w3.weight.get_value()])
        h1 = self.w1(x, opts) if h1 is None else h1.astype(x.dtype)  # rounded as Linear returns it
        h3 = self.w3(x, opts) if h3 is None else h3.astype(x.dtype)
        h = L.swiglu(h1.astype(F32), h3.astype(F32), limit)
        return self.w2(h.astype(x.dtype), opts)


class MoE(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, *, rngs, dtype):
        self.cfg = cfg
        self.gate = Gate(cfg, cfg.is_hash_layer(layer_id), rngs=rngs, dtype=dtype)
        self.experts = Experts(cfg, rngs=rngs, dtype=dtype)
        self.shared_experts = SharedExpert(cfg, rngs=rngs, dtype=dtype) if cfg.n_shared_experts else None

    @property
    def hashed(self) -> bool:
        return self.gate.tid2eid is not None

    def __call__(self, x, token_ids, opts: RunOptions, experts_fn=None, layer=None, project=None):
        """Returns (y like x, the chosen experts [B*T, k] int32). experts_fn: the ops table's `experts` (on a mesh
        already per shard, mesh_ops; None: the XLA forms, per shard on a mesh); layer: the index of this layer in
        its stack when the expert weights are the whole stack (see Transformer._run_layers); project: the ops
        table's `project`, for the shared expert."""
        cfg = self.cfg
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        tid2eid = None if self.gate.tid2eid is None else self.gate.tid2eid[...]
        bias = None if self.gate.bias is None else self.gate.bias[...]
        w, idx = L.route(flat, self.gate.weight[...], bias, tid2eid, token_ids.reshape(-1), cfg)
        xin = quant.fp8_roundtrip(flat, 128) if opts.quant_sim else flat
        experts_fn = experts_fn or functools.partial(routed_experts, mesh_rules=opts.mesh_rules)
        y = experts_fn(xin, w, idx, self.experts.w1[...], self.experts.w2[...], self.experts.w3[...], cfg.swiglu_limit,
                       layer)
        if self.shared_experts is not None:
            y = y + self.shared_experts(flat, cfg.swiglu_limit, opts, project).astype(F32)
        return y.astype(x.dtype).reshape(shape), idx


class Block(nnx.Module):
    """One decoder layer: mHC around attention, mHC around the MoE."""

    def __init__(self, cfg: ModelConfig, layer_id: int, *, rngs, dtype):
        self.cfg = cfg
        n, d = cfg.hc_mult, cfg.dim
        mix = (2 + n) * n
        self.attn_norm = RMSNorm(d, cfg.norm_eps, "embed", rngs=rngs)
        self.ffn_norm = RMSNorm(d, cfg.norm_eps, "embed", rngs=rngs)
        self.hc_attn_fn = nnx.Param(_normal(rngs, (mix, n * d), (n * d) ** -0.5, F32), logical_axes=HC_FN_AXES)
        self.hc_attn_base = nnx.Param(_normal(rngs, (mix,), 0.1, F32), logical_axes=("hc_mix",))
        self.hc_attn_scale = nnx.Param(jnp.ones((3,), F32), logical_axes=("hc_scale",))
        self.hc_ffn_fn = nnx.Param(_normal(rngs, (mix, n * d), (n * d) ** -0.5, F32), logical_axes=HC_FN_AXES)
        self.hc_ffn_base = nnx.Param(_normal(rngs, (mix,), 0.1, F32), logical_axes=("hc_mix",))
        self.hc_ffn_scale = nnx.Param(jnp.ones((3,), F32), logical_axes=("hc_scale",))
        self.attn = Attention(cfg, layer_id, rngs=rngs, dtype=dtype)
        self.ffn = MoE(cfg, layer_id, rngs=rngs, dtype=dtype)

    def hc_attn(self, x, sinkhorn=None):
        return L.hc_pre(x, self.hc_attn_fn[...], self.hc_attn_base[...], self.hc_attn_scale[...], self.cfg, sinkhorn)

    def hc_ffn(self, x, sinkhorn=None):
        return L.hc_pre(x, self.hc_ffn_fn[...], self.hc_ffn_base[...], self.hc_ffn_scale[...], self.cfg, sinkhorn)

    def ffn_part(self, x, token_ids, opts, ops: Ops | None = None, layer=None):
        """ops: the cached path's ops table (None: the reference maths of the uncached forward); layer: see MoE."""
        u, post, comb = self.hc_ffn(x, None if ops is None else ops.sinkhorn)
        if ops is None:
            y, experts = self.ffn(self.ffn_norm(u), token_ids, opts, layer=layer)
            return L.hc_post(y, x, post, comb), experts
        y, experts = self.ffn(self.ffn_norm(u), token_ids, opts, ops.experts, layer, ops.project)
        return ops.hc_post(y, x, post, comb), experts

    def cached(self, x, meta, token_ids, pool, li, ops: Ops, opts: RunOptions):
        u, post, comb = self.hc_attn(x, ops.sinkhorn)
        a, pool = self.attn.cached(self.attn_norm(u), meta, pool, li, ops, opts)
        x = ops.hc_post(a, x, post, comb)
        return self.ffn_part(x, token_ids, opts, ops, li)[0], pool

    def __call__(self, x, positions, token_ids, opts: RunOptions, layer=None):
        """Returns (streams, aux): aux["indexer"] (CSA, opts.indexer_aux), aux["routing"] (top-k routed layers,
        opts.routing_aux). layer: see MoE."""
        u, post, comb = self.hc_attn(x)
        a, idx_aux = self.attn(self.attn_norm(u), positions, opts)
        x = L.hc_post(a, x, post, comb)
        x, experts = self.ffn_part(x, token_ids, opts, layer=layer)
        aux = {}
        if idx_aux is not None:
            aux["indexer"] = idx_aux
        if opts.routing_aux and not self.ffn.hashed:
            aux["routing"] = experts
        return x, aux


def _stack(blocks: list) -> "Block":
    """Blocks of one shape -> one Block whose every array is stacked on a new leading axis (logical axis
    "layers")."""
    graphdef, first = nnx.split(blocks[0])
    states = [first] + [nnx.split(b)[1] for b in blocks[1:]]
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *states)
    stacked = jax.tree.map(lambda v: v.replace(logical_axes=("layers",) + tuple(v.get_metadata()["logical_axes"])),
                           stacked, is_leaf=lambda x: isinstance(x, nnx.Variable))
    return nnx.merge(graphdef, stacked)


class MTPBlock(nnx.Module):
    """Multi-token prediction (reference §7): predicts token i+2 from the main streams at i and token i+1."""

    def __init__(self, cfg: ModelConfig, *, rngs, dtype):
        self.cfg = cfg
        n, d = cfg.hc_mult, cfg.dim
        self.e_proj = Linear(d, d, ("embed", "embed"), rngs=rngs, dtype=dtype, fp8=True)
        self.h_proj = Linear(d, d, ("embed", "embed"), rngs=rngs, dtype=dtype, fp8=True)
        self.enorm = RMSNorm(d, cfg.norm_eps, "embed", rngs=rngs)
        self.hnorm = RMSNorm(d, cfg.norm_eps, "embed", rngs=rngs)
        self.norm = RMSNorm(d, cfg.norm_eps, "embed", rngs=rngs)
        self.hc_head_fn = nnx.Param(_normal(rngs, (n, n * d), (n * d) ** -0.5, F32), logical_axes=HC_FN_AXES)
        self.hc_head_base = nnx.Param(_normal(rngs, (n,), 0.1, F32), logical_axes=("hc_mix",))
        self.hc_head_scale = nnx.Param(jnp.ones((1,), F32), logical_axes=("hc_scale",))
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
        # Layers are built one by one in layer order (the random init does not depend on the grouping), then
        # stacked; each layer's own arrays are dropped as soon as its stack exists.
        blocks = [Block(cfg, i, rngs=rngs, dtype=dtype) for i in range(cfg.n_layers)]
        stacks = []
        for st in layer_stacks(cfg).stacks:
            stacks.append(_stack([blocks[i] for i in st.layers]))
            for i in st.layers:
                blocks[i] = None
        self.stacks = nnx.List(stacks)
        self.norm = RMSNorm(d, cfg.norm_eps, "embed", rngs=rngs)
        self.hc_head_fn = nnx.Param(_normal(rngs, (n, n * d), (n * d) ** -0.5, F32), logical_axes=HC_FN_AXES)
        self.hc_head_base = nnx.Param(_normal(rngs, (n,), 0.1, F32), logical_axes=("hc_mix",))
        self.hc_head_scale = nnx.Param(jnp.ones((1,), F32), logical_axes=("hc_scale",))
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

    # -- the layer loop --
    def _run_layers(self, layer, x, pools, opts: RunOptions, collect: bool = False):
        """Run every main layer in order: `layer(block, g, li, x, pool) -> (x, pool, aux)` with `block` the
        layer's parameters (a Block sliced out of stack g at index li) and `pool` stack g's pools (None in the
        full-sequence forward). Returns (x, pools, per-stack aux: stack -> list of (li, aux) when collect)."""
        split = [nnx.split(s) for s in self.stacks]
        pools = None if pools is None else list(pools)
        on_mesh = opts.mesh_rules is not None

        def run(g, li, x, pool):
            graphdef, state = split[g]
            sliced = jax.tree_util.tree_map_with_path(lambda p, a: _layer_of(p, a, li, on_mesh), state)
            return layer(nnx.merge(graphdef, sliced), g, li, x, pool)

        auxs: dict[int, list] = {}
        for seg in layer_stacks(self.cfg).segments:
            if seg.repeats == 1:  # unrolled
                for g, li in zip(seg.period, seg.base):
                    x, pool, aux = run(g, li, x, None if pools is None else pools[g])
                    if pools is not None:
                        pools[g] = pool
                    if collect:
                        auxs.setdefault(g, []).append((li, aux))
                continue
            touched = sorted(set(seg.period))

            def body(carry, i, seg=seg, touched=touched):
                x, ps = carry
                ps = None if ps is None else dict(zip(touched, ps))
                out = []
                for j, g in enumerate(seg.period):
                    li = seg.base[j] + i * seg.step[j]
                    x, pool, aux = run(g, li, x, None if ps is None else ps[g])
                    if ps is not None:
                        ps[g] = pool
                    out.append(aux if collect else None)
                return (x, None if ps is None else tuple(ps[g] for g in touched)), tuple(out)

            carry = (x, None if pools is None else tuple(pools[g] for g in touched))
            (x, ps), ys = jax.lax.scan(body, carry, jnp.arange(seg.repeats, dtype=jnp.int32))
            if pools is not None:
                for g, p in zip(touched, ps):
                    pools[g] = p
            if collect:
                for j, g in enumerate(seg.period):
                    for i in range(seg.repeats):
                        auxs.setdefault(g, []).append(
                            (seg.base[j] + i * seg.step[j], jax.tree.map(lambda a: a[i], ys[j])))
        return x, pools, auxs

    def __call__(self, token_ids, opts: RunOptions = RunOptions(), return_streams: bool = False):
        """Full-sequence forward from position 0, no cache. token_ids [B, T] -> logits [B, T, V] f32.
        With opts.indexer_aux / routing_aux, sows IndexerAux / RoutingAux (collect them with `nnx.capture`)."""
        b, t = token_ids.shape
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        x = self.embed_streams(token_ids)
        collect = opts.indexer_aux or opts.routing_aux

        def layer(block, g, li, x, pool):
            x, aux = block(x, positions, token_ids, opts, li)
            return x, pool, aux

        x, _, auxs = self._run_layers(layer, x, None, opts, collect)
        routing = []
        for g in sorted(auxs):
            per_layer = [a for _, a in sorted(auxs[g], key=lambda e: e[0])]
            if opts.indexer_aux and "indexer" in per_layer[0]:
                self.sow(IndexerAux, "indexer_aux", jax.tree.map(lambda *a: jnp.stack(a),
                                                                 *[a["indexer"] for a in per_layer]))
            if "routing" in per_layer[0]:
                routing.append(jnp.stack([a["routing"] for a in per_layer]))
        if opts.routing_aux:
            self.sow(RoutingAux, "routing", tuple(routing))
        logits = self.logits_from_streams(x)
        return (logits, x) if return_streams else logits

    def cached(self, token_ids, meta, pools, opts: RunOptions = RunOptions()):
        """One step over the pools: token_ids [B, T] at meta's positions. Returns (logits [B, V] f32 of each
        row's last valid token, pools with the step's writes)."""
        ops = ops_for(opts.attention_impl)
        if opts.mesh_rules is not None:
            ops = mesh_ops(ops, opts.mesh_rules, rows_are_slots=meta.slot is None)
        x = self.embed_streams(token_ids)

        def layer(block, g, li, x, pool):
            x, pool = block.cached(x, meta, token_ids, pool, li, ops, opts)
            return x, pool, None

        x, stacks, _ = self._run_layers(layer, x, pools.stacks, opts)
        last = jnp.maximum(meta.n_valid - 1, 0)
        x_last = jnp.take_along_axis(x, last[:, None, None, None], axis=1)[:, 0]
        return self.logits_from_streams(x_last), dataclasses.replace(pools, stacks=tuple(stacks))

    def mtp_logits(self, streams, token_ids, opts: RunOptions = RunOptions()):
        """MTP head over a full sequence: position i sees the main streams at i and token i+1 and predicts
        token i+2. Returns [B, T-1, V] for positions 0..T-2. With opts.routing_aux, sows RoutingAux
        "mtp_routing"."""
        mtp = self.mtp[0]
        b, t = token_ids.shape
        positions = jnp.broadcast_to(jnp.arange(t - 1, dtype=jnp.int32), (b, t - 1))
        e = self.embed.weight[...][token_ids[:, 1:]]
        x = mtp.streams_in(e, streams[:, :-1], opts)
        x, aux = mtp.block(x, positions, token_ids[:, 1:], opts)
        if "routing" in aux:
            self.sow(RoutingAux, "mtp_routing", aux["routing"])
        return self.head_logits(mtp.collapse(x))
