"""Speculative decoding with the MTP block: greedy outputs equal plain greedy decoding (the teacher-forced
forward, which test_engine.py holds plain decoding to) token for token with log-probs within 1e-5, whatever the
drafts: drafts forced right or partly wrong per slot, so that every acceptance length runs (the default run), and
the MTP block's own (slow: k = 1, 3, 7). Prompts of mixed lengths cross C4 and HCA windows and full pages during
decode; the same prompts again hit the prefix cache, and a later request resumes from a page boundary that a
speculative step crossed (its saved compressor state). The rejection rule's losslessness is checked on a 4-token
vocabulary; the option's errors, flags and metrics."""
import dataclasses

import numpy as np
import pytest

import hf_reference as H
from checkpoints import write_official_checkpoint
from v4jax import LLM, SamplingParams
from v4jax.config import preset
from v4jax.fields import FieldError

GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, logprobs=True)
LENS = (19, 45)
# tiny: window 8, CSA ratio 4, HCA ratio 16; pages of 32 tokens, so that prefixes hit and decode crosses pages
OPTIONS = dict(dtype="float32", max_num_seqs=2, max_model_len=128, prefill_chunk=16, decode_steps=8, page_size=32)


def _spec_llm(k: int) -> LLM:
    return LLM("tiny", speculative_config={"method": "mtp", "num_speculative_tokens": k}, **OPTIONS)


def _prompts(lens, vocab, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(2, vocab, n).tolist() for n in lens]


def _log_softmax(x):
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def _assert_teacher_forced(llm, prompt, out):
    """Every generated token is the argmax of one teacher-forced forward over the final sequence, its log-prob
    within 1e-5 (float32)."""
    seq = list(prompt) + out.token_ids
    lg = llm.logits(seq)[len(prompt) - 1:-1]
    ref = lg.argmax(-1)
    bad = np.flatnonzero(ref != np.asarray(out.token_ids))
    if bad.size:  # only a top-1 tie may differ (the reference tie rule)
        i = bad[0]
        top2 = np.sort(lg[i])[-2:]
        assert abs(top2[1] - top2[0]) <= 1e-6 * abs(top2[1]), f"prompt len {len(prompt)}: mismatch at new token {i}"
    lp = _log_softmax(lg)[np.arange(len(out.token_ids)), out.token_ids]
    np.testing.assert_allclose(out.logprobs, lp, atol=1e-5)


def _greedy_rollout(llm, prompt, n):
    """The plain greedy continuation by teacher-forced forwards (the reference every cached path is held to)."""
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(llm.logits(seq)[-1].argmax()))
    return seq[len(prompt):]


def _forced_drafts(llm, prompts, continuations, seed=1):
    """A [slots, positions] draft table: slot i (request i, admitted into slot i) drafts its true continuation
    (slot 0) or the true one with a wrong token at random positions (slot 1)."""
    rng = np.random.default_rng(seed)
    v, n = llm.config.vocab_size, llm.max_model_len
    table = np.zeros((llm.options.max_num_seqs, n), np.int32)
    for i, (p, c) in enumerate(zip(prompts, continuations)):
        seq = np.asarray(list(p) + list(c), np.int32)
        wrong = np.zeros(len(seq), bool) if i == 0 else rng.random(len(seq)) < 0.3
        table[i, :len(seq)] = np.where(wrong, (seq + 1) % v, seq)
    return table


def _forced(llm, table):
    """The engine's greedy program drafting from `table` (tests only: StepSpec.draft_table)."""
    core = llm.engine
    core.greedy_spec = dataclasses.replace(core.greedy_spec, draft_table=table)


