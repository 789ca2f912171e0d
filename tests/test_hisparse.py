"""Host offload of the C4 KV pool (enable_hisparse): the row cache reads the host's values whatever is resident;
the engine with offload gives the plain run's greedy tokens and log-probs; options that cannot work fail at load;
bytes are counted where they live."""
import dataclasses
import re

import jax
import jax.numpy as jnp

import numpy as np
import pytest

from v4jax.api import EngineOptions
from v4jax.config import preset

GREEDY = dict(temperature=0.0, ignore_eos=True, logprobs=True)


def test_names_agree():
    from v4jax.cache import pools
    from v4jax.model import attention, offload
    assert offload.COUNTERS == pools.HOT_COUNTERS
    assert attention.HOT_FIELDS == pools.HOT_FIELDS


def test_host_memory_kinds_on_this_backend():
    dev = jax.devices()[0]
    x = jax.device_put(jnp.zeros((4, 8)), jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host"))
    assert x.sharding.memory_kind == "pinned_host"


def _hot(n, r, h, k, dtype=jnp.float32):
    from v4jax.cache.pools import HOT_COUNTERS
    return {"hot": jnp.zeros((n, h, k), dtype), "table": jnp.full((n, r), -1, jnp.int32),
            "owner": jnp.full((n, h), -1, jnp.int32), "used": jnp.full((n, h), -1, jnp.int32),
            "clock": jnp.zeros((n,), jnp.int32), "counts": jnp.zeros((n, 2, len(HOT_COUNTERS)), jnp.int32)}


@pytest.mark.parametrize("pull_rows", [None, 4])
def test_fetch_reads_the_host_values_whatever_is_resident(rng, monkeypatch, pull_rows):
    """Steps of writes and top-k-like selections (repeats, -1s, more distinct rows over time than the buffer holds)
    on two layers: every selected row read from the hot buffer equals the host pool's row (exactly), the table and
    owners agree, the host pool stays in host memory, and the counters add up. With transfers of 4 rows a step's
    12 picks move in up to three."""
    from v4jax.model import offload
    if pull_rows:
        monkeypatch.setattr(offload, "PULL_ROWS", pull_rows)
    n, r, h, k = 2, 512, 48, 8
    host = jax.device_put(jnp.zeros((n, r, k)), jax.sharding.SingleDeviceSharding(jax.devices()[0],
                                                                                  memory_kind="pinned_host"))
    hot = _hot(n, r, h, k)

    @jax.jit
    def step(hot, host, rows, values, sel):
        outs = []
        for li in range(n):
            hot, host = offload.write(hot, host, jnp.int32(li), rows[li], values[li])
            hot, out = offload.fetch(hot, host, jnp.int32(li), sel[li])
            outs.append(out)
        return hot, offload.to_host(host), jnp.stack(outs)

    ref = np.zeros((n, r, k), np.float32)
    selected = hits = 0
    for t in range(40):
        rows = rng.integers(-1, r, (n, 6)).astype(np.int32)
        rows[:, 1] = rows[:, 0]  # a repeated write: the last one wins on both sides? keep them equal instead
        values = rng.normal(size=(n, 6, k)).astype(np.float32)
        values[:, 1] = values[:, 0]
        for li in range(n):
            for j in range(6):
                if rows[li, j] >= 0:
                    ref[li, rows[li, j]] = values[li, j]
        # a working set that drifts: recent rows again (hits) and new ones (misses), 3 x 4 picks a layer
        base = (t * 7) % (r - 40)
        sel = (base + rng.integers(0, 40, (n, 3, 4))).astype(np.int32)
        sel[:, 0, 0] = -1
        hot, host, out = step(hot, host, rows, values, sel)
        assert host.sharding.memory_kind == "pinned_host"
        buf = np.asarray(hot["hot"]).reshape(-1, k)
        out = np.asarray(out)
        for li in range(n):
            ok = sel[li] >= 0
            assert (out[li][ok] >= li * h).all() and (out[li][ok] < (li + 1) * h).all()
            np.testing.assert_array_equal(buf[out[li][ok]], ref[li][sel[li][ok]])
            assert (out[li][~ok] == -1).all()
        selected += int((sel >= 0).sum())
        table, owner = np.asarray(hot["table"]), np.asarray(hot["owner"])
        for li in range(n):
            res = np.flatnonzero(table[li] >= 0)
            assert (owner[li][table[li][res]] == res).all()
            assert len(res) <= h
    np.testing.assert_array_equal(np.asarray(host), ref)
    c = offload.total_counts(hot["counts"])
    hits = c["hits"]
    assert c["selected"] == selected and c["overflow"] == 0
    assert 0 < hits < selected and c["fetched_rows"] <= selected - hits
    # every miss moved, in blocks: less than a transfer of padding per layer and step (40 steps, 2 layers)
    size = offload.transfer_sizes(12)[-1]
    assert c["fetched_rows"] <= c["transferred_rows"] < c["fetched_rows"] + size * 40 * n


def test_transfer_sizes():
    from v4jax.model.offload import PULL_ROWS, transfer_sizes
    assert transfer_sizes(10) == (0, 10)
    assert transfer_sizes(4 * PULL_ROWS) == (0, PULL_ROWS)
    assert transfer_sizes(64 * PULL_ROWS) == (0, 4 * PULL_ROWS)


@pytest.mark.parametrize("bad, word", [
    (dict(kv_layout="dense"), "kv_layout"),
    (dict(hisparse_device_pages=1, max_num_seqs=64), "hisparse_device_pages"),
])
def test_options_that_cannot_work_name_the_option(bad, word):
    from v4jax.cache.layout import pool_layout
    cfg = preset("tiny")
    opts = EngineOptions(**{"enable_hisparse": True, "max_num_seqs": 2, "prefill_chunk": 64, **bad})
    with pytest.raises(ValueError, match="enable_hisparse|hisparse_device_pages") as e:
        pool_layout(cfg, opts, jnp.float32, 600)
    assert word in str(e.value)


def test_mesh_refused_when_the_llm_is_built():
    """On a mesh (data=1 here: one device, the same code path as any) the offload is refused as the LLM is built,
    before the weights load, naming both options; the layout refuses it too (its other callers)."""
    from v4jax import LLM
    from v4jax.cache.layout import pool_layout
    message = (r"enable_hisparse keeps one device's C4 KV pool in host memory: mesh='data=1' is not supported with "
               r"it \(leave out mesh, or enable_hisparse\)")
    with pytest.raises(ValueError, match=message):
        LLM("tiny", dtype="float32", mesh="data=1", enable_hisparse=True, max_num_seqs=2, max_model_len=256)
    opts = EngineOptions(enable_hisparse=True, max_num_seqs=2)
    object.__setattr__(opts, "mesh", "data=1")  # past EngineOptions' own check: what another caller could pass
    with pytest.raises(ValueError, match=message):
        pool_layout(preset("tiny"), opts, jnp.float32, 256)


def test_no_csa_layers_and_stray_pages_fail():
    from v4jax.cache.layout import pool_layout
    cfg = dataclasses.replace(preset("tiny"), layer_types=("sliding", "hca", "hca", "hca"),
                              compress_ratios=(0, 128, 128, 128))
    with pytest.raises(ValueError, match="enable_hisparse: this model has no CSA"):
        pool_layout(cfg, EngineOptions(enable_hisparse=True), jnp.float32, 600)
    with pytest.raises(ValueError, match="hisparse_device_pages"):
        pool_layout(preset("tiny"), EngineOptions(hisparse_device_pages=4), jnp.float32, 600)


def test_bytes_live_where_the_pools_are():
    """The C4 KV's rows count as host bytes, its hot buffer and table as device bytes; the memory report's
    per-device figure leaves the host rows out, and a device budget then holds more pages than without offload."""
    from v4jax.cache.layout import pool_layout, pool_sizes
    from v4jax.memory import engine_pools
    cfg = preset("tiny")
    base = dict(max_num_seqs=2, prefill_chunk=64)
    on = EngineOptions(enable_hisparse=True, hisparse_device_pages=8, **base)
    lay = pool_layout(cfg, on, jnp.float32, 4096)
    assert lay.hot_rows == 8 * lay.page_size // 4
    c4 = pool_sizes(cfg, lay, jnp.float32, True)["c4_kv"]
    n_csa, k = cfg.layer_types.count("csa"), cfg.head_dim
    assert c4.host_bytes == n_csa * lay.n_pages * lay.page_size // 4 * k * 4
    hot = n_csa * lay.hot_rows * k * 4
    table = n_csa * lay.n_pages * lay.page_size // 4 * 4
    assert c4.device_bytes == c4.bytes - c4.host_bytes >= hot + table
    rep = engine_pools(cfg, on, 4096, "float32")
    assert rep.per_device == sum(s.bytes for s in rep.sizes.values()) - c4.host_bytes
    off = EngineOptions(**base)
    budget = sum(s.bytes for s in pool_sizes(cfg, pool_layout(cfg, off, jnp.float32, 4096), jnp.float32,
                                             True).values())
    more = pool_layout(cfg, dataclasses.replace(on, memory_budget_bytes=budget), jnp.float32, 4096)
    assert more.n_pages > pool_layout(cfg, dataclasses.replace(off, memory_budget_bytes=budget), jnp.float32,
                                      4096).n_pages


def test_host_pool_too_large_for_host_memory_names_the_bytes(monkeypatch):
    """The host rows against the host's available memory (made small here, nothing allocated): building the engine
    fails before any pool exists, naming the bytes needed and available and a memory_budget_bytes that fits; that
    budget's host rows do fit, and the plain engine (nothing on the host) is not checked."""
    from v4jax import LLM, memory
    from v4jax.memory import HostMemoryError, check_engine_fits, check_host_pools_fit, engine_pools
    cfg = preset("tiny")
    opts = EngineOptions(enable_hisparse=True, max_num_seqs=4, prefill_chunk=64)
    pools = engine_pools(cfg, opts, 4096, "float32")
    host = sum(s.host_bytes for s in pools.sizes.values())
    avail = host // 3
    monkeypatch.setattr(memory, "_host_available_bytes", lambda: avail)
    monkeypatch.setenv(memory.MEMORY_ENV, str(1 << 40))  # the device's figure (on CPU also the host's RAM) apart
    with pytest.raises(HostMemoryError) as e:
        check_engine_fits(cfg, opts, 4096, "float32")
    msg = str(e.value)
    assert f"need {host} bytes" in msg and f"but {avail} bytes" in msg and "enable_hisparse" in msg
    budget = int(msg.split("memory_budget_bytes=")[1].split()[0])
    fits = engine_pools(cfg, dataclasses.replace(opts, memory_budget_bytes=budget), 4096, "float32")
    assert 0 < sum(s.host_bytes for s in fits.sizes.values()) <= 0.9 * avail
    assert fits.layout.n_pages >= pools.layout.n_pages // 4  # the largest that fits, not just any
    check_host_pools_fit(cfg, dataclasses.replace(opts, memory_budget_bytes=budget), fits, "float32")
    check_host_pools_fit(cfg, EngineOptions(max_num_seqs=4, prefill_chunk=64),
                         engine_pools(cfg, EngineOptions(max_num_seqs=4, prefill_chunk=64), 4096, "float32"))
    # through the LLM: the check runs when the engine is built, before its pools are made
    llm = LLM("tiny", dtype="float32", enable_hisparse=True, max_num_seqs=4, prefill_chunk=64, max_model_len=4096)
    with pytest.raises(HostMemoryError, match=f"need {host} bytes"):
        llm.engine
    monkeypatch.setattr(memory, "_host_available_bytes", lambda: 10)
    with pytest.raises(HostMemoryError, match="a machine with more host memory"):
        check_engine_fits(cfg, opts, 4096, "float32")


# ---- the engine (compiles engines: minutes on CPU) ----
ENGINE = dict(dtype="float32", max_num_seqs=4, max_model_len=1200, prefill_chunk=64)


def _same(got, want):
    for g, w in zip(got, want, strict=True):
        assert g.token_ids == w.token_ids
        np.testing.assert_allclose(g.logprobs, w.logprobs, atol=1e-5, rtol=0)


@pytest.mark.slow  # two engines to compile (~6 min on one CPU core)
def test_offload_gives_the_plain_run(real_ckpt, monkeypatch):
    """cfg_real_ratios (CSA with a binding top-16): four prompts of 1..1000 tokens decode together, then one sharing
    512 tokens with the longest (a prefix hit), then the batch again on an engine of too few pages (preemption):
    with a hot buffer of 8 pages' entries (the pool holds 20) every greedy token and log-prob equals the plain
    run's, the buffer hits and misses, and every page comes back. The offloaded engine reads whole C4 KV in
    transfers of 16 columns and selects in blocks of query tokens (scores capped at 64 KiB)."""
    from v4jax import LLM, SamplingParams
    from v4jax.model import attention, offload
    ref = LLM(real_ckpt, **ENGINE)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(2, ref.config.vocab_size, n).tolist() for n in (1, 300, 700, 1000)]
    variant = prompts[3][:512] + rng.integers(2, ref.config.vocab_size, 40).tolist()
    params = SamplingParams(max_tokens=100, **GREEDY)
    want, want_v = ref.generate(prompts, params), ref.generate([variant], params)
    monkeypatch.setattr(offload, "WHOLE_READ_COLUMNS", 16)  # read at the offloaded engine's first trace
    monkeypatch.setattr(attention, "SELECT_SCORES_BYTES", 1 << 16)
    llm = LLM(real_ckpt, enable_hisparse=True, **ENGINE)
    assert llm.engine.layout.hot_rows < llm.engine.layout.n_pages * llm.engine.layout.page_size // 4
    _same(llm.generate(prompts, params), want)
    _same(llm.generate([variant], params), want_v)
    st = llm.stats()
    c4 = st["pools"]["c4_kv"]
    assert st["prefix_cache"]["hit_tokens"] >= 512
    assert 0 < c4["hit_rate"] < 1 and c4["overflow"] == 0 and c4["fetched_rows"] > 0
    assert c4["host_bytes_total"] > 0 and c4["device_bytes_total"] > 0


