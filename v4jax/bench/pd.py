"""Prefill/decode transfer benchmark: what one request's state weighs by pool, and what moving it costs.

    v4jax bench pd [--model MODEL] [--prompt-len N ...] [--path jax|http] [--repeats R]

Two engines of the same model in one process: each prompt (random token ids, fresh per repeat so the prefix
cache never hits) is prefilled on one as a prefill-only request, its state exported, moved through the transport
(`jax`: offered on a jax.experimental.transfer server and pulled over its socket; `http`: packed, checksummed and
unpacked, no socket) and imported into the other, which then decodes its first call. Per prompt length: bytes by
pool, and the median of `--repeats` for export (gather + device_get), transfer (offer + pull + checksum) and the
receiver's first step (the bind: slot, pages, scatter of the state; and its first decode call). Then, per prompt
length and pool, the bytes moved against the analytic size of what the request holds in that pool (`analytic_bytes`:
the layout's bytes per token row, entry or slot, from `v4jax.cache.layout.pool_sizes`, times the rows the next
query reads, the entries completed, one slot)."""
from __future__ import annotations

import argparse
import statistics
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


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="v4jax bench pd", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint directory or preset (default: the embedded model)")
    ap.add_argument("--prompt-len", type=int, nargs="+", default=[64, 200])
    ap.add_argument("--path", choices=["jax", "http"], default="jax")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    a = ap.parse_args(argv)

    import numpy as np

    from v4jax.api import LLM
    from v4jax.engine.sampling import SamplingParams
    from v4jax.serve.pd import StateTransport

    opts = dict(dtype=a.dtype, max_num_seqs=1, max_model_len=max(a.prompt_len) + 16, prefill_chunk=256)
    src, dst = LLM(a.model, **opts).engine, LLM(a.model, **opts).engine
    sender, receiver = StateTransport(path=a.path), StateTransport(path=a.path)
    sp = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    rng = np.random.default_rng(0)
    print(f"model {a.model or 'default'} ({a.dtype}), transport {a.path}, median of {a.repeats} "
          "(after one unmeasured run per length)")
    print("| prompt | bytes total | by pool | export ms | transfer ms | receiver's first step ms |")
    print("|---:|---:|---|---:|---:|---:|")
    against = []
    for n in a.prompt_len:
        times = {"export": [], "transfer": [], "import": []}
        for rep in range(a.repeats + 1):
            rid = f"r{n}-{rep}"
            src.add_request(rid, rng.integers(2, src.cfg.vocab_size, n).tolist(), sp, prefill_only=True)
            while not src.scheduler.prefilled():
                src.step()
            t0 = time.perf_counter()
            state = src.export_request(rid)
            t1 = time.perf_counter()
            control = sender.offer(state)
            moved = receiver.pull(control, sender.take_bytes)
            sender.taken(control["uuid"])  # what a decode server says after its pull (the http path's take did)
            t2 = time.perf_counter()
            dst.import_request(moved)
            dst.step()
            t3 = time.perf_counter()
            while dst.has_unfinished_requests():
                dst.step()
            if rep:
                times["export"].append(t1 - t0)
                times["transfer"].append(t2 - t1)
                times["import"].append(t3 - t2)
        by_pool = ", ".join(f"{k} {v:,}" for k, v in sorted(state.bytes_by_pool().items()))
        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        print(f"| {n} | {state.nbytes():,} | {by_pool} | {med['export']:.2f} | {med['transfer']:.2f} | "
              f"{med['import']:.2f} |")
        against.append((n, state.bytes_by_pool(), analytic_bytes(src, n)))
    print("\nBytes moved per request against the analytic size of each pool (the layout's bytes per row, entry or "
          "slot)")
    print("| prompt | pool | moved | analytic | moved / analytic |")
    print("|---:|---|---:|---:|---:|")
    exact = True
    for n, moved, want in against:
        for pool in sorted(set(moved) | set(want)):
            m, w = moved.get(pool, 0), want.get(pool, 0)
            exact &= m == w
            print(f"| {n} | {pool} | {m:,} | {w:,} | {m / w if w else float('nan'):.3f} |")
        print(f"| {n} | total | {sum(moved.values()):,} | {sum(want.values()):,} | "
              f"{sum(moved.values()) / sum(want.values()):.3f} |")
    return 0 if exact else 1
