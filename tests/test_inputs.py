"""Inputs are checked where they enter: SamplingParams at construction, LLM.generate's prompts before the engine
is built (no model step runs for a bad request)."""
import numpy as np
import pytest

from v4jax import LLM, SamplingParams


@pytest.mark.parametrize("bad", ["12", [1.7], ["a"], [None], 5, [10**12], [-1], [True], {1, 2}, [[1]]])
def test_stop_token_ids_rejected_at_construction(bad):
    with pytest.raises(ValueError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=bad)


def test_stop_token_ids_accepted_forms():
    assert SamplingParams(stop_token_ids=[3, 4]).stop_token_ids == (3, 4)
    assert SamplingParams(stop_token_ids=(np.int64(7),)).stop_token_ids == (7,)
    assert SamplingParams(stop_token_ids=np.array([1, 2])).stop_token_ids == (1, 2)
    assert SamplingParams(stop_token_ids=None).stop_token_ids == ()
    assert SamplingParams(stop_token_ids=[2**31 - 1]).stop_token_ids == (2**31 - 1,)


@pytest.mark.parametrize("kwargs,name", [
    (dict(max_tokens=True), "max_tokens"), (dict(max_tokens=2.0), "max_tokens"), (dict(max_tokens="3"), "max_tokens"),
    (dict(top_k=False), "top_k"), (dict(top_k=1.5), "top_k"), (dict(seed=True), "seed"), (dict(seed=1.0), "seed"),
    (dict(seed=2**31), "seed"), (dict(seed=-2**31 - 1), "seed"), (dict(temperature=True), "temperature"),
    (dict(temperature="0"), "temperature"), (dict(top_p=True), "top_p"), (dict(logprobs=1), "logprobs"),
    (dict(ignore_eos="yes"), "ignore_eos"), (dict(temperature=float("inf")), "temperature"),
])
def test_sampling_params_types(kwargs, name):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kwargs)


def test_sampling_params_defaults_and_int32_seeds():
    sp = SamplingParams()
    assert (sp.max_tokens, sp.temperature, sp.top_p, sp.top_k, sp.seed) == (16, 1.0, 1.0, 0, None)
    assert SamplingParams(seed=np.int64(5)).seed == 5 and isinstance(SamplingParams(seed=np.int64(5)).seed, int)
    for s in (2**31 - 1, -2**31):
        assert np.asarray([SamplingParams(seed=s).resolved_seed()], np.int32)[0] == s  # fits the device's int32
    assert 0 <= SamplingParams().resolved_seed() < 2**31


@pytest.fixture(scope="module")
def llm():
    with pytest.warns(UserWarning, match="random weights"):
        return LLM("tiny", dtype="float32", max_model_len=64, max_num_seqs=2)


@pytest.mark.parametrize("prompts", [None, 123, 1.5, b"bytes", {"a": 1}])
def test_generate_rejects_what_is_not_a_prompt(llm, prompts):
    with pytest.raises(TypeError, match="prompts must be a string, a list of token ids"):
        llm.generate(prompts)
    assert llm._engine is None


def test_generate_prompt_errors_name_the_prompt(llm):
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        llm.generate([[1, 2], []])
    with pytest.raises(TypeError, match="prompt 0 must be a string or a list of token ids"):
        llm.generate([None])
    with pytest.raises(TypeError, match="prompt 1: token ids must be integers"):
        llm.generate([[1, 2], [1, 2.5]])
    with pytest.raises(TypeError, match="token ids must be integers"):
        llm.generate([True, False])
    with pytest.raises(ValueError, match="prompt 0: token ids .* outside the vocabulary"):
        llm.generate([[1, 10**6]])
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.generate("hello")
    with pytest.raises(TypeError, match="sampling must be a SamplingParams"):
        llm.generate([[1, 2]], {"max_tokens": 3})
    with pytest.raises(ValueError, match="2 sampling params for 1 prompts"):
        llm.generate([[1, 2]], [SamplingParams(), SamplingParams()])
    assert llm.generate([]) == []
    assert llm._engine is None


def test_max_tokens_past_the_context_names_both_numbers(llm):
    with pytest.raises(ValueError, match=r"prompt 1: prompt_len=60 \+ max_tokens=16 = 76 tokens exceed the context "
                                         r"limit max_model_len=64.*at most 4"):
        llm.generate([[1, 2], list(range(60))])
    with pytest.raises(ValueError, match="prompt_len=70 .*max_model_len=64"):
        llm.generate([list(range(70))], SamplingParams(max_tokens=1))
    assert llm._engine is None


def test_empty_string_prompt_is_rejected(tmp_path):
    """With a tokenizer "" would encode to [BOS] alone: it is an empty prompt all the same (as in vLLM)."""
    llm = LLM(max_model_len=64, max_num_seqs=1)  # the embedded model (ships a tokenizer)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        llm.generate(["ROMEO:", ""])
    assert llm._engine is None
