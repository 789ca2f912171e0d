"""The MoE of a DeepSeek-V4 layer (reference §6): the router (sqrtsoftplus top-k, or the hash table of the first
layers), the routed experts (the ops table's, per shard on a mesh) and the shared expert."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from v4jax.config import ModelConfig
from v4jax.model import layers as L
from v4jax.model import quant
from v4jax.model.layers import Linear, RunOptions, init_normal
from v4jax.model.ops import XLA, Ops, on_shards


F32 = jnp.float32

# Logical axes of the routed experts' weights (sharding/rules.py maps names to mesh axes).
EXPERT_UP_AXES = ("experts", "mlp", "embed")  # routed w1 / w3 [E, I, D]
EXPERT_DOWN_AXES = ("experts", "embed", "mlp")  # routed w2 [E, D, I]


class Buffer(nnx.Variable):
    """A non-trainable array that ships with the checkpoint (the hash-routing table)."""


class Gate(nnx.Module):
    """The router's weights: the gate [E, D] and either the hash table tid2eid [V, k] (a hash layer) or the
    selection bias [E]. In a layer stack (Transformer, `config.LayerStack`) the gate is [n, E, D], the table holds
    the stack's first `n_hashed` layers' [n_hashed, V, k] and the bias the rest's [n - n_hashed, E]."""

    def __init__(self, cfg: ModelConfig, hashed: bool, *, rngs, dtype):
        self.weight = nnx.Param(init_normal(rngs, (cfg.n_routed_experts, cfg.dim), cfg.dim ** -0.5, dtype),
                                logical_axes=("router", "embed"))
        self.n_hashed = int(hashed)
        if hashed:
            keys = jax.random.split(rngs.params(), cfg.vocab_size)
            perm = jax.vmap(lambda k: jax.random.permutation(k, cfg.n_routed_experts)[: cfg.n_activated_experts])(keys)
            self.tid2eid, self.bias = Buffer(perm.astype(jnp.int32), logical_axes=("hash_tokens", "routed")), None
        else:
            self.tid2eid, self.bias = None, nnx.Param(init_normal(rngs, (cfg.n_routed_experts,), 0.1, F32),
                                                      logical_axes=("router",))

    def selection(self, token_ids, layer, hashed):
        """(the hash table's experts for the tokens [M, k] or None, the selection bias [E] or None, the traced
        pick between them or None) of one layer: `layer` None (the gate is one layer's) or its index in the stack,
        `hashed` whether it is hash-routed (None: the index says, traced)."""
        table = None if self.tid2eid is None else self.tid2eid[...]
        bias = None if self.bias is None else self.bias[...]
        if layer is None:
            return None if table is None else table[token_ids], bias, None
        nh = self.n_hashed
        if table is None or bias is None:  # one router kind in the stack
            hashed = table is not None
        elif hashed is None and isinstance(layer, int):
            hashed = layer < nh
        if hashed is True:
            return table[layer, token_ids], None, None
        if hashed is False:
            return None, L.layer_slice(bias, layer - nh), None
        layer = jnp.asarray(layer, jnp.int32)
        return (table[jnp.minimum(layer, nh - 1), token_ids], L.layer_slice(bias, jnp.maximum(layer - nh, 0)),
                layer < nh)


EXPERTS_PER_DRAW = 8  # experts drawn (and quantized) at once by an eager random init


def _draw_expert(key, e, shape, std, dtype, storage):
    """Expert e's random weight: N(0, std^2) from fold_in(key, e), drawn in f32, cast to dtype and, with a storage
    format, quantized as the release's converter would."""
    w = (jax.random.normal(jax.random.fold_in(key, e), shape, F32) * std).astype(dtype)
    return w if storage is None else quant.quantize(w, storage)


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4, 5))
def _draw_experts_in_chunks(key, n, shape, std, dtype, storage):
    return jax.lax.map(lambda e: _draw_expert(key, e, shape, std, dtype, storage), jnp.arange(n),
                       batch_size=min(n, EXPERTS_PER_DRAW))


def draw_experts(key, n: int, shape: tuple, std: float, dtype, storage: str | None):
    """n experts' random weights [n, *shape] (expert e from fold_in(key, e)), or (values, scales) as `storage`
    stores them. Eagerly a few experts at a time: a layer's f32 draw and its bf16 copy never exist whole (flash-h200
    holds 113.6 GiB of stored weights, and a layer of its experts is 10.5 GiB in bf16, 21 in f32). Under a trace
    (a sharded init, eval_shape) all at once (vmap: the same values), so the mesh splits the work by expert."""
    if isinstance(key, jax.core.Tracer):
        return jax.vmap(lambda e: _draw_expert(key, e, shape, std, dtype, storage))(jnp.arange(n))
    return _draw_experts_in_chunks(key, n, tuple(shape), float(std), jnp.dtype(dtype), storage)


