"""The few-token layer-stack projection kernel (pallas_kernels.layer_linear) against XLA's matmul, and its Triton
lowering from this CPU machine (tests/test_engine_pallas.py checks that the engine's Pallas ops table runs it and
keeps the XLA table's greedy outputs)."""
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import _compat
from v4jax.model import layers as L

LL = importlib.import_module("pallas_kernels.layer_linear")


def _case(lead, O, D, dtype, n=None, seed=0):
    kx, kw = jax.random.split(jax.random.key(seed))
    return (jax.random.normal(kx, (*lead, D), dtype),
            jax.random.normal(kw, (O, D) if n is None else (n, O, D), dtype) * D ** -0.5)


@pytest.mark.parametrize("lead,O,D", [((1,), 16, 64), ((5,), 48, 96), ((2, 1), 512, 1024), ((4, 16), 32, 128)])
def test_matches_xla_f32(lead, O, D):
    # O = 512 over D = 1024: 32 row blocks, so D is split in two (partial sums added); 48 x 96: blocks of 16 x 32
    x, w = _case(lead, O, D, jnp.float32)
    out = np.asarray(LL.layer_linear(x, w, interpret=True))
    assert out.shape == (*lead, O)
    np.testing.assert_allclose(out, np.asarray(L.linear(x, w)), rtol=1e-5, atol=1e-5)


def test_reads_one_layer_of_a_stack():
    x, w = _case((3,), 64, 128, jnp.float32, n=3)
    f = jax.jit(lambda i: LL.layer_linear(x, w, i, interpret=True))
    for layer in (0, 2):
        np.testing.assert_allclose(np.asarray(f(jnp.int32(layer))), np.asarray(L.linear(x, w[layer])), rtol=1e-5,
                                   atol=1e-5)


def test_matches_xla_bf16():
    x, w = _case((2,), 64, 256, jnp.bfloat16, n=2)
    out = LL.layer_linear(x, w, jnp.int32(1), interpret=True)
    assert out.dtype == jnp.float32  # f32 sums; the ops table rounds to x's dtype as L.linear does
    ref = jnp.einsum("md,od->mo", x, w[1], preferred_element_type=jnp.float32)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-5)


def test_unsupported_shapes_are_refused():
    x, w = _case((1,), 24, 64, jnp.float32)  # O = 24: no power-of-two block of >= 16 divides it
    assert not LL.supported(x, w)
    with pytest.raises(ValueError, match="power-of-two"):
        LL.layer_linear(x, w, interpret=True)
    assert not LL.supported(jnp.zeros((LL.MAX_TOKENS + 1, 64)), jnp.zeros((32, 64)))  # prefill: XLA's matmul
    assert LL.supported(jnp.zeros((1, 4096)), jax.ShapeDtypeStruct((43, 32768, 1024), jnp.bfloat16))


def test_lowers_for_gpu():
    x, w = jnp.zeros((1, 4096), jnp.bfloat16), jnp.zeros((4, 512, 4096), jnp.bfloat16)
    txt = _compat.lower_for_cuda(lambda x, w: LL.layer_linear(x, w, jnp.int32(1), interpret=False), x, w)
    assert txt.count("triton") >= 1


