"""`v4jax serve`: the real server (uvicorn on a free local port, in a thread) over the embedded default model,
driven by the official `openai` client and plain httpx.

One server for the module (compiling the engine's buckets is most of the cost): prefill chunks of 8 tokens, and
prompts of at most 8 tokens or chat prompts of 16, so every chunk uses one prefill bucket; every request stays
inside one 256-token page (one page bucket); 4 decode slots (slot buckets 1, 2 and 4, greedy and sampling, each
compiled once and used by several tests). The shutdown test runs last: it stops the shared server."""
import asyncio
import json
import time
import types

import httpx
import numpy as np
import pytest

from v4jax import LLM, SamplingParams
from v4jax.serve.app import ServerState
from v4jax.serve.chat import DEFAULT_MODEL_TEMPLATE, ChatTemplate, TemplateError
from v4jax.detokenize import IncrementalDetokenizer, SequenceText
from v4jax.serve.options import ServerOptions

import serving

KEY = "test-key-0123"
MODEL = "v4jax-shakespeare"
PROMPTS = ["ROMEO:", "JULIET:"]
MAX_TOKENS = 8
LOAD_CLIENTS, LOAD_TOKENS = 64, 8
SLOTS = 4


def _all_pages_free(core) -> bool:
    """No slot maps a page, and once the prefix cache lets go of its pages every page is free."""
    core.kv.reset_prefix_cache()
    return core.kv.all_free() and all(s is None for s in core.scheduler.slots)


def _start(state: ServerState):
    # uvicorn closes a connection idle for 5 s (timeout_keep_alive); a client sending on it at that moment gets "Server
    # disconnected without sending a response" (seen once in a loaded CI run, the clients here do not retry)
    server, thread, port = serving.start(state, timeout_keep_alive=600)
    return server, thread, f"http://127.0.0.1:{port}"


PENALTIES = dict(presence_penalty=1.0, frequency_penalty=2.0, repetition_penalty=1.5)


@pytest.fixture(scope="module")
def served():
    llm = LLM(max_model_len=512, prefill_chunk=8, decode_steps=2, max_num_seqs=SLOTS)
    # references before the server owns the engine (only its thread may drive it afterwards)
    refs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=True))
    alone = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=True))[0]
    penalized = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, **PENALTIES))[0]
    streamed = {i: [] for i in range(len(PROMPTS))}
    for i, _, text in llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0), stream=True):
        streamed[i].append(text)
    opts = ServerOptions(api_key=KEY, log_level="warning", access_log=False, max_waiting=64, max_n=4,
                         max_body_bytes=64 << 10, request_timeout_s=120.0)
    state = ServerState(llm, opts).start()
    server, thread, url = _start(state)
    http = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120)
    yield types.SimpleNamespace(llm=llm, refs=refs, alone=alone, streamed=streamed, state=state, server=server,
                                thread=thread, url=url, http=http, penalized=penalized)
    http.close()
    server.shutdown_now()
    thread.join(30)
    state.orchestrator.stop()


@pytest.fixture(scope="module")
def client(served):
    from openai import OpenAI
    return OpenAI(base_url=served.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def _idle_and_free(state, timeout: float = 30.0) -> bool:
    """Wait for the engine to finish everything and the server to release every sequence (its last results
    read, its finish counted), then check (on the engine's thread) that every page is free."""
    deadline = time.monotonic() + timeout
    orch = state.orchestrator
    while time.monotonic() < deadline:
        if orch.stats()["server"]["in_flight"] == 0 and \
                orch.run_on_engine(lambda e: not e.has_unfinished_requests()).result(10):
            return orch.run_on_engine(lambda e: _all_pages_free(e.core)).result(10)
        time.sleep(0.05)
    return False


def _metrics(http) -> dict:
    out = {}
    for line in http.get("/metrics").text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def _sse(lines) -> tuple[list, bool]:
    chunks, done = [], False
    for line in lines:
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            done = True
            break
        chunks.append(json.loads(line[6:]))
    return chunks, done


# ---- pieces without a server ----
def test_incremental_detokenizer_matches_a_full_decode():
    from tokenizers import Tokenizer

    from v4jax.api import DEFAULT_MODEL_DIR
    # the shipped tokenizer: byte-level BPE, multi-byte characters split across tokens
    llm_tok = Tokenizer.from_file(f"{DEFAULT_MODEL_DIR}/tokenizer.json")
    text = "ROMEO: héllo wörld — naïve 😀 fin."
    ids = llm_tok.encode(text).ids
    decode = lambda xs: llm_tok.decode(list(xs), skip_special_tokens=True)
    d = IncrementalDetokenizer(decode)
    pieces = [d.push(t) for t in ids] + [d.flush()]
    assert "".join(pieces) == decode(ids)
    assert not any("\ufffd" in p for p in pieces)


def test_generate_streams_the_text_of_the_result(served):
    # LLM.generate(stream=True) detokenizes incrementally; its pieces make up the non-streamed text
    assert ["".join(served.streamed[i]) for i in range(len(PROMPTS))] == [r.text for r in served.refs]
    assert all(len(pieces) > 1 for pieces in served.streamed.values())


def test_finish_reasons_are_openai_values():
    """The engine's "abort" (a shutdown cut the sequence short) leaves the OpenAI endpoints as "length"."""
    from v4jax.serve.openai import finish_reason
    assert [finish_reason(r) for r in (None, "stop", "length", "abort")] == [None, "stop", "length", "length"]


def test_stop_strings_match_across_tokens_and_are_never_sent():
    toks = ["Hel", "lo, w", "or", "ld! ", "Bye"]
    decode = lambda ids: "".join(toks[i] for i in ids)
    st = SequenceText(decode, stop=["world"])
    sent = [st.push([0, 1]), st.push([2]), st.push([3, 4])]
    assert "".join(p.text for p in sent) == "Hello, "
    assert sent[-1].stopped and sent[-1].token_ids == [3]  # "ld! " completed it; "Bye" is dropped
    st = SequenceText(decode, stop=["xyz"])
    out = [st.push([i], final=i == 4) for i in range(5)]
    assert "".join(p.text for p in out) == "Hello, world! Bye" and not any(p.stopped for p in out)
    assert all("xyz"[:2] not in p.text for p in out[:-1])


def test_stop_strings_count_from_min_tokens_on():
    """vLLM's rule: before min_tokens tokens a stop string is text like any other; from then on a stop string
    ending in new text stops the sequence."""
    toks = ["a", "STOP", "b", "c", "STOP", "d"]
    decode = lambda ids: "".join(toks[i] for i in ids)
    st = SequenceText(decode, stop=["STOP"], min_tokens=3)
    out = [st.push([i]) for i in range(6)]
    assert "".join(p.text for p in out) == "aSTOPbc" and out[4].stopped and out[4].token_ids == [4]
    assert not any(p.stopped for p in out[:4])
    st = SequenceText(decode, stop=["STOP"])
    assert st.push([0, 1, 2]).stopped


def test_stop_strings_kept_in_the_text_on_request():
    """vLLM's include_stop_str_in_output: the text ends after the stop string, the earliest one found."""
    toks = ["Hel", "lo, w", "or", "ld! ", "Bye"]
    decode = lambda ids: "".join(toks[i] for i in ids)
    st = SequenceText(decode, stop=["! B", "world"], include_stop=True)
    sent = [st.push([i]) for i in range(5)]
    assert "".join(p.text for p in sent) == "Hello, world" and sent[3].stopped


def test_chat_templates_render_as_transformers_does(tmp_path):
    tpl = ("{% for m in messages %}{% if m['role'] == 'user' and loop.index0 % 2 == 1 %}"
           "{{ raise_exception('roles must alternate') }}{% endif %}"
           "<|{{ m['role'] }}|>{{ m['content'] | tojson }}\n{% endfor %}"
           "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": tpl, "bos_token": {"content": "<s>"}, "eos_token": "</s>"}))
    t = ChatTemplate.from_model_dir(str(tmp_path))
    assert t.special_tokens == {"bos_token": "<s>", "eos_token": "</s>"}
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "assistant", "content": "ok"}]
    assert t.render(msgs) == '<|system|>"Be brief."\n<|assistant|>"ok"\n<|assistant|>'
    with pytest.raises(TemplateError, match="alternate"):
        t.render([{"role": "system", "content": "a"}, {"role": "user", "content": "b"}])
    (tmp_path / "chat_template.jinja").write_text("{{ bos_token }}{{ messages[0]['content'] }}")
    assert ChatTemplate.from_model_dir(str(tmp_path)).render([{"role": "user", "content": "x"}]) == "<s>x"
    assert ChatTemplate.from_model_dir(str(tmp_path / "missing")) is None
    d = ChatTemplate(DEFAULT_MODEL_TEMPLATE, {"bos_token": "<B>"})
    assert d.render([{"role": "system", "content": "A play."}, {"role": "user", "content": "Hi"}]) == \
        "<B>A play.\n\nUSER:\nHi\n\nASSISTANT:\n"


