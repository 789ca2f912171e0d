"""Where a prefill's time goes: one `LLM.generate` of a PROMPT-token prompt (max_tokens=1, chunks of CHUNK tokens)
traced with the profiler; prints the kernel families by GPU time and each kernel's time per line of the model
(v4jax.bench.profile.summarize, from the compiled program of the last chunk).

    python scripts/profile_prefill.py [MODEL] [PROMPT] [CHUNK] [IMPL]   (defaults: flash-slice 131072 8192 pallas)
"""
import dataclasses
import json
import sys
import time

import jax
import numpy as np

from v4jax import LLM, SamplingParams
from v4jax.bench.profile import summarize

model = sys.argv[1] if len(sys.argv) > 1 else "flash-slice"
prompt = int(sys.argv[2]) if len(sys.argv) > 2 else 131072
chunk = int(sys.argv[3]) if len(sys.argv) > 3 else 8192
impl = sys.argv[4] if len(sys.argv) > 4 else "pallas"
llm = LLM(model, max_num_seqs=1, max_model_len=prompt + chunk, prefill_chunk=chunk, attention_impl=impl,
          enable_prefix_caching=False)
rng = np.random.default_rng(0)
sp = SamplingParams(max_tokens=1, temperature=0.0)
fresh = lambda: [rng.integers(2, llm.config.vocab_size, prompt).tolist()]
t0 = time.perf_counter()
llm.generate(fresh(), sp)
first = time.perf_counter() - t0

t0 = time.perf_counter()
llm.generate(fresh(), sp)
second = time.perf_counter() - t0

# the last prefill call's arguments (kept as they are: converting them per call cost ~100 ms a call), to compile
# its program's text
eng, seen = llm.engine, {}
jitted = eng.steps.prefill


def recording(spec, *args):
    seen["args"] = (spec,) + args
    return jitted(spec, *args)


eng.steps = dataclasses.replace(eng.steps, prefill=recording)
t0 = time.perf_counter()
llm.generate(fresh(), sp)
wall = time.perf_counter() - t0   # the third call: the second can be slow on a GPU (BENCHMARKS, "Repeated calls")
print(f"generate: first {first:.2f} s, second {second:.2f} s, third {wall:.3f} s", flush=True)
eng.steps = dataclasses.replace(eng.steps, prefill=jitted)
abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding)
                        if isinstance(a, jax.Array) else a, seen["args"][1:])
hlo = jitted.lower(seen["args"][0], *abstract).compile().as_text()
prof = summarize(lambda: llm.generate(fresh(), sp), repeats=1, top=40, hlo_text=hlo)
print(json.dumps({"model": model, "prompt": prompt, "chunk": chunk, "impl": impl, "first_s": first, "second_s": second,
                  "wall_s": wall,
                  "compiled_variants": jitted._cache_size(),
                  "kernels": prof.get("kernels"), "kernel_ms": prof.get("kernel_ms"), "copy_ms": prof.get("copy_ms")}))
for name, n, ms in prof.get("top", []):
    print(f"{ms:9.2f} ms {n:6.0f}x  {name}")
print("by line of the model:")
for name, n, ms in prof.get("by_source", []):
    print(f"{ms:9.2f} ms {n:6.0f}x  {name}")
