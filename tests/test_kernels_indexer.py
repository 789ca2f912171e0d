"""Indexer scores and exact top-k.

Scores: reference vs float64 numpy (reference §3.5); TPU-style Pallas (TPU interpret) and GPU Triton (interpret; on
float pools and on FP4-key byte pools) vs the reference, every element checked (interpret outputs start
NaN-poisoned; -inf must land exactly where the reference has -inf). Top-k: every implementation vs a numpy lexsort
oracle of the tie rule (score desc, then lower index; -inf -> -1; k > S padded) on rows with deliberate ties,
-0.0/+0.0, -inf padding, few valid entries;
both branches of the GPU threshold method (fast path and buffer overflow -> exact fallback) and of the TPU
approx_max_k method. Lowering for TPU and CUDA.
"""
import functools
import importlib

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np
import pytest

from pallas_kernels import _compat
from pallas_kernels import indexer as ix
tk = importlib.import_module("pallas_kernels.topk")


pytestmark = pytest.mark.usefixtures("single_device")  # TPU interpret mode wants one device


# ---- scores ----------------------------------------------------------------------------------------------------

def _score_inputs(rng, B, T, Hi, Di, S, R, dtype):
    q = jnp.asarray(rng.standard_normal((B, T, Hi, Di)), dtype)
    w = jnp.asarray(rng.standard_normal((B, T, Hi)) * Hi ** -0.5, jnp.float32)
    pool = jnp.asarray(rng.standard_normal((R, Di)), dtype)
    rows = rng.integers(0, R, (B, S))
    rows[0, ::7] = -1
    run = rows[0, 64:128]
    run[:] = np.arange(100, 100 + run.size) % R     # a contiguous run, not tile-aligned
    if S >= 192 and R >= 128:
        rows[0, 128:192] = np.arange(64, 128)          # a tile-aligned run (whole-tile DMAs on TPU)
    rows[-1, S // 2:] = -1
    n_valid = rng.integers(0, S + 1, (B, T))
    n_valid[0, 0] = S
    n_valid[-1, -1] = 0
    return q, w, pool, jnp.asarray(rows, jnp.int32), jnp.asarray(n_valid, jnp.int32)


def _np_scores(q, w, pool, rows, n_valid):
    q, w, pool = (np.asarray(a, np.float64) for a in (q, w, pool))
    rows, n_valid = np.asarray(rows), np.asarray(n_valid)
    keys = pool[np.maximum(rows, 0)]                                        # [B, S, Di]
    s = np.einsum("bth,bths->bts", w, np.maximum(np.einsum("bthd,bsd->bths", q, keys), 0))
    ok = (np.arange(rows.shape[1])[None, None] < n_valid[..., None]) & (rows >= 0)[:, None]
    return np.where(ok, s, -np.inf)


def _check_scores(out, ref, rtol, atol):
    out, ref = np.asarray(out), np.asarray(ref)
    assert not np.any(np.isnan(out)), "unwritten (NaN-poisoned) outputs"
    np.testing.assert_array_equal(np.isneginf(out), np.isneginf(ref))
    fin = np.isfinite(ref)
    np.testing.assert_allclose(out[fin], ref[fin], rtol=rtol, atol=atol)


def test_scores_reference_matches_numpy(rng):
    args = _score_inputs(rng, 2, 3, 16, 32, 200, 300, jnp.float32)
    _check_scores(ix.indexer_scores_ref(*args), _np_scores(*args), 1e-5, 1e-5)


def test_scores_reference_head_groups(rng, monkeypatch):
    args = _score_inputs(rng, 2, 2, 16, 32, 100, 300, jnp.float32)
    full = ix.indexer_scores_ref(*args)
    monkeypatch.setattr(ix, "_REF_BYTES_LIMIT", 1 << 12)
    _check_scores(ix.indexer_scores_ref(*args), full, 1e-5, 1e-5)


@pytest.mark.parametrize("B,T,S,dtype,tol,mode", [
    (2, 3, 700, jnp.float32, 1e-5, "tpu"),     # S-blocks of 512 with padding; several sub-chunks
    (1, 10, 130, jnp.bfloat16, 1e-3, "tpu"),   # T > 8: query blocks of 8 with padding
    pytest.param(2, 3, 700, jnp.float32, 1e-5, "hlo", marks=pytest.mark.slow),  # interpret=True's fast interpreter
])
def test_scores_tpu_kernel_interpret(rng, B, T, S, dtype, tol, mode):
    args = _score_inputs(rng, B, T, 16, 32, S, 800, dtype)
    ref = ix.indexer_scores_ref(*args)
    out = jax.jit(functools.partial(ix._indexer_scores_tpu, interpret=mode))(*args)
    _check_scores(out, ref, tol, tol)


@pytest.mark.parametrize("T,Hi,dtype,tol,n_inner", [(3, 16, jnp.float32, 1e-5, 1), (20, 12, jnp.bfloat16, 1e-3, 1),
                                                     (1, 16, jnp.float32, 1e-5, 3)])
def test_scores_gpu_kernel_interpret(rng, T, Hi, dtype, tol, n_inner):
    args = _score_inputs(rng, 2, T, Hi, 32, 300, 500, dtype)
    ref = ix.indexer_scores_ref(*args)
    out = jax.jit(functools.partial(ix._indexer_scores_gpu, interpret=True, sb=64, n_inner=n_inner))(*args)
    _check_scores(out, ref, tol, tol)


@pytest.mark.parametrize("Di,T,Hi,dtype,tol,n_inner", [(64, 3, 16, jnp.float32, 1e-5, 1),
                                                        (128, 20, 12, jnp.bfloat16, 1e-3, 1),
                                                        (128, 1, 16, jnp.float32, 1e-5, 3)])
def test_scores_gpu_kernel_interpret_fp4_keys(rng, Di, T, Hi, dtype, tol, n_inner):
    """The Triton kernel reading FP4 keys as bytes (decoded in registers) against the reference reading the same bytes:
    keys of magnitudes a few powers of two apart (their ue8m0 scales differ) and an all-zero key (the scale's floor)."""
    from pallas_kernels import kv_format
    fmt = kv_format.Fp4Key(Di)
    q, w, pool, rows, n_valid = _score_inputs(rng, 2, T, Hi, Di, 300, 500, dtype)
    keys = np.asarray(pool, np.float32) * np.exp(rng.standard_normal((pool.shape[0], 1)))
    keys[65] = 0.0
    pool = jax.jit(fmt.encode)(jnp.asarray(keys))
    ref = ix.indexer_scores_ref(q, w, pool, rows, n_valid, key_format=fmt)
    out = jax.jit(functools.partial(ix._indexer_scores_gpu, interpret=True, sb=64, n_inner=n_inner,
                                    key_format=fmt))(q, w, pool, rows, n_valid)
    _check_scores(out, ref, tol, tol)


# ---- top-k -----------------------------------------------------------------------------------------------------

def _oracle(x, k):
    x = np.asarray(x, np.float32).reshape(-1, x.shape[-1])
    out = np.full((x.shape[0], k), -1, np.int32)
    for n, row in enumerate(x):
        row = np.where(row == 0, np.float32(0), row)
        order = [i for i in np.lexsort((np.arange(row.size), -row)) if row[i] > -np.inf][:k]
        out[n, :len(order)] = order
    return out


def _tricky_rows(rng, N, S):
    x = rng.standard_normal((N, S)).astype(np.float32)
    x[0, : S // 2] = -np.inf                                   # half padding
    x[1] = np.round(x[1] * 3) / 3                              # heavy ties at every level
    x[2, 50:] = -np.inf                                        # fewer valid than k
    x[3] = 0.0                                                 # all tied, with signed zeros
    x[3, 5:90:3] = -0.0
    x[3, 200:210] = 1.0
    x[4] = -np.inf                                             # nothing valid
    x[5, ::2] = x[5, 1::2]                                     # pairwise ties
    return x


# (6, 1024, 512) and (6, 512, 64): a decode step's short rows, ranked whole by one kernel (tk._rank_rows)
TOPK_CASES = [(6, 1000, 64), (6, 300, 512), (6, 9000, 100), (6, 1024, 512), (6, 512, 64)]


@pytest.mark.parametrize("N,S,k", TOPK_CASES)
def test_topk_reference_tie_rule(rng, N, S, k):
    x = _tricky_rows(rng, N, S)
    got = tk.topk_ref(jnp.asarray(x).reshape(2, 3, S), k)
    assert got.shape == (2, 3, k) and got.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(got).reshape(N, k), _oracle(x, k))


@pytest.mark.parametrize("N,S,k", TOPK_CASES)
def test_topk_gpu_threshold_interpret(rng, N, S, k):
    x = _tricky_rows(rng, N, S)
    got = jax.jit(functools.partial(tk._topk_threshold, k=k, interpret=True))(jnp.asarray(x)[None])
    np.testing.assert_array_equal(np.asarray(got)[0], _oracle(x, k))


def test_topk_short_rows_ranked_whole(rng):
    # every row shape a decode step's short rows take reaches the one-launch rank kernel, at most k valid or not
    S, k = 1024, 512
    assert tk._rank_rows_applies(6, S, k) and not tk._rank_rows_applies(6, 1000, k)
    assert not tk._rank_rows_applies(tk._SORT_ROWS, S, k) and not tk._rank_rows_applies(6, 256, k)
    x = _tricky_rows(rng, 6, S)
    x[5, :] = -np.inf
    x[5, [7, 700, 3]] = [2.0, 2.0, -1.0]                                  # three finite, two tied
    got = jax.jit(functools.partial(tk._rank_rows, k=k, interpret=True))(jnp.asarray(x))
    np.testing.assert_array_equal(np.asarray(got), _oracle(x, k))


def test_topk_gpu_threshold_many_rows_sorts_candidates(rng):
    # from tk._SORT_ROWS rows on, the candidates are ordered by one sort instead of the rank kernel: the tricky rows
    # (ties, padding, an overflowing row) among many ordinary ones
    N, S, k = tk._SORT_ROWS, 1000, 64
    x = rng.standard_normal((N, S)).astype(np.float32)
    x[:6] = _tricky_rows(rng, 6, S)
    got = jax.jit(functools.partial(tk._topk_threshold, k=k, interpret=True))(jnp.asarray(x).reshape(2, N // 2, S))
    np.testing.assert_array_equal(np.asarray(got).reshape(N, k), _oracle(x, k))


def test_topk_candidate_orderings_agree(rng):
    # the rank kernel and the sort order the same candidates alike, garbage past each row's count ignored
    N, cap, k = 5, 256, 64
    vals = np.round(rng.standard_normal((N, cap)) * 4).astype(np.float32) / 4     # ties
    idx = np.stack([rng.permutation(10000)[:cap] for _ in range(N)]).astype(np.int32)
    count = np.array([cap, 100, 30, 0, 64], np.int32)
    want = np.full((N, k), -1, np.int32)
    for n in range(N):
        order = sorted(range(count[n]), key=lambda i: (-vals[n, i], idx[n, i]))[:k]
        want[n, :len(order)] = idx[n, order]
    vals[np.arange(cap)[None, :] >= count[:, None]] = 1e9                         # garbage that would win
    args = (jnp.asarray(vals), jnp.asarray(idx), jnp.asarray(count))
    np.testing.assert_array_equal(np.asarray(tk._sort_candidates(*args, k)), want)
    np.testing.assert_array_equal(np.asarray(tk._rank_scatter(*args, k, interpret=True)), want)


def test_kth_largest_kernel_interpret(rng):
    G, k = 256, 40
    g = rng.standard_normal((6, G)).astype(np.float32)
    g[1, :100] = 0.25                                   # ties across the k-th
    g[2] = np.where(rng.random(G) < 0.5, 0.0, -0.0)     # signed zeros only
    g[3, : G - k] = -np.inf                             # exactly k finite
    g[4, : G - k + 1] = -np.inf                         # k - 1 finite: -inf (take every finite score)
    g[5] = -np.inf
    g[0, :5] = -np.float32(3e38)
    got = np.asarray(jax.jit(functools.partial(tk._kth_largest, kk=k, interpret=True))(jnp.asarray(g)))
    want = np.asarray(lax.top_k(jnp.asarray(g), k)[0][:, k - 1])
    np.testing.assert_array_equal(got, want)


def test_topk_gpu_threshold_both_branches(rng):
    S, k = 20000, 64
    n_groups, cap = tk._threshold_params(S, k)
    # unstructured rows: the candidates fit the buffer (fast path)
    x = rng.standard_normal((3, S)).astype(np.float32)
    xp = tk.pad_last(jnp.asarray(x), -(-S // n_groups) * n_groups, -jnp.inf)
    gmax = jnp.max(xp.reshape(3, -1, n_groups), axis=1)
    tau = tk._kth_largest(gmax, k, interpret=True)
    _, _, count = tk._compact(xp, tau, cap, interpret=True, chunk=n_groups)
    assert np.all(np.asarray(count) <= cap) and np.all(np.asarray(count) >= k)
    got = tk._topk_threshold(jnp.asarray(x)[None], k, interpret=True)
    np.testing.assert_array_equal(np.asarray(got)[0], _oracle(x, k))
    # a row of equal scores overflows the buffer: the exact fallback answers (the k-th score is tau: no bisection)
    x[1] = 0.5
    got = tk._topk_threshold(jnp.asarray(x)[None], k, interpret=True)
    np.testing.assert_array_equal(np.asarray(got)[0], _oracle(x, k))
    # ties at tau under fewer than k larger scores (the lowest-index ties fill the k), and under exactly k - 1 and k
    for above in (20, k - 1, k):
        x[2] = 0.5
        x[2, rng.choice(S, above, replace=False)] = rng.uniform(1, 2, above)
        got = tk._topk_threshold(jnp.asarray(x)[None], k, interpret=True)
        np.testing.assert_array_equal(np.asarray(got)[0], _oracle(x, k))
    # all top-k in one strided group (adversarial for the group maxima): still exact
    x = rng.standard_normal((2, S)).astype(np.float32) - 10
    x[0, 7::n_groups] = np.linspace(5, 6, len(x[0, 7::n_groups]))
    got = tk._topk_threshold(jnp.asarray(x)[None], k, interpret=True)
    np.testing.assert_array_equal(np.asarray(got)[0], _oracle(x, k))


def test_topk_gpu_overflow_with_ties_at_the_kth_above_the_threshold(rng):
    """A row whose candidates overflow the buffer with far more than k scores above tau (the bisection, not the tie
    path) and ties at its k-th score, whose key's lowest bit is set: every one of the 32 passes counts."""
    S, k = 20000, 64
    n_groups, cap = tk._threshold_params(S, k)
    x = rng.standard_normal((1, S)).astype(np.float32) - 10
    hot = np.concatenate([np.arange(g, S, n_groups) for g in (7, 8, 9)])   # three strided groups: > cap scores
    assert len(hot) > cap
    kth = np.nextafter(np.float32(5), np.float32(6))                        # an odd key
    x[0, hot] = 4.0
    x[0, hot[rng.permutation(len(hot))[:100]]] = np.r_[np.full(40, 6.0), np.full(60, kth)].astype(np.float32)
    got = tk._topk_threshold(jnp.asarray(x)[None], k, interpret=True)
    np.testing.assert_array_equal(np.asarray(got)[0], _oracle(x, k))


@pytest.mark.parametrize("N,S,k", TOPK_CASES)
def test_topk_tpu_approx(rng, N, S, k):
    x = _tricky_rows(rng, N, S)
    got = jax.jit(functools.partial(tk._topk_approx, k=k))(jnp.asarray(x)[None])
    np.testing.assert_array_equal(np.asarray(got)[0], _oracle(x, k))
    # a low recall target makes misses likely; the verification must catch them and fall back
    got = jax.jit(functools.partial(tk._topk_approx, k=k, recall_target=0.1))(jnp.asarray(x)[None])
    np.testing.assert_array_equal(np.asarray(got)[0], _oracle(x, k))


def test_topk_public_entry_points(rng):
    x = _tricky_rows(rng, 6, 1000)
    want = _oracle(x, 64)
    np.testing.assert_array_equal(np.asarray(tk.topk(jnp.asarray(x)[None], 64))[0], want)
    np.testing.assert_array_equal(np.asarray(tk.topk(jnp.asarray(x)[None], 64, interpret=True))[0], want)


def test_indexer_topk_impls_agree(rng):
    # 16 indexer heads (CONVENTIONS: parity tests use >= 16); compare both impls with the oracle on the
    # reference scores, accepting a difference only at a k-th/(k+1)-th near-tie (within 1e-6 relative).
    args = _score_inputs(rng, 2, 2, 16, 32, 300, 500, jnp.float32)
    k = 40
    scores = np.asarray(ix.indexer_scores_ref(*args))
    want = _oracle(scores, k).reshape(2, 2, k)
    for impl in ("xla", "pallas"):
        got = np.asarray(ix.indexer_topk(*args, k, impl=impl, interpret=(impl == "pallas")))
        for b in range(2):
            for t in range(2):
                if not np.array_equal(got[b, t], want[b, t]):
                    srt = np.sort(scores[b, t][np.isfinite(scores[b, t])])[::-1]
                    assert len(srt) > k and abs(srt[k - 1] - srt[k]) <= 1e-6 * abs(srt[k - 1]), (impl, b, t)


# ---- lowering --------------------------------------------------------------------------------------------------

def _score_shapes(B, T, Hi, Di, S, R, dt):
    A = jax.ShapeDtypeStruct
    return (A((B, T, Hi, Di), dt), A((B, T, Hi), jnp.float32), A((R, Di), dt), A((B, S), jnp.int32),
            A((B, T), jnp.int32))


@pytest.mark.parametrize("shape", [(4, 1, 64, 128, 32768, 1 << 20, jnp.bfloat16),
                                   (2, 11, 16, 32, 300, 500, jnp.float32)])
def test_scores_lower_for_tpu_and_cuda(shape):
    exp = _compat.export_for_tpu(ix._indexer_scores_tpu, *_score_shapes(*shape))
    assert "tpu_custom_call" in exp.mlir_module()
    assert "triton" in _compat.lower_for_cuda(ix._indexer_scores_gpu, *_score_shapes(*shape))


def test_fp4_keys_take_the_triton_kernel_on_gpu(monkeypatch):
    """The public entry, as it dispatches on a GPU, runs the Triton kernel on an FP4 key pool at Flash decode shapes
    (lowered for CUDA here, the pool passed in place), not the reference."""
    from pallas_kernels import kv_format
    fmt = kv_format.Fp4Key(128)
    A = jax.ShapeDtypeStruct
    monkeypatch.setattr(_compat, "backend", lambda: "gpu")
    txt = _compat.lower_for_cuda(functools.partial(ix.indexer_scores, key_format=fmt), A((4, 1, 64, 128), jnp.bfloat16),
                                 A((4, 1, 64), jnp.float32), A((1 << 20, fmt.nbytes), jnp.uint8),
                                 A((4, 32768), jnp.int32), A((4, 1), jnp.int32))
    call = next(line for line in txt.splitlines() if "xla.gpu.triton" in line)
    assert "v4_indexer_scores_gpu" in call and "stablehlo.gather" not in txt
    assert "%arg2" in call.split("triton(", 1)[1].split(")", 1)[0].split(", ")   # the key bytes as they are


def test_topk_lowers_for_tpu_and_cuda(monkeypatch):
    a = jax.ShapeDtypeStruct((64, 1, 262144), jnp.float32)
    assert "triton" in _compat.lower_for_cuda(functools.partial(tk._topk_threshold, k=512), a)
    _compat.export_for_tpu(functools.partial(tk._topk_approx, k=512), a)
    _compat.export_for_tpu(functools.partial(tk.topk_ref, k=512), a)
    monkeypatch.setattr(_compat, "backend", lambda: "tpu")   # the public entry as it dispatches on a TPU
    _compat.export_for_tpu(functools.partial(ix.indexer_topk, k=512, impl="pallas"),
                           *_score_shapes(4, 1, 64, 128, 32768, 1 << 20, jnp.bfloat16))
