"""The "f8" form of the FP4 routed-experts kernels (pallas_kernels.experts.routed_experts_fp4_f8: codes placed as
e4m3 bits, FP8 dots per 32-column block) in Pallas interpret mode on the CPU: the bit placement against the e2m1
values, the form against the "bits" form and the model's gather form on the dequantized weights, ops' routing of
the form, and the Triton lowering for CUDA from this machine."""
import functools
import importlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pallas_kernels import _compat
from v4jax.model import layers as L
from v4jax.model import ops, quant

X = importlib.import_module("pallas_kernels.experts")
F32 = jnp.float32


def test_e4m3_bits_are_the_e2m1_values_over_64():
    # every byte: its low half (the even column) and its high half (the odd column), in column order
    b = jnp.arange(256, dtype=jnp.uint8).reshape(16, 16)
    got = np.asarray(jax.lax.bitcast_convert_type(X.e4m3_bits(b), jnp.float8_e4m3fn).astype(F32)) * 64.0
    codes = np.arange(256).reshape(16, 16)
    want = np.stack([codes & 15, codes >> 4], axis=-1).reshape(16, 32)
    e2m1 = np.arange(16, dtype=np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float32)  # the format's values
    np.testing.assert_array_equal(e2m1, np.asarray(X._e2m1(jnp.arange(16, dtype=jnp.int32))))
    assert e2m1.tolist() == [0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6]
    np.testing.assert_array_equal(got, e2m1[want])
    np.testing.assert_array_equal(np.signbit(got), np.signbit(e2m1[want]))  # -0 stays -0


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4, 5))
def _case(M, k, E, I, D, n):
    """x rounded to FP8 whose 128-blocks span 2^-6 .. 2^6; k distinct experts a token, pairs of no expert (-1);
    FP4 stacks [n, E, ...] whose 32-blocks span 2^-8 .. 2^7 (a scale read at the wrong block or row shows)."""
    ks = jax.random.split(jax.random.key(M * 1000 + E), 9)
    mag = jnp.exp2(jax.random.randint(ks[0], (M, D // 128, 1), -6, 7).astype(F32))
    x = quant.fp8_roundtrip((jax.random.normal(ks[1], (M, D // 128, 128)) * mag).reshape(M, D), 128)
    ex = jax.vmap(lambda kk: jax.random.permutation(kk, E)[:k])(jax.random.split(ks[2], M)).astype(jnp.int32)
    ex = ex.at[::2, -1].set(-1)  # every other token's last pair: no expert (another shard's, on a mesh)
    wt = jax.random.uniform(ks[4], (M, k))

    def store(kk, o, c):
        k1, k2 = jax.random.split(kk)
        bmag = jnp.exp2(jax.random.randint(k2, (n, E, o, c // 32), -8, 8).astype(F32))
        w = 0.2 * jax.random.normal(k1, (n, E, o, c)) * jnp.repeat(bmag, 32, -1)
        return quant.quantize(w, "fp4")

    return x, wt, ex, store(ks[5], I, D), store(ks[6], D, I), store(ks[7], I, D)


def _w2_input(h, w):
    return quant.fp8_roundtrip((h * w).astype(F32), 128)


def _run(x, wt, ex, w1, w2, w3, layer, **kw):
    return np.asarray(jax.jit(lambda x, wt, ex, a, b, c, i: X.routed_experts_fp4(
        x, wt, ex, a, b, c, 10.0, _w2_input, layer=i, interpret=True, **kw))(x, wt, ex, w1, w2, w3, layer))


@pytest.mark.parametrize("M,k,E,I,D,n,layer,f8_blocks", [
    (1, 2, 4, 128, 256, 1, 0, {}),                                          # one token, F8_UP / F8_DOWN
    (5, 3, 6, 256, 128, 2, 1, dict(up=(16, 64), down=(16, 32))),            # a step of 2 and 1 blocks of 32
    (32, 2, 4, 128, 256, 3, 2, dict(up=(64, 256), down=(32, 128)))])        # 32 tokens: tiles of 32 slots
def test_f8_matches_bits_and_the_release_numerics(M, k, E, I, D, n, layer, f8_blocks):
    x, wt, ex, *ws = _case(M, k, E, I, D, n)
    assert X.fp4_supported(x, ws[0][0], "f8") and bool(jnp.any(ex < 0))
    got = _run(x, wt, ex, *ws, jnp.int32(layer), form="f8", **f8_blocks)
    bits = _run(x, wt, ex, *ws, jnp.int32(layer))
    # the model's gather form on the layer's dequantized weights, act_quant (w2's input scaled by the routing weight
    # and rounded to FP8, the outputs summed unweighted); pairs of no expert as expert 0 with routing weight 0
    ref = np.asarray(jax.jit(lambda x, wt, ex, ws: L.routed_experts(
        x, jnp.where(ex >= 0, wt, 0.0), jnp.maximum(ex, 0), *[quant.Quantized(v[layer], s[layer], "fp4")
                                                               for v, s in ws], 10.0, "gather", act_quant=True))(
        x, wt, ex, ws))
    top = float(np.abs(ref).max())
    assert top > 0 and np.all(np.isfinite(got))
    np.testing.assert_allclose(got, bits, rtol=1e-5, atol=1e-5 * top)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * top)


def test_forms_and_the_models_choice(monkeypatch):
    """ops._experts_pallas takes the form experts.FP4_FORM names ("bits" until the GPU sweep says otherwise)."""
    assert X.FP4_FORM == "bits" and X.FP4_FORMS == ("bits", "f8")
    x, wt, ex, w1, w2, w3 = _case(1, 2, 4, 128, 256, 1)  # the first case's (jit-cached)
    with pytest.raises(ValueError, match="FP4 expert form"):
        X.routed_experts_fp4(x, wt, ex, w1, w2, w3, 10.0, _w2_input, form="e4m3")
    calls = []
    monkeypatch.setattr(X, "routed_experts_fp4_f8", lambda *a, **kw: calls.append(kw) or jnp.zeros(x.shape, F32))
    q = [quant.Quantized(v, s, "fp4") for v, s in (w1, w2, w3)]
    monkeypatch.setattr(X, "FP4_FORM", "f8")
    ops.PALLAS.experts(x, wt, ex, *q, 10.0, layer=jnp.int32(0), act_quant=True)
    assert len(calls) == 1 and calls[0]["up"] == X.F8_UP and calls[0]["down"] == X.F8_DOWN


@pytest.mark.parametrize("M", [1, 32])
def test_f8_lowers_for_cuda_triton(M):
    S = jax.ShapeDtypeStruct
    n, k, E, I, D = 3, 6, 16, 2048, 4096  # flash-slice's stacks
    codes = lambda o, c: (S((n, E, o, c // 2), jnp.uint8), S((n, E, o, c // 32), jnp.float8_e8m0fnu))
    w2_input = lambda h, w: quant.fp8_roundtrip((h * w).astype(jnp.bfloat16), 128)
    txt = _compat.lower_for_cuda(lambda x, wt, ex, w1, w2, w3: X.routed_experts_fp4(
        x, wt, ex, w1, w2, w3, 10.0, w2_input, layer=jnp.int32(2), form="f8", interpret=False),
        S((M, D), jnp.bfloat16), S((M, k), F32), S((M, k), jnp.int32), codes(I, D), codes(D, I), codes(I, D))
    assert txt.count("v4_experts_up_fp4_f8") >= 1 and txt.count("v4_experts_down_fp4_f8") >= 1
