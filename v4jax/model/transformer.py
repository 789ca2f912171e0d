"""The DeepSeek-V4 model in Flax NNX (reference §2-§7): a full-sequence forward (the reference) and the cached
step over the pools (v4jax.cache). The layer (Block: mHC around attention and the MoE), the MTP block, the model
and its layer loop live here; attention in v4jax.model.attention, the MoE in v4jax.model.moe.

The main layers are held in stacks (`config.layer_stacks`): layers of one shape (type and ratio) have their
parameters stacked on a leading axis, `model.stacks[g]` is one Block whose every parameter is [n_g, ...], and
official layer N is index i of stack g (`layers.3.attn.wq_a.weight` is `model.stacks[g].attn.wq_a.weight[i]`;
routed experts are stacked on a further E axis). The router kind does not split a stack: the hash layers (the
model's first) lead their stacks, the gate holds their tables and the other layers' selection biases (moe.Gate),
and a scan slot over both kinds runs both selections, each layer keeping its own. Both forwards run the layers
as `lax.scan`s over the smallest repeating unit of the pattern (Flash: 3 unrolled layers, then one scan of
[HCA, CSA] x 20; 24 layers repeating [sliding, CSA, HCA, CSA]: one scan of 4 x 6), so a program's size and its
compile time do not grow with depth (CPU, `tiny` widths with its hash layer, that period-4 pattern: the first
`LLM.generate` took 22 s of CPU at 24 layers, 28 s at 4; 45 s at 24 while the hash layer was a stack of its own
and broke the period). The forward runs as a pure function: `nnx.split` once, then jit over the state.
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

import jax
import jax.numpy as jnp
from flax import nnx

from v4jax.config import ModelConfig, layer_stacks
from v4jax.model import layers as L
from v4jax.model.attention import Attention
from v4jax.model.layers import Linear, RMSNorm, RunOptions, Table, init_normal  # noqa: F401 (RunOptions: re-exported)
from v4jax.model import quant
from v4jax.model.moe import Experts, MoE, routed_experts
from v4jax.model.ops import Ops, on_shards, ops_for

F32 = jnp.float32


class IndexerAux(nnx.Intermediate):
    """Per CSA stack: (indexer log-softmax over causal entries [n, B, T, S], target distribution [n, B, T, S]),
    sown by the full-sequence forward under `nnx.capture` when RunOptions.indexer_aux is set."""


class RoutingAux(nnx.Intermediate):
    """The experts each top-k-routed layer chose: "routing" per stack with top-k layers [n_topk, B*T, k] (stacks in
    order, its top-k layers in order: the rows of its selection biases), and
    "mtp_routing" [B*T, k] from the MTP block; sown under `nnx.capture` when RunOptions.routing_aux is set."""


# Logical axes of the mHC mixing weights [(2 + N) N or N, N D] (sharding/rules.py maps names to mesh axes).
HC_FN_AXES = ("hc_mix", "hc_embed")


_EXPERT_WEIGHTS = {("ffn", "experts", w) for w in ("w1", "w2", "w3", "w1_scale", "w2_scale", "w3_scale")}
_ROUTER_ROWS = {("ffn", "gate", "tid2eid"), ("ffn", "gate", "bias")}  # one row per hash / top-k layer of a stack


def _is_expert_weight(path) -> bool:
    """A Block state's key path (..., "ffn", "experts", "w1" | "w2" | "w3", .value): a routed expert weight."""
    return tuple(getattr(k, "key", None) for k in path[-4:-1]) in _EXPERT_WEIGHTS


def _is_router_rows(path) -> bool:
    """A Block state's key path to a stack's hash tables or selection biases (moe.Gate: not one row a layer)."""
    return tuple(getattr(k, "key", None) for k in path[-4:-1]) in _ROUTER_ROWS


_HC_PARAMS = ("hc_attn_base", "hc_attn_scale", "hc_ffn_base", "hc_ffn_scale")


