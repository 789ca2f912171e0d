"""Prefill/decode disaggregation: a request's state exported from one engine after its prefill and imported into
another continues exactly as the request would on one engine (greedy tokens identical, float32 log-probs within
1e-5), across page sizes, the dense layout and a prefix-cache hit on the prefill side; a corrupted, truncated or
foreign state is refused by name; pages return on both sides."""

import numpy as np
import pytest

from v4jax import LLM, SamplingParams
from v4jax.cache import transfer as T
import xla_flags

GREEDY = dict(temperature=0.0, ignore_eos=True, logprobs=True)
# one slot, short contexts: few programs to compile (each prompt below stays within two 32-token pages)
BASE = dict(dtype="float32", max_num_seqs=1, max_model_len=64, prefill_chunk=32, decode_steps=4)


def _prompts(lens, vocab, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(2, vocab, n).tolist() for n in lens]


def _run_alone(core, rid, prompt, sp):
    core.add_request(rid, prompt, sp)
    toks, lps = [], []
    while core.has_unfinished_requests():
        for d in core.step():
            if d.request_id == rid:
                toks += d.new_token_ids
                lps += d.new_logprobs
    return toks, lps


def _prefill(core, rid, prompt, sp):
    """Prefill on `core` until the request has its first token; its exported state."""
    core.add_request(rid, prompt, sp, prefill_only=True)
    first = []
    while not first:
        for d in core.step():
            if d.request_id == rid:
                first += d.new_token_ids
    return core.export_request(rid)


def _decode(core, states):
    out = {}
    for st in states:
        core.import_request(st)
    while core.has_unfinished_requests():
        for d in core.step():
            t, lp = out.setdefault(d.request_id, ([], []))
            t += d.new_token_ids
            lp += d.new_logprobs
    return out


def _all_free(core):
    core.kv.reset_prefix_cache()
    core.kv.check()
    return core.kv.all_free() and not core.scheduler.requests and all(s is None for s in core.scheduler.slots)


@pytest.fixture(scope="module")
def engines():
    """(prefill, decode): the prefill engine also runs the single-engine reference (the same programs)."""
    prefill = LLM("tiny", page_size=32, **BASE)
    decode = LLM("tiny", page_size=16, **BASE)  # another page size (and SWA page size) on the decode side
    return prefill.engine, decode.engine


def test_export_import_equals_one_engine(engines):
    """Prompts across page and compression boundaries (and a prefix-cache hit on the prefill side: the second
    prompt repeats the first's first page): tokens and log-probs equal the single engine's."""
    prefill, decode = engines
    single = prefill
    vocab = single.cfg.vocab_size
    a, b = _prompts((45, 9), vocab, seed=1)
    prompts = [a, a[:32] + b]
    sp = SamplingParams(max_tokens=11, **GREEDY)
    want = [_run_alone(single, f"s{i}", p, sp) for i, p in enumerate(prompts)]
    single.kv.reset_prefix_cache()  # the prefill runs below start cold (but the second prompt's first page)
    hits0 = prefill.stats()["prefix_cache"]["hit_tokens"]
    states = [_prefill(prefill, f"r{i}", p, sp) for i, p in enumerate(prompts)]
    assert prefill.stats()["prefix_cache"]["hit_tokens"] - hits0 == 32  # the second prompt resumed a page
    assert prefill.stats()["requests"]["exported"] >= 2
    for st in states:
        assert set(st.bytes_by_pool()) == {"swa", "c4_kv", "c4_index", "c128_kv", "compressor_state"}
    got = _decode(decode, states)
    for i, (toks, lps) in enumerate(want):
        assert got[f"r{i}"][0] == toks
        np.testing.assert_allclose(got[f"r{i}"][1], lps, atol=1e-5)
    assert _all_free(prefill) and _all_free(decode)


