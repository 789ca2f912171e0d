"""Log-probabilities through `v4jax serve`, checked against teacher-forced forwards of a float32 model (the
embedded default model) through the official `openai` client: `echo` with the prompt's log-probs and
`max_tokens: 0` (what lm-eval's log-likelihood tasks send), and the top-N alternatives of each generated token
(`logprobs: N`, chat's `top_logprobs: N`). The last test runs lm-eval itself against a `v4jax serve` process
(slow; it needs lm-eval in its own virtual environment, see BENCHMARKS.md)."""
import asyncio
import json
import os
import subprocess
import sys
import time
import types

import httpx
import jax
import numpy as np
import pytest
from test_serve import _idle_and_free, _sse, _start

from v4jax import LLM, SamplingParams
from v4jax.serve.app import ServerState, build_app
from v4jax.serve.engine import LeaderEngine
from v4jax.serve.options import ServerOptions

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = "v4jax-shakespeare"
PROMPT = "ROMEO:\nBut, soft! what light through yonder"
CHAT = [{"role": "user", "content": "What light?"}]
ECHO_TOL = 1e-5  # the server's scoring forward against LLM.logits: the same float32 forward
CACHED_TOL = 2e-5  # the engine's cached path against one teacher-forced forward (logits within 1e-5)


@pytest.fixture(scope="module")
def served():
    llm = LLM(dtype="float32", max_model_len=512, prefill_chunk=16, decode_steps=2)
    ids = llm.encode(PROMPT)
    # LLM.generate's alternatives, before the server owns the engine (only its thread may drive it afterwards)
    generated = llm.generate([ids], SamplingParams(max_tokens=6, temperature=0.0, logprobs=True, top_logprobs=3,
                                                   ignore_eos=True))[0]
    opts = ServerOptions(log_level="warning", access_log=False, request_timeout_s=300.0)
    state = ServerState(llm, opts).start()
    server, thread, url = _start(state)
    http = httpx.Client(base_url=url, timeout=300)
    yield types.SimpleNamespace(llm=llm, ids=ids, generated=generated, state=state, codec=state.codec, url=url,
                                http=http)
    http.close()
    server.shutdown_now()
    thread.join(30)
    state.orchestrator.stop()


@pytest.fixture(scope="module")
def client(served):
    from openai import OpenAI
    return OpenAI(base_url=served.url + "/v1", api_key="none", max_retries=0, timeout=300)


def _log_softmax(llm, ids) -> np.ndarray:
    """[T, vocab]: row t is the distribution of token t + 1, from one teacher-forced forward."""
    return np.asarray(jax.nn.log_softmax(llm.logits(ids), axis=-1))


def _check_top(pairs, row: np.ndarray, n: int, tol: float) -> None:
    """(token id, log-prob) pairs are the n most likely tokens of `row`, most likely first: each rank's log-prob
    is the reference's at that rank, and each id's is its own (so two ids may swap only within `tol` of a tie)."""
    assert len(pairs) == n
    ranked = np.sort(row)[::-1][:n]
    for (i, lp), want in zip(pairs, ranked):
        assert abs(lp - want) <= tol and abs(lp - row[i]) <= tol


def _top_dict(codec, pairs, chosen: int, chosen_lp: float) -> dict:
    """Completions' top_logprobs entry: the alternatives' texts and the chosen token's (OpenAI: up to N + 1)."""
    d = {}
    for i, lp in pairs:
        d.setdefault(codec.token_text(i), lp)
    d.setdefault(codec.token_text(chosen), chosen_lp)
    return d


def _ranked(row: np.ndarray, n: int) -> list[tuple[int, float]]:
    ids = sorted(range(row.size), key=lambda i: (-row[i], i))[:n]
    return [(i, float(row[i])) for i in ids]


# ---- the engine: SamplingParams.top_logprobs ----
def test_sampling_params_top_logprobs_bounds():
    assert SamplingParams(logprobs=True, top_logprobs=20).top_logprobs == 20
    assert SamplingParams(logprobs=True).top_logprobs == 0
    for kw in ({"top_logprobs": 3}, {"logprobs": True, "top_logprobs": 21}, {"logprobs": True, "top_logprobs": -1},
               {"logprobs": True, "top_logprobs": 2.0}):
        with pytest.raises(ValueError, match="top_logprobs") as e:
            SamplingParams(**kw)
        assert e.value.field == "top_logprobs"