@pytest.mark.slow  # one engine to compile
def test_offload_preempted_and_many_long_requests(real_ckpt):
    """Eight long requests at once on an engine whose host pool holds fewer pages than they need together: they
    all finish (waiting for pages, no stall), with the plain run's tokens, and every page comes back."""
    from v4jax import LLM, SamplingParams
    from v4jax.cache.layout import pool_layout, pool_sizes
    from v4jax.config import ModelConfig
    cfg = ModelConfig.from_hf(real_ckpt)
    engine = dict(ENGINE, enable_prefix_caching=False)  # so that every page comes back at the end
    opts = EngineOptions(enable_hisparse=True, **{k: v for k, v in engine.items() if k != "dtype"})
    lay = dataclasses.replace(pool_layout(cfg, opts, jnp.float32, 1200), n_pages=8)
    budget = sum(s.bytes - s.host_bytes for s in pool_sizes(cfg, lay, jnp.float32, False).values())
    rng = np.random.default_rng(1)
    # the first four are admitted with their prompt and a decode call's tokens (2 pages each: all 8) and cross a
    # page boundary while decoding, so running requests need pages that others hold
    prompts = [rng.integers(2, cfg.vocab_size, n).tolist() for n in (480, 470, 490, 500, 1000, 700, 460, 990)]
    params = SamplingParams(max_tokens=60, **GREEDY)
    want = LLM(real_ckpt, **engine).generate(prompts, params)
    small = LLM(real_ckpt, enable_hisparse=True, memory_budget_bytes=budget, **engine)
    assert small.engine.layout.n_pages == 8
    _same(small.generate(prompts, params), want)
    st = small.stats()
    # (no preemption here: the admission reserve keeps these from needing it; test_offload_with_preemption_and_
    # prefix_hits makes one happen)
    assert st["requests"]["finished"] == 8 and st["requests"]["running"] == st["requests"]["waiting"] == 0
    assert all(p["used"] == 0 for p in st["pools"].values()), st["pools"]
    assert st["pools"]["c4_kv"]["overflow"] == 0


