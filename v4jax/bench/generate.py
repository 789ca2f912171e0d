"""`v4jax bench generate`: what a user of `LLM.generate` sees, on a preset with random weights.

* first call: `LLM(...)` then one `generate` of a short prompt (16 tokens, 16 new): its wall time is mostly the
  compile of the prefill and decode programs it uses (cache off by default here, so the number is the compile a
  first run pays; `--cache on` measures a warm persistent cache instead); the same call again gives the
  steady-state time, the difference is reported as the compile time.
* decode rows (batch, context): `batch` random prompts of `context` tokens through `generate` with max_tokens=1
  and with 1 + `--new` (fresh prompts each time, after a pass that compiles): prefill s = the first; decode
  ms/step = the difference over `--new`; "steady" ms/step: the streamed events' times while every request of the
  batch decodes (the difference also counts the steps that decode some requests while others still prefill);
  "prompts cached": the same over prompts whose pages are in the prefix cache (sent once before), so that a large
  batch starts together. One engine per batch size (max_num_seqs = batch: the decode step runs
  every slot), the model's weights shared.
* `--prefill` contexts: more rows at batch 1 (for long prompts: the prefill time of one prompt of that length,
  and the decode rate after it).
* every row's prefill against the FLOP roofline (v4jax.bench.flops): the FLOPs its prompts need over its
  prefill time, as a share of the bf16 matmul rate measured on the same device at the start.
Results (JSON + markdown) go to --out after every row.

Two diagnostics instead of the rows:
* `--profile-prefill`: where a prefill's time goes. One `generate` of a `--prefill`-token prompt (default 128K;
  max_tokens=1, chunks of `--prefill-chunk`) traced with the profiler, the third such call (the second can be slow
  on a GPU); prints the kernel families by GPU time and each kernel's time per line of the model
  (v4jax.bench.profile.summarize, from the compiled program of the last chunk).
* `--repeat-check`: four identical `generate` calls (a 16-token prompt, 16 new tokens) with every compile logged,
  and how the arguments and the trace context (JAX's config states that key its caches) of each call's first
  prefill differ from the first call's: a difference there is what makes a later call compile again. (JAX's
  explain-cache-misses is left off: on JAX 0.11.2 with it on, lowering a Pallas Triton kernel's reduction fails.)
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

from v4jax.bench.flops import measure_matmul_rate, prefill_flops


def _engine_for(llm, **opts):
    """Point `llm` at a fresh engine with these options (same model and weights)."""
    llm.options = dataclasses.replace(llm.options, **opts)
    llm.max_model_len = min(llm.options.max_model_len or llm.config.max_seq_len, llm.config.max_seq_len)
    llm._engine = None


def decode_row(llm, batch: int, context: int, new: int, rng, temperature: float = 0.0, top_p: float = 1.0,
               frequency_penalty: float = 0.0) -> dict:
    """What a user sees: `batch` random prompts of `context` tokens through `LLM.generate` (greedy unless
    `temperature` > 0; ignore_eos),
    once with max_tokens=1 (prefill and the first token) and once with max_tokens=1+new, each on fresh prompts of
    the same lengths (no prefix hits) after a first pass that compiles every program the row uses. Decode ms/step =
    (time(1 + new) - time(1)) / new: one step is one new token for every request. The 1 + new call streams, and
    its events' times give the steady rate (`steady_step_ms`)."""
    from v4jax.engine.sampling import SamplingParams
    sp = lambda n: SamplingParams(max_tokens=n, temperature=temperature, top_p=top_p, ignore_eos=True,  # noqa: E731
                                  frequency_penalty=frequency_penalty)
    fresh = lambda: [rng.integers(2, llm.config.vocab_size, context).tolist() for _ in range(batch)]
    t0 = time.perf_counter()
    llm.generate(fresh(), sp(1 + new))
    warm_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    llm.generate(fresh(), sp(1))
    one_s = time.perf_counter() - t0
    steps0 = llm.stats()["steps"]
    t0 = time.perf_counter()
    events = [(time.perf_counter(), i, len(toks)) for i, toks, _ in llm.generate(fresh(), sp(1 + new), stream=True)]
    all_s = time.perf_counter() - t0
    steps = {k: v - steps0[k] for k, v in llm.stats()["steps"].items()}  # the engine steps of that call
    decode_s = all_s - one_s
    steady_ms, steady_steps = steady_step_ms(events, batch, 1 + new)
    # the same prompts again, their pages in the prefix cache: every request starts within a step or two, so a
    # batch decodes together from its first tokens (fresh prompts of a large batch start over many prefill steps,
    # and at 32 x 4K the first finished before the last started: no steady window)
    cached, hit = fresh(), []
    if llm.options.enable_prefix_caching:
        llm.generate(cached, sp(1))
        hit = [(time.perf_counter(), i, len(toks)) for i, toks, _ in llm.generate(cached, sp(1 + new), stream=True)]
    hit_ms, hit_steps = steady_step_ms(hit, batch, 1 + new) if hit else (None, 0)
    return {"batch": batch, "context": context, "new_tokens": new, "first_pass_s": warm_s, "prefill_s": one_s,
            "wall_s": all_s, "decode_steps_timed": new, "ms_per_step": decode_s * 1e3 / new,
            "tok_per_s": batch * new / decode_s if decode_s > 0 else None,
            "steady_ms_per_step": steady_ms, "steady_steps": steady_steps,
            # a server's engine steps compare with these (v4jax bench serve's "engine:" line)
            "engine_step_ms": 1e3 * steps["seconds"] / max(steps["steps"], 1),
            "engine_device_wait_ms": 1e3 * steps["device_wait_seconds"] / max(steps["steps"], 1),
            "engine_steps": steps,
            "cached_steady_ms_per_step": hit_ms, "cached_steady_steps": hit_steps,
            "tokens": sum(n for _, _, n in events),
            "prefill_tflop": prefill_flops(llm.config, context, batch)["total"] / 1e12,
            "roofline_bytes": step_bytes(llm, batch, context)}


