"""The release's cache entry formats as bytes (reference serving_systems.md §1.1), for `kv_cache_dtype="fp8"`.

FP8 entry (window, C4 and C128 entries; `Fp8Entry`), per entry of `dim` values with the last `rope` in RoPE:
  [0, nope)                      e4m3 codes of the NoPE dims (nope = dim - rope)
  [nope, nope + 2 rope)          the RoPE dims in bf16, little-endian
  [.., + ceil(nope / 64))        ue8m0 scales (2^(byte - 127)), one per 64 NoPE dims
  then zero padding to a multiple of 8 bytes (448 + 128 + 7 + 1 = 584 B for dim 512, rope 64)
FP4 key (C4 indexer keys, already Hadamard-rotated; `Fp4Key`), per key of `dim` values:
  [0, dim / 2)                   e2m1 codes, two per byte, the even dim in the low nibble
  [dim / 2, dim / 2 + dim / 32)  ue8m0 scales, one per 32 dims (64 + 4 = 68 B for dim 128)
  then zero padding to a multiple of 4 bytes (none for dim 128)
Both are whole 32-bit words, which the TPU-style kernels gather (`as_words`) as they gather f32 rows and decode
in place (`decode_words`): word by word, with shifts and same-width bitcasts only (Mosaic changes no bit widths), into
a fixed permutation of the dims (`planar`: the dims each byte or nibble position of the words holds, one plane after
another); the kernels take q in that order too, and put o back.

Encoding rounds exactly as the release does and as v4jax.model.quant simulates it (fp8_roundtrip with block 64
over the NoPE dims, fp4_roundtrip with block 32): decoding gives the simulated values bit for bit. The functions are
plain jnp on the last axis, so the kernels decode rows with them on chip after gathering the bytes.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax import lax

from ._common import e2m1_to_f32

# values per ue8m0 scale: FP8 entry NoPE dims, FP4 indexer key dims. v4jax.config sizes the entries with the same
# two numbers (the kernels import nothing from v4jax; tests/test_kv_fp8.py checks the sizes agree)
FP8_BLOCK, FP4_BLOCK = 64, 32

F32 = jnp.float32
U8, U32 = jnp.uint8, jnp.uint32
FP8_MAX, FP4_MAX = 448.0, 6.0


def pow2_scale(amax, floor, qmax):
    """2^ceil(log2(max(amax, floor) / qmax)) and its ue8m0 byte, exactly (frexp, not exp2/log2, which round on
    some backends)."""
    mant, exp = jnp.frexp(jnp.maximum(amax, floor) / qmax)
    e = jnp.where(mant == 0.5, exp - 1, exp)
    return jnp.ldexp(jnp.ones_like(mant), e), (e + 127).astype(U8)


def _ue8m0(b):
    """ue8m0 bytes -> 2^(b - 127) in f32 (the byte is the f32 exponent field; 0 is never written)."""
    return lax.bitcast_convert_type(b.astype(U32) << 23, F32)


def _blocks(x, block):
    """The last axis as [..., n_blocks, block], zero-padded (zeros never raise amax)."""
    pad = (-x.shape[-1]) % block
    if pad:
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])
    return x.reshape(*x.shape[:-1], -1, block)


def _expand(s, block, n):
    """Per-block values [..., nb] -> per-value [..., n]."""
    return jnp.broadcast_to(s[..., None], (*s.shape, block)).reshape(*s.shape[:-1], -1)[..., :n]


def e2m1_code(y):
    """|y| <= 6 -> the e2m1 magnitude code 0..7 of the nearest value of [0, .5, 1, 1.5, 2, 3, 4, 6], ties to the
    even code (hardware round-to-nearest-even): a tie below an odd code rounds up, below an even one down."""
    a = jnp.abs(y)
    up = [(0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False)]
    code = jnp.zeros(a.shape, jnp.int32)
    for t, tie_up in up:
        code = code + ((a >= t) if tie_up else (a > t)).astype(jnp.int32)
    return code


def _e4m3_value(c):
    """e4m3 codes (uint32 0..255, NaN never stored) -> f32: the f32 bit pattern of a normal code, m * 2^-9 of a
    subnormal one."""
    sign = (c >> 7) << 31
    e, m = (c >> 3) & 15, c & 7
    normal = lax.bitcast_convert_type(sign | ((e + 120) << 23) | (m << 20), F32)
    sub = m.astype(F32) * 2.0 ** -9
    return jnp.where(e == 0, jnp.where(sign != 0, -sub, sub), normal)


def _byte_of(w, i):
    """Byte i (static) of the little-endian words w [..., n] as uint32 [..., 1]."""
    return (w[..., i // 4:i // 4 + 1] >> (8 * (i % 4))) & 0xFF


def _per_plane(scales, group, n):
    """Per-block scales (a list of [..., 1]) -> [..., n] for a plane whose element i lies in block i // group."""
    parts = [jnp.broadcast_to(s, (*s.shape[:-1], min(group, n - j * group))) for j, s in enumerate(scales)
             if j * group < n]
    return jnp.concatenate(parts, axis=-1)


