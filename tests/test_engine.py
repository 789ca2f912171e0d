"""The engine: cached greedy decoding equals the teacher-forced forward; chunking, layouts,
recompilation, page accounting, sampling and the API's error handling."""
import dataclasses
import itertools
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from v4jax import LLM, SamplingParams

GREEDY = dict(temperature=0.0, ignore_eos=True, logprobs=True)


def _log_softmax(x):
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def _assert_teacher_forced(llm, prompt, out):
    """Every generated token is the argmax of the teacher-forced logits at its position (one forward over the
    final sequence), and its log-prob matches."""
    seq = list(prompt) + out.token_ids
    lg = llm.logits(seq)[len(prompt) - 1:-1]
    ref = lg.argmax(-1)
    bad = np.flatnonzero(ref != np.asarray(out.token_ids))
    if bad.size:  # accept only a top-1 tie (reference tie rule), and say so
        i = bad[0]
        top2 = np.sort(lg[i])[-2:]
        assert abs(top2[1] - top2[0]) <= 1e-6 * abs(top2[1]), f"prompt len {len(prompt)}: mismatch at new token {i}"
    lp = _log_softmax(lg)[np.arange(len(out.token_ids)), out.token_ids]
    np.testing.assert_allclose(out.logprobs, lp, atol=1e-4)


def _prompts(lens, vocab, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(2, vocab, n).tolist() for n in lens]


@pytest.fixture(scope="module")
def real_llm(real_ckpt):
    """One engine for the teacher-forced decode and the chunked-prefill reference (prefill chunks of 256 tokens on
    1, 2 and 4 pages of table, decode calls on 1, 2, 4 and 5: compiling them is most of the cost on CPU)."""
    return LLM(real_ckpt, dtype="float32", max_num_seqs=4, max_model_len=1200, prefill_chunk=256)


def test_greedy_equals_teacher_forced_real_ratios(real_llm):
    """Prompts of 1, 128, 255 and 1000 tokens decode 120 tokens together in one batch (HCA windows close in
    decode at 128, 256 and 1024, CSA windows every 4 tokens; the prompt lengths around the window edges are in
    the chunked-prefill tests below)."""
    llm = real_llm
    prompts = _prompts((1, 128, 255, 1000), llm.config.vocab_size)
    outs = llm.generate(prompts, SamplingParams(max_tokens=120, **GREEDY))
    for p, o in zip(prompts, outs):
        assert len(o.token_ids) == 120 and o.finish_reason == "length"
        _assert_teacher_forced(llm, p, o)


@pytest.fixture(scope="module")
def chunk_reference(real_llm):
    """Prompts of 129, 400, 257 and 5 tokens in prefill chunks of 256 (the second pages of 400 and 257 tokens are
    chunks of 144 and 1), 24 decoded tokens each."""
    prompts = _prompts((129, 400, 257, 5), real_llm.config.vocab_size, seed=1)
    return prompts, real_llm.generate(prompts, SamplingParams(max_tokens=24, **GREEDY))


# chunk 7 (many chunks a prompt, none a multiple of 4, windows closing inside chunks and at their edges), chunk 1
# (a token per step) and 64, with -m slow (chunks of 7 are in the engine-core sweep, also -m slow)
@pytest.mark.parametrize("chunk", [pytest.param(c, marks=pytest.mark.slow) for c in (1, 7, 64)])
def test_chunked_prefill_same_outputs(real_ckpt, chunk_reference, chunk):
    prompts, ref = chunk_reference
    llm = LLM(real_ckpt, dtype="float32", max_num_seqs=4, max_model_len=512, prefill_chunk=chunk)
    outs = llm.generate(prompts, SamplingParams(max_tokens=24, **GREEDY))
    for a, b in zip(outs, ref):
        assert a.token_ids == b.token_ids
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)


# ~35 s (five more programs to compile) with -m slow; by default the dense layout gives the paged one's tokens on
# the replay traces (tests/test_replay.py::test_outputs_identical_between_layouts: many pages a slot, slots reused)
@pytest.mark.slow
def test_paged_and_dense_layouts_agree(real_ckpt, chunk_reference):
    prompts, ref = chunk_reference
    llm = LLM(real_ckpt, dtype="float32", max_num_seqs=4, max_model_len=512, prefill_chunk=256, kv_layout="dense")
    outs = llm.generate(prompts, SamplingParams(max_tokens=24, **GREEDY))
    for a, b in zip(outs, ref):
        assert a.token_ids == b.token_ids
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-6)


@pytest.fixture(scope="module")
def tiny_llm():
    return LLM("tiny", dtype="float32", max_num_seqs=4, max_model_len=256, prefill_chunk=16, decode_steps=4)


