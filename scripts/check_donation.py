"""Whether a donated array is updated in place at each size: a jitted row scatter into a donated bf16 [R, K]
array (and the same through a [n, R/n, K] stack flattened inside, as the pools are), with the device's peak
memory before and after each call. An array updated in place adds nothing to the peak; one that is not asks for a
second copy of itself.

    python scripts/check_donation.py [--gib 1,3.9,4.1,8,21] [--layers 21]
"""
from __future__ import annotations

import argparse
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np


@functools.partial(jax.jit, donate_argnums=0)
def write_rows(a, rows, values):
    flat = a.reshape(-1, a.shape[-1])
    return flat.at[rows].set(values, mode="drop").reshape(a.shape)


@functools.partial(jax.jit, static_argnums=(0, 1))
def make(shape, dtype):
    return jax.lax.broadcasted_iota(jnp.int32, shape, len(shape) - 1).astype(dtype)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", default="1,3.9,4.1,8,21")
    ap.add_argument("--layers", type=int, default=21)
    a = ap.parse_args()
    dev = jax.devices()[0]
    for gib in (float(g) for g in a.gib.split(",")):
        k = 512
        rows = int(gib * 2 ** 30 / 2 / k) // a.layers * a.layers
        for shape in ((rows, k), (a.layers, rows // a.layers, k)):
            x = make(shape, jnp.bfloat16)
            x.block_until_ready()
            st0 = dev.memory_stats() or {}
            idx = jnp.asarray(np.arange(0, rows, rows // 32, dtype=np.int32)[:32])
            vals = jnp.ones((32, k), jnp.bfloat16)
            err = None
            try:
                for _ in range(3):
                    x = write_rows(x, idx, vals)
                x.block_until_ready()
            except Exception as e:  # noqa: BLE001
                err = f"{type(e).__name__}: {str(e)[:200]}"
            st1 = dev.memory_stats() or {}
            print(json.dumps({"gib": gib, "shape": list(shape), "elements": int(np.prod(shape)),
                              "over_2_31": int(np.prod(shape)) >= 2 ** 31,
                              "in_use_before": st0.get("bytes_in_use"), "peak_before": st0.get("peak_bytes_in_use"),
                              "peak_after": st1.get("peak_bytes_in_use"), "in_use_after": st1.get("bytes_in_use"),
                              "array_bytes": int(np.prod(shape)) * 2, "error": err}), flush=True)
            del x
            jax.clear_caches()


if __name__ == "__main__":
    main()
