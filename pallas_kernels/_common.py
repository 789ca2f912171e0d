"""Small helpers shared by the kernels: padding of row-id lists, tile-aligned DMA gathers of pool rows (TPU)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

F32 = jnp.float32
NEG_INF = float("-inf")
# A finite "minus infinity" for running maxima, so exp(m_old - m_new) never sees inf - inf.
MASK_FLOOR = -1e30


def round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def layer_operand(layer) -> jax.Array:
    """A kernel's layer index as an int32 [1] operand (None: 0, an array that is not a stack's)."""
    return jnp.zeros((1,), jnp.int32) if layer is None else jnp.asarray(layer, jnp.int32).reshape(1)


def next_pow2(x: int) -> int:
    return 1 if x <= 1 else 1 << (int(x) - 1).bit_length()


def pow2_block(n: int, want: int) -> int | None:
    """The largest power of two <= want that divides n (and is >= 16, Triton's smallest tile), or None."""
    b = want
    while b >= 16:
        if n % b == 0:
            return b
        b //= 2
    return None


def pad_last(x: jax.Array, size: int, value) -> jax.Array:
    """Pads the last axis of x up to `size` with `value` (no-op when already that size)."""
    n = x.shape[-1]
    if n == size:
        return x
    if n > size:
        raise ValueError(f"cannot pad {n} down to {size}")
    pad = [(0, 0)] * (x.ndim - 1) + [(0, size - n)]
    return jnp.pad(x, pad, constant_values=value)


def tile_rows(dtype) -> int:
    """Rows of one TPU HBM tile of a [rows, d] array: 8 for 32-bit, 16 for bf16 (two rows packed per sublane).
    Mosaic only DMAs slices of such an array that start on a tile (a CPU-side libtpu compile rejects the rest)."""
    return 8 * (4 // jnp.dtype(dtype).itemsize)


def gather_groups(rows: jax.Array, group: int, n_pool_rows: int):
    """For DMA gathers in tile-aligned groups of `group` rows (group = tile_rows of the pool): per group, whether
    it is ONE whole tile -- its ids are consecutive valid rows starting on a tile boundary, or all -1 (then tile 0
    is fetched, finite pool data that the kernel masks out) -- and which tile. Otherwise the kernel fetches, row by
    row, the tile holding each row and picks the row out on chip. rows [..., n] with n % group == 0.
    Returns (flag, tile), int32 [..., n // group]."""
    *lead, n = rows.shape
    rg = rows.reshape(*lead, n // group, group)
    first = rg[..., 0]
    consec = jnp.all(rg == first[..., None] + jnp.arange(group, dtype=rows.dtype), axis=-1)
    consec &= (first >= 0) & (first + group <= n_pool_rows) & (first % group == 0)
    allinv = jnp.all(rg < 0, axis=-1) & (n_pool_rows >= group)
    flag = (consec | allinv).astype(jnp.int32)
    tile = jnp.where(consec, first // group, 0).astype(jnp.int32)
    return flag, tile


def tiled_view(pool: jax.Array, rows_per_tile: int) -> jax.Array:
    """pool [R, d] -> [R / t, t, d] (a bitcast on TPU: the same bytes), padded to whole tiles if R is not."""
    R = pool.shape[0]
    Rp = round_up(R, rows_per_tile)
    if Rp != R:
        pool = jnp.pad(pool, ((0, Rp - R), (0, 0)))
    return pool.reshape(Rp // rows_per_tile, rows_per_tile, pool.shape[-1])


def tpu_gather_start(pool3, rows_smem, flag_smem, tile_smem, row0, buf, stage, sem, *, n, wait):
    """Starts (or waits for) the DMAs that bring rows ids[row0 : row0 + n] of the tiled pool view `pool3`
    [R/t, t, d] on chip: a whole-tile group straight into buf [n, d]; any other row's tile into stage[j] [t, d]
    (tpu_gather_finish picks the row out). DMA sources are whole tiles, as Mosaic requires."""
    t = pool3.shape[1]

    def one_group(g, carry):
        gi = row0 // t + g
        flag = flag_smem[0, gi]

        @pl.when(flag == 1)
        def _():
            cp = pltpu.make_async_copy(pool3.at[tile_smem[0, gi]], buf.at[pl.ds(pl.multiple_of(g * t, t), t)], sem)
            cp.wait() if wait else cp.start()

        @pl.when(flag == 0)
        def _():
            for j in range(t):
                r = jnp.maximum(rows_smem[0, row0 + g * t + j], 0)
                cp = pltpu.make_async_copy(pool3.at[r // t], stage.at[g * t + j], sem)
                cp.wait() if wait else cp.start()

        return carry

    lax.fori_loop(0, n // t, one_group, 0)


def tpu_gather_finish(ids, flag_smem, row0, buf, stage, *, n):
    """After tpu_gather_start(wait=True): the rows of non-tile groups, picked out of their tiles into buf. ids
    [1, n] int32: this part's row ids (lanes). Per group of t rows one one-hot matmul, P [t, t*t] @ tiles [t*t, d]
    (Mosaic cannot slice packed bf16 rows at a dynamic offset; a select per row unrolled t*n/t times was slow to
    compile). P has one 1 per row, so the product is exact."""
    t = stage.shape[1]
    d = stage.shape[-1]
    c = lax.broadcasted_iota(jnp.int32, (t * t, t), 0)
    j = lax.broadcasted_iota(jnp.int32, (t * t, t), 1)
    words = stage.dtype == jnp.uint32  # entries in a byte format: picked as two 16-bit halves in f32 (exact)
    mdt = F32 if words else stage.dtype
    prec = lax.Precision.HIGHEST if mdt == F32 else None
    for g in range(n // t):
        @pl.when(flag_smem[0, row0 // t + g] == 0)
        def _():
            r = jnp.maximum(ids[:, g * t:(g + 1) * t], 0)                        # [1, t]
            pt = (c == j * t + r % t).astype(mdt)                                # [t*t, t]: P transposed
            tiles = stage[pl.ds(g * t, t)].reshape(t * t, d)
            pick = lambda x: lax.dot_general(pt, x, (((0,), (0,)), ((), ())), precision=prec,
                                             preferred_element_type=F32)
            if words:
                hi, lo = pick((tiles >> 16).astype(F32)), pick((tiles & 0xFFFF).astype(F32))
                buf[pl.ds(g * t, t), :] = (hi.astype(jnp.uint32) << 16) | lo.astype(jnp.uint32)
            else:
                buf[pl.ds(g * t, t), :] = pick(tiles).astype(buf.dtype)


def dot_f32(a, b, dims):
    """dot_general with f32 accumulation; f32 operands get full precision (no TF32/bf16 passes)."""
    prec = jax.lax.Precision.HIGHEST if (a.dtype == F32 or b.dtype == F32) else None
    return jax.lax.dot_general(a, b, (dims, ((), ())), precision=prec, preferred_element_type=F32)


def mm_nt(a, b):
    """a [M, K] @ b[N, K].T -> [M, N] f32."""
    return dot_f32(a, b, ((1,), (1,)))


def mm_nn(a, b):
    """a [M, K] @ b[K, N] -> [M, N] f32."""
    return dot_f32(a, b, ((1,), (0,)))


def pv_matmul(p, v):
    """p [M, C] f32 @ v [C, N] -> [M, N] f32, accurate to ~2^-17 relative for bf16 v: p is split into a bf16
    high part and a bf16 residual, so both products run on bf16 matrix units with exact products."""
    if v.dtype == jnp.bfloat16:
        p_hi = p.astype(jnp.bfloat16)
        p_lo = (p - p_hi.astype(F32)).astype(jnp.bfloat16)
        return mm_nn(p_hi, v) + mm_nn(p_lo, v)
    return mm_nn(p, v.astype(F32))


def common_compute_dtype(*dtypes):
    """bf16 only if every operand is bf16; f32 otherwise."""
    return jnp.bfloat16 if all(jnp.dtype(d) == jnp.bfloat16 for d in dtypes) else F32


def ue8m0_to_f32(scale):
    """ue8m0 scales (float8_e8m0fnu, or their bytes in an integer dtype) -> 2^(byte - 127) in f32 (byte 0: 2^-127),
    exactly: the exponent field placed by a shift, no conversion a backend may lack (v4jax.model.quant's rule)."""
    if scale.dtype == jnp.float8_e8m0fnu:
        scale = lax.bitcast_convert_type(scale, jnp.uint8)
    b = scale.astype(jnp.int32)
    return jnp.where(b == 0, jnp.float32(2.0 ** -127), lax.bitcast_convert_type(b << 23, F32))


def e2m1_to_f32(code):
    """e2m1 codes 0..15 (bit 3: sign, bits 2..1: exponent e with bias 1, bit 0: mantissa m; any integer dtype) ->
    f32, built as f32 bits (e = 0: 0 or 0.5) in a few integer operations: the GPU kernels decode codes with it in
    registers."""
    c = code.astype(jnp.uint32)
    e, m = (c >> 1) & 3, c & 1
    bits = jnp.where(e == 0, m * (126 << 23), ((e + 126) << 23) | (m << 22)) | ((c & 8) << 28)
    return lax.bitcast_convert_type(bits.astype(jnp.uint32), F32)


def fp8_round_block(x):
    """The release's act_quant of one 128-value block in kernel registers: x f32 [..., 128] -> the values
    e4m3(clip(x / s)) * s, s = 2^ceil(log2(max(amax, 1e-4) / 448)) per row (v4jax.model.quant.fp8_roundtrip's,
    bit for bit). The scale comes from amax's bits, not a division (Triton's f32 divide is not correctly rounded):
    with amax = 1.m x 2^E, s = 2^(E-8) if 1.m <= 1.75 (448 = 1.75 x 2^8) else 2^(E-7), and x / s is x times 2^-e,
    exact."""
    amax = jnp.maximum(jnp.max(jnp.abs(x), axis=-1, keepdims=True), jnp.float32(1e-4))
    bits = lax.bitcast_convert_type(amax, jnp.int32)
    e = (bits >> 23) - 135 + jnp.where((bits & 0x7FFFFF) > 0x600000, 1, 0)
    s = lax.bitcast_convert_type((e + 127) << 23, F32)
    inv = lax.bitcast_convert_type((127 - e) << 23, F32)
    return jnp.clip(x * inv, -448.0, 448.0).astype(jnp.float8_e4m3fn).astype(F32) * s