@pytest.mark.slow  # two engines to compile (~4 min on this machine)
def test_offload_with_preemption_and_prefix_hits():
    """The tiny preset (CSA top-4, so a step selects 4 of up to 512 entries per query) on a pool of 24 full pages:
    three requests of 2,040 tokens are admitted together (8 pages each: the pool), each needs a ninth page at its
    first decode call, so the newest is preempted; a fourth shares the first 1,024 tokens of the first (a prefix
    hit), and the preempted one comes back. With the C4 KV on the host and a hot buffer of one page's entries (64 of
    the pool's 1,536 per layer) every greedy token and log-prob equals the all-device run's with the same pages
    (the same schedule), the engine counts the preemption and the hits, the page counts hold, and every page is free
    once the prefix cache is emptied."""
    from v4jax import LLM, SamplingParams
    from v4jax.cache.layout import pool_layout, pool_sizes
    cfg = preset("tiny")
    engine = dict(dtype="float32", max_num_seqs=4, max_model_len=2304, prefill_chunk=1024)

    def budget(**offload):  # device bytes of a 24-page pool
        opts = EngineOptions(**offload, **{k: v for k, v in engine.items() if k != "dtype"})
        lay = dataclasses.replace(pool_layout(cfg, opts, jnp.float32, engine["max_model_len"]), n_pages=24)
        return sum(s.bytes - s.host_bytes for s in pool_sizes(cfg, lay, jnp.float32, True).values())

    rng = np.random.default_rng(3)
    ids = lambda n: rng.integers(2, cfg.vocab_size, n).tolist()  # noqa: E731
    first = ids(2040)
    prompts = [first, ids(2040), ids(2040), first[:1024] + ids(1016)]
    params = SamplingParams(max_tokens=48, **GREEDY)
    plain = LLM("tiny", memory_budget_bytes=budget(), **engine)
    want = plain.generate(prompts, params)
    offload = dict(enable_hisparse=True, hisparse_device_pages=1)
    llm = LLM("tiny", memory_budget_bytes=budget(**offload), **offload, **engine)
    lay = llm.engine.layout
    assert lay.n_pages == plain.engine.layout.n_pages == 24 and lay.hot_rows == 64
    _same(llm.generate(prompts, params), want)
    st = llm.stats()
    assert st["requests"]["preempted"] >= 1 and st["requests"]["finished"] == 4
    assert st["prefix_cache"]["hit_tokens"] >= 1024
    c4 = st["pools"]["c4_kv"]
    assert 0 < c4["hit_rate"] < 1 and c4["overflow"] == 0 and c4["fetched_rows"] > 0
    kv = llm.engine.kv
    kv.check()
    kv.reset_prefix_cache()
    assert kv.all_free() and all(p["used"] == 0 for p in llm.stats()["pools"].values())