# ---- OpenAI endpoints through the official client ----
def test_models_lists_the_default_model(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_greedy_completion_equals_llm_generate(served, client):
    r = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0)
    ref = served.refs[0]
    assert r.choices[0].text == ref.text
    assert r.choices[0].finish_reason == ref.finish_reason
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ref.prompt_token_ids), len(ref.token_ids))
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_min_p_reaches_the_sampler(served, client):
    """vLLM's `min_p` (an extra field): at 1 only the most likely token survives, so a hot, seeded sample is the
    greedy text; without it the same seed's text differs (so the first assertion can fail)."""
    ask = lambda **extra: client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=MAX_TOKENS,
                                                    temperature=2.0, seed=5, extra_body=extra).choices[0].text
    assert ask(min_p=1.0) == served.refs[0].text
    assert ask() != served.refs[0].text


def test_logit_bias_reaches_the_sampler(served, client):
    """OpenAI's `logit_bias` (ids as strings): +100 on one token makes it every token of a greedy completion."""
    r = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4, temperature=0,
                                  logit_bias={"17": 100}, extra_body={"return_token_ids": True})
    assert r.choices[0].model_extra["token_ids"] == [17] * 4


def test_penalties_reach_the_sampler(served, client):
    """OpenAI's presence / frequency penalties and vLLM's repetition penalty (an extra field): the greedy completion
    is LLM.generate's with the same penalties, which differs from the one without."""
    r = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0,
                                  presence_penalty=PENALTIES["presence_penalty"],
                                  frequency_penalty=PENALTIES["frequency_penalty"],
                                  extra_body={"return_token_ids": True,
                                              "repetition_penalty": PENALTIES["repetition_penalty"]})
    assert r.choices[0].model_extra["token_ids"] == served.penalized.token_ids
    assert served.penalized.token_ids != served.refs[0].token_ids


def test_min_tokens_reaches_the_sampler(served, client):
    """vLLM's `min_tokens`: the greedy completion's first token as a stop id ends it at once; with min_tokens it is
    held back until then, and a stop string of the reference's text counts only from min_tokens on."""
    first = served.refs[0].token_ids[0]
    ask = lambda **extra: client.completions.create(  # noqa: E731
        model=MODEL, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0,
        extra_body={"return_token_ids": True, "stop_token_ids": [first], **extra}).choices[0]
    assert ask().model_extra["token_ids"] == [first]
    held = ask(min_tokens=MAX_TOKENS)
    assert first not in held.model_extra["token_ids"] and len(held.model_extra["token_ids"]) == MAX_TOKENS
    text = served.refs[0].text
    cut = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0,
                                    stop=[text[:2]], extra_body={"min_tokens": MAX_TOKENS}).choices[0]
    assert cut.text == text and cut.finish_reason == "length"


def test_include_stop_str_in_output(served, client):
    """A stop string of the reference's text ends the completion before it, or with `include_stop_str_in_output`
    after it."""
    text = served.refs[0].text
    stop = text[3:6]
    at = text.index(stop)
    ask = lambda **extra: client.completions.create(  # noqa: E731
        model=MODEL, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0, stop=[stop], extra_body=extra).choices[0]
    assert ask().text == text[:at]
    kept = ask(include_stop_str_in_output=True)
    assert kept.text == text[:at + len(stop)] and kept.finish_reason == "stop"


