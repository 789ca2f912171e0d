"""`v4jax bench hisparse`: long requests decoding together with the C4 KV pool on the host (enable_hisparse) or
all on the device, through LLM.generate: capacity (full pages and tokens the pools hold, device and host bytes; the
most requests of the context that the device's free memory, and with offload the host's, would hold), ms per decode
step and decode tokens/s, the hot buffer's hit rate and the bytes fetched from the host per decode step.

    v4jax bench hisparse --model tiny --dtype float32 --context 2048 --concurrency 4 --device-pages 8
    v4jax bench hisparse --model flash-1gpu --context 131072 --concurrency 8 [--no-offload]
Prompts are random token ids, put in the prefix cache by a first pass of one token each, so that in the timed pass
the requests decode side by side. The time and the counters are read once every request has its first decode call's
tokens and at the first request's last token, so that prefill's fetches and the decode program's compilation are
not in the per-step figures."""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time

log = logging.getLogger("v4jax.bench.hisparse")


def fit_requests(cfg, options, max_model_len: int, dtype: str, device_free: int | None,
                 host_available: int | None, limit: int = 1 << 16) -> int | None:
    """The most requests of max_model_len tokens an engine with these options (max_num_seqs of them, every one's
    whole context in pages, no memory_budget_bytes) could hold at once: its pools within 90 % of `device_free` and,
    with offload, its host rows within 90 % of `host_available` (the fit checks' headroom); with offload the hot
    buffer at its default size, which grows with max_num_seqs (a fixed hisparse_device_pages would bound the
    requests by its own rows). None when the device's free memory is unknown."""
    import dataclasses

    from v4jax.memory import engine_pools
    if device_free is None:
        return None

    def fits(n: int) -> bool:
        pools = engine_pools(cfg, dataclasses.replace(options, max_num_seqs=n, memory_budget_bytes=None,
                                                      hisparse_device_pages=None), max_model_len, dtype)
        host = sum(s.host_bytes for s in pools.sizes.values())
        return pools.per_device <= 0.9 * device_free and (
            not host or host_available is None or host <= 0.9 * host_available)

    lo, hi = 0, limit
    while lo < hi:  # the largest n that fits: fitting is monotone in n
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


def _budget_for_both_passes(llm) -> int:
    """Device bytes for pools of twice the pages the requests need: the prompts cached by the first pass and the
    timed requests' own pages side by side. With pages for the requests alone, the first timed request's new pages
    evict the next one's cached prompt, which then prefills again while the first decodes alone."""
    from v4jax.cache.layout import kv_cache_dtype, pool_cost, pool_layout
    layout = pool_layout(llm.config, llm.options, llm.dtype, llm.max_model_len)
    fixed, per_page = pool_cost(llm.config, layout, kv_cache_dtype(llm.options.kv_cache_dtype, llm.dtype),
                                llm.options.enable_prefix_caching)
    return fixed + 2 * layout.n_pages * per_page


