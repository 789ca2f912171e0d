"""The persistent compilation cache (v4jax.compile_cache): on by default, overridden by V4JAX_COMPILATION_CACHE, and a
second process running the same shapes loads its programs instead of compiling them. Counted with JAX's own
monitoring events (cache hits and misses), never timed."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from v4jax import compile_cache

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = textwrap.dedent("""
    import json, sys, jax
    counts = {"hits": 0, "misses": 0}
    def on_event(name, **kw):
        if name == "/jax/compilation_cache/cache_hits":
            counts["hits"] += 1
        elif name == "/jax/compilation_cache/cache_misses":
            counts["misses"] += 1
    jax.monitoring.register_event_listener(on_event)
    def on_duration(name, secs, **kw):
        if name == "/jax/core/compile/backend_compile_duration":
            print("COMPILED", file=sys.stderr, flush=True)
    jax.monitoring.register_event_duration_secs_listener(on_duration)
    from v4jax import LLM, SamplingParams
    llm = LLM("tiny", dtype="float32", max_num_seqs=1, max_model_len=64, prefill_chunk=16, decode_steps=4)
    print("GENERATE", file=sys.stderr, flush=True)
    out = llm.generate([[3, 4, 5, 6, 7]], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    print(json.dumps(dict(counts, tokens=out[0].token_ids, dir=jax.config.jax_compilation_cache_dir)))
""")


def _run(env):
    r = subprocess.run([sys.executable, "-c", SCRIPT], env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1]), r.stderr


def test_second_process_hits_the_cache(tmp_path):
    cache = tmp_path / "jax-cache"
    env = dict(os.environ, V4JAX_COMPILATION_CACHE=str(cache), JAX_PLATFORMS="cpu")
    first, err1 = _run(env)
    assert first["dir"] == str(cache)
    files = [f for f in cache.iterdir() if f.name != compile_cache.MARKERS]
    assert first["misses"] > 0 and files, (first, files)
    second, err2 = _run(env)
    assert second["tokens"] == first["tokens"]
    # every program the first run compiled is read back: nothing compiles again
    assert second["hits"] >= len(files) > 0 and second["misses"] == 0, (first, second, len(files))
    assert sorted(os.listdir(cache)) == sorted([f.name for f in files] + [compile_cache.MARKERS])
    # the one-line notice: exactly once for the run that compiles, before its steps compile (after generate
    # starts, before the first compile that follows); never for the run that the cache serves
    assert err1.count("v4jax: compiling") == 1 and f"cached in {cache}" in err1, err1[-2000:]
    after_start = err1[err1.index("GENERATE"):].splitlines()
    assert after_start[1].startswith("v4jax: compiling") and "COMPILED" in after_start[2:], after_start[:3]
    assert "v4jax: compiling" not in err2, err2[-2000:]


def test_first_compile_notice_is_keyed_on_the_engine(tmp_path, monkeypatch, capsys):
    """Said before the first step of an engine whose signature this cache has not compiled; not again once a run
    has compiled it; always with the cache off."""
    def notices(signature, directory, done=True):
        monkeypatch.setitem(compile_cache._state, "announced", False)
        monkeypatch.setattr(compile_cache, "in_use", lambda: directory)
        first = compile_cache.FirstCompile(signature)
        first.before()
        first.before()
        if done:
            first.after()
        return capsys.readouterr().err
    d = str(tmp_path)
    assert notices("engine a", d, done=False).count("v4jax: compiling") == 1
    assert notices("engine a", d).count(f"cached in {d}") == 1  # not finished before: said again
    assert notices("engine a", d) == ""
    assert notices("engine b", d).count("v4jax: compiling") == 1
    assert notices("engine a", None).count("compilation cache off") == 1
    assert sorted(os.listdir(tmp_path / compile_cache.MARKERS)) == sorted(
        compile_cache.FirstCompile(s).key for s in ("engine a", "engine b"))


def test_off_and_default_dirs(monkeypatch, tmp_path):
    monkeypatch.setenv(compile_cache.ENV, "off")
    assert compile_cache.cache_dir() is None
    monkeypatch.setenv(compile_cache.ENV, str(tmp_path / "x"))
    assert compile_cache.cache_dir() == str(tmp_path / "x")
    monkeypatch.delenv(compile_cache.ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert compile_cache.cache_dir() == str(tmp_path / "xdg" / "v4jax" / "jax")
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert compile_cache.cache_dir() == os.path.join(os.path.expanduser("~"), ".cache", "v4jax", "jax")


def test_tests_run_with_a_temporary_cache():
    """conftest points the cache at a temporary directory, so a test run never writes to the user's cache."""
    d = compile_cache.cache_dir()
    assert d and d != compile_cache.default_dir() and "v4jax-test-jax-cache-" in d

