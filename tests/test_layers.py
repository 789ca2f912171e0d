"""Unit tests of the building blocks against HF modules and against each other: mHC, RoPE/YaRN, both
compressors across window boundaries, indexer top-k tie rule, routing."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import hf_reference as H
from v4jax.model import layers as L
from v4jax.config import CSA, HCA
from v4jax.model import topk_mask


def _hf_cfg():
    return H.hf_config(H.cfg_small_ratios())


def _rand(shape, seed, scale=1.0):
    return (np.random.default_rng(seed).normal(size=shape) * scale).astype(np.float32)


def test_mhc_matches_hf():
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HyperConnection, DeepseekV4HyperHead
    cfg = H.cfg_small_ratios()
    hc = DeepseekV4HyperConnection(_hf_cfg()).float()
    head = DeepseekV4HyperHead(_hf_cfg()).float()
    n, d = cfg.hc_mult, cfg.dim
    fn, base, scale = _rand((24, n * d), 0, 0.1), _rand((24,), 1), 1 + _rand((3,), 2, 0.3)
    hfn, hbase, hscale = _rand((n, n * d), 3, 0.1), _rand((n,), 4), 1 + _rand((1,), 5, 0.3)
    with torch.no_grad():
        hc.fn.copy_(torch.from_numpy(fn)); hc.base.copy_(torch.from_numpy(base)); hc.scale.copy_(torch.from_numpy(scale))
        head.hc_fn.copy_(torch.from_numpy(hfn)); head.hc_base.copy_(torch.from_numpy(hbase))
        head.hc_scale.copy_(torch.from_numpy(hscale))
    x = _rand((2, 5, n, d), 6)
    post_r, comb_r, u_r = (t.detach().numpy() for t in hc(torch.from_numpy(x)))
    u, post, comb = L.hc_pre(jnp.asarray(x), fn, base, scale, cfg)
    np.testing.assert_allclose(u, u_r, atol=1e-5)
    np.testing.assert_allclose(post, post_r, atol=1e-6)
    np.testing.assert_allclose(comb, comb_r, atol=1e-6)
    # Sinkhorn: columns sum to ~1 (last normalisation), rows close to 1.
    np.testing.assert_allclose(np.asarray(comb).sum(-2), 1.0, atol=1e-4)
    np.testing.assert_allclose(np.asarray(comb).sum(-1), 1.0, atol=1e-2)
    f = _rand((2, 5, d), 7)
    ref_post = post_r[..., None] * f[..., None, :] + np.einsum("bsjk,bsjd->bskd", comb_r, x)
    np.testing.assert_allclose(L.hc_post(jnp.asarray(f), jnp.asarray(x), post, comb), ref_post, atol=1e-5)
    y = L.hc_head(jnp.asarray(x), hfn, hbase, hscale, cfg)
    np.testing.assert_allclose(y, head(torch.from_numpy(x)).detach().numpy(), atol=1e-5)


@pytest.mark.parametrize("kind", ["sliding", "compress"])
def test_rope_frequencies_match_hf(kind):
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RotaryEmbedding
    for cfg in (H.cfg_small_ratios(), H.cfg_real_ratios()):
        rot = DeepseekV4RotaryEmbedding(H.hf_config(cfg))
        hf_name = "main" if kind == "sliding" else "compress"
        ours = L.rope_inv_freq(cfg, "sliding" if kind == "sliding" else CSA)
        np.testing.assert_allclose(ours, getattr(rot, f"{hf_name}_inv_freq").numpy(), rtol=1e-6)


def test_rope_inverse_undoes_rotation():
    x = jnp.asarray(_rand((3, 4, 32), 0))
    cos, sin = L.rope_cos_sin(L.rope_inv_freq(H.cfg_small_ratios(), HCA)[:8], jnp.arange(3)[:, None] * 37)
    y = L.apply_rope(L.apply_rope(x, cos, sin), cos, sin, inverse=True)
    np.testing.assert_allclose(y, x, atol=1e-5)
    np.testing.assert_allclose(y[..., :16], x[..., :16])  # nope dims untouched


@pytest.mark.parametrize("ratio,overlap", [(4, True), (8, False), (4, False), (2, True)])
def test_compressor_resumes_across_window_boundaries(ratio, overlap):
    """compress_chunk over any split of a sequence into chunks (boundaries inside, at and across windows)
    emits exactly the entries compress_windows computes for the whole sequence."""
    coff = 2 if overlap else 1
    t, k = 37, 6
    a = jnp.asarray(_rand((1, t, coff * k), 1))
    z = jnp.asarray(_rand((1, t, coff * k), 2))
    full = np.asarray(L.compress_windows(a, z, ratio, overlap))[0]
    rng = np.random.default_rng(ratio)
    # jitted as the engine's steps run it: one program per chunk width instead of every op compiled on its own
    compress_chunk = jax.jit(L.compress_chunk, static_argnums=(7, 8))
    for trial in range(6):
        cuts = sorted(set(rng.integers(1, t, 4).tolist()) | {ratio, ratio - 1, ratio + 1}) if trial else list(range(1, t))
        bounds = [0] + [c for c in cuts if 0 < c < t] + [t]
        st_kv = jnp.zeros((1, coff * ratio, coff * k))
        st_sc = jnp.full((1, coff * ratio, coff * k), -jnp.inf)
        got = {}
        for s, e in zip(bounds[:-1], bounds[1:]):
            width = 1 << (e - s - 1).bit_length()  # padded like the engine's buckets
            pad = lambda v: jnp.pad(v[:, s:e], ((0, 0), (0, width - (e - s)), (0, 0)))
            pooled, ent, ok, st_kv, st_sc = compress_chunk(
                st_kv, st_sc, pad(a), pad(z), jnp.asarray([s]), jnp.asarray([e - s]), jnp.asarray([s == 0]),
                ratio, overlap)
            for j in np.flatnonzero(np.asarray(ok)[0]):
                got[int(ent[0, j])] = np.asarray(pooled[0, j])
        assert sorted(got) == list(range(t // ratio))
        for w, v in got.items():
            np.testing.assert_allclose(v, full[w], rtol=1e-5, atol=1e-6)


def test_topk_tie_rule_and_padding():
    scores = jnp.asarray([[[1.0, 3.0, 3.0, 2.0, 3.0, 0.0]]])
    valid = jnp.asarray([[[True, True, True, True, True, False]]])
    m = np.asarray(topk_mask(scores, valid, 2))[0, 0]
    assert m.tolist() == [False, True, True, False, False, False]  # ties: lower index first
    m = np.asarray(topk_mask(scores, valid, 10))[0, 0]  # k larger than the valid count
    assert m.tolist() == [True, True, True, True, True, False]
    none = np.asarray(topk_mask(scores, jnp.zeros_like(valid), 3))
    assert not none.any()


@pytest.mark.parametrize("hashed", [False, True])
def test_routing_matches_hf(hashed):
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HashRouter, DeepseekV4TopKRouter
    cfg = H.cfg_small_ratios()
    hf_cfg = _hf_cfg()
    router = (DeepseekV4HashRouter if hashed else DeepseekV4TopKRouter)(hf_cfg).float()
    w = _rand((cfg.n_routed_experts, cfg.dim), 0, 0.3)
    bias = _rand((cfg.n_routed_experts,), 1, 0.3)
    tid2eid = np.stack([np.random.default_rng(i).permutation(cfg.n_routed_experts)[:cfg.n_activated_experts]
                        for i in range(cfg.vocab_size)]).astype(np.int64)
    with torch.no_grad():
        router.weight.copy_(torch.from_numpy(w))
        if hashed:
            router.tid2eid.copy_(torch.from_numpy(tid2eid))
        else:
            router.e_score_correction_bias.copy_(torch.from_numpy(bias))
    x = _rand((11, cfg.dim), 2)
    ids = np.random.default_rng(3).integers(0, cfg.vocab_size, 11)
    if hashed:
        _, w_r, idx_r = router(torch.from_numpy(x), torch.from_numpy(ids))
    else:
        _, w_r, idx_r = router(torch.from_numpy(x))
    ww, idx = L.route(jnp.asarray(x), w, None if hashed else bias, jnp.asarray(tid2eid.astype(np.int32)) if hashed
                      else None, jnp.asarray(ids), cfg)
    order_r = np.argsort(idx_r.numpy(), -1)
    order = np.argsort(np.asarray(idx), -1)
    np.testing.assert_array_equal(np.take_along_axis(np.asarray(idx), order, -1),
                                  np.take_along_axis(idx_r.numpy(), order_r, -1))
    np.testing.assert_allclose(np.take_along_axis(np.asarray(ww), order, -1),
                               np.take_along_axis(w_r.detach().numpy(), order_r, -1), rtol=1e-5)


@pytest.mark.parametrize("m", [9, 2])  # 9 tokens: ragged_dot path; 2 tokens: gathered-weights path
def test_routed_experts_grouped_matmul_equals_dense(m):
    """The expert matmul (ragged or gathered) equals computing each selected expert densely."""
    rng = np.random.default_rng(0)
    d, i, e, k = 16, 8, 5, 2
    x = rng.normal(size=(m, d)).astype(np.float32)
    w1, w3 = rng.normal(size=(e, i, d)).astype(np.float32), rng.normal(size=(e, i, d)).astype(np.float32)
    w2 = rng.normal(size=(e, d, i)).astype(np.float32)
    idx = np.stack([rng.permutation(e)[:k] for _ in range(m)]).astype(np.int32)
    wts = rng.random((m, k)).astype(np.float32)
    y = np.asarray(L.routed_experts(jnp.asarray(x), jnp.asarray(wts), jnp.asarray(idx), w1, w2, w3, 3.0))
    ref = np.zeros((m, d), np.float32)
    for t in range(m):
        for j in range(k):
            ex = idx[t, j]
            h = np.asarray(L.swiglu(w1[ex] @ x[t], w3[ex] @ x[t], 3.0))
            ref[t] += wts[t, j] * (w2[ex] @ h)
    np.testing.assert_allclose(y, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("m,n_exp,k", [(2, 16, 3), (40, 8, 2), (40, 32, 3)])  # gather, dense, grouped forms
def test_routed_experts_every_form_equals_per_token_reference(m, n_exp, k):
    key = jax.random.split(jax.random.key(0), 6)
    d, i = 16, 24
    x = jax.random.normal(key[0], (m, d))
    w1, w3 = jax.random.normal(key[1], (n_exp, i, d)), jax.random.normal(key[2], (n_exp, i, d))
    w2 = jax.random.normal(key[3], (n_exp, d, i))
    experts = jnp.argsort(jax.random.uniform(key[4], (m, n_exp)), axis=-1)[:, :k]  # k distinct experts per token
    weights = jax.random.uniform(key[5], (m, k))
    ref = 0
    for j in range(k):
        e = experts[:, j]
        h = L.swiglu(jnp.einsum("md,mid->mi", x, w1[e]), jnp.einsum("md,mid->mi", x, w3[e]), 7.0)
        ref = ref + weights[:, j:j + 1] * jnp.einsum("mi,mdi->md", h, w2[e])
    out = L.routed_experts(x, weights, experts, w1, w2, w3, 7.0)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-4 * float(jnp.abs(ref).max()))


@pytest.mark.parametrize("rows", [[3], [-1], [7], [8], [-1, 2], [0, 7, -1]])
def test_set_rows_writes_what_a_dropping_scatter_writes(rows):
    """L.set_rows (one row: a dynamic_update_slice of the row or its old value) writes the rows in [0, 8) and
    leaves the array alone for the rest (-1, 8), as the scatter of mode "drop" it replaces for one row."""
    dst = jnp.arange(8 * 3, dtype=jnp.float32).reshape(8, 3)
    r = jnp.asarray(rows, jnp.int32)
    vals = -1.0 - jnp.arange(len(rows) * 3, dtype=jnp.float32).reshape(len(rows), 3)
    want = dst.at[jnp.where(r >= 0, r, 8)].set(vals, mode="drop")
    np.testing.assert_array_equal(np.asarray(jax.jit(L.set_rows)(dst, r, vals)), np.asarray(want))
    assert not np.array_equal(np.asarray(want), np.asarray(dst)) or rows in ([-1], [8])
