"""Official checkpoint names <-> paths in the NNX model, and filling an abstract model from a tensor stream.

Main layers live in stacks (`config.layer_stacks`): official `layers.N.<rest>` is `stacks.<g>.<rest>` at index i
of the leading axis, (g, i) = layer_stacks(cfg).where[N], but for the router's selection bias, held for the
stack's top-k layers alone (`ffn.gate.bias` at index i - n_hashed; the hash tables `ffn.gate.tid2eid` are the
first n_hashed, at i); routed experts `...ffn.experts.E.w1.weight` are a further index into `...ffn.experts.w1`.
The loader fills each stacked array directly (one buffer per stacked parameter, assigned once every layer /
expert of it has arrived)."""
from __future__ import annotations

import hashlib
from typing import Iterable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from v4jax.config import ModelConfig, layer_stacks
from v4jax.model import Transformer

_STORED_DTYPES = {np.dtype(jnp.float8_e4m3fn), np.dtype(jnp.uint8), np.dtype(jnp.float8_e8m0fnu)}
# what an `mtp.N.` module holds beside its block: the MTP block's own tensors, a DSpark draft layer's heads
_MTP_OWN = {"e_proj", "h_proj", "enorm", "hnorm", "norm", "hc_head_fn", "hc_head_base", "hc_head_scale",
            "main_proj", "main_norm", "markov_head", "confidence_head"}


def official_to_path(name: str, cfg: ModelConfig) -> tuple[tuple, tuple[int, ...]]:
    """An official tensor name -> (model path, indices into the parameter's leading axes):
    `layers.3.ffn.experts.7.w1.weight` -> (("stacks", g, "ffn", "experts", "w1"), (i, 7)) with layer 3 at index i
    of stack g; `mtp.0.ffn.experts.7.w1.weight` -> (("mtp", 0, "block", "ffn", "experts", "w1"), (7,));
    `embed.weight` -> (("embed", "weight"), ())."""
    parts: list = [int(p) if p.isdigit() else p for p in name.split(".")]
    index: list[int] = []
    if parts[0] == "layers" and len(parts) > 2 and isinstance(parts[1], int):
        if not 0 <= parts[1] < cfg.n_layers:
            raise KeyError(f"{name}: the model has {cfg.n_layers} layers")
        g, i = layer_stacks(cfg).where[parts[1]]
        parts[:2] = ["stacks", g]
        index.append(i - _bias_offset(cfg, parts))
    if parts[0] == "mtp" and len(parts) > 2 and parts[2] not in _MTP_OWN:
        parts.insert(2, "block")
    if "experts" in parts and parts[parts.index("experts") - 1] == "ffn" and isinstance(
            parts[parts.index("experts") + 1], int):
        j = parts.index("experts")
        index.append(parts.pop(j + 1))
        assert parts[-1] in ("weight", "scale"), name
        if parts[-1] == "scale":  # the block scales of an expert weight kept as stored (moe.Experts)
            return tuple(parts[:-2]) + (f"{parts[-2]}_scale",), tuple(index)
        return tuple(parts[:-1]), tuple(index)
    return tuple(parts), tuple(index)


def _bias_offset(cfg: ModelConfig, parts: list) -> int:
    """Rows of stack parts[1] before its first selection bias: its hash layers' (for `ffn.gate.bias`), else 0."""
    if [str(p) for p in parts[2:]] != ["ffn", "gate", "bias"]:
        return 0
    return layer_stacks(cfg).stacks[int(parts[1])].n_hashed


def _variable(model, path):
    node = model
    for p in path:
        node = node[p] if isinstance(p, int) else getattr(node, p)
    if not isinstance(node, nnx.Variable):
        raise KeyError(f"{'.'.join(map(str, path))} is not a parameter of the model")
    return node


def load_tensors(model: Transformer, tensors: Iterable[tuple[str, np.ndarray]], mesh_rules=None) -> Transformer:
    """Assign every (official name, array) to the model (abstract or concrete), casting to each parameter's
    dtype. Each tensor goes straight to the device(s) that hold it: with `mesh_rules` (sharding.MeshRules) into
    its parameter's shards. A stacked parameter (layers of a stack, routed experts) is allocated once in its
    shards and each slice written in place as it arrives, so the host holds about one tensor at a time. Every
    parameter must be assigned."""
    from sharding.place import empty, put, put_slice, variable_axes

    cfg = model.cfg
    pending: dict[tuple, tuple[jax.Array, set]] = {}
    assigned: set[tuple] = set()
    for name, arr in tensors:
        path, index = official_to_path(name, cfg)
        var = _variable(model, path)
        shape = tuple(var.shape)
        if tuple(arr.shape) != shape[len(index):]:
            raise ValueError(f"{name}: shape {tuple(arr.shape)} != model {shape[len(index):]}")
        sharding = None if mesh_rules is None else mesh_rules.sharding(variable_axes(var, name), shape)
        host = np.asarray(arr)
        if var.dtype in _STORED_DTYPES and host.dtype not in (np.dtype(var.dtype), np.dtype(np.int8)):
            raise ValueError(f"{name}: {host.dtype} values for a parameter held as stored ({var.dtype})")
        # packed FP4 is int8 in the checkpoint, its bytes uint8 in the model
        host = host.view(np.uint8) if host.dtype == np.int8 and var.dtype == np.uint8 else host.astype(var.dtype)
        if not index:
            var.set_value(put(host, sharding))
            assigned.add(path)
            continue
        if path not in pending:
            pending[path] = (empty(shape, var.dtype, sharding), set())
        buf, seen = pending[path]
        buf = put_slice(buf, host, index)
        seen.add(index)
        pending[path] = (buf, seen)
        if len(seen) == int(np.prod(shape[:len(index)])):
            var.set_value(pending.pop(path)[0])
            assigned.add(path)
    missing = []
    for path, (buf, seen) in pending.items():
        lead = buf.shape[:len(next(iter(seen)))]
        missing += [_official_name(cfg, path, idx) for idx in np.ndindex(*lead) if tuple(idx) not in seen]
    for path, _ in nnx.to_flat_state(nnx.state(model)):
        key = tuple(path)
        if key not in assigned and key not in pending:
            missing.append(".".join(map(str, key)))
    if missing:
        raise ValueError(f"parameters not found in the checkpoint: {missing[:8]}{' ...' if len(missing) > 8 else ''}")
    return model


