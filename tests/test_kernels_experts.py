"""The few-token routed-experts kernels (pallas_kernels.experts) against their jnp reference, the model's
gather form, and their Triton lowering from this CPU machine (tests/test_engine_pallas.py checks that the engine's
Pallas ops table runs them and keeps the XLA table's greedy outputs)."""
import importlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from pallas_kernels import _compat
from v4jax.model import layers as L

X = importlib.import_module("pallas_kernels.experts")


def _case(M, k, E, I, D, dtype, seed=0, stack=()):
    ks = jax.random.split(jax.random.key(seed), 6)
    x = jax.random.normal(ks[0], (M, D), dtype)
    w1, w3 = (0.2 * jax.random.normal(kk, (*stack, E, I, D), dtype) for kk in ks[1:3])
    w2 = 0.2 * jax.random.normal(ks[3], (*stack, E, D, I), dtype)
    ex = jax.vmap(lambda kk: jax.random.permutation(kk, E)[:k])(jax.random.split(ks[4], M))  # distinct per token
    return x, jax.random.uniform(ks[5], (M, k)), ex.astype(jnp.int32), w1, w2, w3


@pytest.mark.parametrize("M,k,E,I,D,blocks", [(1, 2, 8, 32, 64, None), (3, 2, 5, 64, 128, ((16, 32), (32, 16))),
                                              (2, 6, 16, 48, 96, None),
                                              (40, 3, 4, 32, 64, None)])  # 40 tokens: tiles of 64, full experts
def test_matches_reference_f32(M, k, E, I, D, blocks):
    args = _case(M, k, E, I, D, jnp.float32)
    kw = {} if blocks is None else dict(up=blocks[0], down=blocks[1])
    out = np.asarray(X.routed_experts(*args, 1.5, interpret=True, **kw))  # limit 1.5: the clamp is active
    ref = np.asarray(L.routed_experts(*args, 1.5, form="gather"))
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)


def test_reads_one_layer_of_a_stack():
    x, wt, ex, w1, w2, w3 = _case(3, 2, 5, 32, 64, jnp.float32, stack=(3,))
    for layer in (0, 2):
        out = np.asarray(jax.jit(lambda i: X.routed_experts(x, wt, ex, w1, w2, w3, 1.5, layer=i, interpret=True))(
            jnp.int32(layer)))
        ref = np.asarray(L.routed_experts(x, wt, ex, w1[layer], w2[layer], w3[layer], 1.5, form="gather"))
        np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)


