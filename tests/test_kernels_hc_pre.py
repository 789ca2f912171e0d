"""mHC's collapse with its norm as two Pallas kernels (pallas_kernels.hc_pre) against the model's maths, and their
Triton lowering from this CPU machine."""
import importlib
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import _compat
from v4jax.model import layers as L

HP = importlib.import_module("pallas_kernels.hc_pre")
EPS = dict(iters=20, hc_eps=1e-6, norm_eps=1e-6)
CFG = types.SimpleNamespace(hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, norm_eps=1e-6)  # what hc_pre reads


def _ref(*args):
    return L.hc_pre_norm(*args, CFG)


def _case(m, n, d, dtype, seed=0):
    k = jax.random.split(jax.random.key(seed), 5)
    mix = (2 + n) * n
    x = jax.random.normal(k[0], (m, n, d), dtype)
    fn = jax.random.normal(k[1], (mix, n * d), jnp.float32) * (n * d) ** -0.5
    base = 0.5 * jax.random.normal(k[2], (mix,), jnp.float32)
    scale = 1.0 + 0.5 * jax.random.normal(k[3], (3,), jnp.float32)
    norm_w = 1.0 + 0.3 * jax.random.normal(k[4], (d,), jnp.float32)
    return x, fn, base, scale, norm_w


@pytest.mark.parametrize("m,d,bm,bd", [(1, 64, 16, 128), (5, 256, 4, 64), (37, 128, 16, 32), (32, 512, 16, 128)])
def test_matches_the_model_f32(m, d, bm, bd):
    # token blocks past M (5 tokens in blocks of 4, 37 in 16) are masked; several D blocks sum their partials
    args = _case(m, 4, d, jnp.float32, seed=m)
    y, post, comb = HP.hc_pre_norm(*args, interpret=True, block_tokens=bm, block_d=bd, **EPS)
    ry, rpost, rcomb = _ref(*args)
    assert y.shape == (m, d) and y.dtype == jnp.float32 and post.shape == (m, 4) and comb.shape == (m, 4, 4)
    np.testing.assert_allclose(np.asarray(post), np.asarray(rpost), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(comb), np.asarray(rcomb), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(y), np.asarray(ry), rtol=1e-5, atol=1e-5)


def test_rounds_as_the_model_bf16():
    # u rounded to bf16 before its norm, the norm's output rounded: equal to the model's up to the order of the f32
    # sums (one bf16 ulp where a value lands next to a rounding boundary)
    args = _case(64, 4, 256, jnp.bfloat16, seed=1)
    y, post, comb = HP.hc_pre_norm(*args, interpret=True, **EPS)
    ry, rpost, rcomb = _ref(*args)
    assert y.dtype == jnp.bfloat16
    out, ref = np.asarray(y, np.float32), np.asarray(ry, np.float32)
    assert np.mean(out == ref) > 0.99
    np.testing.assert_allclose(out, ref, rtol=2 ** -7, atol=2 ** -7)
    np.testing.assert_allclose(np.asarray(comb), np.asarray(rcomb), rtol=1e-5, atol=1e-6)


def test_reads_a_layer_of_stacks_in_place():
    # the layer loop's form: stacks of every weight and a traced layer index give that layer's result
    stacks = [_case(4, 4, 128, jnp.float32, seed=s) for s in (3, 4, 5)]
    x = stacks[0][0]
    fn, base, scale, norm_w = (jnp.stack([c[i] for c in stacks]) for i in range(1, 5))
    run = jax.jit(lambda li: HP.hc_pre_norm(x, fn, base, scale, norm_w, li, interpret=True, block_d=32, **EPS))
    for li in (0, 2):
        want = _ref(x, fn[li], base[li], scale[li], norm_w[li])
        for got, ref in zip(run(li), want):
            np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5, atol=1e-5)


def test_refuses_other_shapes():
    x, fn, base, scale, norm_w = _case(2, 4, 48, jnp.float32)  # D = 48: the finish kernel holds a power of two
    assert not HP.supported(x, fn)
    with pytest.raises(ValueError, match="powers of two"):
        HP.hc_pre_norm(x, fn, base, scale, norm_w, interpret=True, **EPS)


def test_lowers_for_gpu():
    args = _case(3, 4, 4096, jnp.bfloat16)
    txt = _compat.lower_for_cuda(lambda *a: HP.hc_pre_norm(*a, interpret=False, **EPS), *args)
    assert txt.count("triton") >= 2


def test_stacks_lower_for_gpu():
    x, fn, base, scale, norm_w = _case(3, 4, 4096, jnp.bfloat16)
    stacks = [jnp.stack([a] * 3) for a in (fn, base, scale, norm_w)]
    txt = _compat.lower_for_cuda(lambda *a: HP.hc_pre_norm(*a, interpret=False, **EPS), x, *stacks, jnp.int32(2))
    assert txt.count("triton") >= 2
