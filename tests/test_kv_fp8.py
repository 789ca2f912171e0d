"""kv_cache_dtype="fp8": the release's FP8 KV entries and FP4 indexer keys stored as bytes.

The byte layouts against hand-built bytes (ml_dtypes' e4m3 and bf16 encodings, nibbles and exponents); encoding then
decoding equals quant_sim's round trips bit for bit; the Pallas kernels (TPU interpret mode) read the byte pools as
the reference reads the decoded values; the pools' bytes per token are the formats' (584 B / 68 B for Flash) in the
layout, the memory report and stats(); a bad option value is an error naming it. The engine over hundreds of tokens
(every compression boundary, a prefix hit, preemption, the dense layout) gives quant_sim's tokens and log-probs
(a slow test: it compiles two engines).
"""
import functools
import importlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pallas_kernels import kv_format as F
from v4jax.config import ModelConfig, preset
from v4jax.model import quant

sa = importlib.import_module("pallas_kernels.sparse_attention")
ix = importlib.import_module("pallas_kernels.indexer")


def _values(rng, shape, spread=3.0):
    """Normal values whose rows' magnitudes span many powers of two (scales from tiny to large)."""
    x = rng.standard_normal(shape) * np.exp(rng.standard_normal(shape[:-1] + (1,)) * spread)
    return jnp.asarray(x, jnp.float32)


def _jit(fmt):
    """fmt's (encode, decode), jitted: eagerly each of their many small ops compiles apart."""
    return jax.jit(fmt.encode), jax.jit(fmt.decode)


def test_flash_sizes():
    cfg = preset("flash")
    assert (cfg.fp8_entry_bytes, cfg.fp4_key_bytes) == (584, 68)
    assert (F.Fp8Entry(512, 64).nbytes, F.Fp4Key(128).nbytes) == (584, 68)


def test_fp8_entry_bytes_by_hand(rng):
    fmt = F.Fp8Entry(512, 64)
    x = np.asarray(_values(rng, (3, 512)))
    b = np.asarray(_jit(fmt)[0](jnp.asarray(x)))
    assert b.shape == (3, 584) and b.dtype == np.uint8
    for r in range(3):
        for blk in range(7):
            v = x[r, blk * 64:(blk + 1) * 64]
            e = int(np.ceil(np.log2(max(np.abs(v).max(), 1e-4) / 448)))
            assert b[r, 576 + blk] == e + 127  # ue8m0 scale byte
            want = (v / 2.0 ** e).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
            np.testing.assert_array_equal(b[r, blk * 64:(blk + 1) * 64], want)
        rope = x[r, 448:].astype(ml_dtypes.bfloat16).view(np.uint16)
        np.testing.assert_array_equal(b[r, 448:576:2], rope & 0xFF)  # little-endian bf16
        np.testing.assert_array_equal(b[r, 449:576:2], rope >> 8)
        assert b[r, 583] == 0  # the pad byte


def test_fp4_key_bytes_by_hand():
    fmt = F.Fp4Key(64)
    x = np.zeros((1, 64), np.float32)
    x[0, :4] = [6.0, -0.5, 1.25, 1.75]  # block 0: amax 6 -> scale 1; 1.25 ties to 1 (even), 1.75 to 2
    x[0, 32:34] = [0.75, -3.0]  # block 1: amax 3 -> scale 0.5: 1.5 (code 3) and -6 (code 15)
    enc, dec = _jit(fmt)
    b = np.asarray(enc(jnp.asarray(x)))[0]
    assert b.shape == (36,)  # 32 + 2 scales + 2 pad
    assert b[0] == 0x7 | (0x9 << 4) and b[1] == 0x2 | (0x4 << 4)  # the even dim in the low nibble
    assert b[16] == 0x3 | (0xF << 4) and b[17] == 0
    assert (b[32], b[33]) == (127, 126)  # ue8m0 scales 2^0, 2^-1
    np.testing.assert_array_equal(np.asarray(dec(jnp.asarray(b)))[[0, 1, 2, 3, 32, 33]],
                                  [6.0, -0.5, 1.0, 2.0, 0.75, -3.0])