def test_no_recompilation_after_warmup(tiny_llm):
    eng = tiny_llm.engine
    before = eng.compiled_variants()
    n = eng.warmup()
    warmed = eng.compiled_variants()
    assert n > 0 and 0 < warmed - before <= n  # programs compiled earlier in this process are not compiled again
    rng = np.random.default_rng(3)
    prompts = [rng.integers(2, 500, int(rng.integers(1, 200))).tolist() for _ in range(50)]
    params = [SamplingParams(max_tokens=int(rng.integers(1, 30)), temperature=float(rng.choice([0.0, 0.7])),
                             top_k=int(rng.integers(0, 5)), seed=i) for i in range(50)]
    outs = tiny_llm.generate(prompts, params)
    assert [len(o.token_ids) <= p.max_tokens for o, p in zip(outs, params)] == [True] * 50
    assert eng.compiled_variants() == warmed


def test_default_sampling_decodes_without_the_vocabulary_sort(tiny_llm):
    """A decode step whose sampled requests cut by neither top-k nor top-p (vLLM's and OpenAI's defaults) runs the
    form without the full-vocabulary sort; a step where one sampled request cuts runs the sorting form (a greedy
    row's top-p / top-k do not count: it never samples)."""
    eng = tiny_llm.engine
    f = lambda *v: np.array(v, np.float32)  # noqa: E731
    i = lambda *v: np.array(v, np.int32)  # noqa: E731
    assert eng._spec_for(f(1.0, 0.0), f(1.0, 0.5), i(0, 3)) is eng.plain_spec
    assert eng._spec_for(f(1.0, 0.7), f(1.0, 0.9), i(0, 0)) is eng.spec
    assert eng._spec_for(f(0.0, 0.7), f(1.0, 1.0), i(0, 40)) is eng.spec
    assert eng._spec_for(f(0.0, 0.0), f(0.5, 1.0), i(0, 0)) is eng.greedy_spec
    assert eng._spec_for(f(1.0), f(1.0), i(0), top_logprobs=True) is eng.top_specs[eng.plain_spec]
    pt, swa = eng.kv.decode_tables(1, eng.layout.max_slots)
    sorts = lambda spec: eng.steps.decode.lower(spec, eng._leaves, eng.pools, eng.store,  # noqa: E731
                                                eng._decode_state_merge(), pt, swa).as_text().count("stablehlo.sort")
    assert sorts(eng.plain_spec) == sorts(eng.greedy_spec) < sorts(eng.spec)


def test_penalties_keep_the_steps_sampling_form(tiny_llm):
    """A step with a penalised request runs its own form's twin with penalties: greedy and sampling without a cut
    take no vocabulary sort (one form for every penalised step, the sampling one with the cut, cost a greedy
    penalised step the cut's search: 0.55 ms at batch 32 on an H100). Every form runs on the covers' form."""
    from v4jax.engine.programs import runs_form
    eng = tiny_llm.engine
    f = lambda *v: np.array(v, np.float32)  # noqa: E731
    i = lambda *v: np.array(v, np.int32)  # noqa: E731
    pen = eng.penalty_specs
    assert eng._spec_for(f(0.0, 0.0), f(0.5, 1.0), i(3, 0), penalty=True) is pen[eng.greedy_spec]
    assert eng._spec_for(f(1.0, 0.0), f(1.0, 0.5), i(0, 3), penalty=True) is pen[eng.plain_spec]
    assert eng._spec_for(f(1.0), f(0.9), i(0), penalty=True) is pen[eng.spec] is eng.penalty_spec
    assert eng._spec_for(f(0.0), f(1.0), i(0), top_logprobs=True, penalty=True) is eng.top_specs[pen[eng.greedy_spec]]
    pt, swa = eng.kv.decode_tables(1, eng.layout.max_slots)
    sorts = lambda spec: eng.steps.decode.lower(spec, eng._leaves, eng.pools, eng.store,  # noqa: E731
                                                eng._decode_state_merge(), pt, swa).as_text().count("stablehlo.sort")
    assert sorts(pen[eng.greedy_spec]) == sorts(pen[eng.plain_spec]) == sorts(eng.greedy_spec) < sorts(eng.penalty_spec)
    forms = [*pen.values(), eng.spec, eng.plain_spec, eng.greedy_spec]
    widest = eng.top_specs[eng.penalty_spec]
    assert all(runs_form(widest, form) and runs_form(eng.top_specs[form], form) for form in forms)
    assert not runs_form(pen[eng.greedy_spec], eng.plain_spec) and not runs_form(eng.spec, pen[eng.greedy_spec])