def test_pairs_of_no_expert_add_nothing():
    """-1 = no expert (on a mesh, another shard's expert): those pairs add nothing and fill no expert's tile (24 of
    the 40 pairs here: more than a tile of 32 rows holds, were they one expert's)."""
    x, wt, ex, w1, w2, w3 = _case(20, 2, 4, 32, 64, jnp.float32, seed=1)
    ex = ex.at[:16, 1].set(-1).at[:8, 0].set(-1)
    out = np.asarray(X.routed_experts(x, wt, ex, w1, w2, w3, 1.5, interpret=True))
    ref = np.asarray(L.routed_experts(x, jnp.where(ex >= 0, wt, 0.0), jnp.maximum(ex, 0), w1, w2, w3, 1.5,
                                      form="gather"))
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 12), st.integers(1, 6), st.integers(1, 9), st.data())
def test_pairs_grouped_as_a_stable_sort_groups_them(m, k, n_exp, data):
    """The kernels' grouping of (token, expert) pairs by comparison equals a stable sort by expert, pairs of no
    expert (negative or out-of-range ids, another shard's) last, and each pair's slot reads its output back."""
    ex = np.array(data.draw(st.lists(st.integers(-2, n_exp + 1), min_size=m * k, max_size=m * k)),
                  np.int32).reshape(m, k)
    got = X._group_pairs(jnp.asarray(ex), n_exp)
    flat = np.where((ex >= 0) & (ex < n_exp), ex, n_exp).reshape(-1)
    order = np.argsort(flat, kind="stable")
    np.testing.assert_array_equal(got.order, order)
    np.testing.assert_array_equal(got.ids, flat)
    np.testing.assert_array_equal(got.tokens, order // k)
    np.testing.assert_array_equal(got.offs, np.concatenate([[0], np.cumsum(np.bincount(flat, minlength=n_exp + 1))]))
    tiles = np.full((n_exp, m * k, 1), -1.0, np.float32)   # each expert's tile row r holds its r-th pair's place
    for place, pair in enumerate(order):
        if flat[pair] < n_exp:
            tiles[flat[pair], place - got.offs[flat[pair]], 0] = pair
    back = np.asarray(got.outputs(jnp.asarray(tiles)))[:, 0]
    np.testing.assert_array_equal(back, np.where(flat < n_exp, np.arange(m * k), 0))



def test_pairs_grouped_without_a_sort_or_a_scatter():
    text = jax.jit(lambda e: X._group_pairs(e, 16)).lower(jnp.zeros((4, 6), jnp.int32)).as_text()
    assert "stablehlo.sort" not in text and "stablehlo.scatter" not in text


def test_matches_reference_bf16():
    args = _case(2, 3, 8, 64, 128, jnp.bfloat16)
    out = np.asarray(X.routed_experts(*args, 7.0, interpret=True))
    np.testing.assert_allclose(out, np.asarray(L.routed_experts(*args, 7.0, form="gather")), rtol=2e-2, atol=2e-2)


def test_unsupported_shapes_are_refused():
    args = _case(1, 2, 4, 24, 64, jnp.float32)  # I = 24: no power-of-two block of >= 16 divides it
    assert not X.supported(args[0], args[3])
    with pytest.raises(ValueError, match="power-of-two"):
        X.routed_experts(*args, 7.0, interpret=True)
    assert not X.supported(jnp.zeros((X.MAX_TOKENS + 1, 64)), jnp.zeros((4, 32, 64)))  # prefill: XLA's forms
    one_token = jnp.zeros((1, 4096))
    stack = lambda n: jax.ShapeDtypeStruct((n, 16, 2048, 4096), jnp.bfloat16)
    assert X.supported(one_token, stack(2)) and X.supported(one_token, stack(20))  # flash-slice's, flash-1gpu's


def test_lowers_for_gpu():
    M, k, E, I, D = 1, 6, 16, 2048, 4096
    args = (jnp.zeros((M, D), jnp.bfloat16), jnp.zeros((M, k)), jnp.zeros((M, k), jnp.int32),
            jnp.zeros((E, I, D), jnp.bfloat16), jnp.zeros((E, D, I), jnp.bfloat16), jnp.zeros((E, I, D), jnp.bfloat16))
    txt = _compat.lower_for_cuda(lambda *a: X.routed_experts(*a, 10.0, interpret=False), *args)
    assert txt.count("triton") >= 2  # the up and the down kernel


def _fp4_case(M, k, E, I, D, seed=7, stack=None):
    """x rounded to FP8 (act_quant), FP4 expert stacks with block scales over a range of magnitudes."""
    from v4jax.model import quant
    x, weights, ex, w1, w2, w3 = _case(M, k, E, I, D, jnp.float32, seed=seed, stack=() if stack is None else (stack,))
    ks = jax.random.split(jax.random.key(seed + 1), 3)
    def store(w, kk):  # a power-of-two magnitude per 32-block, so a scale read at the wrong block shows
        mag = jnp.exp2(jax.random.randint(kk, (*w.shape[:-1], w.shape[-1] // 32), -4, 4).astype(jnp.float32))
        return quant.Quantized(*quant.quantize(w * jnp.repeat(mag, 32, -1), "fp4"), "fp4")
    return quant.fp8_roundtrip(x, 128), weights, ex, *(store(w, kk) for w, kk in zip((w1, w2, w3), ks))


def _w2_input(h, w):
    from v4jax.model import quant
    return quant.fp8_roundtrip((h * w).astype(jnp.float32), 128)


@pytest.mark.parametrize("M,k,E,I,D,layer", [
    pytest.param(1, 2, 8, 64, 128, None, marks=pytest.mark.slow), (3, 2, 5, 128, 64, 1),
    pytest.param(20, 3, 4, 64, 64, 0, marks=pytest.mark.slow)])  # interpreted: ~20 s a case
def test_fp4_matches_the_release_numerics(M, k, E, I, D, layer):
    # against the model's gather form on the dequantized stacks, act_quant (w2's input scaled by the routing weight
    # and rounded to FP8, outputs summed unweighted); one token, a stack read at layer 1, 20 tokens over 4 experts
    x, weights, ex, w1, w2, w3 = _fp4_case(M, k, E, I, D, stack=None if layer is None else 2)
    assert X.fp4_supported(x, w1.values)
    got = jax.jit(lambda x, wt, ex, a, b, c, i: X.routed_experts_fp4(
        x, wt, ex, (a.values, a.scale), (b.values, b.scale), (c.values, c.scale), 10.0, _w2_input, layer=i,
        interpret=True))(x, weights, ex, w1, w2, w3, layer)
    pick = (lambda w: w) if layer is None else (lambda w: w[layer])
    ref = L.routed_experts(x, weights, ex, pick(w1), pick(w2), pick(w3), 10.0, "gather", act_quant=True)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5, atol=1e-5 * float(jnp.abs(ref).max()))


def test_fp4_pairs_match_the_release_numerics():
    """A program a (token, expert) pair: one layer of a stack, a pair of no expert (-1: another shard's expert) that
    adds nothing, the release's rounding of w2's input; the same outputs as the expert-a-program form."""
    x, weights, ex, w1, w2, w3 = _fp4_case(2, 2, 8, 64, 128, stack=2)
    ex = ex.at[0, 1].set(-1)
    run = lambda form: jax.jit(lambda x, wt, ex, a, b, c, i: X.routed_experts_fp4(
        x, wt, ex, (a.values, a.scale), (b.values, b.scale), (c.values, c.scale), 10.0, _w2_input, layer=i,
        interpret=True, form=form))(x, weights, ex, w1, w2, w3, 1)
    got = run("pairs")
    ref = L.routed_experts(x, jnp.where(ex >= 0, weights, 0.0), jnp.maximum(ex, 0), w1[1], w2[1], w3[1], 10.0,
                           "gather", act_quant=True)
    scale = float(jnp.abs(ref).max())
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5, atol=1e-5 * scale)
    np.testing.assert_allclose(np.asarray(got), np.asarray(run("experts")), rtol=1e-5, atol=1e-5 * scale)


def test_fp4_lowers_for_gpu():
    """Both forms lower to Triton; a pair a program where the pairs are at most twice the experts, else an expert a
    program."""
    def kernels(M, k, E):
        x, weights, ex, w1, w2, w3 = _fp4_case(M, k, E, 64, 128)
        txt = _compat.lower_for_cuda(lambda x, wt, ex, a, b, c: X.routed_experts_fp4(
            x.astype(jnp.bfloat16), wt, ex, (a.values, a.scale), (b.values, b.scale), (c.values, c.scale), 10.0,
            _w2_input, interpret=False), x, weights, ex, w1, w2, w3)
        return set(re.findall(r"v4_experts_\w+", txt))
    assert kernels(4, 2, 4) == {"v4_experts_up_fp4_pairs", "v4_experts_down_fp4_pairs"}
    assert kernels(5, 2, 4) == {"v4_experts_up_fp4", "v4_experts_down_fp4"}
