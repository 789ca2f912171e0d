"""`v4jax serve` fuzzed with hypothesis: request bodies for every POST route, right and wrong types for each field,
sizes, unicode (lone surrogates escaped and raw, control characters), nesting, numbers at every width (huge ints,
NaN / Infinity literals, negative zero, 1e400), missing and extra fields, raw bytes that are not JSON.

One server for the module (the embedded default model; a 64-token context, so that every prompt fits one prefill
chunk and one page, and long prompts are refused cheaply), one kept-alive HTTP connection for every request. Each
request must get a 2xx or a 4xx, never a 5xx (nor a streamed server error); an error body has OpenAI's shape; and
the connection must still serve the next request (a probe on the same socket). At the end the server answers a
normal request and every page is free.

The default run is derandomized (the same examples each run, so CI does not flake on a new seed) and bounded
(~250 examples); the slow variant draws 10x as many at random."""
from __future__ import annotations

import collections
import http.client
import json
import time
import types

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from v4jax import LLM
from v4jax.serve.app import ServerState
from v4jax.serve.options import ServerOptions

import serving

KEY = "fuzz-key-0123"
MODEL = "v4jax-shakespeare"
VOCAB = 2048
MAX_MODEL_LEN = 64
MAX_BODY = 16 << 10
CHEAP_TOKENS = 4  # the most a drawn max_tokens may ask for when it would be accepted


# ---- the server ----


@pytest.fixture(scope="module")
def served():
    llm = LLM(max_model_len=MAX_MODEL_LEN, prefill_chunk=16, decode_steps=2, max_num_seqs=2)
    llm.engine.warmup()  # every program compiled before the first example: no example waits on XLA
    opts = ServerOptions(api_key=KEY, log_level="critical", access_log=False, max_waiting=6, max_n=4,
                         max_body_bytes=MAX_BODY, request_timeout_s=60.0)
    state = ServerState(llm, opts).start()
    server, thread, port = serving.start(state)
    conn = KeepAlive(port)
    yield types.SimpleNamespace(state=state, port=port, conn=conn)
    conn.close()
    server.shutdown_now()
    thread.join(30)
    state.orchestrator.stop()


class KeepAlive:
    """One HTTP/1.1 connection for every request. After each response a probe (GET /health) must be answered on
    the same socket: the server neither closed it nor left it unusable. A connection left idle for longer than the
    server's keep-alive timeout (uvicorn's 5 s) is closed by the server as it should be: one idle that long (between
    tests, while a fixture collects garbage) is opened anew, as any client's pool does."""

    IDLE_S = 4.0

    def __init__(self, port: int):
        self.port = port
        self.conn: http.client.HTTPConnection | None = None
        self.last_used = 0.0
        self.statuses: collections.Counter = collections.Counter()  # of the fuzzed requests (not the probes)

    def close(self):
        if self.conn is not None:
            self.conn.close()

    def _open(self) -> http.client.HTTPConnection:
        if self.conn is not None and time.monotonic() - self.last_used > self.IDLE_S:
            self.conn.close()
        if self.conn is None or self.conn.sock is None:  # a failed example closed it: the next one starts anew
            self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
            self.conn.connect()
        return self.conn

    def request(self, method: str, path: str, body: bytes | None, headers: dict, chunked: bool = False):
        conn = self._open()
        sock = conn.sock
        try:
            conn.putrequest(method, path, skip_accept_encoding=True)
            for k, v in headers.items():
                conn.putheader(k, v)
            if body is not None and chunked:
                conn.putheader("Transfer-Encoding", "chunked")
            elif body is not None:
                conn.putheader("Content-Length", str(len(body)))
            conn.endheaders()
            if body is not None and chunked:
                for i in range(0, max(len(body), 1), 4096):
                    piece = body[i:i + 4096]
                    conn.send(b"%x\r\n%s\r\n" % (len(piece), piece) if piece else b"")
                conn.send(b"0\r\n\r\n")
            elif body:
                conn.send(body)
            r = conn.getresponse()
            data = r.read()
        except (http.client.HTTPException, OSError) as e:
            conn.close()
            raise AssertionError(f"the server dropped the connection: {type(e).__name__}: {e}") from None
        self.last_used = time.monotonic()
        kept = not r.will_close and conn.sock is sock
        return r.status, {k.lower(): v for k, v in r.getheaders()}, data, kept

    def probe(self) -> None:
        status, _, data, kept = self.request("GET", "/health", None, {})
        assert status == 200 and kept, ("the probe after a request failed", status, data[:200])


