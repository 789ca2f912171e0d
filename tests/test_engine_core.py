"""EngineCore: every request completes whatever the batch, lengths, chunking and pool budget; the prefix cache is
exact (tokens identical, log-probs within 1e-5 in float32) at every kind of boundary, after eviction and after
tombstoning; randomised adds, aborts, preemptions and evictions leave every page free and every refcount zero."""
import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

import hf_reference as H
from checkpoints import write_official_checkpoint
from sharding import parse_mesh_spec
from v4jax import LLM, SamplingParams
from v4jax.api import EngineOptions
from v4jax.config import CSA, HCA, preset
from v4jax.cache.layout import pool_layout

GREEDY = dict(temperature=0.0, ignore_eos=True, logprobs=True)


def _prompts(lens, vocab, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(2, vocab, n).tolist() for n in lens]


def _check_refcounts(core):
    """Every page's refcount is the number of slots mapping it plus one if the prefix tree holds it."""
    core.kv.check()


def _all_free(core):
    core.kv.reset_prefix_cache()
    core.kv.check()
    return (core.kv.all_free() and all(s is None for s in core.scheduler.slots) and not core.scheduler.requests)


# ---- every request completes ----------------------------------------------------------------------------
MAX_LEN = 520
LENS = (1, 9, 255, 256, 257, MAX_LEN - 1, 400, 130)


def _sweep_params(lens):
    return [SamplingParams(max_tokens=min(12, MAX_LEN - n), **GREEDY) for n in lens]


# chunk 7 (many chunks per prompt), 1, 256 and 2048 (whole prompts, batched prefill rows): -m slow (minutes on CPU)
@pytest.mark.parametrize("chunk", [pytest.param(c, marks=pytest.mark.slow) for c in (1, 7, 256, 2048)])
def test_every_request_completes_and_equals_alone(chunk):
    """More requests than slots, prompts up to max_model_len - 1, chunks 1 / 7 / 256 / 2048: every request
    completes with the greedy tokens it gets when run alone."""
    llm = LLM("tiny", dtype="float32", max_num_seqs=3, max_model_len=MAX_LEN, prefill_chunk=chunk,
              enable_prefix_caching=False)
    prompts = _prompts(LENS, llm.config.vocab_size, seed=1)
    params = _sweep_params(LENS)
    outs = llm.generate(prompts, params)
    for p, sp, o in zip(prompts, params, outs):
        assert len(o.token_ids) == sp.max_tokens and o.finish_reason == "length"
        alone = llm.generate([p], [sp])[0]
        assert alone.token_ids == o.token_ids
        np.testing.assert_allclose(alone.logprobs, o.logprobs, atol=1e-5)
    assert _all_free(llm.engine)


def _budget_for_pages(llm, n_pages):
    """The smallest memory_budget_bytes for which the engine sizes its pools to n_pages full pages."""
    core = llm.engine
    lo, hi = 1, 1 << 40
    while lo < hi:
        mid = (lo + hi) // 2
        try:
            got = pool_layout(core.cfg, dataclasses.replace(core.options, memory_budget_bytes=mid), core.dtype,
                              core.max_model_len).n_pages
        except ValueError:
            got = 0
        lo, hi = (mid + 1, hi) if got < n_pages else (lo, mid)
    return lo


@pytest.mark.parametrize("mesh", [None, "data=2", "data=2,context=2,tensor=2"])
@pytest.mark.parametrize("caching", [False, True])
def test_budget_for_pages_is_what_the_engine_allocates(mesh, caching):
    """replay's budget_for_pages inverts the engine's sizing, over data / context shards too (each data shard's
    own window pages are fixed cost; full pages come in whole tiles of every block)."""
    from v4jax.bench.replay import budget_for_pages
    cfg = preset("tiny")
    opts = EngineOptions(max_num_seqs=4, max_model_len=256, enable_prefix_caching=caching, mesh=mesh)
    shards = parse_mesh_spec(mesh)
    n_data, n_ctx = shards.get("data", 1), shards.get("context", 1)
    for want in (8, 40):
        budget = budget_for_pages(cfg, opts, 256, jnp.float32, want)
        lay = pool_layout(cfg, dataclasses.replace(opts, memory_budget_bytes=budget), jnp.float32, 256, n_data,
                          n_ctx)
        assert lay.n_pages == want and lay.data_shards == n_data
        short = pool_layout(cfg, dataclasses.replace(opts, memory_budget_bytes=budget - 1), jnp.float32, 256,
                            n_data, n_ctx)
        assert short.n_pages < want


