"""Sparse attention kernels: reference vs a float64 numpy transcription of reference §3.6; the TPU-style Pallas
kernel (TPU interpret mode) and the GPU Triton kernel (interpret mode; on float pools and on FP8-entry byte pools)
vs the reference; lowering for TPU (Mosaic) and CUDA (Triton).

Outputs are poisoned: the interpret modes start every output buffer as NaN (TPU interpret: uninitialized
memory = NaN; HLO interpreter: outputs = NaN), and every element is checked (finite and close).
"""
import functools
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import _compat
sa = importlib.import_module("pallas_kernels.sparse_attention")   # (the package attribute is the function)


pytestmark = pytest.mark.usefixtures("single_device")  # TPU interpret mode wants one device


def _np_ref(q, swa, rw, cmp, rc, sink, scale):
    q = np.asarray(q, np.float64)
    B, T, H, D = q.shape
    out = np.zeros((B, T, H, D))
    sets = [(np.asarray(swa, np.float64), np.asarray(rw))]
    if cmp is not None:
        sets.append((np.asarray(cmp, np.float64), np.asarray(rc)))
    for b in range(B):
        for t in range(T):
            ks = np.concatenate([p[r[b, t][r[b, t] >= 0]] for p, r in sets], axis=0)        # [J, D]
            for h in range(H):
                s = scale * ks @ q[b, t, h]
                mx = max(s.max() if len(s) else -np.inf, float(sink[h]))
                e = np.exp(s - mx)
                out[b, t, h] = (e @ ks) / (e.sum() + np.exp(float(sink[h]) - mx))
    return out