# ---- JSON text, written by hand so that it can hold what json.dumps never writes ----
class Lit(str):
    """JSON text emitted as it is (a number literal, a string with a raw escape, deep nesting, broken syntax)."""


class Dumped:
    """A string dumped with or without ensure_ascii (a lone surrogate then becomes an escape, or invalid UTF-8)."""

    def __init__(self, s: str, ascii: bool):
        self.s, self.ascii = s, ascii

    def __repr__(self):
        return f"Dumped({self.s!r}, ascii={self.ascii})"


def dump(v) -> str:
    if isinstance(v, Lit):
        return str(v)
    if isinstance(v, Dumped):
        return json.dumps(v.s, ensure_ascii=v.ascii)
    if isinstance(v, dict):
        return "{" + ",".join(f"{dump(k) if isinstance(k, (Lit, Dumped)) else json.dumps(k)}:{dump(x)}"
                              for k, x in v.items()) + "}"
    if isinstance(v, list):
        return "[" + ",".join(dump(x) for x in v) + "]"
    return json.dumps(v)  # floats: NaN, Infinity, -Infinity, -0.0 as Python writes them


def to_bytes(text: str) -> bytes:
    return text.encode("utf-8", "surrogatepass")  # a raw lone surrogate stays in: invalid UTF-8


NUMBER_LITERALS = [
    "NaN", "Infinity", "-Infinity", "-NaN", "nan", "inf", "-0", "-0.0", "0e0", "-0e-0", "1e400", "-1e400", "1e-400",
    "4.9e-324", "1.7976931348623157e308", "3.4028235e38", "3.5e38", "2147483647", "2147483648", "-2147483648",
    "-2147483649", "4294967296", "9223372036854775807", "9223372036854775808", "-9223372036854775809",
    "18446744073709551616", "1" * 64, "1" * 65, "-" + "9" * 64, "1" * 4400, "0." + "0" * 70 + "1", "1.0", "4.0",
    "1E2", "01", "+1", ".5", "5.", "0x10", "1_000", "１",
]
STRING_LITERALS = [
    r'"\ud800"', r'"\udfff"', r'"a\udc00b"', r'"\ud800\ud800"', r'"\udfff\ud800"', r'"\ud83d\ude00"', r'"\u0000"',
    r'"\u001f"', '"\x00"', '"tab\there"', '"new\nline"', r'"\x41"', r'"\uZZZZ"', r'"\ud8"', '"\\', '"',
    r'"\\ud800"', r'"\\\ud800"', '"\u2028\u2029"', '"\ufeff"', '"\U0001f600"',
]


def _nested(depth: int, inner: str = "1", obj: bool = False) -> Lit:
    return Lit(('{"a":' * depth + inner + "}" * depth) if obj else ("[" * depth + inner + "]" * depth))


NESTING = [_nested(d, obj=o) for d in (30, 31, 32, 33, 64, 2000) for o in (False, True)] + \
    [Lit("[" * 40), Lit("]" * 40 + "[" * 40), Lit('"' + "[" * 100 + '"')]

text_chars = st.characters(exclude_categories=())  # every code point, lone surrogates included
texts = st.text(text_chars, max_size=24) | \
    st.text(st.sampled_from("ROMEO: JULIET\n\t\r\x00\x1f\x7f€😀\ud800\udfff"), max_size=24)
strings = texts | st.builds(Dumped, texts, st.booleans()) | st.sampled_from([Lit(s) for s in STRING_LITERALS])
numbers = (st.integers() | st.integers(-2**70, 2**70) | st.floats() | st.sampled_from([Lit(s) for s in NUMBER_LITERALS])
           | st.sampled_from([0, 1, -1, 2**31 - 1, 2**31, -2**31, -2**31 - 1, 2**63, 0.0, -0.0, 0.5, 1e-300]))
scalars = st.none() | st.booleans() | numbers | strings
keys = st.text(text_chars, max_size=8) | st.builds(Dumped, st.text(text_chars, max_size=8), st.booleans())
json_values = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(keys, inner, max_size=4), max_leaves=10,
) | st.sampled_from(NESTING)
ABSENT = object()


def token_ids(lo=1, hi=8):
    return st.lists(st.integers(0, VOCAB - 1), min_size=lo, max_size=hi)