def test_streamed_completion_with_usage(served, client):
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == served.refs[1].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == MAX_TOKENS
    assert all(c.usage is None for c in chunks[:-1])


def test_streamed_usage_on_every_chunk(served, client):
    """vLLM's `continuous_usage_stats`: every chunk carries the usage so far, the last one the whole."""
    chunks = list(client.completions.create(
        model=MODEL, prompt=PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    used = [c.usage.completion_tokens for c in chunks]
    assert used == sorted(used) and used[-1] == MAX_TOKENS and all(u > 0 for u in used)
    assert len({c.usage.prompt_tokens for c in chunks}) == 1


def test_token_prompts_lists_of_prompts_and_n(served, client):
    ids = [r.prompt_token_ids for r in served.refs]
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=MAX_TOKENS, temperature=0, n=2,
                                  extra_body={"return_token_ids": True})
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    for c in r.choices:  # choice i * n + j: prompt i, sample j
        ref = served.refs[c.index // 2]
        assert c.text == ref.text and c.model_extra["token_ids"] == ref.token_ids
    assert r.usage.prompt_tokens == sum(len(p) for p in ids)
    assert r.usage.completion_tokens == 4 * MAX_TOKENS
    r = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=MAX_TOKENS, temperature=0)
    assert [c.text for c in r.choices] == [ref.text for ref in served.refs]


def _boundary_stop(served, ref) -> str:
    """A stop string made of the end of one token's text and the start of the next's."""
    pieces = [served.state.codec.token_text(t) for t in ref.token_ids]
    i = next(i for i in range(len(pieces) - 1) if pieces[i] and pieces[i + 1])
    return pieces[i][-1] + pieces[i + 1][0]


def test_stop_strings_cut_the_text_before_them(served, client):
    ref = served.refs[0]
    stop = _boundary_stop(served, ref)
    want = ref.text[:ref.text.find(stop)]
    r = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0,
                                  stop=[stop, "no such text"])
    assert (r.choices[0].text, r.choices[0].finish_reason) == (want, "stop")
    assert r.usage.completion_tokens < MAX_TOKENS
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0,
                                            stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert _idle_and_free(served.state)  # the engine's sequence was aborted when the stop string matched


def test_logprobs_in_openai_shapes(served, client):
    ref = served.alone   # a lone request as this one is: the same decode calls (bf16 rounds by the call's rows)
    r = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0, logprobs=1)
    lp = r.choices[0].logprobs
    np.testing.assert_allclose(lp.token_logprobs, ref.logprobs, atol=1e-5)
    assert "".join(lp.tokens) == ref.text and len(lp.top_logprobs) == MAX_TOKENS
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                       max_tokens=MAX_TOKENS, temperature=0, logprobs=True, top_logprobs=1)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == MAX_TOKENS
    assert "".join(t.token for t in content) == r.choices[0].message.content
    assert all(t.logprob <= 0 and t.top_logprobs[0].token == t.token and bytes(t.bytes) == t.token.encode()
               for t in content)


def test_chat_streamed_and_not_with_n(served, client):
    msgs = [{"role": "user", "content": "Hi"}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=MAX_TOKENS, temperature=0.8, seed=3,
                                       n=2)
    assert [c.index for c in r.choices] == [0, 1]
    assert all(c.message.role == "assistant" and c.message.content for c in r.choices)
    assert r.choices[0].message.content != r.choices[1].message.content  # sample index 0 vs 1: other keys
    assert r.usage.completion_tokens == 2 * MAX_TOKENS
    chunks = list(client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=MAX_TOKENS, temperature=0.8,
                                                 seed=3, n=2, stream=True, stream_options={"include_usage": True}))
    text = {0: "", 1: ""}
    roles = {}
    for c in chunks[:-1]:
        ch = c.choices[0]
        roles.setdefault(ch.index, ch.delta.role)
        text[ch.index] += ch.delta.content or ""
    assert roles == {0: "assistant", 1: "assistant"}
    assert [text[0], text[1]] == [c.message.content for c in r.choices]  # seeded: the same tokens
    assert chunks[-1].usage.completion_tokens == 2 * MAX_TOKENS
    # the template's prompt: what the default model's play-script template renders, tokenized as is
    want = served.state.codec.encode_rendered(served.state.codec.template.render(msgs))
    assert chunks[-1].usage.prompt_tokens == len(want) and want[0] == 0  # BOS written by the template


# ---- tool calls: the model's DSML blocks as OpenAI tool_calls ----
TOOLS_TEMPLATE = (
    "{{ bos_token }}{% if tools %}TOOLS:\n{% for t in tools %}{{ t['function'] | tojson }}\n{% endfor %}\n{% endif %}"
    "{% for m in messages %}{{ m['role'] | upper }}:\n{{ m['content'] }}"
    "{% for c in m.get('tool_calls', []) %}CALL {{ c['function']['name'] }} {{ c['function']['arguments'] | tojson }}"
    "{% endfor %}{% if m.get('tool_call_id') %} ({{ m['tool_call_id'] }}){% endif %}\n\n{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:\n{% if thinking %}<think>{% endif %}{% endif %}")
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}
_BAR = "\uff5c"
DSML_REPLY = ("Let me check.\n\n"
              f'<{_BAR}DSML{_BAR}function_calls>\n<{_BAR}DSML{_BAR}invoke name="get_weather">\n'
              f'<{_BAR}DSML{_BAR}parameter name="city" string="true">Paris</{_BAR}DSML{_BAR}parameter>\n'
              f'<{_BAR}DSML{_BAR}parameter name="days" string="false">3</{_BAR}DSML{_BAR}parameter>\n'
              f'</{_BAR}DSML{_BAR}invoke>\n</{_BAR}DSML{_BAR}function_calls>')


