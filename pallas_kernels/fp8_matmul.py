"""y = x @ w[layer].T for a prefill chunk on FP8 tensor cores, w as the release stores it (e4m3 values, one ue8m0
scale per 128 x 128 block), read in place from its layer stack; the release's block-scaled FP8 GEMM (reference
§8.1: x rounded to e4m3 per 1 x 128 block along D with a power-of-two scale, e4m3 products, f32 sums, each
128-wide D block's partial sums scaled by its two block scales).

Why: XLA has no block-scaled FP8 matmul. Its form of an FP8 linear (ops._linear_xla) dequantizes the layer's
slice of the stack to bf16 in memory and multiplies in bf16; this kernel reads the e4m3 bytes where they lie and
multiplies on the FP8 tensor cores, twice the bf16 rate on Hopper. It computes the same products: an activation
rounded to e4m3 times a power of two, and a weight e4m3 times a ue8m0 scale, are both exact in bf16, and the
product of two e4m3 values is exact in f32; only the order of the f32 sums differs. (On Hopper the tensor cores
sum a wgmma's 32 products below f32 precision. Pallas's Triton lowering leaves the dot's max_num_imprecise_acc at
0, so Triton, by its source, adds every wgmma's partial sums into an f32 accumulator: more precise than the
release's kernels, which promote every 128, at the cost of an f32 add per 32 products; not yet measured. This
kernel then adds each 128-block's scaled partial sums in f32.)

Einsum letters: M tokens, D input width (the contraction, in blocks of 128), O outputs, G groups, n layers.

  x [..., D] (groups: [..., G, D]) in bf16 or f32; w [n, O, D] e4m3 (or [O, D] without `layer`); scale [O/128,
  D/128] ue8m0 (layer `layer`'s; a stack [n, O/128, D/128] is indexed at `layer`) -> y [..., O] (groups:
  [..., G, O/G]) in x's dtype. With G groups, rows g*O/G .. of w multiply x[..., g, :] (L.linear's grouped form).

  quantize_x (default): x -> (a [M, G*D] e4m3, a_scale [M, G*D/128] f32 powers of two) by `quantize_act`, the
      rule of v4jax.model.quant.fp8_roundtrip(x, 128) (tests check they agree bit for bit). For an x that is
      already rounded so (the model's FP8 linears round their input: layers.Linear) this changes no value: the
      rounding is idempotent (a block rounded once with scale s has its amax in [224 s, 448 s], or under the amax
      floor, so it gets the scale s or s / 2 again, and each value q * s is exactly q * s or 2q * (s / 2)).
      quantize_x=False: x stays in its dtype and each weight block is widened to it in registers (exact), for
      inputs the release does not round (the grouped wo_a, which the official converter dequantizes to bf16).

  Grid (M/BM * O/BN, splits): program (p, s) computes the output tile (i, j) (p swizzled in groups of `group_m`
  row tiles, so that consecutive programs share weight tiles in L2) over the s-th of `splits` equal parts of the
  D blocks: for each 128-wide block kb,
      d = a[i-tile, kb] @ w[layer, j-tile, kb].T          [BM, BN] f32 (e4m3 x e4m3 on the tensor cores)
      acc += d * a_scale[i-tile, kb][:, None] * w_scale[j-tile, kb]
  (BN <= 128: one weight scale per tile and block; BN = 256: a scale per column, gathered). Rows past M are
  masked (no padded copy of x, no slice of y); splits > 1 (too few tiles for the SMs: a short chunk) writes f32
  partial sums [splits, M, O] that XLA adds. The weight stack is read at the layer's rows (its [n*O, D] view),
  so no slice of it is copied.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from . import _compat, kv_format
from ._common import mm_nt
from .layer_linear import MAX_TOKENS as _DECODE_TOKENS

F32 = jnp.float32
E4M3 = jnp.float8_e4m3fn
BLOCK = 128  # the release's block: one ue8m0 weight scale per 128 x 128, one activation scale per 1 x 128
FP8_MAX = kv_format.FP8_MAX
ACT_FLOOR = 1e-4  # act_quant's amax floor: s = 2^ceil(log2(max(amax, 1e-4) / 448))

# Prefill chunks: more tokens than pallas_kernels.layer_linear takes (a decode step's few tokens stay there).
MIN_TOKENS = _DECODE_TOKENS + 1
# Tiles (not yet swept on the H200: v4jax bench kernels --sweep fp8_prefill): 128 x 128 e4m3 tiles are one weight
# scale block; 3 stages of an A and a B tile are 96 KB of shared memory.
BM, BN, WARPS, STAGES, GROUP_M = 128, 128, 8, 3, 8
MIN_PROGRAMS = 132  # one per SM of the H200: fewer output tiles split D (split-K)
MAX_SPLITS = 8
# Whether the model's prefill linears take this kernel at all: not before it has run on a GPU (the sweep against
# XLA's dequantize + bf16 matmul, and the engine's GPU tests with it); until then they stay with XLA.
ROUTED = False
# Whether the model's unrounded FP8 inputs (the grouped wo_a: bf16 products on the tensor cores, the weight read as
# stored) take this kernel too. Off until the sweep shows it beating XLA's dequantize + cuBLAS bf16 matmul there.
UNROUNDED = False


def quantize_act(x):
    """x [..., D] (D % 128 == 0) -> (e4m3 values [..., D], f32 power-of-two scales [..., D / 128]): the release's
    act_quant, as v4jax.model.quant.fp8_roundtrip(x, 128) rounds (values * scales == that, bit for bit)."""
    *lead, d = x.shape
    xb = x.astype(F32).reshape(*lead, d // BLOCK, BLOCK)
    s = kv_format.pow2_scale(jnp.max(jnp.abs(xb), axis=-1, keepdims=True), ACT_FLOOR, FP8_MAX)[0]
    q = jnp.clip(xb / s, -FP8_MAX, FP8_MAX).astype(E4M3)
    return q.reshape(*lead, d), s[..., 0]


def scale_values(scale):
    """ue8m0 scales (float8_e8m0fnu or their uint8 bytes) -> their f32 values 2^(byte - 127), exactly."""
    if scale.dtype not in (jnp.uint8, jnp.float8_e8m0fnu):
        return scale.astype(F32)
    b = lax.bitcast_convert_type(scale, jnp.uint8).astype(jnp.int32)
    return jnp.where(b == 0, jnp.float32(2.0 ** -127), lax.bitcast_convert_type(b << 23, F32))


def fp8_tensor_cores() -> bool:
    """Whether this process's GPU multiplies e4m3 on its tensor cores (compute capability 8.9 and up: Ada, Hopper,
    Blackwell; Triton cannot lower an e4m3 dot below)."""
    cc = getattr(jax.devices()[0], "compute_capability", None)
    try:
        return cc is not None and tuple(int(v) for v in str(cc).split(".")[:2]) >= (8, 9)
    except ValueError:
        return False


def _tokens(x, groups: int) -> int:
    return x.size // (x.shape[-1] * groups) if x.ndim else 0


def supported(x, w, groups: int = 1, scaled: bool = True, rounded: bool = True) -> bool:
    """Whether the model's linear of x through w takes this kernel: on a GPU, FP8 weights with block scales
    (`scaled`) for an input the release rounds (`rounded`; unrounded ones only with UNROUNDED), bf16 activations
    (the release's; an f32 model keeps XLA's f32 sums: Hopper's FP8 tensor cores sum a wgmma's 32 products below
    f32 precision, which a bf16 output does not show), FP8 tensor cores, at least MIN_TOKENS tokens, O / G and D
    whole 128-blocks, 32-bit offsets into the stack, x and y. (`fp8_linear` itself also takes f32 x.)"""
    if _compat.backend() != "gpu" or not scaled or not (rounded or UNROUNDED):
        return False
    if w.dtype != E4M3 or x.dtype != jnp.bfloat16 or w.ndim not in (2, 3):
        return False
    n_out, d = w.shape[-2:]
    if x.shape[-1] != d or groups < 1 or n_out % groups or (n_out // groups) % BLOCK or d % BLOCK:
        return False
    if groups > 1 and (x.ndim < 2 or x.shape[-2] != groups):
        return False
    m = _tokens(x, groups)
    return (m >= MIN_TOKENS and w.size < 2 ** 31 and x.size < 2 ** 31 and m * n_out < 2 ** 31
            and fp8_tensor_cores())


def _tile(pid, n_m, n_n, group_m):
    """Program pid -> output tile (i, j), row tiles walked in groups of group_m for each column tile (L2 reuse)."""
    width = group_m * n_n
    first = (pid // width) * group_m
    size = jnp.minimum(n_m - first, group_m)
    return first + (pid % width) % size, (pid % width) // size


def _kernel(layer_ref, a_ref, as_ref, w_ref, ws_ref, y_ref, *, m, n_out, group_out, d, bm, bn, n_m, n_n,
            group_m, kb_per_split, quantized):
    load, store = _compat.pltriton.load, _compat.pltriton.store
    i, j = _tile(pl.program_id(0), n_m, n_n, group_m)
    s = pl.program_id(1)
    row0, col0 = i * bm, j * bn
    ok = row0 + lax.broadcasted_iota(jnp.int32, (bm,), 0) < m          # rows of x (and y) inside M
    g = col0 // group_out                                               # this tile's group: x[:, g, :]
    w_row0 = layer_ref[0] * n_out + col0                                # the layer's rows in the [n*O, D] view
    kb0 = s * kb_per_split
    if bn > BLOCK:  # a scale per column: the tile spans bn / 128 weight scale blocks
        scale_rows = (col0 + lax.broadcasted_iota(jnp.int32, (bn,), 0)) // BLOCK

    def body(t, acc):
        kb = kb0 + t
        # rows past M: no `other` (no e4m3 constant in the Triton lowering); they only reach their own output rows,
        # which are not stored
        a = load(a_ref.at[pl.ds(row0, bm), pl.ds(g * d + kb * BLOCK, BLOCK)],
                 mask=jnp.broadcast_to(ok[:, None], (bm, BLOCK)))
        w = w_ref[pl.ds(w_row0, bn), pl.ds(kb * BLOCK, BLOCK)]
        part = mm_nt(a, w if quantized else w.astype(a.dtype))         # [bm, bn] f32
        if bn > BLOCK:
            ws = load(ws_ref.at[scale_rows, kb])[None, :]              # [1, bn]
        else:
            ws = ws_ref[col0 // BLOCK, kb]
        if quantized:  # the block's row scales [bm] (a_scale is stored [G*D/128, M]: contiguous rows)
            xs = load(as_ref.at[g * (d // BLOCK) + kb, pl.ds(row0, bm)], mask=ok, other=0.0)
            return acc + part * (xs[:, None] * ws)
        return acc + part * ws

    acc = lax.fori_loop(0, kb_per_split, body, jnp.zeros((bm, bn), F32))
    dst = y_ref.at[pl.ds(row0, bm), pl.ds(col0, bn)] if len(y_ref.shape) == 2 else \
        y_ref.at[s, pl.ds(row0, bm), pl.ds(col0, bn)]
    store(dst, acc.astype(y_ref.dtype), mask=jnp.broadcast_to(ok[:, None], (bm, bn)))


def block_scaled_matmul(a, a_scale, w, w_scale, layer=None, groups: int = 1, *, out_dtype=None, interpret=None,
                        block_m: int = BM, block_n: int = BN, num_warps: int = WARPS, num_stages: int = STAGES,
                        group_m: int = GROUP_M, min_programs: int = MIN_PROGRAMS, splits: int | None = None):
    """The GEMM of the module doc on 2-D operands: a [M, G*D] (e4m3 with a_scale [M, G*D/128] f32; or bf16 / f32
    with a_scale None: x unrounded), w [n, O, D] e4m3 (or [O, D] with layer None), w_scale [O/128, D/128] (ue8m0
    or f32 values) -> y [M, O] in out_dtype (default: f32 for e4m3 a, else a's dtype). splits: parts of D summed in
    XLA (None: as many as MIN_PROGRAMS asks, up to MAX_SPLITS)."""
    if interpret is None:
        interpret = _compat.backend() == "cpu"
    quantized = a_scale is not None
    if quantized != (a.dtype == E4M3):
        raise ValueError(f"a {a.dtype}: e4m3 with its scales, or unrounded bf16 / f32 without")
    w2 = w.reshape(-1, w.shape[-1])
    n_out, d = w.shape[-2:]
    m = a.shape[0]
    group_out = n_out // groups
    if (a.shape[1] != groups * d or d % BLOCK or n_out % groups or group_out % block_n
            or block_n % 16 or (block_n > BLOCK and block_n % BLOCK) or (block_n < BLOCK and BLOCK % block_n)):
        raise ValueError(f"a {a.shape}, w {w.shape}, {groups} groups, block_n {block_n}: D in 128-blocks, "
                         f"block_n a divisor or multiple of 128 dividing O / G")
    out_dtype = out_dtype or (F32 if quantized else a.dtype)
    n_kb = d // BLOCK
    n_m, n_n = pl.cdiv(m, block_m), n_out // block_n
    if splits is None:
        splits = 1
        while n_m * n_n * splits < min_programs and splits < MAX_SPLITS and n_kb % (2 * splits) == 0:
            splits *= 2
    if n_kb % splits:
        raise ValueError(f"{splits} splits of {n_kb} blocks of D")
    layer = jnp.zeros((1,), jnp.int32) if layer is None else jnp.asarray(layer, jnp.int32).reshape(1)
    ws = scale_values(w_scale if w_scale.ndim == 2 else w_scale[layer[0]])
    a_s = (jnp.zeros((1, 1), F32) if a_scale is None else a_scale.astype(F32).T)  # [G*D/128, M]
    y_shape = (m, n_out) if splits == 1 else (splits, m, n_out)
    y_dtype = out_dtype if splits == 1 else F32
    full = lambda x: pl.BlockSpec(x.shape, lambda *_: (0,) * x.ndim)
    kw = {"interpret": True} if interpret else {
        "compiler_params": _compat.TritonCompilerParams(num_warps=num_warps, num_stages=num_stages)}
    y = pl.pallas_call(
        functools.partial(_kernel, m=m, n_out=n_out, group_out=group_out, d=d, bm=block_m, bn=block_n, n_m=n_m,
                          n_n=n_n, group_m=group_m, kb_per_split=n_kb // splits, quantized=quantized),
        out_shape=jax.ShapeDtypeStruct(y_shape, y_dtype), grid=(n_m * n_n, splits),
        in_specs=[full(layer), full(a), full(a_s), full(w2), full(ws)],
        out_specs=full(jax.ShapeDtypeStruct(y_shape, y_dtype)),
        name="v4_fp8_matmul" if quantized else "v4_fp8_weight_matmul", **kw,
    )(layer, a, a_s, w2, ws)
    return y if splits == 1 else jnp.sum(y, axis=0).astype(out_dtype)


def fp8_linear(x, w, layer=None, groups: int = 1, *, scale, quantize_x: bool = True, interpret=None, **blocks):
    """The model's linear (v4jax.model.layers.linear, groups included) of x through layer `layer` of the e4m3
    stack w with the layer's block scales `scale`, in x's dtype: x rounded by `quantize_act` (quantize_x) and the
    FP8 GEMM, or x as it is against the widened weight. blocks: block_m, block_n, num_warps, num_stages,
    group_m, min_programs, splits of `block_scaled_matmul`."""
    d, n_out = w.shape[-1], w.shape[-2]
    m = _tokens(x, groups)
    x2 = x.reshape(m, groups * d)
    a, a_scale = quantize_act(x2) if quantize_x else (x2, None)
    y = block_scaled_matmul(a, a_scale, w, scale, layer, groups, out_dtype=x.dtype, interpret=interpret, **blocks)
    if groups > 1:
        return y.reshape(*x.shape[:-2], groups, n_out // groups)
    return y.reshape(*x.shape[:-1], n_out)
