"""Decode slots bucketed by powers of two: a decode call runs slots 0..B-1, B the smallest power of two above the
highest running slot, so a few requests in a many-slot engine do not pay for every slot. The tokens (greedy,
float32) are those each request gets alone, across calls whose B grows and shrinks while the device-side state
carries from one call to the next; warm-up compiles every bucket; the call's pools stay donated in place."""
import dataclasses
import re

import jax
import numpy as np
import pytest

from v4jax import LLM, SamplingParams
from v4jax.engine import core as core_module
from v4jax.engine import steps as S

GREEDY = {"temperature": 0.0, "ignore_eos": True, "logprobs": True}
# tests/test_engine.py's tiny engine options: in one run the programs come from the persistent compilation cache
OPTIONS = {"dtype": "float32", "max_model_len": 256, "prefill_chunk": 16, "decode_steps": 4}


@pytest.fixture(scope="module")
def llm4():
    """The 4-slot engine (not warmed up: the tests that count compiles after warm-up call warmup themselves)."""
    return LLM("tiny", max_num_seqs=4, **OPTIONS)


def _count_decode_rows(eng, monkeypatch) -> list:
    """Record each dispatched decode call's (page-table rows, output rows, decode state rows)."""
    rows, decode = [], eng.steps.decode

    def counted(spec, leaves, pools, store, state, pt, swa):
        out = decode(spec, leaves, pools, store, state, pt, swa)
        rows.append((pt.shape[0], out[2].tokens.shape[0], out[3].tokens.shape[0]))
        return out

    monkeypatch.setattr(eng, "steps", dataclasses.replace(eng.steps, decode=counted))
    return rows


def _same(got, want):
    assert got.token_ids == want.token_ids
    np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-5)


def test_a_lone_request_decodes_one_row(llm4, monkeypatch):
    """Alone in a 4-slot engine a request runs decode calls of one row (its slot, 0) and gets the tokens and
    log-probs of a 1-slot engine."""
    eng = llm4.engine
    rows = _count_decode_rows(eng, monkeypatch)
    prompt = np.random.default_rng(0).integers(2, 500, 37).tolist()
    sp = SamplingParams(max_tokens=22, **GREEDY)
    got = llm4.generate([prompt], sp)[0]
    assert rows and set(rows) == {(1, 1, eng.layout.max_slots)}, rows  # the state holds every slot
    _same(got, LLM("tiny", max_num_seqs=1, **OPTIONS).generate([prompt], sp)[0])


# -m slow: in a process that ran other engines first, a call after warm-up compiled 2-4 programs more
# (this file alone compiles none); until that is explained it runs with -m slow
@pytest.mark.slow
def test_buckets_grow_and_shrink_with_the_state_carried(llm4, monkeypatch):
    """Requests arrive while others decode (prefilling meanwhile in slots above the call's rows) and finish at
    different times, so B grows from 1 to 4 and shrinks again, calls continuing the previous call's device-side
    state across changes both ways; every request gets the tokens and log-probs it gets alone. After warm-up
    nothing compiles."""
    eng = llm4.engine
    eng.warmup()
    compiled = eng.compiled_variants()
    rng = np.random.default_rng(1)
    # (arrival step, prompt length, max_tokens): into slots 0, 1, 2, then the lowest one free at step 12
    plan = [(0, 5, 60), (3, 40, 30), (6, 20, 9), (12, 3, 14)]
    prompts = [rng.integers(2, 500, n).tolist() for _, n, _ in plan]
    params = [SamplingParams(max_tokens=m, **GREEDY) for _, _, m in plan]
    calls, dispatch = [], eng._dispatch_decode

    def traced(decode_plan, prev):
        flight = dispatch(decode_plan, prev)
        if flight is not None:
            carried = bool(decode_plan.carried) and prev is not None
            calls.append((flight.rows, prev.rows if carried else None))
        return flight

    monkeypatch.setattr(eng, "_dispatch_decode", traced)
    out = {i: ([], []) for i in range(len(plan))}
    step, last = 0, max(at for at, _, _ in plan)
    while step <= last or eng.has_unfinished_requests():
        for i, (at, _, _) in enumerate(plan):
            if at == step:
                eng.add_request(f"b{i}", prompts[i], params[i], sample_index=i)
        for d in eng.step():
            toks, lps = out[int(d.request_id[1:])]
            toks += d.new_token_ids
            lps += d.new_logprobs
        step += 1
        assert step < 500
    monkeypatch.undo()
    rows = [r for r, _ in calls]
    assert {1, 2, 4} <= set(rows), calls
    carried_changes = {(prev, r) for r, prev in calls if prev is not None and prev != r}
    assert any(p < r for p, r in carried_changes) and any(p > r for p, r in carried_changes), calls
    for i, (p, sp) in enumerate(zip(prompts, params)):
        alone = llm4.generate([p], sp)[0]
        assert out[i][0] == alone.token_ids and len(alone.token_ids) == sp.max_tokens
        np.testing.assert_allclose(out[i][1], alone.logprobs, atol=1e-5)
    assert eng.compiled_variants() == compiled, "a slot bucket compiled after warm-up"