@pytest.fixture
def scripted(served, monkeypatch):
    """The chat template swapped for one that renders tools, and each request's sequence answered with the given
    text in the given pieces (the model here writes no DSML): the HTTP layer, its parsing and the client are real.
    Returns the list to fill with the pieces, and the prompts the requests brought."""
    from v4jax.serve import orchestrator, streams
    codec = served.state.codec
    monkeypatch.setattr(codec, "template", ChatTemplate(TOOLS_TEMPLATE, codec.template.special_tokens))
    pieces, prompts = [], []

    def submit(state, prep, route=None):
        prompts.append(prep.prompts[0])
        stream = orchestrator.RequestStream("scripted", 1, asyncio.get_running_loop())
        for k, piece in enumerate(pieces):
            last = k == len(pieces) - 1
            stream.queue.put_nowait(orchestrator.SeqOutput(0, piece, [k], [-0.5], "stop" if last else None))
        return stream
    monkeypatch.setattr(streams, "submit", submit)
    return types.SimpleNamespace(pieces=pieces, prompts=prompts, codec=codec)


def test_tool_calls_through_the_openai_client(scripted, client):
    scripted.pieces[:] = [DSML_REPLY]
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER_TOOL], max_tokens=64)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content == "Let me check."
    [call] = ch.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 3}
    # the tools reached the prompt through the template, as it renders them
    want = scripted.codec.encode_rendered(scripted.codec.template.render(msgs, tools=[WEATHER_TOOL]))
    assert scripted.prompts[-1] == want and "TOOLS:" in scripted.codec.decode(want)

    # the next turn: the call (arguments a JSON string, as the client sends it) and its result, back to the template
    # with the arguments as an object
    turn2 = msgs + [ch.message.model_dump(exclude_none=True),
                    {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C."}]
    scripted.pieces[:] = ["Sunny", ", 21 C."]
    r2 = client.chat.completions.create(model=MODEL, messages=turn2, tools=[WEATHER_TOOL], max_tokens=64)
    assert r2.choices[0].message.content == "Sunny, 21 C." and r2.choices[0].finish_reason == "stop"
    assert not r2.choices[0].message.tool_calls
    rendered = scripted.codec.decode(scripted.prompts[-1])
    assert 'CALL get_weather {"city": "Paris", "days": 3}' in rendered and f"({call.id})" in rendered

    # tool_choice "none": the block is text, as the model wrote it
    scripted.pieces[:] = [DSML_REPLY]
    r3 = client.chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER_TOOL], tool_choice="none",
                                        max_tokens=64)
    assert r3.choices[0].message.content == DSML_REPLY and r3.choices[0].finish_reason == "stop"


def test_tool_calls_streamed_in_pieces(scripted, client):
    # cut inside the opener, inside an invoke and inside a parameter
    cuts = [5, 16, 20, 40, 75, 130, len(DSML_REPLY) - 3]
    scripted.pieces[:] = [DSML_REPLY[a:b] for a, b in zip([0] + cuts, cuts + [len(DSML_REPLY)])]
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Weather?"}],
                                                 tools=[WEATHER_TOOL], max_tokens=64, stream=True))
    content, calls, reasons = "", {}, []
    for c in chunks:
        d = c.choices[0].delta
        content += d.content or ""
        for tc in d.tool_calls or []:
            got = calls.setdefault(tc.index, {"id": tc.id, "name": "", "arguments": ""})
            got["name"] += tc.function.name or ""
            got["arguments"] += tc.function.arguments or ""
        reasons.append(c.choices[0].finish_reason)
    assert content == "Let me check." and reasons[-1] == "tool_calls" and not any(reasons[:-1])
    assert [(v["name"], json.loads(v["arguments"])) for v in calls.values()] == \
        [("get_weather", {"city": "Paris", "days": 3})]
    # text that only looked like the start of a block is sent once it cannot be one
    scripted.pieces[:] = ["a < b, and <", _BAR + "DS", "M is not it."]
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "?"}],
                                                 tools=[WEATHER_TOOL], max_tokens=64, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "a < b, and <" + _BAR + "DSM is not it."
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_thinking_returns_the_reasoning_apart(scripted, client):
    """chat_template_kwargs {"thinking": true} (a switch this template reads): the text up to </think> comes back
    as reasoning_content, the rest as the answer, with its tool calls; streamed the same."""
    reply = "The user wants weather: call the tool.</think>" + DSML_REPLY
    scripted.pieces[:] = [reply]
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    think = {"chat_template_kwargs": {"thinking": True}}
    r = client.chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER_TOOL], max_tokens=64,
                                       extra_body=think)
    m = r.choices[0].message
    assert m.reasoning_content == "The user wants weather: call the tool." and m.content == "Let me check."
    assert [c.function.name for c in m.tool_calls] == ["get_weather"] and r.choices[0].finish_reason == "tool_calls"
    assert scripted.codec.decode(scripted.prompts[-1]).endswith("ASSISTANT:\n<think>")
    scripted.pieces[:] = [reply[:9], reply[9:45], reply[45:70], reply[70:]]  # </think> split across pieces
    chunks = list(client.chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER_TOOL], max_tokens=64,
                                                 stream=True, extra_body=think))
    deltas = [c.choices[0].delta for c in chunks]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == \
        "The user wants weather: call the tool."
    assert "".join(d.content or "" for d in deltas) == "Let me check."
    assert [tc.function.name for d in deltas for tc in d.tool_calls or []] == ["get_weather"]
    # not asked: the text is the answer as written (the block still read as a call)
    scripted.pieces[:] = [reply]
    m = client.chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER_TOOL], max_tokens=64
                                       ).choices[0].message
    assert getattr(m, "reasoning_content", None) is None
    assert m.content == "The user wants weather: call the tool.</think>Let me check."


