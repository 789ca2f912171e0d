"""Sharding leaves greedy outputs unchanged (fake CPU devices, in a subprocess: the device count is fixed at
JAX start-up)."""
import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import jax, numpy as np
    jax.config.update("jax_default_matmul_precision", "highest")
    from v4jax import LLM, SamplingParams
    from sharding import make_mesh
    assert len(jax.devices()) == 8
    prompts = [[3, 4, 5] * 9, [7, 8] * 20, [11]]
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=True)
    ref = LLM("tiny", dtype="float32", max_num_seqs=4, max_model_len=128, prefill_chunk=32)
    base = ref.generate(prompts, sp)
    llm = LLM("tiny", dtype="float32", max_num_seqs=4, max_model_len=128, prefill_chunk=32, mesh="data=2,expert=4")
    w1 = llm.model.stacks[1].ffn.experts.w1[...]  # [layers of the stack, experts, I, D]
    assert len(w1.sharding.device_set) == 8 and w1.sharding.spec[1] == "expert", w1.sharding
    st = llm.engine.pools.stacks[1].state_kv  # [layers of the stack, slots, ...]
    assert st.sharding.spec[1] == "data", st.sharding
    outs = llm.generate(prompts, sp)
    for a, b in zip(base, outs):
        assert a.token_ids == b.token_ids, (a.token_ids, b.token_ids)
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
    try:
        make_mesh("tensor=16")
    except ValueError as e:
        assert "16 devices" in str(e)
    print("SHARDED-OK")
""")


def test_sharded_engine_equals_single_device():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-c", SCRIPT], env=env, cwd=root, capture_output=True, text=True, timeout=900)
    assert "SHARDED-OK" in r.stdout, r.stderr[-3000:]
