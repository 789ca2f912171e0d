"""Run by tests/test_sharding.py in a subprocess with 8 fake CPU devices (the device count is fixed at JAX start):
a checkpoint loaded onto a mesh (its values and bytes per device), an orbax checkpoint restored onto it, and one
single-device reference run, then the same requests on each mesh given (with how the pools were split, the
prefix-cache hits and the data shards that held slots); prints one JSON line per check.

    python tests/mesh_worker.py --meshes data=2,tensor=2,expert=2 tensor=8 [--checkpoint DIR [--memory-mesh M]]
"""
import argparse
import json
import time

import jax
import numpy as np

jax.config.update("jax_default_matmul_precision", "highest")

from flax import nnx  # noqa: E402

from sharding.place import addressable_bytes_per_device  # noqa: E402
from v4jax import LLM, SamplingParams  # noqa: E402
from v4jax.memory import engine_pool_bytes  # noqa: E402

# Short prompts, one prefill chunk and one page each, so every run compiles one prefill and one decode program.
PROMPTS = [[3, 4, 5] * 5, [7, 8] * 6, [11, 12, 13]]
SAMPLING = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=True)
OPTIONS = dict(dtype="float32", max_num_seqs=4, max_model_len=64, prefill_chunk=16, decode_steps=4)
# The mesh runs: pages of 16 tokens, and the second prompt shares the first's first page. It waits until the first
# has cached that page, then is admitted beside it (its data shard) with a hit; the others spread over the shards.
MESH_PROMPTS = [[3, 4, 5] * 6, [3, 4, 5] * 5 + [3, 9, 9, 9], [7, 8] * 6, [11, 12, 13]]
MESH_OPTIONS = dict(OPTIONS, max_num_seqs=8, page_size=16)


def emit(**kw):
    print("RESULT " + json.dumps(kw), flush=True)


def param_bytes(model) -> tuple[int, int]:
    """(most bytes on one device, total bytes) of the model's parameters."""
    state = nnx.state(model)
    total = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))
    return max(addressable_bytes_per_device(state).values()), total


def pool_report(llm, mesh, admitted_shards) -> dict:
    """How the engine's pools were split: the row axis spec of a compressed pool, the token pool and the SWA pool,
    the largest share of the pool bytes (pools and boundary store) on one device, beside memory.engine_pool_bytes'
    per-device estimate; the prefix-cache hit tokens and the data shards that admitted requests."""
    eng = llm.engine
    lp = eng.pools.stacks[1]  # a CSA stack: [layers, rows, K]
    spec = lambda a: [str(x) for x in tuple(a.sharding.spec) + (None,) * (a.ndim - len(a.sharding.spec))]  # noqa
    tree = (eng.pools, eng.store)
    total = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))
    most = max(addressable_bytes_per_device(tree).values())
    opts = {k: v for k, v in MESH_OPTIONS.items() if k != "max_model_len"}
    estimate = engine_pool_bytes(llm.config, MESH_OPTIONS["max_model_len"], mesh=mesh, **opts)["per_device"]
    return dict(kv_spec=spec(lp.kv), tokens_spec=spec(eng.pools.tokens), swa_spec=spec(lp.swa),
                pool_device_fraction=most / total, pool_device_bytes=most, pool_device_estimate=estimate,
                hit_tokens=llm.stats()["prefix_cache"]["hit_tokens"], data_shards=sorted(set(admitted_shards)))


def record_admissions(llm) -> list:
    """The data shard of every admitted request's slot, appended as the scheduler admits them."""
    sch, shards = llm.engine.scheduler, []
    admit = sch.admit

    def recorded():
        out = admit()
        shards.extend(sch.tables.shard_of(r.slot) for r in out)
        return out
    sch.admit = recorded
    return shards


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--meshes", nargs="*", default=[])
    ap.add_argument("--checkpoint", default=None, help="an HF-format directory of the tiny preset's weights: the "
                    "mesh runs load it (else they create the preset's weights in their shards)")
    ap.add_argument("--orbax", default=None, help="an orbax checkpoint of the same weights to restore onto "
                    "--memory-mesh")
    ap.add_argument("--memory-mesh", default=None, help="load the checkpoint onto this mesh and report its bytes")
    a = ap.parse_args()
    assert jax.device_count() == 8, jax.devices()
    if a.memory_mesh:
        # Loaded straight into the shards of a mesh: the preset's values, spread over the devices.
        t0 = time.time()
        llm = LLM(a.checkpoint, mesh=a.memory_mesh, **OPTIONS)
        want = dict(nnx.to_flat_state(nnx.state(LLM("tiny", **OPTIONS).model)))
        same = all(np.array_equal(np.asarray(v.get_value()), np.asarray(want[p].get_value()))
                   for p, v in nnx.to_flat_state(nnx.state(llm.model)))
        most, total = param_bytes(llm.model)
        w1 = llm.model.stacks[1].ffn.experts.w1[...]
        emit(check="checkpoint", mesh=a.memory_mesh, same_values=bool(same), max_device_fraction=most / total,
             w1_spec=[str(s) for s in w1.sharding.spec], seconds=round(time.time() - t0, 1))
        if a.orbax:
            # An orbax checkpoint written elsewhere, restored onto this mesh: the same values and logits.
            t0 = time.time()
            restored = LLM(a.orbax, mesh=a.memory_mesh, **OPTIONS)
            same = all(np.array_equal(np.asarray(v.get_value()), np.asarray(want[p].get_value()))
                       for p, v in nnx.to_flat_state(nnx.state(restored.model)))
            err = float(np.max(np.abs(restored.logits(PROMPTS[0]) - LLM("tiny", **OPTIONS).logits(PROMPTS[0]))))
            w1 = restored.model.stacks[1].ffn.experts.w1[...]
            emit(check="orbax", mesh=a.memory_mesh, same_values=bool(same), logits_err=err,
                 w1_spec=[str(s) for s in w1.sharding.spec], seconds=round(time.time() - t0, 1))
    if not a.meshes:
        return
    t0 = time.time()
    ref = LLM("tiny", **MESH_OPTIONS)
    base = ref.generate(MESH_PROMPTS, SAMPLING)  # one reference for every mesh
    emit(check="reference", hit_tokens=ref.stats()["prefix_cache"]["hit_tokens"], seconds=round(time.time() - t0, 1))
    for mesh in a.meshes:
        t0 = time.time()
        llm = LLM(a.checkpoint or "tiny", mesh=mesh, **MESH_OPTIONS)
        shards = record_admissions(llm)
        outs = llm.generate(MESH_PROMPTS, SAMPLING)
        most, total = param_bytes(llm.model)
        err = max(float(np.max(np.abs(np.subtract(x.logprobs, y.logprobs)))) for x, y in zip(base, outs))
        st = llm.engine.pools.stacks[1].state_kv  # [layers of the stack, slots, ...] after the steps ran
        emit(check="mesh", mesh=mesh, tokens_equal=all(x.token_ids == y.token_ids for x, y in zip(base, outs)),
             logprob_err=err, max_device_fraction=most / total,
             state_spec=[str(s) for s in tuple(st.sharding.spec) + (None,) * (st.ndim - len(st.sharding.spec))],
             **pool_report(llm, mesh, shards), seconds=round(time.time() - t0, 1))


if __name__ == "__main__":
    main()