@pytest.mark.parametrize("lead,G,R,D", [((1,), 4, 16, 64), ((2, 3), 2, 64, 128)])
def test_grouped_matches_xla(lead, G, R, D):
    # the grouped low-rank output projection: group g's R outputs from x[..., g, :] (two groups per row block
    # would be wrong: R = 16 is one block per group)
    kx, kw = jax.random.split(jax.random.key(1))
    x = jax.random.normal(kx, (*lead, G, D), jnp.float32)
    w = jax.random.normal(kw, (3, G * R, D), jnp.float32) * D ** -0.5
    out = np.asarray(LL.layer_linear(x, w, jnp.int32(1), groups=G, interpret=True))
    assert out.shape == (*lead, G, R)
    np.testing.assert_allclose(out, np.asarray(L.linear(x, w[1], groups=G)), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("lead,outs,D", [((1,), (16, 48, 32), 64), ((3,), (64, 32), 128), ((2, 5), (32, 32), 256)])
def test_several_weights_of_one_input_in_one_launch(lead, outs, D):
    # each weight's outputs as from its own launch; the stacks read at the layer; blocks of 16 rows for (16, 48, 32)
    kx, *kw = jax.random.split(jax.random.key(2), len(outs) + 1)
    x = jax.random.normal(kx, (*lead, D), jnp.float32)
    ws = [jax.random.normal(k, (3, o, D), jnp.float32) * D ** -0.5 for k, o in zip(kw, outs)]
    ys = jax.jit(lambda x, ws, i: LL.layer_linears(x, ws, i, interpret=True))(x, ws, jnp.int32(2))
    assert [y.shape for y in ys] == [(*lead, o) for o in outs]
    for y, w in zip(ys, ws):
        np.testing.assert_allclose(np.asarray(y), np.asarray(L.linear(x, w[2])), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="one input width"):
        LL.layer_linears(x, [ws[0], jnp.zeros((3, 16, 2 * D))], 0, interpret=True)


def test_several_weights_lower_for_gpu():
    x = jnp.zeros((1, 4096), jnp.bfloat16)
    ws = [jnp.zeros((4, o, 4096), jnp.bfloat16) for o in (1024, 512, 256)]
    txt = _compat.lower_for_cuda(lambda x, ws: LL.layer_linears(x, ws, jnp.int32(1), interpret=False), x, ws)
    assert txt.count("triton") >= 1


def _fp8_case(lead, O, D, n, groups=1, seed=3):
    """x rounded to FP8 as the release's act_quant leaves it, and a stack of FP8 weights with random block scales."""
    from v4jax.model import quant
    kx, kw, ks = jax.random.split(jax.random.key(seed), 3)
    x = quant.fp8_roundtrip(jax.random.normal(kx, (*lead, *((groups,) if groups > 1 else ()), D), jnp.float32), 128)
    # block magnitudes over a wide range, so every scale differs and a scale applied to the wrong block shows
    mag = jnp.exp2(jax.random.randint(ks, (n, O // 128, D // 128), -6, 6).astype(jnp.float32))
    w = jax.random.normal(kw, (n, O, D), jnp.float32) * jnp.repeat(jnp.repeat(mag, 128, 1), 128, 2)
    return x, quant.Quantized(*quant.quantize(w, "fp8"), "fp8")


@pytest.mark.parametrize("lead,O,D,groups", [((1,), 256, 384, 1), ((5,), 128, 256, 1), ((2,), 512, 128, 2)])
def test_fp8_weights_match_the_dequantized_matmul(lead, O, D, groups):
    # one token (the multiply-and-sum form) and several (the dot form); two groups of 256 rows; layer 1 of 3
    x, w = _fp8_case(lead, O, D, 3, groups)
    assert LL.supported(x, w.values, groups, scaled=True)
    out = jax.jit(lambda x, v, s, i: LL.layer_linear(x, v, i, groups, scale=s[i], interpret=True))(
        x, w.values, w.scale, jnp.int32(1))
    ref = L.linear(x, w[1].astype(jnp.float32), groups)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-5 * float(jnp.abs(ref).max()))


def test_fp8_weights_need_whole_scale_blocks():
    x, w = _fp8_case((1,), 128, 256, 1)
    assert not LL.supported(x[..., :192], w.values[..., :192], scaled=True)
    assert LL.supported(x[..., :192], w.values[..., :192].astype(jnp.float32))  # unscaled: blocks of 64


def test_fp8_weights_lower_for_gpu():
    x = jnp.zeros((1, 4096), jnp.bfloat16)
    w = jnp.zeros((4, 1024, 4096), jnp.float8_e4m3fn)
    s = jnp.zeros((8, 32), jnp.float8_e8m0fnu)
    txt = _compat.lower_for_cuda(lambda x, w, s: LL.layer_linear(x, w, jnp.int32(1), scale=s, interpret=False),
                                 x, w, s)
    assert txt.count("v4_layer_linear_fp8") >= 1
