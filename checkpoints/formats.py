"""Numeric storage formats of DeepSeek-V4 checkpoints (reference §8.1), in numpy + ml_dtypes only.

* FP8: `float8_e4m3fn` weights `[out, in]` with one ue8m0 (`float8_e8m0fnu`, value 2**(byte-127)) scale per
  128x128 block, scale shape `[ceil(out/128), ceil(in/128)]`; value = w8 * scale.
* FP4: e2m1 codes, two per `int8` byte (low nibble = even column, high nibble = odd column), one ue8m0 scale per
  1x32 block along the input dim, scale shape `[out, ceil(in/32)]`.

Scales are powers of two: for a block with largest magnitude `amax` the scale is the smallest power of two `s`
with `amax / s <= fmax` (fmax 448 for e4m3, 6 for e2m1), i.e. `2**ceil(log2(amax / fmax))`.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
E8M0 = np.dtype(ml_dtypes.float8_e8m0fnu)
BF16 = np.dtype(ml_dtypes.bfloat16)
E2M1 = np.dtype(ml_dtypes.float4_e2m1fn)

FP8_MAX = 448.0
FP4_MAX = 6.0
# e2m1 value of each 4-bit code (bit 3 = sign); index = code.
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                       -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=np.float32)
_E8M0_MIN_EXP, _E8M0_MAX_EXP = -127, 127


def _pair(block) -> tuple[int, int]:
    if isinstance(block, (tuple, list)):
        br, bc = (int(b) for b in block)
    else:
        br = bc = int(block)
    if br < 1 or bc < 1:
        raise ValueError(f"block size must be positive, got {block}")
    return br, bc


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


# ---- ue8m0 scales -----------------------------------------------------------------------------------
def e8m0_from_exponent(exp: np.ndarray) -> np.ndarray:
    """ue8m0 array holding 2**exp (exp integer in [-127, 127])."""
    exp = np.asarray(exp)
    if exp.size and (exp.min() < _E8M0_MIN_EXP or exp.max() > _E8M0_MAX_EXP):
        raise ValueError("scale exponent outside the ue8m0 range [-127, 127]")
    return (exp.astype(np.int32) + 127).astype(np.uint8).view(E8M0)


def e8m0_to_float(scale: np.ndarray) -> np.ndarray:
    """float32 value of a scale array: ue8m0 (2**(byte-127), byte 255 = NaN), raw uint8 bytes, or any float."""
    scale = np.asarray(scale)
    if scale.dtype == E8M0 or scale.dtype == np.uint8:
        b = scale.view(np.uint8).astype(np.int32)
        out = np.ldexp(np.float32(1.0), b - 127).astype(np.float32)
        out[b == 255] = np.nan
        return out
    return scale.astype(np.float32)


def pow2_scale_exponent(amax: np.ndarray, fmax: float) -> np.ndarray:
    """Smallest integer k with amax <= fmax * 2**k (exact; amax == 0 gives the smallest ue8m0 exponent)."""
    a = np.asarray(amax, dtype=np.float64)
    tiny = np.ldexp(fmax, _E8M0_MIN_EXP)
    a = np.where(a > tiny, a, tiny)
    k = np.ceil(np.log2(a / fmax))
    # log2 of a quotient can be off by one ulp at exact powers of two; settle it exactly.
    k = np.where(np.ldexp(fmax, (k - 1).astype(np.int64)) >= a, k - 1, k)
    k = np.where(np.ldexp(fmax, k.astype(np.int64)) < a, k + 1, k)
    return np.clip(k, _E8M0_MIN_EXP, _E8M0_MAX_EXP).astype(np.int32)


def _expand_blocks(scale: np.ndarray, rows: int, cols: int, br: int, bc: int) -> np.ndarray:
    """Blow a [ceil(rows/br), ceil(cols/bc)] grid up to [rows, cols]."""
    return np.repeat(np.repeat(scale, br, axis=0)[:rows], bc, axis=1)[:, :cols]


def _block_amax(w: np.ndarray, br: int, bc: int) -> np.ndarray:
    rows, cols = w.shape
    gr, gc = _ceil_div(rows, br), _ceil_div(cols, bc)
    pad = np.zeros((gr * br, gc * bc), dtype=np.float32)
    pad[:rows, :cols] = np.abs(w)
    return pad.reshape(gr, br, gc, bc).max(axis=(1, 3))


# ---- FP8 e4m3, 128x128 blocks -------------------------------------------------------------------------
def dequant_fp8_blocks(w_e4m3: np.ndarray, scale_e8m0: np.ndarray, block=128) -> np.ndarray:
    """float32 `w * scale[i // br, j // bc]` for a 2-D e4m3 weight and its block scale grid."""
    w = np.asarray(w_e4m3)
    if w.ndim != 2:
        raise ValueError(f"FP8 weight must be 2-D, got shape {w.shape}")
    br, bc = _pair(block)
    rows, cols = w.shape
    want = (_ceil_div(rows, br), _ceil_div(cols, bc))
    if tuple(scale_e8m0.shape) != want:
        raise ValueError(f"FP8 scale shape {tuple(scale_e8m0.shape)} does not fit weight {w.shape} "
                         f"with {br}x{bc} blocks (want {want})")
    s = e8m0_to_float(scale_e8m0)
    out = w.astype(np.float32)
    if rows % br == 0 and cols % bc == 0:
        out = out.reshape(want[0], br, want[1], bc)
        out *= s[:, None, :, None]
        return out.reshape(rows, cols)
    out *= _expand_blocks(s, rows, cols, br, bc)
    return out


def quant_fp8_blocks(w_f32: np.ndarray, block=128) -> tuple[np.ndarray, np.ndarray]:
    """(e4m3 weight, ue8m0 scale grid): scale = 2**ceil(log2(block amax / 448)), w8 = RNE(w / scale)."""
    w = np.asarray(w_f32, dtype=np.float32)
    if w.ndim != 2:
        raise ValueError(f"FP8 weight must be 2-D, got shape {w.shape}")
    if not np.isfinite(w).all():
        raise ValueError("cannot quantize non-finite values to FP8")
    br, bc = _pair(block)
    rows, cols = w.shape
    exp = pow2_scale_exponent(_block_amax(w, br, bc), FP8_MAX)
    inv = _expand_blocks(np.ldexp(1.0, -exp.astype(np.int64)), rows, cols, br, bc)  # float64, exact
    q = np.clip(w.astype(np.float64) * inv, -FP8_MAX, FP8_MAX).astype(E4M3)
    return q, e8m0_from_exponent(exp)


# ---- FP4 e2m1, 1x32 blocks, two codes per byte -------------------------------------------------------
def fp4_codes(x: np.ndarray) -> np.ndarray:
    """4-bit e2m1 codes (uint8 in 0..15) of x, rounding to the nearest value, ties to even, saturating at 6."""
    x = np.clip(np.asarray(x, dtype=np.float32), -FP4_MAX, FP4_MAX)
    return x.astype(E2M1).view(np.uint8) & np.uint8(0x0F)


def pack_fp4(codes: np.ndarray) -> np.ndarray:
    """[rows, cols] codes (cols even) -> int8 [rows, cols/2]; column 2j in the low nibble, 2j+1 in the high."""
    codes = np.asarray(codes, dtype=np.uint8)
    if codes.shape[-1] % 2:
        raise ValueError(f"FP4 packing needs an even last dim, got {codes.shape}")
    lo, hi = codes[..., 0::2] & 0x0F, codes[..., 1::2] & 0x0F
    return (lo | (hi << 4)).astype(np.uint8).view(np.int8)


def unpack_fp4_codes(packed: np.ndarray) -> np.ndarray:
    u = np.asarray(packed).view(np.uint8)
    out = np.empty(u.shape[:-1] + (2 * u.shape[-1],), dtype=np.uint8)
    out[..., 0::2] = u & 0x0F
    out[..., 1::2] = u >> 4
    return out


def unpack_fp4(packed_int8: np.ndarray, scale_e8m0: np.ndarray, block=32) -> np.ndarray:
    """float32 [rows, 2*packed_cols]: e2m1 value of each nibble times its 1 x block scale."""
    packed = np.asarray(packed_int8)
    if packed.ndim != 2:
        raise ValueError(f"FP4 weight must be 2-D, got shape {packed.shape}")
    if packed.dtype not in (np.int8, np.uint8):
        raise ValueError(f"FP4 weight must be packed int8, got {packed.dtype}")
    rows, cols = packed.shape[0], 2 * packed.shape[1]
    bc = int(block)
    want = (rows, _ceil_div(cols, bc))
    if tuple(scale_e8m0.shape) != want:
        raise ValueError(f"FP4 scale shape {tuple(scale_e8m0.shape)} does not fit weight [{rows}, {cols}] "
                         f"with 1x{bc} blocks (want {want})")
    vals = FP4_VALUES[unpack_fp4_codes(packed)]
    s = e8m0_to_float(scale_e8m0)
    if cols % bc == 0:
        vals = vals.reshape(rows, want[1], bc)
        vals *= s[:, :, None]
        return vals.reshape(rows, cols)
    vals *= np.repeat(s, bc, axis=1)[:, :cols]
    return vals


def quant_fp4(w_f32: np.ndarray, block=32) -> tuple[np.ndarray, np.ndarray]:
    """(packed int8 [rows, cols/2], ue8m0 scale [rows, ceil(cols/block)]): scale = 2**ceil(log2(amax / 6))."""
    w = np.asarray(w_f32, dtype=np.float32)
    if w.ndim != 2:
        raise ValueError(f"FP4 weight must be 2-D, got shape {w.shape}")
    if not np.isfinite(w).all():
        raise ValueError("cannot quantize non-finite values to FP4")
    bc = int(block)
    rows, cols = w.shape
    exp = pow2_scale_exponent(_block_amax(w, 1, bc), FP4_MAX)
    inv = np.repeat(np.ldexp(1.0, -exp.astype(np.int64)), bc, axis=1)[:, :cols]
    codes = fp4_codes((w.astype(np.float64) * inv).astype(np.float32))
    return pack_fp4(codes), e8m0_from_exponent(exp)


# ---- error bounds (for tests and sanity checks) -------------------------------------------------------
def fp8_error_bound(w: np.ndarray, scale_full: np.ndarray) -> np.ndarray:
    """Largest |dequant(quant(w)) - w| allowed elementwise, given the per-element scale: half an e4m3 ulp."""
    x = np.abs(np.asarray(w, np.float64)) / scale_full
    # e4m3: 3 mantissa bits, min normal 2**-6, subnormal spacing 2**-9.
    ulp = np.where(x >= 2.0 ** -6, np.ldexp(1.0, np.floor(np.log2(np.maximum(x, 2.0 ** -6))).astype(int) - 3),
                   2.0 ** -9)
    return 0.5 * ulp * scale_full


def fp4_error_bound(w: np.ndarray, scale_full: np.ndarray) -> np.ndarray:
    """Half the e2m1 spacing at |w / scale| (0.5 below 2, 1 in [2, 4), 2 in [4, 6]), times the scale."""
    x = np.abs(np.asarray(w, np.float64)) / scale_full
    spacing = np.where(x < 2.0, 0.5, np.where(x < 4.0, 1.0, 2.0))
    return 0.5 * spacing * scale_full