@pytest.mark.slow  # ~60 s; the randomised test below also runs budgets that queue and preempt
@pytest.mark.parametrize("caching", [False, True])
def test_budget_for_two_long_requests_queues_or_preempts(caching):
    """Pools that hold two long requests: four of them (and short ones) still complete, by queueing or
    preemption, with the tokens they get alone."""
    lens = (500, 480, 20, 510, 3, 490)
    ref_llm = LLM("tiny", dtype="float32", max_num_seqs=4, max_model_len=MAX_LEN, prefill_chunk=64,
                  enable_prefix_caching=False)
    prompts = _prompts(lens, ref_llm.config.vocab_size, seed=2)
    params = [SamplingParams(max_tokens=10, **GREEDY) for _ in lens]
    alone = [ref_llm.generate([p], [sp])[0] for p, sp in zip(prompts, params)]
    budget = _budget_for_pages(LLM("tiny", dtype="float32", max_num_seqs=4, max_model_len=MAX_LEN,
                                   prefill_chunk=64, enable_prefix_caching=caching), 4)
    llm = LLM("tiny", dtype="float32", max_num_seqs=4, max_model_len=MAX_LEN, prefill_chunk=64,
              enable_prefix_caching=caching, memory_budget_bytes=budget)
    assert llm.engine.layout.n_pages == 4
    outs = llm.generate(prompts, params)
    for a, o in zip(alone, outs):
        assert o.token_ids == a.token_ids
        np.testing.assert_allclose(o.logprobs, a.logprobs, atol=1e-5)
    st = llm.stats()
    assert st["requests"]["finished"] == len(lens)
    assert st["requests"]["preempted"] > 0 or max(v["used"] for v in st["pools"].values()) <= 4
    assert _all_free(llm.engine)


def test_request_that_cannot_fit_alone_is_refused_others_go_on():
    llm = LLM("tiny", dtype="float32", max_num_seqs=2, max_model_len=2048, prefill_chunk=64)
    budget = _budget_for_pages(llm, 2)
    llm = LLM("tiny", dtype="float32", max_num_seqs=2, max_model_len=2048, prefill_chunk=64,
              memory_budget_bytes=budget)
    core = llm.engine
    core.add_request("small", [5, 6, 7], SamplingParams(max_tokens=4, **GREEDY))
    ids = lambda n: [2 + i % 500 for i in range(n)]  # inside tiny's vocabulary (the engine checks it too)
    with pytest.raises(ValueError, match="pages"):
        core.add_request("huge", ids(998), SamplingParams(max_tokens=4, **GREEDY))
    with pytest.raises(ValueError, match="max_model_len"):
        core.add_request("long", ids(2038), SamplingParams(max_tokens=16, **GREEDY))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        core.add_request("oov", [5, 512], SamplingParams(max_tokens=4, **GREEDY))
    got = []
    while core.has_unfinished_requests():
        got += core.step()
    assert [d.request_id for d in got] == ["small"] * len(got) and got[-1].finish_reason == "length"
    assert sum(len(d.new_token_ids) for d in got) == 4
    assert llm.stats()["requests"]["rejected"] == 3


