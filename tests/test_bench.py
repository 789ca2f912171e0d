"""`v4jax bench decode --small` runs end to end on CPU (JAX rows, the HF peer, the logits check) and its roofline
byte counts are the ones computed by hand below. No timing is asserted."""
from __future__ import annotations

import json
import math
import os

import pytest

from v4jax.cache.layout import full_page_size
from v4jax import bench, memory
from v4jax.bench import small_config

# Hand count for small_config() (bf16 = 2 B; norms, mHC, sinks, ape, router bias in f32 = 4 B).
#   dim 64, vocab 256, 2 layers (CSA ratio 4, HCA ratio 32), 4 heads x 64, q_lora 32, 2 groups x 32, window 16,
#   indexer 4 x 32 top-8, 4 experts (2 active) of width 32 + 1 shared, hc_mult 4 (mix width 24).
HEAD = 256 * 64 * 2  # 32768
TOP = 64 * 4 + (4 * 256 + 4 + 1) * 4  # final norm + hc_head fn/base/scale = 4372
COMMON = (2 * 64 * 4  # attn / ffn norms
          + 2 * (24 * 256 + 24 + 3) * 4  # hc_attn, hc_ffn: fn [24, 256], base [24], scale [3]
          + (32 * 64 + 256 * 32 + 64 * 64 + 64 * 128 + 64 * 64) * 2  # wq_a wq_b wkv wo_a wo_b
          + (32 + 64 + 4) * 4)  # q_norm, kv_norm, attn_sink  -> 103528 per layer
CSA_EXTRA = (2 * 128 * 64 * 2 + (4 * 128 + 64) * 4  # compressor wkv/wgate [128, 64], ape [4, 128], norm [64]
             + (128 * 32 + 4 * 64) * 2  # indexer wq_b [128, 32], weights_proj [4, 64]
             + 2 * 64 * 64 * 2 + (4 * 64 + 32) * 4)  # indexer compressor [64, 64] x 2, ape [4, 64], norm [32]
HCA_EXTRA = 2 * 64 * 64 * 2 + (32 * 64 + 64) * 4  # compressor wkv/wgate [64, 64], ape [32, 64], norm [64]
ROUTER = 2 * (4 * 64 * 2 + 4 * 4)  # gate [4, 64] + bias [4], 2 layers
SHARED = 2 * 3 * 32 * 64 * 2  # 2 layers
EXPERT = 3 * 32 * 64 * 2  # one routed expert


def hand_weights(batch: int) -> float:
    active = {1: 2.0, 2: 4 * (1 - 0.5 ** 2)}[batch]  # E (1 - (1 - k/E)^B), E = 4, k = 2
    return batch * 64 * 2 + HEAD + TOP + 2 * COMMON + CSA_EXTRA + HCA_EXTRA + ROUTER + SHARED + 2 * active * EXPERT


