"""Official checkpoint names <-> paths in the NNX model, and filling an abstract model from a tensor stream."""
from __future__ import annotations

from typing import Iterable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from v4jax.model import Transformer

_MTP_OWN = {"e_proj", "h_proj", "enorm", "hnorm", "norm", "hc_head_fn", "hc_head_base", "hc_head_scale"}


def official_to_path(name: str) -> tuple[tuple, int | None]:
    """`layers.3.ffn.experts.7.w1.weight` -> (("layers", 3, "ffn", "experts", "w1"), 7); others -> (path, None)."""
    parts: list = [int(p) if p.isdigit() else p for p in name.split(".")]
    if parts[0] == "mtp" and parts[2] not in _MTP_OWN:
        parts.insert(2, "block")
    if "experts" in parts and parts[parts.index("experts") - 1] == "ffn" and isinstance(
            parts[parts.index("experts") + 1], int):
        i = parts.index("experts")
        expert = parts.pop(i + 1)
        assert parts[-1] == "weight", name
        return tuple(parts[:-1]), expert
    return tuple(parts), None


def _variable(model, path):
    node = model
    for p in path:
        node = node[p] if isinstance(p, int) else getattr(node, p)
    if not isinstance(node, nnx.Variable):
        raise KeyError(f"{'.'.join(map(str, path))} is not a parameter of the model")
    return node


def load_tensors(model: Transformer, tensors: Iterable[tuple[str, np.ndarray]]) -> Transformer:
    """Assign every (official name, array) to the model (abstract or concrete), casting to each parameter's
    dtype; routed experts are gathered per layer and assigned once. Every parameter must be assigned."""
    pending: dict[tuple, np.ndarray] = {}
    assigned: set[tuple] = set()
    for name, arr in tensors:
        path, expert = official_to_path(name)
        var = _variable(model, path)
        if expert is None:
            if tuple(var.shape) != tuple(arr.shape):
                raise ValueError(f"{name}: shape {tuple(arr.shape)} != model {tuple(var.shape)}")
            var.set_value(jnp.asarray(arr, dtype=var.dtype))
            assigned.add(path)
        else:
            buf = pending.get(path)
            if buf is None:
                buf = pending[path] = np.zeros(var.shape, dtype=np.float32)
            buf[expert] = arr
            if expert == var.shape[0] - 1:
                var.set_value(jnp.asarray(pending.pop(path), dtype=var.dtype))
                assigned.add(path)
    for path, buf in pending.items():
        var = _variable(model, path)
        var.set_value(jnp.asarray(buf, dtype=var.dtype))
        assigned.add(path)
    missing = []
    flat = nnx.to_flat_state(nnx.state(model))
    for path, var in flat:
        key = tuple(path)
        if key not in assigned:
            missing.append(".".join(map(str, key)))
    if missing:
        raise ValueError(f"parameters not found in the checkpoint: {missing[:8]}{' ...' if len(missing) > 8 else ''}")
    return model


def path_to_official(path: tuple) -> list[tuple[str, int | None]]:
    """Inverse of official_to_path for one model variable: [(official name, expert index or None)]."""
    parts = [str(p) for p in path]
    if parts[0] == "mtp" and parts[2] == "block":
        del parts[2]
    if len(parts) >= 2 and parts[-2] == "experts" and parts[-1] in ("w1", "w2", "w3"):
        return [(".".join(parts[:-1]) + ".{e}." + parts[-1] + ".weight", -1)]
    return [(".".join(parts), None)]


def model_to_official(model: Transformer) -> dict[str, np.ndarray]:
    """Every parameter under its official name as float32 numpy (int32 for tid2eid); experts split per expert."""
    out: dict[str, np.ndarray] = {}
    for path, var in nnx.to_flat_state(nnx.state(model)):
        arr = np.asarray(jax.device_get(var.get_value()))
        arr = arr if arr.dtype == np.int32 else arr.astype(np.float32)
        (name, expert), = path_to_official(tuple(path))
        if expert is None:
            out[name] = arr
        else:
            for e in range(arr.shape[0]):
                out[name.format(e=e)] = arr[e]
    return out