def test_bytes_moved_are_the_analytic_size(engines):
    """What a state carries, pool by pool, is what the layout says a request at that position holds (the bytes of
    `v4jax bench pd`'s second table): the window's last rows, the completed entries, one slot of compressor state."""
    from v4jax.bench.pd import analytic_bytes
    prefill, _ = engines
    for n in (5, 40):
        prompt = _prompts((n,), prefill.cfg.vocab_size, seed=10)[0]
        st = _prefill(prefill, "a", prompt, SamplingParams(max_tokens=2, **GREEDY))
        want = analytic_bytes(prefill, n)
        assert {k: v for k, v in want.items() if v} == {k: v for k, v in st.bytes_by_pool().items() if v}
        assert want["c4_kv"] == n // 4 * st.arrays["c4_kv/1/kv"][0, 0].nbytes * st.arrays["c4_kv/1/kv"].shape[0]
    assert _all_free(prefill)


def test_bytes_roundtrip_and_corruption_refused(engines):
    prefill, decode = engines
    prompt = _prompts((37,), prefill.cfg.vocab_size, seed=2)[0]
    st = _prefill(prefill, "x", prompt, SamplingParams(max_tokens=3, **GREEDY))
    data = T.to_bytes(st)
    back = T.from_bytes(data)
    assert back.meta == st.meta and all(np.array_equal(back.arrays[k], st.arrays[k]) for k in st.arrays)
    with pytest.raises(T.TransferError, match="truncated"):
        T.from_bytes(data[:-5])
    bad = bytearray(data)
    bad[-3] ^= 0xFF
    with pytest.raises(T.TransferError, match="checksum"):
        T.from_bytes(bytes(bad))
    # a state with an array cut short, or another format, is refused at import (nothing is taken)
    short = T.RequestState(st.meta, dict(st.arrays, **{k: v[:, :1] for k, v in st.arrays.items()
                                                       if k.startswith("c4_kv")}))
    with pytest.raises(T.TransferError, match="c4_kv"):
        decode.import_request(short)
    other = T.RequestState(dict(st.meta, format=dict(st.meta["format"], kv_dtype="float8")), st.arrays)
    with pytest.raises(T.TransferError, match="kv_cache_dtype"):
        decode.import_request(other)
    # an engine of another KV format (checked before anything runs: nothing compiles)
    with pytest.raises(T.TransferError, match="kv_cache_dtype"):
        LLM("tiny", kv_cache_dtype="bfloat16", **BASE).engine.import_request(st)
    other = T.RequestState(dict(st.meta, format=dict(st.meta["format"], config="0" * 32)), st.arrays)
    with pytest.raises(T.TransferError, match="model configuration"):
        decode.import_request(other)
    assert not decode.has_unfinished_requests() and _all_free(decode) and _all_free(prefill)


def test_state_of_other_weights_refused(engines):
    """A state from an engine of the same configuration but other weights (another seed) is refused by the weights'
    digest, with a message naming them; in the in-process pair the request fails with that message and nothing is
    left on either side. The digest is the same on engines of the same weights (whatever their page size)."""
    from v4jax.model.weights import weights_checksum
    from v4jax.serve.disagg import LocalDisagg
    prefill, decode = engines
    fmt = prefill.transfer_format()
    assert fmt == decode.transfer_format() and fmt["weights"] == weights_checksum(prefill._leaves)
    other = LLM("tiny", seed=1, page_size=16, **BASE).engine
    assert other.transfer_format()["config"] == fmt["config"] and other.transfer_format()["weights"] != fmt["weights"]
    prompt = _prompts((37,), prefill.cfg.vocab_size, seed=9)[0]
    sp = SamplingParams(max_tokens=3, **GREEDY)
    st = _prefill(prefill, "m", prompt, sp)
    assert st.meta["format"]["weights"] == fmt["weights"]
    with pytest.raises(T.TransferError, match=r"a weights digest \(another checkpoint, or another seed"):
        other.import_request(st)
    with pytest.raises(T.TransferError, match=r"prompt 0: the request's state was refused: .*weights"):
        LocalDisagg(prefill, other).generate([prompt], sp)
    for core in (prefill, other):
        assert not core.has_unfinished_requests() and _all_free(core)


