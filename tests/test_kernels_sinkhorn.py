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


def _mix(shape, seed=0, layers=None):
    """(dot, ssq, scale, base): mHC's mix is L.mix_of(dot, ssq, COUNT, 1e-6); scale and base a layer's, or stacks of
    `layers`."""
    k = jax.random.split(jax.random.key(seed), 4)
    lead = () if layers is None else (layers,)
    ssq = COUNT * jnp.exp(0.3 * jax.random.normal(k[1], (*shape, 1)))
    return (2.0 * jax.random.normal(k[0], (*shape, 24)), ssq, jax.random.normal(k[2], (*lead, 3)),
            jax.random.normal(k[3], (*lead, 24)))


COUNT = 16384  # the streams' values a mix reads: N * D (Flash: 4 x 4096)


@pytest.mark.parametrize("shape,iters", [((1,), 20), ((2, 3), 20), ((70,), 7), ((1, 1), 1)])
def test_weights_match_reference(shape, iters):
    """mHC's weights from its mix in one kernel (token blocks of 32, the last one part full) against the model's
    jnp maths: the mix's norm and scaling, pre, post and the Sinkhorn-normalised comb."""
    dot, ssq, scale, base = _mix(shape)
    got = SK.hc_weights(dot, ssq, COUNT, 1e-6, scale, base, 4, iters, 1e-6, interpret=True)
    ref = L.hc_weights(dot, ssq, COUNT, 1e-6, scale, base, 4, iters, 1e-6)
    for g, r in zip(got, ref):
        assert g.shape == r.shape
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=2e-6, atol=1e-7)
    np.testing.assert_allclose(np.asarray(got[2]).sum(-2), 1.0, atol=1e-5)


def test_weights_read_the_layer_of_a_stack():
    dot, ssq, scale, base = _mix((5,), seed=1, layers=3)
    for layer in (0, 2):
        got = SK.hc_weights(dot, ssq, COUNT, 1e-6, scale, base, 4, 20, 1e-6, jnp.int32(layer), interpret=True)
        ref = L.hc_weights(dot, ssq, COUNT, 1e-6, L.LayerOf(scale, layer), L.LayerOf(base, layer), 4, 20, 1e-6)
        for g, r in zip(got, ref):
            np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=2e-6, atol=1e-7)


def test_weights_lower_for_gpu():
    dot, ssq, scale, base = _mix((3,), layers=43)
    fn = lambda d, q, s, b: SK.hc_weights(d, q, COUNT, 1e-6, s, b, 4, 20, 1e-6, jnp.int32(5), interpret=False)  # noqa
    assert "triton" in _compat.lower_for_cuda(fn, dot, ssq, scale, base)


def test_the_ops_table_reads_the_weights_of_its_layer():
    # the Pallas table's hc_weights takes scale and base as the layer loop holds them (L.LayerOf of their stacks) and
    # must read that layer's, as the XLA table's slices do
    from v4jax.model import ops
    dot, ssq, scale, base = _mix((3,), seed=2, layers=4)
    for layer in (1, 3):
        args = (dot, ssq, COUNT, 1e-6, L.LayerOf(scale, jnp.int32(layer)), L.LayerOf(base, jnp.int32(layer)), 4, 20,
                1e-6)
        for g, r in zip(ops.PALLAS.hc_weights(*args), ops.XLA.hc_weights(*args)):
            np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=2e-6, atol=1e-7)