def test_penalised_sampling_draws_alike_in_every_form(tiny_llm):
    """A seeded, penalised request that does not cut draws the same tokens alone (the sampling twin without the cut)
    as beside a request that cuts (the twin with the cut) and beside greedy ones; the penalties change its draws."""
    # penalties that favour the tokens seen (a random model's draws seldom repeat one: penalising them changes little)
    sp = SamplingParams(max_tokens=12, temperature=1.0, seed=5, presence_penalty=-2.0, frequency_penalty=-2.0,
                        repetition_penalty=0.5)
    p = [3, 4, 5, 6, 7]
    alone = tiny_llm.generate([p], [sp])[0].token_ids
    cuts = SamplingParams(max_tokens=12, temperature=0.8, top_k=5, seed=9)
    assert tiny_llm.generate([p, [9, 9, 9]], [sp, cuts])[0].token_ids == alone
    assert tiny_llm.generate([p, [9, 9, 9]], [sp, SamplingParams(max_tokens=12, temperature=0.0)])[0].token_ids == alone
    plain = SamplingParams(max_tokens=12, temperature=1.0, seed=5)
    assert tiny_llm.generate([p], [plain])[0].token_ids != alone


def test_prefill_step_has_no_device_branch(tiny_llm, monkeypatch):
    # a prefill step runs the sampling program whether or not its rows sample (one program per shape for warm-up
    # to compile); it has no device-side branch (on GPU a lax.cond waits on the host for its predicate)
    eng = tiny_llm.engine
    steps, calls = eng.steps, []
    monkeypatch.setattr(eng, "steps", dataclasses.replace(
        steps, prefill=lambda *a: (calls.append(jax.tree.map(_abstract, a)), steps.prefill(*a))[1]))
    tiny_llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, temperature=0.0))
    tiny_llm.generate([[5, 6, 8]], SamplingParams(max_tokens=2, temperature=0.8, seed=1))
    assert calls[0][0] is eng.spec and calls[-1][0] is eng.spec
    text = steps.prefill.lower(*calls[0]).as_text()
    assert not any(op in text for op in ("stablehlo.case", "stablehlo.if"))
    assert "stablehlo.sort" in text


def _abstract(x):
    return jax.ShapeDtypeStruct(x.shape, x.dtype) if isinstance(x, (jax.Array, np.ndarray)) else x


def test_steps_pin_jax_trace_context_first(tiny_llm, monkeypatch):
    # every thread that runs steps sets JAX's Pallas-fuser state before its first jitted call
    # (v4jax.engine.steps.pin_trace_context: on JAX 0.11 that state's first change made a second generate recompile)
    from v4jax.engine import steps as S
    pinned = set()

    class State:
        def set_local(self, value):
            assert value is False
            pinned.add(threading.get_ident())

    monkeypatch.setattr(S, "_NESTED_FUSE", State())
    eng = tiny_llm.engine
    seen = []

    def checked(fn):
        def call(*a, **kw):
            seen.append(threading.get_ident() in pinned)
            return fn(*a, **kw)
        return call

    monkeypatch.setattr(eng, "steps", dataclasses.replace(eng.steps, prefill=checked(eng.steps.prefill),
                                                          decode=checked(eng.steps.decode)))
    out = []
    params = SamplingParams(max_tokens=3, ignore_eos=True)   # sampled at temperature 1: EOS could end it early
    worker = threading.Thread(target=lambda: out.append(tiny_llm.generate([[5, 6, 7]], params)))
    worker.start()
    worker.join()
    assert out and len(out[0][0].token_ids) == 3
    assert seen and all(seen)


def _all_pages_free(eng):
    """No slot maps a page, and once the prefix cache lets go of its pages every page is free."""
    eng.kv.reset_prefix_cache()
    return eng.kv.all_free() and all(s is None for s in eng.scheduler.slots)


def test_freeing_returns_every_page_randomised(tiny_llm):
    rng = np.random.default_rng(7)
    eng = tiny_llm.engine
    for trial in range(6):
        prompts = [rng.integers(2, 500, int(rng.integers(1, 120))).tolist() for _ in range(int(rng.integers(1, 7)))]
        sp = SamplingParams(max_tokens=int(rng.integers(1, 40)), temperature=0.5, seed=trial)
        stream = tiny_llm.generate(prompts, sp, stream=True)
        cut = int(rng.integers(0, 12)) if trial % 2 else None  # odd trials: the client vanishes mid-stream
        for ev in itertools.islice(stream, cut):
            pass
        stream.close()
        assert _all_pages_free(eng), f"trial {trial}: pages leaked"