def _layer_of(path, stack, li, on_mesh: bool):
    """What layer li of a Block state's leaf is inside the layer loop. The routed experts' weights and the router's
    hash tables and selection biases stay whole (the MoE reads layer li's own) and, off a mesh, a Linear's weight
    [n, O, D] (and its FP8 block scales) becomes L.LayerOf (the ops table's `linear` reads it in place): on the H200
    a slice fed to a kernel or a matmul that cannot fuse it is a copy every step (all experts of a layer: 2.1 ms of
    a 4.8 ms flash-slice step at batch 32); so do mHC's scales and biases and the weights of the norms after its
    collapse (the ops table's `hc_weights` and `hc_collapse` read them). The rest is sliced (on a mesh the
    projections are XLA's, partitioned by the rules, and the weights enter shard_maps as arrays)."""
    if _is_expert_weight(path) or _is_router_rows(path):
        return stack
    owner, leaf = ([None, None] + [getattr(k, "key", None) for k in path])[-3:-1]
    if not on_mesh and ((leaf in ("weight", "scale") and stack.ndim == 3) or leaf in _HC_PARAMS
                        or (owner in ("attn_norm", "ffn_norm") and leaf == "weight")):
        return L.LayerOf(stack, li)
    return L.layer_slice(stack, li)


def mesh_ops(ops: Ops, mesh_rules, rows_are_slots: bool) -> Ops:
    """The ops table of a step on a mesh. The experts run per shard on the shard's experts (routed_experts); a
    table of Pallas calls (ops.per_shard) also runs compress, hc_weights, hc_post and hc_collapse per shard, on the
    step's rows: split as the slots are (over `data`) when row b is slot b, whole on every shard otherwise. select
    and attend run inside attention_core's shard_map (Attention._attend_pools)."""
    from jax.sharding import PartitionSpec as P
    experts = functools.partial(routed_experts, ops=ops, mesh_rules=mesh_rules)
    if not ops.per_shard:
        return dataclasses.replace(ops, experts=experts)

    def by_row(b):  # every row argument and result of these entries is [B, ...]
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

    def hc_weights(dot, ssq, count, norm_eps, scale, base, n, iters, eps):
        rows = by_row(dot.shape[0])
        return on_shards(lambda d, q, s, b: ops.hc_weights(d, q, count, norm_eps, s, b, n, iters, eps), mesh_rules,
                         (rows, rows, P(), P()), rows)(dot, ssq, scale, base)

    def hc_post(f, x, post, comb):  # (a mesh's projections are XLA's: f comes summed, L.total is for the contract)
        rows = by_row(x.shape[0])
        return on_shards(ops.hc_post, mesh_rules, rows, rows)(L.total(f), x, post, comb)

    def hc_collapse(pre, x, weight, eps):
        rows = by_row(x.shape[0])
        return on_shards(lambda p, s, w: ops.hc_collapse(p, s, w, eps), mesh_rules, (rows, rows, P()),
                         rows)(pre, x, weight)

    # `project` stays: on a mesh the weights are arrays, not LayerOf, and it takes none of them
    return dataclasses.replace(ops, compress=compress, hc_weights=hc_weights, hc_post=hc_post,
                               hc_collapse=hc_collapse, experts=experts)