@pytest.mark.parametrize("dim,rope", [(512, 64), (64, 16)])  # Flash; tiny (a ragged last scale block)
def test_fp8_entry_decodes_to_quant_sim(rng, dim, rope):
    x = _values(rng, (6, 9, dim))
    want = jax.jit(lambda x: jnp.concatenate([quant.fp8_roundtrip(x[..., :dim - rope], 64),
                                              x[..., dim - rope:].astype(jnp.bfloat16).astype(jnp.float32)], -1))(x)
    enc, dec = _jit(F.Fp8Entry(dim, rope))
    got = dec(enc(x))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    # storing quant_sim's values loses nothing (their bytes may differ: a block whose amax rounds down to 224 s
    # takes the scale s / 2, with the same values)
    np.testing.assert_array_equal(np.asarray(dec(enc(want))), np.asarray(want))


@pytest.mark.parametrize("dim", [128, 32])
def test_fp4_key_decodes_to_quant_sim(rng, dim):
    x = quant.hadamard_rotate(_values(rng, (6, 9, dim)))
    enc, dec = _jit(F.Fp4Key(dim))
    np.testing.assert_array_equal(np.asarray(dec(enc(x))), np.asarray(jax.jit(quant.fp4_roundtrip)(x)))


def test_fp4_rounding_ties_to_even_exactly():
    # the values one f32 ulp either side of each midpoint round to the nearer neighbour; the midpoints to the even
    mids = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], np.float32)
    lo, hi = np.nextafter(mids, 0), np.nextafter(mids, 7)
    grid = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float32)
    r = lambda v: np.asarray(quant._round_e2m1(jnp.asarray(v)))
    np.testing.assert_array_equal(r(lo), grid[:-1])
    np.testing.assert_array_equal(r(hi), grid[1:])
    np.testing.assert_array_equal(r(mids), [0, 1, 1, 2, 2, 4, 4])
    np.testing.assert_array_equal(r(-mids), -np.array([0, 1, 1, 2, 2, 4, 4], np.float32))


def test_indexer_against_fp4_keys_rounds_as_the_release():
    """Without quant_sim, FP4 keys (kv_cache_dtype="fp8") still get the release's indexer numerics: keys
    Hadamard-rotated before the pool encodes them (their stored values are quant_sim's keys), queries rotated and
    rounded to FP4."""
    from flax import nnx

    from v4jax.config import CSA
    from v4jax.model import RunOptions
    from v4jax.model import layers as L
    from v4jax.model.attention import Indexer
    cfg = preset("tiny")
    ix_ = Indexer(cfg, 4, rngs=nnx.Rngs(0), dtype=jnp.float32)
    cos, sin = L.rope_cos_sin(tuple(L.rope_inv_freq(cfg, CSA)), jnp.arange(5)[None])
    qr = jnp.asarray(np.random.default_rng(1).standard_normal((1, 5, cfg.q_lora_rank)), jnp.float32)
    plain, sim = RunOptions(), RunOptions(quant_sim=True)
    got, want = jax.jit(lambda qr: (ix_.queries(qr, cos, sin, plain, fp4_keys=True),
                                    quant.fp4_roundtrip(quant.hadamard_rotate(ix_.queries(qr, cos, sin, plain)))))(qr)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    k = _values(np.random.default_rng(2), (7, cfg.index_head_dim))
    fmt = F.Fp4Key(cfg.index_head_dim)
    got, want = jax.jit(lambda k: (fmt.decode(fmt.encode(ix_.round_keys(k, plain, fp4_keys=True))),
                                   ix_.round_keys(k, sim)))(k)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


# ---- kernels: byte pools read as the reference reads the decoded values -----------------------------------------