@pytest.mark.slow  # minutes on CPU; -m slow
def test_generate_returns_the_top_alternatives_of_each_token(served):
    out = served.generated
    lsm = _log_softmax(served.llm, served.ids + out.token_ids)
    start = len(served.ids) - 1
    assert len(out.top_logprobs) == len(out.token_ids) == 6
    for j, (t, pairs) in enumerate(zip(out.token_ids, out.top_logprobs)):
        _check_top(pairs, lsm[start + j], 3, CACHED_TOL)
        assert pairs[0] == (t, out.logprobs[j])  # greedy: the chosen token is the most likely, with the same value


# ---- echo: the prompt's log-probs ----
def test_echo_scores_the_prompt_as_the_teacher_forced_forward(served, client):
    ids, codec = served.ids, served.codec
    lsm = _log_softmax(served.llm, ids)
    r = client.completions.create(model=MODEL, prompt=PROMPT, echo=True, logprobs=3, max_tokens=0)
    c = r.choices[0]
    assert (c.text, c.finish_reason) == (PROMPT, "length")
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), 0)
    lp = c.logprobs
    assert lp.tokens == [codec.token_text(t) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing predicts the first token
    want = [lsm[t - 1, ids[t]] for t in range(1, len(ids))]
    np.testing.assert_allclose(lp.token_logprobs[1:], want, atol=ECHO_TOL, rtol=0)
    for t in range(1, len(ids)):
        want_top = _top_dict(codec, _ranked(lsm[t - 1], 3), ids[t], lsm[t - 1, ids[t]])
        got = lp.top_logprobs[t]
        assert got.keys() == want_top.keys(), t
        np.testing.assert_allclose([got[k] for k in want_top], list(want_top.values()), atol=ECHO_TOL, rtol=0)
    assert lp.text_offset == list(np.cumsum([0] + [len(s) for s in lp.tokens[:-1]]))
    # token ids as the prompt: the same scores, the text decoded; logprobs 0: no alternatives
    r2 = client.completions.create(model=MODEL, prompt=ids, echo=True, logprobs=0, max_tokens=0)
    c2 = r2.choices[0]
    assert c2.text == served.llm.decode(ids) and c2.logprobs.top_logprobs is None
    assert c2.logprobs.token_logprobs == lp.token_logprobs
    # several prompts and n: one echo per choice
    r3 = client.completions.create(model=MODEL, prompt=[PROMPT, "JULIET:"], echo=True, max_tokens=0, n=2)
    assert [c.text for c in r3.choices] == [PROMPT, PROMPT, "JULIET:", "JULIET:"]
    assert all(c.logprobs is None for c in r3.choices)
    assert _idle_and_free(served.state)


def test_echo_with_generated_tokens(served, client):
    ids, codec = served.ids, served.codec
    r = client.completions.create(model=MODEL, prompt=PROMPT, echo=True, logprobs=2, max_tokens=4, temperature=0,
                                  extra_body={"ignore_eos": True, "return_token_ids": True})
    c = r.choices[0]
    out = c.model_extra["token_ids"]
    assert c.text == PROMPT + served.llm.decode(out) and len(out) == 4
    lp = c.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(ids) + 4
    assert lp.text_offset[len(ids)] == len(PROMPT)  # the generated text starts where the echoed prompt ends
    lsm = _log_softmax(served.llm, ids + out)
    want = [lsm[t - 1, (ids + out)[t]] for t in range(1, len(ids) + 4)]
    np.testing.assert_allclose(lp.token_logprobs[1:], want, atol=CACHED_TOL, rtol=0)
    for j, t in enumerate(out):  # greedy: the chosen token is the first of its alternatives
        row = lsm[len(ids) - 1 + j]
        assert max(lp.top_logprobs[len(ids) + j].values()) == lp.token_logprobs[len(ids) + j]
        assert lp.top_logprobs[len(ids) + j].keys() == _top_dict(codec, _ranked(row, 2), t, 0.0).keys()
    # streamed: the prompt comes first, then the tokens
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, echo=True, logprobs=2, max_tokens=4,
                                            temperature=0, stream=True, extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].text == PROMPT and chunks[0].choices[0].finish_reason is None
    assert "".join(ch.choices[0].text for ch in chunks) == c.text
    assert [x for ch in chunks for x in ch.choices[0].logprobs.token_logprobs] == lp.token_logprobs
    assert [x for ch in chunks for x in ch.choices[0].logprobs.text_offset] == lp.text_offset
    # max_tokens 0, streamed: one chunk per choice, the prompt, finish_reason "length"
    with served.http.stream("POST", "/v1/completions", json={"prompt": PROMPT, "echo": True, "max_tokens": 0,
                                                             "logprobs": 1, "stream": True,
                                                             "stream_options": {"include_usage": True}}) as resp:
        sse, done = _sse(resp.iter_lines())
    assert done and len(sse) == 2 and sse[0]["choices"][0]["text"] == PROMPT
    assert sse[0]["choices"][0]["finish_reason"] == "length" and sse[1]["usage"]["completion_tokens"] == 0
    assert _idle_and_free(served.state)