def _bytes_le(u16):
    """uint16-valued ints [..., n] -> their bytes [..., 2n], low byte first."""
    u = u16.astype(U32)
    return jnp.stack([u & 0xFF, u >> 8], axis=-1).reshape(*u.shape[:-1], -1).astype(U8)


@dataclasses.dataclass(frozen=True)
class Fp8Entry:
    """The FP8 KV entry of `dim` values, the last `rope` of them RoPE dims kept in bf16 (module doc)."""
    dim: int
    rope: int

    @property
    def nope(self) -> int:
        return self.dim - self.rope

    @property
    def n_scales(self) -> int:
        return -(-self.nope // FP8_BLOCK)

    @property
    def nbytes(self) -> int:
        return -(-(self.nope + 2 * self.rope + self.n_scales) // 8) * 8

    def encode(self, x):
        """x [..., dim] -> uint8 [..., nbytes]."""
        x = x.astype(F32)
        xb = _blocks(x[..., :self.nope], FP8_BLOCK)
        s, sb = pow2_scale(jnp.max(jnp.abs(xb), axis=-1), 1e-4, FP8_MAX)
        q = jnp.clip(xb / s[..., None], -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn)
        q = lax.bitcast_convert_type(q, U8).reshape(*x.shape[:-1], -1)[..., :self.nope]
        rope = _bytes_le(lax.bitcast_convert_type(x[..., self.nope:].astype(jnp.bfloat16), jnp.uint16))
        pad = jnp.zeros((*x.shape[:-1], self.nbytes - self.nope - 2 * self.rope - self.n_scales), U8)
        return jnp.concatenate([q, rope, sb, pad], axis=-1)

    @property
    def planar(self):
        """The dims in `decode_words`' order: NoPE dims 4i + b for b = 0..3 (byte b of word i), then RoPE dims
        2i and 2i + 1 (the low and high half of word i)."""
        import numpy as np
        nope, rope = self.nope, self.rope
        return np.concatenate([np.arange(b, nope, 4) for b in range(4)]
                              + [nope + np.arange(h, rope, 2) for h in range(2)])

    def decode_words(self, w, dtype=F32):
        """uint32 words [..., nbytes / 4] (as_words) -> [..., dim] in dtype, the dims in `planar` order."""
        nope, rope = self.nope, self.rope
        if nope % 4:
            raise ValueError(f"FP8 entries decode by words when the NoPE dims are a multiple of 4, got {nope}")
        nw, off = nope // 4, nope + 2 * rope
        scales = [_ue8m0(_byte_of(w, off + j)) for j in range(self.n_scales)]
        s = _per_plane(scales, FP8_BLOCK // 4, nw)
        codes = w[..., :nw]
        planes = [_e4m3_value((codes >> (8 * b)) & 0xFF) * s for b in range(4)]
        r = w[..., nw:nw + rope // 2]
        planes += [lax.bitcast_convert_type(r << 16, F32), lax.bitcast_convert_type((r >> 16) << 16, F32)]
        return jnp.concatenate(planes, axis=-1).astype(dtype)

    def decode(self, b, dtype=F32):
        """uint8 [..., nbytes] -> [..., dim] in dtype."""
        nope, rope = self.nope, self.rope
        q = lax.bitcast_convert_type(b[..., :nope], jnp.float8_e4m3fn).astype(F32)
        s = _ue8m0(b[..., nope + 2 * rope:nope + 2 * rope + self.n_scales])
        rb = b[..., nope:nope + 2 * rope].astype(U32).reshape(*b.shape[:-1], rope, 2)
        r = lax.bitcast_convert_type((rb[..., 0] | (rb[..., 1] << 8)) << 16, F32)
        return jnp.concatenate([q * _expand(s, FP8_BLOCK, nope), r], axis=-1).astype(dtype)


@dataclasses.dataclass(frozen=True)
class Fp4Key:
    """The FP4 indexer key of `dim` values (a multiple of 32; module doc)."""
    dim: int

    def __post_init__(self):
        if self.dim % FP4_BLOCK:
            raise ValueError(f"FP4 indexer keys need index_head_dim a multiple of {FP4_BLOCK}, got {self.dim}")

    @property
    def nbytes(self) -> int:
        return -(-(self.dim // 2 + self.dim // FP4_BLOCK) // 4) * 4

    def encode(self, x):
        """x [..., dim] (Hadamard-rotated keys) -> uint8 [..., nbytes]."""
        xb = _blocks(x.astype(F32), FP4_BLOCK)
        s, sb = pow2_scale(jnp.max(jnp.abs(xb), axis=-1), FP4_MAX * 2.0 ** -126, FP4_MAX)
        y = jnp.clip(xb / s[..., None], -FP4_MAX, FP4_MAX)
        code = (e2m1_code(y) | jnp.where(y < 0, 8, 0)).reshape(*x.shape[:-1], self.dim // 2, 2)
        packed = (code[..., 0] | (code[..., 1] << 4)).astype(U8)
        pad = jnp.zeros((*x.shape[:-1], self.nbytes - self.dim // 2 - sb.shape[-1]), U8)
        return jnp.concatenate([packed, sb, pad], axis=-1)

    @property
    def planar(self):
        """The dims in `decode_words`' order: dims 8i + j for j = 0..7 (nibble j of word i)."""
        import numpy as np
        return np.concatenate([np.arange(j, self.dim, 8) for j in range(8)])

    def decode_words(self, w, dtype=F32):
        """uint32 words [..., nbytes / 4] (as_words) -> [..., dim] in dtype, the dims in `planar` order."""
        nw, half = self.dim // 8, self.dim // 2
        s = _per_plane([_ue8m0(_byte_of(w, half + j)) for j in range(self.dim // FP4_BLOCK)], FP4_BLOCK // 8, nw)
        codes = w[..., :nw]
        return jnp.concatenate([e2m1_to_f32((codes >> (4 * j)) & 15) * s for j in range(8)], axis=-1).astype(dtype)

    def decode(self, b, dtype=F32):
        """uint8 [..., nbytes] -> [..., dim] in dtype."""
        half = self.dim // 2
        p = b[..., :half].astype(jnp.int32)
        code = jnp.stack([p & 15, p >> 4], axis=-1).reshape(*b.shape[:-1], self.dim)
        s = _ue8m0(b[..., half:half + self.dim // FP4_BLOCK])
        return (e2m1_to_f32(code) * _expand(s, FP4_BLOCK, self.dim)).astype(dtype)


def as_words(pool):
    """uint8 rows [R, E] (E a multiple of 4) -> the same bytes as uint32 words [R, E / 4]."""
    return lax.bitcast_convert_type(pool.reshape(*pool.shape[:-1], -1, 4), U32)


def decode_rows(pool, rows, fmt, dtype):
    """pool[rows] (rows in range) as values: gathered, then decoded where `fmt` (an entry format) is set, else cast
    to dtype."""
    got = pool[rows]
    return got.astype(dtype) if fmt is None else fmt.decode(got, dtype)


def decoded_pool(pool, rows, fmt, dtype):
    """The rows [...] of pool (-1: none) decoded to dtype as a pool of their own [rows.size, K], and each row's place
    in it (-1 kept): what a bf16 pool's kernel then reads in place of the bytes."""
    vals = decode_rows(pool, jnp.maximum(rows, 0), fmt, dtype)
    return (vals.reshape(rows.size, vals.shape[-1]),
            jnp.where(rows >= 0, jnp.arange(rows.size, dtype=jnp.int32).reshape(rows.shape), -1))
