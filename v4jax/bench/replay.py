"""Replay benchmark (prefix cache): request traces against three engine layouts.

    python -m v4jax.bench.replay [--model MODEL] [--trace NAME[,NAME]] [--scale S] [--out DIR]

Each trace is replayed on `kv_layout="dense"` (every slot owns a contiguous max_model_len span: the generic
baseline), on `kv_layout="paged"` without the prefix cache, and on paged with the prefix cache. One engine per
layout (an `EngineCore` built from the loaded model) serves every trace, its prefix cache emptied between runs;
unless `--warmup none`, each trace is first replayed once unmeasured, so the measured run compiles nothing.

Traces (synthetic, seeded; token ids uniform in [2, vocab); lengths multiples of 32 tokens times `--scale`):
  shared_system  one long system prompt shared by many users, each with its own question, arriving every few steps
  multi_turn     conversations whose context grows turn by turn: each turn's prompt = the previous turn's prompt +
                 the tokens it generated + a new user message; a turn is added when the previous one finished
  long_docs      long documents, several questions about each, interleaved across documents
  agentic        long agent sessions: each step's prompt = the previous context + its output + a tool result

Arrivals are closed-loop by engine step count, so a run is deterministic: a request without a parent is added
before step `arrival`; a request that extends a parent is added `arrival` steps after the step in which the
parent finished (its prompt uses the tokens the parent actually generated). When nothing is running and nothing
is due, the step counter jumps to the next arrival (no idle time is counted). Decoding is greedy with
ignore_eos=True.

Measured per (trace, layout):
  * times: host wall-clock spent inside EngineCore.add_request / step() calls (the replay's own bookkeeping,
    stats sampling included, is excluded; the device work is inside because step() reads each decode call's
    tokens). Arrival = the clock when the request is added; TTFT = the clock after the step() whose delta first
    carries a token for it; TPOT = (last token time - first token time) / (n - 1), over requests with n >= 2
    tokens (tokens come k per decode call, so TPOT is a per-call time / k). p50 / p90 / p99 by linear
    interpolation.
  * throughput: generated tokens / engine time, and (prompt + generated) tokens / engine time (every prompt
    token counted, cached or not).
  * peak pool memory: after every step, stats()["pools"] used counts times bytes per unit, maximised over steps:
    full pages (one id addresses a page's rows of every compressed pool: C4 KV and C4 indexer keys on CSA
    layers, C128 KV on HCA layers, and the int32 token ids) x bytes per full page, + SWA pages x bytes per SWA
    page (the window KV rows of every layer, plus, with the prefix cache, the boundary-state row that rides in
    each SWA page) + compressor-state slots in use x bytes per slot. Bytes per unit are the engine's own arrays
    (v4jax.cache.pool_bytes / PoolLayout). With the prefix cache, pages held only by the cache are in use too;
    "peak mapped" counts only the pages some request maps (what the cache could evict down to). Dense counts a
    slot's whole reserved span while the slot is occupied. "pool alloc" = every pool array the layout allocates.
  * prefix reuse: reused = stats()["prefix_cache"]["hit_tokens"], queried = ["queried_tokens"] (every
    admission, re-admissions after preemption too); reusable = what a perfect cache could reuse, from the
    trace: per request, the full pages of its prompt (at most prompt_len - 1 tokens, as the engine caps a match)
    that equal the leading pages of an earlier-added request's prompt + output without its last token (the
    tokens whose KV that request wrote), summed.
  * same tokens: every request's generated tokens equal to those of the paged run without the prefix cache.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import platform
import sys
import time
from typing import Callable, Sequence

import numpy as np

LAYOUTS = {  # name -> (kv_layout, enable_prefix_caching)
    "dense": ("dense", False),
    "paged": ("paged", False),
    "paged+prefix": ("paged", True),
}
REFERENCE_LAYOUT = "paged"  # "same tokens" compares against it
GRANULE = 32  # trace lengths are multiples of this (few prefill-chunk buckets to compile)


# ---- traces ----------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class TraceRequest:
    rid: str
    new_tokens: list  # the whole prompt, or (with a parent) what is appended to the parent's prompt + output
    max_tokens: int
    arrival: int = 0  # step it is due; with a parent: steps after the step in which the parent finished
    parent: str | None = None


@dataclasses.dataclass
class Trace:
    name: str
    requests: list  # TraceRequest, in the order they are added when due at the same step
    params: dict

    def by_id(self) -> dict:
        return {r.rid: r for r in self.requests}

    def prompt_len(self, rid: str, _memo: dict | None = None) -> int:
        """Prompt length, known before the run: outputs have exactly max_tokens tokens (ignore_eos)."""
        memo = {} if _memo is None else _memo
        if rid not in memo:
            r = self.by_id()[rid]
            memo[rid] = len(r.new_tokens) + (0 if r.parent is None else
                                             self.prompt_len(r.parent, memo) + self.by_id()[r.parent].max_tokens)
        return memo[rid]

    def max_context(self) -> int:
        memo: dict = {}
        return max(self.prompt_len(r.rid, memo) + r.max_tokens for r in self.requests)

    def working_set_pages(self, page_size: int, max_num_seqs: int) -> int:
        """Full pages a cache must hold for this trace to reuse everything: the largest contexts that are live at
        once. A session (a chain of requests extending one another) runs one request at a time, and its longest
        context (prompt + max_tokens) holds every earlier turn's pages; while it waits for its next turn its pages
        must stay, so every session of two or more requests counts (the traces open all sessions at once).
        Requests that extend nothing are live only while they run: the `max_num_seqs` largest count."""
        memo: dict = {}
        root_of: dict = {}
        size: dict = {}
        n_in: dict = {}
        for r in self.requests:  # parents come before their children
            root = r.rid if r.parent is None else root_of[r.parent]
            root_of[r.rid] = root
            pages = -(-(self.prompt_len(r.rid, memo) + r.max_tokens) // page_size)
            size[root] = max(size.get(root, 0), pages)
            n_in[root] = n_in.get(root, 0) + 1
        sessions = sum(v for k, v in size.items() if n_in[k] > 1)
        single = sorted((v for k, v in size.items() if n_in[k] == 1), reverse=True)[:max_num_seqs]
        return sessions + sum(single)


def _length(rng, lo: int, hi: int, scale: float, g: int = GRANULE) -> int:
    """A length in [lo, hi] * scale, a multiple of g (at least one)."""
    n = int(rng.integers(int(lo * scale) // g, int(hi * scale) // g + 1))
    return max(1, n) * g


def _scaled(n: int, scale: float, g: int = GRANULE) -> int:
    return max(1, int(n * scale) // g) * g


def _ids(rng, vocab: int, n: int) -> list:
    return rng.integers(2, vocab, n).tolist()


def shared_system(vocab: int, seed: int = 0, scale: float = 1.0, *, system_tokens: int = 1024, users: int = 8,
                  question_tokens: tuple = (32, 96), max_tokens: int = 32, gap: int = 2,
                  granule: int = GRANULE) -> Trace:
    """One system prompt shared by every user; user i's question arrives at step i * gap."""
    rng = np.random.default_rng([seed, 1])
    system = _ids(rng, vocab, _scaled(system_tokens, scale, granule))
    reqs = [TraceRequest(f"user{i}", system + _ids(rng, vocab, _length(rng, *question_tokens, scale, granule)),
                         max_tokens, arrival=i * gap) for i in range(users)]
    return Trace("shared_system", reqs, dict(system_tokens=len(system), users=users, question_tokens=question_tokens,
                                             max_tokens=max_tokens, gap=gap, scale=scale, granule=granule))


