"""Logical axes -> mesh axes. Changing a parallelism strategy is editing LOGICAL_RULES.

Every parameter dimension carries a logical name where the model creates it (`logical_axes` metadata of its
nnx.Param, the leading axis of a layer stack named "layers"); every pool dimension has one in POOL_AXES below
(v4jax.cache and the model's per-shard attention read it here). This table alone says which mesh axis, if any, each
name is split over.

Mesh axes by role: `data` (decode slots, their per-slot state and their pages), `context` (pages of a long sequence),
`tensor` (heads, q/o low-rank, MLP width, vocab), `expert` (routed experts).

Two rules make any table valid for any shape: a dimension the mesh axis does not divide stays whole, and a
mesh axis already used by an earlier dimension of the same array is not used again (wq_b's rows are heads over
`tensor`, so its q_lora columns stay whole)."""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "context", "tensor", "expert")

LOGICAL_RULES: dict[str, str | tuple[str, ...] | None] = {
    # parameters
    "layers": None,  # the leading axis of a layer stack (parameters and pools): every device holds every layer
    "vocab": "tensor",  # embedding and output-head rows
    "embed": None,  # the model width D
    "heads": "tensor",  # query heads: wq_b rows (heads x head_dim), attention sinks
    "q_lora": "tensor",  # the q low-rank: wq_a rows, q_norm
    "o_lora": "tensor",  # the grouped o low-rank: wo_a rows, wo_b columns (groups x o_lora_rank)
    "group_heads": None,  # wo_a columns: the heads of one output group x head_dim
    "head_dim": None,  # the one shared KV head
    "index_heads": "tensor",  # Lightning Indexer heads: its wq_b rows, weights_proj rows
    "compress": "tensor",  # compressor projections (overlap x head_dim): features pooled one by one
    "ratio": None,
    "router": None,  # gate rows: every device routes every token
    "routed": None,  # the k experts of a hash-routed token
    "hash_tokens": None,
    "experts": "expert",  # routed experts
    "mlp": "tensor",  # expert and shared-expert width
    "hc_mix": None,  # mHC mixing rows ((2 + N) x N)
    "hc_embed": "tensor",  # mHC's flattened streams (N x D): the mixing weights' columns
    "hc_scale": None,
    # pools (POOL_AXES, STORE_AXES)
    # Attention data parallelism: slots and their pages are split over `data` (full pages also over `context`),
    # one page allocator per block, so a device holds only its shard's pages (v4jax.cache.pages.PageTables).
    "slots": "data",  # per-slot compressor state (and the decode batch)
    "pool_rows": ("data", "context"),  # rows of the full-page pools (C4 KV, C4 indexer keys, C128 KV)
    "pages": ("data", "context"),  # the token pool's full pages
    "swa_rows": "data",  # rows of the SWA pool
    "boundary_rows": "data",  # boundary-state rows: one per SWA page, beside it
    "page_tokens": None,
    "index_head_dim": None,
    "window": None,
    "state_dim": None,
    "hot_rows": None,
    "counter_words": None,
    "counters": None,
}


# Logical axis names of every pool array (v4jax.cache.pools: pool field -> names of its dims) and of every array
# of the boundary store (v4jax.cache.boundary). Here, beside the rules, so that the cache and the model read one
# table (the model does not import the cache).
POOL_AXES: dict[str, tuple[str, ...]] = {
    "tokens": ("pages", "page_tokens"),
    "swa": ("layers", "swa_rows", "head_dim"),
    "kv": ("layers", "pool_rows", "head_dim"),
    "idx": ("layers", "pool_rows", "index_head_dim"),
    "state_kv": ("layers", "slots", "window", "state_dim"),
    "state_score": ("layers", "slots", "window", "state_dim"),
    "idx_state_kv": ("layers", "slots", "window", "state_dim"),
    "idx_state_score": ("layers", "slots", "window", "state_dim"),
    # the C4 KV's hot buffer under host offload (single device only)
    "kv_hot": ("layers", "hot_rows", "head_dim"),
    "hot_table": ("layers", "pool_rows"),
    "hot_owner": ("layers", "hot_rows"),
    "hot_used": ("layers", "hot_rows"),
    "hot_clock": ("layers",),
    "hot_counts": ("layers", "counter_words", "counters"),
}
STORE_AXES = ("layers", "boundary_rows", "window", "state_dim")

