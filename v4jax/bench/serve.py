"""`v4jax bench serve`: an open-loop load generator against a running `v4jax serve`.

    v4jax bench serve --url http://127.0.0.1:8000 --rate 4 --num-requests 64 --prompt-len 32 --output-len 16:64
    v4jax bench serve --replay multi_turn --step-s 0.05          # a trace of v4jax.bench.replay, steps -> seconds
    v4jax bench serve --num-requests 64 --max-concurrency 8 --prompt-len 512 --output-len 256:480 \
        --long-num 8 --long-rate 1 --long-prompt-len 8192 --long-output-len 8   # long prompts among decoding streams

Requests arrive as a Poisson process at `--rate` per second (`inf`: all at once), whatever the server's
progress (open loop), each a streamed `/v1/completions` call with a token-id prompt, `ignore_eos` (so outputs
have exactly the drawn length), `return_token_ids` and the usage chunk. Lengths are fixed (`N`) or uniform in
`LO:HI`; token ids uniform in [2, --vocab). With `--replay`, a trace's request without a parent arrives at
`arrival x --step-s`, one that extends a parent `arrival x --step-s` after the parent finished, its prompt the
parent's prompt + the tokens the parent got + its own new tokens (the prefix cache's case).

A second class of requests, `--long-num N` > 0: N long prompts (`--long-prompt-len`, `--long-output-len`) arriving
as a Poisson process at `--long-rate` per second from `--long-start` seconds on (their own schedule: the short
requests' arrivals and lengths are those of the same seed without them), while the short ones (`--num-requests`;
`--max-concurrency` bounds only these) decode. What a long prefill costs the streams decoding beside it (on one
server: its chunks run between their decode calls; disaggregated: on another server) shows in the short class's
ITL while a long request is between its send and its first token, against its ITL otherwise.

Measured per request on the client: TTFT = first chunk carrying a token - send; TPOT = (last token chunk - first)
/ (tokens - 1), over requests with >= 2 tokens (tokens come several per chunk: one engine decode call each);
e2e = end of stream - send; ITL = the gap between a stream's successive token chunks / the chunk's tokens (one
sample a chunk, in the units of TPOT). Throughput: output tokens (and prompt + output) / wall time from the first send
to the last end. p50 / p90 / p99 by linear interpolation. Errors are non-200 answers, error events and broken
streams, by kind. The server's prefix-cache counters and its compiled programs (/metrics) are read before and
after."""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import random
import sys
import time
from typing import Sequence


@dataclasses.dataclass
class Result:
    prompt_len: int
    sent: float
    first: float | None = None
    last: float | None = None
    end: float | None = None
    tokens: list = dataclasses.field(default_factory=list)
    error: str | None = None
    cls: str = "short"
    chunks: list = dataclasses.field(default_factory=list)  # (arrival, tokens) of each chunk carrying tokens


def _length(spec: str) -> tuple[int, int]:
    lo, _, hi = spec.partition(":")
    try:
        a, b = int(lo), int(hi or lo)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or LO:HI, got {spec!r}") from None
    if a < 1 or b < a:
        raise argparse.ArgumentTypeError(f"expected 1 <= LO <= HI, got {spec!r}")
    return a, b


