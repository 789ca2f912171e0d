"""Run by tests/test_disagg.py in a subprocess with 8 fake CPU devices (the device count is fixed at JAX start):
prefill and decode engines of one process on different meshes of different devices (LocalDisagg), against
LLM.generate on one device; prints one JSON line.

    python tests/disagg_mesh_worker.py --prefill-mesh data=2,tensor=2 --decode-mesh tensor=4
"""
import argparse
import json
import time

import jax
import numpy as np

jax.config.update("jax_default_matmul_precision", "highest")

from v4jax import LLM, SamplingParams  # noqa: E402
from v4jax.serve.disagg import LocalDisagg  # noqa: E402

# prompts across page and compression boundaries (pages of 32 on the prefill side, 16 on the decode side)
PROMPTS = [np.random.default_rng(0).integers(2, 500, n).tolist() for n in (45, 9, 33)]
SAMPLING = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=True)
OPTIONS = dict(dtype="float32", max_num_seqs=4, max_model_len=64, prefill_chunk=32, decode_steps=4)


def n_devices(mesh: str) -> int:
    return int(np.prod([int(part.split("=")[1]) for part in mesh.split(",")]))


def moved(pools, placed) -> list[str]:
    """Pool arrays no longer placed as `placed` (their shardings when created) says."""
    leaves = jax.tree.leaves_with_path(pools)
    return [f"{jax.tree_util.keystr(p)}: {s} -> {a.sharding}" for (p, a), s in zip(leaves, placed)
            if not a.sharding.is_equivalent_to(s, a.ndim)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prefill-mesh", required=True)
    ap.add_argument("--decode-meshes", nargs="+", required=True)
    a = ap.parse_args()
    devices = jax.devices()
    assert len(devices) == 8, devices
    t0 = time.time()
    want = LLM("tiny", **OPTIONS).generate(PROMPTS, SAMPLING)  # one device
    prefill = LLM("tiny", mesh=a.prefill_mesh, devices=devices[:n_devices(a.prefill_mesh)], page_size=32,
                  **OPTIONS).engine
    print("RESULT " + json.dumps({"check": "reference", "seconds": round(time.time() - t0, 1)}), flush=True)
    for mesh in a.decode_meshes:
        t0 = time.time()
        decode = LLM("tiny", mesh=mesh, devices=devices[8 - n_devices(mesh):], page_size=16, **OPTIONS).engine
        placed = [a.sharding for a in jax.tree.leaves(decode.pools)]
        pair = LocalDisagg(prefill, decode)
        got = pair.generate(PROMPTS, SAMPLING)
        kv = decode.pools.stacks[1].kv
        for core in (prefill, decode):
            core.kv.reset_prefix_cache()
            core.kv.check()
        print("RESULT " + json.dumps({
            "check": "pair", "decode_mesh": mesh,
            "tokens_equal": all(w.token_ids == g[0] for w, g in zip(want, got)),
            "logprob_err": max(float(np.max(np.abs(np.subtract(w.logprobs, g[1])))) for w, g in zip(want, got)),
            "transfers": pair.stats()["transfers"]["count"],
            "prefill_devices": sorted({d.id for a in jax.tree.leaves(prefill.pools) for d in a.sharding.device_set}),
            "decode_devices": sorted({d.id for a in jax.tree.leaves(decode.pools) for d in a.sharding.device_set}),
            # every pool where the decode engine created it, after the imports and the decode steps
            "moved": moved(decode.pools, placed),
            "decode_kv_spec": [str(s) for s in kv.sharding.spec],
            "all_free": all(c.kv.all_free() and not c.scheduler.requests for c in (prefill, decode)),
            "seconds": round(time.time() - t0, 1)}), flush=True)
        del decode, pair


if __name__ == "__main__":
    main()