def parse_mesh_spec(spec: str | dict[str, int] | None) -> dict[str, int]:
    """`"data=2,tensor=4"` / a dict -> {axis: size}, checked against MESH_AXES."""
    if isinstance(spec, str):
        try:
            spec = {k.strip(): int(v) for k, v in (kv.split("=") for kv in spec.split(",") if kv.strip())}
        except ValueError:
            raise ValueError(f"mesh {spec!r}: expected axis=size pairs, e.g. 'data=2,tensor=4'") from None
    spec = dict(spec or {})
    bad = set(spec) - set(MESH_AXES)
    if bad:
        raise ValueError(f"unknown mesh axes {sorted(bad)}; known: {MESH_AXES}")
    small = [a for a, n in spec.items() if n < 1]
    if small:
        raise ValueError(f"mesh axes {small} need at least one device")
    return spec


def make_mesh(spec: str | dict[str, int] | None = None, devices=None) -> Mesh:
    """`"expert=4"` / `{"tensor": 2, "data": 2}` -> a Mesh over all MESH_AXES (unnamed axes have size 1), over
    every process's devices (jax.devices() is global under jax.distributed)."""
    spec = parse_mesh_spec(spec)
    shape = tuple(spec.get(a, 1) for a in MESH_AXES)
    devices = list(devices if devices is not None else jax.devices())
    n = int(np.prod(shape))
    if n > len(devices):
        raise ValueError(f"mesh {spec} needs {n} devices, {len(devices)} available")
    return Mesh(np.asarray(devices[:n]).reshape(shape), MESH_AXES)


def spec_for(logical: tuple[str | None, ...], shape: tuple[int, ...], mesh: Mesh,
             rules: dict | None = None) -> PartitionSpec:
    """PartitionSpec of an array from its dims' logical names (see the module doc for the two rules)."""
    rules = LOGICAL_RULES if rules is None else rules
    if len(logical) != len(shape):
        raise ValueError(f"logical axes {logical} do not match shape {shape}")
    used: set[str] = set()
    out = []
    for name, dim in zip(logical, shape):
        if name is not None and name not in rules:
            raise KeyError(f"logical axis {name!r} is not in the sharding rules")
        want = rules.get(name) if name else None
        axes = () if want is None else (want,) if isinstance(want, str) else tuple(want)
        axes = tuple(a for a in axes if mesh.shape[a] > 1 and a not in used)
        size = int(np.prod([mesh.shape[a] for a in axes])) if axes else 1
        if not axes or dim % size:
            out.append(None)
            continue
        used.update(axes)
        out.append(axes[0] if len(axes) == 1 else axes)
    return PartitionSpec(*out)


def split_factor(logical: tuple[str | None, ...], shape: tuple[int, ...], mesh_shape: dict[str, int],
                 rules: dict | None = None) -> int:
    """How many ways spec_for splits an array over a mesh of these axis sizes (axes left out have size 1): its
    bytes on one device are its bytes / this. No devices needed (the memory report and the fit check use it)."""
    import types
    mesh = types.SimpleNamespace(shape={a: int(mesh_shape.get(a, 1)) for a in MESH_AXES})
    f = 1
    for entry in spec_for(tuple(logical), tuple(shape), mesh, rules):
        for axis in () if entry is None else (entry,) if isinstance(entry, str) else entry:
            f *= mesh.shape[axis]
    return f


@dataclasses.dataclass(frozen=True)
class MeshRules:
    """A mesh and the rules table: what the model, the pools and the steps need to place arrays. Hashable, so it
    rides in the model's static RunOptions."""
    mesh: Mesh
    rules: tuple[tuple[str, Any], ...] = tuple(LOGICAL_RULES.items())

    @staticmethod
    def make(spec: str | dict[str, int] | Mesh | None, devices=None) -> "MeshRules | None":
        if spec is None or spec == "" or spec == {}:
            return None
        return MeshRules(spec if isinstance(spec, Mesh) else make_mesh(spec, devices))

    @property
    def table(self) -> dict:
        return dict(self.rules)

    def spec(self, logical, shape) -> PartitionSpec:
        return spec_for(tuple(logical), tuple(shape), self.mesh, self.table)

    def sharding(self, logical, shape) -> NamedSharding:
        return NamedSharding(self.mesh, self.spec(logical, shape))

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec())

    def constrain(self, x, logical):
        """with_sharding_constraint by logical names (inside jit)."""
        return jax.lax.with_sharding_constraint(x, self.sharding(logical, x.shape))

    def replicate(self, tree):
        """Every array of `tree` replicated (inside jit): what the host reads from every process."""
        return jax.tree.map(lambda a: jax.lax.with_sharding_constraint(a, self.replicated), tree)
