"""What the sampler costs a decode step: `sample` over a Flash-sized vocabulary, jitted as the engine runs it,
greedy; sampled at temperature 1 with no filter (vLLM's and OpenAI's default) in the form without the top-k / top-p
sort ("plain") and in the form with it ("sorted"); and with top-p 0.9; per batch, with kernel time from a
profiler trace on a GPU; "top20": greedy with the 20 most likely alternatives (top_logprobs=20). Prints one line
a case and writes JSON lines to --out.

  python scripts/sampling_probe.py --batches 1,8,32,64 --vocab 129280 --out sampling.jsonl
  python scripts/sampling_probe.py --forms top_p --batches 1,8,16 --search-from 1   # the search at every batch
"""
from __future__ import annotations

import argparse
import functools
import json

import jax
import jax.numpy as jnp

from v4jax.bench.profile import said, time_call
from v4jax.engine import sampling


def case(b: int, v: int, form: str):
    ks = jax.random.split(jax.random.key(0), 2)
    logits = 4.0 * jax.random.normal(ks[0], (b, v), jnp.float32)
    temperature = jnp.full((b,), 0.0 if form in ("greedy", "top20") else 1.0, jnp.float32)
    top_p = jnp.full((b,), 0.9 if form == "top_p" else 1.0, jnp.float32)
    zeros_i, zeros_f = jnp.zeros((b,), jnp.int32), jnp.zeros((b,), jnp.float32)
    greedy = form in ("greedy", "top20")
    fn = jax.jit(functools.partial(sampling.sample, any_sampled=not greedy, any_cut=form != "plain",
                                   n_top=20 if form == "top20" else 0))
    args = (logits, logits, temperature, top_p, zeros_i, zeros_f, zeros_i, jnp.arange(b, dtype=jnp.int32), zeros_i)
    return lambda: fn(*args)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--vocab", type=int, default=129280)
    ap.add_argument("--forms", default="greedy,plain,sorted,top_p,top20")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=None)
    ap.add_argument("--search-from", type=int, default=None,
                    help="rows from which a top-k / top-p cut searches its thresholds instead of sorting (default: "
                         "sampling.SEARCH_FROM_ROWS; 1: always the search, a large number: always the sort)")
    a = ap.parse_args(argv)
    if a.search_from is not None:
        sampling.SEARCH_FROM_ROWS = a.search_from  # read when `kept` is traced
    for b in (int(x) for x in a.batches.split(",")):
        for form in a.forms.split(","):
            m = time_call(case(b, a.vocab, form), a.reps)
            print(said(f"batch {b:3d} {form:8s}", m), "|", m.get("top"), flush=True)
            if a.out:
                with open(a.out, "a") as f:
                    f.write(json.dumps({"batch": b, "vocab": a.vocab, "form": form,
                                        "search_from": sampling.SEARCH_FROM_ROWS, **m}) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