class _Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults after each flag's help, except None (the help says what None means)."""

    def _get_help_string(self, action):
        return action.help if action.default is None else super()._get_help_string(action)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="v4jax bench serve", formatter_class=_Formatter,
                                description=__doc__)
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server")
    p.add_argument("--api-key", default=None, help="the server's --api-key, if it has one")
    p.add_argument("--model", default=None, help="model id (default: the first of /v1/models)")
    p.add_argument("--num-requests", type=int, default=64, help="requests to send (synthetic load)")
    p.add_argument("--rate", type=float, default=4.0, help="mean arrivals per second (Poisson); inf = all at once")
    p.add_argument("--prompt-len", type=_length, default=(128, 128), metavar="N|LO:HI", help="prompt tokens")
    p.add_argument("--output-len", type=_length, default=(64, 64), metavar="N|LO:HI", help="generated tokens")
    p.add_argument("--vocab", type=int, default=1000, help="prompt token ids are drawn from [2, vocab)")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0 = greedy)")
    p.add_argument("--max-concurrency", type=int, default=None, help="at most this many requests open at once "
                   "(default: no limit, a pure open loop)")
    p.add_argument("--long-num", type=int, default=0, help="long requests among the short ones (0: none)")
    p.add_argument("--long-prompt-len", type=_length, default=(4096, 4096), metavar="N|LO:HI",
                   help="long requests' prompt tokens")
    p.add_argument("--long-output-len", type=_length, default=(16, 16), metavar="N|LO:HI",
                   help="long requests' generated tokens")
    p.add_argument("--long-rate", type=float, default=1.0, help="long requests' mean arrivals per second (Poisson)")
    p.add_argument("--long-start", type=float, default=0.0, help="seconds after the first short request that the "
                   "long requests' arrivals start")
    p.add_argument("--replay", default=None, help="replay a v4jax.bench.replay trace instead: shared_system, "
                   "multi_turn, long_docs or agentic")
    p.add_argument("--replay-scale", type=float, default=1.0, help="the trace's length scale")
    p.add_argument("--step-s", type=float, default=0.05, help="seconds per trace step (replay arrivals)")
    p.add_argument("--warmup-requests", type=int, default=0, help="requests of the same shapes sent and awaited "
                   "first, not measured (they compile what the measured run uses)")
    p.add_argument("--warmup-settle-s", type=float, default=180.0, help="after the warm-up, wait up to this long "
                   "for the server's background compiles to end (its exact programs, which the warm-up's steps ran "
                   "without on covering ones), so that the measured run is the steady state; 0: do not wait")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds a request may take")
    p.add_argument("--seed", type=int, default=0, help="arrivals, lengths and token ids")
    p.add_argument("--out", default=None, help="directory for serve_bench.json and serve_bench.md")
    return p


# ---- one request ----
async def _one(client, model: str, prompt: list[int], max_tokens: int, temperature: float, timeout: float,
               res: Result) -> None:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": temperature,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}
    res.sent = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/completions", json=body, timeout=timeout) as r:
            if r.status_code != 200:
                await r.aread()
                res.error = f"HTTP {r.status_code}"
                return
            done = False
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = f"error event ({chunk['error'].get('code')})"
                    continue
                for ch in chunk.get("choices", []):
                    ids = ch.get("token_ids") or []
                    if ids:
                        now = time.perf_counter()
                        res.first = res.first or now
                        res.last = now
                        res.tokens += ids
                        res.chunks.append((now, len(ids)))
            if not done and res.error is None:
                res.error = "stream ended without [DONE]"
    except Exception as e:  # a broken connection, a timeout: counted, the run goes on
        res.error = type(e).__name__
    finally:
        res.end = time.perf_counter()


# ---- workloads ----
async def _synthetic(client, a, model: str, rng: random.Random) -> list[Result]:
    reqs = []
    t = 0.0
    for _ in range(a.num_requests):
        p = [rng.randrange(2, a.vocab) for _ in range(rng.randint(*a.prompt_len))]
        reqs.append((t, p, rng.randint(*a.output_len), "short"))
        if not math.isinf(a.rate):
            t += rng.expovariate(a.rate)
    long_rng = random.Random(rng.random())  # its own draws: the short requests are those of the seed without it
    t = a.long_start
    for _ in range(a.long_num):
        p = [long_rng.randrange(2, a.vocab) for _ in range(long_rng.randint(*a.long_prompt_len))]
        reqs.append((t, p, long_rng.randint(*a.long_output_len), "long"))
        t += long_rng.expovariate(a.long_rate)
    sem = asyncio.Semaphore(a.max_concurrency) if a.max_concurrency else None
    start = time.perf_counter()
    results = [Result(len(p), 0.0, cls=c) for _, p, _, c in reqs]

    async def fire(i):
        at, p, mt, cls = reqs[i]
        await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
        if sem is None or cls == "long":
            await _one(client, model, p, mt, a.temperature, a.timeout, results[i])
        else:
            async with sem:
                await _one(client, model, p, mt, a.temperature, a.timeout, results[i])

    await asyncio.gather(*(fire(i) for i in range(len(reqs))))
    return results


