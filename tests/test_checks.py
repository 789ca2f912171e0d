"""One request check (v4jax.engine.checks): an impossible request gets the same message, naming the same numbers,
from LLM.generate (before the engine is built), EngineCore.add_request and the server (a 400 in OpenAI's shape);
every refusal is counted in stats()["requests"]["rejected"]. The data-sharded case (a request can use only its
own data shard's pages) runs on 8 fake CPU devices in a subprocess (this file as a script)."""
import json
import os
import subprocess
import sys
import warnings

import pytest
import xla_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _ids(n):
    return [2 + i % 500 for i in range(n)]  # inside tiny's vocabulary of 512


def _llm(mesh=None, pages=8, max_model_len=4096):
    """tiny with pools of `pages` full pages (over the mesh's data shards)."""
    import jax.numpy as jnp

    from v4jax import LLM
    from v4jax.api import EngineOptions
    from v4jax.bench.replay import budget_for_pages
    from v4jax.config import preset
    opts = dict(max_num_seqs=2, max_model_len=max_model_len, prefill_chunk=64, mesh=mesh)
    budget = budget_for_pages(preset("tiny"), EngineOptions(**opts), max_model_len, jnp.float32, pages)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return LLM("tiny", dtype="float32", memory_budget_bytes=budget, **opts)


def _messages(llm, prompt, max_tokens) -> dict:
    """The error of each entry point for one request, and the rejections counted."""
    from fastapi.testclient import TestClient

    from v4jax import SamplingParams
    from v4jax.serve.app import ServerState, build_app
    from v4jax.serve.options import ServerOptions
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    out = {}
    assert llm._engine is None
    try:
        llm.generate([prompt], sp)
    except ValueError as e:
        out["generate"] = str(e)
    assert llm._engine is None  # refused before anything ran
    try:
        llm.engine.add_request("r", prompt, sp)
    except ValueError as e:
        out["engine"] = str(e)
    state = ServerState(llm, ServerOptions(log_level="warning", access_log=False))
    r = TestClient(build_app(state)).post("/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens})
    out["status"], out["error"] = r.status_code, r.json()["error"]
    out["rejected"] = llm.stats()["requests"]["rejected"]
    out["pages"], out["page_size"] = llm.engine.layout.n_pages, llm.engine.layout.page_size
    return out


def _assert_same(out, *numbers):
    msg = out["engine"]
    assert out["generate"] == f"prompt 0: {msg}", out
    assert out["status"] == 400 and out["error"]["message"] == msg, out
    assert out["error"]["param"] in ("max_tokens", "prompt") and out["error"]["type"] == "invalid_request_error"
    for n in numbers:
        assert str(n) in msg, (n, msg)
    assert out["rejected"] == 2, out  # generate's refusal and the engine's


def test_too_long_for_max_model_len_same_everywhere():
    llm = _llm(max_model_len=1024)
    out = _messages(llm, _ids(1000), 100)
    _assert_same(out, "prompt_len=1000", "max_tokens=100", "max_model_len=1024")
    assert out["error"]["code"] == "context_length_exceeded"


def test_too_many_pages_for_the_pool_same_everywhere():
    llm = _llm(pages=8)
    p = llm.request_check.page_size
    n_pages = llm.request_check.n_pages
    prompt = _ids(n_pages * p - 10)
    out = _messages(llm, prompt, 11)  # one token into page n_pages + 1
    assert out["pages"] == n_pages
    _assert_same(out, f"needs {n_pages + 1} pages of {p} tokens", f"the pool holds {n_pages}")
    assert out["error"]["code"] == "request_too_large"


def _mesh_case() -> dict:
    llm = _llm(mesh="data=2", pages=8)
    c = llm.request_check
    assert c.data_shards == 2
    per_shard = c.n_pages // 2
    # fits the whole pool, not one data shard
    prompt = _ids(per_shard * c.page_size)
    return dict(out=_messages(llm, prompt, 1), per_shard=per_shard, n_pages=c.n_pages, page_size=c.page_size)


def test_too_many_pages_for_one_data_shard_same_everywhere():
    env = dict(os.environ, XLA_FLAGS=xla_flags.cpu(8), JAX_PLATFORMS="cpu",
               TF_CPP_MIN_LOG_LEVEL="2")
    r = subprocess.run([sys.executable, os.path.abspath(__file__)], env=env, cwd=ROOT, capture_output=True,
                       text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    res = json.loads([line for line in r.stdout.splitlines() if line.startswith("RESULT ")][-1][len("RESULT "):])
    out, per_shard = res["out"], res["per_shard"]
    assert per_shard + 1 <= res["n_pages"]  # the whole pool would hold it
    _assert_same(out, f"needs {per_shard + 1} pages of {res['page_size']} tokens", f"{per_shard} per data shard",
                 f"the pool holds {res['n_pages']}")


def test_stop_ids_and_prompt_rules_are_the_checks():
    from v4jax import SamplingParams
    from v4jax.engine.checks import RequestCheck, RequestError
    c = RequestCheck(vocab_size=100, max_model_len=64, model_max_len=128, eos_token_id=1, page_size=16, n_pages=4)
    c([5, 6], SamplingParams(max_tokens=8))
    with pytest.raises(RequestError, match="prompt is empty"):
        c([], SamplingParams())
    with pytest.raises(RequestError, match=r"token ids \[100\] are outside the vocabulary \[0, 100\)"):
        c([5, 100], SamplingParams())
    with pytest.raises(RequestError, match="stop_token_ids: at most 7 are supported besides EOS, got 8") as e:
        c([5], SamplingParams(stop_token_ids=list(range(8))))
    assert e.value.param == "stop_token_ids"
    c([5], SamplingParams(stop_token_ids=list(range(8)), ignore_eos=True))
    c([5] * 60, SamplingParams(max_tokens=4))  # 4 pages: the whole pool
    big = RequestCheck(vocab_size=100, max_model_len=128, model_max_len=128, eos_token_id=1, page_size=16, n_pages=4)
    with pytest.raises(RequestError, match=r"needs 5 pages of 16 tokens \(prompt_len=60 \+ max_tokens=5\); the pool "
                                           "holds 4") as e:
        big([5] * 60, SamplingParams(max_tokens=5))
    assert e.value.param == "max_tokens"
    with pytest.raises(RequestError, match="prompt_len=64 ") as e:
        c([5] * 64, SamplingParams(max_tokens=1))
    assert e.value.param == "prompt"
    dense = RequestCheck(vocab_size=100, max_model_len=64, model_max_len=128, eos_token_id=1, page_size=16, n_pages=0)
    dense([5] * 60, SamplingParams(max_tokens=4))  # dense: every slot holds the whole context


if __name__ == "__main__":
    print("RESULT " + json.dumps(_mesh_case()), flush=True)
