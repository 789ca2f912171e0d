"""Prefill/decode transfer benchmark: what one request's state weighs by pool, and what moving it costs.

    v4jax bench pd [--model MODEL] [--prompt-len N ...] [--path jax|http] [--repeats R]

Two engines of the same model in one process: each prompt (random token ids, fresh per repeat so the prefix
cache never hits) is prefilled on one as a prefill-only request, its state exported, moved through the transport
(`jax`: offered on a jax.experimental.transfer server and pulled over its socket; `http`: packed, checksummed and
unpacked, no socket) and imported into the other, which then decodes its first call. Per prompt length: bytes by
pool, and the median of `--repeats` for export (gather + device_get), transfer (offer + pull + checksum) and the
receiver's first step (the bind: slot, pages, scatter of the state; and its first decode call)."""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Sequence


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
            moved = receiver.pull(sender.offer(state), sender.take_bytes)
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
    return 0