def multi_turn(vocab: int, seed: int = 0, scale: float = 1.0, *, conversations: int = 3, turns: int = 5,
               first_tokens: tuple = (256, 512), user_tokens: tuple = (64, 160), max_tokens: int = 32,
               gap: int = 3, think: int = 1, granule: int = GRANULE) -> Trace:
    """Conversation c starts at step c * gap; turn t + 1 = turn t's prompt + its output + a new user message,
    added `think` steps after turn t finished."""
    rng = np.random.default_rng([seed, 2])
    reqs = []
    for c in range(conversations):
        reqs.append(TraceRequest(f"c{c}t0", _ids(rng, vocab, _length(rng, *first_tokens, scale, granule)),
                                 max_tokens, arrival=c * gap))
        for t in range(1, turns):
            reqs.append(TraceRequest(f"c{c}t{t}", _ids(rng, vocab, _length(rng, *user_tokens, scale, granule)),
                                     max_tokens, arrival=think, parent=f"c{c}t{t - 1}"))
    return Trace("multi_turn", reqs, dict(conversations=conversations, turns=turns, first_tokens=first_tokens,
                                          user_tokens=user_tokens, max_tokens=max_tokens, gap=gap, think=think,
                                          scale=scale, granule=granule))


def long_docs(vocab: int, seed: int = 0, scale: float = 1.0, *, docs: int = 2, doc_tokens: int = 1536,
              questions: int = 4, question_tokens: tuple = (32, 64), max_tokens: int = 32, gap: int = 3,
              granule: int = GRANULE) -> Trace:
    """Question q about document d (= document + question) arrives at step (q * docs + d) * gap."""
    rng = np.random.default_rng([seed, 3])
    texts = [_ids(rng, vocab, _scaled(doc_tokens, scale, granule)) for _ in range(docs)]
    reqs = [TraceRequest(f"d{d}q{q}", texts[d] + _ids(rng, vocab, _length(rng, *question_tokens, scale, granule)),
                         max_tokens, arrival=(q * docs + d) * gap) for q in range(questions) for d in range(docs)]
    return Trace("long_docs", reqs, dict(docs=docs, doc_tokens=len(texts[0]), questions=questions,
                                         question_tokens=question_tokens, max_tokens=max_tokens, gap=gap,
                                         scale=scale, granule=granule))


