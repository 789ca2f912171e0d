"""A cold engine's first `LLM.generate` of one long prompt (no warm-up, compilation cache off): seconds, step
programs compiled and how many of them in the background (compiled ahead: the page buckets the prompt's later
chunks cross and its decode calls, while its first chunk's program compiles), then the same in a fresh process
with nothing compiled ahead (`--no-ahead`: each program compiled by the step that first needs it).

    python scripts/first_generate.py --model tiny --dtype float32 --prompt 3000 --chunk 256 --max-model-len 4096
    python scripts/first_generate.py --model flash-slice --prompt 131072 --chunk 8192 --max-model-len 131584
"""
import argparse
import json
import os
import subprocess
import sys
import time


def one(a) -> dict:
    import numpy as np

    from v4jax import LLM, SamplingParams
    from v4jax.engine import steps as S
    llm = LLM(a.model, dtype=a.dtype, max_num_seqs=a.max_num_seqs, max_model_len=a.max_model_len,
              prefill_chunk=a.chunk)
    llm.engine.programs.background = not a.no_ahead
    prompt = np.random.default_rng(0).integers(2, llm.config.vocab_size, a.prompt).tolist()
    t = time.perf_counter()
    out = llm.generate([prompt], SamplingParams(max_tokens=a.new, temperature=0.0, ignore_eos=True))
    return {"model": a.model, "prompt": a.prompt, "chunk": a.chunk, "ahead": not a.no_ahead,
            "seconds": time.perf_counter() - t, "programs": S.compiled_programs(),
            "background": S.compiled_programs(background=True), "first_tokens": list(out[0].token_ids[:8])}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--prompt", type=int, default=3000)
    p.add_argument("--chunk", type=int, default=256)
    p.add_argument("--new", type=int, default=40)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--max-num-seqs", type=int, default=4)
    p.add_argument("--no-ahead", action="store_true")
    p.add_argument("--one", action="store_true", help="this process only (else both forms, each in its own)")
    a = p.parse_args()
    if a.one:
        print(json.dumps(one(a)), flush=True)
        return 0
    env = dict(os.environ, V4JAX_COMPILATION_CACHE="off")
    rows = []
    for flag in ([], ["--no-ahead"]):
        r = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--one", *flag], env=env, capture_output=True,
                           text=True)
        line = [x for x in r.stdout.splitlines() if x.startswith("{")]
        rows.append(json.loads(line[-1]) if line else {"error": r.stderr[-500:]})
        print(json.dumps(rows[-1]), flush=True)
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
