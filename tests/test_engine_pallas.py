"""attention_impl="pallas" (kernels in interpret mode on CPU) gives the XLA path's greedy outputs in the engine."""
import numpy as np

from v4jax import LLM, SamplingParams


def test_pallas_engine_equals_xla():
    prompts = [[3, 4, 5] * 7, [9] * 40]  # crosses CSA (4) and HCA (16) windows in prefill and decode
    sp = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=True)
    outs = {}
    for impl in ("xla", "pallas"):
        llm = LLM("tiny", dtype="float32", max_num_seqs=2, max_model_len=128, prefill_chunk=32, decode_steps=4,
                  attention_impl=impl)
        outs[impl] = llm.generate(prompts, sp)
    for a, b in zip(outs["xla"], outs["pallas"]):
        assert a.token_ids == b.token_ids
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