# ---- top-N alternatives of generated tokens ----
def test_completion_alternatives_equal_the_forward(served, client):
    ids, codec = served.ids, served.codec
    for temperature in (0.0, 1.0):
        r = client.completions.create(model=MODEL, prompt=PROMPT, logprobs=5, max_tokens=6, temperature=temperature,
                                      seed=0, extra_body={"ignore_eos": True, "return_token_ids": True})
        c = r.choices[0]
        out = c.model_extra["token_ids"]
        lsm = _log_softmax(served.llm, ids + out)
        lp = c.logprobs
        for j, t in enumerate(out):
            row = lsm[len(ids) - 1 + j]
            assert abs(lp.token_logprobs[j] - row[t]) <= CACHED_TOL  # of the raw logits, whatever the temperature
            got, want = lp.top_logprobs[j], _top_dict(codec, _ranked(row, 5), t, row[t])
            assert got.keys() == want.keys()
            np.testing.assert_allclose([got[k] for k in want], list(want.values()), atol=CACHED_TOL, rtol=0)
            if temperature == 0:
                assert max(got.values()) == lp.token_logprobs[j]
        # streamed: the same alternatives chunk by chunk
        chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, logprobs=5, max_tokens=6,
                                                temperature=temperature, seed=0, stream=True,
                                                extra_body={"ignore_eos": True}))
        assert [x for ch in chunks for x in ch.choices[0].logprobs.top_logprobs] == lp.top_logprobs
    assert _idle_and_free(served.state)


def test_chat_top_logprobs_equal_the_forward(served, client):
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=5, temperature=0, logprobs=True,
                                       top_logprobs=3, extra_body={"ignore_eos": True, "return_token_ids": True})
    c = r.choices[0]
    prompt, out = c.model_extra["prompt_token_ids"], c.model_extra["token_ids"]
    lsm = _log_softmax(served.llm, prompt + out)
    content = c.logprobs.content
    assert len(content) == len(out) == 5
    for j, (t, entry) in enumerate(zip(out, content)):
        row = lsm[len(prompt) - 1 + j]
        assert len(entry.top_logprobs) == 3 and entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob == entry.logprob
        want = _ranked(row, 3)
        assert [a.token for a in entry.top_logprobs] == [served.codec.token_text(i) for i, _ in want]
        np.testing.assert_allclose([a.logprob for a in entry.top_logprobs], [lp for _, lp in want],
                                   atol=CACHED_TOL, rtol=0)
    assert _idle_and_free(served.state)


# ---- limits ----
def test_echo_limits_and_errors(served):
    http = served.http
    cases = [({"prompt": PROMPT, "max_tokens": 0}, "max_tokens"),
             ({"prompt": list(range(2, 600)), "echo": True, "max_tokens": 0}, "prompt"),  # past the context
             ({"prompt": PROMPT, "echo": True, "logprobs": 21}, "logprobs"),
             ({"prompt": PROMPT, "echo": True, "max_tokens": 0, "temperature": -1}, "temperature")]
    for body, param in cases:
        r = http.post("/v1/completions", json=body)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["param"] == param
    # a prompt filling the context can still be scored: nothing is generated
    ids = [0] + [int(t) for t in np.random.default_rng(0).integers(2, 2048, 511)]
    r = http.post("/v1/completions", json={"prompt": ids, "echo": True, "max_tokens": 0, "logprobs": 1})
    assert r.status_code == 200 and len(r.json()["choices"][0]["logprobs"]["token_logprobs"]) == 512


