"""mHC's expansion as a Pallas kernel (pallas_kernels.hc_post) against the XLA form, and its Triton lowering from
this CPU machine."""
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import _compat
from v4jax.model import layers as L

HP = importlib.import_module("pallas_kernels.hc_post")


def _case(m, n, d, dtype, seed=0):
    k = jax.random.split(jax.random.key(seed), 4)
    f = jax.random.normal(k[0], (m, d), dtype)
    x = jax.random.normal(k[1], (m, n, d), dtype)
    post = 2 * jax.nn.sigmoid(jax.random.normal(k[2], (m, n)))
    comb = jax.nn.softmax(jax.random.normal(k[3], (m, n, n)), axis=-1)
    return f, x, post, comb


@pytest.mark.parametrize("m,d,bm,bd", [(1, 64, 16, 512), (5, 256, 4, 64), (37, 128, 16, 32), (32, 512, 16, 512)])
def test_matches_the_model_f32(m, d, bm, bd):
    # blocks of tokens past M (5 tokens in blocks of 4, 37 in 16) are masked; the model's own form is the reference
    f, x, post, comb = _case(m, 4, d, jnp.float32)
    out = HP.hc_post(f, x, post, comb, interpret=True, block_tokens=bm, block_d=bd)
    assert out.shape == x.shape and out.dtype == x.dtype
    np.testing.assert_allclose(np.asarray(out), np.asarray(L.hc_post(f, x, post, comb)), rtol=1e-6, atol=1e-6)


def test_rounds_as_the_model_bf16():
    # post * f and the sum over j each rounded to bf16, then added: equal to the XLA form up to the order of the
    # four f32 terms (one bf16 ulp where a sum lands next to a rounding boundary)
    f, x, post, comb = _case(64, 4, 256, jnp.bfloat16, seed=1)
    out = np.asarray(HP.hc_post(f, x, post, comb, interpret=True), np.float32)
    ref = np.asarray(L.hc_post(f, x, post, comb), np.float32)
    assert out.dtype == np.float32 and np.mean(out == ref) > 0.99
    np.testing.assert_allclose(out, ref, rtol=2 ** -7, atol=2 ** -7)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_adds_up_partial_sums(dtype):
    # f as a projection's f32 partial sums [S, M, D]: their sum, rounded to x's dtype, is the sublayer's output
    f, x, post, comb = _case(5, 4, 256, dtype, seed=3)
    parts = jax.random.normal(jax.random.key(4), (4,) + f.shape, jnp.float32)
    f = jnp.sum(parts, axis=0).astype(dtype)
    out = np.asarray(HP.hc_post(parts, x, post, comb, interpret=True), np.float32)
    np.testing.assert_array_equal(out, np.asarray(HP.hc_post(f, x, post, comb, interpret=True), np.float32))
    lone = np.asarray(HP.hc_post(parts[:1], x, post, comb, interpret=True), np.float32)   # one part, rounded too
    np.testing.assert_array_equal(lone, np.asarray(HP.hc_post(parts[0].astype(dtype), x, post, comb,
                                                                interpret=True), np.float32))


def test_refuses_other_shapes():
    f, x, post, comb = _case(2, 4, 24, jnp.float32)  # D = 24: no power-of-two block of >= 16 divides it
    assert not HP.supported(f, x)
    with pytest.raises(ValueError, match="power-of-two"):
        HP.hc_post(f, x, post, comb, interpret=True)


def test_lowers_for_gpu():
    f, x, post, comb = _case(3, 4, 4096, jnp.bfloat16)
    txt = _compat.lower_for_cuda(lambda *a: HP.hc_post(*a, interpret=False), f, x, post, comb)
    assert txt.count("triton") >= 1


# ---- the collapse and the next sublayer's RMS norm (collapse_norm) ----
def _collapse_case(m, n, d, dtype, layers=3, seed=2):
    k = jax.random.split(jax.random.key(seed), 3)
    pre = jax.nn.sigmoid(jax.random.normal(k[0], (m, n))) + 1e-6
    x = jax.random.normal(k[1], (m, n, d), dtype)
    w = 1 + 0.1 * jax.random.normal(k[2], (layers, d))
    return pre, x, w


def _collapse_ref(pre, x, w, eps):
    return L.rms_norm(L.collapse(pre, x), w, eps)


@pytest.mark.parametrize("m,d", [(1, 64), (3, 256), (32, 128)])
def test_collapse_norm_matches_the_model_f32(m, d):
    pre, x, w = _collapse_case(m, 4, d, jnp.float32)
    for layer in (0, 2):  # the weight read from its stack at the layer
        out = HP.collapse_norm(pre, x, w, 1e-6, jnp.int32(layer), interpret=True)
        assert out.shape == (m, d) and out.dtype == x.dtype
        np.testing.assert_allclose(np.asarray(out), np.asarray(_collapse_ref(pre, x, w[layer], 1e-6)), rtol=2e-6,
                                   atol=2e-6)
    one = HP.collapse_norm(pre, x, w[1], 1e-6, interpret=True)  # a lone weight [D]
    np.testing.assert_allclose(np.asarray(one), np.asarray(_collapse_ref(pre, x, w[1], 1e-6)), rtol=2e-6, atol=2e-6)


def test_collapse_norm_rounds_as_the_model_bf16():
    # the collapse rounded to bf16 before the norm, the norm in f32, the result rounded: equal to the model's up to
    # the order of the f32 sums (one bf16 ulp where a value lands next to a rounding boundary)
    pre, x, w = _collapse_case(16, 4, 512, jnp.bfloat16, seed=3)
    out = np.asarray(HP.collapse_norm(pre, x, w, 1e-6, jnp.int32(1), interpret=True), np.float32)
    ref = np.asarray(_collapse_ref(pre, x, w[1], 1e-6), np.float32)
    assert np.mean(out == ref) > 0.99
    np.testing.assert_allclose(out, ref, rtol=2 ** -7, atol=2 ** -7)


def test_collapse_norm_refuses_other_shapes():
    pre, x, w = _collapse_case(2, 4, 24, jnp.float32)  # D = 24: not a power of two
    assert not HP.collapse_supported(pre, x)
    pre, x, w = _collapse_case(HP.COLLAPSE_MAX_TOKENS + 1, 4, 64, jnp.float32)  # a prefill chunk's rows
    assert not HP.collapse_supported(pre, x)
    with pytest.raises(ValueError, match="powers of two"):
        HP.collapse_norm(pre, x, w, 1e-6, interpret=True)


def test_collapse_norm_lowers_for_gpu():
    pre, x, w = _collapse_case(3, 4, 4096, jnp.bfloat16, layers=43)
    txt = _compat.lower_for_cuda(lambda *a: HP.collapse_norm(*a, 1e-6, jnp.int32(7), interpret=False), pre, x, w)
    assert txt.count("triton") >= 1


def test_the_ops_table_reads_the_norm_weight_of_its_layer():
    # the Pallas table's hc_collapse takes the weight as the layer loop holds it (L.LayerOf of its stack) and must read
    # that layer's row, as the XLA table's slice does (the presets' norm weights start equal in every layer, so the
    # engine tests would not see another layer's row)
    from v4jax.model import ops
    pre, x, w = _collapse_case(2, 4, 128, jnp.float32, layers=4, seed=5)
    for layer in (1, 3):
        got = ops.PALLAS.hc_collapse(pre, x, L.LayerOf(w, jnp.int32(layer)), 1e-6)
        ref = ops.XLA.hc_collapse(pre, x, L.LayerOf(w, jnp.int32(layer)), 1e-6)
        np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=2e-6, atol=2e-6)