def run(model: str, dtype: str, context: int, concurrency: int, new_tokens: int, offload: bool,
        device_pages: int | None, budget: int | None, prefill_chunk: int, seed: int = 0, profile: bool = False,
        emit=None, kv_cache_dtype: str = "auto", quantization: str | None = None) -> dict:
    import dataclasses

    import numpy as np

    from v4jax import LLM, SamplingParams
    from v4jax.memory import _host_available_bytes, device_free_bytes, model_weight_bytes
    # a request is `context` tokens in all, prompt and output (a 1M request fits a 1M model)
    opts = dict(dtype=dtype, max_num_seqs=concurrency, max_model_len=context, prefill_chunk=prefill_chunk,
                kv_cache_dtype=kv_cache_dtype, **({} if quantization is None else {"quantization": quantization}))
    if offload:
        opts.update(enable_hisparse=True, hisparse_device_pages=device_pages)
    llm = LLM(model, memory_budget_bytes=budget, **opts)
    if budget is None:  # the engine is built at first use: its pools can still be sized
        llm.options = dataclasses.replace(llm.options, memory_budget_bytes=_budget_for_both_passes(llm))
    # The programs that cover every step (the prefill at the widest page table, the greedy decode), compiled at
    # once in threads, and nothing else: without this each page bucket a prompt crosses compiled its own prefill
    # program, one after another (1M at chunks of 8192: 8 programs, 13-19 s each for flash-slice on an H100,
    # 25-30 s for flash-1gpu), for steps that are not timed. The timed decode runs at the context's bucket, the
    # widest, on its own program.
    t = time.perf_counter()
    n = llm.warmup(cover_only=True)
    llm.engine.programs.background = False
    log.info("engine built, %d programs compiled in %.1f s", n, time.perf_counter() - t)
    compiled = llm.engine.compiled_variants()
    # what the device has left once the weights are placed, before the engine's pools exist
    free, _ = device_free_bytes(in_use=model_weight_bytes(llm.model))
    fit = fit_requests(llm.config, llm.options, llm.max_model_len, dtype, free, _host_available_bytes())
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(2, llm.config.vocab_size, context - new_tokens - 1).tolist() for _ in range(concurrency)]
    core = llm.engine
    lay = core.layout
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    # A first pass prefills every prompt (one token each) into the prefix cache, so that in the timed pass the
    # requests' prefills are hits and they decode side by side: without it the first request decodes alone while
    # the others prefill, and a window of all of them decoding may never come.
    t, pre0 = time.perf_counter(), llm.stats()["pools"]["c4_kv"]
    llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    prefill_s, pre1 = time.perf_counter() - t, llm.stats()["pools"]["c4_kv"]
    log.info("prompts prefilled into the prefix cache in %.1f s", prefill_s)
    # The timed window: from the moment every request has its first decode call's tokens (that call compiled the
    # decode program of the context's page bucket) to the first request's last token, while all of them decode.
    k = llm.options.decode_steps
    if new_tokens <= 2 * k:
        raise ValueError(f"--new-tokens {new_tokens}: the timed window starts after the first decode call's {k} "
                         f"tokens; use more than {2 * k}")
    got = [0] * concurrency
    t0 = t1 = st0 = st1 = None
    for i, ids, _ in llm.generate(prompts, params, stream=True):
        got[i] += len(ids)
        if t0 is None and min(got) > k:
            st0, t0, got0 = llm.stats()["pools"]["c4_kv"], time.perf_counter(), list(got)
            log.info("timed window starts at tokens %s", got0)
        if t0 is not None and t1 is None and max(got) >= new_tokens:
            st1, t1, got1 = llm.stats()["pools"]["c4_kv"], time.perf_counter(), list(got)
    if t1 is None or t1 <= t0 or min(b - a for a, b in zip(got0, got1)) <= 0:
        raise RuntimeError(f"no window with every request decoding (tokens at its start {got0}, at its end "
                           f"{got1}): give more --new-tokens")
    wall = t1 - t0
    steps = max(max(b - a for a, b in zip(got0, got1)), 1)
    row = {"model": model, "context": context, "concurrency": concurrency, "offload": offload,
           "kv_cache_dtype": kv_cache_dtype,
           "fit_requests": fit, "device_free_bytes": free,
           "full_pages": lay.n_pages, "capacity_tokens": lay.n_pages * lay.page_size,
           "c4_device_bytes": st1.get("device_bytes_total", st1["bytes_total"]),
           "c4_host_bytes": st1.get("host_bytes_total", 0), "ms_per_step": 1e3 * wall / steps,
           "tokens_per_s": (sum(got1) - sum(got0)) / wall,
           "prefill_s": prefill_s, "programs_warmup": n,
           "programs_compiled_after": core.compiled_variants() - compiled}
    if offload:
        d = {k: st1[k] - st0[k] for k in ("selected", "hits", "fetched_bytes", "transferred_bytes")}
        # what the prefill moved from the host (a chunk reads its rows' whole C4 KV, or fetches by blocks of queries)
        row.update(prefill_fetched_bytes=pre1["fetched_bytes"] - pre0["fetched_bytes"],
                   prefill_transferred_bytes=pre1["transferred_bytes"] - pre0["transferred_bytes"],
                   prefill_hit_rate=(pre1["hits"] - pre0["hits"]) / max(pre1["selected"] - pre0["selected"], 1))
        row.update(device_rows=st1["device_rows"], hit_rate=d["hits"] / d["selected"] if d["selected"] else None,
                   fetched_bytes_per_step=d["fetched_bytes"] / steps,
                   transferred_bytes_per_step=d["transferred_bytes"] / steps)
    if emit is not None:  # the row first: a profile of a long context may outlast the caller's time limit
        emit(dict(row))
    if profile:  # the device kernels of a decode step, by family: 2k more tokens (two decode calls) against one
        from v4jax.bench.profile import summarize
        from v4jax.bench.spec import decode_profile
        sp = lambda m: SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True)
        row["profile"] = decode_profile(lambda p: llm.generate(prompts, p), sp(1), sp(2 * k + 1), 2 * k)
        if len(row["profile"]) > 1:  # the totals first (no profile: one line saying why)
            (_, n, ms), (_, nc, cms), *row["profile"] = row["profile"]
            # a step's wall time against its kernels' and copies' (the rest: the device waited)
            row["profile_decode_ms"] = dict(wall=row["ms_per_step"], kernel_ms=ms, copy_ms=cms, kernels=n, copies=nc)
        # and a late prefill chunk's: the first prompt's cached start, then prefill_chunk new tokens (each traced
        # run a new tail, so that it prefills rather than hits the cache)
        chunk = min(prefill_chunk, len(prompts[0]) // 2)
        tails = iter(rng.integers(2, llm.config.vocab_size, (4, chunk)).tolist())
        late = prompts[0][:len(prompts[0]) - chunk]
        prof = summarize(lambda: llm.generate([late + next(tails)], sp(1)), repeats=2, top=25)
        row["profile_prefill"] = prof.get("top") or [(f"(no profile: {prof.get('error')})", 0, 0.0)]
        # the chunk's wall time against its kernels' and copies' (the rest: the host's work and waits)
        t = time.perf_counter()
        llm.generate([late + next(tails)], sp(1))
        row["profile_prefill_ms"] = dict(wall=1e3 * (time.perf_counter() - t),
                                         **{k: prof.get(k) for k in ("kernel_ms", "copy_ms", "kernels", "copies")})
        if emit is not None:
            emit({k: row[k] for k in ("model", "context", "offload", "profile", "profile_decode_ms", "profile_prefill",
                                      "profile_prefill_ms") if k in row})
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="v4jax bench hisparse", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--context", type=int, default=2048, help="tokens per request, prompt and output")
    p.add_argument("--concurrency", type=int, default=4, help="requests decoding together (max_num_seqs)")
    p.add_argument("--new-tokens", type=int, default=32, help="tokens decoded per request in the timed run")
    p.add_argument("--device-pages", type=int, default=None, help="hisparse_device_pages (default: one step's)")
    p.add_argument("--memory-budget-bytes", type=int, default=None, help="device bytes for the pools")
    p.add_argument("--prefill-chunk", type=int, default=256)
    p.add_argument("--no-offload", dest="offload", action="store_false", help="the C4 KV pool on the device")
    p.add_argument("--profile", action="store_true", help="trace two decode calls and a late prefill chunk after the "
                   "timed run (a GPU): a decode step's and the chunk's device kernels by family, in the row")
    p.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "bfloat16", "fp8"),
                   help="the pools' entries (fp8: the release's FP8 entries and FP4 indexer keys)")
    p.add_argument("--quantization", default=None, choices=("none", "fp8"), help="default: the preset's")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    # the engine's slow steps (compiles) and the phases, with times, on stderr
    logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    def emit(row):  # the measured row, then (--profile) a line of the profiles alone
        if a.json:
            print(json.dumps(row), flush=True)
        else:
            for k, v in row.items():
                print(f"{k}: {v}", flush=True)

    run(a.model, a.dtype, a.context, a.concurrency, a.new_tokens, a.offload, a.device_pages, a.memory_budget_bytes,
        a.prefill_chunk, profile=a.profile, emit=emit, kv_cache_dtype=a.kv_cache_dtype, quantization=a.quantization)
    return 0
