"""GPU-specific kernels (Pallas Triton) compiled and run on a real GPU, against the references.

Run on the device machine:  python -m pytest -q -m gpu tests/test_kernels_gpu.py
(Correctness only; timing is `v4jax bench kernels`.)
"""
import functools
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import _compat
from pallas_kernels import compressor as C
from pallas_kernels import compressor_gpu as CG
from pallas_kernels import indexer as IX
from v4jax.model import layers as L
TK = importlib.import_module("pallas_kernels.topk")

SA = importlib.import_module("pallas_kernels.sparse_attention")

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(_compat.backend() != "gpu", reason="needs a GPU")]


def _close(out, ref, tol):
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    assert not np.any(np.isnan(out))
    np.testing.assert_array_equal(np.isinf(out), np.isinf(ref))
    fin = np.isfinite(ref)
    np.testing.assert_allclose(out[fin], ref[fin], rtol=tol, atol=tol)


@pytest.mark.parametrize("B,T,H,D,W,K,dtype,n_split", [
    (3, 2, 20, 64, 40, 70, jnp.float32, None),
    (4, 1, 64, 512, 128, 512, jnp.bfloat16, None),
    (1, 1, 64, 512, 128, 512, jnp.bfloat16, None),        # few programs: split-K path
    (32, 1, 64, 512, 128, 512, jnp.bfloat16, 1),
])
def test_sparse_attention_gpu(B, T, H, D, W, K, dtype, n_split):
    ks = jax.random.split(jax.random.key(0), 8)
    R1, R2 = B * W, B * 4 * K
    q = jax.random.normal(ks[0], (B, T, H, D), dtype)
    swa = jax.random.normal(ks[1], (R1, D), dtype)
    cmp = jax.random.normal(ks[2], (R2, D), dtype)
    rw = jax.random.randint(ks[3], (B, T, W), -1, R1).astype(jnp.int32)
    rc = jax.random.randint(ks[4], (B, T, K), -1, R2).astype(jnp.int32)
    sink = jax.random.normal(ks[5], (H,), jnp.float32)
    args = (q, swa, rw, cmp, rc, sink)
    ref = SA.sparse_attention_ref(*args, scale=D ** -0.5)
    out = jax.jit(functools.partial(SA._sparse_attention_gpu, scale=D ** -0.5, n_split=n_split))(*args)
    _close(out.astype(jnp.float32), ref.astype(jnp.float32), 1e-5 if dtype == jnp.float32 else 2e-2)
    pub = jax.jit(functools.partial(SA.sparse_attention, scale=D ** -0.5))(*args)
    _close(pub.astype(jnp.float32), ref.astype(jnp.float32), 1e-5 if dtype == jnp.float32 else 2e-2)


@pytest.mark.parametrize("B,T,K,hca", [(1, 1, 512, False), (32, 1, 512, False), (4, 1, 1024, True),
                                       (2, 3, 40, False)])
def test_sparse_attention_fp8_entries_gpu(B, T, K, hca):
    """What a GPU runs on FP8 entries (the gathered rows decoded, then the bf16 pools' kernel) against the
    reference on the same bytes; past DECODED_GATHER_BYTES the reference itself."""
    from pallas_kernels import kv_format
    H, D, W = 64, 512, 128
    fmt = kv_format.Fp8Entry(D, 64)
    ks = jax.random.split(jax.random.key(7), 8)
    R1, R2 = B * W, B * 4 * K
    q = jax.random.normal(ks[0], (B, T, H, D), jnp.bfloat16)
    swa, cmp = _byte_pool(ks[1], fmt, R1), _byte_pool(ks[2], fmt, R2)
    rw = jax.random.randint(ks[3], (B, T, W), -1, R1).astype(jnp.int32)
    rc = jax.random.randint(ks[4], (B, T, K), -1, R2).astype(jnp.int32)
    if hca:   # every row before the -1s (valid_prefix)
        rc = jnp.broadcast_to(jnp.where(jnp.arange(K) < K - 100, jnp.arange(K) + 3, -1), (B, T, K)).astype(jnp.int32)
    sink = jax.random.normal(ks[5], (H,), jnp.float32)
    args = (q, swa, rw, cmp, rc, sink)
    ref = SA.sparse_attention_ref(*args, scale=D ** -0.5, entry_format=fmt).astype(jnp.float32)
    out = jax.jit(functools.partial(SA.sparse_attention, scale=D ** -0.5, entry_format=fmt, valid_prefix=hca))(*args)
    _close(out.astype(jnp.float32), ref, 2e-2)