def test_bench_requests_that_fit():
    """v4jax bench hisparse's capacity figure: the largest request count whose pools fit 90 % of the device's free
    memory (one more does not), more of them with offload, and with offload no more than the host's memory holds."""
    from v4jax.bench.hisparse import fit_requests
    from v4jax.memory import engine_pools
    cfg = preset("tiny")
    off = EngineOptions(max_num_seqs=1, prefill_chunk=64)
    on = dataclasses.replace(off, enable_hisparse=True, hisparse_device_pages=1)
    device = lambda opts, n: engine_pools(cfg, dataclasses.replace(opts, max_num_seqs=n), 4096, "float32")  # noqa
    free = 40 * device(off, 1).per_device
    n_off = fit_requests(cfg, off, 4096, "float32", free, None)
    assert device(off, n_off).per_device <= 0.9 * free < device(off, n_off + 1).per_device
    n_on = fit_requests(cfg, on, 4096, "float32", free, 1 << 40)
    assert n_on > n_off
    host = lambda n: sum(s.host_bytes for s in device(dataclasses.replace(on, hisparse_device_pages=None),  # noqa
                                                      n).sizes.values())
    small = 3 * host(1)
    n_host = fit_requests(cfg, on, 4096, "float32", free, small)
    assert 1 <= n_host < n_on and host(n_host) <= 0.9 * small < host(n_host + 1)
    assert fit_requests(cfg, off, 4096, "float32", None, None) is None