def _n_lead(path: tuple) -> int:
    """Leading axes of a model parameter that index official tensors (its stack's layers, routed experts)."""
    names = [str(p) for p in path]
    return (names[0] == "stacks") + (len(names) >= 2 and names[-2] == "experts"
                                     and names[-1] in ("w1", "w2", "w3", "w1_scale", "w2_scale", "w3_scale"))


def _official_name(cfg: ModelConfig, path: tuple, index: tuple[int, ...]) -> str:
    """Inverse of official_to_path."""
    parts = [str(p) for p in path]
    index = list(index)
    if parts[0] == "stacks":
        layer = layer_stacks(cfg).stacks[int(parts[1])].layers[index.pop(0) + _bias_offset(cfg, parts)]
        parts[:2] = ["layers", str(layer)]
    if parts[0] == "mtp" and len(parts) > 2 and parts[2] == "block":
        del parts[2]
    if index:  # routed experts
        w, kind = parts[-1].split("_") if parts[-1].endswith("_scale") else (parts[-1], "weight")
        return ".".join(parts[:-1] + [str(index[0]), w, kind])
    return ".".join(parts)


def model_to_official(model: Transformer) -> dict[str, np.ndarray]:
    """Every parameter under its official name as float32 numpy (int32 for tid2eid); stacks split per layer,
    experts per expert."""
    cfg = model.cfg
    out: dict[str, np.ndarray] = {}
    for path, var in nnx.to_flat_state(nnx.state(model)):
        path = tuple(path)
        arr = np.asarray(jax.device_get(var.get_value()))
        arr = arr if arr.dtype == np.int32 else arr.astype(np.float32)
        for idx in np.ndindex(*arr.shape[:_n_lead(path)]):
            out[_official_name(cfg, path, tuple(idx))] = arr[idx]
    return out


# ---- a digest of the weights, to tell one model's weights from another's (prefill/decode disaggregation) ----
_BITS = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}
_MIX = (0x9E3779B1, 0x85EBCA77, 0xC2B2AE3D, 0x27D4EB2F, 0x165667B1)  # odd multipliers (xxhash's primes)


def _leaf_checksum(x):
    """sum over elements of (bits + 1) * (odd hash of the element's index), mod 2**32: integer sums are exact in any
    order, so every mesh (and the host) gets the same value for the same array."""
    bits = jax.lax.bitcast_convert_type(x, _BITS[x.dtype.itemsize]).astype(jnp.uint32)
    pos = jnp.ones(x.shape, jnp.uint32)
    for d in range(x.ndim):
        pos = pos + jax.lax.broadcasted_iota(jnp.uint32, x.shape, d) * jnp.uint32(_MIX[d % len(_MIX)])
    return jnp.sum((bits + jnp.uint32(1)) * (pos * jnp.uint32(_MIX[0]) | jnp.uint32(1)), dtype=jnp.uint32)


def weights_checksum(state) -> str:
    """A digest of a model's parameters (an nnx State, or its leaves in a pytree): every leaf's path, shape,
    dtype and a checksum of its bits, computed where the leaves are (one pass over the weights, one jitted
    program). Equal weights give equal digests on any mesh; weights that differ in one element differ."""
    leaves = jax.tree.leaves_with_path(state)
    for path, x in leaves:
        if np.dtype(x.dtype).itemsize not in _BITS:
            raise TypeError(f"weights_checksum: {jax.tree_util.keystr(path)} is {x.dtype}")
    sums = jax.device_get(jax.jit(lambda xs: [_leaf_checksum(x) for x in xs])([x for _, x in leaves]))
    h = hashlib.sha256()
    for (path, x), s in zip(leaves, sums):
        h.update(f"{jax.tree_util.keystr(path)}|{tuple(x.shape)}|{np.dtype(x.dtype).name}|{int(s)}\n".encode())
    return h.hexdigest()[:32]