def _synchronous_generate(llm, prompts, params):
    """The engine without pipelining: every decode call is read right after it is dispatched."""
    core = llm.engine
    ids = [core.new_request_id() for _ in prompts]
    for i, (rid, p, sp) in enumerate(zip(ids, prompts, params)):
        core.add_request(rid, p, sp, sample_index=i)
    out = {rid: ([], None) for rid in ids}
    while core.has_unfinished_requests():
        deltas = core.step()
        if core._flight is not None:
            deltas += core._collect(core._flight)
            core._flight = None
        for d in deltas:
            out[d.request_id] = (out[d.request_id][0] + d.new_token_ids, d.finish_reason or out[d.request_id][1])
    return [out[rid] for rid in ids]


def test_pipelined_scheduler_equals_synchronous_steps(tiny_llm, monkeypatch):
    """generate() dispatches decode call n+1 before reading call n (requests that ended in call n ride along
    inactive, their slots are refilled a call later): the same tokens and finish reasons as waiting for every
    call, with stop tokens, short budgets and more requests than slots."""
    eng = tiny_llm.engine
    rng = np.random.default_rng(5)
    prompts = [rng.integers(2, 500, int(rng.integers(1, 90))).tolist() for _ in range(11)]
    params = [SamplingParams(max_tokens=int(rng.integers(2, 30)), temperature=float(rng.choice([0.0, 0.8])),
                             seed=i) for i in range(11)]
    # stop tokens that occur: every other request stops at a token its unstopped run makes halfway (seeded, so the
    # stopped run makes the same tokens up to there)
    free = _synchronous_generate(tiny_llm, prompts, params)
    params = [dataclasses.replace(sp, stop_token_ids=[toks[len(toks) // 2]] if i % 2 else
                                  [int(t) for t in rng.integers(2, 500, 7)])
              for i, (sp, (toks, _)) in enumerate(zip(params, free))]
    want = _synchronous_generate(tiny_llm, prompts, params)
    assert _all_pages_free(eng)
    carried = []
    dispatch = eng._dispatch_decode
    monkeypatch.setattr(eng, "_dispatch_decode",
                        lambda plan, prev: (carried.append(prev is not None), dispatch(plan, prev))[1])
    got = [(o.token_ids, o.finish_reason) for o in tiny_llm.generate(prompts, params)]
    assert any(carried), "no call was dispatched while another was in flight"
    assert got == want
    assert {r for _, r in want} == {"stop", "length"}
    assert _all_pages_free(eng)


@pytest.mark.slow  # minutes on CPU; -m slow
def test_fixed_length_decode_calls_equal_early_exit(monkeypatch):
    """The GPU form of the decode call (k steps always, no early exit once every slot stopped: the extra steps
    must change nothing) gives the early-exit form's tokens, log-probs and finish reasons, greedy and sampled,
    with stop tokens and budgets shorter than a call."""
    from v4jax.engine import steps
    rng = np.random.default_rng(7)
    prompts = [rng.integers(2, 500, int(rng.integers(1, 40))).tolist() for _ in range(6)]
    params = [SamplingParams(max_tokens=int(rng.integers(1, 11)), temperature=float(rng.choice([0.0, 0.8])), seed=i,
                             logprobs=True, stop_token_ids=[int(t) for t in rng.integers(2, 500, 7)]) for i in range(6)]
    outs = {}
    for early in (True, False):
        monkeypatch.setattr(steps, "early_exit", lambda early=early: early)
        # tiny_llm's options: the early-exit engine's programs are tiny_llm's (warmed up above), from the
        # persistent compilation cache
        llm = LLM("tiny", dtype="float32", max_num_seqs=4, max_model_len=256, prefill_chunk=16, decode_steps=4)
        outs[early] = llm.generate(prompts, params)
    for a, b in zip(outs[True], outs[False]):
        assert (a.token_ids, a.finish_reason) == (b.token_ids, b.finish_reason)
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-6)


def test_seeded_sampling_independent_of_batch(tiny_llm):
    sp = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=11)
    p = [3, 4, 5, 6, 7]
    alone = tiny_llm.generate([p], [sp])[0].token_ids
    other = SamplingParams(max_tokens=20, temperature=1.0, seed=99)
    together = tiny_llm.generate([p, [9, 9, 9], [1, 2]], [sp, other, other])[0].token_ids
    assert alone == together
    assert tiny_llm.generate([p], [SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=12)])[0].token_ids != alone


def test_top_k_one_is_greedy(tiny_llm):
    p = [5, 6, 7, 8]
    g = tiny_llm.generate([p], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))[0].token_ids
    k1 = tiny_llm.generate([p], SamplingParams(max_tokens=10, temperature=1.5, top_k=1, seed=0,
                                               ignore_eos=True))[0].token_ids
    assert g == k1


