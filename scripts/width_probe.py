"""What the page-table width buckets cost and save: the same decode and prefill rows through `LLM.generate` with the
engine's power-of-two width buckets ("pow2": a step's tables as wide as the next power of two of its pages) and
with one width ("max": every table as wide as the longest sequence's, so one program per shape whatever the
context). The kernels already skip keys past each query's valid length (the indexer scores write -inf there
without a load); what a wider table still costs is those writes, the top-k over them and the wider tables.
Prints ms/step per row for each, the programs each compiled, and how many a warm-up would compile.

    python scripts/width_probe.py --model flash-slice --max-model-len 131584 --max-num-seqs 32 \\
        --rows 1x4096 32x4096 1x131072 --new 32
"""
import argparse
import json
import time

import numpy as np


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="flash-slice")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-model-len", type=int, default=131584)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--rows", nargs="+", default=["1x4096", "32x4096", "1x131072"], help="BATCHxCONTEXT")
    p.add_argument("--new", type=int, default=32)
    p.add_argument("--policies", nargs="+", default=["max", "pow2"])
    p.add_argument("--out", default=None, help="append each row as a JSON line here")
    a = p.parse_args()

    from v4jax import LLM
    from v4jax.bench.generate import _engine_for, decode_row
    from v4jax.engine import steps as S
    from v4jax.engine.core import EngineCore

    pow2_bucket = EngineCore._page_bucket
    llm = LLM(a.model, dtype=a.dtype, max_model_len=a.max_model_len, max_num_seqs=a.max_num_seqs)
    for policy in a.policies:
        EngineCore._page_bucket = (pow2_bucket if policy == "pow2" else
                                   lambda self, upto: self.layout.max_pages_per_seq)
        _engine_for(llm)
        eng = llm.engine
        widths = eng._page_buckets()
        warmup_programs = len(eng._prefill_programs()) + len(eng._decode_programs())
        for spec in a.rows:
            b, c = (int(x) for x in spec.split("x"))
            before, t0 = S.compiled_programs(), time.perf_counter()
            row = decode_row(llm, b, c, a.new, np.random.default_rng(0))
            row.update(policy=policy, widths=widths, warmup_programs=warmup_programs,
                       compiled=S.compiled_programs() - before, row_s=time.perf_counter() - t0)
            print(f"{policy:5s} batch {b:3d} context {c:7d}: {row['ms_per_step']:.3f} ms/step "
                  f"(steady {row['steady_ms_per_step'] or float('nan'):.3f}), prefill+first {row['prefill_s']:.3f} s, "
                  f"{row['compiled']} programs compiled, warm-up would compile {warmup_programs} "
                  f"({len(widths)} widths), row {row['row_s']:.0f} s", flush=True)
            if a.out:
                with open(a.out, "a") as f:
                    f.write(json.dumps(row) + "\n")
    EngineCore._page_bucket = pow2_bucket


if __name__ == "__main__":
    main()