def agentic(vocab: int, seed: int = 0, scale: float = 1.0, *, sessions: int = 1, task_tokens: int = 512,
            steps: int = 8, tool_tokens: tuple = (96, 160), max_tokens: int = 32, gap: int = 2,
            granule: int = GRANULE) -> Trace:
    """Session s starts at step s * gap with its system prompt + task; step i + 1 = step i's prompt + its output
    (the tool call) + the tool's result, added as soon as step i finished."""
    rng = np.random.default_rng([seed, 4])
    task = _scaled(task_tokens, scale, granule)
    reqs = []
    for s in range(sessions):
        reqs.append(TraceRequest(f"s{s}step0", _ids(rng, vocab, task), max_tokens, arrival=s * gap))
        for i in range(1, steps):
            reqs.append(TraceRequest(f"s{s}step{i}", _ids(rng, vocab, _length(rng, *tool_tokens, scale, granule)),
                                     max_tokens, arrival=0, parent=f"s{s}step{i - 1}"))
    return Trace("agentic", reqs, dict(sessions=sessions, task_tokens=task, steps=steps, tool_tokens=tool_tokens,
                                       max_tokens=max_tokens, gap=gap, scale=scale, granule=granule))


TRACES: dict[str, Callable[..., Trace]] = {
    "shared_system": shared_system, "multi_turn": multi_turn, "long_docs": long_docs, "agentic": agentic}


