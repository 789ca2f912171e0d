"""attention_impl="pallas" on a real GPU: the engine's greedy outputs equal the XLA path's (CONVENTIONS
"identical": same greedy tokens, float32 log-probs within 1e-5), with the GPU kernels actually in use.

Run on the device machine:  python -m pytest -q -m gpu tests/test_engine_gpu.py
"""
import importlib
import time

import numpy as np
import pytest

import hf_reference as H
from checkpoints import write_official_checkpoint
from pallas_kernels import _compat
from v4jax import LLM, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_compat.backend() != "gpu", reason="needs a GPU")]

SA = importlib.import_module("pallas_kernels.sparse_attention")
IX = importlib.import_module("pallas_kernels.indexer")
TK = importlib.import_module("pallas_kernels.topk")
EX = importlib.import_module("pallas_kernels.experts")
CG = importlib.import_module("pallas_kernels.compressor_gpu")
LL = importlib.import_module("pallas_kernels.layer_linear")
HP = importlib.import_module("pallas_kernels.hc_post")


def _counting(monkeypatch, module, name, counts):
    fn = getattr(module, name)

    def wrapped(*a, **kw):
        counts[name] = counts.get(name, 0) + 1
        return fn(*a, **kw)

    monkeypatch.setattr(module, name, wrapped)


def test_pallas_engine_equals_xla_on_gpu(tmp_path, monkeypatch):
    # real ratios (window 128, CSA 4 with top-16, HCA 128); prompts past 512 tokens put > 128 CSA entries in the
    # indexer rows, where the GPU top-k kernels (not the small-row fallback) select
    cfg = H.cfg_real_ratios()
    write_official_checkpoint(tmp_path, cfg, H.random_official_tensors(cfg, seed=5, include_mtp=False), fp8=False,
                              fp4_experts=False, bf16=False)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(2, cfg.vocab_size, n).tolist() for n in (1, 300, 700, 1100)]
    sp = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, logprobs=True)
    counts = {}
    # (the top-k orders a prefill chunk's candidates with one sort, a decode step's with the rank kernel)
    used = ("_sparse_attention_gpu", "_indexer_scores_gpu", "_rank_scatter", "_sort_candidates", "routed_experts",
            "_state_update", "layer_linear", "layer_linears", "hc_post", "dense_prefix_attention")
    for module, name in zip((SA, IX, TK, TK, EX, CG, LL, LL, HP, SA), used):
        _counting(monkeypatch, module, name, counts)
    outs = {}
    for impl in ("xla", "pallas"):
        t0 = time.perf_counter()
        llm = LLM(str(tmp_path), dtype="float32", max_num_seqs=4, max_model_len=1280, prefill_chunk=256,
                  attention_impl=impl)
        outs[impl] = llm.generate(prompts, sp)
        print(f"{impl}: engine built and generated in {time.perf_counter() - t0:.0f} s", flush=True)
        if impl == "xla":
            assert not counts, counts
    assert all(counts.get(n, 0) > 0 for n in used), counts
    for p, a, b in zip(prompts, outs["xla"], outs["pallas"]):
        assert a.token_ids == b.token_ids, f"prompt of {len(p)} tokens"
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)


def test_pallas_engine_equals_xla_on_gpu_fp8_cache(tmp_path, monkeypatch):
    """kv_cache_dtype="fp8": the engine with the Pallas table on the byte pools (the indexer's Triton kernel reading FP4
    keys, the sparse attention's Triton kernel on the gathered FP8 entries decoded) gives the XLA path's greedy tokens,
    every indexer call on the byte-reading kernel and every sparse-attention call on decoded rows. Log-probs
    within 1e-3, not 1e-5: each new entry is rounded to FP8, and the two paths' f32 summation orders may put a value
    on the other side of an e4m3 rounding boundary (a step of 1/16 of the value)."""
    cfg = H.cfg_real_ratios()
    write_official_checkpoint(tmp_path, cfg, H.random_official_tensors(cfg, seed=5, include_mtp=False), fp8=False,
                              fp4_experts=False, bf16=False)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(2, cfg.vocab_size, n).tolist() for n in (1, 300, 700)]
    sp = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, logprobs=True)
    calls = []
    for module, name, fmt in ((SA, "_sparse_attention_gpu", "entry_format"), (IX, "_indexer_scores_gpu", "key_format")):
        def wrapped(*a, _fn=getattr(module, name), _name=name, _fmt=fmt, **kw):
            calls.append((_name, kw.get(_fmt) is not None))
            return _fn(*a, **kw)
        monkeypatch.setattr(module, name, wrapped)
    outs = {}
    for impl in ("xla", "pallas"):
        llm = LLM(str(tmp_path), dtype="float32", max_num_seqs=4, max_model_len=1280, prefill_chunk=256,
                  attention_impl=impl, kv_cache_dtype="fp8")
        outs[impl] = llm.generate(prompts, sp)
        if impl == "xla":
            assert not calls, calls
    assert {n for n, _ in calls} == {"_indexer_scores_gpu", "_sparse_attention_gpu"}
    assert all(b == (n == "_indexer_scores_gpu") for n, b in calls)
    for p, a, b in zip(prompts, outs["xla"], outs["pallas"]):
        assert a.token_ids == b.token_ids, f"prompt of {len(p)} tokens"
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-3)


def test_second_generate_compiles_nothing():
    # JAX 0.11's Pallas fuser changed a thread-local state in jit's cache key after its first use, so a process's
    # second generate traced and compiled its prefill again (v4jax.engine.steps.pin_trace_context)
    llm = LLM("tiny", max_num_seqs=1, max_model_len=512, attention_impl="pallas")
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    first = llm.generate([[5, 6, 7, 8]], sp)
    variants = llm.engine.compiled_variants()
    t0 = time.perf_counter()
    again = llm.generate([[5, 6, 7, 8]], sp)
    assert llm.engine.compiled_variants() == variants, "the second generate compiled a step again"
    assert again[0].token_ids == first[0].token_ids
    print(f"second generate: {time.perf_counter() - t0:.3f} s")