def test_min_p_one_is_greedy(tiny_llm):
    """min_p = 1 keeps only the most likely token; min_p = 0 changes nothing against the same seed without it."""
    p = [5, 6, 7, 8]
    g = tiny_llm.generate([p], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))[0].token_ids
    sp = dict(max_tokens=10, temperature=1.5, seed=3, ignore_eos=True)
    assert tiny_llm.generate([p], SamplingParams(min_p=1.0, **sp))[0].token_ids == g
    free = tiny_llm.generate([p], SamplingParams(**sp))[0].token_ids
    assert free != g  # at temperature 1.5 this seed leaves the greedy path: the test above can fail
    assert tiny_llm.generate([p], SamplingParams(min_p=0.0, **sp))[0].token_ids == free


def test_min_p_cuts_below_its_share_of_the_top():
    """vLLM's rule: a token survives if its probability (after temperature) is at least min_p times the most
    likely one's; the survivors keep their relative odds, and top-k / top-p apply after it."""
    from v4jax.engine.sampling import filtered_probs, sample
    logits = jnp.log(jnp.array([[0.1, 1.0, 0.4, 0.6]], jnp.float32))
    one = lambda v, dt=jnp.float32: jnp.array([v], dt)
    probs = filtered_probs(logits, one(1.0), one(1.0), one(0, jnp.int32), one(0.5))
    np.testing.assert_allclose(np.asarray(probs[0]), [0, 1 / 1.6, 0, 0.6 / 1.6], rtol=1e-6)
    probs = filtered_probs(logits, one(2.0), one(1.0), one(0, jnp.int32), one(0.5))  # after temperature:
    np.testing.assert_allclose(np.asarray(probs[0]) > 0, [False, True, True, True])  # sqrt(0.4) > 0.5
    probs = filtered_probs(logits, one(1.0), one(0.4), one(0, jnp.int32), one(0.0))
    np.testing.assert_allclose(np.asarray(probs[0]), [0, 1, 0, 0])  # top-p alone, unchanged by min_p = 0
    n = 256
    rows = jnp.repeat(logits, n, 0)
    draw = lambda mp: np.asarray(sample(rows, rows, jnp.ones(n), jnp.ones(n), jnp.zeros(n, jnp.int32),
                                        jnp.full(n, mp), jnp.zeros(n, jnp.int32), jnp.zeros(n, jnp.int32),
                                        jnp.arange(n, dtype=jnp.int32), True)[0])
    assert set(draw(0.5).tolist()) == {1, 3} and set(draw(0.0).tolist()) == {0, 1, 2, 3}


def test_logit_bias_steers_the_choice_not_the_logprobs(tiny_llm):
    """A +100 bias makes its token the greedy choice at every step, a -100 one bans the greedy token; the log-probs
    reported stay those of the raw logits (the teacher-forced forward's)."""
    p = [5, 6, 7, 8]
    base = dict(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=True)
    g = tiny_llm.generate([p], SamplingParams(**base))[0]
    forced = 17 if g.token_ids[0] != 17 else 18
    out = tiny_llm.generate([p], SamplingParams(logit_bias={forced: 100.0}, **base))[0]
    assert out.token_ids == [forced] * 6
    raw = jax.nn.log_softmax(jnp.asarray(tiny_llm.logits(p + [forced] * 5)[len(p) - 1:]), axis=-1)
    np.testing.assert_allclose(out.logprobs, np.asarray(raw[np.arange(6), forced]), atol=1e-4)
    banned = tiny_llm.generate([p], SamplingParams(logit_bias={g.token_ids[0]: -100.0}, **base))[0]
    assert banned.token_ids[0] != g.token_ids[0]
    hot = dict(max_tokens=6, temperature=1.0, seed=4, ignore_eos=True)  # sampled rows too
    assert tiny_llm.generate([p], SamplingParams(logit_bias={forced: 100.0}, **hot))[0].token_ids == [forced] * 6
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tiny_llm.generate([p], SamplingParams(logit_bias={10**6: 1.0}))


def _masked_greedy(llm, prompt, n, stop, min_tokens):
    """The greedy rollout by teacher-forced forwards with `stop` never chosen before min_tokens tokens, ending
    after it (the reference for min_tokens)."""
    seq = []
    for i in range(n):
        lg = np.array(llm.logits(list(prompt) + seq)[-1])
        if i < min_tokens:
            lg[stop] = -np.inf
        seq.append(int(lg.argmax()))
        if seq[-1] == stop:
            break
    return seq