def step_bytes(llm, batch: int, context: int) -> float:
    """Bytes one decode step must read (BENCHMARKS.md, "Decode"), as this LLM stores them: the weights touched in
    their stored formats (FP8 linears and FP4 experts under quantization) and the pools in the cache's format."""
    from v4jax import memory as M
    cfg = llm.config
    wbytes = 4 if str(llm.dtype) == "float32" else 2
    fmt = "fp4" if llm.options.kv_cache_dtype == "fp8" else {2: "bf16", 4: "f32"}[wbytes]
    return (M.decode_weight_bytes(cfg, batch, wbytes, weights=llm.model.weight_format)["total"]
            + batch * M.decode_read_bytes(cfg, context, fmt)["total"])


def steady_step_ms(events, batch: int, max_tokens: int):
    """ms per decode step while every request of the batch is decoding, from streamed events [(time, request,
    new tokens)]: from the event that brings the last request its first token to that request's last event
    before any request finishes, over the tokens it got in between (one per step). (None, 0) when that window
    holds no step (requests admitted so far apart that the first finished before the last started)."""
    count = [0] * batch
    start = None  # (time, the last-started request, its count then)
    end = None
    for t, i, n in events:
        count[i] += n
        if start is None:
            if count[i] >= max_tokens and batch > 1:
                return None, 0  # one finished before the last started: never all decoding together
            if min(count) > 0:
                start = (t, i, count[i])
            continue
        if count[i] >= max_tokens and i != start[1]:
            break  # a request finished: the batch shrinks from here
        if i == start[1]:
            end = (t, count[i])
            if count[i] >= max_tokens:
                break
    if start is None or end is None or end[1] <= start[2]:
        return None, 0
    steps = end[1] - start[2]
    return (end[0] - start[0]) * 1e3 / steps, steps