def _small_text():
    """Text a request may hold: mostly valid UTF-8, now and then with a lone surrogate (escaped in the JSON)."""
    return st.text(st.characters(codec="utf-8"), min_size=1, max_size=16) | \
        st.text(st.characters(exclude_categories=()), min_size=1, max_size=4)


# The right values of each field (a request of only these generates, cheaply); the wrong ones are json_values.
COMMON = {
    "model": st.just(MODEL),
    "max_tokens": st.integers(1, CHEAP_TOKENS),
    "temperature": st.sampled_from([0, 0.0, 0.7, 1, 2.5]) | st.floats(0, 3),
    "top_p": st.floats(0.01, 1),
    "top_k": st.integers(-1, 64),
    "seed": st.integers(-2**31, 2**31 - 1),
    "n": st.integers(1, 3),
    "stream": st.booleans(),
    "stop": _small_text() | st.lists(_small_text(), max_size=3),
    "stop_token_ids": token_ids(0, 3),
    "ignore_eos": st.booleans(),
    "return_token_ids": st.booleans(),
    "presence_penalty": st.just(0),
    "min_tokens": st.integers(0, 4),
    "frequency_penalty": st.just(0.0),
    "logit_bias": st.just({}),
    "response_format": st.just({"type": "text"}),
    "user": _small_text(),
}
COMPLETION = {
    **COMMON,
    "prompt": _small_text() | token_ids() | st.lists(_small_text(), min_size=1, max_size=2)
    | st.lists(token_ids(), min_size=1, max_size=2),
    "logprobs": st.integers(0, 5) | st.booleans(),
    "echo": st.just(False),
    "suffix": st.just(""),
    "best_of": st.integers(1, 3),
}
_parts = st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": _small_text()}), min_size=1, max_size=2)
_message = st.fixed_dictionaries({"role": st.sampled_from(["system", "developer", "user", "assistant", "tool"]),
                                  "content": _small_text() | _parts}, optional={"name": _small_text()})
CHAT = {
    **COMMON,
    "messages": st.lists(_message, min_size=1, max_size=3),
    "max_completion_tokens": st.integers(1, CHEAP_TOKENS),
    "logprobs": st.booleans(),
    "top_logprobs": st.integers(0, 20),
    "add_generation_prompt": st.booleans(),
    "chat_template_kwargs": st.dictionaries(st.sampled_from(["bos_token", "eos_token", "x_token", "custom"]),
                                            _small_text(), max_size=2),
    "tools": st.just([]),
}
GENERATE = {
    "max_tokens": st.integers(1, CHEAP_TOKENS),
    "text_content": st.fixed_dictionaries({"text": _small_text()}),
    "token_content": st.fixed_dictionaries({"token_ids": token_ids()}),
    "metadata": st.just({}) | st.dictionaries(st.text(max_size=4), st.text(max_size=4), max_size=2),
    "num_samples": st.integers(0, 3),
}
REQUIRED = {"/v1/completions": ("prompt", "max_tokens"), "/v1/chat/completions": ("messages", "max_tokens"),
            "/v1/generate": ("max_tokens", "text_content")}
FIELDS = {"/v1/completions": COMPLETION, "/v1/chat/completions": CHAT, "/v1/generate": GENERATE}


@st.composite
def bodies(draw, path: str):
    """A body for `path`: each field absent, right or wrong (any JSON value), sometimes extra fields; one in four
    is right throughout. Valid requests stay cheap: an accepted max_tokens is at most CHEAP_TOKENS."""
    fields = FIELDS[path]
    valid = draw(st.integers(0, 3)) == 0
    body = {}
    for name, good in fields.items():
        if valid:
            if name in REQUIRED[path] or draw(st.integers(0, 3)) == 0:
                body[name] = draw(good)
            continue
        choice = draw(st.sampled_from(["absent", "absent", "good", "bad"]))
        if choice == "good" or (choice == "absent" and name in REQUIRED[path] and draw(st.booleans())):
            body[name] = draw(good)
        elif choice == "bad":
            body[name] = draw(json_values | good.map(lambda v: _wrap(v)))
    if path == "/v1/generate" and valid and "token_content" in body:
        body.pop("text_content", None)
    if not valid and draw(st.integers(0, 4)) == 0:
        body.update(draw(st.dictionaries(keys, json_values, max_size=3)))
    for name in ("max_tokens", "max_completion_tokens"):  # a count the server would accept is made cheap
        v = body.get(name)
        if type(v) is int and CHEAP_TOKENS < v <= MAX_MODEL_LEN:
            body[name] = CHEAP_TOKENS
    return body