@pytest.mark.usefixtures("single_device")
def test_sparse_attention_reads_fp8_entries(rng):
    B, T, H, D, rope, W, K = 1, 2, 8, 128, 32, 8, 40  # a window chunk and a compressed chunk per query
    fmt = F.Fp8Entry(D, rope)
    q = jnp.asarray(rng.standard_normal((B, T, H, D)), jnp.float32)
    enc, dec = _jit(fmt)
    swa, cmp = enc(_values(rng, (64, D), 1.0)), enc(_values(rng, (300, D), 1.0))
    rw = rng.integers(0, 64, (B, T, W))
    rw[0, 0, :3] = -1  # some empty window slots
    rc = rng.integers(0, 300, (B, T, K))
    rc[-1, -1, :32] = np.arange(32, 64)  # a tile-aligned run (whole-tile DMAs)
    rc[0, 0, ::3] = -1
    rw, rc = jnp.asarray(rw, jnp.int32), jnp.asarray(rc, jnp.int32)
    sink = jnp.asarray(rng.standard_normal(H), jnp.float32)
    scale = D ** -0.5
    ref = jax.jit(functools.partial(sa.sparse_attention_ref, scale=scale))
    want = ref(q, dec(swa), rw, dec(cmp), rc, sink)
    ref = jax.jit(functools.partial(sa.sparse_attention_ref, scale=scale, entry_format=fmt))(q, swa, rw, cmp, rc, sink)
    np.testing.assert_array_equal(np.asarray(ref), np.asarray(want))
    out = jax.jit(functools.partial(sa.sparse_attention, scale=scale, interpret=True, entry_format=fmt))(
        q, swa, rw, cmp, rc, sink)
    assert np.all(np.isfinite(np.asarray(out)))
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=1e-5, atol=1e-5)


@pytest.mark.usefixtures("single_device")
@pytest.mark.parametrize("fits", [True, False])
def test_gpu_decodes_gathered_fp8_rows_for_the_bf16_kernel(rng, monkeypatch, fits):
    """On a GPU, FP8 entries: the gathered rows decoded once into a pool of their own and read by the bf16 pools'
    kernel (here in interpret mode), the same output as the reference on the bytes; past DECODED_GATHER_BYTES
    the reference runs."""
    B, T, H, D, rope, W, K = 2, 1, 8, 128, 32, 8, 40
    fmt = F.Fp8Entry(D, rope)
    q = jnp.asarray(rng.standard_normal((B, T, H, D)), jnp.float32)
    enc, dec = _jit(fmt)
    swa, cmp = enc(_values(rng, (64, D), 1.0)), enc(_values(rng, (300, D), 1.0))
    rw, rc = rng.integers(0, 64, (B, T, W)), rng.integers(0, 300, (B, T, K))
    rw[0, 0, :3], rc[1, 0, ::4] = -1, -1    # empty slots
    rw, rc = jnp.asarray(rw, jnp.int32), jnp.asarray(rc, jnp.int32)
    sink = jnp.asarray(rng.standard_normal(H), jnp.float32)
    want = jax.jit(functools.partial(sa.sparse_attention_ref, scale=D ** -0.5))(q, dec(swa), rw, dec(cmp), rc, sink)
    pools = []
    gpu_kernel = sa._sparse_attention_gpu

    def kernel(q, swa, rw, cmp, rc, sink, **kw):
        pools.append((swa.dtype, cmp.dtype, swa.shape[0], cmp.shape[0]))
        return gpu_kernel(q, swa, rw, cmp, rc, sink, interpret=True, **kw)

    monkeypatch.setattr(sa._compat, "backend", lambda: "gpu")
    monkeypatch.setattr(sa, "_sparse_attention_gpu", kernel)
    if not fits:
        monkeypatch.setattr(sa, "DECODED_GATHER_BYTES", B * T * (W + K) * D * 4 - 1)
    out = jax.jit(functools.partial(sa.sparse_attention, scale=D ** -0.5, entry_format=fmt))(q, swa, rw, cmp, rc, sink)
    assert pools == ([(jnp.float32, jnp.float32, B * T * W, B * T * K)] if fits else [])
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=1e-5, atol=1e-5)


