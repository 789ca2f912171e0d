"""attention_impl="pallas" (kernels in interpret mode on CPU) gives the XLA path's greedy outputs in the engine."""
import collections

import numpy as np
import pytest

from pallas_kernels import compressor as pallas_compressor
from pallas_kernels import experts as pallas_experts
from pallas_kernels import hc_post as pallas_hc_post
from pallas_kernels import layer_linear as pallas_linear
from v4jax import LLM, SamplingParams
from v4jax.model import layers
from v4jax.model import ops

GREEDY = dict(temperature=0.0, ignore_eos=True, logprobs=True)


@pytest.mark.slow  # minutes on CPU; -m slow
def test_pallas_engine_equals_xla(monkeypatch):
    # crosses CSA (4) and HCA (16) windows in prefill (chunks of 16 + 5 and 16 + 16 + 16 + 12 tokens) and in decode
    # (at 24, 28 and 64); every chunk compiles at 16 tokens (interpret-mode Pallas programs take ~20 s each)
    prompts = [[3, 4, 5] * 7, [9] * 60]
    sp = SamplingParams(max_tokens=10, **GREEDY)
    experts_calls = []  # tokens of each routed-experts kernel call, at trace time
    real = pallas_experts.routed_experts
    monkeypatch.setattr(pallas_experts, "routed_experts",
                        lambda x, *a, **kw: experts_calls.append(x.shape[0]) or real(x, *a, **kw))
    linear_calls = []  # (tokens, weight stack shape) of each layer-linear kernel call
    real_linear = pallas_linear.layer_linear
    monkeypatch.setattr(pallas_linear, "layer_linear", lambda x, w, *a, **kw: linear_calls.append(
        (x.size // x.shape[-1], w.shape)) or real_linear(x, w, *a, **kw))
    group_calls = []  # (tokens, number of weights) of each projections-of-one-input call
    real_group = pallas_linear.layer_linears
    monkeypatch.setattr(pallas_linear, "layer_linears", lambda x, ws, *a, **kw: group_calls.append(
        (x.size // x.shape[-1], len(ws))) or real_group(x, ws, *a, **kw))
    hc_post_tokens = []  # (tokens, f as partial sums [S, M, D]) of each call
    real_hc_post = pallas_hc_post.hc_post
    monkeypatch.setattr(pallas_hc_post, "hc_post", lambda f, *a, **kw: hc_post_tokens.append(
        (f.shape[-2], f.ndim == 3)) or real_hc_post(f, *a, **kw))
    # the GPU's decode path for the compressors (pallas_kernels.compressor_gpu on the state stacks, fed the
    # projections of the attention input's one launch), interpreted; the CPU's own kernel: the next tests
    monkeypatch.setattr(ops, "_backend", lambda: "gpu")
    outs = {}
    for impl in ("xla", "pallas"):
        # tests/test_engine.py's tiny engine options: in one run the XLA engine's programs come from the persistent
        # compilation cache
        llm = LLM("tiny", dtype="float32", max_num_seqs=4, max_model_len=256, prefill_chunk=16, decode_steps=4,
                  attention_impl=impl)
        outs[impl] = llm.generate(prompts, sp)
        assert bool(experts_calls) == bool(linear_calls) == (impl == "pallas")
    # decode calls run the slots up to the highest busy one, in powers of two: two requests, two rows
    assert 2 in experts_calls and 4 not in experts_calls
    # the decode step's projections read the weight stacks (prefill chunks of 16 tokens too)
    assert {m for m, _ in linear_calls} >= {2, 16} and all(len(shape) == 3 for _, shape in linear_calls)
    # ... and, per layer kind, every projection of the attention input in one launch (sliding: wq_a, wkv; HCA: and
    # its compressor's two; CSA: and the indexer's compressor's two and weights_proj), the shared expert's w1 / w3
    # in one
    assert {(2, n) for n in (2, 4, 7)} <= set(group_calls) <= {(m, n) for m in (1, 2, 16) for n in (2, 4, 7)}
    assert {2, 16} <= {m for m, _ in hc_post_tokens}  # mHC's expansion: decode's two rows, a chunk's 16
    assert (2, True) in hc_post_tokens  # decode's attention output as wo_b's partial sums, added in the kernel
    for a, b in zip(outs["xla"], outs["pallas"]):
        assert a.token_ids == b.token_ids
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)


@pytest.fixture(scope="module")
def window_crossing_runs():
    """Both impls on prompts of 61, 43, 1 and 34 tokens in prefill chunks of 7 (not a multiple of 4 or 16: the
    last chunks hold 5, 1 (a one-token chunk), 1 and 6 tokens), then 18 decode tokens, so CSA (4) and HCA (16)
    windows close inside chunks, across chunk edges and in decode. Two slots: the last two prompts reuse a slot,
    whose compressor state must start empty. Counts, per impl, the calls (at trace time) of the compressor
    kernels, keyed by kernel and number of rows (a decode call runs slots 0..1 while slot 1 decodes, prefill one),
    and of the XLA compressor."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(2, 500, n).tolist() for n in (61, 43, 1, 34)]
    sp = SamplingParams(max_tokens=18, **GREEDY)
    calls = collections.Counter()

    def counted(name, fn):
        def wrapper(x, *args, **kwargs):
            calls[name, x.shape[0]] += 1
            return fn(x, *args, **kwargs)
        return wrapper

    outs, counts = {}, {}
    with pytest.MonkeyPatch.context() as mp:
        for name in ("compressor_decode", "compressor_prefill"):
            mp.setattr(pallas_compressor, name, counted(name, getattr(pallas_compressor, name)))
        mp.setattr(layers, "compress_chunk", counted("compress_chunk", layers.compress_chunk))
        for impl in ("xla", "pallas"):
            calls.clear()
            llm = LLM("tiny", dtype="float32", max_num_seqs=2, max_model_len=128, prefill_chunk=7, decode_steps=4,
                      attention_impl=impl)
            outs[impl] = llm.generate(prompts, sp)
            counts[impl] = dict(calls)
    return outs, counts


@pytest.mark.slow  # with the next test ~70 s; the kernels across windows: tests/test_kernels_compressor.py
@pytest.mark.slow  # minutes on CPU; -m slow
def test_pallas_engine_calls_compressor_kernels(window_crossing_runs):
    _, counts = window_crossing_runs
    xla, pallas = counts["xla"], counts["pallas"]
    assert sum(n for (name, _), n in xla.items() if name == "compress_chunk") > 0  # the counter sees the XLA path
    assert not any(name.startswith("compressor_") for name, _ in xla)
    assert pallas.get(("compressor_decode", 2), 0) > 0, pallas  # decode steps
    assert pallas.get(("compressor_prefill", 1), 0) > 0, pallas  # prefill chunks (a one-token chunk is padded
    # to the shortest compiled chunk, MIN_CHUNK_BUCKET tokens, so it runs the prefill kernel too)
    assert not any(name == "compress_chunk" for name, _ in pallas), pallas  # no XLA compressor left


@pytest.mark.slow
@pytest.mark.slow  # minutes on CPU; -m slow
def test_pallas_engine_equals_xla_across_windows(window_crossing_runs):
    outs, _ = window_crossing_runs
    for a, b in zip(outs["xla"], outs["pallas"]):
        assert len(a.token_ids) == 18
        assert a.token_ids == b.token_ids
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)


def test_the_pallas_table_per_backend():
    # resolved once per forward pass, no backend branch inside an entry: on a GPU compress also takes the GPU decode
    # kernel; on a TPU the entries whose kernels are written for Triton are the XLA table's, and say so
    assert ops.ops_for("xla", "gpu") is ops.ops_for("xla", "tpu") is ops.XLA
    assert ops.ops_for("pallas", "cpu") is ops.PALLAS and not ops.PALLAS.from_xla
    gpu = ops.ops_for("pallas", "gpu")
    assert gpu.compress is not ops.PALLAS.compress and gpu.experts is ops.PALLAS.experts
    tpu = ops.ops_for("pallas", "tpu")
    assert tpu.from_xla == ("project", "hc_post", "hc_collapse")
    assert all(getattr(tpu, name) is getattr(ops.XLA, name) for name in tpu.from_xla)
    # weights as stored: the TPU's own kernels (XLA's forms for the rest)
    assert tpu.linear is ops._linear_tpu and tpu.experts is ops._experts_tpu
    assert tpu.compress is ops.PALLAS.compress and tpu.attend is ops.PALLAS.attend and tpu.per_shard
    with pytest.raises(ValueError, match="attention_impl"):
        ops.ops_for("triton")


def test_a_table_that_cannot_run_here_says_so_when_the_engine_is_built(monkeypatch):
    """On a TPU the Pallas table's Triton-only entries are the XLA table's: building the engine says which."""
    monkeypatch.setattr(ops, "_backend", lambda: "tpu")
    assert ops.ops_for("pallas").from_xla == ("project", "hc_post", "hc_collapse") and not ops.ops_for("xla").from_xla
    llm = LLM("tiny", dtype="float32", max_model_len=64, max_num_seqs=2, attention_impl="pallas")
    with pytest.warns(UserWarning, match="project, hc_post, hc_collapse run as the XLA table's"):
        llm.engine


@pytest.mark.parametrize("quantization,kv_cache_dtype", [("none", "auto"), ("fp8", "fp8")])
def test_engine_steps_lower_for_cuda_with_every_triton_module_verified(monkeypatch, quantization, kv_cache_dtype):
    """The engine's decode and prefill steps on the Pallas table, as a GPU traces them (the GPU's kernels, their Triton
    modules through the verifier the GPU runs before compiling: `_compat.lower_for_cuda`), lowered here. A kernel
    that lowered in interpret mode and in its own test's shapes once failed only on the GPU, inside the top-k's
    overflow path that the engine's decode step reaches."""
    import re

    from pallas_kernels import _compat
    from v4jax.bench.tpu_aot import engine_steps
    eng = LLM("tiny", dtype="bfloat16", max_num_seqs=4, max_model_len=512, prefill_chunk=64, attention_impl="pallas",
              quantization=quantization, kv_cache_dtype=kv_cache_dtype).engine
    monkeypatch.setattr(_compat, "backend", lambda: "gpu")
    kernels = set()
    for step, args in engine_steps(eng, 64).values():
        kernels |= set(re.findall(r'name = "(v4_[a-z_0-9]+)"', _compat.lower_for_cuda(step, *args)))
    experts = ("v4_experts_up_fp4", "v4_experts_down_fp4") if quantization == "fp8" else ("v4_experts_up",
                                                                                           "v4_experts_down")
    want = {"v4_sparse_attention_gpu", "v4_dense_prefix_attention_gpu", "v4_indexer_scores_gpu",
            "v4_topk_redo_overflow", "v4_compressor_state_gpu", "v4_hc_weights", "v4_hc_post", *experts}
    assert want <= kernels, sorted(kernels)
