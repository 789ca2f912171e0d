"""mHC's kernels (pallas_kernels.sinkhorn: the Sinkhorn loop TPUs run, all of the weights GPUs run) against the
model's jnp maths, and their lowering for TPU (Mosaic) and GPU (Triton) from this CPU machine."""
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import _compat
from v4jax.model import layers as L

SK = importlib.import_module("pallas_kernels.sinkhorn")


def _comb(shape, seed=0):
    return jax.nn.softmax(3.0 * jax.random.normal(jax.random.key(seed), (*shape, 4, 4)), -1) + 1e-6


@pytest.mark.parametrize("shape,iters", [((1,), 20), ((2, 3), 20), ((130,), 7), ((1, 1), 1)])
def test_matches_reference(shape, iters):
    comb = _comb(shape)
    out = np.asarray(SK.sinkhorn(comb, iters, 1e-6, interpret=True))
    ref = np.asarray(L.sinkhorn(comb, iters, 1e-6))
    np.testing.assert_allclose(out, ref, rtol=2e-6, atol=1e-7)
    # doubly stochastic after the last (column) step: columns sum to one
    np.testing.assert_allclose(out.sum(-2), 1.0, atol=1e-5)


def test_lowers_for_tpu():
    comb = jnp.ones((1, 1, 4, 4), jnp.float32)
    fn = lambda c: SK.sinkhorn(c, 20, 1e-6, interpret=False)  # noqa: E731
    assert "tpu_custom_call" in _compat.export_for_tpu(fn, comb).mlir_module()


def _mix(shape, seed=0):
    k = jax.random.split(jax.random.key(seed), 3)
    return (2.0 * jax.random.normal(k[0], (*shape, 24)), jax.random.normal(k[1], (3,)),
            jax.random.normal(k[2], (24,)))


@pytest.mark.parametrize("shape,iters", [((1,), 20), ((2, 3), 20), ((70,), 7), ((1, 1), 1)])
def test_weights_match_reference(shape, iters):
    """mHC's weights from its mix in one kernel (token blocks of 32, the last one part full) against the model's
    jnp maths: pre, post and the Sinkhorn-normalised comb."""
    mix, scale, base = _mix(shape)
    got = SK.hc_weights(mix, scale, base, 4, iters, 1e-6, interpret=True)
    ref = L.hc_weights(mix, scale, base, 4, iters, 1e-6)
    for g, r in zip(got, ref):
        assert g.shape == r.shape
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=2e-6, atol=1e-7)
    np.testing.assert_allclose(np.asarray(got[2]).sum(-2), 1.0, atol=1e-5)


def test_weights_lower_for_gpu():
    mix, scale, base = _mix((3,))
    txt = _compat.lower_for_cuda(lambda *a: SK.hc_weights(*a, 4, 20, 1e-6, interpret=False), mix, scale, base)
    assert "triton" in txt
