"""GPU kernel time of the few-token routed experts: XLA's gather form vs pallas_kernels.experts (block sizes and
warps swept), from a profiler trace. Bytes = each routed (token, expert) pair's three weight matrices once.

  python scripts/bench_experts.py            # flash sizes (D 4096, I 2048, 6 active), E = 16 and 256, M = 1, 4, 32
"""
import itertools
import json
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from pallas_kernels import experts as X  # noqa: E402
from v4jax.model import layers as L  # noqa: E402
from v4jax.bench.profile import summarize  # noqa: E402


def case(M, k, E, I, D):
    ks = jax.random.split(jax.random.key(0), 6)
    x = jax.random.normal(ks[0], (M, D), jnp.bfloat16)
    w1, w3 = (0.05 * jax.random.normal(kk, (E, I, D), jnp.bfloat16) for kk in ks[1:3])
    w2 = 0.05 * jax.random.normal(ks[3], (E, D, I), jnp.bfloat16)
    ex = jax.vmap(lambda kk: jax.random.permutation(kk, E)[:k])(jax.random.split(ks[4], M)).astype(jnp.int32)
    return x, jax.random.uniform(ks[5], (M, k)), ex, w1, w2, w3


def main():
    rows = []
    k, I, D = 6, 2048, 4096
    for E, M in [(16, 1), (256, 1), (256, 4), (256, 32)]:
        args = case(M, k, E, I, D)
        gbytes = M * k * 3 * I * D * 2 / 1e9
        forms = {"xla_gather": jax.jit(lambda *a: L.routed_experts(*a, 10.0, form="gather"))}
        for (ur, uc), (dr, dc), nw, ns in itertools.product([(16, 512), (32, 256), (8, 1024)], [(16, 512), (32, 256)],
                                                            [4, 8], [2]):
            forms[f"pallas up{ur}x{uc} down{dr}x{dc} w{nw} s{ns}"] = jax.jit(
                lambda *a, u=(ur, uc), d=(dr, dc), nw=nw, ns=ns: X.routed_experts(
                    *a, 10.0, up=u, down=d, num_warps=nw, num_stages=ns))
        for name, fn in forms.items():
            try:
                s = summarize(lambda: jax.block_until_ready(fn(*args)), repeats=5, top=4)
            except Exception as e:  # a block shape Triton refuses: say so, go on
                rows.append({"E": E, "M": M, "form": name, "error": str(e)[:200]})
                continue
            ms = s.get("kernel_ms", float("nan"))
            rows.append({"E": E, "M": M, "form": name, "kernel_ms": ms, "kernels": s.get("kernels"),
                         "GB/s": gbytes / ms * 1e3 if ms else None, "top": s.get("top")})
            print(f"E={E} M={M} {name}: {ms:.4f} ms, {gbytes / ms * 1e3:.0f} GB/s", flush=True)
    out = os.environ.get("OUT", ".")
    with open(os.path.join(out, "experts.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