def test_min_tokens_holds_the_stop_ids_back(tiny_llm):
    """With min_tokens m the stop ids are never drawn before m tokens (greedy: the masked teacher-forced rollout;
    sampled: the same tokens as a -100 logit bias on them, the same keys), and end the request after; the
    log-probs stay raw. max_tokens below min_tokens is refused."""
    p = [5, 6, 7, 8]
    free = tiny_llm.generate([p], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0].token_ids
    stop = max(set(free), key=free.count)  # the token it emits most
    m = free.index(stop) + 3
    want = _masked_greedy(tiny_llm, p, 12, stop, m)
    assert stop not in want[:m]
    sp = dict(max_tokens=12, ignore_eos=True, stop_token_ids=[stop], logprobs=True)
    out = tiny_llm.generate([p], SamplingParams(temperature=0.0, min_tokens=m, **sp))[0]
    assert out.token_ids == want
    raw = jax.nn.log_softmax(jnp.asarray(tiny_llm.logits(p + out.token_ids)[len(p) - 1:-1]), axis=-1)
    np.testing.assert_allclose(out.logprobs, np.asarray(raw[np.arange(len(want)), want]), atol=1e-4)
    assert tiny_llm.generate([p], SamplingParams(temperature=0.0, **sp))[0].token_ids == free[:free.index(stop) + 1]
    for seed in range(3):
        hot = dict(temperature=1.5, seed=seed, max_tokens=m, ignore_eos=True)
        held = tiny_llm.generate([p], SamplingParams(min_tokens=m, stop_token_ids=[stop], **hot))[0].token_ids
        banned = tiny_llm.generate([p], SamplingParams(logit_bias={stop: -100.0}, **hot))[0].token_ids
        assert held == banned and stop not in held
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)


def _penalized_greedy(llm, prompt, n, presence, frequency, repetition):
    """The greedy rollout by teacher-forced forwards with vLLM's penalties applied to each step's logits (the
    reference for the penalties)."""
    from test_sampling import reference_penalized
    seq = []
    for _ in range(n):
        lg = np.array(llm.logits(list(prompt) + seq)[-1])
        seq.append(int(reference_penalized(lg, list(prompt), seq, presence, frequency, repetition).argmax()))
    return seq


def test_penalty_counts_once_a_call_then_a_token_a_step():
    """A decode call counts each row's sequence from the token pool once (positions before the fed token, through
    its page table), then adds the fed token each step: at every step the same (held, counts) as counting the whole
    sequence so far, the prompt held but not counted."""
    import types

    from v4jax.engine import steps as S
    from v4jax.engine.sampling import count_token, token_counts
    rng = np.random.default_rng(3)
    p, v, b = 4, 50, 3
    prompt_len, pos = np.array([5, 9, 2]), np.array([7, 13, 2])  # the fed token's position
    page_table = np.array([[4, 0, 7, -1, -1, -1], [1, 2, 3, 5, -1, -1], [6, -1, -1, -1, -1, -1]], np.int32)
    pool = rng.integers(0, v, (8, p)).astype(np.int32)
    spec = types.SimpleNamespace(layout=types.SimpleNamespace(page_size=p))
    sm = types.SimpleNamespace(prompt_len=jnp.asarray(prompt_len))
    seqs = [[int(pool[page_table[r, i // p], i % p]) for i in range(pos[r])] for r in range(b)]
    counted = S._pool_counts(spec, v, sm, types.SimpleNamespace(tokens=jnp.asarray(pool)), jnp.asarray(page_table),
                             jnp.asarray(pos))
    for step in range(3):
        fed = rng.integers(0, v, b)
        counted = count_token(*counted, jnp.asarray(fed), jnp.ones(b, bool), jnp.asarray(pos + step >= prompt_len))
        for r in range(b):
            seqs[r].append(int(fed[r]))
        width = max(map(len, seqs))
        tokens = np.array([s + [0] * (width - len(s)) for s in seqs])
        seen = np.arange(width)[None, :] < np.array([len(s) for s in seqs])[:, None]
        want = token_counts(v, jnp.asarray(tokens), jnp.asarray(seen),
                            jnp.asarray(seen & (np.arange(width)[None, :] >= prompt_len[:, None])))
        for got, ref in zip(counted, want):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))


def test_penalties_follow_the_teacher_forced_rollout(tiny_llm):
    """Presence, frequency and repetition penalties (greedy, several tokens past a decode call and a prompt longer
    than a prefill chunk) give the rollout of teacher-forced forwards penalized as vLLM does, beside a request
    without penalties in the same steps (its tokens unchanged); the log-probs stay those of the raw logits. With
    speculative decoding they are refused."""
    rng = np.random.default_rng(7)
    p = rng.integers(2, 60, 40).tolist() + [5, 6, 5, 6]
    base = dict(max_tokens=10, temperature=0.0, ignore_eos=True)
    free = tiny_llm.generate([p], SamplingParams(**base))[0].token_ids
    changed = 0
    for pres, freq, rep in ((0.0, 1.5, 1.0), (1.0, 0.0, 1.0), (0.0, 0.0, 1.8), (0.5, 0.5, 1.3), (-2.0, -2.0, 0.5)):
        want = _penalized_greedy(tiny_llm, p, 10, pres, freq, rep)
        changed += want != free
        sp = SamplingParams(presence_penalty=pres, frequency_penalty=freq, repetition_penalty=rep, logprobs=True,
                            **base)
        out, plain = tiny_llm.generate([p, p], [sp, SamplingParams(**base)])
        assert out.token_ids == want, (pres, freq, rep)
        assert plain.token_ids == free
        raw = jax.nn.log_softmax(jnp.asarray(tiny_llm.logits(p + out.token_ids)[len(p) - 1:-1]), axis=-1)
        np.testing.assert_allclose(out.logprobs, np.asarray(raw[np.arange(10), want]), atol=1e-4)
    assert changed >= 2, changed  # the penalties change these rollouts
    from v4jax.engine.checks import RequestCheck
    from v4jax.engine.sampling import SamplingParams as SP
    check = dataclasses.replace(tiny_llm.engine.request_check, speculative=True)
    with pytest.raises(ValueError, match="frequency_penalty: penalties are not supported with speculative"):
        check(p, SP(frequency_penalty=0.5))
    check(p, SP())
    assert isinstance(check, RequestCheck)


def test_stream_events_concatenate_to_result(tiny_llm):
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9]]
    sp = SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True)
    full = tiny_llm.generate(prompts, sp)
    got = {0: [], 1: []}
    order = []
    for i, toks, text in tiny_llm.generate(prompts, sp, stream=True):
        got[i].extend(toks)
        order.append(i)
    assert got[0] == full[0].token_ids and got[1] == full[1].token_ids
    assert len(set(order[:4])) == 2  # interleaved across prompts


