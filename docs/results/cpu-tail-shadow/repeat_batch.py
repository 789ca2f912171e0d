"""A batch of long distinct prompts prefilled together, then the same prompts again (what `v4jax bench spec` and
any repeated batch do): the share of each call's prompt tokens the prefix cache resumed, and the call's time.
python docs/results/cpu-tail-shadow/repeat_batch.py [BATCH] [PROMPT_TOKENS] (tiny preset, float32, CPU)."""
import json
import sys
import time

import numpy as np

from v4jax import LLM, SamplingParams

batch, length = (int(a) for a in (sys.argv[1:] or ["32", "3584"]))
llm = LLM("tiny", dtype="float32", max_num_seqs=batch, max_model_len=4096)
rng = np.random.default_rng(0)
prompts = [rng.integers(1, llm.config.vocab_size, length).tolist() for _ in range(batch)]
for call, n in enumerate([1, 33, 1, 33]):
    before = llm.stats()["prefix_cache"]
    t = time.perf_counter()
    llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    t = time.perf_counter() - t
    after = llm.stats()["prefix_cache"]
    print(json.dumps({"call": call, "max_tokens": n, "seconds": round(t, 2),
                      "hit_share": (after["hit_tokens"] - before["hit_tokens"])
                      / (after["queried_tokens"] - before["queried_tokens"]),
                      "tombstoned_tails": after["tombstoned_tails"] - before["tombstoned_tails"]}), flush=True)
