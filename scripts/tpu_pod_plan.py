#!/usr/bin/env python
"""Compile the engine's prefill and decode steps of a preset for a TPU pod slice on a CPU machine (libtpu AOT),
with abstract weights and pools sharded by sharding/rules.py: nothing is allocated. Prints, per device, XLA's
memory_analysis() beside the analytic bytes of the weights and pools as the mesh splits them.

  pip install --no-deps --target .libtpu libtpu==0.0.42.1
  PYTHONPATH=.libtpu:. python scripts/tpu_pod_plan.py --preset flash --topology v5p:2x2x2 --mesh tensor=8
  PYTHONPATH=.libtpu:. python scripts/tpu_pod_plan.py --preset pro --topology v5p:4x4x2 --mesh tensor=8,expert=4

One JSON line per step (`PLAN {...}`). tests/test_tpu_aot.py (-m slow) runs the Flash plan.
"""
import argparse
import functools
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402


def per_device_bytes(abstract_tree, shardings) -> int:
    """Bytes one device holds of a tree of arrays placed by these shardings."""
    total = 0
    for a, s in zip(jax.tree.leaves(abstract_tree), jax.tree.leaves(shardings)):
        total += math.prod(s.shard_shape(a.shape)) * np.dtype(a.dtype).itemsize
    return total


def plan(preset_name: str, topology: str, mesh_spec: str, slots: int, context: int, chunk: int, k: int):
    from jax.experimental import topologies

    from sharding import MeshRules, make_mesh
    from sharding.place import state_shardings
    from v4jax import cache as C
    from v4jax.config import preset
    from v4jax.engine import steps as S
    from v4jax.api import EngineOptions
    from v4jax.cache.layout import pool_layout
    from v4jax.model import RunOptions, Transformer

    topo = topologies.get_topology_desc(platform="tpu", topology_name=topology)
    mr = MeshRules(make_mesh(mesh_spec, topo.devices))
    cfg = preset(preset_name)
    dtype = jnp.bfloat16
    abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0), dtype=dtype, mtp=False))  # no MTP run
    graphdef, state = nnx.split(abstract)
    leaves, treedef = jax.tree.flatten(state)
    sh_leaves = jax.tree.leaves(state_shardings(state, mr))
    leaves = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s) for a, s in zip(leaves, sh_leaves)]

    # the engine's layout (EngineCore's pool_layout): full pages in data x context blocks, SWA pages per data shard
    n_data, n_ctx = mr.mesh.shape["data"], mr.mesh.shape["context"]
    options = EngineOptions(max_num_seqs=slots, prefill_chunk=chunk, decode_steps=k, enable_prefix_caching=False)
    layout = pool_layout(cfg, options, dtype, context, n_data, n_ctx)
    max_pages, max_swa = layout.max_pages_per_seq, layout.max_swa_pages_per_seq
    pools = jax.eval_shape(lambda: C.init_pools(cfg, layout, dtype))
    pool_sh = C.pool_shardings(pools, mr.sharding)
    pools = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), pools, pool_sh)
    from v4jax.cache.boundary import BoundaryStore
    store = BoundaryStore(layers=tuple(None for _ in pools.stacks))  # prefix cache off
    spec = S.StepSpec(graphdef, treedef, cfg, layout, RunOptions(mesh_rules=mr), k, context, False)
    rep = mr.replicated
    A = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=rep)  # noqa: E731
    i32, f32 = jnp.int32, jnp.float32
    samp = lambda n: S.SamplingState(A((n,), f32), A((n,), f32), A((n,), i32), A((n,), i32), A((n,), i32),  # noqa
                                     A((n,), i32))
    state = S.DecodeState(A((slots,), i32), A((slots,), i32), A((slots,), jnp.bool_), A((slots,), i32),
                          A((slots, S.MAX_STOP), i32), samp(slots))
    batch = S.PrefillBatch(A((1, chunk), i32), A((1,), i32), A((1,), i32), A((1,), jnp.bool_), A((1,), i32))
    steps = {
        "decode": (functools.partial(S._decode, spec),
                   (leaves, pools, store, state, A((slots, max_pages), i32), A((slots, max_swa), i32))),
        "prefill": (functools.partial(S._prefill, spec),
                    (leaves, pools, store, batch, A((1, max_pages), i32), A((1, max_swa), i32), samp(1))),
    }
    weights_dev = per_device_bytes(leaves, sh_leaves)
    pools_dev = per_device_bytes(pools, pool_sh)
    for name, (fn, args) in steps.items():
        t0 = time.time()
        row = dict(step=name, preset=preset_name, topology=topology, device_kind=topo.devices[0].device_kind,
                   devices=len(topo.devices), mesh=mesh_spec, slots=slots, context=context,
                   chunk=chunk if name == "prefill" else None, weights_per_device=weights_dev,
                   pools_per_device=pools_dev)
        try:
            compiled = jax.jit(fn, donate_argnums=(1, 2)).trace(*args).lower().compile()
            mem = compiled.memory_analysis()
            row.update(ok=True, **{f: int(getattr(mem, f)) for f in (
                "argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes", "temp_size_in_bytes",
                "generated_code_size_in_bytes") if getattr(mem, f, None) is not None})
        except Exception as e:  # noqa: BLE001 - an OOM or a compile error is the finding
            row.update(ok=False, error=f"{type(e).__name__}: {' | '.join(str(e).strip().splitlines()[:3])[:600]}")
        row["compile_seconds"] = round(time.time() - t0, 1)
        print("PLAN " + json.dumps(row), flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="flash")
    ap.add_argument("--topology", default="v5p:2x2x2")
    ap.add_argument("--mesh", default="tensor=8")
    ap.add_argument("--slots", type=int, default=32)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--decode-steps", type=int, default=8)
    a = ap.parse_args(argv)
    plan(a.preset, a.topology, a.mesh, a.slots, a.context, a.chunk, a.decode_steps)


if __name__ == "__main__":
    main()