def test_stop_token_ends_request(tiny_llm):
    p = [10, 11, 12]
    free = tiny_llm.generate([p], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0].token_ids
    stop = free[3]
    out = tiny_llm.generate([p], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True,
                                                stop_token_ids=[stop]))[0]
    assert out.finish_reason == "stop" and out.token_ids == free[:free.index(stop) + 1]


def test_context_limit(tiny_llm):
    """A request up to the context runs to its last position; one past it is refused, naming both numbers."""
    p = list(range(2, 252))
    out = tiny_llm.generate([p], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(p) + len(out.token_ids) == 255
    out = tiny_llm.generate([p[:200]], SamplingParams(max_tokens=56, temperature=0.0, ignore_eos=True))[0]
    assert len(out.token_ids) == 56 and out.finish_reason == "length"
    with pytest.raises(ValueError, match="max_tokens=50.*256"):
        tiny_llm.generate([p], SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))


@pytest.mark.parametrize("kwargs", [dict(max_tokens=0), dict(temperature=-1.0), dict(top_p=0.0), dict(top_p=1.5),
                                    dict(top_k=-2), dict(temperature=float("nan")), dict(min_p=-0.1),
                                    dict(min_p=1.5), dict(logit_bias={3: 101.0}), dict(logit_bias={-1: 1.0}),
                                    dict(logit_bias={3: float("inf")}), dict(logit_bias={3: "1"}),
                                    dict(logit_bias={t: 1.0 for t in range(129)}), dict(logit_bias=[(3, 1.0), (3, 2.0)])])