# -m slow: in a process that ran other engines first, a call after warm-up compiled 2-4 programs more
# (this file alone compiles none); until that is explained it runs with -m slow
@pytest.mark.slow
def test_warmup_compiles_every_slot_bucket(llm4):
    """Warm-up compiles each slot bucket (1, 2, 4 of 4 slots) for every page bucket, sampling and greedy; a
    generate whose decode calls cross the buckets compiles nothing more."""
    eng = llm4.engine
    eng.warmup()
    assert eng._slot_buckets() == [1, 2, 4]
    n = eng.compiled_variants()
    rng = np.random.default_rng(2)
    prompts = [rng.integers(2, 500, int(rng.integers(1, 60))).tolist() for _ in range(7)]
    params = [SamplingParams(max_tokens=int(rng.integers(1, 24)), temperature=float(rng.choice([0.0, 0.7])), seed=i)
              for i in range(7)]
    llm4.generate(prompts, params)
    assert eng.compiled_variants() == n


def test_the_call_updates_the_pools_in_place(llm4):
    """The decode call of B < S rows writes its slots' compressor states back into the donated pools: every pool
    and boundary-store buffer is aliased to an output, for each bucket as for the full one (no second copy of the
    pools), and the slots past B come back bit for bit (a prefilling request's state there is its own)."""
    from v4jax import cache as C
    eng = llm4.engine
    s = eng.layout.max_slots
    def n(dt=np.int32):
        return np.zeros((s,), dt)

    state = S.DecodeState(n(), n(), n(bool), n(), S.SamplingState.neutral(s))
    state = eng.steps.carry(state, state, n(bool))
    donated = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves((eng.pools, eng.store)))
    for rows in eng._slot_buckets():
        pt, swa = eng.kv.decode_tables(1, rows)
        compiled = eng.steps.decode.lower(eng.greedy_spec, eng._leaves, eng.pools, eng.store, state, pt,
                                          swa).compile()
        assert compiled.memory_analysis().alias_size_in_bytes == donated, rows
    # every slot's compressor states made distinct (free slots: a request starting there resets its own)
    rng = np.random.default_rng(3)
    eng.pools = dataclasses.replace(eng.pools, stacks=tuple(
        dataclasses.replace(lp, **{f: jax.numpy.asarray(rng.standard_normal(getattr(lp, f).shape), np.float32)
                                   for f in C.SLOT_FIELDS if getattr(lp, f) is not None})
        for lp in eng.pools.stacks))
    before = jax.tree.map(np.asarray, eng.pools)
    pt, swa = eng.kv.decode_tables(1, 2)  # no row active: the call changes nothing
    eng.pools, eng.store, out, end = eng.steps.decode(eng.greedy_spec, eng._leaves, eng.pools, eng.store, state, pt,
                                                      swa)
    assert out.tokens.shape == (2, eng.k) and end.tokens.shape == (s,)
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(eng.pools)):
        np.testing.assert_array_equal(a, np.asarray(b))