def test_abort_returns_pages_and_reports():
    """A running request aborted while its decode call is in flight and a waiting one: both report "abort", the
    others run to their length, and every page is free. (tests/test_engine.py's tiny engine options: in one run
    its programs come from the persistent compilation cache.)"""
    llm = LLM("tiny", dtype="float32", max_num_seqs=4, max_model_len=256, prefill_chunk=16, decode_steps=4)
    core = llm.engine
    sp = SamplingParams(max_tokens=100, **GREEDY)
    for i, p in enumerate(_prompts((100, 40, 20, 10, 150), llm.config.vocab_size)):
        core.add_request(f"r{i}", p, sp)
    for _ in range(40):  # r0's 7 prefill chunks, then its first decode call (dispatched, not yet read)
        core.step()
        if core._flight is not None:
            break
    sch = core.scheduler
    assert sch.requests["r0"].status == "running" and core._flight is not None
    assert [r.request_id for r in sch.waiting] == ["r4"]  # four slots
    assert core.abort("r0") and core.abort("r4") and not core.abort("nope")
    reasons = {}
    while core.has_unfinished_requests():
        for d in core.step():
            if d.finish_reason:
                reasons[d.request_id] = d.finish_reason
    assert reasons == {"r0": "abort", "r1": "length", "r2": "length", "r3": "length", "r4": "abort"}
    assert llm.stats()["requests"]["aborted"] == 2
    assert _all_free(core)


# ---- the prefix cache is exact -------------------------------------------------------------------------
def _write_ckpt(d, cfg) -> str:
    write_official_checkpoint(d, cfg, H.random_official_tensors(cfg, seed=7, include_mtp=False), fp8=False,
                              fp4_experts=False, bf16=False)
    return str(d)


@pytest.fixture(scope="module")
def real_ckpt(tmp_path_factory):
    """Window 128, CSA 4 with a binding top-16, HCA 128, random weights, float32."""
    return _write_ckpt(tmp_path_factory.mktemp("real_prefix"), H.cfg_real_ratios())


@pytest.fixture(scope="module")
def csa_hca_ckpt(tmp_path_factory):
    """cfg_real_ratios' attention (window 128, CSA 4 with a binding top-16, HCA 128) on two layers, a CSA and an HCA
    one: every state a cached page resumes from (window pages, C4 entries and indexer keys, C128 entries, both
    compressors' partial windows), at half the four layers' compile time. (A sliding layer holds window pages only;
    a stack of two layers of one kind resuming from a prefix hit: tests/test_disagg.py's export test, tiny.)"""
    cfg = dataclasses.replace(H.cfg_real_ratios(), n_layers=2, layer_types=(CSA, HCA), compress_ratios=(4, 128),
                              n_hash_layers=0)
    return _write_ckpt(tmp_path_factory.mktemp("csa_hca_prefix"), cfg)


# shared-prefix lengths: on a page boundary (256, 512) and inside a page, every residue mod 4, residues
# 0, 1, 2, 3, 64, 127 mod 128
SHARED = (256, 257, 258, 259, 320, 383, 512, 515)
# Each variant adds 129 new tokens after its shared prefix: whatever its hit (256 or 512), the rest of its prompt
# (129 to 256 tokens) is one prefill chunk of the full 256-token length, so every prefill compiles a 256-token
# chunk (about 6 s a program on CPU; 1, 2 and 4 pages of table) and the decode calls 2 and 4 pages of table.
NEW_TOKENS = 129


def _variants(base, vocab, seed=3):
    rng = np.random.default_rng(seed)
    return [base[:n] + rng.integers(2, vocab, NEW_TOKENS).tolist() for n in SHARED]


def _same(a, b):
    for x, y in zip(a, b):
        assert x.token_ids == y.token_ids
        np.testing.assert_allclose(x.logprobs, y.logprobs, atol=1e-5)