class Block(nnx.Module):
    """One decoder layer: mHC around attention, mHC around the MoE."""

    def __init__(self, cfg: ModelConfig, layer_id: int, *, rngs, dtype, experts_storage: str | None = None):
        self.cfg = cfg
        n, d = cfg.hc_mult, cfg.dim
        mix = (2 + n) * n
        self.attn_norm = RMSNorm(d, cfg.norm_eps, "embed", rngs=rngs)
        self.ffn_norm = RMSNorm(d, cfg.norm_eps, "embed", rngs=rngs)
        self.hc_attn_fn = nnx.Param(init_normal(rngs, (mix, n * d), (n * d) ** -0.5, F32), logical_axes=HC_FN_AXES)
        self.hc_attn_base = nnx.Param(init_normal(rngs, (mix,), 0.1, F32), logical_axes=("hc_mix",))
        self.hc_attn_scale = nnx.Param(L.ones((3,)), logical_axes=("hc_scale",))
        self.hc_ffn_fn = nnx.Param(init_normal(rngs, (mix, n * d), (n * d) ** -0.5, F32), logical_axes=HC_FN_AXES)
        self.hc_ffn_base = nnx.Param(init_normal(rngs, (mix,), 0.1, F32), logical_axes=("hc_mix",))
        self.hc_ffn_scale = nnx.Param(L.ones((3,)), logical_axes=("hc_scale",))
        self.attn = Attention(cfg, layer_id, rngs=rngs, dtype=dtype)
        self.ffn = MoE(cfg, layer_id, rngs=rngs, dtype=dtype, experts_storage=experts_storage)

    def attn_input(self, x, ops: Ops | None = None):
        """The streams x [..., N, D] -> (the attention's input [..., D]: mHC's collapse, then attn_norm; post, comb).
        ops: the cached path's ops table (None: the reference maths of the uncached forward)."""
        return self._sublayer_input(x, self.hc_attn_fn, self.hc_attn_base, self.hc_attn_scale, self.attn_norm, ops)

    def ffn_input(self, x, ops: Ops | None = None):
        """As attn_input, for the MoE (ffn_norm)."""
        return self._sublayer_input(x, self.hc_ffn_fn, self.hc_ffn_base, self.hc_ffn_scale, self.ffn_norm, ops)

    def _sublayer_input(self, x, fn, base, scale, norm, ops):
        if ops is None:
            u, post, comb = L.hc_pre(x, fn[...], base[...], scale[...], self.cfg)
            return norm(u), post, comb
        pre, post, comb = L.hc_pre_weights(x, fn[...], base.get_value(), scale.get_value(), self.cfg, ops.hc_weights)
        return ops.hc_collapse(pre, x, norm.weight.get_value(), norm.eps), post, comb

    def ffn_part(self, x, token_ids, opts, ops: Ops | None = None, layer=None, hashed=None):
        """ops: the cached path's ops table (None: the reference maths of the uncached forward); layer, hashed:
        see MoE."""
        h, post, comb = self.ffn_input(x, ops)
        if ops is None:
            y, experts = self.ffn(h, token_ids, opts, layer=layer, hashed=hashed)
            return L.hc_post(y, x, post, comb), experts
        y, experts = self.ffn(h, token_ids, opts, ops.experts, layer, ops.project, hashed)
        return ops.hc_post(y, x, post, comb), experts

    def cached(self, x, meta, token_ids, pool, li, ops: Ops, opts: RunOptions, hashed=None):
        h, post, comb = self.attn_input(x, ops)
        a, pool = self.attn.cached(h, meta, pool, li, ops, opts)
        x = ops.hc_post(a, x, post, comb)
        return self.ffn_part(x, token_ids, opts, ops, li, hashed)[0], pool

    def __call__(self, x, positions, token_ids, opts: RunOptions, layer=None, hashed=None):
        """Returns (streams, aux): aux["indexer"] (CSA, opts.indexer_aux), aux["routing"] (opts.routing_aux, when
        some layer of the block routes by top-k: the stack's hash layers' too, dropped by the caller). layer,
        hashed: see MoE."""
        h, post, comb = self.attn_input(x)
        a, idx_aux = self.attn(h, positions, opts)
        x = L.hc_post(a, x, post, comb)
        x, experts = self.ffn_part(x, token_ids, opts, layer=layer, hashed=hashed)
        aux = {}
        if idx_aux is not None:
            aux["indexer"] = idx_aux
        if opts.routing_aux and self.ffn.topk:
            aux["routing"] = experts
        return x, aux


def _stacked(trees):
    """Like trees (Variables, or states of them) with every array stacked on a new leading axis (logical axis
    "layers")."""
    return _with_layers_axis(jax.tree.map(lambda *a: jnp.stack(a), *trees))


def _with_layers_axis(tree):
    return jax.tree.map(lambda v: v.replace(logical_axes=("layers",) + tuple(v.get_metadata()["logical_axes"])),
                        tree, is_leaf=lambda x: isinstance(x, nnx.Variable))


# Writes one layer's arrays into their stacks in place (the stacks' buffers donated); one program per layer
# structure, the index traced (one per array was a compile each, and so were the stacks' zeros). Inside a trace
# (eval_shape, a jitted sharded init) they are ordinary updates.
_put_layer = jax.jit(lambda stacks, layer, j: jax.tree.map(
    lambda stack, a: jax.lax.dynamic_update_index_in_dim(stack, a, j, 0), stacks, layer), donate_argnums=0)
_zero_stacks = jax.jit(lambda layer, n: jax.tree.map(lambda a: jnp.zeros((n,) + a.shape, a.dtype), layer),
                       static_argnums=1)