def _wrap(v):
    """A right value in a wrong container (a list of it, an object holding it)."""
    return [v] if not isinstance(v, list) else {"v": v}


@st.composite
def requests(draw, paths=tuple(FIELDS)):
    """(method, path, body bytes, headers, chunked): mostly JSON objects for the POST routes, sometimes bodies that
    are not (raw bytes, other JSON values, a valid body cut short or re-encoded), other paths and methods."""
    path = draw(st.sampled_from(paths))
    kind = draw(st.sampled_from(["object"] * 8 + ["raw", "value", "mangled", "path"]))
    method = "POST"
    if kind == "object":
        body = to_bytes(dump(draw(bodies(path))))
    elif kind == "raw":
        body = draw(st.binary(max_size=64) | st.sampled_from([b"", b"{", b"}", b"\xff\xfe{}", b"\x00" * 8, b"null",
                                                              b"\xef\xbb\xbf{}", b"{}" * 3, b'{"a":1}{"a":2}']))
    elif kind == "value":
        body = to_bytes(dump(draw(json_values)))
    elif kind == "mangled":
        text = dump(draw(bodies(path)))
        how = draw(st.sampled_from(["cut", "utf-16", "utf-16-le", "utf-32", "bom", "latin-1", "pad"]))
        if how == "cut":
            body = to_bytes(text)[:draw(st.integers(0, max(0, len(text) - 1)))]
        elif how == "bom":
            body = b"\xef\xbb\xbf" + to_bytes(text)
        elif how == "pad":
            body = b" \t\r\n" * draw(st.integers(1, 64)) + to_bytes(text) + b"\n" * 3
        else:
            body = text.encode(how, "surrogatepass" if how != "latin-1" else "replace")
    else:
        path = draw(st.sampled_from(["/v1/models", "/health", "/v1/health", "/metrics", "/v1/nothing", "/",
                                     "/v1/completions/", "/v1//completions", "/v1/completions?x=%ff&y",
                                     "/v1/%ED%A0%80", "/v1/generate/../completions"]))
        method = draw(st.sampled_from(["POST", "PUT", "DELETE", "PATCH", "GET"]))
        body = to_bytes(dump(draw(bodies("/v1/completions"))))
    headers = {}
    ctype = draw(st.sampled_from(["application/json"] * 4 + [None, "text/plain", "application/json; charset=latin-1",
                                                            "multipart/form-data; boundary=x"]))
    if ctype is not None:
        headers["Content-Type"] = ctype
    auth = draw(st.sampled_from(["good"] * 9 + ["none", "wrong", "scheme"]))
    if auth != "none":
        headers["Authorization"] = {"good": f"Bearer {KEY}", "wrong": "Bearer nope",
                                    "scheme": f"Basic {KEY}"}[auth]
    chunked = draw(st.integers(0, 9)) == 0
    return method, path, body, headers, chunked


# ---- what every response must be ----
def _errors_in_stream(data: bytes) -> list:
    """The error objects of a streamed response (SSE `data:` lines, or JetStream's JSON lines)."""
    found = []
    for line in data.decode("utf-8").splitlines():
        line = line.removeprefix("data: ")
        if not line.strip() or line == "[DONE]":
            continue
        obj = json.loads(line)
        if "error" in obj:
            found.append(obj["error"])
    return found


def check(conn: KeepAlive, req) -> int:
    try:
        return _check(conn, req)
    except AssertionError:
        conn.close()  # whatever state the failure left it in, the next example starts on a new connection
        conn.conn = None
        raise


def _check(conn: KeepAlive, req) -> int:
    method, path, body, headers, chunked = req
    status, resp_headers, data, kept = conn.request(method, path, body, headers, chunked)
    conn.statuses[status] += 1
    shown = (method, path, body[:300], headers, chunked)
    # a path with a trailing slash is redirected to the route (Starlette's redirect_slashes): not an error
    redirect = status in (307, 308) and "location" in resp_headers
    assert 200 <= status < 300 or 400 <= status < 500 or redirect, (status, data[:500], shown)
    assert kept, ("the server closed the connection", status, data[:300], shown)
    if status >= 400:
        err = json.loads(data)["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"], (status, err, shown)
    elif resp_headers.get("content-type", "").startswith("text/event-stream"):
        server_errors = [e for e in _errors_in_stream(data) if e.get("type") == "server_error"]
        assert not server_errors, (server_errors, shown)
        if path != "/v1/generate":
            assert data.endswith(b"data: [DONE]\n\n"), (data[-200:], shown)
    conn.probe()
    return status


