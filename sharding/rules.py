"""Logical axes -> mesh axes. Changing a parallelism strategy is editing LOGICAL_RULES.

Mesh axes by role: `data` (decode slots and their per-slot state), `context` (pages of a long sequence),
`tensor` (heads, MLP width, vocab), `expert` (routed experts)."""
from __future__ import annotations

import dataclasses

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "context", "tensor", "expert")

LOGICAL_RULES: dict[str, str | None] = {
    # parameters
    "vocab": "tensor",
    "embed": None,
    "heads_x_dim": "tensor",  # H*K of wq_b rows / wo_a columns
    "q_lora": None,
    "experts": "expert",
    "mlp": "tensor",
    "layers": None,  # the leading axis of stacked layers (parameters and pools)
    # pools (v4jax.cache.LOGICAL_AXES)
    "slots": "data",
    "pool_rows": None,
    "pages": None,
    "page_tokens": None,
    "head_dim": None,
    "index_head_dim": None,
    "window": None,
    "state_dim": None,
}


def make_mesh(spec: str | dict[str, int] | None = None, devices=None) -> Mesh:
    """`"expert=4"` / `{"tensor": 2, "data": 2}` -> a Mesh over all MESH_AXES (unnamed axes have size 1)."""
    if isinstance(spec, str):
        spec = {k: int(v) for k, v in (kv.split("=") for kv in spec.split(",") if kv)}
    spec = dict(spec or {})
    bad = set(spec) - set(MESH_AXES)
    if bad:
        raise ValueError(f"unknown mesh axes {sorted(bad)}; known: {MESH_AXES}")
    shape = tuple(spec.get(a, 1) for a in MESH_AXES)
    devices = list(devices if devices is not None else jax.devices())
    n = int(np.prod(shape))
    if n > len(devices):
        raise ValueError(f"mesh {spec} needs {n} devices, {len(devices)} available")
    return Mesh(np.asarray(devices[:n]).reshape(shape), MESH_AXES)


def spec_for(logical: tuple[str | None, ...], shape: tuple[int, ...], mesh: Mesh) -> PartitionSpec:
    """PartitionSpec from logical names; a dimension the mesh axis does not divide stays replicated."""
    out = []
    for name, dim in zip(logical, shape):
        axis = LOGICAL_RULES.get(name) if name else None
        out.append(axis if axis and dim % mesh.shape[axis] == 0 and mesh.shape[axis] > 1 else None)
    return PartitionSpec(*out)


def param_logical_axes(path: tuple, shape: tuple[int, ...]) -> tuple[str | None, ...]:
    """Logical axes of a model parameter from its model path (stacked layers: `stacks.<g>....`, a leading
    "layers" axis)."""
    names = [str(p) for p in path]
    if names[0] == "stacks":
        return ("layers",) + param_logical_axes(tuple(names[2:]), shape[1:])
    leaf = names[-1]
    if "experts" in names and leaf in ("w1", "w3"):
        return ("experts", "mlp", None)
    if "experts" in names and leaf == "w2":
        return ("experts", None, "mlp")
    if names[0] in ("embed", "head") and leaf == "weight":
        return ("vocab", "embed")
    return (None,) * len(shape)


def shard_params(model, mesh: Mesh):
    """Place every parameter of an NNX model by the rules (in place)."""
    for path, var in nnx.to_flat_state(nnx.state(model)):
        spec = spec_for(param_logical_axes(tuple(path), var.value.shape), var.value.shape, mesh)
        var.value = jax.device_put(var.value, NamedSharding(mesh, spec))
    return model


def shard_pools(pools, mesh: Mesh):
    """Place every pool array by v4jax.cache.LOGICAL_AXES."""
    from v4jax.cache import LOGICAL_AXES

    def place(name, arr):
        if arr is None:
            return None
        return jax.device_put(arr, NamedSharding(mesh, spec_for(LOGICAL_AXES[name], arr.shape, mesh)))

    stacks = tuple(dataclasses.replace(lp, **{f.name: place(f.name, getattr(lp, f.name))
                                              for f in dataclasses.fields(lp)}) for lp in pools.stacks)
    return dataclasses.replace(pools, tokens=place("tokens", pools.tokens), stacks=stacks)
