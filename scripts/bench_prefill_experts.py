"""GPU kernel time of a prefill chunk's routed experts: XLA's dense form (every expert over every token) against
the grouped form on JAX's Hopper ragged matmul (jax.experimental.pallas.ops.gpu.ragged_dot_mgpu, block sizes
swept), from a profiler trace; FLOPs = the routed (token, expert) pairs' three matmuls.

  python scripts/bench_prefill_experts.py [M ...]     # flash sizes (D 4096, I 2048, 16 experts, 6 active); M 8192
"""
import json
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from pallas_kernels import experts_grouped as G  # noqa: E402
from v4jax.model import layers as L  # noqa: E402
from v4jax.bench.profile import summarize  # noqa: E402
from bench_experts import case as uniform_case  # noqa: E402  (scripts/ is this script's directory)


def case(M, k, E, I, D):
    """The decode bench's weights and tokens, with skewed routing (as a router gives): expert popularity varies."""
    x, _, _, w1, w2, w3 = uniform_case(M, k, E, I, D)
    ks = jax.random.split(jax.random.key(1), 2)
    logits = jax.random.normal(ks[0], (M, E)) + 2.0 * jax.random.normal(ks[1], (E,))
    w, ex = jax.lax.top_k(jax.nn.softmax(logits), k)
    return x, w, ex.astype(jnp.int32), w1, w2, w3


def main():
    ms_list = [int(a) for a in sys.argv[1:]] or [8192]
    k, E, I, D = 6, 16, 2048, 4096
    rows = []
    for M in ms_list:
        args = case(M, k, E, I, D)
        tflop = M * k * 3 * 2 * I * D / 1e12
        ref = jax.jit(lambda *a: L.routed_experts(*a, 10.0, form="dense"))(*args)
        forms = {"xla_dense": jax.jit(lambda *a: L.routed_experts(*a, 10.0, form="dense")),
                 "xla_grouped": jax.jit(lambda *a: L.routed_experts(*a, 10.0, form="grouped"))}
        for bm, bn, steps, gbn in [(128, 128, 4, 4), (128, 128, 4, 8), (128, 128, 4, 16), (128, 128, 6, 4),
                                   (128, 128, 3, 8), (128, 64, 4, 8), (64, 128, 4, 8)]:
            cfg = G.Blocks(bm, bn, 64, steps, gbn)
            forms[f"mgpu m{bm} n{bn} s{steps} g{gbn}"] = jax.jit(
                lambda *a, cfg=cfg: G.routed_experts(*a, 10.0, blocks=cfg))
        for name, fn in forms.items():
            try:
                out = fn(*args)
                err = float(jnp.max(jnp.abs(out - ref)) / jnp.max(jnp.abs(ref)))
                s = summarize(lambda: jax.block_until_ready(fn(*args)), repeats=3, top=6)
            except Exception as e:  # a block shape the compiler refuses (shared memory): say so, go on
                rows.append({"M": M, "form": name, "error": str(e)[:300]})
                print(f"M={M} {name}: error {str(e)[:200]}", flush=True)
                continue
            ms = s.get("kernel_ms", float("nan"))
            rows.append({"M": M, "form": name, "kernel_ms": ms, "TFLOP/s": tflop / ms * 1e3, "rel_err": err,
                         "top": s.get("top")})
            print(f"M={M} {name}: {ms:.3f} ms, {tflop / ms * 1e3:.0f} TFLOP/s (routed FLOPs), rel err {err:.2e}",
                  flush=True)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "prefill_experts.json"), "w") as f:
            json.dump({"device": str(jax.devices()[0]), "jax": jax.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
