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


def test_fp8_entries_take_the_reference_on_gpu(monkeypatch):
    """The public entry, as it dispatches on a GPU, runs the XLA reference on FP8 byte pools at Flash decode shapes
    (lowered for CUDA here): no Triton call (a Triton form reading the bytes was measured slower and removed)."""
    from pallas_kernels import kv_format
    fmt = kv_format.Fp8Entry(512, 64)
    S = jax.ShapeDtypeStruct
    shapes = (S((4, 1, 64, 512), jnp.bfloat16), S((4096, fmt.nbytes), jnp.uint8), S((4, 1, 128), jnp.int32),
              S((65536, fmt.nbytes), jnp.uint8), S((4, 1, 512), jnp.int32), S((64,), jnp.float32))
    monkeypatch.setattr(_compat, "backend", lambda: "gpu")
    for kw in (dict(), dict(return_lse=True, valid_prefix=True)):
        txt = _compat.lower_for_cuda(functools.partial(sa.sparse_attention, scale=0.04, entry_format=fmt, **kw),
                                     *shapes)
        assert "triton" not in txt and "stablehlo.gather" in txt


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