@pytest.mark.slow  # a third engine to compile
def test_dense_decode_side(engines):
    prefill, _ = engines
    single = prefill
    dense = LLM("tiny", kv_layout="dense", **BASE).engine
    prompt = _prompts((40,), single.cfg.vocab_size, seed=3)[0]
    sp = SamplingParams(max_tokens=6, **GREEDY)
    toks, lps = _run_alone(single, "d", prompt, sp)
    got = _decode(dense, [_prefill(prefill, "d", prompt, sp)])
    assert got["d"][0] == toks
    np.testing.assert_allclose(got["d"][1], lps, atol=1e-5)
    assert _all_free(prefill) and _all_free(dense)


def test_abort_frees(engines):
    prefill, dense = engines
    prompt = _prompts((40,), prefill.cfg.vocab_size, seed=3)[0]
    sp = SamplingParams(max_tokens=6, **GREEDY)
    # an imported request aborted before and after it is bound; a prefilled one aborted before export
    st = _prefill(prefill, "e", prompt, sp)
    dense.import_request(st)
    assert dense.abort("e")
    dense.import_request(st, request_id="e2")
    dense.step()
    assert dense.abort("e2")
    prefill.add_request("f", prompt, sp, prefill_only=True)
    while not prefill.scheduler.prefilled():
        prefill.step()
    assert prefill.abort("f")
    for core in (dense, prefill):
        while core.has_unfinished_requests():
            core.step()
    assert _all_free(prefill) and _all_free(dense)


def test_local_pair_as_one_serving_engine(engines):
    """The in-process pair (one ServingEngine over a prefill and a decode engine, each state through its bytes):
    the single engine's tokens and log-probs; every page back on both sides."""
    from v4jax.serve.disagg import LocalDisagg
    prefill, decode = engines
    prompts = _prompts((33, 44), prefill.cfg.vocab_size, seed=5)
    sp = SamplingParams(max_tokens=7, **GREEDY)
    want = [_run_alone(prefill, f"w{i}", p, sp) for i, p in enumerate(prompts)]
    pair = LocalDisagg(prefill, decode)
    got = pair.generate(prompts, sp)
    for (t, lp), (wt, wlp) in zip(got, want):
        assert t == wt
        np.testing.assert_allclose(lp, wlp, atol=1e-5)
    assert pair.stats()["transfers"]["count"] == 2
    assert _all_free(prefill) and _all_free(decode)


@pytest.mark.parametrize("path", ["jax", "http"])
def test_transport_checks_every_transfer(engines, path):
    """Both transports deliver the state bit for bit (a short prompt has no C128 entry yet: an empty array); a
    wrong checksum, or (HTTP) cut bytes, are refused."""
    from v4jax.serve.pd import StateTransport
    prefill, _ = engines
    sender, receiver = StateTransport(path=path), StateTransport(path=path)
    for n in (5, 40):
        prompt = _prompts((n,), prefill.cfg.vocab_size, seed=6)[0]
        st = _prefill(prefill, "t", prompt, SamplingParams(max_tokens=3, **GREEDY))
        assert (st.arrays["c128_kv/2/kv"].size == 0) == (n < 16)
        got = receiver.pull(sender.offer(st), sender.take_bytes)
        assert got.meta == st.meta and all(np.array_equal(got.arrays[k], st.arrays[k]) for k in st.arrays)
    bad = dict(sender.offer(st), checksum="0" * 32)
    with pytest.raises(T.TransferError, match="checksum"):
        receiver.pull(bad, sender.take_bytes)
    if path == "http":
        control = sender.offer(st)
        with pytest.raises(T.TransferError, match="truncated"):
            receiver.pull(control, lambda uid: sender.take_bytes(uid)[:-100])
    assert _all_free(prefill)


