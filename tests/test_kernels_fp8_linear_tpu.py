"""The TPU kernel of FP8 linears as stored (pallas_kernels.fp8_linear_tpu) against the jnp reference (the weight
dequantized, then L.linear), interpreted here, and its lowering for TPU (Mosaic) from this CPU machine."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import _compat
from pallas_kernels import fp8_linear_tpu as K
from v4jax.model import layers as L
from v4jax.model import quant


def _case(n, o, d, m, groups, dtype, seed=0):
    rng = np.random.default_rng(seed)
    # rows of very different sizes, so that the blocks' scales differ (a wrong scale or block shows)
    w = rng.standard_normal((n, o, d)) * np.exp(rng.standard_normal((n, o, 1)) * 2) * 0.05
    values, scale = quant.quantize(jnp.asarray(w, jnp.float32), "fp8")
    x = jnp.asarray(rng.standard_normal((m, groups, d) if groups > 1 else (m, d)), dtype)
    return x, values, scale


@pytest.mark.parametrize("n,o,d,m,groups,dtype,tile", [
    (3, 256, 384, 1, 1, jnp.bfloat16, 1 << 20),    # one program's tile over all outputs
    (3, 512, 256, 5, 1, jnp.float32, 128 * 256),   # 4 programs of 128 outputs
    (2, 1024, 256, 3, 4, jnp.bfloat16, 128 * 256),  # groups: each program's x columns are its group's
    (2, 384, 128, 300, 1, jnp.bfloat16, 1 << 20),  # a prefill chunk: row tiles of 256, the last one padded
])
def test_matches_reference(n, o, d, m, groups, dtype, tile):
    x, values, scale = _case(n, o, d, m, groups, dtype)
    for layer in (0, n - 1):
        got = K.fp8_linear(x, values, jnp.int32(layer), groups, scale=scale[layer], tile_bytes=tile, interpret=True)
        ref = L.linear(x.astype(jnp.float32), quant.Quantized(values[layer], scale[layer], "fp8"), groups)
        assert got.shape == ref.shape and got.dtype == jnp.float32
        # the same products; only the order of the f32 sums differs
        np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5, atol=1e-5 * float(jnp.abs(ref).max()))
    # a wrong layer would not pass: the layers' weights differ
    other = L.linear(x.astype(jnp.float32), quant.Quantized(values[0], scale[0], "fp8"), groups)
    assert not np.allclose(np.asarray(got), np.asarray(other), rtol=1e-3)


def test_block_out():
    assert K.block_out(32768, 1024) == 1024       # 1 MB of e4m3 a tile
    assert K.block_out(1024, 8192) == 128         # never under one scale block
    assert K.block_out(384, 1024) == 384
    assert K.block_out(640, 2048) == 128          # 512 does not divide 640: the largest 128-multiple that does


def test_supported():
    w = jax.ShapeDtypeStruct((2, 256, 384), K.E4M3)
    x = jax.ShapeDtypeStruct((3, 384), jnp.bfloat16)
    assert K.supported(x, w)
    assert not K.supported(x, jax.ShapeDtypeStruct((2, 200, 384), K.E4M3))       # outputs not whole blocks
    assert not K.supported(x, jax.ShapeDtypeStruct((2, 256, 384), jnp.bfloat16))  # not stored FP8
    assert K.supported(jax.ShapeDtypeStruct((3, 2, 384), jnp.bfloat16), w, groups=2)
    assert not K.supported(jax.ShapeDtypeStruct((3, 2, 384), jnp.bfloat16), w, groups=4)  # 64 outputs a group


@pytest.mark.parametrize("m,groups", [(1, 1), (32, 8), (512, 1)])
def test_lowers_for_tpu(m, groups):
    """Mosaic lowering at a Flash projection's width (compiled for v5e / v6e / v5p by libtpu: v4jax bench tpu-aot)."""
    o, d = 8192, 1024
    args = (jax.ShapeDtypeStruct((m, groups, d) if groups > 1 else (m, d), jnp.bfloat16),
            jax.ShapeDtypeStruct((4, o, d), K.E4M3), jax.ShapeDtypeStruct((o // 128, d // 128), quant.SCALE_DTYPE),
            jax.ShapeDtypeStruct((), jnp.int32))
    exported = _compat.export_for_tpu(
        lambda x, w, s, layer: K.fp8_linear(x, w, layer, groups, scale=s, interpret=False), *args)
    text = exported.mlir_module()
    assert "tpu_custom_call" in text and "v4_fp8_linear_tpu" in text