def markdown(data: dict) -> str:
    f = lambda x, fmt="{:.2f}": "-" if x is None else fmt.format(x)
    lines = [f"Device: {data.get('device')}; JAX {data.get('jax')}; `{data.get('model')}` (random weights, bf16); "
             f"k = {data.get('k')}; prefill chunk {data.get('prefill_chunk')}; attention {data.get('attention_impl')}; "
             f"slots {data.get('max_num_seqs', 'batch')}; "
             f"bf16 matmul rate {f(data.get('matmul_tflops'), '{:.0f}')} TFLOP/s.", ""]
    fc = data.get("first_call")
    if fc:
        lines += [f"First generate (16-token prompt, 16 new): {fc['first_s']:.1f} s; again: {fc['second_s']:.2f} s; "
                  f"compile ~{fc['compile_s']:.1f} s (model init {data.get('init_s', 0):.1f} s, not included).", ""]
    wu = data.get("warmup")
    if wu:
        lines += [f"Warm-up: {wu['programs']} programs in {wu['s']:.1f} s (max_model_len {wu['max_model_len']}, "
                  f"{wu['max_num_seqs']} slots).", ""]
    bw = data.get("bandwidth_GBps")
    if bw:
        lines += [f"Roofline: the bytes a step reads as stored (weights touched, pools in the cache's format) / "
                  f"{bw:.0f} GB/s (device copy).", ""]
    lines += ["| batch | context | prefill s (max_tokens=1) | prefill TFLOP/s (% of matmul) | decode ms/step "
              "(LLM.generate) | steady ms/step | steady, prompts cached | tok/s | new tokens | step GB | "
              "roofline ms (x) |",
              "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def roof(r):
        if not bw or not r.get("roofline_bytes"):
            return "-"
        ms = r["roofline_bytes"] / bw / 1e6
        return f"{ms:.2f} ({r['ms_per_step'] / ms:.2f}x)"

    for r in data["rows"]:
        if "error" in r:
            lines.append(f"| {r['batch']} | {r['context']} | error: {r['error'][:80]} | | | | | | | | |")
        else:
            rate = r.get("prefill_tflop", 0) / r["prefill_s"] if r.get("prefill_s") else None
            pct = rate / data["matmul_tflops"] * 100 if rate and data.get("matmul_tflops") else None
            lines.append(f"| {r['batch']} | {r['context']} | {f(r['prefill_s'])} | {f(rate, '{:.0f}')} "
                         f"({f(pct, '{:.0f}')} %) | {f(r['ms_per_step'])} | "
                         f"{f(r.get('steady_ms_per_step'))} ({r.get('steady_steps', 0)} steps) | "
                         f"{f(r.get('cached_steady_ms_per_step'))} ({r.get('cached_steady_steps', 0)} steps) | "
                         f"{f(r.get('tok_per_s'), '{:.0f}')} | {r['decode_steps_timed']} | "
                         f"{f(r.get('roofline_bytes', 0) / 1e9)} | {roof(r)} |")
    steps = [r for r in data["rows"] if "engine_step_ms" in r]
    if steps:
        from v4jax.bench.serve import engine_line
        lines += ["", "Engine steps of the timed call:"] + [
            f"- batch {r['batch']}, {r['context']}: " + (engine_line(r["engine_steps"]) if "engine_steps" in r else
                                                        f"{r['engine_step_ms']:.2f} ms a step, of it "
                                                        f"{r['engine_device_wait_ms']:.2f} waiting on the device")
            for r in steps]
    return "\n".join(lines) + "\n"


def generate_main(argv=None) -> int:
    from v4jax.bench.decode import _parse_ints
    ap = argparse.ArgumentParser(prog="v4jax bench generate", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="flash-slice")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--contexts", default="4K")
    ap.add_argument("--prefill", default="", help="more contexts at batch 1 only (e.g. 128K)")
    ap.add_argument("--new", type=int, default=48, help="new tokens per request in a decode row")
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--temperature", type=float, default=0.0, help="the decode rows' sampling (default greedy; "
                    "1.0 is vLLM's and OpenAI's default)")
    ap.add_argument("--top-p", type=float, default=1.0, help="the decode rows' top-p (with --temperature)")
    ap.add_argument("--frequency-penalty", type=float, default=0.0,
                    help="the decode rows' frequency penalty (the program form with penalties)")
    ap.add_argument("--prefill-chunk", type=int, default=None, help="default: the LLM's")
    ap.add_argument("--attention-impl", default=None, choices=("xla", "pallas"), help="default: the LLM's")
    ap.add_argument("--max-num-seqs", type=int, default=0, help="one engine of this many slots for every row (the "
                    "user's case: a lone request on a many-slot engine); 0: an engine per row, of `batch` slots")
    ap.add_argument("--max-model-len", type=int, default=0, help="with --max-num-seqs: the engine's context "
                    "(default: the longest row's)")
    ap.add_argument("--warmup", action="store_true", help="time the engine's warm-up (every program it can "
                    "dispatch) before the rows")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--quantization", default=None, choices=("none", "fp8"), help="default: the LLM's (a preset's "
                    "weights in --dtype); fp8: the release's FP8 linears and FP4 experts")
    ap.add_argument("--kv-cache-dtype", default=None, choices=("auto", "bfloat16", "fp8"), help="default: the "
                    "LLM's; fp8: the release's 584-byte FP8 entries and FP4 indexer keys")
    ap.add_argument("--cache", default="off", choices=("on", "off"), help="the persistent compilation cache")
    ap.add_argument("--deadline-s", type=float, default=None)
    ap.add_argument("--out", default=None)
    ap.add_argument("--profile-prefill", action="store_true", help="instead of the rows: a profile of one "
                    "prefill of a --prefill-token prompt (default 128K) in chunks of --prefill-chunk")
    ap.add_argument("--repeat-check", action="store_true", help="instead of the rows: four identical generate "
                    "calls, compiles logged, and what differs in each call's prefill arguments from the first's")
    a = ap.parse_args(argv)
    t_start = time.perf_counter()
    deadline = t_start + (a.deadline_s or 1e9)
    if a.cache == "off":
        os.environ["V4JAX_COMPILATION_CACHE"] = "off"
    if a.profile_prefill:
        from v4jax.api import EngineOptions
        return profile_prefill(a.model, (_parse_ints(a.prefill) or (131072,))[0],
                               a.prefill_chunk or EngineOptions.prefill_chunk,
                               a.attention_impl, a.dtype, a.quantization, a.kv_cache_dtype)
    if a.repeat_check:
        return repeat_check(a.model, a.attention_impl, a.dtype)
    import jax
    import numpy as np

    from v4jax import LLM, SamplingParams

    out_dir = a.out or os.environ.get("OUT") or "bench_out"
    os.makedirs(out_dir, exist_ok=True)
    dev = jax.devices()[0]
    data = {"command": "v4jax bench generate " + " ".join(argv if argv is not None else sys.argv[1:]),
            "device": f"{dev.platform}: {getattr(dev, 'device_kind', '')}", "jax": jax.__version__,
            "model": a.model, "k": a.k, "prefill_chunk": a.prefill_chunk, "attention_impl": a.attention_impl,
            "quantization": a.quantization, "kv_cache_dtype": a.kv_cache_dtype,
            "rows": []}

    def write():
        with open(os.path.join(out_dir, "generate.json"), "w") as fh:
            json.dump(data, fh, indent=1, default=str)
        with open(os.path.join(out_dir, "generate.md"), "w") as fh:
            fh.write(markdown(data))

    batches, contexts, prefills = _parse_ints(a.batches), _parse_ints(a.contexts), _parse_ints(a.prefill)
    longest = max(contexts + prefills) + a.new + 2 * a.k
    t0 = time.perf_counter()
    chosen = {k: v for k, v in (("prefill_chunk", a.prefill_chunk), ("attention_impl", a.attention_impl),
                                ("quantization", a.quantization), ("kv_cache_dtype", a.kv_cache_dtype))
              if v is not None}
    llm = LLM(a.model, dtype=a.dtype, max_num_seqs=1, max_model_len=longest, decode_steps=a.k, **chosen)
    data.update(prefill_chunk=llm.options.prefill_chunk, attention_impl=llm.options.attention_impl or "default",
                max_num_seqs=a.max_num_seqs or "batch")
    jax.block_until_ready(jax.tree.leaves(llm._state))
    data["init_s"] = time.perf_counter() - t0
    data["matmul_tflops"] = measure_matmul_rate(8192 if dev.platform == "gpu" else 512) / 1e12
    if dev.platform == "gpu":
        from v4jax.bench.decode import measure_bandwidth
        data["bandwidth_GBps"] = measure_bandwidth(4 << 30)["copy_GBps"]
    print(f"[{time.perf_counter() - t_start:6.1f}s] {data['device']}: {a.model} initialised", flush=True)
    rng = np.random.default_rng(0)
    sp = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    llm.generate([rng.integers(2, llm.config.vocab_size, 16).tolist()], sp)
    t1 = time.perf_counter()
    llm.generate([rng.integers(2, llm.config.vocab_size, 16).tolist()], sp)
    t2 = time.perf_counter()
    data["first_call"] = {"first_s": t1 - t0, "second_s": t2 - t1, "compile_s": (t1 - t0) - (t2 - t1)}
    write()
    print(f"[{time.perf_counter() - t_start:6.1f}s] first generate {data['first_call']}", flush=True)
    plan = [(b, c) for b in batches for c in contexts] + [(1, c) for c in prefills]
    if a.max_num_seqs:
        _engine_for(llm, max_num_seqs=a.max_num_seqs, max_model_len=a.max_model_len or longest)
    if a.warmup:
        t0 = time.perf_counter()
        programs = llm.engine.warmup(lambda i, n: i % 16 == 0 and print(
            f"[{time.perf_counter() - t_start:6.1f}s] warm-up {i} / {n}", flush=True))
        data["warmup"] = {"programs": programs, "s": time.perf_counter() - t0,
                          "max_model_len": llm.max_model_len, "max_num_seqs": llm.options.max_num_seqs}
        write()
        print(f"[{time.perf_counter() - t_start:6.1f}s] warm-up {data['warmup']}", flush=True)
    for b, c in plan:
        if time.perf_counter() > deadline:
            data["rows"].append({"batch": b, "context": c, "error": "skipped: past --deadline-s"})
            write()
            continue
        try:
            if not a.max_num_seqs:
                _engine_for(llm, max_num_seqs=b, max_model_len=c + a.new + 2 * a.k)
            row = decode_row(llm, b, c, a.new, rng, a.temperature, a.top_p, a.frequency_penalty)
        except Exception as e:  # noqa: BLE001 - a row that fails is a result too
            row = {"batch": b, "context": c, "error": f"{type(e).__name__}: {str(e)[:300]}"}
        if not a.max_num_seqs:
            llm._engine = None
        data["rows"].append(row)
        write()
        print(f"[{time.perf_counter() - t_start:6.1f}s] {row}", flush=True)
    data["total_s"] = time.perf_counter() - t_start
    write()
    print(markdown(data), flush=True)
    return 0