async def _replayed(client, a, model: str) -> list[Result]:
    from v4jax.bench.replay import TRACES, make_traces
    if a.replay not in TRACES:
        raise SystemExit(f"--replay {a.replay!r}: traces are {', '.join(TRACES)}")
    trace = make_traces([a.replay], a.vocab, a.seed, a.replay_scale)[0]
    done: dict[str, asyncio.Future] = {r.rid: asyncio.get_running_loop().create_future() for r in trace.requests}
    results: dict[str, Result] = {}
    start = time.perf_counter()

    async def fire(tr):
        if tr.parent is None:
            prompt = list(tr.new_tokens)
            await asyncio.sleep(max(0.0, start + tr.arrival * a.step_s - time.perf_counter()))
        else:
            ctx = await done[tr.parent]
            if ctx is None:  # the parent failed: this turn cannot be built
                results[tr.rid] = Result(0, time.perf_counter(), error="parent failed", end=time.perf_counter())
                done[tr.rid].set_result(None)
                return
            prompt = ctx + list(tr.new_tokens)
            await asyncio.sleep(tr.arrival * a.step_s)
        res = results[tr.rid] = Result(len(prompt), 0.0)
        await _one(client, model, prompt, tr.max_tokens, a.temperature, a.timeout, res)
        done[tr.rid].set_result(None if res.error else prompt + res.tokens)

    await asyncio.gather(*(fire(tr) for tr in trace.requests))
    return [results[r.rid] for r in trace.requests]