def test_tokenize_and_detokenize(served):
    """vLLM's /tokenize and /detokenize: a prompt's ids as /v1/completions would run it (BOS as the tokenizer's
    config asks), a chat's as /v1/chat/completions renders it, and ids back to text."""
    http = served.http
    r = http.post("/tokenize", json={"model": MODEL, "prompt": PROMPTS[0], "return_token_strs": True}).json()
    want = served.llm.encode(PROMPTS[0])
    assert r["tokens"] == want and r["count"] == len(want) and r["max_model_len"] == served.state.limits.max_model_len
    assert r["token_strs"] == [served.state.codec.token_text(t) for t in want]
    plain = http.post("/tokenize", json={"prompt": PROMPTS[0], "add_special_tokens": False}).json()
    assert plain["tokens"] == want[1:] and plain["token_strs"] is None  # without the BOS the config adds
    msgs = [{"role": "user", "content": "Hi"}]
    codec = served.state.codec
    assert http.post("/tokenize", json={"messages": msgs}).json()["tokens"] == \
        codec.encode_rendered(codec.template.render(msgs))
    assert http.post("/detokenize", json={"tokens": want}).json() == {"prompt": served.llm.decode(want)}
    for path, body, param in [("/tokenize", {"prompt": ""}, "prompt"), ("/tokenize", {"prompt": 5}, "prompt"),
                              ("/detokenize", {"tokens": [10 ** 9]}, "tokens"),
                              ("/detokenize", {"tokens": "abc"}, "tokens"),
                              ("/tokenize", {"model": "other", "prompt": "x"}, "model")]:
        r = http.post(path, json=body)
        assert r.status_code in (400, 404) and r.json()["error"]["param"] == param, (path, body, r.text)


# ---- JetStream's endpoints with httpx ----
def test_jetstream_generate_streams_text_and_ids(served):
    ref = served.refs[0]
    with served.http.stream("POST", "/v1/generate", json={"max_tokens": MAX_TOKENS,
                                                          "text_content": {"text": PROMPTS[0]}}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        msgs = [json.loads(line) for line in r.iter_lines() if line]
    samples = [m["streamContent"]["samples"] for m in msgs]
    assert all(len(s) == 1 for s in samples)
    assert "".join(s[0].get("text", "") for s in samples) == ref.text
    assert sum((s[0].get("tokenIds", []) for s in samples), []) == ref.token_ids
    eos = served.llm.engine.cfg.eos_token_id
    ids = _jetstream_samples(served, ref.prompt_token_ids, 2)
    assert all(_whole_sample(x, eos) for x in ids), ids


def _jetstream_samples(served, prompt_ids, n) -> list[list[int]]:
    """Each sample's token ids from /v1/generate with a token prompt (ids only, no text)."""
    body = {"max_tokens": MAX_TOKENS, "token_content": {"token_ids": prompt_ids}, "num_samples": n}
    with served.http.stream("POST", "/v1/generate", json=body) as r:
        msgs = [json.loads(line) for line in r.iter_lines() if line]
    samples = [m["streamContent"]["samples"] for m in msgs]
    assert all(len(s) == n and all(set(x) <= {"tokenIds"} for x in s) for s in samples)  # ids only
    return [sum((s[j].get("tokenIds", []) for s in samples), []) for j in range(n)]


def _whole_sample(ids, eos) -> bool:
    """MAX_TOKENS tokens, or fewer ending on EOS (the EOS is sent): num_samples > 1 samples at temperature 1, so any
    token, the first included, may be EOS."""
    return eos not in ids[:-1] and (len(ids) == MAX_TOKENS or (0 < len(ids) < MAX_TOKENS and ids[-1] == eos))


def test_jetstream_sample_ending_on_eos_is_whole(served, monkeypatch):
    """Unseeded samples get fresh seeds; pinned here to one that, with the default model, draws EOS as the first
    token of sample 1 of PROMPTS[0] (about 1 sample in 10,000 does): that sample is the single EOS."""
    eos = served.llm.engine.cfg.eos_token_id
    monkeypatch.setattr(SamplingParams, "resolved_seed", lambda self: 16658 if self.seed is None else self.seed)
    ids = _jetstream_samples(served, served.refs[0].prompt_token_ids, 2)
    assert ids[1] == [eos], f"seed 16658 no longer draws EOS first for sample 1 (model or sampler changed): {ids}"
    assert all(_whole_sample(x, eos) for x in ids), ids


def test_health_endpoints(served):
    assert served.http.get("/v1/health").json() == {"is_live": "True"}
    assert httpx.get(served.url + "/health").status_code == 200  # no key needed
    assert httpx.get(served.url + "/v1/health").status_code == 200


def test_metrics_count_what_happened(served, client):
    before = _metrics(served.http)
    client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0)
    after = _metrics(served.http)
    d = lambda k: after.get(k, 0) - before.get(k, 0)
    assert d("v4jax_prompt_tokens_total") == len(served.refs[0].prompt_token_ids)
    assert d("v4jax_generation_tokens_total") == MAX_TOKENS
    assert d("v4jax_time_to_first_token_seconds_count") == 1
    assert d("v4jax_e2e_request_latency_seconds_count") == 1
    assert d("v4jax_time_per_output_token_seconds_count") == 1
    assert d('v4jax_request_finished_total{finish_reason="length"}') == 1
    assert d("v4jax_prefix_cache_queried_tokens_total") == len(served.refs[0].prompt_token_ids)
    for pool in ("swa", "c4_kv", "c4_index", "c128_kv", "tokens", "compressor_state"):
        assert after[f'v4jax_pool_total_pages{{pool="{pool}"}}'] > 0
        assert f'v4jax_pool_used_pages{{pool="{pool}"}}' in after
        assert after[f'v4jax_pool_bytes_total{{pool="{pool}"}}'] > 0
        used, total = (after[f'v4jax_pool_bytes_{k}{{pool="{pool}"}}'] for k in ("used", "total"))
        assert 0 <= used <= total
    for name in ("v4jax_num_requests_running", "v4jax_num_requests_waiting", "v4jax_num_preemptions_total",
                 "v4jax_prefix_cache_hit_tokens_total", "v4jax_prefix_cache_reused_pages_total",
                 "v4jax_prefix_cache_tombstoned_tails_total", "v4jax_recomputed_tokens_total"):
        assert name in after
    # the engine compiled its programs in this process (the references before the server started)
    assert after["v4jax_programs_compiled_total"] > 0 and after["v4jax_program_compile_seconds_total"] > 0