@pytest.mark.parametrize("path", ["jax", "http"])
def test_offer_never_pulled_is_withdrawn(engines, path, caplog):
    """An offered state nobody pulls within the offer timeout is dropped by the sender, logged and counted; one that
    was taken is not; the request's pages came back at its export either way."""
    import logging
    import time

    from prometheus_client import CollectorRegistry

    from v4jax.serve.pd import StateTransport, TransferMetrics
    prefill, _ = engines
    registry = CollectorRegistry()
    sender = StateTransport(path=path, metrics=TransferMetrics(registry), offer_timeout_s=0.5)
    receiver = StateTransport(path=path, timeout_s=5)
    prompt = _prompts((40,), prefill.cfg.vocab_size, seed=8)[0]
    st = _prefill(prefill, "w", prompt, SamplingParams(max_tokens=3, **GREEDY))
    assert _all_free(prefill)  # exported: what an offer holds is the state's copy in host memory
    caplog.set_level(logging.WARNING, logger="v4jax.serve")
    control = sender.offer(st)
    got = receiver.pull(control, sender.take_bytes)
    assert all(np.array_equal(got.arrays[k], st.arrays[k]) for k in st.arrays)
    if path == "jax":
        assert sender.taken(control["uuid"]) is not None  # the decode server's DELETE after its pull
    lost = sender.offer(st)
    assert sender.offered() == (1, st.nbytes())
    assert registry.get_sample_value("v4jax_pd_offered_bytes") == st.nbytes()
    give_up = time.monotonic() + 60
    while sender.withdrawn == 0 and time.monotonic() < give_up:
        time.sleep(0.05)
    assert sender.withdrawn == 1 and sender.offered() == (0, 0)
    assert registry.get_sample_value("v4jax_pd_offers_withdrawn_total") == 1
    assert registry.get_sample_value("v4jax_pd_offers") == 0
    assert registry.get_sample_value("v4jax_pd_offered_bytes") == 0
    assert f"withdrew the state of request w ({st.nbytes()} bytes, offer {lost['uuid']})" in caplog.text
    if path == "http":  # its bytes are gone
        assert sender.take_bytes(lost["uuid"]) is None
    else:  # the transfer server dropped it: a pull never arrives
        with pytest.raises(T.TransferError, match="did not arrive"):
            receiver.pull(lost)
    sender.close()


def test_bench_pd_reports_gb_per_s(engines, monkeypatch):
    """`v4jax bench pd`'s timing: each transport's row has the bytes moved, a transfer time and GB/s = bytes /
    seconds; a transport that cannot start (jax.experimental.transfer on a backend without it) has its error in its
    row and the http path is still timed; pages return on both sides."""
    from v4jax.bench import pd
    from v4jax.serve import pd as serve_pd
    prefill, decode = engines
    sizes, rows = pd.measure(prefill, decode, [40], ["jax", "http"], repeats=1, timeout_s=30)
    assert [s["prompt"] for s in sizes] == [40] and sizes[0]["bytes"] == sum(analytic := pd.analytic_bytes(
        prefill, 40).values()) and analytic
    assert [(r["path"], r["error"], r["repeats"]) for r in rows] == [("jax", None, 1), ("http", None, 1)]
    for r in rows:
        assert r["bytes"] == sizes[0]["bytes"] and r["transfer_ms"] > 0 and r["import_ms"] > 0
        assert r["gb_per_s"] == pytest.approx(r["bytes"] / r["transfer_ms"] / 1e6)

    def broken(host):
        raise RuntimeError("no transfer server on this backend")
    monkeypatch.setattr(serve_pd, "start_transfer_server", broken)
    _, rows = pd.measure(prefill, decode, [40], ["jax", "http"], repeats=1, timeout_s=30)
    assert rows[0]["gb_per_s"] is None and "no transfer server" in rows[0]["error"]
    assert rows[1]["error"] is None and rows[1]["gb_per_s"] > 0
    table = pd.markdown(sizes, rows)
    assert "| jax | 40 |" in table and "RuntimeError: no transfer server" in table
    assert _all_free(prefill) and _all_free(decode)


