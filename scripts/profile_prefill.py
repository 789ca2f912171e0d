"""Where a prefill chunk's time goes: one `LLM.generate` of a CHUNK-token prompt (max_tokens=1) traced with the
profiler; prints the kernel families by GPU time (v4jax.bench.profile.summarize).

    python scripts/profile_prefill.py [MODEL] [CHUNK] [IMPL]     (defaults: flash-slice 8192 pallas)
"""
import json
import sys
import time

import numpy as np

from v4jax import LLM, SamplingParams
from v4jax.bench.profile import summarize

model = sys.argv[1] if len(sys.argv) > 1 else "flash-slice"
chunk = int(sys.argv[2]) if len(sys.argv) > 2 else 8192
impl = sys.argv[3] if len(sys.argv) > 3 else "pallas"
llm = LLM(model, max_num_seqs=1, max_model_len=2 * chunk, prefill_chunk=chunk, attention_impl=impl,
          enable_prefix_caching=False)
rng = np.random.default_rng(0)
sp = SamplingParams(max_tokens=1, temperature=0.0)
fresh = lambda: [rng.integers(2, llm.config.vocab_size, chunk).tolist()]
llm.generate(fresh(), sp)
t0 = time.perf_counter()
llm.generate(fresh(), sp)
wall = time.perf_counter() - t0
prof = summarize(lambda: llm.generate(fresh(), sp), repeats=1, top=25)
print(json.dumps({"model": model, "chunk": chunk, "impl": impl, "wall_s": wall,
                  "kernels": prof.get("kernels"), "kernel_ms": prof.get("kernel_ms"), "copy_ms": prof.get("copy_ms")}))
for name, n, ms in prof.get("top", []):
    print(f"{ms:9.2f} ms {n:6.0f}x  {name}")
