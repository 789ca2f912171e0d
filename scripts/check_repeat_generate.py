"""Times four identical `LLM.generate` calls (a 16-token prompt, 16 new tokens), logs every compile, and prints
how the arguments and the trace context (JAX's config states that key its caches) of each call's first prefill
differ from the first call's: a difference there is what makes a later call compile again. (JAX's
explain-cache-misses is left off: on JAX 0.11.2 with it on, lowering a Pallas Triton kernel's reduction fails.)

    python scripts/check_repeat_generate.py [MODEL] [IMPL]      (defaults: flash-slice pallas)
"""
import dataclasses
import logging
import sys
import time

import jax
import numpy as np
from jax._src import config as jax_config

jax.config.update("jax_log_compiles", True)
logging.basicConfig(stream=sys.stdout, level=logging.WARNING, format="%(message)s")

from v4jax import LLM, SamplingParams  # noqa: E402

model = sys.argv[1] if len(sys.argv) > 1 else "flash-slice"
impl = sys.argv[2] if len(sys.argv) > 2 else "pallas"
llm = LLM(model, max_num_seqs=1, max_model_len=4096, attention_impl=impl)
eng = llm.engine
jitted = eng.steps.prefill
signatures = []


def describe(leaf):
    if not isinstance(leaf, jax.Array):
        return ("python", type(leaf).__name__, leaf if np.isscalar(leaf) else None)
    return (str(jax.typeof(leaf)), str(leaf.sharding), leaf.committed, str(leaf.format.layout))


def recording(spec, *args):
    paths, _ = jax.tree_util.tree_flatten_with_path(args)
    context = {f"config {n}": str(c) for n, c in zip(jax_config.trace_context_names(), jax_config.trace_context())}
    leaves = {jax.tree_util.keystr(p): describe(x) for p, x in paths}
    signatures.append({"spec": (hash(spec), id(spec)), **context, **leaves})
    return jitted(spec, *args)


eng.steps = dataclasses.replace(eng.steps, prefill=recording)
rng = np.random.default_rng(0)
sp = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
firsts = []
for i in range(4):
    print(f"==== generate call {i}", flush=True)
    firsts.append(len(signatures))
    t0 = time.perf_counter()
    llm.generate([rng.integers(2, llm.config.vocab_size, 16).tolist()], sp)
    print(f"==== generate call {i}: {time.perf_counter() - t0:.2f} s; prefill variants {jitted._cache_size()}",
          flush=True)
for i in range(1, 4):
    a, b = signatures[firsts[0]], signatures[firsts[i]]
    diff = [(k, a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
    print(f"==== prefill arguments of call {i} vs call 0: {len(diff)} of {len(b)} differ")
    for k, x, y in diff[:20]:
        print(f"  {k}\n    call 0: {x}\n    call {i}: {y}")
