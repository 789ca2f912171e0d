"""Arrays created and loaded straight into their shards.

Nothing the size of the model passes through one device or one host: a model's (or a pool tree's) abstract
shapes come first (nnx.eval_shape / jax.eval_shape), their shardings from the logical names (rules.py), then one
jit with those out_shardings creates every array in place; a checkpoint tensor goes to its shards as it is read
(`put`, `put_slice`), so a host holds about one tensor at a time."""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from sharding.rules import MeshRules


def _is_variable(x) -> bool:
    return isinstance(x, nnx.Variable)


def variable_axes(var: nnx.Variable, where: str = "a parameter") -> tuple:
    """The logical axis names a model variable was created with (one per dimension)."""
    axes = var.get_metadata().get("logical_axes")
    if axes is None or len(axes) != len(var.shape):
        raise ValueError(f"{where} of shape {tuple(var.shape)} has logical axes {axes}: every parameter is created "
                         "with one logical name per dimension")
    return tuple(axes)


def state_shardings(state: nnx.State, mr: MeshRules) -> nnx.State:
    """The NamedSharding of every variable of an NNX state (abstract or concrete), same tree."""
    return jax.tree.map(lambda v: v.replace(value=mr.sharding(variable_axes(v), v.shape)), state,
                        is_leaf=_is_variable)


def create_model(make: Callable[[], nnx.Module], mr: MeshRules | None) -> nnx.Module:
    """`make()` built directly sharded: its abstract state first, then one jit whose outputs are the variables
    in their shards (the random init is the same maths as an eager `make()`)."""
    if mr is None:
        return make()
    graphdef, abstract = nnx.split(nnx.eval_shape(make))
    state = jax.jit(lambda: nnx.state(make()), out_shardings=state_shardings(abstract, mr))()
    return nnx.merge(graphdef, state)


def create_sharded(make: Callable, shardings_of: Callable, mr: MeshRules | None):
    """A pytree of arrays `make()` created in its shards: `shardings_of(abstract tree, mr)` gives the tree of
    NamedShardings."""
    if mr is None:
        return make()
    return jax.jit(make, out_shardings=shardings_of(jax.eval_shape(make), mr))()


def put(host: np.ndarray, sharding: NamedSharding | None) -> jax.Array:
    """A host array into its shards (each process supplies the shards of its own devices)."""
    if sharding is None:
        return jnp.asarray(host)
    return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])


def _update_slice(buf, piece, index):
    start = tuple(index) + (0,) * (buf.ndim - index.shape[0])
    return jax.lax.dynamic_update_slice(buf, piece.reshape((1,) * index.shape[0] + piece.shape), start)


# One program per (shape, sharding) of a stacked parameter; the index is traced, so every slice reuses it.
_update_slice_donated = jax.jit(_update_slice, donate_argnums=0)


def empty(shape, dtype, sharding: NamedSharding | None) -> jax.Array:
    """Zeros of a stacked parameter, allocated in its shards, for put_slice to fill."""
    if sharding is None:
        return jnp.zeros(shape, dtype)
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)()


def put_slice(buf: jax.Array, host: np.ndarray, index: tuple[int, ...]) -> jax.Array:
    """buf[index] = host in place (buf donated): one layer / expert of a stacked parameter written into the
    shards that hold it; the piece travels sharded as its slot of buf is."""
    sh = buf.sharding
    if isinstance(sh, NamedSharding):
        spec = tuple(sh.spec) + (None,) * (buf.ndim - len(sh.spec))
        piece = put(host, NamedSharding(sh.mesh, PartitionSpec(*spec[len(index):])))
    else:
        piece = jnp.asarray(host)
    return _update_slice_donated(buf, piece, np.asarray(index, np.int32))


def addressable_bytes_per_device(tree) -> dict:
    """device -> bytes of `tree`'s arrays whose shards it holds."""
    out: dict = {}
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            out[shard.device] = out.get(shard.device, 0) + shard.data.nbytes
    return out
