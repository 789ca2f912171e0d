"""The decode call's device memory as XLA plans it: arguments, outputs, how much of the donated pools the outputs
alias, and temporaries, against the largest pool array. A donated pool that is not aliased (or a temporary the
size of a pool array) doubles that array's memory inside the call.

    python scripts/decode_memory.py [--model flash-slice] [--batch 32] [--contexts 16K,128K] [--attention-impl pallas]

One JSON line per context (an engine sized for it, freed before the next).
"""
from __future__ import annotations

import argparse
import gc
import json

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


def main():
    from v4jax import cache as C
    from v4jax.bench.decode import JaxDecodeBench, _parse_ints, small_config
    from v4jax.model import RunOptions, Transformer
    from v4jax.config import preset

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="small")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--contexts", default="256")
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--attention-impl", default="xla")
    a = ap.parse_args()
    cfg = small_config() if a.model == "small" else preset(a.model)
    model = Transformer(cfg, rngs=nnx.Rngs(0), dtype=jnp.bfloat16, mtp=False)
    for ctx in _parse_ints(a.contexts):
        bench = JaxDecodeBench(cfg, model, RunOptions(attention_impl=a.attention_impl), a.batch, ctx, a.k)
        eng = bench.engine
        state, pt, swa = bench.decode_args(ctx - 2 * a.k, np.random.default_rng(0))
        compiled = eng.steps.decode.lower(eng.greedy_spec, eng._leaves, eng.pools, eng.store, state, pt,
                                          swa).compile()
        m = compiled.memory_analysis()
        largest = max(jax.tree.leaves(eng.pools), key=lambda x: x.nbytes)
        out = {"model": a.model, "batch": a.batch, "context": ctx, "device": jax.devices()[0].device_kind,
               "pool_bytes": sum(C.pool_bytes(eng.pools).values()),
               "largest_pool_array": [largest.nbytes, list(largest.shape), str(largest.dtype)]}
        for f in ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes", "temp_size_in_bytes"):
            out[f] = getattr(m, f, None)
        print(json.dumps(out), flush=True)
        del bench, eng, compiled
        gc.collect()


if __name__ == "__main__":
    main()
