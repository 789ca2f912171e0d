"""The Triton sparse attention reading FP8 entries as 32-bit words (pallas_kernels.sparse_attention_fp8_gpu): its
in-register decode against kv_format's bit for bit, the kernel (interpret mode) against the reference the model runs
on FP8 pools (sparse_attention_ref with entry_format) on CSA and HCA rows, its lowering for CUDA, and on a GPU the
compiled kernel at Flash decode shapes (-m gpu).

Pools: NoPE blocks of magnitudes 2^-6 .. 2^5 apart within a row (every scale byte of an entry differs), one all-zero
row (the scale's floor); rows with -1s, a query with no valid row (o = 0), one without compressed rows.
"""
import functools
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from pallas_kernels import _compat, kv_format
from pallas_kernels import sparse_attention_fp8_gpu as W

sa = importlib.import_module("pallas_kernels.sparse_attention")   # (the package attribute is the function)

FLASH = kv_format.Fp8Entry(512, 64)     # 448 NoPE dims in 7 scale blocks (two scale words), 584 B
SMALL = kv_format.Fp8Entry(256, 64)     # 192 NoPE dims in 3 scale blocks


def _pool(rng, fmt, rows):
    x = rng.standard_normal((rows, fmt.dim))
    blocks = -(-fmt.nope // kv_format.FP8_BLOCK)
    mag = np.exp2(rng.integers(-6, 6, (rows, blocks))).repeat(kv_format.FP8_BLOCK, axis=1)[:, :fmt.nope]
    x[:, :fmt.nope] *= mag
    x[1] = 0.0
    return jax.jit(fmt.encode)(jnp.asarray(x, jnp.float32))


def _inputs(rng, fmt, B, T, H, Wn, K, R1, R2, dtype, hca=False):
    q = jnp.asarray(rng.standard_normal((B, T, H, fmt.dim)), dtype)
    rw = rng.integers(0, R1, (B, T, Wn))
    rw[rng.random(rw.shape) < 0.2] = -1
    if hca:   # each query's valid compressed rows a prefix (n_ready): ending inside a block, at 0, at the full width
        n_ready = rng.integers(0, K + 1, (B, T, 1))
        n_ready.flat[:3] = [K, 0, 37][:n_ready.size]
        rc = np.where(np.arange(K) < n_ready, rng.integers(0, R2, (B, T, K)), -1)
    else:
        rc = rng.integers(0, R2, (B, T, K))
        rc[rng.random(rc.shape) < 0.2] = -1
        rc[0, -1] = -1                                       # no compressed rows for one query
    rw[-1, 0], rc[-1, 0] = -1, -1                            # nothing valid at all: o = 0
    sink = jnp.asarray(rng.standard_normal(H) * 2, jnp.float32)
    return (q, _pool(rng, fmt, R1), jnp.asarray(rw, jnp.int32), _pool(rng, fmt, R2), jnp.asarray(rc, jnp.int32), sink)


def _check(out, ref, tol):
    out = np.asarray(out.astype(jnp.float32), np.float64)
    ref = np.asarray(ref, np.float64)
    assert np.all(np.isfinite(out)), "unwritten (NaN-poisoned) or non-finite outputs"
    np.testing.assert_allclose(out, ref, rtol=tol, atol=tol * np.max(np.abs(ref)))


def test_word_order_is_a_permutation():
    for fmt in (FLASH, SMALL, kv_format.Fp8Entry(64, 0)):
        assert sorted(W.word_order(fmt)) == list(range(fmt.dim))
    order = W.word_order(FLASH)                  # plane 1 starts with byte 1 of word 0; RoPE after 112 code words
    assert list(order[[0, 1, 128, 112, 113, 240, 241, 368, 369]]) == [0, 4, 1, 448, 450, 449, 451, 480, 482]


@pytest.mark.parametrize("expand", W.EXPANDS)
def test_decode_matches_kv_format_bit_for_bit(rng, expand):
    """A block of gathered words decoded in the kernel is kv_format's decode of the same entries (in the column
    order), masked rows 0."""
    fmt, C = FLASH, 32
    pool8 = _pool(rng, fmt, 50)
    ids = jnp.asarray(np.where(rng.random(C) < 0.25, -1, rng.integers(0, 50, C)), jnp.int32)

    def kernel(ids_ref, pool_ref, o_ref):
        ids_ = ids_ref[...]
        o_ref[...] = W._gather_rows(pool_ref, ids_, ids_ >= 0, fmt, jnp.float32, expand)

    words = kv_format.as_words(pool8)
    got = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((C, fmt.dim), jnp.float32), interpret=True)(ids, words)
    want = np.where((np.asarray(ids) >= 0)[:, None],
                    np.asarray(fmt.decode(pool8[jnp.maximum(ids, 0)]))[:, W.word_order(fmt)], 0.0)
    np.testing.assert_array_equal(np.asarray(got), want)