@pytest.mark.slow  # two speculative engines to compile
def test_speculative_decode_side(engines):
    """With speculative decoding on both sides the drafter's state moves too: the single speculative engine's
    tokens and log-probs; a state without it is refused by a speculative decode engine."""
    plain, _ = engines
    spec = dict(BASE, speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    prefill, decode = LLM("tiny", page_size=32, **spec).engine, LLM("tiny", page_size=16, **spec).engine
    prompt = _prompts((41,), prefill.cfg.vocab_size, seed=7)[0]
    sp = SamplingParams(max_tokens=10, **GREEDY)
    toks, lps = _run_alone(prefill, "s", prompt, sp)
    prefill.kv.reset_prefix_cache()
    st = _prefill(prefill, "s", prompt, sp)
    assert {"mtp_swa", "draft_state"} <= set(st.bytes_by_pool())
    got = _decode(decode, [st])
    assert got["s"][0] == toks
    np.testing.assert_allclose(got["s"][1], lps, atol=1e-5)
    with pytest.raises(T.TransferError, match="speculative_config"):
        decode.import_request(_prefill(plain, "p", prompt, sp))
    assert _all_free(prefill) and _all_free(decode) and _all_free(plain)


_SENDER = """
import sys, json, numpy as np
from v4jax.engine.transfer import RequestState
from v4jax.serve.pd import StateTransport
state = RequestState({"request": {"request_id": "x"}}, {"swa/0/swa": np.arange(4096, dtype=np.float32)})
transport = StateTransport()  # kept: its transfer server serves the offer
print(json.dumps(transport.offer(state)), flush=True)
sys.stdin.readline()
"""


def test_sender_dying_fails_the_pull():
    """A sender that dies before its state is pulled: the pull fails (it does not hang), and the next offer from a
    live sender is pulled whole."""
    import json
    import os
    import subprocess
    import sys

    from v4jax.serve.pd import StateTransport
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    child = subprocess.Popen([sys.executable, "-c", _SENDER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True, env=env)
    control = json.loads(child.stdout.readline())
    child.kill()
    child.wait(30)
    receiver = StateTransport(timeout_s=3)
    with pytest.raises(T.TransferError, match="did not arrive"):
        receiver.pull(control)
    child = subprocess.Popen([sys.executable, "-c", _SENDER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True, env=env)
    try:
        got = receiver.pull(json.loads(child.stdout.readline()))
        np.testing.assert_array_equal(got.arrays["swa/0/swa"], np.arange(4096, dtype=np.float32))
    finally:
        child.stdin.write("\n")
        child.stdin.flush()
        child.wait(30)


@pytest.mark.slow  # three engines on 8 fake devices in a subprocess: minutes with a cold compilation cache
def test_prefill_and_decode_on_different_meshes():
    """Prefill on devices 0-3 (data=2 x tensor=2, pages of 32), decode on devices 4-7 (tensor=4, then data=2 x
    context=2, pages of 16), in one process (LocalDisagg): LLM.generate's greedy tokens on one device, log-probs
    within 1e-5; the decode engine's pools stay on its own devices in its own shardings; pages back on both sides."""
    import json
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, XLA_FLAGS=xla_flags.cpu(8), JAX_PLATFORMS="cpu",
               TF_CPP_MIN_LOG_LEVEL="2")
    decode_meshes = ["tensor=4", "data=2,context=2"]
    r = subprocess.run([sys.executable, os.path.join(root, "tests", "disagg_mesh_worker.py"), "--prefill-mesh",
                        "data=2,tensor=2", "--decode-meshes", *decode_meshes], env=env, cwd=root,
                       capture_output=True, text=True, timeout=1500)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    rows = [json.loads(line[len("RESULT "):]) for line in r.stdout.splitlines() if line.startswith("RESULT ")]
    pairs = {row["decode_mesh"]: row for row in rows if row["check"] == "pair"}
    assert sorted(pairs) == sorted(decode_meshes)
    for row in pairs.values():
        assert row["tokens_equal"] and row["logprob_err"] <= 1e-5, row
        assert row["transfers"] == 3 and row["all_free"], row
        assert row["prefill_devices"] == [0, 1, 2, 3] and row["decode_devices"] == [4, 5, 6, 7], row
        assert row["moved"] == [], row
    assert pairs["data=2,context=2"]["decode_kv_spec"] == ["None", "('data', 'context')"]


def test_devices_need_a_mesh():
    import jax

    from v4jax.fields import FieldError
    with pytest.raises(FieldError, match="mesh"):
        LLM("tiny", devices=jax.devices()[:1], **BASE)