def test_metrics_export_the_engines_pool_bytes_and_cache_figures():
    """The engine's stats() figures as Prometheus text: pool bytes as gauges per pool, reused pages, tombstoned
    tails and recomputed tokens as counters (base units, the v4jax_ prefix)."""
    from v4jax.serve.metrics import ServerMetrics
    stats = {"pools": {"swa": {"used": 3, "total": 42, "unit": "64 tokens", "bytes_used": 300, "bytes_total": 4200},
                       "tokens": {"used": 2, "total": 8, "unit": "256 tokens", "bytes_used": 2048,
                                  "bytes_total": 8192}},
             "prefix_cache": {"reused_pages": 5, "tombstoned_tails": 2, "hit_tokens": 1280},
             "requests": {"recomputed_tokens": 77, "preempted": 1},
             "programs": {"compiled": 12, "compile_seconds": 40.5}}
    text = ServerMetrics(lambda: stats).render().decode()
    got = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
           if line and not line.startswith("#")}
    assert got['v4jax_pool_bytes_used{pool="swa"}'] == 300 and got['v4jax_pool_bytes_total{pool="swa"}'] == 4200
    assert got['v4jax_pool_bytes_used{pool="tokens"}'] == 2048 and got['v4jax_pool_bytes_total{pool="tokens"}'] == 8192
    assert got["v4jax_prefix_cache_reused_pages_total"] == 5
    assert got["v4jax_prefix_cache_tombstoned_tails_total"] == 2
    assert got["v4jax_recomputed_tokens_total"] == 77
    assert got["v4jax_programs_compiled_total"] == 12 and got["v4jax_program_compile_seconds_total"] == 40.5
    assert "# TYPE v4jax_recomputed_tokens_total counter" in text or "# TYPE v4jax_recomputed_tokens counter" in text
    assert "# TYPE v4jax_pool_bytes_used gauge" in text


# ---- limits ----
LONG = list(range(2, 600))  # past the 512-token context
MALFORMED = [  # (path, body: dict | bytes, headers, status, param)
    ("/v1/completions", b"{not json", {}, 400, None),
    ("/v1/completions", b"[1, 2]", {}, 400, None),
    ("/v1/completions", {"prompt": 5}, {}, 400, "prompt"),
    ("/v1/completions", {"prompt": []}, {}, 400, "prompt"),
    ("/v1/completions", {"prompt": ""}, {}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1, "a"]}, {}, 400, "prompt"),
    ("/v1/completions", {"prompt": [5000]}, {}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "10"}, {}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": -1}, {}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, {}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 10**6}, {}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 2**40}, {}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 4.5}, {}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, {}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, {}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, {}, 400, "top_p"),
    ("/v1/completions", {"prompt": "x", "top_k": -5}, {}, 400, "top_k"),
    ("/v1/completions", {"prompt": "x", "seed": 2**40}, {}, 400, "seed"),
    ("/v1/completions", {"prompt": "x", "n": 0}, {}, 400, "n"),
    ("/v1/completions", {"prompt": "x", "n": 1000}, {}, 400, "n"),
    ("/v1/completions", {"prompt": "x", "stream": "yes"}, {}, 400, "stream"),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, {}, 400, "stream_options"),
    ("/v1/completions", {"prompt": "x", "stop": 5}, {}, 400, "stop"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": ["a"]}, {}, 400, "stop_token_ids"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": list(range(2, 12))}, {}, 400, "stop_token_ids"),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, {}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "x", "echo": "yes"}, {}, 400, "echo"),
    ("/v1/completions", {"prompt": "x", "echo": True, "max_tokens": -1}, {}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "presence_penalty": 2.5}, {}, 400, "presence_penalty"),
    ("/v1/completions", {"prompt": "x", "frequency_penalty": "a"}, {}, 400, "frequency_penalty"),
    ("/v1/completions", {"prompt": "x", "repetition_penalty": 0}, {}, 400, "repetition_penalty"),
    ("/v1/completions", {"prompt": "x", "min_tokens": 8, "max_tokens": 4}, {}, 400, "min_tokens"),
    ("/v1/completions", {"prompt": "x", "min_tokens": -1}, {}, 400, "min_tokens"),
    ("/v1/completions", {"prompt": "x", "min_p": 1.5}, {}, 400, "min_p"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 150}}, {}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"x": 1}}, {}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": [5]}, {}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"99999999": 1}}, {}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "ignore_eos": 1}, {}, 400, "ignore_eos"),
    ("/v1/completions", {"prompt": LONG}, {}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "model": "gpt-4"}, {}, 404, "model"),
    ("/v1/completions", {"prompt": "x" * (70 << 10)}, {}, 413, None),
    ("/v1/chat/completions", {"messages": []}, {}, 400, "messages"),
    ("/v1/chat/completions", {"messages": "hi"}, {}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, {}, 400, "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"content": "x"}]}, {}, 400, "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, {}, 400, "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, {}, 400,
     "messages[0].content[0]"),
    ("/v1/chat/completions", {"messages": ["x"]}, {}, 400, "messages[0]"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 5}, {}, 400, "n"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, {}, 400,
     "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21},
     {}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "echo": True}, {}, 400, "echo"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x " * 600}]}, {}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 600}, {},
     400, "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, {},
     400, "tools[0]"),
    # a well-formed tool, but the default model's template never reads 'tools'
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "tools": [{"type": "function", "function": {"name": "f"}}]}, {}, 400, "tools"),
    ("/v1/completions", {"prompt": "x", "tools": [{"type": "function", "function": {"name": "f"}}]}, {}, 400,
     "tools"),
    ("/v1/generate", {"text_content": {"text": "x"}}, {}, 400, "max_tokens"),
    ("/v1/generate", {"max_tokens": 4}, {}, 400, "text_content"),
    ("/v1/generate", {"max_tokens": 4, "text_content": {"text": "x"}, "token_content": {"token_ids": [1]}}, {}, 400,
     "text_content"),
    ("/v1/generate", {"max_tokens": 4, "text_content": {"text": "x"}, "temperature": 0}, {}, 400, "temperature"),
    ("/v1/generate", {"max_tokens": 4, "token_content": {"token_ids": []}}, {}, 400, "token_content"),
    ("/v1/generate", {"max_tokens": 4, "token_content": {"token_ids": LONG}}, {}, 400, "token_content"),
    ("/v1/generate", {"max_tokens": 4, "text_content": {"text": "x"}, "num_samples": 99}, {}, 400, "num_samples"),
    ("/v1/completions", {"prompt": "x"}, {"Authorization": "Bearer wrong"}, 401, None),
    ("/v1/completions", {"prompt": "x"}, {"Authorization": ""}, 401, None),
    ("/v1/nothing-here", {}, {}, 404, None),
]


