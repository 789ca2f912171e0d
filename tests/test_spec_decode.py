"""Speculative decoding with the MTP block: greedy outputs equal the teacher-forced forward (what plain greedy
decoding gives, test_engine.py) token for token with log-probs within 1e-5, whatever the drafts: the MTP block's,
and drafts forced right, wrong or mixed per slot, so that every acceptance length runs. Prompts of mixed lengths
cross C4 and HCA windows and full pages during decode; a later request resumes from a page boundary that a
speculative step crossed (its saved compressor state)."""
import dataclasses

import numpy as np
import pytest

import hf_reference as H
from checkpoints import write_official_checkpoint
from v4jax import LLM, SamplingParams
from v4jax.fields import FieldError

GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, logprobs=True)
LENS = (5, 19, 30, 45)
# tiny: window 8, CSA ratio 4, HCA ratio 16; pages of 32 tokens, so that prefixes hit and decode crosses pages
OPTIONS = dict(dtype="float32", max_num_seqs=4, max_model_len=128, prefill_chunk=16, decode_steps=8, page_size=32)


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


def _forced_drafts(llm, prompts, outs, seed=1):
    """A [slots, positions] draft table: slot i (request i, admitted into slot i) drafts its true continuation
    (slot 0), the true one with a wrong token at random positions (slots 1, 3), or always a wrong one (slot 2)."""
    rng = np.random.default_rng(seed)
    v, n = llm.config.vocab_size, llm.max_model_len
    table = np.zeros((llm.options.max_num_seqs, n), np.int32)
    for i, (p, o) in enumerate(zip(prompts, outs)):
        seq = np.asarray(list(p) + o.token_ids, np.int32)
        wrong = {0: np.zeros(len(seq), bool), 2: np.ones(len(seq), bool)}.get(i, rng.random(len(seq)) < 0.3)
        table[i, :len(seq)] = np.where(wrong, (seq + 1) % v, seq)
    return table


def _check_k(llm):
    prompts = _prompts(LENS, llm.config.vocab_size)
    outs = llm.generate(prompts, GREEDY)
    for p, o in zip(prompts, outs):
        assert len(o.token_ids) == GREEDY.max_tokens
        _assert_teacher_forced(llm, p, o)
    st = llm.stats()["spec_decode"]
    k = llm.options.num_speculative_tokens
    assert st["num_drafts"] > 0 and st["num_draft_tokens"] == k * st["num_drafts"]
    assert st["num_accepted_tokens"] == sum(st["accepted_by_position"])

    # Forced drafts, the same prompts again (now with prefix hits on their cached full pages): the same outputs,
    # every acceptance length exercised
    core = llm.engine
    plain = core.greedy_spec
    core.greedy_spec = dataclasses.replace(plain, draft_table=_forced_drafts(llm, prompts, outs))
    try:
        hits = llm.stats()["prefix_cache"]["hit_tokens"]
        forced = llm.generate(prompts, GREEDY)
        assert llm.stats()["prefix_cache"]["hit_tokens"] > hits
    finally:
        core.greedy_spec = plain
    for a, b in zip(outs, forced):
        assert a.token_ids == b.token_ids
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
    after = llm.stats()["spec_decode"]
    by_pos = np.subtract(after["accepted_by_position"], st["accepted_by_position"])
    assert by_pos[-1] > 0, by_pos  # whole drafts accepted (slot 0)
    rounds = after["num_drafts"] - st["num_drafts"]
    assert by_pos[0] < rounds  # some rejected at the first position (slots 1-3)

    # A request resuming at a page boundary that a speculative step crossed (page 64 of the longest request,
    # reached while decoding): its prompt is that request's sequence and more
    seq = prompts[3] + outs[3].token_ids
    hits = llm.stats()["prefix_cache"]["hit_tokens"]
    (o,) = llm.generate([seq[:70]], dataclasses.replace(GREEDY, max_tokens=12))
    assert llm.stats()["prefix_cache"]["hit_tokens"] - hits == 64
    assert o.token_ids == outs[3].token_ids[25:37]
    _assert_teacher_forced(llm, seq[:70], o)


@pytest.fixture(scope="module")
def llm3():
    return _spec_llm(3)


def test_greedy_with_speculation_equals_teacher_forced(llm3):
    _check_k(llm3)


@pytest.mark.slow
@pytest.mark.parametrize("k", [1, 7])
def test_greedy_with_speculation_other_k(k):
    _check_k(_spec_llm(k))


def test_sampled_rows_seeded_reproducible(llm3):
    prompts = _prompts((6, 21), llm3.config.vocab_size, seed=3)
    sp = SamplingParams(max_tokens=12, temperature=0.9, seed=7, ignore_eos=True)
    a = llm3.generate(prompts, sp)
    b = llm3.generate(prompts, sp)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]


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