class Experts(nnx.Module):
    """Routed experts stacked on a leading axis: w1/w3 [E, I, D] (gate/up), w2 [E, D, I] (down); as the release
    stores them (`storage`: "fp4", or "fp8" as its first Flash release): the stored values and w1_scale / w2_scale /
    w3_scale their ue8m0 block scales."""

    def __init__(self, cfg: ModelConfig, *, rngs, dtype, storage: str | None = None):
        e, i, d = cfg.n_routed_experts, cfg.moe_inter_dim, cfg.dim
        self.storage = storage  # "fp4" | "fp8" as stored, None in dtype
        self.w1_scale = self.w2_scale = self.w3_scale = None
        for name, shape, std, axes in (("w1", (i, d), d ** -0.5, EXPERT_UP_AXES),
                                       ("w2", (d, i), i ** -0.5, EXPERT_DOWN_AXES),
                                       ("w3", (i, d), d ** -0.5, EXPERT_UP_AXES)):
            drawn = draw_experts(rngs.params(), e, shape, std, dtype, storage)
            if storage is None:
                setattr(self, name, nnx.Param(drawn, logical_axes=axes))
            else:
                setattr(self, name, nnx.Param(drawn[0], logical_axes=axes))
                setattr(self, name + "_scale", nnx.data(nnx.Param(drawn[1], logical_axes=axes)))

    def weights(self):
        """(w1, w2, w3): arrays, or quant.Quantized as stored."""
        if self.storage is None:
            return self.w1[...], self.w2[...], self.w3[...]
        return tuple(quant.Quantized(getattr(self, n)[...], getattr(self, n + "_scale")[...], self.storage)
                     for n in ("w1", "w2", "w3"))


def _mesh_axes(entry) -> tuple[str, ...]:
    """A PartitionSpec entry as a tuple of mesh axes."""
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


DENSE_ROWS_PER_EXPERT = 8


def routed_experts(x, weights, experts, w1, w2, w3, limit, layer=None, *, ops: Ops = XLA, mesh_rules=None,
                   act_quant: bool = False):
    """The ops table's experts (default the XLA forms), on a mesh run per shard (shard_map): a shard holds some
    experts (expert parallel) and a slice of each one's width (tensor), runs its experts on every token routed to
    them, and the partial outputs add up over those mesh axes. Tokens are not dispatched: every shard sees the
    step's (few) tokens, so the only collective is the sum of [M, D]. `layer`: w1/w2/w3 are a layer stack and this
    is the layer's index in it (a kernel reads the shard's stack in place). act_quant: the release's numerics
    (v4jax.model.layers.routed_experts)."""
    if mesh_rules is None:
        return ops.experts(x, weights, experts, w1, w2, w3, limit, layer, act_quant=act_quant)
    from jax.sharding import PartitionSpec as P
    stack = () if layer is None else ("layers",)
    up, down = mesh_rules.spec(stack + EXPERT_UP_AXES, w1.shape), mesh_rules.spec(stack + EXPERT_DOWN_AXES, w2.shape)
    e_axes, sum_axes = _mesh_axes(up[-3]), _mesh_axes(up[-3]) + _mesh_axes(up[-2])
    if not sum_axes and not ops.per_shard:
        return ops.experts(x, weights, experts, w1, w2, w3, limit, layer, act_quant=act_quant)

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
                        layer, form, act_quant=act_quant)
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
        ws = [self.w1.weight.get_value(), self.w3.weight.get_value()]
        if self.w1.scale is not None:  # as stored: x rounded to FP8 in the kernel
            scales = [self.w1.scale.get_value(), self.w3.scale.get_value()]
            h1, h3 = (project or XLA.project)(x, ws, scales, act_quant=True)
        else:
            xq = quant.fp8_roundtrip(x, 128) if opts.quant_sim else x  # as Linear rounds the input of w1 and w3
            h1, h3 = (project or XLA.project)(xq, ws)
        h1 = self.w1(x, opts) if h1 is None else h1.astype(x.dtype)  # rounded as Linear returns it
        h3 = self.w3(x, opts) if h3 is None else h3.astype(x.dtype)
        h = L.swiglu(h1.astype(F32), h3.astype(F32), limit)
        return self.w2(h.astype(x.dtype), opts)


class MoE(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, *, rngs, dtype, experts_storage: str | None = None):
        self.cfg = cfg
        self.gate = Gate(cfg, cfg.is_hash_layer(layer_id), rngs=rngs, dtype=dtype)
        self.experts = Experts(cfg, rngs=rngs, dtype=dtype, storage=experts_storage)
        self.shared_experts = SharedExpert(cfg, rngs=rngs, dtype=dtype) if cfg.n_shared_experts else None

    @property
    def topk(self) -> bool:
        """Some layer of this gate routes by top-k (every layer but the hash layers)."""
        return self.gate.bias is not None

    def __call__(self, x, token_ids, opts: RunOptions, experts_fn=None, layer=None, project=None, hashed=None):
        """Returns (y like x, the chosen experts [B*T, k] int32). experts_fn: the ops table's `experts` (on a mesh
        already per shard, mesh_ops; None: the XLA forms, per shard on a mesh); layer: the index of this layer in
        its stack when the weights are the whole stack (see Transformer._run_layers), with `hashed` its router
        kind (None: by the index); project: the ops table's `project`, for the shared expert."""
        cfg = self.cfg
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        table_experts, bias, pick = self.gate.selection(token_ids.reshape(-1), layer, hashed)
        w, idx = L.route_by(flat, self.gate.weight[...], bias, table_experts, cfg, pick)
        act_quant = opts.quant_sim or self.experts.storage is not None  # the release's numerics
        xin = quant.fp8_roundtrip(flat, 128) if act_quant else flat
        experts_fn = experts_fn or functools.partial(routed_experts, mesh_rules=opts.mesh_rules)
        y = experts_fn(xin, w, idx, *self.experts.weights(), cfg.swiglu_limit, layer, act_quant=act_quant)
        if self.shared_experts is not None:
            y = y + self.shared_experts(flat, cfg.swiglu_limit, opts, project).astype(F32)
        return y.astype(x.dtype).reshape(shape), idx