def test_malformed_requests_get_4xx_and_the_server_keeps_serving(served):
    seen = []
    for path, body, headers, status, param in MALFORMED:
        kw = {"content": body, "headers": {"Content-Type": "application/json", **headers}} \
            if isinstance(body, bytes) else {"json": body, "headers": headers}
        if headers.get("Authorization") == "":
            with httpx.Client(base_url=served.url) as anon:  # no key at all
                r = anon.post(path, json=body)
        else:
            r = served.http.post(path, **kw)
        err = r.json()["error"]
        seen.append((path, body if len(repr(body)) < 80 else "...", r.status_code, err.get("param")))
        assert r.status_code == status, seen[-1]
        assert err["message"] and err["type"] and set(err) == {"message", "type", "param", "code"}, seen[-1]
        if param is not None:
            assert err["param"] == param, (seen[-1], err["message"])
    assert served.http.get("/v1/completions").status_code == 405
    r = served.http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPTS[0], "max_tokens": MAX_TOKENS,
                                                  "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == served.refs[0].text
    assert _idle_and_free(served.state)


def test_request_timeout_aborts(served):
    opts = served.state.options
    old, opts.request_timeout_s = opts.request_timeout_s, 0.05
    try:
        body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 200, "ignore_eos": True}
        r = served.http.post("/v1/completions", json=body)
        assert r.status_code == 408 and r.json()["error"]["code"] == "request_timeout"
        with served.http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            chunks, done = _sse(r.iter_lines())
        assert done and chunks[-1]["error"]["code"] == "request_timeout"
    finally:
        opts.request_timeout_s = old
    assert _idle_and_free(served.state)


