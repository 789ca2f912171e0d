"""The TPU kernel of a decode step's FP4 experts as stored (pallas_kernels.fp4_experts_tpu) against the model's
gather form on the dequantized weights with the release's rounding, interpreted here, and its lowering for TPU
(Mosaic) from this CPU machine."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import _compat
from pallas_kernels import experts_tpu
from pallas_kernels import fp4_experts_tpu as K
from v4jax.model import ops, quant


def _stacks(n, e, i, d, seed=0):
    rng = np.random.default_rng(seed)
    # rows of very different sizes: their 1 x 32 scales differ, so a wrong scale column shows
    ws = [rng.standard_normal(s) * np.exp(rng.standard_normal(s[:-1] + (1,))) * 0.05
          for s in ((n, e, i, d), (n, e, d, i), (n, e, i, d))]
    return [quant.Quantized(*quant.quantize(jnp.asarray(w, jnp.float32), "fp4"), "fp4") for w in ws]


def _w2_input(dt):
    return lambda h, w: quant.fp8_roundtrip((h * w).astype(dt), 128)


# 1 x 2 pairs: a decode step's tiles; 24 x 3 past DECODE_PAIRS (lowered here to 16): a prefill chunk's tiles (of 8
# rows here), 12 pairs an expert on average, so an expert spans several tiles. D 1024: every stack's scales have
# fewer than 128 columns (read transposed); D 4096: w1's and w3's have 128 (read as stored)
@pytest.mark.parametrize("m,k,dtype,d", [(1, 2, jnp.float32, 1024), (24, 3, jnp.bfloat16, 1024),
                                         (1, 2, jnp.float32, 4096)])
def test_matches_reference(m, k, dtype, d, monkeypatch):
    monkeypatch.setattr(experts_tpu, "DECODE_PAIRS", 16)
    monkeypatch.setattr(experts_tpu, "PREFILL_TILE", 8)
    n, e, i = 2, 6, 256  # w2: two programs of 256 outputs (D 1024), two chunks of w1's 512 code bytes
    st = _stacks(n, e, i, d)
    rng = np.random.default_rng(1)
    x = quant.fp8_roundtrip(jnp.asarray(rng.standard_normal((m, d)), dtype), 128)
    # 16 tokens over 6 experts: runs of one expert; the first pair of no expert (another shard's: weight 0)
    experts = jnp.asarray(rng.integers(0, e, (m, k)), jnp.int32).at[0, 0].set(-1)
    weights = jnp.asarray(rng.random((m, k)), jnp.float32).at[0, 0].set(0.0)
    stored = [(q.values, q.scale) for q in st]
    for layer in (0, n - 1):
        got = K.routed_experts_fp4(x, weights, experts, *stored, 7.0, _w2_input(dtype), layer=jnp.int32(layer),
                                   interpret=True)
        ref = ops._experts_xla(x, weights, experts, *st, 7.0, jnp.int32(layer), "gather", True)
        assert got.shape == (m, d) and got.dtype == jnp.float32
        # the same products (e2m1 values times powers of two, exact in bf16); only the order of the sums differs
        np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5, atol=1e-5 * float(jnp.abs(ref).max()))
    other = ops._experts_xla(x, weights, experts, *st, 7.0, jnp.int32(0), "gather", True)
    assert not np.allclose(np.asarray(got), np.asarray(other), rtol=1e-3)  # the layers differ


def test_e2m1_values():
    codes = jnp.arange(16, dtype=jnp.int32)
    want = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
    assert np.asarray(K._e2m1(codes)).tolist() == want


def test_supported():
    A = jax.ShapeDtypeStruct
    x = A((4, 1024), jnp.bfloat16)
    w1, w2 = A((2, 8, 512, 512), jnp.uint8), A((2, 8, 1024, 256), jnp.uint8)
    assert K.supported(x, w1, w2)
    assert not K.supported(A((4, 512), jnp.bfloat16), w1, w2)           # x narrower than w1's input
    assert not K.supported(x, A((2, 8, 384, 512), jnp.uint8), w2)       # 384 outputs: not whole blocks of 256


@pytest.mark.parametrize("m,i", [(1, 2048), (32, 2048), (1, 256)])
def test_lowers_for_tpu(m, i):
    """Mosaic lowering at Flash's expert sizes, whole (I 2048) and one device's shard under tensor=8 (I 256: w2's
    scales read transposed); compiled for v5e / v6e / v5p by libtpu: v4jax bench tpu-aot."""
    A = jax.ShapeDtypeStruct
    n, e, k, d = 2, 16, 6, 4096
    args = (A((m, d), jnp.bfloat16), A((m, k), jnp.float32), A((m, k), jnp.int32),
            A((n, e, i, d // 2), jnp.uint8), A((n, e, i, d // 32), quant.SCALE_DTYPE),
            A((n, e, d, i // 2), jnp.uint8), A((n, e, d, i // 32), quant.SCALE_DTYPE),
            A((n, e, i, d // 2), jnp.uint8), A((n, e, i, d // 32), quant.SCALE_DTYPE), A((), jnp.int32))

    def f(x, wt, ex, c1, s1, c2, s2, c3, s3, layer):
        return K.routed_experts_fp4(x, wt, ex, (c1, s1), (c2, s2), (c3, s3), 10.0, _w2_input(x.dtype), layer=layer,
                                    interpret=False)
    text = _compat.export_for_tpu(f, *args).mlir_module()
    assert text.count('kernel_name = "v4_fp4_experts_tpu"') == 3  # w1, w3, w2