# ---- report ----
def _pct(xs: Sequence[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    k = (len(s) - 1) * q / 100
    lo = int(math.floor(k))
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def _dist(xs: Sequence[float]) -> dict:
    return {"mean": sum(xs) / len(xs) if xs else None, "p50": _pct(xs, 50), "p90": _pct(xs, 90),
            "p99": _pct(xs, 99), "max": max(xs, default=None)}


def summarize(results: list[Result]) -> dict:
    ok = [r for r in results if r.error is None]
    errors: dict[str, int] = {}
    for r in results:
        if r.error is not None:
            errors[r.error] = errors.get(r.error, 0) + 1
    t0 = min((r.sent for r in results), default=0.0)
    t1 = max((r.end for r in results if r.end is not None), default=t0)
    wall = max(t1 - t0, 1e-9)
    out_tok = sum(len(r.tokens) for r in ok)
    in_tok = sum(r.prompt_len for r in ok)
    return {
        "requests": len(results), "completed": len(ok), "errors": sum(errors.values()), "errors_by_kind": errors,
        "duration_s": wall, "request_throughput": len(ok) / wall, "output_throughput": out_tok / wall,
        "total_throughput": (in_tok + out_tok) / wall, "prompt_tokens": in_tok, "output_tokens": out_tok,
        "ttft_s": _dist([r.first - r.sent for r in ok if r.first is not None]),
        "tpot_s": _dist([(r.last - r.first) / (len(r.tokens) - 1) for r in ok if len(r.tokens) >= 2]),
        "e2e_s": _dist([r.end - r.sent for r in ok]),
        "itl_s": _dist([x for r in ok for _, _, x in _itl(r)]),
        # the longest wait of a stream between two chunks: a stall of the whole server (a compile) shows here
        "max_gap_s": max((t1 - t0 for r in ok for t0, t1, _ in _itl(r)), default=None),
    }


def _itl(r: Result) -> list[tuple[float, float, float]]:
    """(gap start, gap end, seconds per token) of each chunk after a stream's first."""
    return [(t0, t1, (t1 - t0) / n) for (t0, _), (t1, n) in zip(r.chunks, r.chunks[1:])]


def summarize_classes(results: list[Result]) -> dict:
    """Per class (short, long): the summary of its requests with their ITL; for the short class, its ITL split by
    whether the gap overlaps a long request's wait for its first token (send -> first token: its prefill, and
    disaggregated its transfer)."""
    out = {}
    waits = [(r.sent, r.first if r.first is not None else r.end) for r in results if r.cls == "long"]
    for cls in ("short", "long"):
        mine = [r for r in results if r.cls == cls]
        if not mine:
            continue
        s = summarize(mine)
        gaps = [g for r in mine if r.error is None for g in _itl(r)]
        s["itl_s"] = _dist([x for _, _, x in gaps])
        if cls == "short" and waits:
            overlap = [any(t0 < w1 and w0 < t1 for w0, w1 in waits) for t0, t1, _ in gaps]
            during = [x for (_, _, x), o in zip(gaps, overlap) if o]
            outside = [x for (_, _, x), o in zip(gaps, overlap) if not o]
            s["itl_during_long_s"] = {**_dist(during), "n": len(during)}
            s["itl_outside_long_s"] = {**_dist(outside), "n": len(outside)}
        out[cls] = s
    return out


def markdown(rep: dict) -> str:
    s = rep["summary"]
    ms = lambda d: " / ".join("-" if d[k] is None else f"{d[k] * 1e3:.0f}" for k in ("p50", "p90", "p99"))
    sec = lambda d: " / ".join("-" if d[k] is None else f"{d[k]:.2f}" for k in ("p50", "p90", "p99"))
    pc = rep.get("prefix_cache") or {}
    reuse = f"{pc['hit_tokens']} / {pc['queried_tokens']}" if pc else "-"
    head = ("| load | requests | ok | errors | duration s | req/s | out tok/s | total tok/s | TTFT p50 / p90 / p99 ms "
            "| TPOT p50 / p90 / p99 ms | e2e p50 / p90 / p99 s | prefix hit / queried tok |")
    row = (f"| {rep['load']} | {s['requests']} | {s['completed']} | {s['errors']} | {s['duration_s']:.1f} | "
           f"{s['request_throughput']:.2f} | {s['output_throughput']:.1f} | {s['total_throughput']:.1f} | "
           f"{ms(s['ttft_s'])} | {ms(s['tpot_s'])} | {sec(s['e2e_s'])} | {reuse} |")
    lines = [head, "|" + "---|" * (head.count("|") - 1), row]
    if (es := rep.get("engine_steps")) and es["steps"]:
        lines.append("\nengine: " + engine_line(es))
    if rep.get("warmup_settled_s"):
        lines.append(f"\nafter the warm-up: {rep['warmup_settled_s']:.1f} s waited for the server's background "
                     "compiles to end")
    cw = rep.get("compiled_while_measured")
    if cw and cw["programs_compiled"]:
        waited = cw["programs_compiled"] - cw.get("background", 0)
        lines.append(f"\nprograms compiled while measured: {cw['programs_compiled']:.0f} "
                     f"({cw['compile_seconds']:.1f} s of compiling); every stream waited for {waited:.0f} of them"
                     + (f", {cw['background']:.0f} compiled in the background while {cw['substituted_steps']:.0f} "
                        "steps ran on covering programs" if cw.get("background") else ""))
    if cw and cw.get("still_compiling"):
        lines.append(f"\nstill compiling in the background at the end: {cw['still_compiling']:.0f} "
                     f"({cw.get('substituted_steps', 0):.0f} steps ran on covering programs)")
    if s["errors_by_kind"]:
        lines.append("\nerrors: " + ", ".join(f"{k}: {v}" for k, v in sorted(s["errors_by_kind"].items())))
    if rep.get("classes"):
        lines += ["", class_table([("", rep)])]
    return "\n".join(lines)


def class_table(reps: Sequence[tuple[str, dict]]) -> str:
    """One row per (run, class) of runs with a long class: TTFT, TPOT and ITL p50 / p99 in ms, and the short
    class's ITL while a long request waits for its first token against otherwise (with the gaps counted)."""
    ms = lambda d: "-" if not d or d["p50"] is None else f"{d['p50'] * 1e3:.1f} / {d['p99'] * 1e3:.1f}"
    with_n = lambda d: "-" if not d or d["p50"] is None else f"{ms(d)} ({d['n']})"
    lines = ["| run | class | requests | ok | prompt | output | TTFT p50 / p99 ms | TPOT p50 / p99 ms "
             "| ITL p50 / p99 ms | short ITL during long prefills p50 / p99 ms (gaps) | short ITL otherwise p50 / p99 ms (gaps) |",
             "|---|---|---:|---:|---|---|---|---|---|---|---|"]
    for label, rep in reps:
        args = rep.get("args", {})
        for cls, c in (rep.get("classes") or {}).items():
            prompt, output = ((args.get("long_prompt_len"), args.get("long_output_len")) if cls == "long" else
                              (args.get("prompt_len"), args.get("output_len")))
            spec = lambda r: "-" if not r else _spec(tuple(r))
            lines.append(f"| {label or '-'} | {cls} | {c['requests']} | {c['completed']} | {spec(prompt)} | "
                         f"{spec(output)} | {ms(c['ttft_s'])} | {ms(c['tpot_s'])} | {ms(c['itl_s'])} | "
                         f"{with_n(c.get('itl_during_long_s'))} | {with_n(c.get('itl_outside_long_s'))} |")
    return "\n".join(lines)


def engine_line(es: dict) -> str:
    """An engine's steps over a run (LLM.stats()["steps"]'s difference, or /metrics'), in one line: their wall
    and device-wait ms a step, and what they dispatched: prefill steps with their rows, decode calls with the
    requests they advanced, each on average (the same requests arriving together and apart differ there)."""
    n = es["steps"]
    seconds = es.get("step_seconds", es.get("seconds", 0.0))
    line = (f"{n:.0f} steps, {1e3 * seconds / n:.2f} ms a step, of it {1e3 * es['device_wait_seconds'] / n:.2f} "
            "waiting on the device")
    if "prefill_steps" in es:
        p, d = es["prefill_steps"], es["decode_calls"]
        line += (f"; {p:.0f} prefill steps" + (f" of {es['prefill_rows'] / p:.1f} rows" if p else "")
                 + f", {d:.0f} decode calls" + (f" of {es['decode_rows'] / d:.1f} requests" if d else ""))
    return line


def _counter(text: str, name: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


_COUNTERS = {"queried_tokens": "v4jax_prefix_cache_queried_tokens_total",
             "hit_tokens": "v4jax_prefix_cache_hit_tokens_total",
             "programs_compiled": "v4jax_programs_compiled_total",
             "compile_seconds": "v4jax_program_compile_seconds_total",
             "background": "v4jax_programs_compiled_background_total",
             "substituted_steps": "v4jax_steps_substituted_total",
             "compiling": "v4jax_programs_compiling",
             "steps": "v4jax_engine_steps_total",
             "step_seconds": "v4jax_engine_step_seconds_total",
             "device_wait_seconds": "v4jax_engine_device_wait_seconds_total",
             "prefill_steps": "v4jax_engine_prefill_steps_total",
             "prefill_rows": "v4jax_engine_prefill_rows_total",
             "decode_calls": "v4jax_engine_decode_calls_total",
             "decode_rows": "v4jax_engine_decode_rows_total"}


async def _server_counters(client) -> dict:
    """The server's counters that bench serve reports as a run's difference (those /metrics has; a router's has
    none of them)."""
    try:
        text = (await client.get("/metrics")).text
    except Exception:
        return {}
    return {k: v for k, name in _COUNTERS.items() if (v := _counter(text, name)) is not None}


def _delta(before: dict, after: dict, keys: Sequence[str], kind=int) -> dict | None:
    if not all(k in before and k in after for k in keys):
        return None
    return {k: kind(after[k] - before[k]) for k in keys}


async def _settle(client, limit_s: float) -> float | None:
    """Wait (up to limit_s) until the server compiles nothing in the background; the seconds waited (None: the
    server does not say what it compiles)."""
    t0 = time.monotonic()
    while True:
        compiling = (await _server_counters(client)).get("compiling")
        if compiling is None:
            return None
        if not compiling or time.monotonic() - t0 >= limit_s:
            return time.monotonic() - t0
        await asyncio.sleep(0.5)


async def run(a) -> dict:
    import httpx
    headers = {"Authorization": f"Bearer {a.api_key}"} if a.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=a.url, headers=headers, limits=limits, timeout=a.timeout) as client:
        models = (await client.get("/v1/models")).raise_for_status().json()["data"]
        model = a.model or models[0]["id"]
        rng = random.Random(a.seed)
        settled_s = None
        if a.warmup_requests:
            # the long class too (two at most), arriving while the short ones decode: their mixed steps compile
            warm = argparse.Namespace(**{**vars(a), "num_requests": a.warmup_requests, "rate": math.inf,
                                         "long_num": min(a.long_num, 2)})
            res = await _synthetic(client, warm, model, random.Random(a.seed + 1))
            bad = [r.error for r in res if r.error]
            if bad:
                raise SystemExit(f"warm-up failed: {bad[0]}")
            settled_s = await _settle(client, a.warmup_settle_s)
        before = await _server_counters(client)
        results = await (_replayed(client, a, model) if a.replay else _synthetic(client, a, model, rng))
        after = await _server_counters(client)
    pc = _delta(before, after, ("queried_tokens", "hit_tokens"))
    # the engine thread's steps while measured: wall and device-wait seconds (the rest is its host side, which
    # shares the GIL with the server's other threads)
    engine = _delta(before, after, ("steps", "step_seconds", "device_wait_seconds"), float)
    if engine is not None:  # what the steps dispatched (a server before these counters has none)
        engine.update(_delta(before, after, ("prefill_steps", "prefill_rows", "decode_calls", "decode_rows"), float)
                      or {})
    # programs the server compiled while measured: each one stalled every stream for its compile, unless it was
    # compiled in the background while covering programs ran the steps (substituted_steps)
    compiled = _delta(before, after, ("programs_compiled", "compile_seconds"), float)
    if compiled is not None:
        compiled.update(_delta(before, after, ("background", "substituted_steps"), float) or {})
        if "compiling" in after:  # at the end, still compiling in the background (counted once done)
            compiled["still_compiling"] = after["compiling"]
    load = (f"replay {a.replay} (scale {a.replay_scale:g}, {a.step_s:g} s/step)" if a.replay else
            f"{'all at once' if math.isinf(a.rate) else f'Poisson {a.rate:g}/s'}, prompt {_spec(a.prompt_len)}, "
            f"output {_spec(a.output_len)}")
    if a.long_num and not a.replay:
        load += (f"; {a.long_num} long (prompt {_spec(a.long_prompt_len)}, output {_spec(a.long_output_len)}) at "
                 f"Poisson {a.long_rate:g}/s from {a.long_start:g} s")
    t0 = min((r.sent for r in results), default=0.0)
    per_request = [{"class": r.cls, "sent_s": r.sent - t0, "prompt_len": r.prompt_len, "tokens": len(r.tokens),
                    "ttft_s": None if r.first is None else r.first - r.sent,
                    "e2e_s": None if r.end is None else r.end - r.sent, "error": r.error} for r in results]
    classes = summarize_classes(results) if any(r.cls == "long" for r in results) else None
    return {"load": load, "model": model, "url": a.url, "summary": summarize(results), "classes": classes,
            "prefix_cache": pc, "compiled_while_measured": compiled, "warmup_settled_s": settled_s,
            "engine_steps": engine,
            "requests": per_request,
            "args": {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(a).items() if k != "api_key"}}


def _spec(r: tuple[int, int]) -> str:
    return f"{r[0]}" if r[0] == r[1] else f"{r[0]}:{r[1]}"


def main(argv: Sequence[str] | None = None) -> int:
    p = _parser()
    a = p.parse_args(argv)
    if a.long_num and a.replay:
        p.error("--long-num is a synthetic load's second class: not with --replay")
    if a.long_num and not a.long_rate > 0:
        p.error("--long-rate must be > 0")
    rep = asyncio.run(run(a))
    rep["command"] = "v4jax bench serve " + " ".join(argv if argv is not None else sys.argv[1:])
    table = markdown(rep)
    print(table)
    print(json.dumps(rep["summary"], indent=1))
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "serve_bench.json"), "w") as f:
            json.dump(rep, f, indent=1, default=str)
        with open(os.path.join(a.out, "serve_bench.md"), "w") as f:
            f.write(table + "\n")
    return 0 if rep["summary"]["completed"] else 1


if __name__ == "__main__":
    sys.exit(main())