def _check_forced(llm):
    """Drafts forced right (slot 0) and partly wrong (slot 1), so that every acceptance length runs: the tokens are
    the plain greedy ones, log-probs within 1e-5; then again on prefix hits, and a request resuming at a page
    boundary that a speculative step crossed."""
    prompts = _prompts(LENS, llm.config.vocab_size)
    want = [_greedy_rollout(llm, p, GREEDY.max_tokens) for p in prompts]
    _forced(llm, _forced_drafts(llm, prompts, want))
    k = llm.options.num_speculative_tokens
    for rerun in (False, True):
        hits = llm.stats()["prefix_cache"]["hit_tokens"]
        before = llm.stats()["spec_decode"]
        outs = llm.generate(prompts, GREEDY)
        for p, o, w in zip(prompts, outs, want):
            assert o.token_ids == w
            _assert_teacher_forced(llm, p, o)
        st = llm.stats()
        assert (st["prefix_cache"]["hit_tokens"] > hits) == rerun
        sd = st["spec_decode"]
        steps = sd["num_drafts"] - before["num_drafts"]
        by_pos = np.subtract(sd["accepted_by_position"], before["accepted_by_position"])
        assert sd["num_draft_tokens"] - before["num_draft_tokens"] == k * steps
        assert by_pos[-1] > 0, by_pos  # whole drafts accepted (slot 0)
        assert by_pos[0] < steps  # drafts rejected at the first position (slot 1)
    # page 64 of the longer request was reached while speculating: resume there with more of its sequence
    seq = prompts[1] + want[1]
    hits = llm.stats()["prefix_cache"]["hit_tokens"]
    (o,) = llm.generate([seq[:70]], dataclasses.replace(GREEDY, max_tokens=12))
    assert llm.stats()["prefix_cache"]["hit_tokens"] - hits == 64
    assert o.token_ids == want[1][25:37]
    _assert_teacher_forced(llm, seq[:70], o)


def _check_mtp_drafts(llm):
    """The MTP block's own drafts (the tiny random model accepts next to none): plain greedy tokens, and the
    counters add up."""
    prompts = _prompts(LENS, llm.config.vocab_size, seed=2)
    outs = llm.generate(prompts, GREEDY)
    for p, o in zip(prompts, outs):
        assert len(o.token_ids) == GREEDY.max_tokens
        _assert_teacher_forced(llm, p, o)
    st = llm.stats()["spec_decode"]
    k = llm.options.num_speculative_tokens
    assert st["num_drafts"] > 0 and st["num_draft_tokens"] == k * st["num_drafts"]
    assert st["num_accepted_tokens"] == sum(st["accepted_by_position"])


@pytest.mark.slow  # minutes on CPU; -m slow
def test_greedy_with_forced_drafts_equals_plain_greedy():
    _check_forced(_spec_llm(3))


@pytest.mark.slow
def test_fixed_step_count_as_on_gpu(monkeypatch):
    """A GPU runs each call's `spec_steps` steps without an early exit (no loop predicate read on the host): the
    steps after every slot stopped or had its tokens change nothing."""
    from v4jax.engine import steps
    monkeypatch.setattr(steps, "early_exit", lambda: False)
    assert steps.spec_steps(8, 2) == 2 and steps.spec_steps(8, 4) == 1
    _check_forced(_spec_llm(1))


@pytest.mark.slow
@pytest.mark.parametrize("k", [1, 3, 7])
def test_greedy_with_mtp_drafts_equals_plain_greedy(k):
    llm = _spec_llm(k)
    _check_mtp_drafts(llm)
    if k != 3:
        _check_forced(llm)


@pytest.mark.slow
def test_logit_bias_in_the_verify_step():
    """A +100 logit bias decides the verified tokens as it decides plain decoding's: every token is the biased one,
    greedy and sampled, with the drafts accepted (the drafter proposes with the same bias); log-probs raw."""
    llm = _spec_llm(3)
    (p,) = _prompts(LENS[:1], llm.config.vocab_size)
    for extra in ({"temperature": 0.0}, {"temperature": 1.0, "seed": 2}):
        sp = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=True, logit_bias={7: 100.0}, **extra)
        (o,) = llm.generate([p], sp)
        assert o.token_ids == [7] * 12
        raw = _log_softmax(llm.logits(p + [7] * 11)[len(p) - 1:])
        np.testing.assert_allclose(o.logprobs, raw[np.arange(12), 7], atol=1e-4)
    assert llm.stats()["spec_decode"]["num_accepted_tokens"] > 0


@pytest.mark.slow
def test_min_tokens_in_the_verify_step():
    """min_tokens holds the stop id back at each verified position as plain decoding does: greedy, the same tokens
    as the engine without speculation (drafts of the stop id rejected before min_tokens); sampled, no stop id
    before min_tokens."""
    llm, plain = _spec_llm(3), LLM("tiny", **OPTIONS)
    (p,) = _prompts(LENS[:1], llm.config.vocab_size)
    free = plain.generate([p], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))[0].token_ids
    stop = free[1]
    m = free.index(stop) + 4
    sp = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, stop_token_ids=[stop], min_tokens=m)
    want = plain.generate([p], sp)[0].token_ids
    assert stop not in want[:m]
    assert llm.generate([p], sp)[0].token_ids == want
    for seed in range(3):
        hot = SamplingParams(max_tokens=m, temperature=1.5, seed=seed, ignore_eos=True, stop_token_ids=[stop],
                             min_tokens=m)
        assert stop not in llm.generate([p], hot)[0].token_ids


