"""The TPU kernel of the routed experts with bf16 / f32 weights read from the layer stack in place
(pallas_kernels.experts_tpu) against the model's own maths (v4jax.model.layers.routed_experts), interpreted here,
its lowering for TPU (Mosaic) from this CPU machine, and the TPU ops table routing to it."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import _compat
from pallas_kernels import experts_tpu as K
from v4jax.model import layers as L
from v4jax.model import ops


def _stacks(n, e, i, d, dtype, seed=0):
    rng = np.random.default_rng(seed)
    return [jnp.asarray(rng.standard_normal(s) * 0.05, dtype) for s in ((n, e, i, d), (n, e, d, i), (n, e, i, d))]


# 1 x 2 pairs: a decode step's tiles; 24 x 3 past DECODE_PAIRS (lowered here to 16): a prefill chunk's tiles (of 8
# rows here), 12 pairs an expert on average, so an expert spans several tiles and a weight tile is reused
@pytest.mark.parametrize("m,k,dtype", [(1, 2, jnp.float32), (24, 3, jnp.float32), (5, 2, jnp.bfloat16)])
def test_matches_reference(m, k, dtype, monkeypatch):
    monkeypatch.setattr(K, "DECODE_PAIRS", 16)
    monkeypatch.setattr(K, "PREFILL_TILE", 8)
    n, e, i, d = 2, 6, 256, 512  # w2: two programs of 256 outputs
    w1, w2, w3 = _stacks(n, e, i, d, dtype)
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((m, d)), dtype)
    # the first pair of no expert (another shard's: weight 0)
    experts = jnp.asarray(rng.integers(0, e, (m, k)), jnp.int32).at[0, 0].set(-1)
    weights = jnp.asarray(rng.random((m, k)), jnp.float32).at[0, 0].set(0.0)
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    for layer in (0, n - 1):
        got = K.routed_experts(x, weights, experts, w1, w2, w3, 7.0, layer=jnp.int32(layer), interpret=True)
        ref = L.routed_experts(x, weights, jnp.maximum(experts, 0), w1[layer], w2[layer], w3[layer], 7.0, "gather")
        assert got.shape == (m, d) and got.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=tol, atol=tol * float(jnp.abs(ref).max()))
    other = L.routed_experts(x, weights, jnp.maximum(experts, 0), w1[0], w2[0], w3[0], 7.0, "gather")
    assert not np.allclose(np.asarray(got), np.asarray(other), rtol=1e-3)  # the layers differ


def test_the_tpu_table_takes_it_for_plain_weights_only(monkeypatch):
    called = []
    monkeypatch.setattr(K, "routed_experts", lambda *a, **kw: called.append(1) or jnp.zeros((1, 512), jnp.float32))
    w1, w2, w3 = _stacks(1, 4, 256, 512, jnp.float32)
    x, wt, ex = jnp.ones((1, 512)), jnp.ones((1, 2)), jnp.zeros((1, 2), jnp.int32)
    ops._experts_tpu(x, wt, ex, w1, w2, w3, 7.0, jnp.int32(0))
    ops._experts_tpu(x, wt, ex, w1, w2, w3, 7.0, jnp.int32(0), form="dense")  # a mesh shard's form for XLA
    assert called == [1, 1]
    ops._experts_tpu(x, wt, ex, w1, w2, w3, 7.0, jnp.int32(0), act_quant=True)  # the release's rounding: XLA's
    assert called == [1, 1]


@pytest.mark.parametrize("m,i", [(1, 2048), (32, 256), (2048, 256)])
def test_lowers_for_tpu(m, i):
    """Mosaic lowering at Flash's expert sizes, whole (I 2048) and one device's shard under tensor=8 (I 256), a
    decode step and a prefill chunk (compiled for v5e / v6e / v5p by libtpu: v4jax bench tpu-aot)."""
    A = jax.ShapeDtypeStruct
    n, e, k, d = 2, 16, 6, 4096
    args = (A((m, d), jnp.bfloat16), A((m, k), jnp.float32), A((m, k), jnp.int32),
            A((n, e, i, d), jnp.bfloat16), A((n, e, d, i), jnp.bfloat16), A((n, e, i, d), jnp.bfloat16),
            A((), jnp.int32))

    def f(x, wt, ex, w1, w2, w3, layer):
        return K.routed_experts(x, wt, ex, w1, w2, w3, 10.0, layer=layer, interpret=False)
    text = _compat.export_for_tpu(f, *args).mlir_module()
    assert text.count('kernel_name = "v4_experts_tpu"') == 3  # w1, w3, w2


@pytest.mark.slow
def test_the_model_with_it_gives_the_engines_tokens(monkeypatch):
    """The TPU table's experts (this kernel, interpreted) inside the layer loop: the default model's logits and the
    engine's greedy tokens and log-probs over a prompt and decode steps equal the XLA table's."""
    import dataclasses

    from v4jax import LLM, SamplingParams
    opts = dict(dtype="float32", max_num_seqs=2, max_model_len=256)
    sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=True)
    ids = list(range(5, 45))
    ref = LLM(**opts)
    ref_logits, ref_out = ref.logits(ids), ref.generate([ids], sp)[0]
    calls = []
    real = K.routed_experts
    monkeypatch.setattr(K, "routed_experts", lambda x, *a, **kw: calls.append(x.shape[0]) or real(x, *a, **kw))
    monkeypatch.setitem(ops.OPS, "xla", dataclasses.replace(ops.XLA, **ops.TPU_OWN))
    llm = LLM(**opts)
    np.testing.assert_allclose(llm.logits(ids), ref_logits, atol=1e-4, rtol=0)
    out = llm.generate([ids], sp)[0]
    assert 1 in calls and max(calls) > 1  # a decode step's routed experts and the prompt's
    assert out.token_ids == ref_out.token_ids
    np.testing.assert_allclose(out.logprobs, ref_out.logprobs, atol=1e-4)