class _StackBuilder:
    """Blocks of one shape arriving one at a time, in any order of their stack indices -> one Block whose every
    array is stacked on a new leading axis. Each block is copied into the stack's buffers as it arrives and can be
    dropped at once, so building n layers holds the stack and one layer, not the stack beside n layers (stacking
    at the end ran `flash-h200`'s 113.6 GiB of random weights out of an H200's memory). The router kind may differ
    (the hash layers come first): the gate's hash tables are those of the hash layers and its selection biases
    those of the others (moe.Gate)."""

    def __init__(self, n: int):
        self.n, self.graphdef, self.state = n, None, None
        self.tables, self.biases = {}, {}

    def add(self, j: int, block: "Block") -> None:
        gate = block.ffn.gate
        if gate.tid2eid is not None:
            self.tables[j] = gate.tid2eid
        if gate.bias is not None:
            self.biases[j] = gate.bias
        gate.tid2eid = gate.bias = None
        graphdef, state = nnx.split(block)
        if self.state is None:
            self.graphdef = graphdef
            self.state = _zero_stacks(state, self.n)
        self.state = _put_layer(self.state, state, j)

    def finish(self) -> "Block":
        assert sorted(self.tables) == list(range(len(self.tables))), "hash layers come first in a stack"
        out = nnx.merge(self.graphdef, _with_layers_axis(self.state))
        gate = out.ffn.gate
        gate.tid2eid = nnx.data(_stacked([self.tables[j] for j in sorted(self.tables)])) if self.tables else None
        gate.bias = nnx.data(_stacked([self.biases[j] for j in sorted(self.biases)])) if self.biases else None
        gate.n_hashed = len(self.tables)
        return out


def last_valid(x, n_valid):
    """x [B, T, ...] -> [B, ...]: each row's last valid token (n_valid [B]; row 0's first where none)."""
    last = jnp.maximum(n_valid - 1, 0)
    return jnp.take_along_axis(x, last.reshape((-1,) + (1,) * (x.ndim - 1)), axis=1)[:, 0]


class MTPBlock(nnx.Module):
    """Multi-token prediction (reference §7): predicts token i+2 from the main streams at i and token i+1."""

    def __init__(self, cfg: ModelConfig, *, rngs, dtype, experts_storage: str | None = None):
        self.cfg = cfg
        n, d = cfg.hc_mult, cfg.dim
        self.e_proj = Linear(d, d, ("embed", "embed"), rngs=rngs, dtype=dtype, fp8=True)
        self.h_proj = Linear(d, d, ("embed", "embed"), rngs=rngs, dtype=dtype, fp8=True)
        self.enorm = RMSNorm(d, cfg.norm_eps, "embed", rngs=rngs)
        self.hnorm = RMSNorm(d, cfg.norm_eps, "embed", rngs=rngs)
        self.norm = RMSNorm(d, cfg.norm_eps, "embed", rngs=rngs)
        self.hc_head_fn = nnx.Param(init_normal(rngs, (n, n * d), (n * d) ** -0.5, F32), logical_axes=HC_FN_AXES)
        self.hc_head_base = nnx.Param(init_normal(rngs, (n,), 0.1, F32), logical_axes=("hc_mix",))
        self.hc_head_scale = nnx.Param(L.ones((1,)), logical_axes=("hc_scale",))
        self.block = Block(cfg, cfg.n_layers, rngs=rngs, dtype=dtype, experts_storage=experts_storage)

    def streams_in(self, embedded_next, h_main, opts):
        """embedded_next [B, T, D] (embedding of token i+1), h_main [B, T, N, D] -> MTP input streams."""
        e = self.e_proj(self.enorm(embedded_next), opts)
        h = self.h_proj(self.hnorm(h_main), opts)
        return (e[:, :, None, :] + h).astype(h_main.dtype)

    def collapse(self, x):
        y = L.hc_head(x, self.hc_head_fn[...], self.hc_head_base[...], self.hc_head_scale[...], self.cfg)
        return self.norm(y)


class MarkovHead(nnx.Module):
    """DSpark's low-rank bigram head: the bias markov_w2 @ markov_w1[token] [V] on the logits of the draft after
    `token`."""

    def __init__(self, cfg: ModelConfig, *, rngs, dtype):
        v, r = cfg.vocab_size, cfg.dspark_markov_rank
        self.markov_w1 = Table(v, r, 1.0, rngs=rngs, dtype=dtype)
        self.markov_w2 = Table(v, r, r ** -0.5, rngs=rngs, dtype=dtype)

    def embed(self, token_ids):
        return self.markov_w1.weight[...][token_ids]

    def bias(self, embedded):
        w = self.markov_w2.weight[...]
        return jnp.einsum("...r,vr->...v", embedded.astype(w.dtype), w, preferred_element_type=F32)