def test_prefix_cache_exact(csa_hca_ckpt):
    opts = dict(dtype="float32", max_num_seqs=4, max_model_len=1200, prefill_chunk=256)
    cold = LLM(csa_hca_ckpt, enable_prefix_caching=False, **opts)
    warm = LLM(csa_hca_ckpt, **opts)
    vocab = cold.config.vocab_size
    base = _prompts((700,), vocab, seed=4)[0]
    variants = _variants(base, vocab)
    sp = SamplingParams(max_tokens=4, **GREEDY)
    want_base = cold.generate([base], sp)
    want = cold.generate(variants, sp)
    _same(warm.generate([base], sp), want_base)
    assert warm.stats()["prefix_cache"]["hit_tokens"] == 0
    st0 = warm.stats()["prefix_cache"]
    for v, w in zip(variants, want):  # one at a time: each one's hit is the base's pages
        before = warm.stats()["prefix_cache"]["hit_tokens"]
        _same(warm.generate([v], sp), [w])
        hit = warm.stats()["prefix_cache"]["hit_tokens"] - before
        shared = next(n for n in SHARED if v[:n] == base[:n] and v[n] != base[n])
        assert hit == shared // 256 * 256, (shared, hit)
    st = warm.stats()["prefix_cache"]
    assert st["queried_tokens"] - st0["queried_tokens"] == sum(map(len, variants))

    # a repeat of the base reuses its two full pages; its last page (512..699) is recomputed
    before = warm.stats()["prefix_cache"]["hit_tokens"]
    _same(warm.generate([base], sp), want_base)
    assert warm.stats()["prefix_cache"]["hit_tokens"] - before == 512

    # tombstones: drop the tail of the first page; a match ending there backs off, deeper ones still hit
    pc = warm.engine.kv._prefix
    node = pc.root
    for _ in range(1):
        node = next(c for c in node.children.values() if c.tokens == tuple(base[node.depth * 256:(node.depth + 1) * 256]))
        if node.tail is not None:
            pc.drop_tail(node)
    st = warm.stats()
    assert st["requests"]["recomputed_tokens"] == 0  # every cached page so far was resumable
    assert st["prefix_cache"]["reused_pages"] * 256 == st["prefix_cache"]["hit_tokens"]
    before = warm.stats()["prefix_cache"]["hit_tokens"]
    _same(warm.generate([variants[SHARED.index(383)]], sp), [want[SHARED.index(383)]])
    assert warm.stats()["prefix_cache"]["hit_tokens"] == before  # 256 is a tombstone: a cold start
    assert warm.stats()["requests"]["recomputed_tokens"] == 256  # the cached page it could not resume after
    _same(warm.generate([variants[SHARED.index(515)]], sp), [want[SHARED.index(515)]])
    assert warm.stats()["prefix_cache"]["hit_tokens"] - before == 512  # through the tombstone
    assert warm.stats()["requests"]["recomputed_tokens"] == 256
    assert warm.stats()["prefix_cache"]["tombstoned_tails"] >= 1

    # eviction: everything the tree holds goes; the same prompts run cold and give the same results
    pc.evict_full(warm.engine.layout.n_pages)
    assert pc.n_nodes() == 0
    _same(warm.generate(variants[:4], sp), want[:4])
    assert _all_free(warm.engine)


def test_prefix_cache_resumes_inside_a_long_chunk(csa_hca_ckpt):
    """A prompt prefilled in chunks that span several pages (the default chunk is 2048 tokens, a page 256) can be
    resumed at every page boundary inside them, not only where a chunk ended: a shared prefix of any length hits
    its full pages, exactly."""
    opts = dict(dtype="float32", max_num_seqs=2, max_model_len=1400, prefill_chunk=1024)
    cold = LLM(csa_hca_ckpt, enable_prefix_caching=False, **opts)
    warm = LLM(csa_hca_ckpt, **opts)
    vocab = cold.config.vocab_size
    base = _prompts((1100,), vocab, seed=5)[0]  # chunks [0, 1024) (boundaries 256, 512, 768 inside) and [1024, 1100)
    rng = np.random.default_rng(6)
    shared = (300, 600, 900, 1030)
    variants = [base[:n] + rng.integers(2, vocab, 60).tolist() for n in shared]
    sp = SamplingParams(max_tokens=4, **GREEDY)
    want = cold.generate(variants, sp)
    warm.generate([base], sp)
    for v, w, n in zip(variants, want, shared):
        before = warm.stats()["prefix_cache"]["hit_tokens"]
        _same(warm.generate([v], sp), [w])
        assert warm.stats()["prefix_cache"]["hit_tokens"] - before == n // 256 * 256, n
    assert warm.stats()["requests"]["recomputed_tokens"] == 0
    assert _all_free(warm.engine)