@pytest.mark.slow
def test_sampled_seeded_reproducible():
    """A seeded sampled request (the rejection rule) gives the same tokens again, beside a greedy one whose tokens
    stay the teacher-forced ones."""
    llm = _spec_llm(3)
    prompts = _prompts((6, 21), llm.config.vocab_size, seed=3)
    sp = [SamplingParams(max_tokens=12, temperature=0.9, seed=7, ignore_eos=True), GREEDY]
    a = llm.generate(prompts, sp)
    b = llm.generate(prompts, sp)
    assert a[0].token_ids == b[0].token_ids and len(a[0].token_ids) == 12
    _assert_teacher_forced(llm, prompts[1], a[1])


@pytest.mark.slow
def test_preemption_with_speculation():
    """Pools of 4 full pages for two requests admitted at 1 page each that grow to 3 each while speculating: one is
    preempted (recomputed later from its tokens), and both still give the plain greedy tokens."""
    from v4jax.api import EngineOptions
    from v4jax.cache.layout import pool_layout

    opts = dict(OPTIONS, speculative_config={"method": "mtp", "num_speculative_tokens": 3}, enable_prefix_caching=False)
    cfg = preset("tiny")

    def pages(budget):
        kw = {k: v for k, v in opts.items() if k != "dtype"}
        try:
            return pool_layout(cfg, EngineOptions(memory_budget_bytes=budget, **kw), np.float32, 128).n_pages
        except ValueError:
            return 0

    lo, hi = 1, 1 << 40
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if pages(mid) >= 4 else (mid + 1, hi)
    llm = LLM("tiny", memory_budget_bytes=lo, **opts)
    assert llm.engine.layout.n_pages == 4
    prompts = _prompts((20, 18), llm.config.vocab_size, seed=4)
    outs = llm.generate(prompts, dataclasses.replace(GREEDY, max_tokens=60))
    for p, o in zip(prompts, outs):
        _assert_teacher_forced(llm, p, o)
    assert llm.stats()["requests"]["preempted"] > 0


def test_speculative_config_errors(tmp_path):
    with pytest.raises(FieldError, match="speculative_config: method"):
        LLM("tiny", speculative_config={"method": "eagle", "num_speculative_tokens": 2})
    with pytest.raises(FieldError, match="num_speculative_tokens must be an integer in"):
        LLM("tiny", speculative_config={"method": "mtp", "num_speculative_tokens": 0})
    with pytest.raises(FieldError, match="needs decode_steps >= 8"):
        LLM("tiny", speculative_config={"method": "mtp", "num_speculative_tokens": 7}, decode_steps=4)
    with pytest.raises(FieldError, match="unknown key"):
        LLM("tiny", speculative_config={"method": "mtp", "num_speculative_tokens": 2, "draft_model": "x"})
    cfg = H.cfg_small_ratios()
    write_official_checkpoint(tmp_path, cfg, H.random_official_tensors(cfg, seed=0, include_mtp=False), fp8=False,
                              fp4_experts=False, bf16=False)
    with pytest.raises(FieldError, match="no MTP weights"):
        LLM(str(tmp_path), speculative_config={"method": "mtp", "num_speculative_tokens": 2})