@pytest.mark.parametrize("B,T,Hi,Di,S,dtype", [(2, 3, 16, 32, 300, jnp.float32), (4, 1, 64, 128, 8192, jnp.bfloat16),
                                               (1, 20, 64, 128, 1000, jnp.bfloat16)])
def test_indexer_scores_gpu(B, T, Hi, Di, S, dtype):
    ks = jax.random.split(jax.random.key(1), 8)
    R = B * S
    q = jax.random.normal(ks[0], (B, T, Hi, Di), dtype)
    w = jax.random.normal(ks[1], (B, T, Hi), jnp.float32) * Hi ** -0.5
    pool = jax.random.normal(ks[2], (R, Di), dtype)
    rows = jax.random.randint(ks[3], (B, S), -1, R).astype(jnp.int32)
    n_valid = jax.random.randint(ks[4], (B, T), 0, S + 1).astype(jnp.int32)
    args = (q, w, pool, rows, n_valid)
    ref = IX.indexer_scores_ref(*args)
    _close(jax.jit(IX._indexer_scores_gpu)(*args), ref, 1e-4 if dtype == jnp.float32 else 1e-3)
    _close(jax.jit(IX.indexer_scores)(*args), ref, 1e-4 if dtype == jnp.float32 else 1e-3)


def _byte_pool(key, fmt, rows):
    """A pool of `rows` entries in the byte format fmt, from normal values times 1/16 .. 1 by row (their ue8m0 scales
    differ)."""
    kx, km = jax.random.split(key)
    x = jax.random.normal(kx, (rows, fmt.dim), jnp.float32) * jnp.exp2(jax.random.randint(km, (rows, 1), -4, 1))
    return jax.jit(fmt.encode)(x)


@pytest.mark.parametrize("B,T,Hi,S,dtype", [(1, 1, 64, 32768, jnp.bfloat16), (32, 1, 64, 8192, jnp.bfloat16),
                                            (1, 20, 64, 1000, jnp.bfloat16), (2, 3, 16, 300, jnp.float32)])
def test_indexer_scores_fp4_gpu(B, T, Hi, S, dtype):
    """The Triton kernel on FP4 keys (68 bytes a key, decoded in registers) and the public entry on GPU against the
    reference reading the same bytes."""
    from pallas_kernels import kv_format
    fmt = kv_format.Fp4Key(128)
    ks = jax.random.split(jax.random.key(4), 8)
    R = B * S
    q = jax.random.normal(ks[0], (B, T, Hi, 128), dtype)
    w = jax.random.normal(ks[1], (B, T, Hi), jnp.float32) * Hi ** -0.5
    pool = _byte_pool(ks[2], fmt, R)
    rows = jax.random.randint(ks[3], (B, S), -1, R).astype(jnp.int32)
    n_valid = jax.random.randint(ks[4], (B, T), 0, S + 1).astype(jnp.int32)
    args = (q, w, pool, rows, n_valid)
    ref = IX.indexer_scores_ref(*args, key_format=fmt)
    tol = 1e-4 if dtype == jnp.float32 else 1e-3
    _close(jax.jit(functools.partial(IX._indexer_scores_gpu, key_format=fmt))(*args), ref, tol)
    _close(jax.jit(functools.partial(IX.indexer_scores, key_format=fmt))(*args), ref, tol)


@pytest.mark.parametrize("N,S,k", [(1, 262144, 512), (64, 262144, 512), (8, 9000, 100), (4, 300, 512), (4, 1024, 512),
                                   (32, 4096, 512)])