def hand_kv_per_seq(ctx: int) -> int:
    indexer = (ctx // 4) * 32 * 2  # every C4 indexer key of the CSA layer
    sparse = min(8, ctx // 4) * 64 * 2  # top-8 selected C4 entries
    hca = (ctx // 32) * 64 * 2  # every C32 entry of the HCA layer
    swa = 2 * min(16, ctx) * 64 * 2  # the window of both layers
    return indexer + sparse + hca + swa


def test_hand_count_constants():
    assert (COMMON, CSA_EXTRA, HCA_EXTRA) == (103528, 61312, 24832)
    assert hand_weights(1) == 405252 and hand_kv_per_seq(256) == 10240
    assert memory.param_bytes(small_config(), 2, mtp=False)["total"] == (
        2 * 256 * 64 * 2 + TOP + 2 * COMMON + CSA_EXTRA + HCA_EXTRA + ROUTER + SHARED + 2 * 4 * EXPERT)


@pytest.mark.parametrize("batch,ctx", [(1, 256), (2, 256), (1, 512)])
def test_roofline_by_hand(batch, ctx):
    rl = bench.roofline_bytes(small_config(), batch, ctx)
    assert rl["weights"] == pytest.approx(hand_weights(batch), rel=1e-12)
    assert rl["kv"] == batch * hand_kv_per_seq(ctx)
    assert rl["total"] == pytest.approx(hand_weights(batch) + batch * hand_kv_per_seq(ctx), rel=1e-12)


def test_random_pools_fill_every_element():
    # the decode benchmark's synthetic pools: an engine built under _random_pools has its pools' shapes, dtypes
    # and (uncommitted: a committed pool is a new signature to the engine's steps) placement, every element
    # written, floats in [-2, 2], ids inside the vocabulary, the same values for the same seed, other values for
    # another, and other values in each layer of a stack
    import jax
    import numpy as np

    from v4jax import cache as C
    from v4jax.bench import decode as D

    cfg = small_config()
    p = full_page_size(cfg)
    LAYOUT = C.PoolLayout(page_size=p, swa_page_size=math.gcd(p, 64), n_pages=6, n_swa_pages=5, max_slots=2,
                          max_pages_per_seq=3, max_swa_pages_per_seq=2)
    zeros = C.init_pools
    outs = []
    for seed in (3, 3, 4):
        with D._random_pools(cfg.vocab_size, seed):
            assert C.init_pools is not zeros
            outs.append(C.init_pools(cfg, LAYOUT, jax.numpy.bfloat16))
        assert C.init_pools is zeros
    ref = zeros(cfg, LAYOUT, jax.numpy.bfloat16)
    leaves = [jax.tree.leaves(o) for o in outs]
    for r, a, b, c in zip(jax.tree.leaves(ref), *leaves):
        assert (a.shape, a.dtype, a.committed) == (r.shape, r.dtype, r.committed) == (c.shape, c.dtype, False)
        a, b, c = (np.asarray(x, np.float32) for x in (a, b, c))
        np.testing.assert_array_equal(a, b)
        assert not np.array_equal(a, c)
        if np.issubdtype(r.dtype, np.integer):      # every element written: zeros only as often as chance gives
            assert a.size - np.count_nonzero(a) <= 3 * a.size // cfg.vocab_size + 2
            assert a.min() >= 0 and a.max() < cfg.vocab_size and len(np.unique(a)) > min(cfg.vocab_size, a.size) // 2
        else:
            assert a.size - np.count_nonzero(a) <= 2
            assert a.min() >= -2 and a.max() <= 2 and len(np.unique(a)) > min(100, a.size // 2)
        if a.ndim >= 2 and a.shape[0] > 1:
            assert not np.array_equal(a[0], a[1])


def test_random_byte_pools_decode_to_a_few_units():
    # kv_cache_dtype="fp8": the synthetic pools' FP8 entries and FP4 keys decode to finite values of a few units,
    # most of them nonzero, every scale the same (random bytes everywhere made RoPE dims up to 2^112 and scales
    # down to 2^-127), padding zero
    import numpy as np

    from pallas_kernels import kv_format as F
    from v4jax import cache as C
    from v4jax.bench import decode as D

    cfg = small_config()
    p = full_page_size(cfg)
    layout = C.PoolLayout(page_size=p, swa_page_size=math.gcd(p, 64), n_pages=6, n_swa_pages=5, max_slots=2,
                          max_pages_per_seq=3, max_swa_pages_per_seq=2)
    with D._random_pools(cfg.vocab_size, 0):
        pools = C.init_pools(cfg, layout, "fp8")
    entry, key = F.Fp8Entry(cfg.head_dim, cfg.rope_head_dim), F.Fp4Key(cfg.index_head_dim)
    seen = set()
    for stack in pools.stacks:
        for name in ("swa", "kv", "idx"):
            a = getattr(stack, name)
            if a is None:
                continue
            fmt = key if name == "idx" else entry
            assert a.dtype == np.uint8 and a.shape[-1] == fmt.nbytes
            v = np.asarray(fmt.decode(a))
            assert np.all(np.isfinite(v)) and np.abs(v).max() <= 8 and np.mean(v != 0) > 0.8, name
            assert len(np.unique(v)) >= (15 if name == "idx" else 50)  # e2m1 x one scale: 15 values
            seen.add(name)
    assert seen == {"swa", "kv", "idx"}
    b = np.asarray(pools.stacks[-1].swa)[..., entry.nope + 2 * entry.rope:]
    assert np.all(b[..., :entry.n_scales] == 127 - 6) and np.all(b[..., entry.n_scales:] == 0)


def test_prefill_flops_by_hand():
    # small_config(): per token, the multiply-adds of its weights (bf16 linears, f32 mHC mixes and router)
    from v4jax.bench.flops import prefill_flops
    proj = (2 * (32 * 64 + 256 * 32 + 64 * 64 + 64 * 128 + 64 * 64)   # wq_a wq_b wkv wo_a wo_b, 2 layers
            + 2 * 2 * 24 * 256                                         # mHC mixes, both sides, 2 layers
            + 2 * 128 * 64 + 2 * 64 * 64                               # compressors: CSA [128, 64] x2, HCA [64, 64] x2
            + 128 * 32 + 4 * 64 + 2 * 64 * 64                          # indexer wq_b, weights_proj, its compressor
            + 2 * 4 * 64)                                              # routers
    experts = 2 * 3 * 32 * 64 * (1 + 2)                                # shared + 2 routed, 2 layers
    L = 100
    rows = index_keys = 0
    for p in range(L):                                                 # window 16; CSA top-8 of (p+1)//4; HCA (p+1)//32
        rows += 2 * min(16, p + 1) + min(8, (p + 1) // 4) + (p + 1) // 32
        index_keys += (p + 1) // 4
    f = prefill_flops(small_config(), L, batch=3)
    assert f["projections"] == 3 * 2 * proj * L and f["experts"] == 3 * 2 * experts * L
    assert f["attention"] == 3 * 4 * 4 * 64 * rows and f["indexer"] == 3 * 2 * 4 * 32 * index_keys
    assert f["head"] == 3 * 2 * 256 * 64
    assert f["total"] == pytest.approx(sum(v for k, v in f.items() if k != "total"))


@pytest.mark.slow  # ~35 s: the decode bench end to end on CPU
def test_small_runs_end_to_end(tmp_path):
    out = str(tmp_path / "bench")
    rc = bench.decode_main(["--small", "--batches", "1,2", "--contexts", "256", "--long-b1", "", "--iters", "2",
                            "--gen-iters", "1", "--hf-iters", "2", "--out", out])
    assert rc == 0
    data = json.load(open(os.path.join(out, "decode.json")))
    rows = data["rows"]
    assert [(r["batch"], r["context"]) for r in rows] == [(1, 256), (2, 256)]
    for r in rows:
        assert "error" not in r, r
        assert r["ms_per_step"] > 0 and r["k"] == 4 and r["held_tokens"] == 256 - 8
        assert r["page_bucket"] == 1 and r["c4_entries_scanned_per_seq"] == 64
        assert r["roofline"]["total"] == pytest.approx(hand_weights(r["batch"]) + r["batch"] * hand_kv_per_seq(256))
    assert data["bandwidth"]["copy_GBps"] > 0
    try:
        import torch  # noqa: F401
        from transformers import DeepseekV4ForCausalLM  # noqa: F401
    except ImportError:
        return
    assert [(h["batch"], h["context"]) for h in data["hf"]] == [(1, 256), (2, 256)]
    assert all(h.get("ms_per_step", 0) > 0 for h in data["hf"]), data["hf"]
    assert data["hf_check"]["argmax_agree"] >= 0.9  # the HF model runs the JAX model's weights
    md = open(os.path.join(out, "decode.md")).read()
    assert "| 1 | 256 |" in md and "HF" in md


@pytest.mark.slow  # ~30 s
def test_small_runs_with_penalties(tmp_path):
    """--frequency-penalty times the program form with penalties, as the jitted call and through the engine loop."""
    out = str(tmp_path / "bench")
    assert bench.decode_main(["--small", "--batches", "2", "--contexts", "256", "--long-b1", "", "--iters", "1",
                              "--gen-iters", "1", "--hf", "off", "--frequency-penalty", "0.5", "--out", out]) == 0
    rows = json.load(open(os.path.join(out, "decode.json")))["rows"]
    assert len(rows) == 1 and "error" not in rows[0] and rows[0]["ms_per_step"] > 0, rows
    assert rows[0]["penalties_form"] and rows[0]["generate_step_ms_per_step"] > 0


def test_memory_main(capsys):
    assert bench.memory_main(["--model", "flash", "--context", "1M", "--budget-gib", "64"]) == 0
    text = capsys.readouterr().out
    assert "6880" in text and "3850.25" in text and "full pages" in text


def test_profile_attributes_kernels_to_model_lines():
    # the compiled program's stack-frame table maps each fused instruction to the innermost lines of our code
    import jax
    import jax.numpy as jnp

    from v4jax.model import layers as L
    from v4jax.bench.profile import hlo_sources

    def f(x, w):
        return L.swiglu(L.rms_norm(x, w, 1e-6), x, 10.0)

    text = jax.jit(f).lower(jnp.ones((4, 256)), jnp.ones((256,))).compile().as_text()
    where = set(hlo_sources(text).values())
    assert any("v4jax/model/layers.py" in w and "(rms_norm)" in w for w in where), where
    assert any("pallas_kernels/experts.py" in w and "(swiglu)" in w for w in where), where  # one swiglu, there