def test_rejection_rule_is_lossless():
    """Two tokens drawn by speculation (k = 2 drafts from a poor drafter, a second step where the first rejected
    its drafts) are distributed as the target's own: P(t0, t1) = P0(t0) P1(t1 | t0), on a 4-token vocabulary."""
    import jax
    import jax.numpy as jnp

    from v4jax.engine.spec import accept_sampled

    v, n = 4, 40000
    rng = np.random.default_rng(0)
    dist = lambda *shape: rng.dirichlet(np.ones(v), size=shape).astype(np.float32)
    p0, p1, p2 = dist(), dist(v), dist(v, v)  # the target: P(t0), P(t1 | t0), P(t2 | t0, t1)
    q0, q1 = dist(), dist(v)  # the drafter's own guesses
    keys = jax.random.split(jax.random.key(0), 8)

    def draw(key, probs):
        return jax.random.categorical(key, jnp.log(jnp.asarray(probs)), shape=(n,)) if probs.ndim == 1 else \
            jax.random.categorical(key, jnp.log(jnp.asarray(probs)))

    d0 = draw(keys[0], q0)
    d1 = draw(keys[1], q1[d0])
    drafts = jnp.stack([d0, d1], 1).astype(jnp.int32)
    p = jnp.stack([jnp.broadcast_to(p0, (n, v)), p1[d0], p2[d0, d1]], 1)
    q = jnp.stack([jnp.broadcast_to(q0, (n, v)), q1[d0]], 1)
    u = jax.random.uniform(keys[2], (n, 2))
    kept, tokens = accept_sampled(p, q, drafts, u, jax.random.split(keys[3], (n, 3)))
    t0 = tokens[:, 0]
    # rows that kept no draft: a second step from t0 with one draft
    e0 = draw(keys[4], q1[t0]).astype(jnp.int32)
    _, more = accept_sampled(jnp.stack([p1[t0], p2[t0, e0]], 1), q1[t0][:, None], e0[:, None],
                             jax.random.uniform(keys[5], (n, 1)), jax.random.split(keys[6], (n, 2)))
    t1 = jnp.where(kept >= 1, tokens[:, 1], more[:, 0])
    counts = np.zeros((v, v))
    np.add.at(counts, (np.asarray(t0), np.asarray(t1)), 1)
    want = p0[:, None] * p1
    sigma = np.sqrt(want * (1 - want) / n)
    assert np.all(np.abs(counts / n - want) < 5 * sigma + 1e-4), (counts / n, want)
    assert 0 < float(jnp.mean(kept >= 1)) < 1  # both paths ran


def test_flags_and_metrics():
    """`v4jax serve --speculative-config JSON` (and `generate`) reach LLM(...) as the dict; the counters of
    stats()["spec_decode"] are Prometheus counters, acceptance per draft position labelled."""
    from v4jax import cli
    from v4jax.serve.metrics import ServerMetrics
    from v4jax.serve.options import llm_kwargs

    flag = '{"method": "mtp", "num_speculative_tokens": 3}'
    args = cli.build_parser().parse_args(["serve", "tiny", "--speculative-config", flag])
    assert llm_kwargs(args)["speculative_config"] == {"method": "mtp", "num_speculative_tokens": 3}
    args = cli.build_parser().parse_args(["generate", "x", "--speculative-config", flag])
    assert args.speculative_config == {"method": "mtp", "num_speculative_tokens": 3}
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["serve", "--speculative-config", "[3]"])
    stats = {"spec_decode": {"num_drafts": 10, "num_draft_tokens": 30, "num_accepted_tokens": 12,
                             "accepted_by_position": [7, 4, 1]}}
    text = ServerMetrics(lambda: stats).render().decode()
    got = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
           if line and not line.startswith("#")}
    assert got["v4jax_spec_decode_num_drafts_total"] == 10
    assert got["v4jax_spec_decode_num_draft_tokens_total"] == 30
    assert got["v4jax_spec_decode_num_accepted_tokens_total"] == 12
    per_pos = "v4jax_spec_decode_num_accepted_tokens_per_pos_total"
    assert [got[f'{per_pos}{{position="{i}"}}'] for i in range(3)] == [7, 4, 1]


@pytest.mark.slow  # two engines to compile; -m slow
def test_speculation_on_fp8_cache_entries():
    """With FP8 cache entries and FP4 indexer keys, speculation gives plain decoding's greedy tokens on the same
    cache format, log-probs within 1e-4, the native formats' rule (CONVENTIONS): a verify step computes an entry in
    other shapes than a decode step, and a last-bit difference there can round it to the neighbouring FP8 value
    (3e-5 in 5 of 40 log-probs here). Rejected drafts leave the byte pools as if never written."""
    prompts = _prompts(LENS, 512, seed=3)
    plain = LLM("tiny", kv_cache_dtype="fp8", **OPTIONS)
    want = plain.generate(prompts, GREEDY)
    llm = LLM("tiny", kv_cache_dtype="fp8", speculative_config={"method": "mtp", "num_speculative_tokens": 3},
              **OPTIONS)
    table = np.zeros((OPTIONS["max_num_seqs"], OPTIONS["max_model_len"]), np.int32)
    for i, (p, w) in enumerate(zip(prompts, want)):
        seq = np.asarray(p + w.token_ids, np.int32)
        wrong = np.zeros(len(seq), bool) if i == 0 else np.random.default_rng(1).random(len(seq)) < 0.3
        table[i, :len(seq)] = np.where(wrong, (seq + 1) % 512, seq)
    _forced(llm, table)
    for got, w in zip(llm.generate(prompts, GREEDY), want):
        assert got.token_ids == w.token_ids
        np.testing.assert_allclose(got.logprobs, w.logprobs, atol=1e-4)
    assert llm.stats()["spec_decode"]["num_accepted_tokens"] > 0


