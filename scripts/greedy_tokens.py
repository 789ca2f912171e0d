"""Greedy tokens and log-probs of a fixed set of requests, written to a file and compared with another run's: the
check that a compiler setting (XLA_FLAGS, set per process) leaves what the engine computes as it was.

  XLA_FLAGS=... python scripts/greedy_tokens.py [--model flash-slice] [--new 32] --out RUN.json [--against BASE.json]

Prints how many requests' tokens equal the baseline's and the largest log-prob difference; exits 1 where a token
differs. The prefix cache is off, so every run computes every prompt from its first token.
"""
import argparse
import json
import os
import sys

import numpy as np

LENGTHS = (17, 300, 600, 64, 5, 450)  # prompts inside and across the window, the compressors' ratios and pages


def run(model: str, new: int, dtype: str) -> dict:
    from v4jax import LLM, SamplingParams
    llm = LLM(model, max_num_seqs=8, max_model_len=2048, dtype=dtype, enable_prefix_caching=False)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(2, llm.config.vocab_size, n).tolist() for n in LENGTHS]
    sp = SamplingParams(max_tokens=new, temperature=0.0, logprobs=True, ignore_eos=True)
    outs = llm.generate(prompts, sp)
    return dict(model=model, xla_flags=os.environ.get("XLA_FLAGS", ""), tokens=[o.token_ids for o in outs],
                logprobs=[[float(x) for x in o.logprobs] for o in outs])


def compare(a: dict, b: dict) -> tuple[int, float]:
    """(requests whose tokens are equal, the largest |log-prob difference| over the tokens both runs chose)."""
    same = sum(x == y for x, y in zip(a["tokens"], b["tokens"]))
    err = 0.0
    for ta, tb, la, lb in zip(a["tokens"], b["tokens"], a["logprobs"], b["logprobs"]):
        n = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), len(ta))  # up to the first difference
        if n:
            err = max(err, float(np.max(np.abs(np.array(la[:n]) - np.array(lb[:n])))))
    return same, err


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="flash-slice")
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", required=True)
    ap.add_argument("--against", default=None, help="a baseline run's file")
    a = ap.parse_args(argv)
    got = run(a.model, a.new, a.dtype)
    with open(a.out, "w") as f:
        json.dump(got, f)
    if a.against is None:
        print(f"{len(got['tokens'])} requests, {a.new} tokens each: {a.out}")
        return 0
    with open(a.against) as f:
        base = json.load(f)
    same, err = compare(got, base)
    print(f"XLA_FLAGS={got['xla_flags']!r} against {base['xla_flags']!r}: greedy tokens identical in {same} of "
          f"{len(got['tokens'])} requests; max |log-prob difference| {err:.3g}")
    return 0 if same == len(got["tokens"]) else 1


if __name__ == "__main__":
    sys.exit(main())
