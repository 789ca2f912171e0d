"""Prometheus metrics of one server, in a registry of its own (several servers can share a process).

Latencies are histograms in seconds, tokens are counters; the engine's pools, prefix cache and queues are read
at scrape time from the orchestrator's latest engine stats (never from the engine itself: only its thread may
touch it)."""
from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0, 160.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
                 0.5, 0.75, 1.0, 2.5)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
                960.0, 1920.0)



# EngineCore.stats()["steps"]: key, metric, help
_ENGINE_STEPS = (
    ("steps", "v4jax_engine_steps", "Engine steps (each a decode call and a prefill step at most)"),
    ("seconds", "v4jax_engine_step_seconds", "Wall seconds of those steps"),
    ("device_wait_seconds", "v4jax_engine_device_wait_seconds",
     "Of those, seconds waiting on the device for a call's outputs (the rest is the host's)"),
    ("prefill_steps", "v4jax_engine_prefill_steps", "Prefill steps dispatched"),
    ("prefill_rows", "v4jax_engine_prefill_rows", "Prompt chunks those prefill steps ran (a row each)"),
    ("decode_calls", "v4jax_engine_decode_calls", "Decode calls dispatched"),
    ("decode_rows", "v4jax_engine_decode_rows", "Running requests those decode calls advanced (summed over the calls)"),
)

