"""Prefill/decode transfer benchmark: what one request's state weighs by pool, and what moving it costs.

    v4jax bench pd [--model MODEL] [--prompt-len N ...] [--path jax http] [--repeats R] [--out DIR]

Two engines of the same model in one process: each prompt (random token ids, fresh per repeat so the prefix
cache never hits) is prefilled on one as a prefill-only request, its state exported, moved through each transport
of `--path` (`jax`: offered on a jax.experimental.transfer server and pulled over its socket; `http`: packed,
checksummed, served by a local HTTP server and fetched as a decode server fetches it, then unpacked) and imported
into the other, which then decodes its first call. Per prompt length: bytes by pool and the median of `--repeats`
for export (gather + device_get); per transport and length: transfer (offer + pull + checksum), its GB/s (bytes /
transfer seconds) and the receiver's first step (the bind: slot, pages, scatter of the state; and its first decode
call). A transport that fails (jax.experimental.transfer on a backend without it, a pull that never arrives) has
its error in its rows and the others are still timed. Then, per prompt length and pool, the bytes moved against the
analytic size of what the request holds in that pool (`analytic_bytes`: the layout's bytes per token row, entry or
slot, from `v4jax.cache.layout.pool_sizes`, times the rows the next query reads, the entries completed, one slot)."""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import threading
import time
from typing import Sequence


def analytic_bytes(engine, fed: int) -> dict[str, int]:
    """Bytes of each pool that a request at position `fed` must carry, from the layout's pool sizes (not from the
    transfer's own shapes): the window's last min(fed, W - 1) token rows of every layer (swa, mtp_swa), the
    fed // ratio completed entries of every compressed layer (c4_kv, c4_index: CSA; c128_kv: HCA), one slot of the
    compressor and drafter states."""
    from v4jax.cache.layout import pool_sizes
    from v4jax.config import CSA, SLIDING, layer_stacks
    cfg, lay = engine.cfg, engine.layout
    sizes = pool_sizes(cfg, lay, engine.kv_dtype, caching=False)  # without the prefix cache's rows in SWA pages
    ratio = {}
    for st in layer_stacks(cfg).stacks:
        if st.kind == CSA:
            ratio["c4_kv"] = ratio["c4_index"] = st.ratio
        elif st.kind != SLIDING:
            ratio["c128_kv"] = st.ratio
    rows = min(fed, cfg.window_size - 1)
    out = {}
    for name, size in sizes.items():
        if name in ("swa", "mtp_swa"):
            out[name] = rows * size.unit_bytes // lay.swa_page_size
        elif name in ratio:
            out[name] = fed // ratio[name] * size.unit_bytes // (lay.page_size // ratio[name])
        elif name in ("compressor_state", "draft_state"):
            out[name] = size.unit_bytes
    return out


@contextlib.contextmanager
def _http_server(take_bytes):
    """A local HTTP server handing out each offer's bytes once at /state/{uuid} (what a decode server GETs from a
    prefill server on the http path); yields its base URL. The standard library's server: the bench needs none of
    the server's packages."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as between servers: a fetch is not a new connection
        def do_GET(self):
            data = take_bytes(int(self.path.rsplit("/", 1)[-1])) if self.path.startswith("/state/") else None
            if data is None:
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/state"
    finally:
        server.shutdown()
        server.server_close()


class _Path:
    """One transport, both ends: `move(state)` is what the state's trip costs a decode server (offer, pull, checks)."""

    def __init__(self, name: str, stack: contextlib.ExitStack, timeout_s: float):
        from v4jax.serve.pd import StateTransport
        self.name, self.error = name, None
        try:
            self.sender = StateTransport(path=name, timeout_s=timeout_s)
            self.receiver = StateTransport(path=name, timeout_s=timeout_s)
        except Exception as e:  # jax.experimental.transfer missing on this backend: said in every row
            self.error = f"{type(e).__name__}: {e}"
            return
        if name == "http":
            import httpx
            client = stack.enter_context(httpx.Client(timeout=timeout_s))
            url = stack.enter_context(_http_server(self.sender.take_bytes))

            def fetch(uid):
                r = client.get(f"{url}/{uid}")
                r.raise_for_status()
                return r.content
            self.fetch = fetch
        else:
            self.fetch = None

    def move(self, state):
        control = self.sender.offer(state)
        moved = self.receiver.pull(control, self.fetch)
        if self.name == "jax":
            self.sender.taken(control["uuid"])  # what a decode server says after its pull (the http GET took it)
        return moved


def _ms(xs):
    return statistics.median(xs) * 1e3 if xs else None


