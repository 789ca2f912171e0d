"""Compressor kernels (reference §3.4, §4.2).

* decode reference vs a per-token numpy transcription of §4.2 (official semantics);
* prefill reference == running the decode reference token by token, across chunk boundaries at any alignment,
  with padding tokens, inactive slots, and chunks shorter than a window;
* TPU-style Pallas decode / prefill (TPU interpret mode: outputs and scratch start NaN-poisoned) and the GPU
  Triton decode (interpret) vs the references, every element of entries and states compared;
* lowering for TPU (Mosaic) and CUDA (Triton) at Flash sizes (Dm 4096; d 512 CSA/HCA, d 128 indexer).
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import _compat
from pallas_kernels import compressor as C
from pallas_kernels import compressor_gpu as CG

EPS = 1e-6


pytestmark = pytest.mark.usefixtures("single_device")  # TPU interpret mode wants one device


def _weights(rng, m, overlap, d, Dm, wdtype=jnp.float32):
    coff = 2 if overlap else 1
    return dict(wkv=jnp.asarray(rng.standard_normal((coff * d, Dm)) * 0.2, wdtype),
                wgate=jnp.asarray(rng.standard_normal((coff * d, Dm)) * 0.2, wdtype),
                ape=jnp.asarray(rng.standard_normal((m, coff * d)) * 0.5, jnp.float32),
                norm_w=jnp.asarray(1 + 0.1 * rng.standard_normal(d), jnp.float32))


def _fresh_state(B, m, overlap, d):
    coff = 2 if overlap else 1
    return (jnp.zeros((B, coff * m, coff * d), jnp.float32),
            jnp.full((B, coff * m, coff * d), -jnp.inf, jnp.float32))


def _rope(pos, rd):
    inv = 1.0 / (10000.0 ** (np.arange(0, rd, 2) / rd))
    ang = np.asarray(pos, np.float64)[..., None] * inv
    return jnp.asarray(np.cos(ang), jnp.float32), jnp.asarray(np.sin(ang), jnp.float32)


def _close(a, b, tol):
    a, b = np.asarray(a), np.asarray(b)
    assert not np.any(np.isnan(a)), "NaN (unwritten) values"
    np.testing.assert_array_equal(np.isneginf(a), np.isneginf(b))
    fin = np.isfinite(b)
    np.testing.assert_allclose(a[fin], b[fin], rtol=tol, atol=tol)


# ---- numpy transcription of §4.2 (one token) -------------------------------------------------------------------

def _np_decode(x, p, kv, sc, W, m, overlap, rd):
    kv, sc = kv.copy(), sc.copy()
    d = W["norm_w"].shape[0]
    a = np.asarray(W["wkv"], np.float64) @ x
    z = np.asarray(W["wgate"], np.float64) @ x + np.asarray(W["ape"], np.float64)[p % m]
    if overlap:
        kv[m + p % m], sc[m + p % m] = a, z
    else:
        kv[p % m], sc[p % m] = a, z
    if (p + 1) % m:
        return None, kv, sc
    if overlap:
        A = np.concatenate([kv[:m, :d], kv[m:, d:]])
        Z = np.concatenate([sc[:m, :d], sc[m:, d:]])
    else:
        A, Z = kv, sc
    e = np.exp(Z - Z.max(0))
    c = (e * A).sum(0) / e.sum(0)
    c = c / np.sqrt(np.mean(c * c) + EPS) * np.asarray(W["norm_w"], np.float64)
    cos, sin = (np.asarray(v, np.float64) for v in _rope(p + 1 - m, rd))
    x0, x1 = c[d - rd::2].copy(), c[d - rd + 1::2].copy()
    c[d - rd::2], c[d - rd + 1::2] = x0 * cos - x1 * sin, x0 * sin + x1 * cos
    if overlap:
        kv[:m], sc[:m] = kv[m:], sc[m:]
    return c, kv, sc


def _decode_step_matches(rng, kernel, ref, W, kv, sc, pos, B, Dm, rd, m, wdtype):
    """One decode token through kernel and reference from the same state: same emitted entries and states.
    Returns the reference states (so one step's error does not compound into the next)."""
    x = jnp.asarray(rng.standard_normal((B, Dm)), wdtype)
    cs = _rope(np.maximum(pos + 1 - m, 0), rd)
    p = jnp.asarray(pos, jnp.int32)
    e_r, em_r, kv_r, sc_r = ref(x, p, kv, sc, cos_sin=cs, **W)
    e_k, em_k, kv_k, sc_k = kernel(x, p, kv, sc, W["wkv"], W["wgate"], W["ape"], W["norm_w"], cs)
    np.testing.assert_array_equal(np.asarray(em_k), np.asarray(em_r))
    _close(e_k, e_r, 2e-5)
    _close(kv_k, kv_r, 2e-5)
    _close(sc_k, sc_r, 2e-5)
    return kv_r, sc_r


def test_finish_entry_rounds_like_the_model(rng):
    """entry_dtype=bf16: the same roundings as the model's XLA path (pooled window and normed entry in bf16, RoPE
    math in f32), bit for bit on the same pooled values; entry_dtype=f32 keeps everything in f32."""
    from v4jax.model import layers as L
    d, half = 64, 8
    pooled = jnp.asarray(rng.standard_normal((5, d)) * 3, jnp.float32)
    w = jnp.asarray(rng.standard_normal(d), jnp.float32)
    ang = jnp.asarray(rng.standard_normal((5, half)), jnp.float32)
    cos, sin = jnp.cos(ang), jnp.sin(ang)
    want = L.apply_rope(L.rms_norm(pooled.astype(jnp.bfloat16), w, EPS), cos, sin)
    got = C.finish_entry(pooled, w, cos, sin, eps=EPS, entry_dtype=jnp.bfloat16).astype(jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    want32 = L.apply_rope(L.rms_norm(pooled, w, EPS), cos, sin)
    np.testing.assert_allclose(np.asarray(C.finish_entry(pooled, w, cos, sin, eps=EPS)), np.asarray(want32),
                               rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("m,overlap", [(4, True), (8, False)])
def test_decode_reference_matches_numpy(rng, m, overlap):
    d, Dm, rd, B = 32, 24, 8, 2
    W = _weights(rng, m, overlap, d, Dm)
    kv, sc = _fresh_state(B, m, overlap, d)
    nkv, nsc = [np.asarray(kv, np.float64)[b] for b in range(B)], [np.asarray(sc, np.float64)[b] for b in range(B)]
    start = np.array([0, 3])
    for i in range(2 * m + 3):
        pos = start + i
        pos[1] = -1 if i == 2 else pos[1]
        x = rng.standard_normal((B, Dm)).astype(np.float32)
        entry, emitted, kv, sc = C.compressor_decode_ref(jnp.asarray(x), jnp.asarray(pos, jnp.int32), kv, sc,
                                                         cos_sin=_rope(np.maximum(pos + 1 - m, 0), rd), ratio=m,
                                                         overlap=overlap, eps=EPS, **W)
        for b in range(B):
            if pos[b] < 0:
                assert not emitted[b]
                continue
            want, nkv[b], nsc[b] = _np_decode(x[b].astype(np.float64), pos[b], nkv[b], nsc[b], W, m, overlap, rd)
            assert bool(emitted[b]) == (want is not None)
            if want is not None:
                np.testing.assert_allclose(np.asarray(entry[b]), want, rtol=1e-5, atol=1e-5)
            else:
                assert np.all(np.asarray(entry[b]) == 0)
            _close(kv[b], nkv[b], 1e-5)
            _close(sc[b], nsc[b], 1e-5)


# ---- prefill == decode token by token -------------------------------------------------------------------------

def _decode_run(step, xs, start, ntok, kv, sc, m, rd):
    """Runs `step` (a decode implementation) token by token; returns {b: [(entry_index, entry)]} and the state."""
    B, L, _ = xs.shape
    ents = {b: [] for b in range(B)}
    for i in range(L):
        pos = np.where(i < ntok, start + i, -1)
        e, em, kv, sc = step(xs[:, i], jnp.asarray(pos, jnp.int32), kv, sc, _rope(np.maximum(pos + 1 - m, 0), rd))
        for b in np.nonzero(np.asarray(em))[0]:
            ents[b].append((pos[b] // m, np.asarray(e[b])))
    return ents, kv, sc


def _prefill_run(fn, xs, start, ntok, kv, sc, m, T, rd):
    B, L, _ = xs.shape
    ents = {b: [] for b in range(B)}
    for c0 in range(0, L, T):
        sp = start + c0
        nt = np.clip(ntok - c0, 0, T)
        cos, sin = _rope(np.asarray(C.prefill_entry_positions(jnp.asarray(sp, jnp.int32), T, m)), rd)
        e, ne, fe, kv, sc = fn(xs[:, c0:c0 + T], jnp.asarray(sp, jnp.int32), jnp.asarray(nt, jnp.int32), kv, sc, cos,
                               sin)
        np.testing.assert_array_equal(np.asarray(ne), np.asarray(C.prefill_entry_count(jnp.asarray(sp, jnp.int32),
                                                                                        jnp.asarray(nt, jnp.int32), m)))
        for b in range(B):
            assert np.all(np.asarray(e[b, int(ne[b]):]) == 0)
            for i in range(int(ne[b])):
                ents[b].append((int(fe[b]) + i, np.asarray(e[b, i])))
    return ents, kv, sc


def _same_entries(got, want, tol):
    for b in want:
        assert [g[0] for g in got[b]] == [w[0] for w in want[b]], b
        for g, w in zip(got[b], want[b]):
            np.testing.assert_allclose(g[1], w[1], rtol=tol, atol=tol)


CASES = [  # m, overlap, chunk T, starts, valid tokens (of 3 chunks)
    (4, True, 8, [0, 5, 2, 0], [24, 17, 11, 3]),
    (4, True, 3, [1, 0, 6, 0], [9, 4, 7, 0]),        # chunks shorter than a window
    (8, False, 12, [0, 3, 9, 0], [36, 29, 20, 7]),
]


@pytest.mark.parametrize("m,overlap,T,start,ntok", CASES)
def test_prefill_reference_equals_decode(rng, m, overlap, T, start, ntok):
    d, Dm, rd = 32, 24, 8
    B = len(start)
    W = _weights(rng, m, overlap, d, Dm)
    kv, sc = _fresh_state(B, m, overlap, d)
    xs = jnp.asarray(rng.standard_normal((B, 3 * T, Dm)), jnp.float32)
    start, ntok = np.array(start), np.array(ntok)
    ref = jax.jit(functools.partial(C.compressor_decode_ref, ratio=m, overlap=overlap, eps=EPS, **W))
    step = lambda x, p, kv, sc, cs: ref(x, p, kv, sc, cos_sin=cs)
    want, kv_d, sc_d = _decode_run(step, xs, start, ntok, kv, sc, m, rd)
    pre = jax.jit(functools.partial(C.compressor_prefill_ref, ratio=m, overlap=overlap, eps=EPS, **W))
    fn = lambda x, sp, nt, kv, sc, cos, sin: pre(x, sp, nt, kv, sc, cos=cos, sin=sin)
    got, kv_p, sc_p = _prefill_run(fn, xs, start, ntok, kv, sc, m, T, rd)
    _same_entries(got, want, 1e-5)
    _close(kv_p, kv_d, 1e-5)
    _close(sc_p, sc_d, 1e-5)


# ---- Pallas kernels vs references ------------------------------------------------------------------------------

@pytest.mark.parametrize("m,overlap,d,wdtype", [(4, True, 128, jnp.float32), (8, False, 256, jnp.bfloat16)])
def test_decode_tpu_kernel_interpret(rng, m, overlap, d, wdtype):
    Dm, rd, B = 64, 16, 3
    W = _weights(rng, m, overlap, d, Dm, wdtype)
    kv, sc = _fresh_state(B, m, overlap, d)
    kernel = jax.jit(functools.partial(C._compressor_decode_tpu, ratio=m, overlap=overlap, eps=EPS, interpret=True))
    ref = jax.jit(functools.partial(C.compressor_decode_ref, ratio=m, overlap=overlap, eps=EPS))
    start = np.array([0, m - 2, 5])
    for i in range(m + 2):        # every slot closes once, slot 2 is inactive for a while
        pos = start + i
        pos[2] = -1 if i < 3 else pos[2]
        kv, sc = _decode_step_matches(rng, kernel, ref, W, kv, sc, pos, B, Dm, rd, m, wdtype)


@pytest.mark.parametrize("m,overlap,T,start,ntok", [CASES[0], CASES[2]])
def test_prefill_tpu_kernel_interpret(rng, m, overlap, T, start, ntok):
    d, Dm, rd = 128, 32, 16
    B = len(start)
    W = _weights(rng, m, overlap, d, Dm)
    kv, sc = _fresh_state(B, m, overlap, d)
    xs = jnp.asarray(rng.standard_normal((B, 2 * T, Dm)), jnp.float32)
    start, ntok = np.array(start), np.minimum(np.array(ntok), 2 * T)
    outs = []
    for f in (C.compressor_prefill_ref, functools.partial(C._compressor_prefill_tpu, interpret=True)):
        g = jax.jit(functools.partial(f, ratio=m, overlap=overlap, eps=EPS, **W))
        fn = lambda x, sp, nt, kv, sc, cos, sin: g(x, sp, nt, kv, sc, cos=cos, sin=sin)
        outs.append(_prefill_run(fn, xs, start, ntok, kv, sc, m, T, rd))
    (want, kv_r, sc_r), (got, kv_k, sc_k) = outs
    _same_entries(got, want, 2e-5)
    _close(kv_k, kv_r, 2e-5)
    _close(sc_k, sc_r, 2e-5)


@pytest.mark.parametrize("m,overlap,wdtype", [(4, True, jnp.float32), (16, False, jnp.bfloat16)])
def test_decode_gpu_kernel_interpret(rng, m, overlap, wdtype):
    d, Dm, rd, B = 64, 48, 16, 19     # B not a multiple of the 16-slot program block
    W = _weights(rng, m, overlap, d, Dm, wdtype)
    kv, sc = _fresh_state(B, m, overlap, d)
    kernel = jax.jit(functools.partial(CG.compressor_decode_gpu, ratio=m, overlap=overlap, eps=EPS, interpret=True))
    ref = jax.jit(functools.partial(C.compressor_decode_ref, ratio=m, overlap=overlap, eps=EPS))
    start = rng.integers(0, 3 * m, B)
    for i in range(m + 1):
        pos = start + i
        pos[4] = -1
        kv, sc = _decode_step_matches(rng, kernel, ref, W, kv, sc, pos, B, Dm, rd, m, wdtype)


@pytest.mark.parametrize("m,overlap", [(4, True), (16, False)])
def test_decode_gpu_kernel_on_a_layer_stack_interpret(rng, m, overlap):
    # states of 3 layers [3, B, ...]: layer 1 is updated in place (as the one-layer call does), 0 and 2 untouched
    d, Dm, rd, B = 64, 48, 16, 19
    W = _weights(rng, m, overlap, d, Dm, jnp.bfloat16)
    coff = 2 if overlap else 1
    kv = jnp.asarray(rng.standard_normal((3, B, coff * m, coff * d)), jnp.float32)
    sc = jnp.asarray(rng.standard_normal((3, B, coff * m, coff * d)), jnp.float32)
    pos = rng.integers(0, 3 * m, B)
    pos[4] = -1
    pos[0] = m - 1  # closes a window
    x = jnp.asarray(rng.standard_normal((B, Dm)), jnp.bfloat16)
    cs = _rope(np.maximum(pos + 1 - m, 0), rd)
    p = jnp.asarray(pos, jnp.int32)
    one = functools.partial(CG.compressor_decode_gpu, ratio=m, overlap=overlap, eps=EPS, interpret=True)
    e_r, em_r, kv_r, sc_r = jax.jit(one)(x, p, kv[1], sc[1], W["wkv"], W["wgate"], W["ape"], W["norm_w"], cs)
    e_k, em_k, kv_k, sc_k = jax.jit(functools.partial(one, layer=jnp.int32(1)))(
        x, p, kv, sc, W["wkv"], W["wgate"], W["ape"], W["norm_w"], cs)
    np.testing.assert_array_equal(np.asarray(em_k), np.asarray(em_r))
    assert np.asarray(em_r).any()
    np.testing.assert_array_equal(np.asarray(e_k), np.asarray(e_r))
    for got, one_layer, before in ((kv_k, kv_r, kv), (sc_k, sc_r, sc)):
        np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(one_layer))
        np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(before[0]))
        np.testing.assert_array_equal(np.asarray(got[2]), np.asarray(before[2]))


def test_public_entries_on_cpu(rng):
    m, overlap, d, Dm, rd, B, T = 4, True, 128, 32, 16, 2, 8
    W = _weights(rng, m, overlap, d, Dm)
    kv, sc = _fresh_state(B, m, overlap, d)
    x = jnp.asarray(rng.standard_normal((B, T, Dm)), jnp.float32)
    sp, nt = jnp.array([0, 3], jnp.int32), jnp.array([8, 6], jnp.int32)
    cos, sin = _rope(np.asarray(C.prefill_entry_positions(sp, T, m)), rd)
    kw = dict(ratio=m, overlap=overlap, eps=EPS)
    r = jax.jit(functools.partial(C.compressor_prefill_ref, **kw))(x, sp, nt, kv, sc, cos=cos, sin=sin, **W)
    k = jax.jit(functools.partial(C.compressor_prefill, **kw))(x, sp, nt, kv, sc, cos=cos, sin=sin, **W)
    for a, b in zip(k, r):
        _close(a, b, 2e-5)
    p = jnp.array([7, 2], jnp.int32)
    cs = _rope(np.array([4, 0]), rd)
    r = jax.jit(functools.partial(C.compressor_decode_ref, **kw))(x[:, 0], p, r[3], r[4], cos_sin=cs, **W)
    k = jax.jit(functools.partial(C.compressor_decode, **kw))(x[:, 0], p, k[3], k[4], cos_sin=cs, **W)
    for a, b in zip(k, r):
        _close(a, b, 2e-5)


# ---- lowering --------------------------------------------------------------------------------------------------

FLASH = [(4, True, 512, 64), (128, False, 512, 64), (4, True, 128, 8)]   # main CSA, HCA, indexer


def _dec_shapes(m, ov, d, B, Dm=4096, rd=64):
    A = jax.ShapeDtypeStruct
    coff = 2 if ov else 1
    return (A((B, Dm), jnp.bfloat16), A((B,), jnp.int32), A((B, coff * m, coff * d), jnp.float32),
            A((B, coff * m, coff * d), jnp.float32), A((coff * d, Dm), jnp.bfloat16), A((coff * d, Dm), jnp.bfloat16),
            A((m, coff * d), jnp.float32), A((d,), jnp.float32), (A((B, rd // 2), jnp.float32),) * 2)


@pytest.mark.parametrize("m,ov,d,B", FLASH)
def test_lowers_for_tpu(m, ov, d, B):
    kw = dict(ratio=m, overlap=ov, eps=EPS)
    dec = _dec_shapes(m, ov, d, B)
    _compat.export_for_tpu(functools.partial(C._compressor_decode_tpu, **kw), *dec)
    T = 256
    A = jax.ShapeDtypeStruct
    E = T // m + 2
    pre = (A((B, T, 4096), jnp.bfloat16), A((B,), jnp.int32), A((B,), jnp.int32), *dec[2:8],
           A((B, E, 32), jnp.float32), A((B, E, 32), jnp.float32))
    _compat.export_for_tpu(functools.partial(C._compressor_prefill_tpu, **kw), *pre)


@pytest.mark.parametrize("m,ov,d,B", FLASH)
def test_lowers_for_cuda_triton(m, ov, d, B):
    txt = _compat.lower_for_cuda(functools.partial(CG.compressor_decode_gpu, ratio=m, overlap=ov, eps=EPS,
                                                   interpret=False), *_dec_shapes(m, ov, d, B))
    assert "triton" in txt