@pytest.mark.usefixtures("single_device")
def test_indexer_scores_read_fp4_keys(rng):
    B, T, Hi, Di, S, R = 2, 2, 16, 32, 200, 300
    fmt = F.Fp4Key(Di)
    enc, dec = _jit(fmt)
    rot = jax.jit(lambda x: quant.fp4_roundtrip(quant.hadamard_rotate(x)))
    q = rot(jnp.asarray(rng.standard_normal((B, T, Hi, Di)), jnp.float32))
    w = jnp.asarray(rng.standard_normal((B, T, Hi)) * Hi ** -0.5, jnp.float32)
    pool = enc(jax.jit(quant.hadamard_rotate)(_values(rng, (R, Di), 1.0)))
    rows = rng.integers(0, R, (B, S))
    rows[0, ::7] = -1
    rows[0, 128:192] = np.arange(64, 128)  # a tile-aligned run
    n_valid = rng.integers(0, S + 1, (B, T))
    rows, n_valid = jnp.asarray(rows, jnp.int32), jnp.asarray(n_valid, jnp.int32)
    want = jax.jit(ix.indexer_scores_ref)(q, w, dec(pool), rows, n_valid)
    ref = jax.jit(functools.partial(ix.indexer_scores_ref, key_format=fmt))(q, w, pool, rows, n_valid)
    np.testing.assert_array_equal(np.asarray(ref), np.asarray(want))
    out = np.asarray(jax.jit(functools.partial(ix.indexer_scores, interpret=True, key_format=fmt))(
        q, w, pool, rows, n_valid))
    want = np.asarray(want)
    np.testing.assert_array_equal(np.isneginf(out), np.isneginf(want))
    fin = np.isfinite(want)
    np.testing.assert_allclose(out[fin], want[fin], rtol=1e-5, atol=1e-5)


def test_kernels_lower_for_tpu():
    """The byte pools' kernels at Flash decode shapes lower for TPU (Mosaic): words gathered, decoded with shifts
    and same-width bitcasts."""
    from pallas_kernels import _compat
    S = jax.ShapeDtypeStruct
    fmt, key = F.Fp8Entry(512, 64), F.Fp4Key(128)
    exp = _compat.export_for_tpu(functools.partial(sa._sparse_attention_tpu, scale=0.04, entry_format=fmt),
                                 S((4, 1, 64, 512), jnp.bfloat16), S((4096, 584), jnp.uint8),
                                 S((4, 1, 128), jnp.int32), S((65536, 584), jnp.uint8), S((4, 1, 512), jnp.int32),
                                 S((64,), jnp.float32))
    assert "tpu_custom_call" in exp.mlir_module()
    exp = _compat.export_for_tpu(functools.partial(ix._indexer_scores_tpu, key_format=key),
                                 S((4, 1, 64, 128), jnp.bfloat16), S((4, 1, 64), jnp.float32),
                                 S((1 << 20, 68), jnp.uint8), S((4, 32768), jnp.int32), S((4, 1), jnp.int32))
    assert "tpu_custom_call" in exp.mlir_module()


