"""Prefill/decode disaggregation served for real: a `v4jax router` in front of a prefill server and a decode server
(uvicorn on free local ports, in threads, over the embedded default model), driven by the `openai` client. The
router's answers equal the model's own greedy output, streamed and not; each state crosses by
jax.experimental.transfer with its checksum and is counted in both servers' /metrics; pages return on both sides;
a dead prefill server is retried once on another, and with none left the client gets 503; the shared secret keeps
clients off the PD servers."""
import time
import types

import httpx
import pytest
import uvicorn

from v4jax import LLM, SamplingParams
from v4jax.serve.app import Server, ServerState
from v4jax.serve.options import ServerOptions
from v4jax.serve.router import Router, RouterOptions, build_router_app

import serving

# two servers of the default model and a router: over a minute of set-up on 2 CPU cores; the in-process pair of
# tests/test_disagg.py is the default run's end-to-end check
pytestmark = pytest.mark.slow

SECRET = "pd-secret-123"
PROMPTS = ["ROMEO:", "JULIET:"]
MAX_TOKENS = 6
LLM_OPTS = dict(max_model_len=256, prefill_chunk=8, decode_steps=2, max_num_seqs=2)


def _run(server):
    thread, port = serving.serve(server)
    return thread, f"http://127.0.0.1:{port}"


def _server(llm, mode, transport="jax"):
    opts = ServerOptions(log_level="warning", access_log=False, disaggregation_mode=mode, pd_secret=SECRET,
                         request_timeout_s=120.0, pd_transport=transport)
    state = ServerState(llm, opts).start()
    server = Server(state)
    thread, url = _run(server)
    return types.SimpleNamespace(state=state, server=server, thread=thread, url=url)


def _router(prefill, decode):
    router = Router(RouterOptions(prefill=prefill, decode=decode, pd_secret=SECRET, request_timeout_s=120.0))
    server = uvicorn.Server(uvicorn.Config(build_router_app(router), log_level="warning", lifespan="off"))
    thread, url = _run(server)
    return types.SimpleNamespace(router=router, server=server, thread=thread, url=url)


def _dead_url():
    sock = serving.free_socket()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    sock.close()  # nothing listens there
    return url


@pytest.fixture(scope="module")
def cluster():
    prefill_llm = LLM(**LLM_OPTS)
    refs = prefill_llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    p = _server(prefill_llm, "prefill")
    d = _server(LLM(**LLM_OPTS), "decode")
    r = _router([p.url], [d.url])
    yield types.SimpleNamespace(p=p, d=d, r=r, refs=refs)
    for s in (r, p, d):
        s.server.should_exit = True
        s.thread.join(30)
    for s in (p, d):
        s.state.orchestrator.stop()


def _idle_and_free(state, timeout: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout
    orch = state.orchestrator
    while time.monotonic() < deadline:
        if orch.stats()["server"]["in_flight"] == 0 and \
                orch.run_on_engine(lambda e: not e.has_unfinished_requests()).result(10):
            def free(e):
                e.core.kv.reset_prefix_cache()
                return e.core.kv.all_free() and all(s is None for s in e.core.scheduler.slots)
            return orch.run_on_engine(free).result(10)
        time.sleep(0.05)
    return False


def _metrics(url) -> dict:
    out = {}
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def _all_pages_free(url, timeout: float = 30.0) -> bool:
    """Every pool's v4jax_pool_used_pages at 0 in the server's /metrics (its engine thread publishes stats between
    steps: wait for the snapshot after the last change)."""
    deadline = time.monotonic() + timeout
    while True:
        used = {k: v for k, v in _metrics(url).items() if k.startswith("v4jax_pool_used_pages{")}
        if used and not any(used.values()):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)


