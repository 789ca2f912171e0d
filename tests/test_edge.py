"""Validation at the edge: one rule table (v4jax.fields) bounds SamplingParams, the LLM options and the server's
fields; the server bounds a body before parsing it and answers every malformed request with a 4xx in OpenAI's
shape on a connection it keeps; a failed engine step fails only its own requests (500) and the loop goes on;
/health reports a dead engine thread."""
import http.client
import json
import time
import warnings

import pytest

from v4jax import LLM, SamplingParams
from v4jax.fields import FieldError
from v4jax.serve.app import ServerState, build_app
from v4jax.serve.options import ServerOptions

import serving


# ---- SamplingParams and LLM options ----
@pytest.mark.parametrize("kwargs,name", [
    (dict(top_k=2**31), "top_k"), (dict(max_tokens=2**31), "max_tokens"), (dict(seed=-2**31 - 1), "seed"),
    (dict(temperature=1e300), "temperature"), (dict(top_p=float("nan")), "top_p"), (dict(top_k=10**30), "top_k"),
])
def test_sampling_params_are_bounded_to_int32_and_finite(kwargs, name):
    with pytest.raises(ValueError, match=f"^{name} must be"):
        SamplingParams(**kwargs)
    assert SamplingParams(top_k=2**31 - 1, max_tokens=2**31 - 1).top_k == 2**31 - 1


@pytest.mark.parametrize("kwargs,match", [
    (dict(max_num_seqs="8"), r"max_num_seqs must be an integer .*got '8'"),
    (dict(max_num_seqs=8.0), r"max_num_seqs must be an integer"),
    (dict(max_num_seqs=True), r"max_num_seqs must be an integer"),
    (dict(max_model_len=-5), r"max_model_len must be an integer in \[1, "),
    (dict(max_model_len=0), r"max_model_len must be an integer in \[1, "),
    (dict(max_model_len="512"), r"max_model_len must be an integer .*got '512'"),
    (dict(decode_steps=2**31), r"decode_steps must be an integer in \[1, 2147483647\]"),
    (dict(enable_prefix_caching="no"), r"enable_prefix_caching must be True or False, got 'no'"),
    (dict(quant_sim=1), r"quant_sim must be True or False"),
    (dict(kv_layout=["paged"]), r"kv_layout must be one of 'paged', 'dense'"),
    (dict(mesh=2), r"mesh must be a string"),
    (dict(memory_budget_bytes=2**64), r"memory_budget_bytes must be an integer"),
])
def test_llm_options_are_type_checked_before_the_model_loads(kwargs, match, monkeypatch):
    import v4jax.api as api
    monkeypatch.setattr(api, "load_model", lambda *a, **k: pytest.fail("the model loaded"))
    with pytest.raises(FieldError, match=match):
        LLM("tiny", **kwargs)


def test_unknown_options_and_max_model_len_past_the_model():
    with pytest.raises(TypeError, match=r"unknown LLM option\(s\) \['bogus'\]"):
        LLM("tiny", bogus=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(FieldError, match="max_model_len=1000000000 exceeds this model's context limit of 4096"):
            LLM("tiny", max_model_len=10**9)
        assert LLM("tiny", max_model_len=4096, memory_budget_bytes=2**40).max_model_len == 4096


# ---- the body, before parsing ----
def test_json_bodies_are_bounded_before_parsing():
    from v4jax.serve.protocol import ApiError, json_object
    cases = [(b"[" * 100_000 + b"]" * 100_000, "deeper than"), (b'{"n": ' + b"9" * 5000 + b"}", "longer than"),
             (b'{"prompt": "\\ud800"}', "prompt is not valid UTF-8"), (b'{"\\udc00x": 1}', "a key of the body"),
             (b'{"messages": [{"role": "user", "content": "a\\uDBFFb"}]}', r"messages[0].content is not valid")]
    for raw, match in cases:
        with pytest.raises(ApiError) as e:
            json_object(raw)
        assert e.value.status == 400 and match in e.value.message, (raw[:40], e.value.message)
    assert json_object(b'{"prompt": "\\ud83d\\ude00", "s": "[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[", '
                       b'"e": "\\\\ud800"}') == {"prompt": "\U0001F600", "s": "[" * 38, "e": "\\ud800"}
    assert json_object(b'{"a": ' + b"[" * 31 + b"]" * 31 + b"}")  # 32 levels with the object


# ---- the server: 4xx on a kept-alive connection ----


@pytest.fixture(scope="module")
def served():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # the embedded model, with tests/test_serve_fuzz.py's engine options: in one run the programs one of the
        # two compiles, the other loads from the persistent compilation cache
        llm = LLM(max_model_len=64, max_num_seqs=2, prefill_chunk=16, decode_steps=2)
    state = ServerState(llm, ServerOptions(log_level="critical", access_log=False)).start()
    server, thread, port = serving.start(state)
    yield state, port
    server.shutdown_now()
    thread.join(30)
    state.orchestrator.stop()


def _post(conn, path, body):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    conn.request("POST", path, body=raw, headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    return r, json.loads(r.read())


CHAT = [{"role": "user", "content": "Hi"}]
MALFORMED = [  # (path, body, param or None)
    ("/v1/completions", {"prompt": "ROMEO:", "max_tokens": 4, "top_k": 2147483648}, "top_k"),
    ("/v1/completions", {"prompt": "ROMEO:", "max_tokens": 4, "seed": 2**63}, "seed"),
    ("/v1/completions", {"prompt": "ROMEO:", "max_tokens": 4, "temperature": 1e400}, "temperature"),
    ("/v1/completions", {"prompt": "ROMEO:", "n": 2**40}, "n"),
    ("/v1/completions", b'{"prompt": "ROMEO:", "max_tokens": ' + b"7" * 5000 + b"}", None),
    ("/v1/completions", b'{"prompt": ' + b"[" * 50_000 + b"]" * 50_000 + b"}", None),
    ("/v1/completions", b'{"prompt": "ROMEO:\\ud800"}', "prompt"),
    ("/v1/completions", b'{"prompt": "ROMEO:", "\\ud800": 1}', None),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "a\\udfff"}]}', "messages[0].content"),
    ("/v1/chat/completions", {"messages": CHAT, "chat_template_kwargs": {"add_generation_prompt": 5}},
     "chat_template_kwargs"),
    ("/v1/chat/completions", {"messages": CHAT, "chat_template_kwargs": {"bos_token": 5}},
     "chat_template_kwargs.bos_token"),
    ("/v1/chat/completions", {"messages": CHAT, "chat_template_kwargs": {"messages": 5}}, "chat_template_kwargs"),
    ("/v1/generate", b'{"max_tokens": 4, "text_content": {"text": "\\ud800"}}', "text_content.text"),
    ("/v1/generate", {"max_tokens": 2**31, "text_content": {"text": "x"}}, "max_tokens"),
]