def test_cover_warmup_no_step_waits(monkeypatch):
    """After a warm-up of the covering programs only (prefill per row count at its longest chunk, the decode call
    over every slot, both at the widest page table), a generate of mixed lengths and sampling forms compiles
    nothing on its own thread: its steps run on covering programs while their own compile in the background.
    Once those compiles end, the same generate runs every step on its own program and gives the same tokens
    (seeded sampling included) and log-probs."""
    # steps of one row of 32 or two of 16; page tables of one page or two (the cover's)
    llm = LLM("tiny", max_num_seqs=2, **{**OPTIONS, "prefill_chunk": 32, "max_model_len": 512})
    eng = llm.engine
    assert eng.warmup(cover_only=True) == 5
    rng = np.random.default_rng(3)
    prompts = [rng.integers(2, 500, n).tolist() for n in (71, 7, 40)]
    # greedy, sampled, and greedy with top-3 alternatives (the cover's form has them)
    params = [SamplingParams(max_tokens=n, temperature=t, seed=i, logprobs=True, top_logprobs=top, ignore_eos=True)
              for i, (n, t, top) in enumerate(((9, 0.0, 0), (20, 0.7, 0), (6, 0.0, 3)))]
    before = eng.stats()["programs"]
    # every step logged as slow: what it ran, covering or its own, first run or not
    slow = []
    monkeypatch.setattr(core_module, "SLOW_STEP_S", -1.0)
    monkeypatch.setattr(core_module.log, "info", lambda msg, *a: slow.append(msg % a))
    got = llm.generate(prompts, params)
    first_generate = len(slow)
    during = eng.stats()["programs"]
    eng.programs.wait()
    after = eng.stats()["programs"]
    assert during["substituted_steps"] > 0
    assert after["compiled"] - before["compiled"] == after["background"] - before["background"] > 0, after
    again = llm.generate(prompts, params)
    assert eng.stats()["programs"]["substituted_steps"] == during["substituted_steps"]
    assert any("on a covering program" in m for m in slow[:first_generate]), slow
    assert not any("on a covering program" in m for m in slow[first_generate:]), slow
    assert sum("its first run" in m for m in slow) >= 3  # the covers' and the exact ones
    for g, w in zip(got, again):
        _same(g, w)
        assert (g.top_logprobs is None) == (w.top_logprobs is None)
        if g.top_logprobs is not None:
            assert [[i for i, _ in t] for t in g.top_logprobs] == [[i for i, _ in t] for t in w.top_logprobs]
            np.testing.assert_allclose([[v for _, v in t] for t in g.top_logprobs],
                                       [[v for _, v in t] for t in w.top_logprobs], atol=1e-5)
    assert len(got[2].top_logprobs) == 6 and all(len(t) == 3 for t in got[2].top_logprobs)


def test_a_long_prompt_compiles_its_later_programs_ahead():
    """Without covers, a prompt of several chunks crossing page buckets has the programs of its later chunks and of
    its decoding compiled in the background while its first chunk's compiles (ProgramBook.ahead), not one after
    another as its steps reach them: each one guessed ran, and none compiled twice."""
    prompt = np.random.default_rng(5).integers(2, 500, 300).tolist()
    llm = LLM("tiny", max_num_seqs=2, **{**OPTIONS, "prefill_chunk": 32, "max_model_len": 512})
    eng = llm.engine
    before = eng.stats()["programs"]
    out = llm.generate([prompt], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))[0]
    eng.programs.wait()
    after = eng.stats()["programs"]
    compiled, background = (after[k] - before[k] for k in ("compiled", "background"))
    assert len(out.token_ids) == 40
    assert compiled == after["ran"] == after["ready"] >= 4, after   # every program compiled once, and ran
    assert background == compiled - 1, after                        # all but the first chunk's, ahead


