"""mHC's mix at a decode step's rows as a Pallas kernel (pallas_kernels.hc_mix), fn read from a layer stack in place,
against the model's form, and its Triton lowering from this CPU machine."""
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import _compat
from v4jax.model import layers as L

HM = importlib.import_module("pallas_kernels.hc_mix")
EPS = 1e-6


def _case(m, n, d, dtype, c=24, layers=3, seed=0):
    k = jax.random.split(jax.random.key(seed), 2)
    x = (2.0 * jax.random.normal(k[0], (m, n, d))).astype(dtype)
    fn = jax.random.normal(k[1], (layers, c, n * d)) * (n * d) ** -0.5
    return x, fn


@pytest.mark.parametrize("m,d,splits", [(2, 64, 64), (5, 256, 4), (64, 128, 3), (1, 512, 8)])
def test_matches_the_model(m, d, splits):
    # (3 splits of 2 chunks: the largest divisor of the chunks at most 3, i.e. 2)
    x, fn = _case(m, 4, d, jnp.float32)
    for layer in (0, 2):
        dot, ms = HM.hc_mix(x.reshape(m, -1), fn, jnp.int32(layer), interpret=True, splits=splits)
        assert dot.shape == (m, fn.shape[1]) and ms.shape == (m,)
        mix = dot * jax.lax.rsqrt(ms + EPS)[:, None]
        ref = L.hc_mix(x, L.LayerOf(fn, jnp.int32(layer)), EPS)
        np.testing.assert_allclose(np.asarray(mix), np.asarray(ref), rtol=1e-5, atol=1e-6)


def test_bf16_streams_are_widened_exactly():
    x, fn = _case(8, 4, 256, jnp.bfloat16, seed=1)
    dot, ms = HM.hc_mix(x.reshape(8, -1), fn[1], interpret=True)
    flat = x.reshape(8, -1).astype(jnp.float32)
    np.testing.assert_allclose(np.asarray(dot), np.asarray(jnp.einsum("mk,ck->mc", flat, fn[1], precision="highest")),
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(ms), np.asarray(jnp.mean(flat * flat, axis=1)), rtol=1e-6)


def test_refuses_other_shapes():
    x, fn = _case(2, 4, 24, jnp.float32)  # K = 96: not a multiple of 256 columns
    assert not HM.supported(x.reshape(2, -1), fn)
    x65, fn65 = _case(HM.MAX_TOKENS + 1, 4, 64, jnp.float32)
    assert not HM.supported(x65.reshape(HM.MAX_TOKENS + 1, -1), fn65)
    with pytest.raises(ValueError, match="multiple of"):
        HM.hc_mix(x.reshape(2, -1), fn, interpret=True)


def test_lowers_for_gpu():
    x, fn = _case(32, 4, 4096, jnp.bfloat16)
    txt = _compat.lower_for_cuda(lambda x, f, i: HM.hc_mix(x, f, i, interpret=False), x.reshape(32, -1), fn,
                                 jnp.int32(1))
    assert txt.count("triton") >= 1