def test_impossible_sampling_params(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_bad_inputs_are_clear_errors(tiny_llm):
    with pytest.raises(ValueError, match="context limit"):
        tiny_llm.generate([list(range(300))])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tiny_llm.logits([1, 2, 100000])
    with pytest.raises(ValueError, match="empty"):
        tiny_llm.generate([[]])
    with pytest.raises(ValueError, match="no tokenizer"):
        tiny_llm.generate("hello")
    with pytest.raises(TypeError, match="unknown LLM option"):
        LLM("tiny", no_such_option=1)
    with pytest.raises(ValueError, match="attention_impl must be"):
        LLM("tiny", attention_impl="triton")
    assert _all_pages_free(tiny_llm.engine)
    # no attention_impl: the Pallas kernels on a GPU, the XLA references elsewhere (here: the CPU)
    assert tiny_llm.run_options.attention_impl == ("pallas" if jax.default_backend() == "gpu" else "xla")


def test_page_table_snapshot_is_private(tiny_llm):
    """Steps get a private copy of the host page tables: the host mutates them while earlier (async) steps may
    still read them, and on CPU jnp.asarray can alias numpy memory (this made chunk-1 prefill nondeterministic)."""
    t = tiny_llm.engine.kv._tables
    full, swa = tiny_llm.engine.kv.decode_tables(1)
    was = t.full.copy(), t.swa.copy()
    t.full[:], t.swa[:] = 7, 7  # what the next allocation does to the host tables
    try:
        np.testing.assert_array_equal(full, was[0][:, :1])
        np.testing.assert_array_equal(swa, was[1])
    finally:
        t.full[:], t.swa[:] = was


@pytest.mark.slow  # minutes on CPU; -m slow
def test_stats_pools_and_prefix_figures_are_what_the_engine_holds():
    """stats(): every pool's used / total pages and their bytes are the engine's (bytes per unit from the layout,
    the totals summing to the arrays it allocated); reused pages are the prefix hits in pages."""
    from v4jax import cache as C
    from v4jax.cache.boundary import store_bytes
    from v4jax.cache.layout import pool_sizes
    llm = LLM("tiny", dtype="float32", max_num_seqs=4, max_model_len=256, prefill_chunk=16, decode_steps=4,
              page_size=32)
    eng = llm.engine
    lay, t = eng.layout, eng.kv._tables
    sizes = pool_sizes(eng.cfg, lay, eng.dtype, eng.kv.caching)
    st = eng.stats()
    assert sum(p["bytes_total"] for p in st["pools"].values()) == (sum(C.pool_bytes(eng.pools).values())
                                                                  + store_bytes(eng.store))
    rng = np.random.default_rng(2)
    stem = rng.integers(2, 500, 2 * lay.page_size).tolist()
    before = eng.stats()["prefix_cache"]
    sp = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    llm.generate([stem + [7]], sp)
    for i, p in enumerate([stem + [8, 9], rng.integers(2, 500, 40).tolist()]):
        eng.add_request(f"stats-{i}", p, sp)
    eng.step()  # admitted and prefilling: pages in use
    st = eng.stats()
    held = {"swa": t.swa_alloc.n_used, "compressor_state": sum(r is not None for r in eng.scheduler.slots)}
    assert held["compressor_state"] == 2
    for name, p in st["pools"].items():
        s = sizes[name]
        assert p["used"] == held.get(name, t.full_alloc.n_used) and p["total"] == s.units and p["unit"] == s.unit
        assert p["bytes_used"] == p["used"] * s.unit_bytes and p["bytes_total"] == s.bytes
    while eng.has_unfinished_requests():
        eng.step()
    pc = eng.stats()["prefix_cache"]
    assert pc["hit_tokens"] - before["hit_tokens"] == 2 * lay.page_size  # the stem's two pages, mapped once
    assert pc["reused_pages"] - before["reused_pages"] == 2
    assert eng.stats()["requests"]["recomputed_tokens"] == 0
    assert _all_pages_free(eng)


@pytest.mark.slow  # minutes on CPU (the server's top-N against the forward stays in the default run); -m slow
def test_top_logprobs_are_the_teacher_forced_top_n(tiny_llm):
    """SamplingParams.top_logprobs = N: each generated token's N most likely alternatives (log-softmax of the raw
    logits, before temperature) are the top N of one teacher-forced forward over the final sequence, in batches
    mixing requests that ask for other N or none, over chunked prefills and several decode calls. Ranks may swap
    only within the tolerance of a tie."""
    prompts = _prompts((5, 40, 23), 500, seed=5)
    params = [SamplingParams(max_tokens=9, top_logprobs=4, **GREEDY),
              SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=9, temperature=0.9, seed=2, ignore_eos=True, logprobs=True, top_logprobs=20)]
    outs = tiny_llm.generate(prompts, params)
    assert outs[1].top_logprobs is None
    for p, sp, out in zip(prompts[::2], params[::2], outs[::2]):
        lsm = _log_softmax(tiny_llm.logits(p + out.token_ids)[len(p) - 1:-1])
        assert len(out.top_logprobs) == len(out.token_ids) == 9
        for j, (t, pairs) in enumerate(zip(out.token_ids, out.top_logprobs)):
            ranked = np.sort(lsm[j])[::-1][:sp.top_logprobs]
            assert len(pairs) == sp.top_logprobs
            for (i, lp), want in zip(pairs, ranked):
                assert abs(lp - want) <= 1e-4 and abs(lp - lsm[j, i]) <= 1e-4
            if sp.temperature == 0:  # greedy: the chosen token leads, with its own log-prob
                assert pairs[0] == (t, out.logprobs[j])
