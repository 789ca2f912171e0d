"""mHC's collapse and the RMS norm after it as one Pallas kernel (pallas_kernels.hc_pre_norm) against the model's
form, the norm's weight read from a layer stack in place, and its Triton lowering from this CPU machine."""
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import _compat
from v4jax.model import layers as L

HN = importlib.import_module("pallas_kernels.hc_pre_norm")
EPS = 1e-6


def _case(m, n, d, dtype, layers=3, seed=0):
    k = jax.random.split(jax.random.key(seed), 3)
    x = (3.0 * jax.random.normal(k[0], (m, n, d))).astype(dtype)
    pre = jax.nn.sigmoid(jax.random.normal(k[1], (m, n))) + 1e-4
    stack = 1.0 + 0.5 * jax.random.normal(k[2], (layers, d))
    return x, pre, stack


@pytest.mark.parametrize("m,d", [(1, 64), (5, 256), (64, 128)])
def test_matches_the_model_f32(m, d):
    x, pre, stack = _case(m, 4, d, jnp.float32)
    for layer in (0, 2):
        out = HN.hc_pre_norm(x, pre, stack, jnp.int32(layer), eps=EPS, interpret=True)
        assert out.shape == (m, d) and out.dtype == x.dtype
        ref = L.hc_pre_norm(x, pre, L.LayerOf(stack, jnp.int32(layer)), EPS)
        np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=2e-6, atol=2e-6)
    # a weight of its own (no stack)
    out = HN.hc_pre_norm(x, pre, stack[1], eps=EPS, interpret=True)
    np.testing.assert_allclose(np.asarray(out), np.asarray(L.hc_pre_norm(x, pre, stack[1], EPS)), rtol=2e-6,
                               atol=2e-6)


def test_rounds_as_the_model_bf16():
    # u rounded to bf16 before the norm, the output rounded again: equal to the model's form but for the order of
    # the sums (one bf16 ulp where a value lands next to a rounding boundary)
    x, pre, stack = _case(32, 4, 512, jnp.bfloat16, seed=1)
    out = np.asarray(HN.hc_pre_norm(x, pre, stack, jnp.int32(1), eps=EPS, interpret=True), np.float32)
    ref = np.asarray(L.hc_pre_norm(x, pre, L.LayerOf(stack, jnp.int32(1)), EPS), np.float32)
    assert np.mean(out == ref) > 0.99
    np.testing.assert_allclose(out, ref, rtol=2 ** -7, atol=2 ** -7)


def test_refuses_other_shapes():
    x, pre, stack = _case(2, 4, 24, jnp.float32)  # D = 24: not a power of two
    assert not HN.supported(x, stack)
    x65, _, stack65 = _case(HN.MAX_TOKENS + 1, 4, 64, jnp.float32)  # more tokens than a decode step's
    assert not HN.supported(x65, stack65)
    with pytest.raises(ValueError, match="powers of two"):
        HN.hc_pre_norm(x, pre, stack, eps=EPS, interpret=True)


def test_lowers_for_gpu():
    x, pre, stack = _case(3, 4, 4096, jnp.bfloat16)
    txt = _compat.lower_for_cuda(lambda *a: HN.hc_pre_norm(*a, eps=EPS, interpret=False), x, pre, stack,
                                 jnp.int32(1))
    assert txt.count("triton") >= 1
