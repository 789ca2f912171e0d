"""Steps until each request's first token when requests sharing a long document arrive while its first reader is
still prefilling it, followed by unrelated short requests. CPU, the tiny preset in float32, 8 slots, the default
prefill step of 2,048 tokens: the document (3,000 tokens) takes two steps, the second with room for others. Engine
steps are deterministic, so the step counts are the measure: python docs/results/cpu-admission/burst_behind_doc.py"""
import numpy as np

from v4jax import LLM, SamplingParams

llm = LLM("tiny", dtype="float32", max_num_seqs=8, max_model_len=4096)
eng = llm.engine
rng = np.random.default_rng(0)
doc = rng.integers(2, 500, 3000).tolist()
sp = SamplingParams(max_tokens=4, ignore_eos=True)
eng.add_request("reader", doc + [7], sp)
eng.step()  # the reader starts: its first 2,048 tokens are computed
for i in range(3):  # questions on the same document
    eng.add_request(f"same_doc{i}", doc + [8 + i], sp)
for i in range(4):  # unrelated short requests right behind them
    eng.add_request(f"other{i}", rng.integers(2, 500, 40).tolist(), sp)
first, step = {}, 1
while eng.has_unfinished_requests():
    step += 1
    for d in eng.step():
        if d.new_token_ids and d.request_id not in first:
            first[d.request_id] = step
for rid in sorted(first, key=first.get):
    print(f"{rid:10s} first token at step {first[rid]}")
hits = eng.stats()["prefix_cache"]
print(f"prefix cache: {hits['hit_tokens']} of {hits['queried_tokens']} prompt tokens hit")