class _EngineCollector:
    """Pools, prefix cache and request counts from the engine's stats() snapshot."""

    def __init__(self, stats: Callable[[], dict]):
        self.stats = stats

    def collect(self):
        s = self.stats()
        used = GaugeMetricFamily("v4jax_pool_used_pages", "Pages in use per pool (compressor_state: slots); "
                                 "pages only the prefix cache holds count as used", labels=["pool"])
        total = GaugeMetricFamily("v4jax_pool_total_pages", "Pages per pool (compressor_state: slots)",
                                  labels=["pool"])
        bytes_used = GaugeMetricFamily("v4jax_pool_bytes_used", "Bytes of the pages (compressor_state: slots) in "
                                       "use per pool, over the whole mesh", labels=["pool"])
        bytes_total = GaugeMetricFamily("v4jax_pool_bytes_total", "Bytes allocated per pool, over the whole mesh",
                                        labels=["pool"])
        for name, p in s.get("pools", {}).items():
            used.add_metric([name], p["used"])
            total.add_metric([name], p["total"])
            bytes_used.add_metric([name], p.get("bytes_used", 0))
            bytes_total.add_metric([name], p.get("bytes_total", 0))
        yield used
        yield total
        yield bytes_used
        yield bytes_total
        # host offload (enable_hisparse): where a pool's bytes are, and the C4 KV's hot buffer
        device_total = GaugeMetricFamily("v4jax_pool_device_bytes_total", "Bytes of an offloaded pool in device "
                                         "memory (its hot buffer and table)", labels=["pool"])
        host_total = GaugeMetricFamily("v4jax_pool_host_bytes_total", "Bytes of an offloaded pool in host memory",
                                       labels=["pool"])
        offloaded = {name: p for name, p in s.get("pools", {}).items() if "host_bytes_total" in p}
        for name, p in offloaded.items():
            device_total.add_metric([name], p["device_bytes_total"])
            host_total.add_metric([name], p["host_bytes_total"])
        if offloaded:
            yield device_total
            yield host_total
        c4 = offloaded.get("c4_kv")
        if c4 is not None:
            yield CounterMetricFamily("v4jax_hisparse_selected_entries", "C4 entries the indexer's top-k selected "
                                      "(per query token, layer and pick)", value=c4["selected"])
            yield CounterMetricFamily("v4jax_hisparse_hit_entries", "Selected C4 entries found in the device "
                                      "buffer", value=c4["hits"])
            yield CounterMetricFamily("v4jax_hisparse_fetched_bytes", "Bytes of distinct C4 entries fetched from "
                                      "host memory", value=c4["fetched_bytes"])
            yield CounterMetricFamily("v4jax_hisparse_transferred_bytes", "Bytes moved from host memory for C4 "
                                      "fetches (fixed transfer sizes)", value=c4["transferred_bytes"])
        pc = s.get("prefix_cache", {})
        yield CounterMetricFamily("v4jax_prefix_cache_queried_tokens", "Prompt tokens looked up in the prefix cache",
                                  value=pc.get("queried_tokens", 0))
        yield CounterMetricFamily("v4jax_prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache "
                                  "(whole full pages)", value=pc.get("hit_tokens", 0))
        yield GaugeMetricFamily("v4jax_prefix_cache_cached_pages", "Full pages held by the prefix tree",
                                value=pc.get("cached_pages", 0))
        yield CounterMetricFamily("v4jax_prefix_cache_reused_pages", "Full pages mapped from the prefix cache into "
                                  "a request instead of being computed", value=pc.get("reused_pages", 0))
        yield CounterMetricFamily("v4jax_prefix_cache_tombstoned_tails", "Window tails the prefix cache dropped "
                                  "under pressure (their compressed pages stay cached)",
                                  value=pc.get("tombstoned_tails", 0))
        rq = s.get("requests", {})
        yield GaugeMetricFamily("v4jax_num_requests_running", "Sequences in a decode slot (prefilling included)",
                                value=rq.get("running", 0) + rq.get("prefilling", 0))
        yield GaugeMetricFamily("v4jax_num_requests_waiting", "Sequences waiting for a slot",
                                value=rq.get("waiting", 0))
        yield CounterMetricFamily("v4jax_num_preemptions", "Sequences preempted (recomputed later) since start",
                                  value=rq.get("preempted", 0))
        yield CounterMetricFamily("v4jax_recomputed_tokens", "Prompt and generated tokens computed again: after a "
                                  "preemption, or past cached pages that could not be resumed from (a dropped "
                                  "window tail)", value=rq.get("recomputed_tokens", 0))
        pg = s.get("programs", {})
        yield CounterMetricFamily("v4jax_programs_compiled", "Prefill and decode programs compiled (or loaded from "
                                  "the persistent compilation cache) since start; one more while serving is a stall, "
                                  "unless compiled in the background", value=pg.get("compiled", 0))
        yield CounterMetricFamily("v4jax_program_compile_seconds", "Seconds those compiles took (summed over the "
                                  "threads that ran them)", value=pg.get("compile_seconds", 0.0))
        yield CounterMetricFamily("v4jax_programs_compiled_background", "Of those, compiled in the background while "
                                  "covering programs ran the steps that needed them", value=pg.get("background", 0))
        yield CounterMetricFamily("v4jax_steps_substituted", "Steps that ran on a covering program while their own "
                                  "compiled in the background", value=pg.get("substituted_steps", 0))
        yield GaugeMetricFamily("v4jax_programs_compiling", "Programs compiling in the background now",
                                value=pg.get("compiling", 0))
        st = s.get("steps", {})
        for key, name, doc in _ENGINE_STEPS:
            yield CounterMetricFamily(name, doc, value=st.get(key, 0))
        sd = s.get("spec_decode", {})
        yield CounterMetricFamily("v4jax_spec_decode_num_drafts", "Speculative steps of the decode slots (each "
                                  "drafts num_speculative_tokens tokens)", value=sd.get("num_drafts", 0))
        yield CounterMetricFamily("v4jax_spec_decode_num_draft_tokens", "Draft tokens proposed",
                                  value=sd.get("num_draft_tokens", 0))
        yield CounterMetricFamily("v4jax_spec_decode_num_accepted_tokens", "Draft tokens accepted",
                                  value=sd.get("num_accepted_tokens", 0))
        by_pos = CounterMetricFamily("v4jax_spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted, by "
                                     "their position in the draft (0: the first)", labels=["position"])
        for i, n in enumerate(sd.get("accepted_by_position", [])):
            by_pos.add_metric([str(i)], n)
        yield by_pos
        srv = s.get("server", {})
        yield GaugeMetricFamily("v4jax_num_requests_in_flight", "Sequences admitted and not yet released by the "
                                "engine", value=srv.get("in_flight", 0))


class ServerMetrics:
    def __init__(self, stats: Callable[[], dict]):
        r = self.registry = CollectorRegistry()
        self.ttft = Histogram("v4jax_time_to_first_token_seconds", "Time from arrival to the first generated token",
                              buckets=_TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("v4jax_time_per_output_token_seconds", "Per sequence: (last - first token time) / "
                              "(tokens - 1)", buckets=_TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("v4jax_e2e_request_latency_seconds", "Time from arrival to a sequence's end",
                             buckets=_E2E_BUCKETS, registry=r)
        self.prompt_tokens = Counter("v4jax_prompt_tokens", "Prompt tokens admitted (once per sequence)",
                                     registry=r)
        self.generation_tokens = Counter("v4jax_generation_tokens", "Tokens generated and sent", registry=r)
        self.finished = Counter("v4jax_request_finished", "Sequences released by the engine, by how they ended "
                                "(abort: the client left, timed out, or the server shut down)",
                                ["finish_reason"], registry=r)
        self.rejected = Counter("v4jax_request_rejected", "Requests refused before they reached the engine",
                                ["reason"], registry=r)
        r.register(_EngineCollector(stats))

    def render(self) -> bytes:
        return generate_latest(self.registry)
