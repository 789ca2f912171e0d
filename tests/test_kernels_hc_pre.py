"""mHC's collapse as two Pallas launches (pallas_kernels.hc_pre) against the model's jnp reference
(v4jax.model.layers.hc_pre), interpreted on CPU, and its lowering for the GPU (Triton, MLIR-verified)."""
import importlib
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import _compat
from v4jax.model import layers as L

HP = importlib.import_module("pallas_kernels.hc_pre")


def _case(m, n, d, dtype, seed=0):
    ks = jax.random.split(jax.random.key(seed), 4)
    mix = (2 + n) * n
    # streams of different magnitudes (the norm matters), fn / base / scale all random (every parameter)
    x = (jax.random.normal(ks[0], (m, n, d)) * jnp.exp2(jnp.arange(n, dtype=jnp.float32))[:, None]).astype(dtype)
    fn = jax.random.normal(ks[1], (mix, n * d), jnp.float32) * (n * d) ** -0.5
    base = jax.random.normal(ks[2], (mix,), jnp.float32)
    scale = 0.5 + jax.random.uniform(ks[3], (3,), jnp.float32)
    return x, fn, base, scale


@pytest.mark.parametrize("m,n,d,dtype,iters", [(1, 4, 64, jnp.bfloat16, 20), (3, 4, 128, jnp.float32, 20),
                                               (17, 4, 1024, jnp.bfloat16, 7), (64, 2, 64, jnp.float32, 3)])
def test_matches_reference(m, n, d, dtype, iters):
    x, fn, base, scale = _case(m, n, d, dtype)
    # the fields of ModelConfig hc_pre reads
    cfg = types.SimpleNamespace(hc_mult=n, hc_sinkhorn_iters=iters, hc_eps=1e-6, norm_eps=1e-5)
    u, post, comb = jax.jit(lambda *a: HP.hc_pre(*a, iters=iters, hc_eps=cfg.hc_eps, norm_eps=cfg.norm_eps,
                                                 interpret=True))(x, fn, base, scale)
    ru, rpost, rcomb = L.hc_pre(x, fn, base, scale, cfg)
    assert u.dtype == ru.dtype and u.shape == ru.shape and comb.shape == rcomb.shape
    np.testing.assert_allclose(np.asarray(post), np.asarray(rpost), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(comb), np.asarray(rcomb), rtol=1e-5, atol=1e-6)
    # u: the same f32 sum up to rounding, then one rounding to x's dtype (a bf16 step where the sums straddle one)
    tol = 1e-5 if dtype == jnp.float32 else 2 ** -7
    uu, ref = np.asarray(u, np.float64), np.asarray(ru, np.float64)
    np.testing.assert_allclose(uu, ref, rtol=tol, atol=tol * np.abs(ref).max())


def test_unsupported_shapes_are_refused():
    x, fn, base, scale = _case(65, 4, 64, jnp.float32)
    assert not HP.supported(x, fn)
    with pytest.raises(ValueError, match="expected"):
        HP.hc_pre(x, fn, base, scale, iters=20, hc_eps=1e-6, norm_eps=1e-6, interpret=True)


def test_lowers_for_gpu():
    x, fn, base, scale = _case(2, 4, 4096, jnp.bfloat16)
    txt = _compat.lower_for_cuda(lambda *a: HP.hc_pre(*a, iters=20, hc_eps=1e-6, norm_eps=1e-6, interpret=False),
                                 x, fn, base, scale)
    assert "v4_hc_mix" in txt and "v4_hc_pre" in txt