@pytest.mark.parametrize("union", [True, False], ids=["rows decoded once", "rows decoded per query"])
@pytest.mark.parametrize("kind", ["csa", "hca"])
def test_attention_core_on_byte_pools(rng, monkeypatch, kind, union):
    """One CSA / HCA layer's writes and attention (attention_core, the XLA ops) on byte pools equal the same on
    float pools holding the decoded values with the writes rounded as stored; and split over 4 shards of the context
    axis, as on a mesh, the same outputs and bytes as one device. Both ways of reading the entries: a chunk's rows
    decoded once (the window union and the layer's compressed rows) and read as a pool of their own, or each query's
    rows decoded as gathered (attention.DECODED_UNION_BYTES = 0); likewise the indexer's FP4 keys, decoded once for
    the step (as for a prefill chunk; KEYS_DECODED_ONCE_ABOVE = 0 here) or by the select op."""
    from test_context import AXIS, _layer_inputs

    from sharding import context
    from v4jax.model import attention as A
    from v4jax.model import attention_core
    from v4jax.model.ops import ops_for
    calls = []
    decoded_union = A._decoded_union
    monkeypatch.setattr(A, "_decoded_union", lambda *a: calls.append(1) or decoded_union(*a))
    if not union:
        monkeypatch.setattr(A, "DECODED_UNION_BYTES", 0)
    else:
        monkeypatch.setattr(A, "KEYS_DECODED_ONCE_ABOVE", 0)
    q, sink, pools, writes, reads = _layer_inputs(rng, kind, kd=16, ki=32)
    fmt = {"swa": F.Fp8Entry(16, 4), "kv": F.Fp8Entry(16, 4), "idx": F.Fp4Key(32)}
    fmt = {name: f for name, f in fmt.items() if name in pools}
    codec = {name: _jit(f) for name, f in fmt.items()}
    stored = {name: codec[name][0](a) for name, a in pools.items()}
    decoded = {name: codec[name][1](a) for name, a in stored.items()}
    rounded = {name: (r, codec[name][1](codec[name][0](v))) for name, (r, v) in writes.items()}
    static = dict(ops=ops_for("xla"), scale=0.25, window=4, topk=5)
    li = jnp.int32(1)
    whole = {name: context.RowBlock((), a.shape[1]) for name, a in pools.items()}
    want, want_pools = jax.jit(lambda p: attention_core(whole, q, sink, p, rounded, reads, li, **static))(decoded)
    core = functools.partial(attention_core, formats=fmt, **static)
    got, got_pools = jax.jit(lambda p: core(whole, q, sink, p, writes, reads, li))(stored)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    for name, a in got_pools.items():
        np.testing.assert_array_equal(np.asarray(codec[name][1](a)), np.asarray(want_pools[name]))
    # the window union and the compressed rows, and a CSA layer's indexer keys
    assert len(calls) == ((3 if kind == "csa" else 2) if union else 0)

    n = 4
    split = {name: context.RowBlock(() if name == "swa" else (AXIS,), a.shape[1] // (1 if name == "swa" else n))
             for name, a in stored.items()}

    def blocks_of(name, a):  # [layers, R, E] -> [n, layers, R / n, E] (the SWA pool: a copy per shard)
        if name == "swa":
            return jnp.broadcast_to(a, (n,) + a.shape)
        return jnp.moveaxis(a.reshape(a.shape[0], n, -1, a.shape[-1]), 1, 0)

    shards, shard_pools = jax.jit(jax.vmap(lambda p: core(split, q, sink, p, writes, reads, li), axis_name=AXIS))(
        {name: blocks_of(name, a) for name, a in stored.items()})
    for c in range(n):
        np.testing.assert_allclose(shards[c], got, rtol=1e-5, atol=1e-6)
    for name, a in got_pools.items():
        np.testing.assert_array_equal(shard_pools[name], blocks_of(name, a))


# ---- pools: bytes per token in the layout, the memory report and stats() ---------------------------------------

def test_pool_bytes_are_the_formats():
    from v4jax import memory as M
    from v4jax.api import EngineOptions
    from v4jax.config import CSA, HCA
    cfg = preset("flash")
    opts = EngineOptions(kv_cache_dtype="fp8", max_num_seqs=2, enable_prefix_caching=False, prefill_chunk=256)
    pools = M.engine_pools(cfg, opts, 4096)
    p, ps = pools.layout.page_size, pools.layout.swa_page_size
    n_csa, n_hca = cfg.layer_types.count(CSA), cfg.layer_types.count(HCA)
    s = pools.sizes
    assert s["c4_kv"].unit_bytes == n_csa * p // 4 * 584
    assert s["c4_index"].unit_bytes == n_csa * p // 4 * 68
    assert s["c128_kv"].unit_bytes == n_hca * p // 128 * 584
    assert s["swa"].unit_bytes == cfg.n_layers * ps * 584
    # the memory report's per-token figures (FP8 entries, FP4 indexer keys) are the layout's
    per_token = M.report(cfg, 1 << 20, fmt="fp4").per_token
    assert per_token["csa_kv"] * p == s["c4_kv"].unit_bytes
    assert per_token["csa_index"] * p == s["c4_index"].unit_bytes
    assert per_token["hca_kv"] * p == s["c128_kv"].unit_bytes
    bf16 = M.engine_pools(cfg, EngineOptions(max_num_seqs=2, enable_prefix_caching=False, prefill_chunk=256), 4096)
    assert bf16.sizes["c4_kv"].unit_bytes == n_csa * p // 4 * 1024


def test_bad_kv_cache_dtype_names_the_option():
    from v4jax import LLM
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        LLM("tiny", kv_cache_dtype="fp4")
    from v4jax.cache.layout import kv_cache_dtype
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        kv_cache_dtype("int8", jnp.float32)


def test_cli_flag():
    import argparse

    from v4jax.serve.options import add_llm_arguments, llm_kwargs
    p = argparse.ArgumentParser()
    add_llm_arguments(p)
    assert llm_kwargs(p.parse_args(["--kv-cache-dtype", "fp8"]))["kv_cache_dtype"] == "fp8"
    assert llm_kwargs(p.parse_args([]))["kv_cache_dtype"] == "auto"
    with pytest.raises(SystemExit):
        p.parse_args(["--kv-cache-dtype", "fp16"])


# ---- the engine: FP8 pools give quant_sim's outputs -------------------------------------------------------------

GREEDY = dict(temperature=0.0, ignore_eos=True, logprobs=True)
ENGINE = dict(dtype="float32", quant_sim=True, max_num_seqs=4, max_model_len=1200, prefill_chunk=256)


def _same(got, want):
    for g, w in zip(got, want, strict=True):
        assert g.token_ids == w.token_ids
        np.testing.assert_allclose(g.logprobs, w.logprobs, atol=1e-4)


@pytest.fixture(scope="module")
def quant_sim_run(real_ckpt):
    """bfloat16 pools with quant_sim (which rounds what they hold the release's way): four prompts (1, 128, 255,
    700 tokens) decode 150 tokens together (HCA windows close at every 128, CSA every 4, the window wraps), then a
    prompt sharing 512 tokens with the longest. Returns (prompts, variant, params, outputs, variant's output)."""
    from v4jax import LLM, SamplingParams
    ref = LLM(real_ckpt, kv_cache_dtype="bfloat16", **ENGINE)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(2, ref.config.vocab_size, n).tolist() for n in (1, 128, 255, 700)]
    variant = prompts[3][:512] + rng.integers(2, ref.config.vocab_size, 40).tolist()
    params = SamplingParams(max_tokens=150, **GREEDY)
    return prompts, variant, params, ref.generate(prompts, params), ref.generate([variant], params)


