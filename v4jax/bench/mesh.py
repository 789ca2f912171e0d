"""`v4jax bench mesh`: decode on a mesh against one device: greedy tokens equal, ms/step through `LLM.generate`,
scaling per mesh.

    v4jax bench mesh --model flash-slice --meshes "tensor=2;expert=2;data=2" --batches 1,32 \
        --context 4096 --new 32 --out $OUT
    v4jax bench mesh --model tiny --dtype float32 --meshes "tensor=2;expert=2" --batches 1,4 --context 64   (CPU)

For each mesh (`;`-separated specs, e.g. "tensor=8;expert=8;data=2,tensor=4"): one LLM on the mesh, the same
random prompts as the single-device run, greedy; a row per batch size with the decode ms/step (time of
max_tokens = 1 + new minus time of max_tokens = 1, over new), tok/s, whether the tokens equal the single-device
run's, and the scaling efficiency (single-device ms/step / (mesh ms/step * devices)). On a CPU machine it runs on
8 fake devices (the script adds XLA_FLAGS=--xla_force_host_platform_device_count=8, which only the CPU platform
reads) with `--model tiny`, as a dry run. NCCL's NVLink multicast stays off (NCCL_NVLS_ENABLE=0).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time


def _row(llm, prompts, new: int) -> tuple[float, list]:
    from v4jax import SamplingParams
    sp = lambda n: SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    llm.generate(prompts, sp(1 + new))  # compiles
    t0 = time.perf_counter()
    llm.generate(prompts, sp(1))
    one = time.perf_counter() - t0
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp(1 + new))
    return (time.perf_counter() - t0 - one) * 1e3 / new, [o.token_ids for o in outs]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="v4jax bench mesh", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="flash-slice")
    ap.add_argument("--meshes", default="tensor=2;expert=2;data=2", help="';'-separated mesh specs")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", default=os.environ.get("OUT", "mesh_out"))
    a = ap.parse_args(argv)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    import jax
    import numpy as np

    from v4jax import LLM
    batches = [int(b) for b in a.batches.split(",")]
    meshes = [m.strip() for m in a.meshes.split(";") if m.strip()]
    os.makedirs(a.out, exist_ok=True)
    dev = jax.devices()[0]
    data = {"command": "v4jax bench mesh " + " ".join(argv if argv is not None else sys.argv[1:]),
            "device": f"{len(jax.devices())} x {dev.platform} {getattr(dev, 'device_kind', '')}", "jax": jax.__version__,
            "model": a.model, "rows": []}
    rng = np.random.default_rng(0)
    opts = dict(dtype=a.dtype, max_num_seqs=max(batches), max_model_len=a.context + a.new + 32,
                enable_prefix_caching=False)
    base = LLM(a.model, **opts)
    prompts = {b: [rng.integers(2, base.config.vocab_size, a.context).tolist() for _ in range(b)] for b in batches}
    ref = {b: _row(base, prompts[b], a.new) for b in batches}
    del base
    for b in batches:
        data["rows"].append({"mesh": "one device", "devices": 1, "batch": b, "ms_per_step": ref[b][0],
                             "tok_per_s": b * 1e3 / ref[b][0] if ref[b][0] > 0 else None})
    for spec in meshes:
        try:
            llm = LLM(a.model, mesh=spec, **opts)
            n = int(np.prod([int(kv.split("=")[1]) for kv in spec.split(",")]))
            for b in batches:
                ms, toks = _row(llm, prompts[b], a.new)
                data["rows"].append({"mesh": spec, "devices": n, "batch": b, "ms_per_step": ms,
                                     "tok_per_s": b * 1e3 / ms if ms > 0 else None,
                                     "same_tokens": toks == ref[b][1],
                                     "scaling": ref[b][0] / (ms * n) if ms > 0 else None})
            del llm
        except Exception as e:  # noqa: BLE001 - a mesh that fails is a result too
            data["rows"].append({"mesh": spec, "error": f"{type(e).__name__}: {str(e)[:300]}"})
        with open(os.path.join(a.out, "mesh.json"), "w") as fh:
            json.dump(data, fh, indent=1)
    print(f"{data['device']}; JAX {data['jax']}; {a.model}, context {a.context}, {a.new} new tokens, greedy")
    print("| mesh | devices | batch | ms/step | tok/s | same tokens | scaling |")
    print("|---|---|---|---|---|---|---|")
    f = lambda x, fmt: "-" if x is None else fmt.format(x)
    for r in data["rows"]:
        if "error" in r:
            print(f"| {r['mesh']} | error: {r['error'][:100]} | | | | | |")
        else:
            print(f"| {r['mesh']} | {r['devices']} | {r['batch']} | {r['ms_per_step']:.2f} | "
                  f"{f(r.get('tok_per_s'), '{:.0f}')} | {r.get('same_tokens', '-')} | {f(r.get('scaling'), '{:.2f}')} |")
    with open(os.path.join(a.out, "mesh.json"), "w") as fh:
        json.dump(data, fh, indent=1)
    return 0