@pytest.mark.slow  # minutes on CPU; -m slow
def test_load_with_disconnects_returns_every_page(served):
    """64 concurrent streaming clients, a quarter leaving at random points: no 5xx, every complete stream is
    whole, every page comes back, and /metrics counts it all."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(2, 2048, int(rng.integers(5, 9))).tolist() for _ in range(LOAD_CLIENTS)]
    leave = set(rng.choice(LOAD_CLIENTS, LOAD_CLIENTS // 4, replace=False).tolist())
    leave_after = {i: int(rng.integers(0, 4)) for i in leave}  # chunks read (of 5) before disconnecting
    before = _metrics(served.http)

    async def one(http, i):
        body = {"model": MODEL, "prompt": prompts[i], "max_tokens": LOAD_TOKENS, "temperature": 0.7, "seed": i,
                "ignore_eos": True, "stream": True, "return_token_ids": True}
        tokens, finish, done, n = 0, None, False, 0
        async with http.stream("POST", "/v1/completions", json=body) as r:
            status = r.status_code
            if i in leave and leave_after[i] == 0:
                return status, None, None, False
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                ch = json.loads(line[6:])["choices"][0]
                tokens += len(ch["token_ids"])
                finish = ch["finish_reason"] or finish
                n += 1
                if i in leave and n >= leave_after[i]:
                    break  # leaving the block closes the connection mid-stream
        return status, tokens, finish, done

    async def run():
        limits = httpx.Limits(max_connections=LOAD_CLIENTS + 8)
        async with httpx.AsyncClient(base_url=served.url, headers={"Authorization": f"Bearer {KEY}"},
                                     limits=limits, timeout=120) as http:
            return await asyncio.gather(*(one(http, i) for i in range(LOAD_CLIENTS)))

    results = asyncio.run(run())
    assert [s for s, *_ in results] == [200] * LOAD_CLIENTS
    for i, (_, tokens, finish, done) in enumerate(results):
        if i not in leave:
            assert (tokens, finish, done) == (LOAD_TOKENS, "length", True), i
    assert _idle_and_free(served.state)
    after = _metrics(served.http)
    d = lambda k: after.get(k, 0) - before.get(k, 0)
    assert d("v4jax_prompt_tokens_total") == sum(len(p) for p in prompts)
    aborted, finished = d('v4jax_request_finished_total{finish_reason="abort"}'), \
        d('v4jax_request_finished_total{finish_reason="length"}')
    assert aborted + finished == LOAD_CLIENTS and aborted >= 1 and finished >= LOAD_CLIENTS - len(leave)
    assert d("v4jax_e2e_request_latency_seconds_count") == finished
    assert d("v4jax_generation_tokens_total") >= (LOAD_CLIENTS - len(leave)) * LOAD_TOKENS
    assert after["v4jax_num_requests_in_flight"] == 0 and after['v4jax_pool_used_pages{pool="compressor_state"}'] == 0


def test_queue_bound_turns_excess_into_429(served):
    orch = served.state.orchestrator
    old, orch.max_waiting = orch.max_waiting, 0  # capacity: the decode slots
    try:
        async def one(http):
            body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 48, "temperature": 0, "ignore_eos": True,
                    "stream": True}
            async with http.stream("POST", "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    return r.status_code, r.headers.get("retry-after"), json.loads(await r.aread())
                _, done = _sse([line async for line in r.aiter_lines()])
                return r.status_code, done, None

        async def run():
            async with httpx.AsyncClient(base_url=served.url, headers={"Authorization": f"Bearer {KEY}"},
                                         timeout=120) as http:
                return await asyncio.gather(*(one(http) for _ in range(20)))

        results = asyncio.run(run())
    finally:
        orch.max_waiting = old
    ok = [r for r in results if r[0] == 200]
    busy = [r for r in results if r[0] == 429]
    assert len(ok) + len(busy) == 20 and len(ok) >= SLOTS and busy
    assert all(done for _, done, _ in ok)
    assert all(ra == "1" and body["error"]["type"] == "rate_limit_error" for _, ra, body in busy)
    assert _idle_and_free(served.state)


def test_bench_serve_against_the_server(served, tmp_path):
    from v4jax.bench import serve as bench
    args = bench._parser().parse_args(["--url", served.url, "--api-key", KEY, "--num-requests", "8", "--rate", "inf",
                                       "--prompt-len", "5:8", "--output-len", "4:12", "--vocab", "2048"])
    rep = asyncio.run(bench.run(args))
    s = rep["summary"]
    assert (s["requests"], s["completed"], s["errors"]) == (8, 8, 0)
    assert 8 * 4 <= s["output_tokens"] <= 8 * 12 and s["ttft_s"]["p50"] > 0 and s["e2e_s"]["p99"] >= s["e2e_s"]["p50"]
    # the programs the server compiled while measured (/metrics before and after), named under the table if any
    cw = rep["compiled_while_measured"]
    assert cw["programs_compiled"] >= 0 and (cw["compile_seconds"] > 0) == (cw["programs_compiled"] > 0)
    # the engine thread's steps while measured (/metrics): their wall seconds and the device's share of them
    es = rep["engine_steps"]
    assert es["steps"] > 0 and es["step_seconds"] >= es["device_wait_seconds"] > 0
    # what they dispatched: each request's prompt (5-8 tokens) one prefill row, and decode calls for its tokens
    assert es["prefill_rows"] == 8 and 1 <= es["prefill_steps"] <= 8 and es["decode_calls"] >= 1, es
    assert es["decode_rows"] >= es["decode_calls"], es
    md = bench.markdown(rep)
    assert md.count("\n") == (6 if cw["programs_compiled"] else 4) and "\nengine: " in md
    assert ("programs compiled while measured" in md) == bool(cw["programs_compiled"])


def test_bench_serve_waits_for_background_compiles_after_its_warm_up(monkeypatch):
    """After the warm-up requests, bench serve measures only once the server compiles nothing in the background
    (its /metrics gauge), up to --warmup-settle-s; a server that does not say is not waited for."""
    from types import SimpleNamespace

    from v4jax.bench import serve as bench
    real_sleep = asyncio.sleep
    monkeypatch.setattr(bench.asyncio, "sleep", lambda s: real_sleep(0))

    class Server:
        def __init__(self, gauges):
            self.gauges, self.asked = list(gauges), 0

        async def get(self, path):
            self.asked += 1
            g = self.gauges.pop(0) if len(self.gauges) > 1 else self.gauges[0]
            return SimpleNamespace(text="" if g is None else f"v4jax_programs_compiling {g}\n")

    busy = Server([2, 2, 1, 0, 0])
    assert asyncio.run(bench._settle(busy, 60.0)) is not None and busy.asked == 4
    forever = Server([1])
    assert asyncio.run(bench._settle(forever, 0.0)) is not None and forever.asked == 1  # the limit ends the wait
    assert asyncio.run(bench._settle(Server([None]), 60.0)) is None


def test_bench_serve_long_prompts_among_decoding_streams(served, tmp_path):
    """`v4jax bench serve`'s second class: long prompts arriving on their own schedule while short streams decode;
    per class TTFT / TPOT / ITL, and the short streams' ITL split by whether a long request was waiting for its
    first token (its prefill chunks run between their decode calls)."""
    from v4jax.bench import serve as bench
    argv = ["--url", served.url, "--api-key", KEY, "--num-requests", "6", "--rate", "inf", "--max-concurrency", "3",
            "--prompt-len", "5:8", "--output-len", "24", "--vocab", "2048", "--long-num", "3", "--long-rate", "20",
            "--long-prompt-len", "96", "--long-output-len", "4", "--out", str(tmp_path)]
    assert bench.main(argv) == 0
    rep = json.loads((tmp_path / "serve_bench.json").read_text())
    c = rep["classes"]
    assert [(c[k]["requests"], c[k]["completed"]) for k in ("short", "long")] == [(6, 6), (3, 3)]
    assert c["short"]["output_tokens"] == 6 * 24 and c["long"]["prompt_tokens"] == 3 * 96
    assert c["long"]["output_tokens"] == 3 * 4 and rep["summary"]["completed"] == 9
    for cls in ("short", "long"):
        for k in ("ttft_s", "tpot_s", "itl_s"):
            assert 0 < c[cls][k]["p50"] <= c[cls][k]["p99"] < 60, (cls, k, c[cls][k])
    during, outside = c["short"]["itl_during_long_s"], c["short"]["itl_outside_long_s"]
    assert during["n"] > 0 and outside["n"] >= 0 and during["p50"] > 0
    assert sorted(r["class"] for r in rep["requests"]) == ["long"] * 3 + ["short"] * 6
    assert "; 3 long (prompt 96, output 4) at Poisson 20/s from 0 s" in rep["load"]
    table = (tmp_path / "serve_bench.md").read_text()
    assert "| short | 6 | 6 | 5:8 | 24 |" in table and "| long | 3 | 3 | 96 | 4 |" in table
    assert _idle_and_free(served.state)


def test_shutdown_ends_running_streams(served):
    """Runs last: SIGTERM's path (handle_exit) with no grace: the running stream ends early with [DONE] and the
    OpenAI finish_reason "length" (the engine's "abort": cut short by the server), the server stops, and the engine
    lets go of every page."""
    served.state.options.shutdown_grace_s = 0.0
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 200, "ignore_eos": True, "stream": True,
            "return_token_ids": True}
    aborted = lambda: served.state.metrics.registry.get_sample_value("v4jax_request_finished_total",
                                                                    {"finish_reason": "abort"}) or 0
    aborted_before = aborted()
    with served.http.stream("POST", "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        first = json.loads(next(line for line in lines if line.startswith("data: "))[6:])
        served.server.shutdown_now()
        chunks, done = _sse(lines)
    assert first["choices"][0]["finish_reason"] is None
    assert done and chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert sum(len(c["choices"][0]["token_ids"]) for c in [first, *chunks]) < 200
    served.thread.join(30)
    assert not served.thread.is_alive()
    assert not served.state.orchestrator.accepting
    assert _idle_and_free(served.state)
    # the server's metrics keep the engine's own reason
    assert aborted() == aborted_before + 1