def test_multi_process_server_refuses_prompt_scoring(served):
    """A multi-process server (LeaderEngine) has no scoring forward that its other processes would run in step:
    `echo` with `logprobs` is a 501 naming the field, never a wrong answer."""

    class Channel:
        def publish(self, message):
            pass

    state = ServerState(served.llm, ServerOptions(log_level="warning"),
                        engine=LeaderEngine(served.llm.engine, Channel()))  # never started: nothing runs

    async def post(body):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(state)), base_url="http://t") as c:
            return await c.post("/v1/completions", json=body)

    r = asyncio.run(post({"prompt": PROMPT, "echo": True, "logprobs": 1, "max_tokens": 0}))
    err = r.json()["error"]
    assert r.status_code == 501 and err["param"] == "echo" and err["code"] == "unsupported"
    assert set(err) == {"message", "type", "param", "code"} and "multi-process" in err["message"]


# ---- lm-eval against the server ----
LMEVAL_PYTHON = os.environ.get("V4JAX_LMEVAL_PYTHON", "/work/lmeval-venv/bin/python")
TASK_DIR = os.path.join(ROOT, "tests", "data", "lm_eval")


def _has_lm_eval() -> bool:
    if not os.path.exists(LMEVAL_PYTHON):
        return False
    probe = subprocess.run([LMEVAL_PYTHON, "-c", "import lm_eval, transformers"], capture_output=True, check=False)
    return probe.returncode == 0


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _own_accuracy(llm, docs) -> float:
    """The multiple-choice accuracy lm-eval computes, from LLM.logits: each choice's continuation tokens
    (lm-eval's pairing: whole = encode(context + " " + choice), continuation = whole[len(encode(context)):], no
    special tokens) summed, the best choice against the answer."""
    tok = llm.tokenizer
    right = 0
    for d in docs:
        ctx = tok.encode(d["context"], add_special_tokens=False).ids
        scores = []
        for choice in d["choices"]:  # the task's target_delimiter, " ", joins them
            whole = tok.encode(d["context"] + " " + choice, add_special_tokens=False).ids
            lsm = _log_softmax(llm, whole)
            scores.append(sum(lsm[t - 1, whole[t]] for t in range(len(ctx), len(whole))))
        right += int(np.argmax(scores)) == d["answer"]
    return right / len(docs)


@pytest.mark.slow
@pytest.mark.skipif(not _has_lm_eval(), reason=f"lm-eval (with transformers) is not installed at {LMEVAL_PYTHON} "
                    "(set V4JAX_LMEVAL_PYTHON; BENCHMARKS.md, 'Evaluation harnesses')")
def test_lm_eval_multiple_choice_against_the_server(tmp_path):
    """lm-eval's `local-completions` runs a multiple-choice task (log-likelihood requests: echo, logprobs 1) over
    the local data in tests/data/lm_eval against `v4jax serve --dtype float32`; its accuracy is the one computed
    here from LLM.logits."""
    port = _free_port()
    log = tmp_path / "server.log"
    cmd = [sys.executable, "-m", "v4jax.cli", "serve", "--port", str(port), "--dtype", "float32", "--max-model-len",
           "512", "--no-access-log"]
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "the server did not come up"
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.3)
        out = tmp_path / "lm_eval"
        env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        model_args = (f"model={MODEL},base_url={url}/v1/completions,tokenizer_backend=huggingface,"
                      f"tokenizer={ROOT}/v4jax/default_model,max_length=512")
        r = subprocess.run([LMEVAL_PYTHON, "-m", "lm_eval", "--model", "local-completions", "--model_args",
                            model_args, "--tasks", "v4jax_shakespeare_cloze", "--include_path", TASK_DIR,
                            "--output_path", str(out)],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=900, check=False)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    finally:
        proc.terminate()
        proc.wait(30)
    results = json.loads(next(out.rglob("results_*.json")).read_text())["results"]["v4jax_shakespeare_cloze"]
    with open(os.path.join(TASK_DIR, "shakespeare_cloze.jsonl")) as f:
        docs = [json.loads(line) for line in f if line.strip()]
    assert results["acc,none"] == pytest.approx(_own_accuracy(LLM(dtype="float32"), docs))