# ---- what a perfect cache could reuse --------------------------------------------------------------------------
def reusable_tokens(order: Sequence[str], prompts: dict, outputs: dict, page_size: int) -> dict:
    """rid -> tokens a perfect prefix cache could reuse: the leading full pages of the prompt (at most
    prompt_len - 1 tokens) equal to those of an earlier-added request's prompt + output[:-1]."""
    p = page_size
    trie: dict = {}
    out = {}
    for rid in order:
        prompt = prompts[rid]
        node, n = trie, 0
        for i in range((len(prompt) - 1) // p):
            node = node.get(tuple(prompt[i * p:(i + 1) * p]))
            if node is None:
                break
            n += 1
        out[rid] = n * p
        seq = list(prompt) + list(outputs[rid][:-1])
        node = trie
        for i in range(len(seq) // p):
            node = node.setdefault(tuple(seq[i * p:(i + 1) * p]), {})
    return out


# ---- pool sizes ------------------------------------------------------------------------------------------------
def unit_bytes(core) -> dict:
    """Bytes per unit of each pool kind of an EngineCore, from its own arrays: per full page, per SWA page (with
    the boundary-state row that rides in it when the prefix cache is on), per compressor-state slot; and the
    total it allocates."""
    from v4jax import cache as C
    from v4jax.cache.boundary import store_bytes
    lay = core.layout
    pb = C.pool_bytes(core.pools)
    store = store_bytes(core.store)
    full = pb.get("kv", 0) + pb.get("idx", 0) + pb.get("tokens", 0)
    state = sum(v for k, v in pb.items() if k.startswith("state") or k.startswith("idx_state"))
    return {"full_page": full / lay.n_pages, "swa_page": (pb.get("swa", 0) + store) / lay.n_swa_pages,
            "slot": state / lay.max_slots, "allocated": sum(pb.values()) + store,
            "n_pages": lay.n_pages, "n_swa_pages": lay.n_swa_pages, "page_size": lay.page_size,
            "swa_page_size": lay.swa_page_size, "slots": lay.max_slots}


def budget_for_pages(cfg, options, max_model_len: int, dtype, n_pages: int) -> int:
    """memory_budget_bytes for which the engine allocates `n_pages` full pages (rounded up to whole TPU tiles in
    every block of the mesh's data x context, v4jax.cache.layout.page_multiple): the bytes of the engine's pools
    (pool_layout, pool_sizes) with that many pages: SWA pages of every data shard with their boundary rows,
    compressor states, and the full pages."""
    import math

    from v4jax.cache.layout import kv_cache_dtype, mesh_shards, page_multiple, pool_layout, pool_sizes
    n_data, n_ctx = mesh_shards(options.mesh)
    dtype = kv_cache_dtype(options.kv_cache_dtype, dtype)
    lay = pool_layout(cfg, dataclasses.replace(options, memory_budget_bytes=None), dtype, max_model_len, n_data,
                      n_ctx)
    caching = options.enable_prefix_caching and options.kv_layout == "paged"
    mult = math.lcm(page_multiple(cfg, lay.page_size, dtype), n_data * n_ctx)
    lay = dataclasses.replace(lay, n_pages=-(-n_pages // mult) * mult)
    return sum(s.bytes for s in pool_sizes(cfg, lay, dtype, caching).values())


# ---- the replay loop -------------------------------------------------------------------------------------------
def _percentiles(xs) -> dict:
    if not xs:
        return {"p50": None, "p90": None, "p99": None}
    a = np.asarray(xs, float)
    return {f"p{q}": float(np.percentile(a, q)) for q in (50, 90, 99)}


def _mapped_pages(core) -> tuple[int, int, int]:
    """(full, SWA, slots) that running requests map right now (pages held only by the prefix cache excluded)."""
    slots = core.scheduler.slots_in_use()
    return (*core.kv.mapped_pages(slots), len(slots))


def replay_trace(core, trace: Trace, *, max_steps: int = 1_000_000) -> dict:
    """Drive `core` through `trace` (closed loop by step count); returns the per-request record and the run's
    counters. The prefix cache is emptied first, so every run starts cold."""
    from v4jax.engine.sampling import SamplingParams
    sch = core.scheduler
    if core.has_unfinished_requests():
        raise RuntimeError("the engine still has unfinished requests")
    core.kv.reset_prefix_cache()
    s0 = core.stats()
    units = unit_bytes(core)
    reqs = trace.by_id()
    children: dict = {}
    for r in trace.requests:
        if r.parent is not None:
            children.setdefault(r.parent, []).append(r.rid)
    due = {r.rid: r.arrival for r in trace.requests if r.parent is None}
    pos = {r.rid: i for i, r in enumerate(trace.requests)}
    order: list = []  # rids in the order they were added
    prompts, outputs, rec = {}, {}, {}
    admitted_hit: dict = {}
    clock = 0.0
    step = 0
    peak = {"bytes": 0.0, "full": 0, "swa": 0, "slots": 0, "mapped_bytes": 0.0}

    orig_admit = sch.admit

    def admit(*args):  # observe each admission: the tokens its prefix hit mapped (req.computed right after it)
        out = orig_admit(*args)
        for r in out:
            admitted_hit.setdefault(r.request_id, r.computed)
        return out

    sch.admit = admit
    try:
        while due or core.has_unfinished_requests():
            ready = sorted((rid for rid, s in due.items() if s <= step), key=lambda rid: (due[rid], pos[rid]))
            for rid in ready:
                r = reqs[rid]
                prompt = list(r.new_tokens) if r.parent is None else (prompts[r.parent] + outputs[r.parent]
                                                                      + list(r.new_tokens))
                sp = SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True)
                t0 = time.perf_counter()
                core.add_request(rid, prompt, sp)
                clock += time.perf_counter() - t0
                del due[rid]
                order.append(rid)
                prompts[rid], outputs[rid] = prompt, []
                rec[rid] = {"arrival": clock, "times": [], "prompt_len": len(prompt)}
            if not core.has_unfinished_requests():
                step = min(due.values())  # idle: jump to the next arrival
                continue
            t0 = time.perf_counter()
            deltas = core.step()
            clock += time.perf_counter() - t0
            step += 1
            if step > max_steps:
                raise RuntimeError(f"{trace.name}: more than {max_steps} steps")
            for d in deltas:
                if d.new_token_ids:
                    outputs[d.request_id].extend(d.new_token_ids)
                    rec[d.request_id]["times"].extend([clock] * len(d.new_token_ids))
                if d.finish_reason is not None:
                    rec[d.request_id]["finish"] = d.finish_reason
                    rec[d.request_id]["finish_step"] = step
                    for c in children.get(d.request_id, ()):
                        due[c] = step + reqs[c].arrival
            st = core.stats()["pools"]
            full, swa, slots = st["tokens"]["used"], st["swa"]["used"], st["compressor_state"]["used"]
            b = full * units["full_page"] + swa * units["swa_page"] + slots * units["slot"]
            if b > peak["bytes"]:
                peak.update(bytes=b, full=full, swa=swa, slots=slots)
            mf, ms, msl = _mapped_pages(core)
            peak["mapped_bytes"] = max(peak["mapped_bytes"],
                                       mf * units["full_page"] + ms * units["swa_page"] + msl * units["slot"])
    finally:
        sch.admit = orig_admit
    s1 = core.stats()
    pc0, pc1 = s0["prefix_cache"], s1["prefix_cache"]
    return {"order": order, "prompts": prompts, "outputs": outputs, "rec": rec, "hit": admitted_hit,
            "engine_s": clock, "steps": step, "peak": peak, "units": units,
            "hit_tokens": pc1["hit_tokens"] - pc0["hit_tokens"],
            "queried_tokens": pc1["queried_tokens"] - pc0["queried_tokens"],
            "evicted_pages": pc1["evicted_pages"] - pc0["evicted_pages"],
            "tombstoned_tails": pc1["tombstoned_tails"] - pc0["tombstoned_tails"],
            "preempted": s1["requests"]["preempted"] - s0["requests"]["preempted"]}


def summarize(trace: Trace, layout: str, run: dict, page_size: int) -> dict:
    """One row of the report from a replay_trace result."""
    rec, outs, prompts = run["rec"], run["outputs"], run["prompts"]
    ttft = [(r["times"][0] - r["arrival"]) * 1e3 for r in rec.values() if r["times"]]
    tpot = [(r["times"][-1] - r["times"][0]) / (len(r["times"]) - 1) * 1e3 for r in rec.values()
            if len(r["times"]) >= 2]
    gen = sum(len(o) for o in outs.values())
    prompt_tok = sum(len(p) for p in prompts.values())
    reusable = reusable_tokens(run["order"], prompts, outs, page_size)
    t = run["engine_s"]
    u = run["units"]
    return {
        "trace": trace.name, "layout": layout, "requests": len(rec), "steps": run["steps"],
        "prompt_tokens": prompt_tok, "generated_tokens": gen, "engine_s": t,
        "gen_tok_s": gen / t if t else None, "total_tok_s": (gen + prompt_tok) / t if t else None,
        "ttft_ms": _percentiles(ttft), "tpot_ms": _percentiles(tpot),
        "peak_pool_bytes": run["peak"]["bytes"], "peak_full_pages": run["peak"]["full"],
        "peak_swa_pages": run["peak"]["swa"], "peak_slots": run["peak"]["slots"],
        "peak_mapped_bytes": run["peak"]["mapped_bytes"], "pool_alloc_bytes": u["allocated"],
        "bytes_per_full_page": u["full_page"], "bytes_per_swa_page": u["swa_page"], "bytes_per_slot": u["slot"],
        "n_pages": u["n_pages"], "n_swa_pages": u["n_swa_pages"],
        "reused_tokens": run["hit_tokens"], "queried_tokens": run["queried_tokens"],
        "reusable_tokens": sum(reusable.values()),
        "reused_of_reusable": (run["hit_tokens"] / sum(reusable.values())) if sum(reusable.values()) else None,
        "evicted_pages": run["evicted_pages"], "tombstoned_tails": run["tombstoned_tails"],
        "preempted": run["preempted"], "same_tokens": None,
        "per_request": [{"id": rid, "prompt_len": len(prompts[rid]), "generated": len(outs[rid]),
                         "hit_tokens": run["hit"].get(rid, 0), "reusable_tokens": reusable[rid],
                         "ttft_ms": ((rec[rid]["times"][0] - rec[rid]["arrival"]) * 1e3) if rec[rid]["times"] else None,
                         "finish": rec[rid].get("finish")} for rid in run["order"]],
    }


def build_core(llm, layout: str, **overrides):
    """An EngineCore of `layout` over the model that `llm` loaded (one model, several engines)."""
    from v4jax.engine import EngineCore
    kv, caching = LAYOUTS[layout]
    opts = dataclasses.replace(llm.options, kv_layout=kv, enable_prefix_caching=caching, **overrides)
    return EngineCore(llm.config, llm.model, opts, llm.run_options, llm.max_model_len)


def run_replay(llm, traces: Sequence[Trace], layouts: Sequence[str] = tuple(LAYOUTS), *, warmup: str = "replay",
               budget_ws: float | None = None, log: Callable = print, deadline: float | None = None,
               on_row: Callable | None = None) -> dict:
    """Replay every trace on every layout (in the order given); returns {"rows": [...], "traces": {...},
    "engines": {...}, "skipped": [...]}.
    budget_ws: give the paged layouts memory_budget_bytes = their fixed pools + budget_ws x the largest working
    set (Trace.working_set_pages) of the traces, in full pages; None: the engine's default sizing.
    deadline: a time.perf_counter() value after which no further (layout, trace) run starts (listed in
    "skipped"); on_row(report) is called after every row (to write partial results)."""
    opts = llm.options
    page = _page_size(llm)
    ws = {t.name: t.working_set_pages(page, opts.max_num_seqs) for t in traces}
    out = {"rows": [], "engines": {}, "traces": {
        t.name: {"params": _jsonable(t.params), "requests": len(t.requests), "max_context": t.max_context(),
                 "working_set_pages": ws[t.name]} for t in traces}, "skipped": []}
    outputs: dict = {}
    late = lambda: deadline is not None and time.perf_counter() > deadline
    for layout in layouts:
        if late():
            out["skipped"] += [f"{layout} / {t.name}" for t in traces]
            continue
        over = {}
        if budget_ws and LAYOUTS[layout][0] == "paged":
            pages = int(np.ceil(budget_ws * max(ws.values())))
            kv, caching = LAYOUTS[layout]
            o = dataclasses.replace(opts, kv_layout=kv, enable_prefix_caching=caching)
            over["memory_budget_bytes"] = budget_for_pages(llm.config, o, llm.max_model_len, llm.model.dtype, pages)
        t0 = time.perf_counter()
        core = build_core(llm, layout, **over)
        out["engines"][layout] = dict(unit_bytes(core), memory_budget_bytes=over.get("memory_budget_bytes"),
                                      build_s=time.perf_counter() - t0)
        compiled_before = core.compiled_variants()
        if warmup == "engine":
            t0 = time.perf_counter()
            n = core.warmup()
            out["engines"][layout].update(warmup_s=time.perf_counter() - t0, compiled_variants=n)
            log(f"{layout}: warm-up compiled {n} variants in {time.perf_counter() - t0:.1f} s")
        for tr in traces:
            if late():
                out["skipped"].append(f"{layout} / {tr.name}")
                continue
            if warmup == "replay":
                t0 = time.perf_counter()
                replay_trace(core, tr)
                log(f"{layout} / {tr.name}: warm-up replay {time.perf_counter() - t0:.1f} s")
            t0 = time.perf_counter()
            run = replay_trace(core, tr)
            row = summarize(tr, layout, run, page)
            row["wall_s"] = time.perf_counter() - t0
            outputs[(tr.name, layout)] = run["outputs"]
            out["rows"].append(row)
            log(f"{layout} / {tr.name}: {row['steps']} steps, {row['engine_s']:.2f} s, reused "
                f"{row['reused_tokens']} / reusable {row['reusable_tokens']}")
            _same_tokens(out, outputs)
            if on_row is not None:
                on_row(out)
        out["engines"][layout]["compiled_variants_after"] = core.compiled_variants() - compiled_before
        del core
        gc.collect()
    out["rows"].sort(key=lambda r: ([t.name for t in traces].index(r["trace"]), list(LAYOUTS).index(r["layout"])))
    _same_tokens(out, outputs)
    return out


def _same_tokens(out: dict, outputs: dict) -> None:
    for row in out["rows"]:
        ref = outputs.get((row["trace"], REFERENCE_LAYOUT))
        if ref is None:
            row["same_tokens"] = None
        elif row["layout"] == REFERENCE_LAYOUT:
            row["same_tokens"] = "ref"
        else:
            mine = outputs[(row["trace"], row["layout"])]
            diff = [rid for rid in ref if mine.get(rid) != ref[rid]]
            row["same_tokens"] = "yes" if not diff else f"no ({len(diff)}/{len(ref)} differ)"
            # where each differing request first departs from the reference (its generated-token index)
            row["first_token_diff"] = {rid: next((i for i, (x, y) in enumerate(zip(mine.get(rid, []), ref[rid]))
                                                  if x != y), min(len(mine.get(rid, [])), len(ref[rid])))
                                       for rid in diff}


def _page_size(llm) -> int:
    from v4jax.cache.layout import full_page_size
    return full_page_size(llm.config, llm.options.page_size)


def _jsonable(x):
    return json.loads(json.dumps(x, default=list))


# ---- report ----------------------------------------------------------------------------------------------------
COLUMNS = ("trace", "layout", "requests", "prompt tok", "gen tok", "peak pool MiB (full / SWA pages, slots)",
           "peak mapped MiB", "pool alloc MiB", "gen tok/s", "total tok/s", "TTFT p50 / p90 / p99 ms",
           "TPOT p50 / p90 / p99 ms", "reused / queried tok", "reusable tok", "reused of reusable",
           "preempted", "same tokens")


def _ms(d: dict) -> str:
    return " / ".join("-" if d[k] is None else f"{d[k]:.0f}" if d[k] >= 100 else f"{d[k]:.1f}"
                      for k in ("p50", "p90", "p99"))


def markdown(report: dict) -> str:
    mib = 1 << 20
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in report["rows"]:
        frac = "-" if r["reused_of_reusable"] is None else f"{100 * r['reused_of_reusable']:.0f} %"
        cells = [r["trace"], r["layout"], r["requests"], r["prompt_tokens"], r["generated_tokens"],
                 f"{r['peak_pool_bytes'] / mib:.2f} ({r['peak_full_pages']} / {r['peak_swa_pages']}, "
                 f"{r['peak_slots']})", f"{r['peak_mapped_bytes'] / mib:.2f}", f"{r['pool_alloc_bytes'] / mib:.1f}",
                 f"{r['gen_tok_s']:.1f}", f"{r['total_tok_s']:.0f}", _ms(r["ttft_ms"]), _ms(r["tpot_ms"]),
                 f"{r['reused_tokens']} / {r['queried_tokens']}", r["reusable_tokens"], frac, r["preempted"],
                 r["same_tokens"] or "-"]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


# ---- command line ----------------------------------------------------------------------------------------------
class _Formatter(argparse.ArgumentDefaultsHelpFormatter):
    """Adds "(default: X)" to help texts that do not already say what the default is."""

    def _get_help_string(self, action):
        h = action.help or ""
        if "default" in h or action.default in (None, [], argparse.SUPPRESS):
            return h
        return super()._get_help_string(action)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m v4jax.bench.replay", formatter_class=_Formatter,
        description="Replay synthetic request traces (shared system prompt, multi-turn chats, long documents, "
                    "agentic sessions) against the dense, paged and paged + prefix-cache engine layouts; report "
                    "peak pool memory, throughput, TTFT / TPOT percentiles and prefix-cache reuse (Markdown table "
                    "and JSON). Arrivals are closed-loop by engine step count (deterministic).")
    ap.add_argument("--model", default=None, help="preset name (tiny, flash-slice, ...) or checkpoint directory; "
                    "default: the embedded default model")
    ap.add_argument("--trace", default="all", help=f"comma list of {', '.join(TRACES)}, or all")
    ap.add_argument("--layouts", default=",".join(LAYOUTS), help="comma list of " + ", ".join(LAYOUTS))
    ap.add_argument("--scale", type=float, default=1.0, help="multiply every trace length (system prompt, "
                    "documents, messages, tool results) by this; lengths stay multiples of 32 tokens")
    ap.add_argument("--granule", type=int, default=GRANULE, help="every trace length is a multiple of this many "
                    "tokens (a multiple of the page size keeps every prefill chunk one shape: fewer compilations)")
    ap.add_argument("--max-tokens", type=int, default=None, help="tokens generated per request (default: each "
                    "trace's own, 32)")
    ap.add_argument("--trace-opt", action="append", default=[], metavar="TRACE.KEY=VALUE",
                    help="override a trace parameter, e.g. multi_turn.turns=8 or shared_system.users=16 (repeatable)")
    ap.add_argument("--seed", type=int, default=0, help="trace seed (weights of a preset: seed 0)")
    ap.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                    help="auto: float32 on CPU, bfloat16 on an accelerator")
    ap.add_argument("--max-num-seqs", type=int, default=8, help="decode slots")
    ap.add_argument("--max-model-len", type=int, default=None, help="context limit; default: the longest trace "
                    "context rounded up to a full page")
    ap.add_argument("--prefill-chunk", type=int, default=None, help="largest prefill chunk (default: the engine's, "
                    "2048)")
    ap.add_argument("--page-size", type=int, default=None, help="tokens per full page (default: the engine's, 256 "
                    "rounded up to the lcm of the compression ratios)")
    ap.add_argument("--decode-steps", type=int, default=8, help="tokens per jitted decode call (k)")
    ap.add_argument("--budget-ws", type=float, default=None, help="paged layouts: memory_budget_bytes = fixed "
                    "pools + this many times the largest trace working set in full pages (default: the engine's "
                    "own sizing, max_num_seqs x max_model_len)")
    ap.add_argument("--warmup", default="replay", choices=("replay", "engine", "none"),
                    help="replay: each trace once unmeasured first (compiles what it uses); engine: "
                    "EngineCore.warmup() (every bucket); none: compile times fall into the measurements")
    ap.add_argument("--attention-impl", default="xla", choices=("xla", "pallas"), help="attention kernels")
    ap.add_argument("--deadline-s", type=float, default=None, help="start no (layout, trace) run after this many "
                    "seconds (what ran is reported; the rest is listed as skipped)")
    ap.add_argument("--out", default=None, help="folder for replay.json and replay.md (default: $OUT, else "
                    "./bench_out)")
    return ap


def _parse_value(v: str):
    try:
        return json.loads(v.replace("(", "[").replace(")", "]"))
    except json.JSONDecodeError:
        return v


def make_traces(names: Sequence[str], vocab: int, seed: int = 0, scale: float = 1.0, max_tokens: int | None = None,
                opts: Sequence[str] = (), granule: int = GRANULE) -> list[Trace]:
    over: dict = {n: {} for n in names}
    for o in opts:
        key, _, val = o.partition("=")
        tname, _, k = key.partition(".")
        if tname not in TRACES or not k or not _:
            raise SystemExit(f"--trace-opt {o!r}: expected TRACE.KEY=VALUE with TRACE in {list(TRACES)}")
        if tname in over:
            v = _parse_value(val)
            over[tname][k] = tuple(v) if isinstance(v, list) else v
    out = []
    for n in names:
        kw = dict(over[n])
        kw.setdefault("granule", granule)
        if max_tokens is not None:
            kw.setdefault("max_tokens", max_tokens)
        out.append(TRACES[n](vocab, seed, scale, **kw))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    t_start = time.perf_counter()
    import warnings

    import jax

    from v4jax.api import LLM
    from v4jax.config import PRESETS, ModelConfig, preset
    from v4jax.cache.layout import full_page_size

    names = list(TRACES) if a.trace == "all" else [n.strip() for n in a.trace.split(",") if n.strip()]
    bad = [n for n in names if n not in TRACES]
    layouts = [n.strip() for n in a.layouts.split(",") if n.strip()]
    bad += [n for n in layouts if n not in LAYOUTS]
    if bad:
        print(f"unknown trace or layout {bad}; traces: {list(TRACES)}, layouts: {list(LAYOUTS)}", file=sys.stderr)
        return 2
    on_cpu = jax.default_backend() == "cpu"
    dtype = a.dtype if a.dtype != "auto" else ("float32" if on_cpu else "bfloat16")
    if a.model is None or a.model in PRESETS:
        from v4jax.api import DEFAULT_MODEL_DIR
        cfg = preset(a.model) if a.model else ModelConfig.from_hf(DEFAULT_MODEL_DIR)
    else:
        cfg = ModelConfig.from_hf(a.model)
    traces = make_traces(names, cfg.vocab_size, a.seed, a.scale, a.max_tokens, a.trace_opt, a.granule)
    page = full_page_size(cfg, a.page_size)
    max_len = a.max_model_len or -(-max(t.max_context() for t in traces) // page) * page
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "random weights" for a preset: said in the report instead
        chunk = {} if a.prefill_chunk is None else {"prefill_chunk": a.prefill_chunk}
        llm = LLM(a.model, dtype=dtype, max_num_seqs=a.max_num_seqs, max_model_len=max_len, page_size=a.page_size,
                  decode_steps=a.decode_steps, attention_impl=a.attention_impl, **chunk)
    dev = jax.devices()[0]
    log = lambda msg: print(f"[{time.perf_counter() - t_start:7.1f}s] {msg}", flush=True)
    log(f"{dev.platform} ({getattr(dev, 'device_kind', '')}), jax {jax.__version__}; model {llm.source}, {dtype}, "
        f"page {page} tokens, max_model_len {llm.max_model_len}, {a.max_num_seqs} slots")
    out_dir = a.out or os.environ.get("OUT") or "bench_out"
    os.makedirs(out_dir, exist_ok=True)
    meta = {
        "command": "python -m v4jax.bench.replay " + " ".join(argv if argv is not None else sys.argv[1:]),
        "device": f"{dev.platform}: {getattr(dev, 'device_kind', '')}", "jax": jax.__version__,
        "python": platform.python_version(), "model": llm.source, "dtype": dtype, "page_size": page,
        "max_model_len": llm.max_model_len, "max_num_seqs": a.max_num_seqs, "prefill_chunk": llm.options.prefill_chunk,
        "decode_steps": a.decode_steps, "warmup": a.warmup, "budget_ws": a.budget_ws, "seed": a.seed,
        "scale": a.scale, "granule": a.granule, "arrivals": "closed loop by engine step count",
        "decoding": "greedy, ignore_eos"}

    def write(rep):
        rep["meta"] = dict(meta, total_s=time.perf_counter() - t_start)
        with open(os.path.join(out_dir, "replay.json"), "w") as f:
            json.dump(rep, f, indent=1, default=str)
        with open(os.path.join(out_dir, "replay.md"), "w") as f:
            f.write(markdown(rep) + "\n")

    deadline = t_start + a.deadline_s if a.deadline_s else None
    rep = run_replay(llm, traces, layouts, warmup=a.warmup, budget_ws=a.budget_ws, log=log, deadline=deadline,
                     on_row=write)
    write(rep)
    print(markdown(rep), flush=True)
    if rep["skipped"]:
        log(f"skipped (deadline): {', '.join(rep['skipped'])}")
    log(f"wrote {out_dir}/replay.json and replay.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