def _inputs(rng, B, T, H, D, W, K, R1, R2, dtype):
    q = jnp.asarray(rng.standard_normal((B, T, H, D)), dtype)
    swa = jnp.asarray(rng.standard_normal((R1, D)), dtype)
    cmp = jnp.asarray(rng.standard_normal((R2, D)), dtype)
    rw = rng.integers(0, R1, (B, T, W))
    rc = rng.integers(0, R2, (B, T, K))
    rw[0, 0, : W // 3] = -1                                    # some empty window slots
    rw[-1, -1] = (np.arange(W) + 3) % R1                       # a contiguous run, not tile-aligned
    rc[-1, -1, :32] = (np.arange(32) + 32)[:K]                 # tile-aligned runs (whole-tile DMAs on TPU)
    rc[0, -1] = -1                                             # no compressed entries for one query
    rc[-1, 0, ::3] = -1
    if B > 1:
        rw[1, 0] = -1
        rc[1, 0] = -1                                            # nothing valid at all -> o = 0
    sink = jnp.asarray(rng.standard_normal(H) * 2, jnp.float32)
    return q, swa, jnp.asarray(rw, jnp.int32), cmp, jnp.asarray(rc, jnp.int32), sink


def _check(out, ref, rtol, atol):
    out = np.asarray(out.astype(jnp.float32))
    assert np.all(np.isfinite(out)), "unwritten (NaN-poisoned) or non-finite outputs"
    np.testing.assert_allclose(out, np.asarray(ref, np.float32), rtol=rtol, atol=atol)


def test_reference_matches_numpy(rng):
    args = _inputs(rng, 2, 2, 4, 32, 8, 12, 40, 60, jnp.float32)
    scale = 32 ** -0.5
    ref = sa.sparse_attention_ref(*args, scale=scale)
    np.testing.assert_allclose(np.asarray(ref), _np_ref(*args, scale), rtol=1e-5, atol=1e-6)
    # the all-invalid query gives exactly 0
    assert np.all(np.asarray(ref)[1, 0] == 0)
    # without a compressed set
    q, swa, rw, _, _, sink = args
    ref2 = sa.sparse_attention_ref(q, swa, rw, None, None, sink, scale=scale)
    np.testing.assert_allclose(np.asarray(ref2), _np_ref(q, swa, rw, None, None, sink, scale), rtol=1e-5,
                               atol=1e-6)


def test_reference_t_chunking(rng, monkeypatch):
    args = _inputs(rng, 1, 4, 4, 32, 8, 8, 40, 60, jnp.float32)
    full = sa.sparse_attention_ref(*args, scale=0.2)
    monkeypatch.setattr(sa, "_REF_BYTES_LIMIT", 1 << 12)
    chunked = sa.sparse_attention_ref(*args, scale=0.2)
    np.testing.assert_allclose(np.asarray(chunked), np.asarray(full), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("dtype,tol,K,mode", [(jnp.float32, 1e-5, 150, "tpu"), (jnp.bfloat16, 2e-2, 40, "tpu"),
                                              (jnp.float32, 1e-5, 150, "hlo")])
def test_tpu_kernel_interpret(rng, dtype, tol, K, mode):
    # mode "tpu": TPU interpret mode (simulated DMAs and semaphores, NaN-initialised memory, bounds checks);
    # "hlo": the fast HLO interpreter that interpret=True uses
    B, T, H, D, W = 2, 2, 8, 128, 20                         # K = 150: two compressed chunks of 128 rows
    args = _inputs(rng, B, T, H, D, W, K, 64, 300, dtype)
    scale = D ** -0.5
    ref = sa.sparse_attention_ref(*args, scale=scale)
    out = jax.jit(functools.partial(sa._sparse_attention_tpu, scale=scale, interpret=mode))(*args)
    assert out.dtype == dtype
    _check(out, ref.astype(jnp.float32), rtol=tol, atol=tol)


def test_tpu_kernel_interpret_window_only_and_public_entry(rng):
    q, swa, rw, _, _, sink = _inputs(rng, 1, 3, 4, 128, 16, 1, 50, 1, jnp.float32)
    ref = sa.sparse_attention_ref(q, swa, rw, None, None, sink, scale=0.1)
    out = jax.jit(functools.partial(sa.sparse_attention, scale=0.1, interpret=True))(q, swa, rw, None, None, sink)
    _check(out, ref, 1e-5, 1e-5)


@pytest.mark.parametrize("n_split", [1, 3])
@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
def test_gpu_kernel_interpret(rng, n_split, dtype, tol):
    args = _inputs(rng, 2, 2, 20, 64, 40, 70, 64, 300, dtype)   # H=20: padded to a multiple of 16 heads
    ref = sa.sparse_attention_ref(*args, scale=0.125)
    out = jax.jit(functools.partial(sa._sparse_attention_gpu, scale=0.125, interpret=True, n_split=n_split))(*args)
    _check(out, ref.astype(jnp.float32), rtol=tol, atol=tol)


@pytest.mark.parametrize("n_split", [1, 3])
def test_gpu_kernel_interpret_skip_tail(rng, n_split):
    # HCA-style rows: each query's valid entries a prefix of its row (n_ready), the rest -1; prefixes that end inside
    # a block, on a block's edge, at 0 and at the full width
    q, swa, rw, cmp, _, sink = _inputs(rng, 2, 3, 16, 64, 40, 1, 64, 300, jnp.float32)
    K = 150
    n_ready = np.array([[37, 64, 0], [150, 1, 96]])[..., None]
    rc = jnp.asarray(np.where(np.arange(K) < n_ready, rng.integers(0, 300, (2, 3, K)), -1), jnp.int32)
    ref = sa.sparse_attention_ref(q, swa, rw, cmp, rc, sink, scale=0.125)
    out = jax.jit(functools.partial(sa._sparse_attention_gpu, scale=0.125, interpret=True, n_split=n_split,
                                    block=32, skip_tail=True))(q, swa, rw, cmp, rc, sink)
    _check(out, ref, rtol=1e-5, atol=1e-5)


def _shapes(B, T, H, D, W, K, R1, R2, dt):
    S = jax.ShapeDtypeStruct
    return (S((B, T, H, D), dt), S((R1, D), dt), S((B, T, W), jnp.int32), S((R2, D), dt), S((B, T, K), jnp.int32),
            S((H,), jnp.float32))


@pytest.mark.parametrize("shape", [
    (4, 1, 64, 512, 128, 512, 4096, 65536, jnp.bfloat16),    # Flash decode
    (2, 3, 8, 128, 20, 40, 64, 300, jnp.float32),             # spec-decode T, odd sizes
])
def test_lowers_for_tpu(shape):
    exp = _compat.export_for_tpu(functools.partial(sa._sparse_attention_tpu, scale=0.04), *_shapes(*shape))
    assert "tpu_custom_call" in exp.mlir_module()


@pytest.mark.parametrize("n_split", [None, 4])
def test_lowers_for_cuda_triton(n_split):
    txt = _compat.lower_for_cuda(functools.partial(sa._sparse_attention_gpu, scale=0.04, n_split=n_split),
                                 *_shapes(4, 1, 64, 512, 128, 512, 4096, 65536, jnp.bfloat16))
    assert "triton" in txt


def test_fp8_entries_on_gpu_take_the_triton_kernel_on_decoded_rows(monkeypatch):
    """The public entry, as it dispatches on a GPU at Flash decode shapes (lowered for CUDA here): XLA gathers and
    decodes the FP8 entries, the bf16 pools' Triton kernel reads them; past DECODED_GATHER_BYTES the XLA reference
    alone (no Triton call: a Triton form reading the bytes was measured slower and removed)."""
    from pallas_kernels import kv_format
    fmt = kv_format.Fp8Entry(512, 64)
    S = jax.ShapeDtypeStruct
    shapes = (S((4, 1, 64, 512), jnp.bfloat16), S((4096, fmt.nbytes), jnp.uint8), S((4, 1, 128), jnp.int32),
              S((65536, fmt.nbytes), jnp.uint8), S((4, 1, 512), jnp.int32), S((64,), jnp.float32))
    monkeypatch.setattr(_compat, "backend", lambda: "gpu")
    for limit, triton in ((sa.DECODED_GATHER_BYTES, True), (4 * 640 * 512 * 2 - 1, False)):
        monkeypatch.setattr(sa, "DECODED_GATHER_BYTES", limit)
        for kw in (dict(), dict(return_lse=True, valid_prefix=True)):
            txt = _compat.lower_for_cuda(functools.partial(sa.sparse_attention, scale=0.04, entry_format=fmt, **kw),
                                         *shapes)
            assert ("triton" in txt) == triton and "stablehlo.gather" in txt


@pytest.mark.parametrize("impl", ["ref", "tpu", "gpu"])
def test_partials_over_disjoint_rows_merge_to_one_softmax(rng, impl):
    """return_lse: each implementation's partial softmax over a part of the rows (the sink in one part only) merges,
    by log-sum-exp, into the softmax over all rows: what shards holding disjoint rows do (sharding/context.py)."""
    q, swa, rw, cmp, rc, sink = _inputs(rng, 2, 2, 16, 128, 20, 40, 64, 300, jnp.float32)
    fn = {"ref": sa.sparse_attention_ref,
          "tpu": functools.partial(sa._sparse_attention_tpu, interpret="hlo"),
          "gpu": functools.partial(sa._sparse_attention_gpu, interpret=True, n_split=1)}[impl]
    fn = jax.jit(functools.partial(fn, scale=0.09, return_lse=True))
    ref = sa.sparse_attention_ref(q, swa, rw, cmp, rc, sink, scale=0.09)
    part_w, part_c = rng.integers(0, 2, rw.shape), rng.integers(0, 2, rc.shape)
    part_w[0, 1] = 1                                           # part 0: no window rows for one query
    part_c[0, 1] = 1
    parts = [fn(q, swa, jnp.where(part_w == i, rw, -1), cmp, jnp.where(part_c == i, rc, -1),
                sink if i == 0 else jnp.full_like(sink, -jnp.inf)) for i in (0, 1)]
    (o0, l0), (o1, l1) = [(np.asarray(o, np.float64), np.asarray(lse, np.float64)) for o, lse in parts]
    assert parts[0][0].dtype == jnp.float32 and np.all(np.isfinite(l0))
    m = np.maximum(l0, l1)
    w0, w1 = np.exp(l0 - m), np.where(np.isfinite(l1), np.exp(l1 - m), 0.0)
    merged = (w0[..., None] * o0 + w1[..., None] * o1) / (w0 + w1)[..., None]
    _check(merged, ref, 1e-5, 1e-5)
    assert np.isneginf(l1[1, 0]).all()                         # nothing valid and no sink: lse = -inf


# ---- dense_prefix_attention: an HCA layer's prefill chunk, blocks of consecutive queries --------------------------

def _prefix_inputs(rng, B, T, H, D, W, S, R1, R2, dtype, sink_inf=False):
    """An HCA chunk as the model hands it over: q, the SWA pool, the window union win_rows [B, T + W - 1] (random
    -1s), the compressed pool, hca_rows [B, S] (a -1 inside, as another shard's rows; row 1: a -1 tail past its
    entries, as a page bucket wider than the row's entries), n_ready [B, T] (row 0 rising from 0 to the full
    width S, row 1 not monotone), sink [H]."""
    q = jnp.asarray(rng.standard_normal((B, T, H, D)), dtype)
    swa = jnp.asarray(rng.standard_normal((R1, D)), dtype)
    cmp = jnp.asarray(rng.standard_normal((R2, D)), dtype)
    win = rng.integers(0, R1, (B, T + W - 1))
    win[rng.random(win.shape) < 0.25] = -1
    hca = rng.integers(0, R2, (B, S))
    hca[:, 3] = -1
    nr = np.sort(rng.integers(0, S + 1, (B, T)), axis=1)
    nr[0, :2], nr[0, -1] = 0, S
    if B > 1:
        hca[1, S - S // 3:] = -1
        rng.shuffle(nr[1])
        win[1, :W] = -1                                        # query (1, 0): no window rows ...
        nr[1, 0] = 0                                           # ... and no entries: o = 0 (lse -inf without a sink)
    sink = jnp.asarray(rng.standard_normal(H) * 2, jnp.float32)
    if sink_inf:
        sink = jnp.full((H,), -jnp.inf, jnp.float32)
    return q, swa, jnp.asarray(win, jnp.int32), cmp, jnp.asarray(hca, jnp.int32), jnp.asarray(nr, jnp.int32), sink


@pytest.mark.parametrize("dtype,tol,return_lse,H,kw", [
    (jnp.float32, 1e-5, False, 20, dict(q_block=4, heads=16, block=16)),   # T=11: a partial query block, 2 head blocks
    (jnp.float32, 1e-5, True, 20, dict(q_block=4, heads=8, block=32)),     # 3 head blocks, the last of 4 heads
    (jnp.float32, 1e-5, True, 6, dict(q_block=2, heads=16, block=16)),     # H < heads: hb = 8, tq = 4
    (jnp.bfloat16, 2e-2, False, 20, dict(q_block=4, heads=16, block=16)),
    (jnp.bfloat16, 2e-2, True, 20, dict(q_block=2, heads=16, block=16, pv_split=False)),
])
def test_dense_prefix_kernel_interpret(rng, dtype, tol, return_lse, H, kw):
    W, S = 6, 40
    args = _prefix_inputs(rng, 2, 11, H, 64, W, S, 50, 70, dtype, sink_inf=return_lse and H == 6)
    ref = sa.dense_prefix_attention_ref(*args, scale=0.125, window=W, return_lse=return_lse)
    out = jax.jit(functools.partial(sa.dense_prefix_attention, scale=0.125, window=W, interpret=True,
                                    return_lse=return_lse, **kw))(*args)
    if not return_lse:
        assert out.dtype == dtype
        _check(out, ref.astype(jnp.float32), rtol=tol, atol=tol)
        return
    (o, lse), (ro, rlse) = out, ref
    assert o.dtype == jnp.float32 and lse.shape == args[0].shape[:3]
    _check(o, ro, rtol=tol, atol=tol)
    lse = np.asarray(lse)
    assert not np.any(np.isnan(lse))
    np.testing.assert_allclose(lse, np.asarray(rlse), rtol=tol, atol=tol)     # -inf where the reference's is
    if H == 6:
        assert np.isneginf(lse[1, 0]).all() and np.all(np.asarray(o)[1, 0] == 0)


def test_dense_prefix_rows_are_the_models(rng):
    """dense_prefix_rows builds the per-query rows as the model's Pallas path does for sparse_attention, and its
    reference equals the model's XLA attention (window masked by positions) on the same chunk."""
    from v4jax.model import ops
    B, T, H, D, W, S = 2, 7, 4, 32, 5, 12
    q, swa, win, cmp, hca, nr, sink = _prefix_inputs(rng, B, T, H, D, W, S, 30, 40, jnp.float32)
    start = jnp.array([3, 20])
    win_pos = start[:, None] - (W - 1) + jnp.arange(T + W - 1)[None, :]
    pos = start[:, None] + jnp.arange(T)[None, :]
    win = jnp.where(win_pos >= 0, win, -1)
    xla = ops._attend_xla(q, sink, 0.2, swa, win, win_pos, pos, W, cmp, hca, nr, None)
    ref = sa.dense_prefix_attention_ref(q, swa, win, cmp, hca, nr, sink, scale=0.2, window=W)
    np.testing.assert_allclose(np.asarray(ref), np.asarray(xla), rtol=1e-5, atol=1e-5)


def test_attend_pallas_takes_dense_prefix_on_gpu(rng, monkeypatch):
    """ops._attend_pallas as it dispatches on a GPU: an HCA chunk of >= _PREFIX_MIN_T queries runs
    dense_prefix_attention (interpreted here) and equals the XLA path, with and without the lse; a shorter chunk
    (decode) and FP8 entries keep sparse_attention."""
    from v4jax.model import ops
    B, T, H, D, W, S = 2, 9, 20, 64, 6, 40
    q, swa, win, cmp, hca, nr, sink = _prefix_inputs(rng, B, T, H, D, W, S, 50, 70, jnp.float32)
    win_pos = 100 + jnp.arange(T + W - 1)[None, :].repeat(B, 0)
    pos = win_pos[:, W - 1:]
    calls = []
    kernel = sa.dense_prefix_attention
    monkeypatch.setattr(_compat, "backend", lambda: "gpu")
    monkeypatch.setattr(sa, "_PREFIX_MIN_T", 8)
    monkeypatch.setattr(sa, "dense_prefix_attention",
                        lambda *a, **kw: calls.append(kw) or kernel(*a, interpret=True, block=16, **kw))
    for with_lse in (False, True):
        got = ops._attend_pallas(q, sink, 0.125, swa, win, win_pos, pos, W, cmp, hca, nr, None, with_lse=with_lse)
        want = ops._attend_xla(q, sink, 0.125, swa, win, win_pos, pos, W, cmp, hca, nr, None, with_lse=with_lse)
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            _check(g, w, rtol=1e-5, atol=1e-5)
    assert [kw["return_lse"] for kw in calls] == [False, True]
    from pallas_kernels import kv_format
    assert not sa.dense_prefix_applies(q[:, :4], swa, cmp)                       # decode-sized T
    assert not sa.dense_prefix_applies(q, swa, cmp, kv_format.Fp8Entry(64, 32))  # FP8 entries
    monkeypatch.setattr(_compat, "backend", lambda: "cpu")
    assert not sa.dense_prefix_applies(q, swa, cmp)


@pytest.mark.parametrize("return_lse", [False, True])
def test_dense_prefix_lowers_for_cuda_triton(return_lse):
    """The kernel lowers for CUDA at an HCA layer's shapes: the last 8192-token chunk of a 128K prompt."""
    S = jax.ShapeDtypeStruct
    B, T, H, D, W = 1, 8192, 64, 512, 128
    shapes = (S((B, T, H, D), jnp.bfloat16), S((131072, D), jnp.bfloat16), S((B, T + W - 1), jnp.int32),
              S((1024, D), jnp.bfloat16), S((B, 1024), jnp.int32), S((B, T), jnp.int32), S((H,), jnp.float32))
    txt = _compat.lower_for_cuda(functools.partial(sa.dense_prefix_attention, scale=0.04, window=W,
                                                   return_lse=return_lse), *shapes)
    assert "triton" in txt