# Found by the fuzz, each fixed in the server: (method, path, body, why)
REGRESSIONS = [
    # a UTF-16 body passed the lone-surrogate check (it reads UTF-8 bytes) and the tokenizer then raised a
    # TypeError: a 500, and the connection dropped. Bodies are read as UTF-8 only (RFC 8259).
    ("POST", "/v1/generate", '{"max_tokens": 2, "text_content": {"text": "a\\ud800"}}'.encode("utf-16"),
     "lone surrogate in a UTF-16 body"),
    ("POST", "/v1/generate", '{"max_tokens": 2, "text_content": {"text": "x"}}'.encode("utf-16-le"),
     "UTF-16 without a BOM"),
    ("POST", "/v1/completions", '{"prompt": "a\\udfff", "max_tokens": 2}'.encode("utf-32"),
     "lone surrogate in a UTF-32 body"),
    ("POST", "/v1/chat/completions",
     '{"messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 2}'.encode("utf-16"),
     "lone surrogate in a UTF-16 chat body"),
]


@pytest.mark.parametrize("method,path,body,why", REGRESSIONS, ids=[r[-1] for r in REGRESSIONS])
def test_found_by_the_fuzz(served, method, path, body, why):
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"}
    assert 400 <= check(served.conn, (method, path, body, headers, False)) < 500, why


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_oversized_bodies_get_413_on_a_kept_connection(served, chunked):
    """Refused by the declared length before it is read, or counted as it arrives: a 413 either way, and the
    connection serves the next request."""
    body = json.dumps({"prompt": "x" * MAX_BODY, "max_tokens": 1}).encode()
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"}
    assert check(served.conn, ("POST", "/v1/completions", body, headers, chunked)) == 413


def _run(conn: KeepAlive, strategy, examples: int, derandomize: bool):
    @settings(max_examples=examples, deadline=None, derandomize=derandomize, database=None, print_blob=True,
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def fuzz(req):
        check(conn, req)
    fuzz()


SCALES = [pytest.param(1, True, id="ci"), pytest.param(10, False, id="long", marks=pytest.mark.slow)]


@pytest.mark.parametrize("scale,derandomize", SCALES)
def test_fuzz_completions(served, scale, derandomize):
    _run(served.conn, requests(("/v1/completions",)), 90 * scale, derandomize)


@pytest.mark.parametrize("scale,derandomize", SCALES)
def test_fuzz_chat(served, scale, derandomize):
    _run(served.conn, requests(("/v1/chat/completions",)), 80 * scale, derandomize)


@pytest.mark.parametrize("scale,derandomize", SCALES)
def test_fuzz_generate(served, scale, derandomize):
    _run(served.conn, requests(("/v1/generate",)), 60 * scale, derandomize)


def test_after_the_fuzz_the_server_answers_and_every_page_is_free(served):
    """Runs last: a normal request on the kept-alive connection, then nothing left in flight or holding a page. The
    fuzz reached the engine as well as the checks (some requests generated)."""
    ok = sum(n for s, n in served.conn.statuses.items() if s < 300)
    assert ok >= 10 and sum(served.conn.statuses.values()) - ok >= 100, served.conn.statuses
    body = json.dumps({"model": MODEL, "prompt": "ROMEO:", "max_tokens": CHEAP_TOKENS, "temperature": 0,
                       "ignore_eos": True}).encode()
    status, _, data, kept = served.conn.request("POST", "/v1/completions", body,
                                                {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    assert status == 200 and kept, data[:300]
    choice = json.loads(data)["choices"][0]
    assert choice["finish_reason"] == "length" and choice["text"]
    orch = served.state.orchestrator
    deadline = time.monotonic() + 30
    while orch.stats()["server"]["in_flight"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert orch.stats()["server"]["in_flight"] == 0

    def all_free(engine):
        core = engine.core
        core.kv.reset_prefix_cache()
        return core.kv.all_free() and all(s is None for s in core.scheduler.slots)
    assert orch.run_on_engine(lambda e: not e.has_unfinished_requests()).result(10)
    assert orch.run_on_engine(all_free).result(10)
