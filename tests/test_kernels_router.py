"""The top-k MoE router as two Pallas kernels (pallas_kernels.router) against the model's route_by in interpret
mode, exact ties included, and their Triton lowering from this CPU machine."""
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import _compat
from v4jax.config import preset
from v4jax.model import layers as L

R = importlib.import_module("pallas_kernels.router")
K, SCALE = 6, 2.5


def _cfg(e):
    return preset("tiny").replace(n_routed_experts=e, n_activated_experts=K, route_scale=SCALE)


def _case(m, e, d, dtype, seed=0):
    k = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(k[0], (m, d), dtype)
    w = (jax.random.normal(k[1], (e, d), jnp.float32) * d ** -0.5).astype(dtype)  # logits ~ N(0, 1), as the model
    bias = 0.1 * jax.random.normal(k[2], (e,), jnp.float32)
    return x, w, bias


def _margin(x, w, bias):
    """The smallest gap between consecutive values of the reference's k + 1 largest biased scores, over tokens."""
    logits = jnp.einsum("md,ed->me", x.astype(jnp.float32), w.astype(jnp.float32),
                        precision=jax.lax.Precision.HIGHEST)
    v = np.sort(np.asarray(jnp.sqrt(jax.nn.softplus(logits)) + bias), axis=1)[:, ::-1][:, :K + 1]
    return float(np.min(v[:, :-1] - v[:, 1:]))


@pytest.mark.parametrize("m,e,dtype,blocks", [
    (1, 16, jnp.float32, {}),                          # one token: the elementwise form, 4 experts a program
    (5, 64, jnp.bfloat16, {}),                         # a token block past M
    (37, 64, jnp.float32, {}),                         # the dot form (16 tokens x 16 experts) in f32, blocks past M
    (37, 16, jnp.bfloat16, dict(block_experts=4, select_tokens=4)),  # elementwise at 16 tokens
    (5, 48, jnp.float32, {}),                          # E not a power of two: the select kernel masks 48..63
    (37, 48, jnp.bfloat16, dict(block_d=64)),          # ... with the dot form, four D steps
    (37, 64, jnp.bfloat16, dict(bf16_dot=False)),      # bf16 operands widened to f32 in the dot
])
def test_matches_route_by(m, e, dtype, blocks):
    x, w, bias = _case(m, e, 256, dtype, seed=m + e)
    assert R.supported(x, w, bias, K)
    assert _margin(x, w, bias) > 1e-5  # no near-ties that the sums' order could flip
    wt, ex = R.route(x, w, bias, k=K, route_scale=SCALE, interpret=True, **blocks)
    rwt, rex = L.route_by(x, w, bias, None, _cfg(e))
    assert wt.shape == ex.shape == (m, K) and wt.dtype == jnp.float32 and ex.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(ex), np.asarray(rex))
    np.testing.assert_allclose(np.asarray(wt), np.asarray(rwt), rtol=1e-6, atol=0)


@pytest.mark.parametrize("m,e", [(1, 16), (37, 64), (5, 48)])
def test_reads_a_layer_of_stacks(m, e):
    # the layer loop's form: a stack of gates and one of biases with traced rows (E = 48: sliced, not in place)
    cases = [_case(m, e, 256, jnp.bfloat16, seed=s) for s in (11, 12, 13)]
    x = cases[0][0]
    gates, biases = jnp.stack([c[1] for c in cases]), jnp.stack([c[2] for c in cases[:2]])
    run = jax.jit(lambda li, bi: R.route(x, gates, biases, li, bi, k=K, route_scale=SCALE, interpret=True))
    for li, bi in ((2, 1), (0, 0)):
        assert _margin(x, gates[li], biases[bi]) > 1e-5
        wt, ex = run(li, bi)
        rwt, rex = L.route_by(x, gates[li], biases[bi], None, _cfg(e))
        np.testing.assert_array_equal(np.asarray(ex), np.asarray(rex))
        np.testing.assert_allclose(np.asarray(wt), np.asarray(rwt), rtol=1e-6, atol=0)


def test_exact_ties_take_the_lower_index():
    # tokens with x = 0 score sqrt(log 2) on every expert exactly; the bias then ties experts 3, 9, 40 (first) and
    # 7, 21, 33, 50 (next, four for three places): lax.top_k's order is 3, 9, 40, 7, 21, 33 with equal weights
    e, m = 64, 5
    x, w, _ = _case(m, e, 256, jnp.float32, seed=3)
    x = x.at[jnp.array([0, 2, 3])].set(0.0)
    bias = -jax.random.uniform(jax.random.key(4), (e,), jnp.float32)
    bias = bias.at[jnp.array([40, 9, 3])].set(1.0).at[jnp.array([50, 33, 21, 7])].set(0.5)
    wt, ex = R.route(x, w, bias, k=K, route_scale=SCALE, interpret=True)
    rwt, rex = L.route_by(x, w, bias, None, _cfg(e))
    want = np.array([3, 9, 40, 7, 21, 33])
    np.testing.assert_array_equal(np.asarray(rex)[[0, 2, 3]], np.broadcast_to(want, (3, K)))  # the rule itself
    np.testing.assert_array_equal(np.asarray(ex), np.asarray(rex))
    np.testing.assert_allclose(np.asarray(wt), np.asarray(rwt), rtol=1e-6, atol=0)
    np.testing.assert_allclose(np.asarray(wt)[0], SCALE / K, rtol=1e-6)


def test_refuses_other_shapes():
    x, w, bias = _case(2, 16, 40, jnp.float32)  # D = 40: no power-of-two block of >= 16 divides it
    assert not R.supported(x, w, bias, K)
    with pytest.raises(ValueError, match="power-of-two block"):
        R.route(x, w, bias, k=K, route_scale=SCALE, interpret=True)
    x, w, bias = _case(2, 4, 64, jnp.float32)  # k > E
    assert not R.supported(x, w, bias, K)
    assert not R.supported(x, w, None, K)  # a hash layer's router stays XLA's


@pytest.mark.parametrize("m,dtype", [(1, jnp.bfloat16), (32, jnp.bfloat16), (32, jnp.float32)])
def test_lowers_for_gpu(m, dtype):
    # Flash's sizes: D = 7168, E = 256, k = 6; one token (the elementwise form) and 32 (the dot form: bf16 operands
    # as they are, f32 ones in IEEE f32)
    x, w, bias = _case(m, 256, 7168, dtype)
    txt = _compat.lower_for_cuda(lambda *a: R.route(*a, k=K, route_scale=1.5, interpret=False), x, w, bias)
    assert txt.count("triton") >= 2


def test_stacks_lower_for_gpu():
    # a layer of the gate's and the biases' stacks read in place, as the layer loop calls it
    x, w, bias = _case(1, 256, 7168, jnp.bfloat16)
    gates, biases = jnp.stack([w, w]), jnp.stack([bias] * 3)
    txt = _compat.lower_for_cuda(lambda *a: R.route(*a, k=K, route_scale=1.5, interpret=False), x, gates, biases,
                                 jnp.int32(1), jnp.int32(2))
    assert txt.count("triton") >= 2
