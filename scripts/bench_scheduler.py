#!/usr/bin/env python
"""The scheduler with and without pipelining: generate() (decode call n+1 dispatched before call n is read) vs
EngineCore steps that read each decode call right after dispatching it (tests/test_engine.py::_synchronous_generate),
same requests.

  python scripts/bench_scheduler.py [--model tiny] [--batches 1,4] [--tokens 300]
"""
import argparse
import os
import sys
import time

import numpy as np

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

from test_engine import _synchronous_generate  # noqa: E402
from v4jax import LLM, SamplingParams  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--tokens", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args(argv)
    for b in map(int, a.batches.split(",")):
        llm = LLM(a.model, dtype=a.dtype, max_num_seqs=b, max_model_len=a.tokens + 64, prefill_chunk=64)
        prompts = [[5, 6, 7, 8]] * b
        sp = [SamplingParams(max_tokens=a.tokens, temperature=0.0, ignore_eos=True)] * b
        llm.generate(prompts, sp)
        _synchronous_generate(llm, prompts, sp)          # both warm
        ts, tp = [], []
        for _ in range(a.repeats):
            t0 = time.perf_counter()
            _synchronous_generate(llm, prompts, sp)
            ts.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            llm.generate(prompts, sp)
            tp.append(time.perf_counter() - t0)
        s, p = np.median(ts) / a.tokens * 1e3, np.median(tp) / a.tokens * 1e3
        print(f"batch {b}, {a.tokens} tokens per request: waited-for steps {s:.3f} ms/token-step, "
              f"pipelined {p:.3f} ms/token-step ({s / p:.2f}x)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