def test_router_serves_the_models_own_output(cluster):
    from openai import OpenAI
    client = OpenAI(base_url=cluster.r.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    for prompt, ref in zip(PROMPTS, cluster.refs):
        got = client.completions.create(model="v4jax-shakespeare", prompt=prompt, max_tokens=MAX_TOKENS,
                                        temperature=0.0)
        assert got.choices[0].text == ref.text
        streamed = client.completions.create(model="v4jax-shakespeare", prompt=prompt, max_tokens=MAX_TOKENS,
                                             temperature=0.0, stream=True)
        assert "".join(c.choices[0].text for c in streamed) == ref.text
    chat = client.chat.completions.create(model="v4jax-shakespeare", max_tokens=MAX_TOKENS, temperature=0.0,
                                          messages=[{"role": "user", "content": "Speak."}])
    assert chat.choices[0].finish_reason in ("stop", "length") and chat.choices[0].message.content is not None
    parts = list(client.chat.completions.create(model="v4jax-shakespeare", max_tokens=MAX_TOKENS, temperature=0.0,
                                                messages=[{"role": "user", "content": "Speak."}], stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in parts) == chat.choices[0].message.content
    assert _idle_and_free(cluster.p.state) and _idle_and_free(cluster.d.state)
    sent, got = _metrics(cluster.p.url), _metrics(cluster.d.url)
    n = sent['v4jax_pd_transfers_total{direction="sent",path="jax"}']
    assert n == got['v4jax_pd_transfers_total{direction="received",path="jax"}'] == 6
    for pool in ("swa", "compressor_state"):
        key = f'v4jax_pd_transfer_bytes_total{{direction="%s",pool="{pool}"}}'
        assert sent[key % "sent"] == got[key % "received"] > 0
    assert got['v4jax_pd_transfer_seconds_count{direction="received"}'] == 6


def test_secret_keeps_clients_off_the_servers(cluster):
    body = {"prompt": "ROMEO:", "max_tokens": 2}
    assert httpx.post(cluster.d.url + "/v1/completions", json=body).status_code == 403
    assert httpx.post(cluster.p.url + "/v4jax/pd/prefill", json={}).status_code == 403
    assert httpx.get(cluster.p.url + "/health").status_code == 200


def test_dead_prefill_server_is_retried_then_503(cluster):
    body = {"model": "v4jax-shakespeare", "prompt": "ROMEO:", "max_tokens": MAX_TOKENS, "temperature": 0.0}
    dead = _dead_url()
    r = _router([dead, cluster.p.url], [cluster.d.url])  # the dead one is first (equal load, given first)
    try:
        got = httpx.post(r.url + "/v1/completions", json=body, timeout=120)
        assert got.status_code == 200 and got.json()["choices"][0]["text"] == cluster.refs[0].text
        assert cluster.d.state.orchestrator.stats()["requests"]["prefill_retries"] >= 1
    finally:
        r.server.should_exit = True
        r.thread.join(30)
    r = _router([dead], [cluster.d.url, _dead_url()])
    try:
        got = httpx.post(r.url + "/v1/completions", json=body, timeout=120)
        assert got.status_code == 503 and "prefill" in got.json()["error"]["message"]
        streamed = httpx.post(r.url + "/v1/completions", json=dict(body, stream=True), timeout=120)
        assert streamed.status_code == 503
    finally:
        r.server.should_exit = True
        r.thread.join(30)
    assert _idle_and_free(cluster.p.state) and _idle_and_free(cluster.d.state)


def test_concurrent_streams_with_disconnects(cluster):
    """32 concurrent streams through the router (openai client), every fourth closed by its client after two chunks
    (mid-decode: it asked for 200 tokens): the others get the model's own output; the closed ones are aborted on
    the decode server; afterwards every page of every pool is free on both servers, no state is left offered on the
    prefill server, the router holds nothing in flight and still answers."""
    from concurrent.futures import ThreadPoolExecutor

    from openai import OpenAI
    client = OpenAI(base_url=cluster.r.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    n, closed = 32, set(range(0, 32, 4))
    aborted0 = _metrics(cluster.d.url).get('v4jax_request_finished_total{finish_reason="abort"}', 0.0)

    def one(i):
        prompt = PROMPTS[i % len(PROMPTS)]
        if i not in closed:
            stream = client.completions.create(model="v4jax-shakespeare", prompt=prompt, max_tokens=MAX_TOKENS,
                                               temperature=0.0, stream=True)
            return "".join(c.choices[0].text for c in stream)
        stream = client.completions.create(model="v4jax-shakespeare", prompt=prompt, max_tokens=200,
                                           temperature=0.0, stream=True)
        got = 0
        for _ in stream:
            got += 1
            if got == 2:
                break
        stream.close()  # the client goes away mid-stream
        return got

    with ThreadPoolExecutor(n) as pool:
        outs = list(pool.map(one, range(n)))
    for i, out in enumerate(outs):
        if i in closed:
            assert out == 2
        else:
            assert out == cluster.refs[i % len(PROMPTS)].text, i
    assert _idle_and_free(cluster.p.state) and _idle_and_free(cluster.d.state)
    d, p, r = _metrics(cluster.d.url), _metrics(cluster.p.url), _metrics(cluster.r.url)
    assert d['v4jax_request_finished_total{finish_reason="abort"}'] - aborted0 == len(closed)
    assert p["v4jax_pd_offers"] == 0 and p["v4jax_pd_offered_bytes"] == 0
    assert p["v4jax_pd_offers_withdrawn_total"] == 0  # every offer was pulled and said so
    for url in (cluster.d.url, cluster.p.url):  # as /metrics reports them (after the prefix caches were emptied)
        assert _all_pages_free(url)
    assert all(v == 0 for k, v in r.items() if k.startswith("v4jax_router_in_flight"))
    got = client.completions.create(model="v4jax-shakespeare", prompt=PROMPTS[0], max_tokens=MAX_TOKENS,
                                    temperature=0.0)
    assert got.choices[0].text == cluster.refs[0].text


def test_decode_server_of_other_weights_refused(cluster):
    """A decode server whose weights digest differs (as from another checkpoint): the prefill server refuses its
    prefills before doing any (409, naming the weights), the decode server answers 503 with that message through
    the router, and nothing is left offered or held on either side."""
    d = cluster.d.state.engine
    own = d.format
    d.format = dict(own, weights="0" * 32)
    try:
        body = {"model": "v4jax-shakespeare", "prompt": PROMPTS[0], "max_tokens": MAX_TOKENS, "temperature": 0.0}
        got = httpx.post(cluster.r.url + "/v1/completions", json=body, timeout=120)
        assert got.status_code == 503, got.text
        assert "weights digest" in got.json()["error"]["message"]
    finally:
        d.format = own
    assert _idle_and_free(cluster.p.state) and _idle_and_free(cluster.d.state)
    assert _metrics(cluster.p.url)["v4jax_pd_offers"] == 0


@pytest.mark.slow  # a third server to compile
def test_http_transport_end_to_end(cluster):
    """A prefill server with --pd-transport http: the decode server fetches the bytes from its /v4jax/pd/state."""
    p = _server(LLM(**LLM_OPTS), "prefill", transport="http")
    r = _router([p.url], [cluster.d.url])
    try:
        body = {"model": "v4jax-shakespeare", "prompt": PROMPTS[1], "max_tokens": MAX_TOKENS, "temperature": 0.0}
        got = httpx.post(r.url + "/v1/completions", json=body, timeout=120)
        assert got.status_code == 200 and got.json()["choices"][0]["text"] == cluster.refs[1].text
        assert _metrics(p.url)['v4jax_pd_transfers_total{direction="sent",path="http"}'] == 1
        assert _metrics(cluster.d.url)['v4jax_pd_transfers_total{direction="received",path="http"}'] == 1
        assert _idle_and_free(p.state) and _idle_and_free(cluster.d.state)
    finally:
        for s in (r, p):
            s.server.should_exit = True
            s.thread.join(30)
        p.state.orchestrator.stop()
