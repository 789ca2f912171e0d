"""One pass of the sampler's radix threshold search (v4jax.engine.sampling._threshold) in several forms, on a
Flash-sized vocabulary: the sums at 15 (or 31) thresholds of a row as one variadic reduce of f32 weights or int32
counts, as separate sums, and with the weights recomputed from the keys in the pass. Prints one line a form with
its kernel time and GB/s of the bytes the pass must read.

  python scripts/radix_probe.py --batches 1,32
"""
from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp

from v4jax.bench.profile import said, time_call
from v4jax.engine import sampling


def variadic(keys, weight, n):
    ts = [jnp.uint32(0x80000000) + jnp.uint32(d << 20) for d in range(1, n + 1)]
    zero = jnp.zeros((), weight.dtype)
    return jax.lax.reduce([jnp.where(keys >= t, weight, zero) for t in ts], [zero] * n,
                          lambda xs, ys: [x + y for x, y in zip(xs, ys)], (1,))


def separate(keys, weight, n):
    ts = [jnp.uint32(0x80000000) + jnp.uint32(d << 20) for d in range(1, n + 1)]
    return [jnp.sum(jnp.where(keys >= t, weight, 0.0), axis=-1) for t in ts]


def from_keys(keys, n):
    # the weight as the search would recompute it: the logit decoded from its key, exp(logit - max)
    bits = jnp.where(keys >> 31 == 1, keys ^ jnp.uint32(1 << 31), ~keys)
    logit = jax.lax.bitcast_convert_type(bits, jnp.float32)
    return variadic(keys, jnp.exp(logit - 30.0), n)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--vocab", type=int, default=129280)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    for b in (int(x) for x in a.batches.split(",")):
        logits = 4.0 * jax.random.normal(jax.random.key(0), (b, a.vocab), jnp.float32)
        keys = sampling._order_keys(logits)
        weight = jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True))
        ones = jnp.ones_like(keys, jnp.int32)
        mb = b * a.vocab * 4 / 1e6
        forms = {
            "variadic15 f32": (jax.jit(lambda k, w: variadic(k, w, 15)), (keys, weight), 2 * mb),
            "variadic15 i32": (jax.jit(lambda k, w: variadic(k, w, 15)), (keys, ones), 2 * mb),
            "variadic7 f32": (jax.jit(lambda k, w: variadic(k, w, 7)), (keys, weight), 2 * mb),
            "variadic31 f32": (jax.jit(lambda k, w: variadic(k, w, 31)), (keys, weight), 2 * mb),
            "separate15 f32": (jax.jit(lambda k, w: separate(k, w, 15)), (keys, weight), 2 * mb),
            "from_keys15": (jax.jit(lambda k: from_keys(k, 15)), (keys,), mb),
            "max (one read)": (jax.jit(lambda w: jnp.max(w, axis=-1)), (weight,), mb),
        }
        for name, (fn, args, bytes_mb) in forms.items():
            m = time_call(lambda: fn(*args), a.reps, mb=bytes_mb)
            print(said(f"batch {b:3d} {name:16s}", m), "|", m.get("top"), flush=True)
            if a.out:
                with open(a.out, "a") as f:
                    f.write(json.dumps({"batch": b, "form": name, **m}) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