@pytest.mark.slow  # ~55 s; test_prefix_cache_exact covers every boundary kind in the default run
def test_prefix_cache_exact_with_decoded_pages_and_small_budget(real_ckpt):
    """A second turn reuses pages the first turn's decode wrote (boundary states saved by the decode loop),
    under a budget small enough that the tree evicts between requests."""
    opts = dict(dtype="float32", max_num_seqs=2, max_model_len=1024, prefill_chunk=128)
    cold = LLM(real_ckpt, enable_prefix_caching=False, **opts)
    vocab = cold.config.vocab_size
    first = _prompts((200,), vocab, seed=8)[0]
    sp1 = SamplingParams(max_tokens=90, **GREEDY)   # decodes across the 256 boundary
    turn1 = cold.generate([first], sp1)[0]
    second = first + turn1.token_ids + _prompts((30,), vocab, seed=9)[0]
    sp2 = SamplingParams(max_tokens=5, **GREEDY)
    want = cold.generate([second], sp2)[0]
    warm = LLM(real_ckpt, **opts)
    budget = _budget_for_pages(warm, 4)  # (full pages come in whole TPU tiles: 4 here, so 6 would be 8)
    warm = LLM(real_ckpt, memory_budget_bytes=budget, **opts)
    assert warm.engine.layout.n_pages == 4  # one of the 900-token prompts fills it: the conversation is evicted
    _same([warm.generate([first], sp1)[0]], [turn1])
    before = warm.stats()["prefix_cache"]["hit_tokens"]
    _same([warm.generate([second], sp2)[0]], [want])
    assert warm.stats()["prefix_cache"]["hit_tokens"] - before == 256
    # other traffic evicts the conversation; it still runs exactly
    others = _prompts((900, 800), vocab, seed=10)
    warm.generate(others, SamplingParams(max_tokens=3, **GREEDY))
    _same([warm.generate([second], sp2)[0]], [want])
    assert warm.stats()["prefix_cache"]["evicted_pages"] > 0
    assert _all_free(warm.engine)


# ---- randomised bookkeeping ------------------------------------------------------------------------------
# ~100 s each on a 2-core CPU: -m slow (the default run's bookkeeping checks: tests/test_pages.py, the small-budget
# prefix-cache test above, tests/test_engine.py's randomised freeing)
@pytest.mark.slow
@pytest.mark.parametrize("n_requests", [100, 3000])
def test_randomised_adds_aborts_preemptions_evictions(n_requests):
    """Random adds (prompts from a few shared stems, so the tree shares and evicts), aborts and steps under a
    budget of a few requests: refcounts stay exact after every step, every request ends, and at the end every
    page is free and every refcount zero."""
    llm = LLM("tiny", dtype="float32", max_num_seqs=3, max_model_len=700, prefill_chunk=64, decode_steps=4)
    llm = LLM("tiny", dtype="float32", max_num_seqs=3, max_model_len=700, prefill_chunk=64, decode_steps=4,
              memory_budget_bytes=_budget_for_pages(llm, 6))
    core = llm.engine
    rng = np.random.default_rng(11)
    vocab = llm.config.vocab_size
    stems = [rng.integers(2, vocab, 600).tolist() for _ in range(3)]
    live, ended, added = set(), {}, 0
    while added < n_requests or core.has_unfinished_requests():
        r = rng.random()
        if added < n_requests and r < 0.35:
            stem = stems[int(rng.integers(0, 3))]
            n = int(rng.integers(1, 600))
            prompt = stem[:n] + rng.integers(2, vocab, int(rng.integers(0, 40))).tolist()
            prompt = prompt[:680] or [3]
            sp = SamplingParams(max_tokens=int(rng.integers(1, min(120, 700 - len(prompt)) + 1)),
                                temperature=float(rng.choice([0.0, 1.0])), seed=added)
            rid = f"q{added}"
            core.add_request(rid, prompt, sp)
            live.add(rid)
            added += 1
        elif live and r < 0.40:
            rid = sorted(live)[int(rng.integers(0, len(live)))]
            assert core.abort(rid)
        for d in core.step():
            if d.finish_reason is not None:
                assert d.request_id not in ended
                ended[d.request_id] = d.finish_reason
                live.discard(d.request_id)
        _check_refcounts(core)
    assert len(ended) == n_requests and not live
    st = llm.stats()
    assert st["requests"]["aborted"] > 0 and st["requests"]["preempted"] > 0
    assert st["prefix_cache"]["hit_tokens"] > 0 and st["prefix_cache"]["evicted_pages"] > 0
    assert _all_free(core)
