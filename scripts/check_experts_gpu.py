"""pallas_kernels.experts on the GPU against its reference: small and flash-sized experts, a layer stack whose
rows pass 2**31 elements (64-bit offsets), duplicate experts within a token."""
import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import experts as X

for (n, layer, M, k, E, I, D, dup) in [(1, 0, 5, 6, 256, 2048, 4096, True), (1, 0, 5, 6, 256, 2048, 4096, False),
                                       (1, 0, 5, 6, 64, 2048, 4096, True), (3, 2, 4, 6, 256, 2048, 4096, False),
                                       (3, 1, 32, 6, 16, 2048, 4096, False)]:
    ks = jax.random.split(jax.random.key(0), 6)
    x = jax.random.normal(ks[0], (M, D), jnp.bfloat16)
    w1 = 0.05 * jax.random.normal(ks[1], (n, E, I, D), jnp.bfloat16)
    w3 = 0.05 * jax.random.normal(ks[2], (n, E, I, D), jnp.bfloat16)
    w2 = 0.05 * jax.random.normal(ks[3], (n, E, D, I), jnp.bfloat16)
    if dup:
        ex = jax.random.randint(ks[4], (M, k), 0, E).at[0, 1].set(0).at[0, 0].set(0)
    else:
        ex = jax.vmap(lambda kk: jax.random.permutation(kk, E)[:k])(jax.random.split(ks[4], M))
    wt = jax.random.uniform(ks[5], (M, k))
    out = np.asarray(jax.jit(lambda *a: X.routed_experts(*a, 10.0, layer=jnp.int32(layer)))(x, wt, ex, w1, w2, w3))
    ref = np.asarray(X.routed_experts_ref(x, wt, ex, w1[layer], w2[layer], w3[layer], 10.0))
    err = np.abs(out - ref)
    bad = np.argwhere(err > 2e-2 + 2e-2 * np.abs(ref))
    print(f"n={n} layer={layer} M={M} E={E} dup={dup}: max err {err.max():.3g} of |ref| {np.abs(ref).max():.3g}, "
          f"bad {len(bad)} rows {sorted(set(bad[:, 0].tolist()))[:8]}", flush=True)
    del w1, w2, w3