@pytest.mark.slow  # ~1 min: two 4K prompts prefilled twice on the CPU
def test_bench_times_requests_decoding_together():
    """v4jax bench hisparse: --context is a request's whole length (the tiny model's 4,096 positions hold one), and
    the timed window has every request decoding: tokens/s x ms/step is about the request count (tokens arrive a
    decode call's 8 at a time, so the window's ends cut one request's call short)."""
    from v4jax.bench.hisparse import run
    lines = []
    row = run("tiny", "float32", 4096, 2, 48, True, 8, None, 256, profile=True, emit=lines.append)
    # the measured row emitted before the profiles (a long context's profile may outlast a time limit), then them
    assert [sorted(line) for line in lines] == [sorted(set(row) - {"profile", "profile_prefill", "profile_prefill_ms"}),
                                                ["context", "model", "offload", "profile", "profile_prefill",
                                                 "profile_prefill_ms"]]
    assert row["profile_prefill_ms"]["wall"] > 0
    assert row["context"] == 4096 and row["offload"] and 0 < row["hit_rate"] <= 1 and row["prefill_s"] > 0
    assert row["profile"][0][0].startswith("(no profile")  # a CPU's trace has no device kernels
    assert row["profile_prefill"][0][0].startswith("(no profile")
    assert row["prefill_transferred_bytes"] >= row["prefill_fetched_bytes"] > 0 and 0 <= row["prefill_hit_rate"] < 1
    # the covering programs, compiled first, ran every step: nothing compiled after them
    assert row["programs_warmup"] >= 3 and row["programs_compiled_after"] == 0, row
    assert 1.5 < row["tokens_per_s"] * row["ms_per_step"] / 1e3 <= 2.0 + 1e-6


def test_flags():
    import argparse

    from v4jax.serve.options import add_llm_arguments, llm_kwargs
    p = argparse.ArgumentParser()
    add_llm_arguments(p)
    kw = llm_kwargs(p.parse_args(["--enable-hisparse", "--hisparse-device-pages", "12"]))
    assert kw["enable_hisparse"] is True and kw["hisparse_device_pages"] == 12
    assert EngineOptions(**{k: v for k, v in kw.items() if k != "dtype"}).enable_hisparse


def test_metrics_export_where_the_bytes_are():
    from v4jax.serve.metrics import ServerMetrics
    c4 = {"used": 1, "total": 6, "unit": "256 tokens", "bytes_used": 10, "bytes_total": 100,
          "device_bytes_total": 40, "host_bytes_total": 60, "device_rows": 64, "selected": 50, "hits": 30,
          "fetched_rows": 12, "transferred_rows": 16, "overflow": 0, "hit_rate": 0.6, "fetched_bytes": 1200,
          "transferred_bytes": 1600}
    stats = {"pools": {"c4_kv": c4, "swa": {"used": 0, "total": 4, "unit": "64 tokens", "bytes_used": 0,
                                            "bytes_total": 8}}}
    text = ServerMetrics(lambda: stats).render().decode()
    got = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
           if line and not line.startswith("#")}
    assert got['v4jax_pool_device_bytes_total{pool="c4_kv"}'] == 40
    assert got['v4jax_pool_host_bytes_total{pool="c4_kv"}'] == 60
    assert 'v4jax_pool_host_bytes_total{pool="swa"}' not in got
    assert got["v4jax_hisparse_hit_entries_total"] == 30 and got["v4jax_hisparse_selected_entries_total"] == 50
    assert got["v4jax_hisparse_fetched_bytes_total"] == 1200


