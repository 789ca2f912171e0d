"""Where a step program's compile time goes: one engine's prefill and decode programs lowered once, then compiled
with XLA's options as given and with GPU autotuning off (`xla_gpu_autotune_level=0`), each timed. A first
`generate` of a 4K prompt on flash-1gpu compiled two prefill programs of 30-47 s each on the H200; this says whether
autotuning the GEMMs is that time.

    python scripts/compile_probe.py --model flash-1gpu --chunk 2048 --pages 8 --out $OUT/compile.json
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="flash-1gpu")
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--pages", type=int, default=8)
    ap.add_argument("--max-model-len", type=int, default=4352)
    ap.add_argument("--options", default="default,autotune0", help="compile option sets, in this order")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()

    from v4jax import LLM
    from v4jax.engine import steps as S

    option_sets = {"default": None, "autotune0": {"xla_gpu_autotune_level": 0}}
    t0 = time.perf_counter()
    llm = LLM(a.model, max_num_seqs=1, max_model_len=a.max_model_len)
    core = llm.engine
    rows = [{"what": "load", "s": time.perf_counter() - t0}]
    print(json.dumps(rows[-1]), flush=True)
    rb, s = 1, core.layout.max_slots
    pt, swa = core.kv.prefill_tables([], rb, a.pages)
    z = lambda dt=np.int32: np.zeros(rb, dt)  # noqa: E731
    samp = S.SamplingState.neutral(rb)
    batch = S.PrefillBatch(np.zeros((rb, a.chunk), np.int32), z(), z(), z(bool), np.full(rb, s, np.int32))
    lowerings = {
        "prefill": lambda: core.steps.prefill.lower(core.greedy_spec, core._leaves, core.pools, core.store, batch, pt,
                                                    swa, samp),
        "decode": lambda: core.steps.decode.lower(core.greedy_spec, core._leaves, core.pools, core.store,
                                                  core._decode_state_merge(), pt, swa),
    }
    for what, lower in lowerings.items():
        t0 = time.perf_counter()
        lowered = lower()
        rows.append({"what": f"{what} lower", "s": time.perf_counter() - t0})
        print(json.dumps(rows[-1]), flush=True)
        for name in a.options.split(","):
            t0 = time.perf_counter()
            lowered.compile(compiler_options=option_sets[name])
            rows.append({"what": f"{what} compile", "options": name, "s": time.perf_counter() - t0})
            print(json.dumps(rows[-1]), flush=True)
    if a.out:
        with open(a.out, "w") as fh:
            json.dump({"model": a.model, "chunk": a.chunk, "pages": a.pages, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
