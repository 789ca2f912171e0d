"""pallas_kernels.experts on the GPU against its reference and against numpy: small and flash-sized experts, a
layer stack at exactly 2**31 elements (32-bit offsets in Pallas' Triton lowering) and past it (64-bit), duplicate
experts within a token.
Run without tests/conftest.py's matmul precision, the XLA reference's f32 einsums run as TF32 (5x the kernel's
error against float64, measured)."""
import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import experts as X
from v4jax.model import layers as L


def numpy_rows(x, wt, ex, w1, w2, w3, layer, rows, limit=10.0):
    """The exact FFN of a few tokens in float64 from the experts' weights copied one by one to the host."""
    take = jax.jit(lambda w, l, e: w[l, e])
    out = []
    for m in rows:
        acc = 0.0
        xm = np.asarray(x[m], np.float64)
        for kk in range(ex.shape[1]):
            e = int(ex[m, kk])
            g1, g3, g2 = (np.asarray(take(w, layer, e), np.float64) for w in (w1, w3, w2))
            h1, h3 = g1 @ xm, g3 @ xm
            h = (np.minimum(h1, limit) / (1 + np.exp(-np.minimum(h1, limit)))) * np.clip(h3, -limit, limit)
            h = np.asarray(jnp.asarray(h, jnp.bfloat16), np.float64)
            acc = acc + float(wt[m, kk]) * (g2 @ h)
        out.append(acc)
    return np.stack(out)


for (n, layer, M, k, E, I, D, dup) in [(1, 0, 5, 6, 256, 2048, 4096, False), (1, 0, 5, 6, 255, 2048, 4096, False),
                                       (1, 0, 5, 6, 256, 2048, 4096, True), (1, 0, 5, 6, 64, 2048, 4096, True),
                                       (3, 2, 4, 6, 256, 2048, 4096, False), (3, 1, 32, 6, 16, 2048, 4096, False),
                                       (20, 19, 32, 6, 16, 2048, 4096, False)]:
    ks = jax.random.split(jax.random.key(0), 6)
    x = jax.random.normal(ks[0], (M, D), jnp.bfloat16)
    w1 = 0.05 * jax.random.normal(ks[1], (n, E, I, D), jnp.bfloat16)
    w3 = 0.05 * jax.random.normal(ks[2], (n, E, I, D), jnp.bfloat16)
    w2 = 0.05 * jax.random.normal(ks[3], (n, E, D, I), jnp.bfloat16)
    if dup:
        ex = jax.random.randint(ks[4], (M, k), 0, E).at[0, 1].set(0).at[0, 0].set(0)
    else:
        ex = jax.vmap(lambda kk: jax.random.permutation(kk, E)[:k])(jax.random.split(ks[4], M))
    ex = ex.at[M - 1, 0].set(E - 1)  # the last expert: the highest offsets
    wt = jax.random.uniform(ks[5], (M, k))
    out = np.asarray(jax.jit(lambda *a: X.routed_experts(*a, 10.0, layer=jnp.int32(layer)))(x, wt, ex, w1, w2, w3))
    ref = np.asarray(jax.jit(lambda *a: L.routed_experts(*a, 10.0, form="gather"))(x, wt, ex, w1[layer], w2[layer],
                                                                                    w3[layer]))
    rows = [0, M - 1]
    exact = numpy_rows(x, wt, ex, w1, w2, w3, layer, rows)
    tol = lambda a, b: float(np.max(np.abs(a - b) / (2e-2 + 2e-2 * np.abs(b))))
    err = np.abs(out - ref)
    bad = np.argwhere(err > 2e-2 + 2e-2 * np.abs(ref))
    print(f"n={n} layer={layer} M={M} E={E} ({n * E * I * D / 2**31:.2f} x 2**31 el) dup={dup}: kernel-vs-ref "
          f"max err {err.max():.3g} of |ref| {np.abs(ref).max():.3g}, bad rows {sorted(set(bad[:, 0].tolist()))[:8]}"
          f"; rows {rows} vs float64: kernel {tol(out[rows], exact):.3g}, xla ref {tol(ref[rows], exact):.3g} "
          f"(<1 passes)", flush=True)
    del w1, w2, w3