def measure(src, dst, prompt_lens: Sequence[int], paths: Sequence[str] = ("jax",), repeats: int = 5,
            timeout_s: float = 60.0, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """Prefill each length on `src` (prefill-only, fresh random prompts), export, move through each transport and
    import into `dst` (then decode its first call), `repeats` times after one unmeasured run. Returns (sizes: per
    length, bytes by pool and the median export ms; rows: per transport and length, the median transfer ms, GB/s,
    the receiver's first step ms and the transport's error, if any)."""
    import numpy as np

    from v4jax.engine.sampling import SamplingParams

    sp = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    rng = np.random.default_rng(seed)
    sizes, rows = [], []
    with contextlib.ExitStack() as stack:
        movers = [_Path(p, stack, timeout_s) for p in paths]
        for n in prompt_lens:
            export = []
            times = {p.name: {"transfer": [], "import": []} for p in movers}
            errors = {p.name: p.error for p in movers}
            state = None
            for rep in range(repeats + 1):
                rid = f"r{n}-{rep}-{rng.integers(1 << 30)}"
                src.add_request(rid, rng.integers(2, src.cfg.vocab_size, n).tolist(), sp, prefill_only=True)
                while not src.scheduler.prefilled():
                    src.step()
                t0 = time.perf_counter()
                state = src.export_request(rid)
                if rep:
                    export.append(time.perf_counter() - t0)
                for p in movers:
                    if errors[p.name]:
                        continue
                    t1 = time.perf_counter()
                    try:
                        moved = p.move(state)
                    except Exception as e:  # the row says why; the other transports go on
                        errors[p.name] = f"{type(e).__name__}: {e}"
                        continue
                    t2 = time.perf_counter()
                    dst.import_request(moved, request_id=f"{rid}-{p.name}")
                    dst.step()
                    t3 = time.perf_counter()
                    while dst.has_unfinished_requests():
                        dst.step()
                    if rep:
                        times[p.name]["transfer"].append(t2 - t1)
                        times[p.name]["import"].append(t3 - t2)
            sizes.append({"prompt": n, "bytes": state.nbytes(), "bytes_by_pool": state.bytes_by_pool(),
                          "export_ms": _ms(export)})
            for p in movers:
                tr = times[p.name]["transfer"]
                rows.append({"path": p.name, "prompt": n, "bytes": state.nbytes(), "transfer_ms": _ms(tr),
                             "gb_per_s": state.nbytes() / statistics.median(tr) / 1e9 if tr else None,
                             "import_ms": _ms(times[p.name]["import"]), "repeats": len(tr), "error": errors[p.name]})
    return sizes, rows


def markdown(sizes: list[dict], rows: list[dict]) -> str:
    num = lambda x, f="{:.2f}": "-" if x is None else f.format(x)
    out = ["| prompt | bytes total | by pool | export ms |", "|---:|---:|---|---:|"]
    for s in sizes:
        by_pool = ", ".join(f"{k} {v:,}" for k, v in sorted(s["bytes_by_pool"].items()))
        out.append(f"| {s['prompt']} | {s['bytes']:,} | {by_pool} | {num(s['export_ms'])} |")
    out += ["", "Transfer (offer + pull + checksum) by transport; GB/s = bytes / transfer seconds",
            "| transport | prompt | bytes | transfer ms | GB/s | receiver's first step ms | error |",
            "|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        out.append(f"| {r['path']} | {r['prompt']} | {r['bytes']:,} | {num(r['transfer_ms'])} | "
                   f"{num(r['gb_per_s'], '{:.3f}')} | {num(r['import_ms'])} | "
                   f"{(r['error'] or '').replace('|', '/')[:200]} |")
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="v4jax bench pd", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint directory or preset (default: the embedded model)")
    ap.add_argument("--prompt-len", type=int, nargs="+", default=[64, 200])
    ap.add_argument("--path", choices=["jax", "http"], nargs="+", default=["jax"], help="transports to time")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--prefill-chunk", type=int, default=256)
    ap.add_argument("--max-model-len", type=int, default=None, help="default: the longest prompt + 16")
    ap.add_argument("--max-num-seqs", type=int, default=1, help="slots of each engine (one request moves at a time)")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds a transfer may take before it is an error")
    ap.add_argument("--out", default=None, help="directory for pd_bench.json")
    a = ap.parse_args(argv)

    from v4jax.api import LLM

    # few slots: two engines of a long context share one device (as a prefill and a decode server can)
    opts = dict(dtype=a.dtype, max_num_seqs=a.max_num_seqs, max_model_len=a.max_model_len or max(a.prompt_len) + 16,
                prefill_chunk=a.prefill_chunk)
    src, dst = LLM(a.model, **opts).engine, LLM(a.model, **opts).engine
    print(f"model {a.model or 'default'} ({a.dtype}), transports {' '.join(a.path)}, median of {a.repeats} "
          "(after one unmeasured run per length)\n")
    sizes, rows = measure(src, dst, a.prompt_len, a.path, a.repeats, a.timeout)
    print(markdown(sizes, rows))
    print("\nBytes moved per request against the analytic size of each pool (the layout's bytes per row, entry or "
          "slot)")
    print("| prompt | pool | moved | analytic | moved / analytic |")
    print("|---:|---|---:|---:|---:|")
    exact = True
    for s in sizes:
        n, moved, want = s["prompt"], s["bytes_by_pool"], analytic_bytes(src, s["prompt"])
        for pool in sorted(set(moved) | set(want)):
            m, w = moved.get(pool, 0), want.get(pool, 0)
            exact &= m == w
            print(f"| {n} | {pool} | {m:,} | {w:,} | {m / w if w else float('nan'):.3f} |")
        print(f"| {n} | total | {sum(moved.values()):,} | {sum(want.values()):,} | "
              f"{sum(moved.values()) / sum(want.values()):.3f} |")
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "pd_bench.json"), "w") as f:
            json.dump({"model": a.model or "default", "dtype": a.dtype, "repeats": a.repeats, "engine": opts,
                       "sizes": sizes, "rows": rows, "exact": exact}, f, indent=1)
    timed = any(r["gb_per_s"] is not None for r in rows)
    return 0 if exact and timed else 1
