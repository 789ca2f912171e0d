"""The prefill experts' grouped form (pallas_kernels.experts_grouped) around its matmul: sort, gather, SwiGLU,
combine, the layer stack and pairs of no expert, against the model's dense form. On CPU the grouped matmul is
XLA's ragged dot; the Mosaic-GPU kernel itself: tests/test_kernels_gpu.py (-m gpu)."""
import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import experts_grouped as G
from v4jax.model import layers as L


def xla_grouped(rows, w, sizes):
    return jax.lax.ragged_dot(rows, jnp.swapaxes(w, 1, 2), sizes).astype(rows.dtype)


def test_grouped_experts_match_the_dense_form_on_a_layer_stack():
    M, k, E, I, D, n = 96, 3, 8, 32, 64, 3
    ks = jax.random.split(jax.random.key(1), 6)
    x = jax.random.normal(ks[0], (M, D), jnp.float32)
    w1, w3 = (0.2 * jax.random.normal(kk, (n, E, I, D)) for kk in ks[1:3])
    w2 = 0.2 * jax.random.normal(ks[3], (n, E, D, I))
    w, ex = jax.lax.top_k(jax.random.normal(ks[4], (M, E)) + 3.0 * jax.random.normal(ks[5], (E,)), k)
    w = jax.nn.softmax(w)
    ex = ex.at[::7, 1].set(-1)  # pairs of no expert (another shard's) add nothing
    got = jax.jit(lambda *a: G.routed_experts(*a, 1.5, layer=2, matmul=xla_grouped))(x, w, ex, w1, w2, w3)
    ref = L.routed_experts(x, jnp.where(ex >= 0, w, 0.0), jnp.maximum(ex, 0), w1[2], w2[2], w3[2], 1.5, "dense")
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=2e-5, atol=2e-5)


def test_grouped_experts_are_not_chosen_off_hopper():
    x, w1 = jnp.zeros((1024, 4096), jnp.bfloat16), jnp.zeros((16, 2048, 4096), jnp.bfloat16)
    assert not G.supported(x, w1)  # the CPU backend


def test_the_pallas_ops_take_the_grouped_form_for_a_prefill_chunk(monkeypatch):
    from v4jax.model import ops
    calls = []

    def matmul(rows, w, sizes, blocks=G.BLOCKS):
        calls.append(rows.shape)
        return xla_grouped(rows, w, sizes)

    monkeypatch.setattr(G, "supported", lambda x, w1: x.shape[0] >= 64)
    monkeypatch.setattr(G, "grouped_matmul", matmul)
    M, k, E, I, D, n = 96, 2, 4, 16, 32, 2  # past the decode kernel's 64 tokens
    ks = jax.random.split(jax.random.key(2), 5)
    x = jax.random.normal(ks[0], (M, D))
    w1, w3 = (0.3 * jax.random.normal(kk, (n, E, I, D)) for kk in ks[1:3])
    w2 = 0.3 * jax.random.normal(ks[3], (n, E, D, I))
    w, ex = jax.lax.top_k(jax.random.normal(ks[4], (M, E)), k)
    got = ops.OPS["pallas"].experts(x, w, ex, w1, w2, w3, 2.0, 1)
    ref = ops.OPS["xla"].experts(x, w, ex, w1, w2, w3, 2.0, 1)
    assert len(calls) == 3  # up, gate, down
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=2e-5, atol=2e-5)


def test_experts_as_stored_take_the_grouped_form_with_the_release_rounding(monkeypatch):
    """A prefill chunk through FP4 experts as stored, with the release's rounding (w2's input the routing weight
    times the SwiGLU, rounded to FP8; the outputs summed unweighted): the pallas ops widen the layer's experts and
    run the grouped matmul, equal to the XLA form."""
    from v4jax.model import ops, quant
    calls = []

    def matmul(rows, w, sizes, blocks=G.BLOCKS):
        calls.append(rows.shape)
        return xla_grouped(rows, w, sizes)

    monkeypatch.setattr(G, "supported", lambda x, w1: x.shape[0] >= 64 and w1.dtype == x.dtype)
    monkeypatch.setattr(G, "grouped_matmul", matmul)
    M, k, E, I, D, n = 96, 2, 4, 64, 64, 2
    ks = jax.random.split(jax.random.key(4), 5)
    x = quant.fp8_roundtrip(jax.random.normal(ks[0], (M, D)), 128)     # the release rounds the experts' input
    w1, w3 = (quant.Quantized(*quant.quantize(0.3 * jax.random.normal(kk, (n, E, I, D)), "fp4"), "fp4")
              for kk in ks[1:3])
    w2 = quant.Quantized(*quant.quantize(0.3 * jax.random.normal(ks[3], (n, E, D, I)), "fp4"), "fp4")
    w, ex = jax.lax.top_k(jax.random.normal(ks[4], (M, E)), k)
    w = jax.nn.softmax(w)
    ex = ex.at[::5, 1].set(-1)  # pairs of no expert (another shard's: weight 0)
    w = jnp.where(ex >= 0, w, 0.0)
    got = ops.OPS["pallas"].experts(x, w, ex, w1, w2, w3, 2.0, 1, act_quant=True)
    ref = ops.OPS["xla"].experts(x, w, ex, w1, w2, w3, 2.0, 1, act_quant=True)
    assert len(calls) == 3  # up, gate, down
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5, atol=1e-5)
