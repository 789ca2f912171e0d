"""`v4jax serve` with speculative decoding (the default model drafting with its own MTP head, k = 2): greedy
completions, streamed and not, equal plain decoding's text through the `openai` client; sampled streams with a
quarter of the clients leaving mid-stream end with every page free; /metrics counts the drafts."""
import asyncio
import json

import httpx
import numpy as np
import pytest

from test_serve import KEY, MODEL, _all_pages_free, _idle_and_free, _metrics, _start
from v4jax import LLM, SamplingParams
from v4jax.serve.app import ServerState
from v4jax.serve.options import ServerOptions

pytestmark = pytest.mark.slow  # a speculative engine to compile (minutes on CPU); -m slow

PROMPTS = ["ROMEO:", "JULIET:", "First Citizen:\nBefore we proceed any further, hear me speak."]
MAX_TOKENS = 24
OPTIONS = dict(max_model_len=512, prefill_chunk=16, decode_steps=6)
SPEC = {"method": "mtp", "num_speculative_tokens": 2}


@pytest.fixture(scope="module")
def served():
    plain = LLM(**OPTIONS)
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    refs = [o.text for o in plain.generate(PROMPTS, greedy)]
    del plain
    llm = LLM(speculative_config=SPEC, **OPTIONS)
    opts = ServerOptions(api_key=KEY, log_level="warning", access_log=False, max_waiting=64, max_n=4,
                         max_body_bytes=64 << 10, request_timeout_s=300.0)
    state = ServerState(llm, opts).start()
    server, thread, url = _start(state)
    http = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=300)
    yield state, url, http, refs
    http.close()
    server.shutdown_now()
    thread.join(30)
    state.orchestrator.stop()


def test_greedy_text_equals_plain_decoding(served):
    from openai import OpenAI
    state, url, http, refs = served
    client = OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=300)
    before = _metrics(http)
    for prompt, ref in zip(PROMPTS, refs):
        done = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0,
                                         extra_body={"ignore_eos": True})
        assert done.choices[0].text == ref
        stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0,
                                           stream=True, extra_body={"ignore_eos": True})
        assert "".join(c.choices[0].text for c in stream) == ref
    after = _metrics(http)
    drafts = after["v4jax_spec_decode_num_drafts_total"] - before.get("v4jax_spec_decode_num_drafts_total", 0)
    accepted = after["v4jax_spec_decode_num_accepted_tokens_total"] - \
        before.get("v4jax_spec_decode_num_accepted_tokens_total", 0)
    assert drafts > 0 and accepted > 0  # the trained head's drafts are kept about half the time


def test_sampled_streams_with_disconnects_free_every_page(served):
    state, url, http, _ = served
    n = 16
    rng = np.random.default_rng(0)
    leave = set(rng.choice(n, n // 4, replace=False).tolist())

    async def one(client, i):
        body = {"model": MODEL, "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": MAX_TOKENS, "temperature": 0.8,
                "seed": i, "ignore_eos": True, "stream": True, "return_token_ids": True}
        tokens, done = 0, False
        async with client.stream("POST", "/v1/completions", json=body) as r:
            status = r.status_code
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                    break
                if line.startswith("data: "):
                    tokens += len(json.loads(line[6:])["choices"][0]["token_ids"])
                    if i in leave and tokens >= 4:
                        break  # leaving the block closes the connection mid-stream
        return status, tokens, done

    async def run():
        async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {KEY}"},
                                     limits=httpx.Limits(max_connections=n + 4), timeout=300) as client:
            return await asyncio.gather(*(one(client, i) for i in range(n)))

    results = asyncio.run(run())
    assert [s for s, *_ in results] == [200] * n
    for i, (_, tokens, done) in enumerate(results):
        if i not in leave:
            assert (tokens, done) == (MAX_TOKENS, True), i
    assert _idle_and_free(state, timeout=120)
    assert state.orchestrator.run_on_engine(lambda e: _all_pages_free(e.core)).result(10)
