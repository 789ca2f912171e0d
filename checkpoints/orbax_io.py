"""Orbax checkpoints of the model's parameters: written from the shards of one mesh, restored onto any mesh.

    OUT/config.json            HF config (ModelConfig.to_hf_dict), and the source's tokenizer files
    OUT/v4jax_orbax.json       {"dtype", "mtp", "mesh", "groups"}
    OUT/params/<group>/        one orbax PyTree checkpoint per group: "top" (embeddings, head, final norm and
                               mHC), "stacks.<g>" (one layer stack), "mtp.<j>"

Parameters travel as the model's pure state dict (nnx.to_pure_dict). Every process writes the shards it holds;
restoring reads each array straight into the target sharding given (so a checkpoint written on `expert=8` loads
on `tensor=4,expert=2`, or on one device), one group at a time behind a progress bar, casting to the target's
dtype."""
from __future__ import annotations

import json
import os

META_FILE = "v4jax_orbax.json"
PARAMS_DIR = "params"
TOP = "top"


def is_orbax_dir(path) -> bool:
    return os.path.isfile(os.path.join(os.fspath(path), META_FILE))


def _groups(pure: dict) -> dict[str, dict]:
    """group name -> sub-dict: each layer stack / MTP block alone, everything else together."""
    out: dict[str, dict] = {TOP: {}}
    for key, val in pure.items():
        if isinstance(val, dict) and val and all(isinstance(k, int) for k in val):
            for i, sub in val.items():
                out[f"{key}.{i}"] = sub
        else:
            out[TOP][key] = val
    return out


def _ungroup(groups: dict[str, dict]) -> dict:
    pure = dict(groups.get(TOP, {}))
    for name, sub in groups.items():
        if name == TOP:
            continue
        key, i = name.rsplit(".", 1)
        pure.setdefault(key, {})[int(i)] = sub
    return pure


def _bar(total: int, desc: str, progress: bool):
    from tqdm import tqdm  # a text bar on terminals only (disable=None)
    return tqdm(total=total, unit="group", desc=desc, disable=None if progress else True, leave=False)


def save(out_dir, pure: dict, config: dict, meta: dict, progress: bool = True) -> None:
    """Write the pure state dict `pure` (arrays, possibly sharded across processes) and its HF `config`."""
    import jax
    import orbax.checkpoint as ocp

    out_dir = os.path.abspath(os.fspath(out_dir))
    groups = _groups(pure)
    ckptr = ocp.StandardCheckpointer()
    with _bar(len(groups), f"writing {os.path.basename(out_dir)}", progress) as bar:
        for name, tree in groups.items():
            ckptr.save(os.path.join(out_dir, PARAMS_DIR, name), tree, force=True)
            ckptr.wait_until_finished()
            bar.update(1)
    if jax.process_index() == 0:
        with open(os.path.join(out_dir, "config.json"), "w") as f:
            json.dump(config, f, indent=2)
        with open(os.path.join(out_dir, META_FILE), "w") as f:
            json.dump(dict(meta, groups=sorted(groups)), f, indent=2)


def read_meta(path) -> dict:
    with open(os.path.join(os.fspath(path), META_FILE)) as f:
        return json.load(f)


def restore(path, target: dict, progress: bool = True) -> dict:
    """The pure state dict, every array restored into `target`'s leaf (a jax.ShapeDtypeStruct with a sharding:
    its shape, dtype and placement)."""
    import orbax.checkpoint as ocp

    path = os.path.abspath(os.fspath(path))
    want = _groups(target)
    have = set(read_meta(path)["groups"])
    missing = sorted(set(want) - have)
    if missing:
        raise ValueError(f"{path}: the orbax checkpoint has no {missing} (it holds {sorted(have)})")
    ckptr = ocp.StandardCheckpointer()
    out = {}
    with _bar(len(want), f"restoring {os.path.basename(path)}", progress) as bar:
        for name, tree in want.items():
            out[name] = ckptr.restore(os.path.join(path, PARAMS_DIR, name), tree)
            bar.update(1)
    return _ungroup(out)