@pytest.mark.slow  # two engines to compile (~4 min on one CPU core)
def test_fp8_pools_give_quant_sim_outputs(real_ckpt, quant_sim_run):
    """kv_cache_dtype="fp8" gives quant_sim's greedy tokens and log-probs (within 1e-4) over the batch and the
    prefix hit; the pools' bytes are the formats' (stats and arrays agree)."""
    from v4jax import LLM
    from v4jax.config import CSA, HCA
    prompts, variant, params, want, want_v = quant_sim_run
    llm = LLM(real_ckpt, kv_cache_dtype="fp8", **ENGINE)
    _same(llm.generate(prompts, params), want)
    hit = llm.stats()["prefix_cache"]["hit_tokens"]
    _same(llm.generate([variant], params), want_v)
    assert llm.stats()["prefix_cache"]["hit_tokens"] - hit == 512

    cfg, core = llm.config, llm.engine
    entry, key = cfg.fp8_entry_bytes, cfg.fp4_key_bytes
    assert (entry, key) == (200, 36)  # head_dim 128 (rope 64), index_head_dim 64
    stats = llm.stats()["pools"]
    arrays = {"c4_kv": [lp.kv for lp in core.pools.stacks if lp.idx is not None],
              "c4_index": [lp.idx for lp in core.pools.stacks if lp.idx is not None],
              "c128_kv": [lp.kv for lp in core.pools.stacks if lp.kv is not None and lp.idx is None]}
    p = core.layout.page_size
    n_csa = cfg.layer_types.count(CSA)
    per_page = {"c4_kv": n_csa * p // 4 * entry, "c4_index": n_csa * p // 4 * key,
                "c128_kv": cfg.layer_types.count(HCA) * p // 128 * entry}
    for name, arrs in arrays.items():
        assert all(a.dtype == jnp.uint8 for a in arrs)
        assert stats[name]["bytes_total"] == sum(a.nbytes for a in arrs) == per_page[name] * stats[name]["total"]


@pytest.mark.slow  # two engines to compile (~4 min on one CPU core)
def test_fp8_pools_preempted(real_ckpt, quant_sim_run):
    """An engine whose pools hold 4 of the 9 full pages the batch needs preempts (by recompute) and gives the tokens
    and log-probs of quant_sim's engine of the same 4 pages. (Against the quant_sim run with every page, the tokens
    are equal and a few log-probs differ by ~0.02: requests held back or recomputed run in other chunks, which
    changes the reductions' last bits, and an FP8 rounding step flips on such a bit. Bit-equal runs need the same
    chunk schedule. With 5 pages the scheduler now holds requests back instead of preempting.)"""
    import dataclasses

    from v4jax import LLM
    from v4jax.api import EngineOptions
    from v4jax.cache.layout import pool_layout, pool_sizes
    prompts, _, params, _, _ = quant_sim_run
    cfg = ModelConfig.from_hf(real_ckpt)
    runs = {}
    for kv in ("bfloat16", "fp8"):  # quant_sim's bf16 pools, then the release's bytes
        opts = EngineOptions(kv_cache_dtype=kv, **{k: v for k, v in ENGINE.items() if k != "dtype"})
        lay = dataclasses.replace(pool_layout(cfg, opts, kv, 1200), n_pages=4)
        budget = sum(s.bytes for s in pool_sizes(cfg, lay, kv, True).values())
        small = LLM(real_ckpt, kv_cache_dtype=kv, memory_budget_bytes=budget, **ENGINE)
        assert small.engine.layout.n_pages == 4
        runs[kv] = small.generate(prompts, params)
        assert small.stats()["requests"]["preempted"] > 0
    _same(runs["fp8"], runs["bfloat16"])


@pytest.mark.slow  # two engines to compile (~6 min on one CPU core)
def test_fp8_pools_dense_layout(real_ckpt, quant_sim_run):
    """The dense layout with FP8 pools gives the dense layout's quant_sim outputs. (Against the paged quant_sim run
    one prompt's log-probs differed past ~130 tokens by up to 0.07, tokens equal: the layouts' reductions may differ
    in the last bit, and an FP8 rounding step flips on such a bit; quant_sim's reference is the same layout.)"""
    from v4jax import LLM
    prompts, _, params, _, _ = quant_sim_run
    want = LLM(real_ckpt, kv_cache_dtype="bfloat16", kv_layout="dense", **ENGINE).generate(prompts, params)
    _same(LLM(real_ckpt, kv_cache_dtype="fp8", kv_layout="dense", **ENGINE).generate(prompts, params), want)


@pytest.mark.slow  # an engine and two forwards to compile (~70 s on CPU)
def test_teacher_forced_forward_rounds_as_the_cache():
    """The teacher-forced forward of an LLM with FP8 cache entries rounds its keys as the pools store them (FP8
    window and compressed entries, FP4 indexer keys): the engine's greedy tokens are its argmax and their log-probs
    those of the forward (float32; a median within 1e-5, the rest within 0.01 where a last-bit difference between
    the paths flips an FP8 rounding: compiled at -O0, as the tests are, 4 of 24 differed by up to 1.2e-3; at -O2
    none beyond 2e-6), over a prompt whose decode crosses CSA and HCA windows; the forward without the rounding
    misses them by 0.1 to 2."""
    from v4jax import LLM, SamplingParams
    llm = LLM("tiny", dtype="float32", kv_cache_dtype="fp8", max_num_seqs=1, max_model_len=96, prefill_chunk=32)
    prompt = np.random.default_rng(5).integers(2, llm.config.vocab_size, 40).tolist()
    (out,) = llm.generate([prompt], SamplingParams(max_tokens=24, **GREEDY))
    seq = prompt + out.token_ids
    lg = llm.logits(seq)[len(prompt) - 1:-1]
    lp = lg - lg.max(-1, keepdims=True)
    lp = lp - np.log(np.exp(lp).sum(-1, keepdims=True))
    assert (lg.argmax(-1) == np.asarray(out.token_ids)).all()
    diff = np.abs(np.asarray(out.logprobs) - lp[np.arange(len(out.token_ids)), out.token_ids])
    assert np.median(diff) < 1e-5 and diff.max() < 0.01, diff
    exact = LLM("tiny", dtype="float32", max_num_seqs=1, max_model_len=96).logits(seq)[len(prompt) - 1:-1]
    exact = exact - exact.max(-1, keepdims=True)
    exact = exact - np.log(np.exp(exact).sum(-1, keepdims=True))
    assert np.abs(np.asarray(out.logprobs) - exact[np.arange(len(out.token_ids)), out.token_ids]).max() > 0.1


def test_kernel_and_config_block_sizes_agree():
    from pallas_kernels import kv_format
    from v4jax import config
    assert (kv_format.FP8_BLOCK, kv_format.FP4_BLOCK) == (config.FP8_BLOCK, config.FP4_BLOCK)