def test_warmup_checks_each_steps_memory_and_a_step_out_of_memory_says_what_to_lower(monkeypatch):
    """LLM.warmup reads XLA's memory analysis of every program it compiles and refuses an engine whose largest step
    needs more temporaries than the device has left after the weights and pools (DeviceMemoryError, naming the
    option to lower), where serving would fail at the first step of that shape; a step that does run out of device
    memory raises StepMemoryError with the same advice, not XLA's bare error."""
    from v4jax import memory as M
    from v4jax.engine import StepMemoryError
    llm = LLM("tiny", max_num_seqs=2, **{**OPTIONS, "prefill_chunk": 32, "max_model_len": 512})
    assert llm.warmup() == 5  # the device (host RAM here) has room: no error
    temps = {str(p): b for p, b in llm.engine.step_temporaries.items()}
    assert len(temps) == 5 and all(b > 0 for b in temps.values()), temps
    name, need = max(temps.items(), key=lambda kv: kv[1])
    monkeypatch.setattr(M, "device_free_bytes", lambda device=None, in_use=0: (need - 1, "a test limit"))
    option = "prefill_chunk" if name.startswith("prefill") else "max_num_seqs"
    want = rf"the step program \({re.escape(name)}\) needs .*a test limit.*lower {option}"
    with pytest.raises(M.DeviceMemoryError, match=want):
        llm.warmup()
    monkeypatch.setattr(M, "device_free_bytes", lambda device=None, in_use=0: (need, "a test limit"))
    assert llm.warmup() == 5

    def out_of_memory(plans):
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 5.25GiB with "
                                         "allocator GPU_0_bfc on device 0. [executable_name='jit__prefill']")

    monkeypatch.setattr(llm.engine, "_dispatch_prefill", out_of_memory)
    with pytest.raises(StepMemoryError, match="ran out of device memory .*5.25GiB.*lower prefill_chunk"):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2))


def test_running_requests_decode_once_every_k_prefill_steps(llm4, monkeypatch):
    """While a prompt prefills over several steps, the requests already running decode in one call every k steps
    (k tokens each: a token a prefill step on average), not beside every chunk; once no prompt prefills, a call
    every step. Each request gets the tokens it gets alone."""
    eng = llm4.engine
    rng = np.random.default_rng(4)
    a, b = rng.integers(2, 500, 5).tolist(), rng.integers(2, 500, 160).tolist()   # b: 10 chunks of 16
    sp = SamplingParams(max_tokens=40, **GREEDY)
    k = eng.scheduler.k
    calls, dispatch = [], eng._dispatch_decode
    monkeypatch.setattr(eng, "_dispatch_decode", lambda plan, prev: calls.append(plan is not None) or dispatch(
        plan, prev))
    steps, out = [], {"a": [], "b": []}
    eng.add_request("a", a, sp)
    while not eng.scheduler.running():
        out["a"] += [t for d in eng.step() for t in d.new_token_ids]
    eng.add_request("b", b, sp)
    while eng.has_unfinished_requests():
        prefilling = bool(eng.scheduler.prefilling() or eng.scheduler.waiting)
        for d in eng.step():
            out[d.request_id] += d.new_token_ids
        steps.append((prefilling, calls[-1]))
        assert len(steps) < 200
    monkeypatch.undo()
    during = "".join("d" if decoded else "-" for prefilling, decoded in steps if prefilling)
    after = [decoded for prefilling, decoded in steps if not prefilling]
    assert len(during) == 10 and during.startswith("-" * (k - 1) + "d") and "-" * k not in during, during
    assert all(after[:-1]), after   # (the last step may only read the final call)
    for rid, prompt in (("a", a), ("b", b)):
        assert out[rid] == llm4.generate([prompt], sp)[0].token_ids