@pytest.mark.parametrize("s, used, cols, moved", [(12, 7, 3, 9), (12, 12, 5, 15), (12, 0, 4, 0), (12, 12, 64, 12)])
def test_whole_read_moves_the_columns_in_use(rng, monkeypatch, s, used, cols, moved):
    """A whole read moves the columns up to the last row in use, WHOLE_READ_COLUMNS a transfer (the last one ending
    at S when it would pass it), and gives every row in use its host values."""
    from v4jax.model import offload
    monkeypatch.setattr(offload, "WHOLE_READ_COLUMNS", cols)
    n, r, k, b = 2, 64, 4, 2
    pool = rng.standard_normal((n, r, k)).astype(np.float32)
    rows = np.full((b, s), -1, np.int32)
    rows[0, :used] = rng.choice(r, used, replace=False)
    rows[1, :used // 2] = rng.choice(r, used // 2, replace=False)
    rows[1, 1] = -1  # a none among rows in use
    host = jax.device_put(pool, jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host"))
    read = jax.jit(lambda *a: offload.read_whole(*a))  # a new trace: jit's cache does not see the patched constant
    hot, got = read(_hot(n, r, 8, k, jnp.float32), host, jnp.int32(1), jnp.asarray(rows), jnp.int32(3))
    got = np.asarray(got).reshape(b, s, k)
    np.testing.assert_array_equal(got[rows >= 0], pool[1, rows[rows >= 0]])
    c = offload.total_counts(hot["counts"])
    assert (c["fetched_rows"], c["transferred_rows"], c["selected"], c["hits"]) == (np.sum(rows >= 0), b * moved, 3, 0)


@pytest.mark.parametrize("t, s, hot_rows, whole, fp8, cols", [
    (1, 12, 64, 0, False, None), (8, 48, 12, 0, False, None), (8, 48, 64, 0, False, None),
    (8, 12, 12, 2, False, None), (16, 60, 12, 1, False, None), (16, 60, 12, 1, False, 16),
    (1, 12, 64, 0, True, None), (8, 48, 12, 0, True, None), (8, 12, 12, 2, True, 5)])
def test_attention_core_offloaded_equals_on_device(rng, monkeypatch, t, s, hot_rows, whole, fp8, cols):
    """One CSA layer's writes and attention (attention_core, layer 1 of a 2-layer stack) with its C4 KV on the host
    and a hot buffer (cold, then warm from a first call) equal the same on the device: the same output and pools,
    on float pools and on the release's byte entries (kv_cache_dtype="fp8"). 8 query tokens over 48 entries a row
    fetch in blocks of tokens (with a buffer of 12 rows: blocks of one token, 2 rows x 5 picks); over 12 entries a
    row they read both rows' whole C4 KV at once, over 60 (16 tokens) one row's at a time; either way the last
    token's selections become resident; whole reads in one transfer or several (`cols` columns each)."""
    from test_context import _layer_inputs

    from pallas_kernels import kv_format
    from sharding import context
    from v4jax.model import attention_core, offload
    from v4jax.model.ops import ops_for
    if cols:  # a whole read in transfers of `cols` columns
        monkeypatch.setattr(offload, "WHOLE_READ_COLUMNS", cols)
    q, sink, pools, writes, reads = _layer_inputs(rng, "csa", t=t, kd=16, ki=32, s=s, r=128, r_swa=64)
    b, topk = q.shape[0], 5
    assert offload.whole_read_rows(b, s, t, topk, hot_rows) == whole
    static = dict(ops=ops_for("xla"), scale=0.25, window=4, topk=topk)
    if fp8:  # byte pools, written encoded and decoded where read
        formats = {"swa": kv_format.Fp8Entry(16, 4), "kv": kv_format.Fp8Entry(16, 4), "idx": kv_format.Fp4Key(32)}
        pools = {name: jax.jit(formats[name].encode)(a) for name, a in pools.items()}
        static["formats"] = formats
    li = jnp.int32(1)
    blocks = {name: context.RowBlock((), a.shape[1]) for name, a in pools.items()}
    want, want_pools = jax.jit(lambda p: attention_core(blocks, q, sink, p, writes, reads, li, **static))(pools)
    n, r, k = pools["kv"].shape
    host = jax.device_put(pools["kv"], jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host"))
    hot = _hot(n, r, hot_rows, k, pools["kv"].dtype)
    run = jax.jit(lambda p, hot: attention_core(blocks, q, sink, p, writes, reads, li, hot=hot, **static))
    for _ in range(2):  # cold, then with the first call's rows resident (and its writes applied again)
        got, got_pools = run(dict(pools, kv=host), hot)
        hot = got_pools.pop("hot")
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
        for name, a in got_pools.items():
            np.testing.assert_array_equal(np.asarray(a), np.asarray(want_pools[name]))
        assert got_pools["kv"].sharding.memory_kind == "pinned_host"
    counts = offload.total_counts(hot["counts"])
    assert counts["overflow"] == 0
    if whole:  # every row of both batch rows moved in each call; the last token's selections made resident
        resident = np.asarray(hot["owner"])[1]
        rows = np.asarray(reads["rows"])
        idx = want_pools["idx"].reshape(-1, want_pools["idx"].shape[-1])
        _, at = static["ops"].select(reads["iq"], reads["w"], idx, jnp.where(rows >= 0, rows + r, -1),
                                     reads["n_ready"], topk, static.get("formats", {}).get("idx"))
        at = np.asarray(at)[:, -1]  # [B, k] the last token's picks
        last = np.where(at >= 0, np.take_along_axis(rows, np.maximum(at, 0), axis=1), -1)
        assert set(resident[resident >= 0].tolist()) == set(last[last >= 0].tolist())
        assert counts["fetched_rows"] >= 2 * int(np.sum(np.asarray(reads["rows"]) >= 0))
    else:
        assert counts["hits"] > 0


@pytest.mark.slow  # one speculative engine to compile (minutes on CPU)
def test_offload_with_speculative_decoding():
    """MTP speculation (k = 3) with the C4 KV on the host and a hot buffer of one page's entries (8 of the pool's 64
    per layer): drafts forced right and partly wrong, so that every acceptance length runs, give the plain greedy
    tokens of the teacher-forced forward with log-probs within 1e-5, on prefix hits too and resuming at a page
    boundary crossed while speculating (test_spec_decode's check); the verify steps of 4 query tokens fetch in
    blocks that fit the buffer."""
    from test_spec_decode import OPTIONS, _check_forced

    from v4jax import LLM
    llm = LLM("tiny", speculative_config={"method": "mtp", "num_speculative_tokens": 3}, enable_hisparse=True,
              hisparse_device_pages=1, **OPTIONS)
    lay = llm.engine.layout
    assert lay.hot_rows == 8 and lay.n_pages * lay.page_size // 4 == 64
    _check_forced(llm)
    c4 = llm.stats()["pools"]["c4_kv"]
    assert 0 < c4["hit_rate"] < 1 and c4["overflow"] == 0 and c4["fetched_rows"] > 0


@pytest.mark.parametrize("n_rows", [5, 64, 96])
def test_host_writes_land_on_their_rows(rng, n_rows):
    """offload's host write: blocks of consecutive rows, single rows and -1 (none) land as a numpy scatter does."""
    from v4jax.model import offload
    n, r, k = 2, 256, 8
    pool = rng.standard_normal((n, r, k)).astype(np.float32)
    rows = np.concatenate([np.arange(64, 64 + n_rows // 2), rng.choice(np.r_[128:200, 232:r], n_rows - n_rows // 2,
                                                                          replace=False)]).astype(np.int32)
    rows[rng.random(n_rows) < 0.1] = -1
    if n_rows >= 64:
        rows[32:64] = np.arange(200, 232)  # a second whole block, apart from the first
    values = rng.standard_normal((n_rows, k)).astype(np.float32)
    host = jax.device_put(pool, jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host"))
    got = jax.jit(offload._write_rows)(host, jnp.int32(1), jnp.asarray(rows), jnp.asarray(values))
    want = pool.copy()
    keep = rows >= 0
    want[1, rows[keep]] = values[keep]
    np.testing.assert_array_equal(np.asarray(got), want)


def test_host_writes_in_blocks_of_every_size(rng):
    """A prefill chunk's rows: a run of consecutive pages (one block of 256 rows, written as one update), pages of 64
    rows apart, a half page, rows alone and -1s, each landing as a numpy scatter does; `largest` caps the blocks
    without changing what lands."""
    from v4jax.model import offload
    n, r, k = 2, 2048, 4
    pool = rng.standard_normal((n, r, k)).astype(np.float32)
    pages = rng.choice(np.arange(8, 30), 3, replace=False) * 64
    rows = np.concatenate([np.arange(256, 512), *(np.arange(p, p + 64) for p in pages), np.arange(1984, 2016),
                           rng.choice(np.r_[0:256, 1920:1984], 32, replace=False)]).astype(np.int32)
    rows[rng.random(rows.size) < 0.02] = -1
    values = rng.standard_normal((rows.size, k)).astype(np.float32)
    want = pool.copy()
    want[0, rows[rows >= 0]] = values[rows >= 0]
    for largest in (None, 64, 32):
        host = jax.device_put(pool, jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host"))
        got = jax.jit(offload._write_rows, static_argnums=4)(host, jnp.int32(0), jnp.asarray(rows),
                                                             jnp.asarray(values), largest)
        np.testing.assert_array_equal(np.asarray(got), want)
    # the updates' block sizes: the whole chunk down to 32 rows, or only 32 under `largest`
    for largest, sizes in ((None, {1, 32, 64, 128, 256, 512}), (32, {1, 32})):
        txt = jax.jit(offload._write_rows, static_argnums=4).lower(host, jnp.int32(0), jnp.asarray(rows),
                                                                   jnp.asarray(values), largest).as_text()
        assert {int(b) for b in re.findall(r"dynamic_update_slice[^\n]*tensor<1x(\d+)x4", txt)} == sizes


def test_host_writes_of_a_prefill_chunk_in_runs(rng):
    """A prefill chunk's writes as the model makes them: each of 2 batch rows has T / m + 2 windows (here 66: 64
    complete entries on consecutive rows, 2 incomplete as -1), a run no block size divides. They land as a numpy
    scatter does and in blocks (a 64-row update each, the runs padded), not one row an iteration."""
    from v4jax.model import offload
    n, r, k, e = 2, 512, 4, 66
    pool = rng.standard_normal((n, r, k)).astype(np.float32)
    rows = np.full((2, e), -1, np.int32)
    rows[0, :64], rows[1, :64] = np.arange(128, 192), np.arange(320, 384)
    rows, values = rows.reshape(-1), rng.standard_normal((2 * e, k)).astype(np.float32)
    want = pool.copy()
    want[1, rows[rows >= 0]] = values[rows >= 0]
    write = jax.jit(offload._write_rows, static_argnums=4)
    host = jax.device_put(pool, jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host"))
    np.testing.assert_array_equal(np.asarray(write(host, jnp.int32(1), jnp.asarray(rows), jnp.asarray(values), e)),
                                  want)
    host = jax.device_put(pool, jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host"))
    got = jax.jit(lambda h: offload._write_rows(h, jnp.int32(1), jnp.asarray(rows), jnp.asarray(values), e))(host)
    np.testing.assert_array_equal(np.asarray(got), want)  # the rows a compile-time constant
    txt = write.lower(host, jnp.int32(1), jnp.asarray(rows), jnp.asarray(values), e).as_text()
    assert {int(b) for b in re.findall(r"dynamic_update_slice[^\n]*tensor<1x(\d+)x4", txt)} == {1, 32, 64}


@pytest.mark.parametrize("n_valid", [0, 1, 9, 20])
def test_host_single_row_writes(rng, n_valid):
    """A decode step's single rows, any count of them valid (none, one, several), land as a numpy scatter does, with
    the rows a compile-time constant too (XLA once dropped the writes of an unrolled form there)."""
    from v4jax.model import offload
    n, r, k, m = 2, 128, 4, 24
    pool = rng.standard_normal((n, r, k)).astype(np.float32)
    rows = np.full(m, -1, np.int32)
    rows[rng.choice(m, n_valid, replace=False)] = rng.choice(r, n_valid, replace=False)
    values = rng.standard_normal((m, k)).astype(np.float32)
    want = pool.copy()
    want[0, rows[rows >= 0]] = values[rows >= 0]
    host = jax.device_put(pool, jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host"))
    got = jax.jit(offload._write_rows, static_argnums=4)(host, jnp.int32(0), jnp.asarray(rows), jnp.asarray(values), 2)
    np.testing.assert_array_equal(np.asarray(got), want)
    host = jax.device_put(pool, jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host"))
    got = jax.jit(lambda h: offload._write_rows(h, jnp.int32(0), jnp.asarray(rows), jnp.asarray(values), 2))(host)
    np.testing.assert_array_equal(np.asarray(got), want)


def test_offload_steps_compile_once_per_program():
    """With host offload every argument's placement is part of a step's signature: the pools and the decode state
    are committed to the device from their creation, as the steps return them, so a second request of the same
    shapes runs the programs the first compiled (an uncommitted first argument compiled each again at its second
    call: seconds of a stall on the GPU)."""
    from v4jax import LLM, SamplingParams
    llm = LLM("tiny", dtype="float32", enable_hisparse=True, max_num_seqs=2, prefill_chunk=256, max_model_len=1024)
    rng = np.random.default_rng(3)
    sp = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    llm.generate([rng.integers(2, llm.config.vocab_size, 200).tolist()], sp)
    steps = llm.engine.steps
    sizes = steps.prefill._cache_size(), steps.decode._cache_size()
    llm.generate([rng.integers(2, llm.config.vocab_size, 200).tolist()], sp)
    assert (steps.prefill._cache_size(), steps.decode._cache_size()) == sizes