class ConfidenceHead(nnx.Module):
    """DSpark's per-draft confidence logit: proj [1, D + r] over (the collapsed stage output, the Markov embedding
    of the previous token), in f32."""

    def __init__(self, cfg: ModelConfig, *, rngs):
        d = cfg.dim + cfg.dspark_markov_rank
        self.proj = Linear(d, 1, (None, "embed"), rngs=rngs, dtype=F32)

    def __call__(self, y, embedded):
        x = jnp.concatenate([y.astype(F32), embedded.astype(F32)], axis=-1)
        return self.proj(x)[..., 0]


class DSparkStage(nnx.Module):
    """One draft layer of the DSpark drafter (`mtp.N.*` of the 0731 / -DSpark releases): a sliding-window Block
    whose attention reads a window of keys made from the main model's hidden states (v4jax.engine.dspark). The
    first stage also holds `main_proj` / `main_norm` (the target layers' mean streams, concatenated, -> D), the
    last the head's `norm` and `hc_head_*`, the Markov head and the confidence head."""

    def __init__(self, cfg: ModelConfig, stage: int, *, rngs, dtype, experts_storage: str | None = None):
        self.cfg = cfg
        n, d = cfg.hc_mult, cfg.dim
        self.block = Block(cfg, cfg.n_layers + stage, rngs=rngs, dtype=dtype, experts_storage=experts_storage)
        first, last = stage == 0, stage == cfg.n_mtp_layers - 1
        self.main_proj = nnx.data(Linear(d * len(cfg.dspark_target_layer_ids), d, ("embed", "embed"), rngs=rngs,
                                         dtype=dtype, fp8=True) if first else None)
        self.main_norm = nnx.data(RMSNorm(d, cfg.norm_eps, "embed", rngs=rngs) if first else None)
        self.norm = nnx.data(RMSNorm(d, cfg.norm_eps, "embed", rngs=rngs) if last else None)
        self.hc_head_fn = nnx.data(nnx.Param(init_normal(rngs, (n, n * d), (n * d) ** -0.5, F32),
                                             logical_axes=HC_FN_AXES) if last else None)
        self.hc_head_base = nnx.data(nnx.Param(init_normal(rngs, (n,), 0.1, F32), logical_axes=("hc_mix",))
                                     if last else None)
        self.hc_head_scale = nnx.data(nnx.Param(L.ones((1,)), logical_axes=("hc_scale",)) if last else None)
        self.markov_head = nnx.data(MarkovHead(cfg, rngs=rngs, dtype=dtype) if last else None)
        self.confidence_head = nnx.data(ConfidenceHead(cfg, rngs=rngs) if last else None)

    def main_x(self, taps, opts):
        """taps [..., n_targets * D] (the target layers' mean streams) -> the keys' input [..., D]."""
        return self.main_norm(self.main_proj(taps, opts)).astype(taps.dtype)

    def collapse(self, x):
        """The last stage's output streams [..., N, D] -> [..., D] (before the head's norm)."""
        return L.hc_head(x, self.hc_head_fn[...], self.hc_head_base[...], self.hc_head_scale[...], self.cfg)


class _Draws:
    """The keys of `rngs.params()`, in the same order, with the stream's count kept in Python until `close`. Under a
    trace (nnx.eval_shape, jit) each update of the count variable made Flax ask the traced count for its sharding,
    and the error it catches walks the whole trace so far: building a model abstractly (every checkpoint load)
    grew with the square of its depth (CPU, JAX 0.10.2: 35 s of CPU for Flash's 43 layers, 85 s for Pro's 61;
    with the count in Python 1.8 s each)."""

    def __init__(self, rngs: nnx.Rngs):
        self._stream = rngs.params
        self._key, self._count, self._n = self._stream.key[...], self._stream.count[...], 0

    def params(self):
        self._n += 1
        return jax.random.fold_in(self._key, self._count + (self._n - 1))

    def close(self):
        self._stream.count[...] = self._count + self._n


def _store(module, weights: quant.WeightFormat):
    """Hold the module's FP8 linears as `weights` says (the release's storage, or the dtype; its routed experts are
    drawn in their storage: moe.Experts)."""
    for _, m in list(nnx.iter_modules(module)):
        if isinstance(m, Linear):
            m.store(weights.linear)
    return module