def profile_prefill(model: str, prompt: int, chunk: int, impl: str, dtype: str = "bfloat16",
                    quantization: str | None = None, kv_cache_dtype: str | None = None) -> int:
    """`--profile-prefill` (see the module's docstring); quantization / kv_cache_dtype as the LLM's (None: its
    default)."""
    import jax
    import numpy as np

    from v4jax import LLM, SamplingParams
    from v4jax.bench.profile import summarize

    chosen = {k: v for k, v in (("quantization", quantization), ("kv_cache_dtype", kv_cache_dtype)) if v}
    llm = LLM(model, dtype=dtype, max_num_seqs=1, max_model_len=prompt + chunk, prefill_chunk=chunk,
              attention_impl=impl, enable_prefix_caching=False, **chosen)
    rng = np.random.default_rng(0)
    sp = SamplingParams(max_tokens=1, temperature=0.0)
    fresh = lambda: [rng.integers(2, llm.config.vocab_size, prompt).tolist()]  # noqa: E731
    t0 = time.perf_counter()
    llm.generate(fresh(), sp)
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    llm.generate(fresh(), sp)
    second = time.perf_counter() - t0
    # the last prefill call's arguments (kept as they are: converting them per call cost ~100 ms a call), to
    # compile its program's text
    eng, seen = llm.engine, {}
    jitted = eng.steps.prefill

    def recording(spec, *args):
        seen["args"] = (spec,) + args
        return jitted(spec, *args)

    eng.steps = dataclasses.replace(eng.steps, prefill=recording)
    t0 = time.perf_counter()
    llm.generate(fresh(), sp)
    wall = time.perf_counter() - t0   # the third call: the second can be slow on a GPU (BENCHMARKS, "Repeated calls")
    print(f"generate: first {first:.2f} s, second {second:.2f} s, third {wall:.3f} s", flush=True)
    eng.steps = dataclasses.replace(eng.steps, prefill=jitted)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
                            if isinstance(x, jax.Array) else x, seen["args"][1:])
    hlo = jitted.lower(seen["args"][0], *abstract).compile().as_text()
    prof = summarize(lambda: llm.generate(fresh(), sp), repeats=1, top=40, hlo_text=hlo)
    print(json.dumps({"model": model, "prompt": prompt, "chunk": chunk, "impl": impl, **chosen, "first_s": first,
                      "second_s": second, "wall_s": wall, "compiled_variants": jitted._cache_size(),
                      "kernels": prof.get("kernels"), "kernel_ms": prof.get("kernel_ms"),
                      "copy_ms": prof.get("copy_ms")}))
    for name, n, ms in prof.get("top", []):
        print(f"{ms:9.2f} ms {n:6.0f}x  {name}")
    print("by line of the model:")
    for name, n, ms in prof.get("by_source", []):
        print(f"{ms:9.2f} ms {n:6.0f}x  {name}")
    return 0