@pytest.mark.parametrize("fmt,dtype,expand,n_split,lse,words", [
    (SMALL, jnp.float32, "planes", 1, False, False),     # one program per (head block, query); uint8 pools
    (SMALL, jnp.float32, "columns", 3, True, True),      # rows split, partial states merged; lse; uint32 pools
    (FLASH, jnp.bfloat16, "planes", None, False, True),  # the Flash entry, bf16 products
    (FLASH, jnp.bfloat16, "columns", 1, False, False),
])
def test_csa_rows_against_the_reference(rng, fmt, dtype, expand, n_split, lse, words):
    args = _inputs(rng, fmt, 2, 2, 20, 40, 70, 64, 300, dtype)     # H = 20: padded to 32 heads
    ref_o, ref_lse = sa.sparse_attention_ref(*args, scale=0.05, entry_format=fmt, return_lse=True)
    if words:
        args = (args[0], kv_format.as_words(args[1]), args[2], kv_format.as_words(args[3]), *args[4:])
    out = jax.jit(functools.partial(W.sparse_attention_gpu_words, scale=0.05, entry_format=fmt, interpret=True,
                                    n_split=n_split, return_lse=lse, expand=expand))(*args)
    if lse:
        out, got_lse = out
        _check(got_lse, ref_lse, 1e-5)
        assert out.dtype == jnp.float32
    else:
        assert out.dtype == dtype
        ref_o = ref_o.astype(dtype).astype(jnp.float32)
    _check(out, ref_o, 1e-5 if dtype == jnp.float32 else 1e-2)
    assert np.all(np.asarray(out)[-1, 0] == 0)


@pytest.mark.parametrize("n_split,expand", [(1, "planes"), (3, "columns")])
def test_hca_rows_stop_after_the_valid_prefix(rng, n_split, expand):
    """HCA rows (valid_prefix: each query's compressed rows valid up to its n_ready) with skip_tail."""
    args = _inputs(rng, SMALL, 2, 3, 16, 24, 150, 64, 400, jnp.float32, hca=True)
    ref = sa.sparse_attention_ref(*args, scale=0.06, entry_format=SMALL)
    out = jax.jit(functools.partial(W.sparse_attention_gpu_words, scale=0.06, entry_format=SMALL, interpret=True,
                                    n_split=n_split, skip_tail=True, expand=expand))(*args)
    _check(out, ref, 1e-5)


def test_unsupported_shapes_are_refused():
    S = jax.ShapeDtypeStruct
    q = S((1, 1, 16, 512), jnp.bfloat16)
    assert W.supported(q, S((8, FLASH.nbytes), jnp.uint8), S((8, FLASH.nbytes // 4), jnp.uint32), FLASH)
    assert not W.supported(q, S((8, 512), jnp.bfloat16), None, FLASH)              # not entries
    assert not W.supported(S((1, 1, 16, 256), jnp.bfloat16), S((8, SMALL.nbytes), jnp.uint8), None, FLASH)
    assert not W.supported(S((1, 1, 16, 192), jnp.bfloat16), S((8, 200), jnp.uint8), None,
                           kv_format.Fp8Entry(192, 64))                             # 48 columns a plane
    with pytest.raises(ValueError):
        W.sparse_attention_gpu_words(jnp.zeros((1, 1, 16, 512)), jnp.zeros((8, 512)), jnp.zeros((1, 1, 4), jnp.int32),
                                     None, None, jnp.zeros(16), scale=1.0, entry_format=FLASH)


def _flash_shapes(B, pool_dtype):
    S = jax.ShapeDtypeStruct
    E = FLASH.nbytes if pool_dtype == jnp.uint8 else FLASH.nbytes // 4
    return (S((B, 1, 64, 512), jnp.bfloat16), S((B * 128, E), pool_dtype), S((B, 1, 128), jnp.int32),
            S((B * 32768, E), pool_dtype), S((B, 1, 512), jnp.int32), S((64,), jnp.float32))


@pytest.mark.parametrize("expand", W.EXPANDS)
@pytest.mark.parametrize("kw", [dict(), dict(n_split=4, return_lse=True, skip_tail=True)])
def test_lowers_for_cuda(expand, kw):
    """Flash decode shapes lower to one Triton call that takes the word pools as they are (no gather in XLA)."""
    txt = _compat.lower_for_cuda(functools.partial(W.sparse_attention_gpu_words, scale=0.04, entry_format=FLASH,
                                                   expand=expand, **kw), *_flash_shapes(4, jnp.uint32))
    (call,) = [line for line in txt.splitlines() if "xla.gpu.triton" in line]
    operands = call.split("triton(", 1)[1].split(")", 1)[0].split(", ")
    assert {"%arg1", "%arg3"} <= set(operands)
    assert "stablehlo.gather" not in txt


# ---- on a GPU: the compiled kernel (python -m pytest -q -m gpu tests/test_kernels_sparse_attention_words.py) -------

@pytest.mark.gpu
@pytest.mark.skipif(_compat.backend() != "gpu", reason="needs a GPU")
@pytest.mark.parametrize("B,expand,pool_dtype,hca", [
    (1, "planes", jnp.uint8, False), (32, "planes", jnp.uint32, False), (4, "columns", jnp.uint32, False),
    (4, "planes", jnp.uint32, True)])
def test_flash_decode_on_gpu(B, expand, pool_dtype, hca):
    rng = np.random.default_rng(B)
    args = _inputs(rng, FLASH, B, 1, 64, 128, 1024 if hca else 512, B * 128, B * 4096, jnp.bfloat16, hca=hca)
    ref = sa.sparse_attention_ref(*args, scale=512 ** -0.5, entry_format=FLASH)
    if pool_dtype == jnp.uint32:
        args = (args[0], kv_format.as_words(args[1]), args[2], kv_format.as_words(args[3]), *args[4:])
    out = jax.jit(functools.partial(W.sparse_attention_gpu_words, scale=512 ** -0.5, entry_format=FLASH,
                                    skip_tail=hca, expand=expand))(*args)
    _check(out, ref.astype(jnp.float32), 1e-2)
