"""Times three identical `LLM.generate` calls (a 16-token prompt, 16 new tokens) and logs every jit cache miss
and compile with its reason (JAX's explain-cache-misses), to find what a call after the first still traces or
compiles.

    python scripts/check_repeat_generate.py [MODEL] [IMPL]      (defaults: flash-slice pallas)
"""
import logging
import sys
import time

import jax
import numpy as np

jax.config.update("jax_explain_cache_misses", True)
jax.config.update("jax_log_compiles", True)
logging.basicConfig(stream=sys.stdout, level=logging.WARNING, format="%(message)s")

from v4jax import LLM, SamplingParams  # noqa: E402

model = sys.argv[1] if len(sys.argv) > 1 else "flash-slice"
impl = sys.argv[2] if len(sys.argv) > 2 else "pallas"
llm = LLM(model, max_num_seqs=1, max_model_len=4096, attention_impl=impl)
rng = np.random.default_rng(0)
sp = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
for i in range(3):
    print(f"==== generate call {i}", flush=True)
    t0 = time.perf_counter()
    llm.generate([rng.integers(2, llm.config.vocab_size, 16).tolist()], sp)
    print(f"==== generate call {i}: {time.perf_counter() - t0:.2f} s", flush=True)