@pytest.mark.slow  # minutes on CPU
def test_forced_acceptance_for_benchmarks():
    """StepSpec.forced_acceptance (`v4jax bench spec --accept RATE`): rate 1 keeps every draft (k + 1 tokens a
    step, the drafts emitted as the tokens), rate 0 none (each step emits the model's own token: plain greedy
    decoding, against the teacher-forced forward)."""
    llm = _spec_llm(2)
    prompts = _prompts(LENS, llm.config.vocab_size, seed=3)
    sp = dataclasses.replace(GREEDY, max_tokens=12)
    core = llm.engine
    for rate in (0.0, 1.0):
        core.greedy_spec = dataclasses.replace(core.greedy_spec, forced_acceptance=rate)
        before = llm.stats()["spec_decode"]
        outs = llm.generate(prompts, sp)
        sd = llm.stats()["spec_decode"]
        steps = sd["num_drafts"] - before["num_drafts"]
        accepted = np.subtract(sd["accepted_by_position"], before["accepted_by_position"])
        assert all(len(o.token_ids) == sp.max_tokens for o in outs)
        if rate == 0.0:
            assert steps > 0 and not accepted.any()
            for p, o in zip(prompts, outs):
                _assert_teacher_forced(llm, p, o)
        else:  # every draft kept: a step makes 3 tokens (the last step of a request may be cut by max_tokens)
            assert (accepted == steps).all() and steps <= 2 * -(-sp.max_tokens // 3)


def test_decode_profile_takes_the_prefill_from_the_long_run(monkeypatch):
    """`v4jax bench spec --profile`: each kernel family's launches and time in the long run less the short run's (the
    prefill and first token), per generated token position, the heaviest first, after every kernel's and copy's."""
    from v4jax.bench import profile as P
    from v4jax.bench.spec import decode_profile
    tops = {1: [("prefill_gemm", 10, 5.0), ("attention", 2, 1.0)],
            65: [("prefill_gemm", 10, 5.0), ("attention", 130, 9.0), ("mtp_head", 64, 3.2)]}
    copies = {1: (3, 0.5), 65: (131, 1.78)}
    monkeypatch.setattr(P, "summarize", lambda call, repeats, top: {
        "top": tops[call()], "kernels": sum(t[1] for t in tops[call()]), "kernel_ms": sum(t[2] for t in tops[call()]),
        "copies": copies[call()][0], "copy_ms": copies[call()][1]})
    got = decode_profile(lambda sp: sp.max_tokens, SamplingParams(max_tokens=1), SamplingParams(max_tokens=65), 64)
    assert got[:2] == [("(all kernels)", 3.0, pytest.approx(0.175)), ("(copies)", 2.0, pytest.approx(0.02))]
    assert got[2:] == [("attention", 2.0, 0.125), ("mtp_head", 1.0, 0.05), ("prefill_gemm", 0.0, 0.0)]


@pytest.mark.slow  # a minute on CPU
def test_forced_acceptance_coins_differ_between_slots():
    """The benchmark's coin is drawn per slot and position: equal prompts decoding side by side keep different drafts
    (drawn per position alone, every slot kept the same ones and a batch measured a few dozen coins)."""
    llm = _spec_llm(2)
    prompt = _prompts(LENS[:1], llm.config.vocab_size, seed=4)[0]
    core = llm.engine
    core.greedy_spec = dataclasses.replace(core.greedy_spec, forced_acceptance=0.5)
    outs = llm.generate([prompt] * 4, dataclasses.replace(GREEDY, max_tokens=12))
    assert len({tuple(o.token_ids) for o in outs}) > 1