class Transformer(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, dtype=jnp.bfloat16, mtp: bool = True,
                 weights: quant.WeightFormat = quant.DEQUANTIZED):
        """weights: how the weights the release quantises are held (quant.WeightFormat; a random init is quantised
        as the release's converter would, layer by layer)."""
        draws = _Draws(rngs)
        self._build(cfg, draws, dtype, mtp, weights)
        draws.close()

    def _build(self, cfg: ModelConfig, rngs, dtype, mtp: bool, weights: quant.WeightFormat):
        self.cfg = cfg
        n, d = cfg.hc_mult, cfg.dim
        self.embed = Table(cfg.vocab_size, d, 1.0, rngs=rngs, dtype=dtype)
        # Layers are built one by one in layer order (the random init does not depend on the grouping), each
        # copied into its stack as it is made.
        groups = layer_stacks(cfg).stacks
        builders = [_StackBuilder(len(st.layers)) for st in groups]
        where = {i: (g, j) for g, st in enumerate(groups) for j, i in enumerate(st.layers)}
        experts = weights.experts
        for i in range(cfg.n_layers):
            g, j = where[i]
            builders[g].add(j, _store(Block(cfg, i, rngs=rngs, dtype=dtype, experts_storage=experts), weights))
        self.stacks = nnx.List([b.finish() for b in builders])
        self.norm = RMSNorm(d, cfg.norm_eps, "embed", rngs=rngs)
        self.hc_head_fn = nnx.Param(init_normal(rngs, (n, n * d), (n * d) ** -0.5, F32), logical_axes=HC_FN_AXES)
        self.hc_head_base = nnx.Param(init_normal(rngs, (n,), 0.1, F32), logical_axes=("hc_mix",))
        self.hc_head_scale = nnx.Param(L.ones((1,)), logical_axes=("hc_scale",))
        self.head = Table(cfg.vocab_size, d, d ** -0.5, rngs=rngs, dtype=dtype)
        # the drafter: the MTP block, or the DSpark draft layers of a config with dspark_* keys (both `mtp.N.*`)
        n_draft = cfg.n_mtp_layers if mtp else 0
        if cfg.dspark_block_size:
            self.mtp = nnx.List([_store(DSparkStage(cfg, i, rngs=rngs, dtype=dtype, experts_storage=experts), weights)
                                 for i in range(n_draft)])
        else:
            self.mtp = nnx.List([_store(MTPBlock(cfg, rngs=rngs, dtype=dtype, experts_storage=experts), weights)
                                 for _ in range(n_draft)])

    @property
    def drafter(self) -> str | None:
        """The speculative drafter the weights hold: "mtp" (the MTP block), "dspark" (the DSpark draft layers), or
        None."""
        if not len(self.mtp):
            return None
        return "dspark" if self.cfg.dspark_block_size else "mtp"

    @property
    def dtype(self):
        return self.embed.weight.dtype

    @property
    def weight_format(self) -> quant.WeightFormat:
        """How the weights the release quantises are held (see Transformer)."""
        modules = [m for _, m in nnx.iter_modules(self)]
        fp8 = any(isinstance(m, Linear) and m.scale is not None for m in modules)
        experts = next((m.storage for m in modules if isinstance(m, Experts)), None)
        return quant.WeightFormat("fp8" if fp8 else None, experts)

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
        """Run every main layer in order: `layer(block, g, li, hashed, x, pool) -> (x, pool, aux)` with `block`
        the layer's parameters (a Block sliced out of stack g at index li), `hashed` its router kind (None: by li)
        and `pool` stack g's pools (None in the full-sequence forward). Returns (x, pools, per-stack aux: stack ->
        list of (li, aux) when collect)."""
        split = [nnx.split(s) for s in self.stacks]
        pools = None if pools is None else list(pools)
        on_mesh = opts.mesh_rules is not None

        def run(g, li, hashed, x, pool):
            graphdef, state = split[g]
            sliced = jax.tree_util.tree_map_with_path(lambda p, a: _layer_of(p, a, li, on_mesh), state)
            return layer(nnx.merge(graphdef, sliced), g, li, hashed, x, pool)

        auxs: dict[int, list] = {}
        for seg in layer_stacks(self.cfg).segments:
            if seg.repeats == 1:  # unrolled
                for g, li, hashed in zip(seg.period, seg.base, seg.hashed):
                    x, pool, aux = run(g, li, hashed, x, None if pools is None else pools[g])
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
                    x, pool, aux = run(g, li, seg.hashed[j], x, None if ps is None else ps[g])
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
        opts = dataclasses.replace(opts, ops=ops_for(opts.attention_impl))  # (a Linear's `linear`)
        b, t = token_ids.shape
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        x = self.embed_streams(token_ids)
        collect = opts.indexer_aux or opts.routing_aux

        def layer(block, g, li, hashed, x, pool):
            x, aux = block(x, positions, token_ids, opts, li, hashed)
            return x, pool, aux

        x, _, auxs = self._run_layers(layer, x, None, opts, collect)
        routing = []
        stacks = layer_stacks(self.cfg).stacks
        for g in sorted(auxs):
            per_layer = [a for _, a in sorted(auxs[g], key=lambda e: e[0])]
            if opts.indexer_aux and "indexer" in per_layer[0]:
                self.sow(IndexerAux, "indexer_aux", jax.tree.map(lambda *a: jnp.stack(a),
                                                                 *[a["indexer"] for a in per_layer]))
            if "routing" in per_layer[0]:  # the stack's top-k layers (its last ones), as its selection biases
                routing.append(jnp.stack([a["routing"] for a in per_layer[stacks[g].n_hashed:]]))
        if opts.routing_aux:
            self.sow(RoutingAux, "routing", tuple(routing))
        logits = self.logits_from_streams(x)
        return (logits, x) if return_streams else logits

    def _cached_ops(self, meta, opts: RunOptions) -> RunOptions:
        ops = ops_for(opts.attention_impl)
        if opts.mesh_rules is not None:
            ops = mesh_ops(ops, opts.mesh_rules, rows_are_slots=meta.slot is None)
        return dataclasses.replace(opts, ops=ops)

    def _tapped(self, layer):
        """`layer` (a function of _run_layers) over (streams, taps): taps, one [B, T, D] per DSpark target layer,
        gets the mean over the streams of that layer's output (the official forward's `h.mean(dim=2)` after the
        layer runs)."""
        stacks = layer_stacks(self.cfg).stacks
        ids = self.cfg.dspark_target_layer_ids

        def run(block, g, li, hashed, xt, pool):
            x, taps = xt
            x, pool, aux = layer(block, g, li, hashed, x, pool)
            n = jnp.asarray(stacks[g].layers, jnp.int32)[li]  # the official layer index (li is traced in scans)
            mean = jnp.mean(x.astype(F32), axis=-2).astype(x.dtype)
            return (x, tuple(jnp.where(n == t, mean, a) for t, a in zip(ids, taps))), pool, aux

        return run

    def _no_taps(self, x):
        return tuple(jnp.zeros(x.shape[:-2] + x.shape[-1:], x.dtype) for _ in self.cfg.dspark_target_layer_ids)

    def cached_streams(self, token_ids, meta, pools, opts: RunOptions = RunOptions(), taps: bool = False):
        """One step over the pools: token_ids [B, T] at meta's positions. Returns (the final streams [B, T, N, D]
        of every token, before the head; pools with the step's writes), and with `taps` the DSpark target layers'
        mean streams concatenated [B, T, n_targets * D] after them."""
        opts = self._cached_ops(meta, opts)
        x = self.embed_streams(token_ids)

        def layer(block, g, li, hashed, x, pool):
            x, pool = block.cached(x, meta, token_ids, pool, li, opts.ops, opts, hashed)
            return x, pool, None

        if not taps:
            x, stacks, _ = self._run_layers(layer, x, pools.stacks, opts)
            return x, dataclasses.replace(pools, stacks=tuple(stacks))
        (x, t), stacks, _ = self._run_layers(self._tapped(layer), (x, self._no_taps(x)), pools.stacks, opts)
        return x, dataclasses.replace(pools, stacks=tuple(stacks)), jnp.concatenate(t, axis=-1)

    def taps_of(self, token_ids, opts: RunOptions = RunOptions()):
        """The full-sequence forward's DSpark taps [B, T, n_targets * D] (from position 0, no cache; the reference
        of the cached path's)."""
        opts = dataclasses.replace(opts, ops=ops_for(opts.attention_impl))
        b, t = token_ids.shape
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))

        def layer(block, g, li, hashed, x, pool):
            return block(x, positions, token_ids, opts, li, hashed)[0], pool, None

        x = self.embed_streams(token_ids)
        (_, taps), _, _ = self._run_layers(self._tapped(layer), (x, self._no_taps(x)), None, opts)
        return jnp.concatenate(taps, axis=-1)

    def cached(self, token_ids, meta, pools, opts: RunOptions = RunOptions()):
        """One step over the pools: token_ids [B, T] at meta's positions. Returns (logits [B, V] f32 of each
        row's last valid token, pools with the step's writes)."""
        x, pools = self.cached_streams(token_ids, meta, pools, opts)
        return self.logits_from_streams(last_valid(x, meta.n_valid)), pools

    def mtp_cached(self, hidden, next_ids, meta, pool, opts: RunOptions = RunOptions()):
        """The MTP block over its window pool: at meta's positions i, the main streams at i (hidden [B, T, N, D])
        and token i+1 (next_ids [B, T]). pool: a LayerPool with the MTP layer's window (swa [1, R, K]). Returns
        (the block's output streams [B, T, N, D], which also stand in for the main streams when it drafts again
        from its own draft; pool)."""
        opts = self._cached_ops(meta, opts)
        ops, mtp = opts.ops, self.mtp[0]
        x = mtp.streams_in(self.embed.weight[...][next_ids], hidden, opts)
        blk = mtp.block
        h, post, comb = blk.attn_input(x, ops)
        a, pool = blk.attn.cached(h, meta, pool, 0, ops, opts)
        x = ops.hc_post(a, x, post, comb)
        return blk.ffn_part(x, next_ids, opts, ops)[0], pool

    # -- the DSpark drafter (v4jax.engine.dspark runs it over its window rings) --
    def dspark_keys(self, taps, positions, opts: RunOptions = RunOptions()):
        """The DSpark draft layers' window keys of main positions: taps [B, T, n_targets * D] (the target layers'
        mean streams) at positions [B, T] -> [n_stages, B, T, K], each stage's kv_norm(wkv(main_x)) with RoPE
        (main_x = main_norm(main_proj(taps)), computed once by the first stage)."""
        main_x = self.mtp[0].main_x(taps, opts)
        out = []
        for stage in self.mtp:
            attn = stage.block.attn
            cos, sin = attn.rope(positions)
            out.append(attn.window_kv(main_x, cos, sin, opts))
        return jnp.stack(out)

    def dspark_streams(self, token_ids, positions, context, context_valid, opts: RunOptions = RunOptions()):
        """The DSpark draft layers over one block: token_ids [B, S] (the next token, then the noise token) at
        positions [B, S]; context [n_stages, B, W, K] each stage's window keys of the main positions before the
        block, valid where context_valid [B, W]. Every block token attends to the whole valid window and to the
        whole block (no causal mask inside the block: the official `get_dspark_topk_idxs`). Returns the last
        stage's output streams [B, S, N, D]."""
        opts = dataclasses.replace(opts, ops=ops_for(opts.attention_impl))
        ops = opts.ops
        x = self.embed_streams(token_ids)
        b, s = token_ids.shape
        valid = jnp.concatenate([context_valid, jnp.ones((b, s), bool)], axis=1)
        valid = jnp.broadcast_to(valid[:, None, :], (b, s, valid.shape[1]))
        for stage, ctx in zip(self.mtp, context):
            blk = stage.block
            attn = blk.attn
            cos, sin = attn.rope(positions)
            h, post, comb = blk.attn_input(x, ops)
            q, _ = attn.queries(h, cos, sin, opts)
            keys = jnp.concatenate([ctx.astype(q.dtype), attn.window_kv(h, cos, sin, opts)], axis=1)
            o, _ = L.attend(q, keys, valid, None, None, attn.attn_sink[...], self.cfg.head_dim ** -0.5)
            x = ops.hc_post(attn.output(o.astype(q.dtype), cos, sin, opts), x, post, comb)
            x = blk.ffn_part(x, token_ids, opts, ops)[0]
        return x

    def dspark_head(self, streams):
        """The last draft layer's output streams [..., N, D] -> (its collapsed output y [..., D] (the confidence
        head's input), the block's base logits [..., V] f32 (the shared head after the layer's own norm))."""
        last = self.mtp[-1]
        y = last.collapse(streams)
        return y, self.head_logits(last.norm(y))

    def mtp_head(self, streams):
        """The MTP block's output streams [..., N, D] -> logits [..., V] f32 (the shared head)."""
        return self.head_logits(self.mtp[0].collapse(streams))

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