def repeat_check(model: str, impl: str, dtype: str = "bfloat16") -> int:
    """`--repeat-check` (see the module's docstring)."""
    import logging

    import jax
    import numpy as np
    from jax._src import config as jax_config

    from v4jax import LLM, SamplingParams

    jax.config.update("jax_log_compiles", True)
    logging.basicConfig(stream=sys.stdout, level=logging.WARNING, format="%(message)s")
    llm = LLM(model, dtype=dtype, max_num_seqs=1, max_model_len=4096, attention_impl=impl)
    eng = llm.engine
    jitted = eng.steps.prefill
    signatures = []

    def describe(leaf):
        if not isinstance(leaf, jax.Array):
            return ("python", type(leaf).__name__, leaf if np.isscalar(leaf) else None)
        return (str(jax.typeof(leaf)), str(leaf.sharding), leaf.committed, str(leaf.format.layout))

    def recording(spec, *args):
        paths, _ = jax.tree_util.tree_flatten_with_path(args)
        context = {f"config {n}": str(c) for n, c in zip(jax_config.trace_context_names(),
                                                         jax_config.trace_context())}
        leaves = {jax.tree_util.keystr(p): describe(x) for p, x in paths}
        signatures.append({"spec": (hash(spec), id(spec)), **context, **leaves})
        return jitted(spec, *args)

    eng.steps = dataclasses.replace(eng.steps, prefill=recording)
    rng = np.random.default_rng(0)
    sp = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    firsts = []
    for i in range(4):
        print(f"==== generate call {i}", flush=True)
        firsts.append(len(signatures))
        t0 = time.perf_counter()
        llm.generate([rng.integers(2, llm.config.vocab_size, 16).tolist()], sp)
        print(f"==== generate call {i}: {time.perf_counter() - t0:.2f} s; prefill variants {jitted._cache_size()}",
              flush=True)
    for i in range(1, 4):
        x, y = signatures[firsts[0]], signatures[firsts[i]]
        diff = [(k, x.get(k), y.get(k)) for k in sorted(set(x) | set(y)) if x.get(k) != y.get(k)]
        print(f"==== prefill arguments of call {i} vs call 0: {len(diff)} of {len(y)} differ")
        for k, u, v in diff[:20]:
            print(f"  {k}\n    call 0: {u}\n    call {i}: {v}")
    return 0
