"""The prefill FP8 GEMM (pallas_kernels.fp8_matmul) in Pallas interpret mode on the CPU: its activation rounding
against the model's (v4jax.model.quant.fp8_roundtrip, bit for bit), the GEMM against the dequantized reference
and the XLA form of the ops table (ops._linear_xla), ops._linear_pallas's dispatch as on a GPU, and the Triton
lowering for CUDA from this machine. Interpret mode multiplies the e4m3 tiles as they are (XLA:CPU takes
float8_e4m3fn dots), so the kernel body runs unchanged."""
import functools
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import _compat, kv_format
from v4jax.model import layers as L
from v4jax.model import ops, quant

F8 = importlib.import_module("pallas_kernels.fp8_matmul")
F32, BF16 = jnp.float32, jnp.bfloat16


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _x(key, shape, dtype, rounded=True):
    """x with 128-blocks of magnitudes 2^-8 .. 2^8, one block below act_quant's amax floor and one of zeros,
    rounded to FP8 as layers.Linear leaves it (rounded) or not."""
    k1, k2 = jax.random.split(key)
    *lead, d = shape
    mag = jnp.exp2(jax.random.randint(k2, (*lead, d // 128, 1), -8, 9).astype(F32))
    x = (jax.random.normal(k1, (*lead, d // 128, 128), F32) * mag).reshape(shape)
    flat = x.reshape(-1, d)
    flat = flat.at[0, :128].multiply(1e-9).at[1, -128:].set(0.0)
    x = flat.reshape(shape).astype(dtype)
    return quant.fp8_roundtrip(x, 128) if rounded else x


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _w(key, n, o, d):
    """A stack of n FP8 weights [o, d] whose 128 x 128 blocks' scales span 2^-6 .. 2^5."""
    k1, k2 = jax.random.split(key)
    mag = jnp.exp2(jax.random.randint(k2, (n, o // 128, d // 128), -6, 6).astype(F32))
    w = jax.random.normal(k1, (n, o, d), F32) * jnp.repeat(jnp.repeat(mag, 128, 1), 128, 2) * d ** -0.5
    return quant.Quantized(*quant.quantize(w, "fp8"), "fp8")


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_quantizer_is_the_models_rounding(dtype):
    x = _x(jax.random.key(0), (6, 3, 512), dtype, rounded=False)
    q, s = F8.quantize_act(x)
    assert q.dtype == jnp.float8_e4m3fn and s.dtype == F32 and s.shape == (6, 3, 4)
    want = quant.fp8_roundtrip(x, 128)
    got = (q.astype(F32).reshape(6, 3, 4, 128) * s[..., None]).reshape(x.shape)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want.astype(F32)))        # bit for bit
    np.testing.assert_array_equal(np.asarray(got.astype(dtype)), np.asarray(want))
    amax = jnp.max(jnp.abs(x.astype(F32)).reshape(6, 3, 4, 128), axis=-1)
    np.testing.assert_array_equal(np.asarray(s), np.asarray(kv_format.pow2_scale(amax, 1e-4, 448.0)[0]))
    assert float(s[0, 0, 0]) == float(kv_format.pow2_scale(jnp.float32(0), 1e-4, 448.0)[0])  # the floor
    # already rounded (layers.Linear's input): rounding again changes no value, whatever scale it picks
    q2, s2 = F8.quantize_act(want)
    again = (q2.astype(F32).reshape(6, 3, 4, 128) * s2[..., None]).reshape(x.shape)
    np.testing.assert_array_equal(np.asarray(again), np.asarray(want.astype(F32)))


def _reference(x, w, layer, groups):
    """x rounded as the model rounds it, w[layer] dequantized, an f32 matmul (HIGHEST precision: conftest)."""
    return L.linear(quant.fp8_roundtrip(x.astype(F32), 128), w[layer].astype(F32), groups)


# M = 72 is not a whole number of 32-row tiles; layer 2 of 3; block_n 128 (one scale block a tile), 256 (two: per-
# column scales) and 64 (two tiles a scale block); min_programs 64: D split in two (f32 partial sums added)
@pytest.mark.parametrize("dtype,groups,o,d,block_n,min_programs", [
    (F32, 1, 256, 384, 128, 1), (F32, 2, 512, 256, 256, 64), (BF16, 4, 512, 128, 64, 1)])
def test_gemm_matches_the_dequantized_reference(dtype, groups, o, d, block_n, min_programs):
    kx, kw = jax.random.split(jax.random.key(groups + d))
    m = 72
    x = _x(kx, (m, groups, d) if groups > 1 else (m, d), dtype)
    w = _w(kw, 3, o, d)
    run = jax.jit(lambda x, v, s, i: F8.fp8_linear(x, v, i, groups, scale=s[i], interpret=True, block_m=32,
                                                     block_n=block_n, min_programs=min_programs))
    y = run(x, w.values, w.scale, jnp.int32(2))
    assert y.dtype == dtype and y.shape == (m, *((groups, o // groups) if groups > 1 else (o,)))
    ref = np.asarray(_reference(x, w, 2, groups))
    y = np.asarray(y.astype(F32))
    assert np.isfinite(y).all()
    atol = 1e-5 * np.abs(ref).max()
    if dtype == F32:
        np.testing.assert_allclose(y, ref, rtol=1e-5, atol=atol)
    else:  # the f32 sums rounded to bf16 (half an ulp: 2^-9), as the XLA form rounds its own
        np.testing.assert_allclose(y, ref, rtol=2.0 ** -8, atol=atol)
        xla = np.asarray(ops._linear_xla(x, w.values, 2, groups, w.scale[2]).astype(F32))
        np.testing.assert_allclose(y, xla, rtol=2.0 ** -7, atol=atol)


def test_unrounded_inputs_against_the_widened_weight():
    # quantize_x=False (the grouped wo_a, whose input the release does not round): x as it is, the weight widened;
    # the layer's scales passed as the whole stack
    kx, kw = jax.random.split(jax.random.key(7))
    x = _x(kx, (40, 2, 256), F32, rounded=False)
    w = _w(kw, 2, 256, 256)
    y = F8.fp8_linear(x, w.values, jnp.int32(1), 2, scale=w.scale, quantize_x=False, interpret=True, block_m=32)
    ref = L.linear(x, w[1].astype(F32), 2)
    np.testing.assert_allclose(np.asarray(y), np.asarray(ref), rtol=1e-5, atol=1e-5 * float(jnp.abs(ref).max()))


def test_linear_pallas_takes_the_kernel_for_a_prefill_chunk_on_gpu(monkeypatch):
    """ops._linear_pallas as it dispatches on a GPU: a prefill chunk through FP8 weights runs the kernel
    (interpreted here) and equals the XLA form; a decode step stays with layer_linear, the grouped wo_a's unrounded
    input with XLA (unless UNROUNDED), a CPU with XLA."""
    kx, kw = jax.random.split(jax.random.key(3))
    x = _x(kx, (2, 40, 256), BF16)                                    # 80 tokens
    w = _w(kw, 3, 256, 256)
    calls = []
    kernel = F8.fp8_linear
    monkeypatch.setattr(_compat, "backend", lambda: "gpu")
    monkeypatch.setattr(F8, "fp8_tensor_cores", lambda: True)         # (this machine's device is a CPU)
    monkeypatch.setattr(F8, "fp8_linear", lambda *a, **kw: calls.append(kw) or kernel(*a, interpret=True,
                                                                                        block_m=32, **kw))
    ops._linear_pallas(x, w.values, jnp.int32(1), 1, w.scale[1])
    assert not calls                                                  # not routed before its first GPU run
    monkeypatch.setattr(F8, "ROUTED", True)
    got = ops._linear_pallas(x, w.values, jnp.int32(1), 1, w.scale[1])
    want = ops._linear_xla(x, w.values, jnp.int32(1), 1, w.scale[1])
    assert len(calls) == 1 and calls[0]["quantize_x"] and got.shape == want.shape and got.dtype == BF16
    np.testing.assert_allclose(np.asarray(got.astype(F32)), np.asarray(want.astype(F32)), rtol=2.0 ** -7,
                               atol=1e-5 * float(jnp.abs(want.astype(F32)).max()))
    from pallas_kernels import layer_linear
    assert layer_linear.supported(x[:, :32], w.values, scaled=True)   # decode sizes: the decode kernel's
    assert not F8.supported(x[:, :32], w.values)
    assert not F8.supported(x, w.values, scaled=False)                # bf16 weights: XLA
    assert not F8.supported(x, w.values.astype(BF16))
    # the grouped wo_a: its input is not rounded
    xg, wg = _x(kx, (1, 80, 2, 256), BF16, rounded=False), w                # 2 groups of 128 outputs
    want_g = ops._linear_xla(xg, wg.values, 1, 2, wg.scale[1])
    got_g = ops._linear_pallas(xg, wg.values, 1, 2, wg.scale[1])
    assert len(calls) == 1
    np.testing.assert_array_equal(np.asarray(got_g), np.asarray(want_g))
    monkeypatch.setattr(F8, "UNROUNDED", True)
    got_g = ops._linear_pallas(xg, wg.values, 1, 2, wg.scale[1])
    assert len(calls) == 2 and not calls[1]["quantize_x"]
    np.testing.assert_allclose(np.asarray(got_g.astype(F32)), np.asarray(want_g.astype(F32)), rtol=2.0 ** -7,
                               atol=1e-5 * float(jnp.abs(want_g.astype(F32)).max()))
    monkeypatch.setattr(_compat, "backend", lambda: "cpu")
    assert not F8.supported(x, w.values)


def test_supported_shapes(monkeypatch):
    monkeypatch.setattr(_compat, "backend", lambda: "gpu")
    S = jax.ShapeDtypeStruct
    w = S((43, 1024, 4096), jnp.float8_e4m3fn)
    assert not F8.fp8_tensor_cores() and not F8.supported(S((1, 8192, 4096), BF16), w)        # a CPU device
    monkeypatch.setattr(F8, "fp8_tensor_cores", lambda: True)
    assert F8.supported(S((1, 8192, 4096), BF16), w)
    assert not F8.supported(S((1, 8192, 4096), jnp.float16), w)
    assert not F8.supported(S((1, 8192, 4096), F32), w)                                          # f32 models: XLA
    assert not F8.supported(S((8192, 4000), BF16), S((43, 1024, 4000), jnp.float8_e4m3fn))       # D in 128-blocks
    assert not F8.supported(S((8192, 4096), BF16), S((43, 1000, 4096), jnp.float8_e4m3fn))       # O too
    assert not F8.supported(S((8192, 2, 4096), BF16), S((43, 192, 4096), jnp.float8_e4m3fn), 2)  # O / G too
    assert not F8.supported(S((8192, 1024), BF16), S((61, 65536, 1024), jnp.float8_e4m3fn))     # 32-bit offsets


@pytest.mark.parametrize("m,o,d,groups,quantize_x,block_n", [
    (8192, 1024, 4096, 1, True, 128),      # wq_a
    (8192, 8192, 4096, 8, True, 256),      # wo_a, rounded, per-column scales
    (8192, 8192, 4096, 8, False, 128),     # wo_a as the model feeds it
    (256, 512, 4096, 1, True, 128)])       # a short chunk's wkv: D split
def test_lowers_for_cuda_triton(m, o, d, groups, quantize_x, block_n):
    S = jax.ShapeDtypeStruct
    x = S((1, m, groups, d) if groups > 1 else (1, m, d), BF16)
    w = S((43, o, d), jnp.float8_e4m3fn)
    s = S((o // 128, d // 128), jnp.float8_e8m0fnu)
    txt = _compat.lower_for_cuda(lambda x, w, s: F8.fp8_linear(x, w, jnp.int32(5), groups, scale=s,
                                                               quantize_x=quantize_x, interpret=False,
                                                               block_n=block_n), x, w, s)
    assert txt.count("v4_fp8_matmul" if quantize_x else "v4_fp8_weight_matmul") >= 1
