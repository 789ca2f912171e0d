"""`v4jax bench hisparse`: long requests decoding together with the C4 KV pool on the host (enable_hisparse) or
all on the device, through LLM.generate: capacity (full pages and tokens the pools hold, device and host bytes),
ms per decode step, the hot buffer's hit rate and the bytes fetched from the host per decode step.

    v4jax bench hisparse --model tiny --dtype float32 --context 2048 --concurrency 4 --device-pages 8
    v4jax bench hisparse --model flash-1gpu --context 131072 --concurrency 8 [--no-offload]
Prompts are random token ids; a warm-up run on their first halves compiles the programs. The counters are read
once every request has its first token and after the last, so that prefill's fetches are not in the per-step
figures."""
from __future__ import annotations

import argparse
import json
import time


def run(model: str, dtype: str, context: int, concurrency: int, new_tokens: int, offload: bool,
        device_pages: int | None, budget: int | None, prefill_chunk: int, seed: int = 0) -> dict:
    import numpy as np

    from v4jax import LLM, SamplingParams
    opts = dict(dtype=dtype, max_num_seqs=concurrency, max_model_len=context + new_tokens + 1,
                prefill_chunk=prefill_chunk, memory_budget_bytes=budget)
    if offload:
        opts.update(enable_hisparse=True, hisparse_device_pages=device_pages)
    llm = LLM(model, **opts)
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(2, llm.config.vocab_size, context).tolist() for _ in range(concurrency)]
    core = llm.engine
    lay = core.layout
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    # a warm-up run compiles every program; the timed run decodes from the moment every request has its first
    # token (prefill done) to the last token
    llm.generate([p[: len(p) // 2] for p in prompts], params)
    got = [0] * concurrency
    t0 = st0 = None
    for i, ids, _ in llm.generate(prompts, params, stream=True):
        got[i] += len(ids)
        if t0 is None and min(got) > 0:
            st0, t0, at = llm.stats()["pools"]["c4_kv"], time.perf_counter(), max(got)
    wall = time.perf_counter() - t0
    st1 = llm.stats()["pools"]["c4_kv"]
    steps = max(max(got) - at, 1)
    row = {"model": model, "context": context, "concurrency": concurrency, "offload": offload,
           "full_pages": lay.n_pages, "capacity_tokens": lay.n_pages * lay.page_size,
           "c4_device_bytes": st1.get("device_bytes_total", st1["bytes_total"]),
           "c4_host_bytes": st1.get("host_bytes_total", 0), "ms_per_step": 1e3 * wall / steps}
    if offload:
        d = {k: st1[k] - st0[k] for k in ("selected", "hits", "fetched_bytes", "transferred_bytes")}
        row.update(device_rows=st1["device_rows"], hit_rate=d["hits"] / d["selected"] if d["selected"] else None,
                   fetched_bytes_per_step=d["fetched_bytes"] / steps,
                   transferred_bytes_per_step=d["transferred_bytes"] / steps)
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="v4jax bench hisparse", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--context", type=int, default=2048, help="prompt tokens per request")
    p.add_argument("--concurrency", type=int, default=4, help="requests decoding together (max_num_seqs)")
    p.add_argument("--new-tokens", type=int, default=32, help="tokens decoded per request in the timed run")
    p.add_argument("--device-pages", type=int, default=None, help="hisparse_device_pages (default: one step's)")
    p.add_argument("--memory-budget-bytes", type=int, default=None, help="device bytes for the pools")
    p.add_argument("--prefill-chunk", type=int, default=256)
    p.add_argument("--no-offload", dest="offload", action="store_false", help="the C4 KV pool on the device")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    row = run(a.model, a.dtype, a.context, a.concurrency, a.new_tokens, a.offload, a.device_pages,
              a.memory_budget_bytes, a.prefill_chunk)
    if a.json:
        print(json.dumps(row))
    else:
        for k, v in row.items():
            print(f"{k}: {v}")
    return 0