@pytest.mark.slow  # minutes on CPU; -m slow
def test_malformed_requests_are_4xx_and_the_connection_is_kept(served):
    state, port = served
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    seen = []
    for path, body, param in MALFORMED:
        r, out = _post(conn, path, body)
        seen.append((path, str(body)[:60], r.status, out))
        assert 400 <= r.status < 500, seen[-1]
        assert set(out["error"]) == {"message", "type", "param", "code"} and out["error"]["message"], seen[-1]
        if param is not None:
            assert out["error"]["param"] == param, seen[-1]
        assert not r.will_close, seen[-1]  # the connection is kept
    r, out = _post(conn, "/v1/completions", {"prompt": "ROMEO:", "max_tokens": 4, "temperature": 0})
    assert r.status == 200 and out["usage"]["completion_tokens"] == 4
    conn.close()


def test_a_failed_step_fails_its_requests_only_and_the_loop_goes_on(served):
    state, port = served
    core = state.engine.core
    real = core._dispatch_prefill
    calls = []

    def failing(plans):  # the first prefill fails, after the step admitted its request (its pages reserved)
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected failure")
        return real(plans)

    core._dispatch_prefill = failing
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        r, out = _post(conn, "/v1/completions", {"prompt": "JULIET:", "max_tokens": 4, "temperature": 0})
        assert r.status == 500 and "injected failure" in out["error"]["message"], out
        assert out["error"]["code"] == "engine_error"
        r, out = _post(conn, "/v1/completions", {"prompt": "JULIET:", "max_tokens": 4, "temperature": 0})
        assert r.status == 200 and out["usage"]["completion_tokens"] == 4, out
        conn.close()
    finally:
        core._dispatch_prefill = real
    assert state.orchestrator.engine_alive
    deadline = time.monotonic() + 30
    while state.orchestrator.stats()["server"]["in_flight"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert state.orchestrator.stats()["server"]["in_flight"] == 0

    def all_free(eng):
        eng.core.kv.reset_prefix_cache()
        return eng.core.kv.all_free()

    assert state.orchestrator.run_on_engine(all_free).result(30)


def test_health_reports_a_dead_engine_thread():
    from fastapi.testclient import TestClient
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        llm = LLM("tiny", dtype="float32", max_model_len=64, max_num_seqs=2)
    state = ServerState(llm, ServerOptions(log_level="critical", access_log=False)).start()
    client = TestClient(build_app(state))
    try:
        assert client.get("/health").json() == {"status": "ok"}

        def broken_add(*a, **k):
            raise RuntimeError("add broke")

        state.engine.add_request = broken_add  # an unexpected failure on the way in fails that request only
        r = client.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 2})
        assert r.status_code == 500 and "add broke" in r.json()["error"]["message"], r.json()
        assert state.orchestrator.engine_alive and client.get("/health").status_code == 200
        deadline = time.monotonic() + 10  # its capacity returns just after its stream ends
        while state.orchestrator.stats()["server"]["in_flight"] and time.monotonic() < deadline:
            time.sleep(0.02)
        assert state.orchestrator.stats()["server"]["in_flight"] == 0

        def die():
            raise RuntimeError("engine broke")

        state.engine.has_unfinished_requests = die  # outside any step (at its next turn): the thread itself fails
        deadline = time.monotonic() + 30
        while state.orchestrator.engine_alive and time.monotonic() < deadline:
            time.sleep(0.02)
        r = client.get("/health")
        assert r.status_code == 503
        assert r.json() == {"status": "unavailable", "engine": "dead: RuntimeError: engine broke"}
        assert client.get("/v1/health").status_code == 503
    finally:
        state.orchestrator.stop(5)