def test_topk_gpu(N, S, k):
    x = np.array(jax.random.normal(jax.random.key(2), (N, 1, S), jnp.float32))
    x[0, 0, : S // 2] = -np.inf
    if N > 2:
        x[1, 0] = np.round(x[1, 0] * 3) / 3
        x[2, 0] = 0.5                                   # overflows the candidate buffer -> exact fallback
    xs = jnp.asarray(x)
    want = np.asarray(TK.topk_ref(xs, k))
    np.testing.assert_array_equal(np.asarray(jax.jit(functools.partial(TK._topk_threshold, k=k))(xs)), want)
    np.testing.assert_array_equal(np.asarray(jax.jit(functools.partial(TK.topk, k=k))(xs)), want)


@pytest.mark.parametrize("m,ov,d,Dm,B", [(4, True, 512, 4096, 64), (128, False, 512, 4096, 33), (4, True, 128, 256, 5)])
def test_compressor_decode_gpu(m, ov, d, Dm, B):
    coff = 2 if ov else 1
    ks = jax.random.split(jax.random.key(3), 10)
    x = jax.random.normal(ks[0], (B, Dm), jnp.bfloat16)
    wkv = (jax.random.normal(ks[1], (coff * d, Dm)) * Dm ** -0.5).astype(jnp.bfloat16)
    wg = (jax.random.normal(ks[2], (coff * d, Dm)) * Dm ** -0.5).astype(jnp.bfloat16)
    ape = jax.random.normal(ks[3], (m, coff * d)) * 0.1
    norm_w = 1 + 0.1 * jax.random.normal(ks[4], (d,))
    kv = jax.random.normal(ks[5], (B, coff * m, coff * d))
    sc = jax.random.normal(ks[6], (B, coff * m, coff * d))
    pos = jax.random.randint(ks[7], (B,), -2, 10 * m).astype(jnp.int32)
    cs = (jnp.cos(jnp.ones((B, 32))), jnp.sin(jnp.ones((B, 32))))
    kw = dict(ratio=m, overlap=ov, eps=1e-6)
    ref = jax.jit(functools.partial(C.compressor_decode_ref, **kw))(x, pos, kv, sc, wkv, wg, ape, norm_w, cs)
    for f in (CG.compressor_decode_gpu, C.compressor_decode):
        out = jax.jit(functools.partial(f, **kw))(x, pos, kv, sc, wkv, wg, ape, norm_w, cs)
        np.testing.assert_array_equal(np.asarray(out[1]), np.asarray(ref[1]))
        for o, r in zip((out[0], out[2], out[3]), (ref[0], ref[2], ref[3])):
            _close(o, r, 1e-4)
    # on a stack of two layers' states, updated in place at layer 1 (the engine's decode form)
    kv2, sc2 = jnp.stack([sc, kv]), jnp.stack([kv, sc])
    out = jax.jit(functools.partial(CG.compressor_decode_gpu, layer=jnp.int32(1), **kw))(
        x, pos, kv2, sc2, wkv, wg, ape, norm_w, cs)
    np.testing.assert_array_equal(np.asarray(out[1]), np.asarray(ref[1]))
    for o, r in zip((out[0], out[2][1], out[3][1], out[2][0], out[3][0]), (ref[0], ref[2], ref[3], sc, kv)):
        _close(o, r, 1e-4)


@pytest.mark.parametrize("shape", [(1, 1), (32, 1), (3, 300)])
def test_hc_weights_gpu(shape):
    SK = importlib.import_module("pallas_kernels.sinkhorn")
    k = jax.random.split(jax.random.key(0), 4)
    dot = 2.0 * jax.random.normal(k[0], (*shape, 24))
    ssq = 16384 * jnp.exp(0.3 * jax.random.normal(k[1], (*shape, 1)))
    scale, base = jax.random.normal(k[2], (2, 3)), jax.random.normal(k[3], (2, 24))  # stacks of 2 layers
    got = jax.jit(lambda d, q, s, b: SK.hc_weights(d, q, 16384, 1e-6, s, b, 4, 20, 1e-6, jnp.int32(1)))(dot, ssq,
                                                                                                        scale, base)
    for g, r in zip(got, L.hc_weights(dot, ssq, 16384, 1e-6, scale[1], base[1], 4, 20, 1e-6)):
        _close(g, r, 1e-5)


@pytest.mark.parametrize("M,k,E,I,D", [(1, 6, 16, 2048, 4096), (5, 6, 64, 2048, 4096), (32, 6, 16, 2048, 4096),
                                       (3, 2, 8, 32, 64)])
def test_routed_experts_gpu(M, k, E, I, D):
    X = importlib.import_module("pallas_kernels.experts")
    ks = jax.random.split(jax.random.key(0), 6)
    x = jax.random.normal(ks[0], (M, D), jnp.bfloat16)
    w1, w3 = (0.05 * jax.random.normal(kk, (E, I, D), jnp.bfloat16) for kk in ks[1:3])
    w2 = 0.05 * jax.random.normal(ks[3], (E, D, I), jnp.bfloat16)
    ex = jax.random.randint(ks[4], (M, k), 0, E).at[0, 1].set(0).at[0, 0].set(0)  # a repeated expert
    wt = jax.random.uniform(ks[5], (M, k))
    out = jax.jit(lambda *a: X.routed_experts(*a, 10.0))(x, wt, ex, w1, w2, w3)
    # the hidden activation is rounded to bf16 in both, from f32 sums taken in different orders: an element of h
    # that rounds the other way moves outputs by ~1e-3 of their scale, so the bound is relative to the scale
    ref = np.asarray(L.routed_experts(x, wt, ex, w1, w2, w3, 10.0, form="gather"), np.float64)
    assert np.max(np.abs(np.asarray(out, np.float64) - ref)) <= 1e-2 * np.max(np.abs(ref))


@pytest.mark.slow   # up to 40 GB of weights per case: python -m pytest -q -m "gpu and slow" tests/test_kernels_gpu.py
@pytest.mark.parametrize("n,layer,M,E,dup", [(1, 0, 5, 256, False), (1, 0, 5, 255, False), (1, 0, 5, 256, True),
                                             (3, 2, 4, 256, False), (20, 19, 32, 16, False)])
def test_routed_experts_gpu_large_stacks(n, layer, M, E, dup):
  """Flash-sized experts in layer stacks at 2**31 elements (32-bit offsets in Pallas' Triton lowering) and past it
  (64-bit), the last expert (the highest offsets) and a repeated expert within a token."""
  X = importlib.import_module("pallas_kernels.experts")
  k, I, D = 6, 2048, 4096
  ks = jax.random.split(jax.random.key(0), 6)
  x = jax.random.normal(ks[0], (M, D), jnp.bfloat16)
  w1, w3 = (0.05 * jax.random.normal(kk, (n, E, I, D), jnp.bfloat16) for kk in ks[1:3])
  w2 = 0.05 * jax.random.normal(ks[3], (n, E, D, I), jnp.bfloat16)
  if dup:
    ex = jax.random.randint(ks[4], (M, k), 0, E).at[0, 1].set(0).at[0, 0].set(0)
  else:
    ex = jax.vmap(lambda kk: jax.random.permutation(kk, E)[:k])(jax.random.split(ks[4], M))
  ex = ex.at[M - 1, 0].set(E - 1)
  wt = jax.random.uniform(ks[5], (M, k))
  out = np.asarray(jax.jit(lambda *a: X.routed_experts(*a, 10.0, layer=jnp.int32(layer)))(x, wt, ex, w1, w2, w3),
                   np.float64)
  ref = np.asarray(jax.jit(lambda *a: X.routed_experts_ref(*a, 10.0))(x, wt, ex, w1[layer], w2[layer], w3[layer]),
                   np.float64)
  assert np.all(np.abs(out - ref) <= 2e-2 + 2e-2 * np.abs(ref))


@pytest.mark.parametrize("M,O,D,G,n", [(1, 1024, 4096, 1, 4), (32, 512, 4096, 1, 4), (1, 32768, 1024, 1, 2),
                                       (32, 8192, 4096, 8, 3), (1, 8192, 4096, 8, 3),
                                       (5, 48, 64, 1, 1)])
def test_layer_linear_gpu(M, O, D, G, n):
    LL = importlib.import_module("pallas_kernels.layer_linear")
    kx, kw = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, (M, G, D) if G > 1 else (M, D), jnp.bfloat16)
    w = jax.random.normal(kw, (n, O, D), jnp.bfloat16) * D ** -0.5
    out = jax.jit(lambda x, w, i: LL.layer_linear(x, w, i, groups=G))(x, w, jnp.int32(n - 1))
    wl = w[n - 1].reshape(G, O // G, D).astype(jnp.float32)
    ref = jnp.einsum("mgd,grd->mgr", x.reshape(M, G, D).astype(jnp.float32), wl, precision="highest")
    _close(out.reshape(ref.shape), ref, 1e-4)  # bf16 products are exact in f32; only the summation order differs


@pytest.mark.parametrize("M,outs", [(1, (1024, 512, 1024, 1024, 256, 256)), (32, (2048, 2048))])
def test_layer_linears_gpu(M, outs):
    # a CSA layer's projections of its attention input, the shared expert's w1 / w3: one launch, each weight's rows
    LL = importlib.import_module("pallas_kernels.layer_linear")
    kx, *kw = jax.random.split(jax.random.key(1), len(outs) + 1)
    x = jax.random.normal(kx, (M, 4096), jnp.bfloat16)
    ws = [jax.random.normal(k, (3, o, 4096), jnp.bfloat16) * 4096 ** -0.5 for k, o in zip(kw, outs)]
    ys = jax.jit(lambda x, ws, i: LL.layer_linears(x, ws, i))(x, ws, jnp.int32(2))
    for y, w in zip(ys, ws):
        ref = jnp.einsum("md,od->mo", x.astype(jnp.float32), w[2].astype(jnp.float32), precision="highest")
        _close(y, ref, 1e-4)


@pytest.mark.parametrize("M,outs", [(1, (1024, 512)), (32, (2048, 2048))])
def test_layer_linears_fp8_gpu(M, outs):
    # the release's FP8 wq_a / wkv and shared w1 / w3: one launch, each weight's scale stack read at the layer, x
    # rounded to FP8 in the kernel
    from v4jax.model import quant
    LL = importlib.import_module("pallas_kernels.layer_linear")
    kx, *kw = jax.random.split(jax.random.key(4), len(outs) + 1)
    x = jax.random.normal(kx, (M, 4096), jnp.float32).astype(jnp.bfloat16)
    ws = [quant.Quantized(*quant.quantize(jax.random.normal(k, (3, o, 4096), jnp.float32) * 4096 ** -0.5, "fp8"),
                          "fp8") for k, o in zip(kw, outs)]
    ys = jax.jit(lambda x, vs, ss, i: LL.layer_linears(x, vs, i, scales=ss, act_quant=True))(
        x, [w.values for w in ws], [w.scale for w in ws], jnp.int32(2))
    xq = quant.fp8_roundtrip(x, 128).astype(jnp.float32)
    for y, w in zip(ys, ws):
        ref = jnp.einsum("md,od->mo", xq, w[2].astype(jnp.float32), precision="highest")
        _close(y, ref, 1e-4)


@pytest.mark.parametrize("M", [1, 37, 8192])
def test_hc_post_gpu(M):
    # mHC's expansion: decode batches (one token; 37, past a block) and a prefill chunk, bf16 as in the model
    HP = importlib.import_module("pallas_kernels.hc_post")
    k = jax.random.split(jax.random.key(2), 4)
    f = jax.random.normal(k[0], (M, 4096), jnp.bfloat16)
    x = jax.random.normal(k[1], (M, 4, 4096), jnp.bfloat16)
    post = 2 * jax.nn.sigmoid(jax.random.normal(k[2], (M, 4)))
    comb = jax.nn.softmax(jax.random.normal(k[3], (M, 4, 4)), axis=-1)
    out = np.asarray(jax.jit(HP.hc_post)(f, x, post, comb), np.float32)
    ref = np.asarray(jax.jit(L.hc_post)(f, x, post, comb), np.float32)
    assert np.mean(out == ref) > 0.99  # the sum over j in another order: one bf16 ulp at a rounding boundary
    np.testing.assert_allclose(out, ref, rtol=2 ** -7, atol=2 ** -7)


@pytest.mark.parametrize("M", [1, 32])
def test_hc_post_partial_sums_gpu(M):
    # the attention output as wo_b's f32 partial sums (4 splits), added and rounded to bf16 in the kernel
    HP = importlib.import_module("pallas_kernels.hc_post")
    k = jax.random.split(jax.random.key(4), 4)
    parts = jax.random.normal(k[0], (4, M, 4096), jnp.float32)
    x = jax.random.normal(k[1], (M, 4, 4096), jnp.bfloat16)
    post = 2 * jax.nn.sigmoid(jax.random.normal(k[2], (M, 4)))
    comb = jax.nn.softmax(jax.random.normal(k[3], (M, 4, 4)), axis=-1)
    out = np.asarray(jax.jit(HP.hc_post)(parts, x, post, comb), np.float32)
    f = (((parts[0] + parts[1]) + parts[2]) + parts[3]).astype(jnp.bfloat16)  # the kernel's order
    np.testing.assert_array_equal(out, np.asarray(jax.jit(HP.hc_post)(f, x, post, comb), np.float32))


@pytest.mark.parametrize("M", [1, 32, 64])
def test_hc_collapse_gpu(M):
    # mHC's collapse and the next sublayer's norm at decode batches, bf16 as in the model, the weight of layer 5 of a
    # stack of 43
    HP = importlib.import_module("pallas_kernels.hc_post")
    k = jax.random.split(jax.random.key(3), 3)
    pre = jax.nn.sigmoid(jax.random.normal(k[0], (M, 4))) + 1e-6
    x = jax.random.normal(k[1], (M, 4, 4096), jnp.bfloat16)
    w = 1 + 0.1 * jax.random.normal(k[2], (43, 4096))
    out = np.asarray(jax.jit(lambda *a: HP.collapse_norm(*a, 1e-6, jnp.int32(5)))(pre, x, w), np.float32)
    ref = np.asarray(jax.jit(lambda p, x, w: L.rms_norm(L.collapse(p, x), w[5], 1e-6))(pre, x, w), np.float32)
    assert np.mean(out == ref) > 0.99  # the f32 sums in another order: one bf16 ulp at a rounding boundary
    np.testing.assert_allclose(out, ref, rtol=2 ** -7, atol=2 ** -7)


@pytest.mark.parametrize("M,k,E,I,D", [(1024, 6, 16, 512, 1024), (2000, 6, 16, 2048, 4096)])
def test_grouped_experts_gpu(M, k, E, I, D):
    XG = importlib.import_module("pallas_kernels.experts_grouped")
    ks = jax.random.split(jax.random.key(0), 6)
    x = jax.random.normal(ks[0], (M, D), jnp.bfloat16)
    w1, w3 = (0.05 * jax.random.normal(kk, (2, E, I, D), jnp.bfloat16) for kk in ks[1:3])
    w2 = 0.05 * jax.random.normal(ks[3], (2, E, D, I), jnp.bfloat16)
    # skewed routing (some experts get many rows, some none): group boundaries inside the kernel's row tiles
    wt, ex = jax.lax.top_k(jax.random.normal(ks[4], (M, E)) + 3.0 * jax.random.normal(ks[5], (E,)), k)
    wt = jax.nn.softmax(wt)
    assert XG.supported(x, w1)
    out = jax.jit(lambda *a: XG.routed_experts(*a, 10.0, layer=1))(x, wt, ex, w1, w2, w3)
    # the dense form as the reference (the gather form's [M, k, I, D] weights would need 190 GB here)
    ref = np.asarray(jax.jit(lambda *a: L.routed_experts(*a, 10.0, form="dense"))(x, wt, ex, w1[1], w2[1], w3[1]),
                     np.float64)
    # the kernel rounds its matmul outputs to bf16 (h1, h3 and each expert's output): ~1e-2 of the scale
    assert np.max(np.abs(np.asarray(out, np.float64) - ref)) <= 2e-2 * np.max(np.abs(ref))


def test_grouped_experts_as_stored_gpu():
    """A prefill chunk through FP4 experts as stored with the release's rounding: the pallas ops widen the layer's
    experts and take the grouped matmul; the XLA form (every expert over every token) as the reference."""
    from v4jax.model import ops, quant
    M, k, E, I, D = 1024, 6, 16, 256, 512
    ks = jax.random.split(jax.random.key(3), 6)
    x = quant.fp8_roundtrip(jax.random.normal(ks[0], (M, D), jnp.float32), 128).astype(jnp.bfloat16)
    w1, w3 = (quant.Quantized(*quant.quantize(0.05 * jax.random.normal(kk, (2, E, I, D)), "fp4"), "fp4")
              for kk in ks[1:3])
    w2 = quant.Quantized(*quant.quantize(0.05 * jax.random.normal(ks[3], (2, E, D, I)), "fp4"), "fp4")
    wt, ex = jax.lax.top_k(jax.random.normal(ks[4], (M, E)) + 3.0 * jax.random.normal(ks[5], (E,)), k)
    wt = jax.nn.softmax(wt)
    out = jax.jit(lambda *a: ops.OPS["pallas"].experts(*a, 10.0, 1, act_quant=True))(x, wt, ex, w1, w2, w3)
    ref = jax.jit(lambda *a: ops.OPS["xla"].experts(*a, 10.0, 1, "dense", act_quant=True))(x, wt, ex, w1, w2, w3)
    ref = np.asarray(ref, np.float64)
    assert np.max(np.abs(np.asarray(out, np.float64) - ref)) <= 2e-2 * np.max(np.abs(ref))


@pytest.mark.parametrize("M,O,D,G,n,act_quant", [(1, 1024, 4096, 1, 4, False), (32, 512, 4096, 1, 4, False),
                                                 (1, 8192, 4096, 8, 3, False), (32, 8192, 4096, 8, 3, False),
                                                 (1, 1024, 4096, 1, 4, True), (32, 512, 4096, 1, 4, True)])
def test_layer_linear_fp8_gpu(M, O, D, G, n, act_quant):
    """e4m3 stacks with 128x128 ue8m0 scales as stored (widened in registers): the dequantized matmul's sums; with
    act_quant the kernel rounds x to FP8 itself (Triton's f32 -> e4m3 conversion), as quant.fp8_roundtrip does."""
    from v4jax.model import quant
    LL = importlib.import_module("pallas_kernels.layer_linear")
    kx, kw, km = jax.random.split(jax.random.key(2), 3)
    x = jax.random.normal(kx, (M, G, D) if G > 1 else (M, D), jnp.float32)
    x = x * jnp.repeat(jnp.exp2(jax.random.randint(km, (*x.shape[:-1], D // 128), -3, 4).astype(jnp.float32)),
                       128, -1)  # every 128-block its own scale
    xin = x.astype(jnp.bfloat16) if act_quant else None
    x = quant.fp8_roundtrip(xin if act_quant else x, 128).astype(jnp.float32)
    w = quant.Quantized(*quant.quantize(jax.random.normal(kw, (n, O, D), jnp.float32) * D ** -0.5, "fp8"), "fp8")
    out = jax.jit(lambda x, v, s, i: LL.layer_linear(x, v, i, groups=G, scale=s[i], act_quant=act_quant))(
        xin if act_quant else x.astype(jnp.bfloat16), w.values, w.scale, jnp.int32(n - 1))
    wl = w[n - 1].astype(jnp.float32).reshape(G, O // G, D)
    ref = jnp.einsum("mgd,grd->mgr", x.reshape(M, G, D), wl, precision="highest")
    _close(out.reshape(ref.shape), ref, 1e-4)


@pytest.mark.parametrize("M,k,E,I,D,n", [(1, 6, 16, 2048, 4096, 2), (32, 6, 64, 2048, 4096, 1), (3, 2, 8, 64, 128, 1)])
def test_routed_experts_fp4_gpu(M, k, E, I, D, n):
    """FP4 expert stacks as stored, codes decoded in registers: the model's gather form on the dequantized
    weights with the release's rounding (w2's input rounded to FP8: an element that rounds the other way from sums
    taken in another order moves an output by a step of FP8, hence the bound relative to the scale)."""
    from v4jax.model import quant
    X = importlib.import_module("pallas_kernels.experts")
    ks = jax.random.split(jax.random.key(3), 6)
    x = quant.fp8_roundtrip(jax.random.normal(ks[0], (M, D), jnp.float32), 128).astype(jnp.bfloat16)
    store = lambda w: quant.Quantized(*quant.quantize(w, "fp4"), "fp4")
    w1, w3 = (store(0.05 * jax.random.normal(kk, (n, E, I, D), jnp.float32)) for kk in ks[1:3])
    w2 = store(0.05 * jax.random.normal(ks[3], (n, E, D, I), jnp.float32))
    ex = jax.vmap(lambda kk: jax.random.permutation(kk, E)[:k])(jax.random.split(ks[4], M)).astype(jnp.int32)
    wt = jax.random.uniform(ks[5], (M, k))
    w2_input = lambda h, w: quant.fp8_roundtrip((h * w).astype(jnp.bfloat16), 128)
    out = jax.jit(lambda x, wt, ex, a, b, c, i: X.routed_experts_fp4(
        x, wt, ex, (a.values, a.scale), (b.values, b.scale), (c.values, c.scale), 10.0, w2_input, layer=i))(
        x, wt, ex, w1, w2, w3, jnp.int32(n - 1))
    ref = jax.jit(lambda x, wt, ex, a, b, c: L.routed_experts(x, wt, ex, a[n - 1], b[n - 1], c[n - 1], 10.0,
                                                                "gather", act_quant=True))(x, wt, ex, w1, w2, w3)
    ref = np.asarray(ref, np.float64)
    assert np.max(np.abs(np.asarray(out, np.float64) - ref)) <= 2e-2 * np.max(np.abs(ref))
