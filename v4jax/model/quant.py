"""The official release's quantisation numerics as jnp round trips (reference §9.1), for `quant_sim=True`, and the
release's weight storage (FP8 / FP4 blocks, reference §8.1) as the model holds it when kept as stored.

Values stay in float; each function rounds x exactly as the official kernels store it (FP8 e4m3 with ue8m0
power-of-two block scales, FP4 e2m1 with power-of-two block scales, both round-to-nearest-even)."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from scipy.linalg import hadamard

from pallas_kernels import kv_format
from pallas_kernels._common import e2m1_to_f32, ue8m0_to_f32

F32 = jnp.float32
FP8_MAX = 448.0
FP4_MAX = 6.0


def _blocks(x, block):
    """View the last axis as [..., n_blocks, block], zero-padding a ragged tail (zeros never raise amax)."""
    k = x.shape[-1]
    pad = (-k) % block
    if pad:
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])
    return x.reshape(*x.shape[:-1], -1, block), k


def _pow2_scale(amax, floor, qmax):
    """2^ceil(log2(max(amax, floor) / qmax)), exactly (the stored formats' scale: pallas_kernels.kv_format)."""
    return kv_format.pow2_scale(amax, floor, qmax)[0]


def fp8_roundtrip(x, block: int):
    """act_quant(..., inplace): s = 2^ceil(log2(max(amax, 1e-4) / 448)); x <- e4m3(clip(x / s)) * s."""
    xb, k = _blocks(x.astype(F32), block)
    s = _pow2_scale(jnp.max(jnp.abs(xb), axis=-1, keepdims=True), 1e-4, FP8_MAX)
    q = jnp.clip(xb / s, -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn).astype(F32) * s
    return q.reshape(*x.shape[:-1], -1)[..., :k].astype(x.dtype)


def _round_e2m1(y):
    """Round |y| <= 6 to the nearest e2m1 value, ties to the even mantissa (hardware RNE), as FP4 keys store it."""
    return e2m1_to_f32(kv_format.e2m1_code(y) | jnp.where(y < 0, 8, 0))


def fp4_roundtrip(x, block: int = 32):
    """fp4_act_quant(..., inplace): s = 2^ceil(log2(max(amax, 6*2^-126) / 6)); x <- e2m1(clip(x / s)) * s."""
    xb, k = _blocks(x.astype(F32), block)
    s = _pow2_scale(jnp.max(jnp.abs(xb), axis=-1, keepdims=True), FP4_MAX * 2.0 ** -126, FP4_MAX)
    q = _round_e2m1(jnp.clip(xb / s, -FP4_MAX, FP4_MAX)) * s
    return q.reshape(*x.shape[:-1], -1)[..., :k].astype(x.dtype)


def hadamard_rotate(x):
    """Normalised Walsh-Hadamard transform along the last axis (a power of two): x @ H * n^-0.5."""
    n = x.shape[-1]
    h = jnp.asarray(hadamard(n) * n ** -0.5, F32)
    return jnp.einsum("...i,ij->...j", x.astype(F32), h).astype(x.dtype)


# ---- weights kept in the checkpoint's storage (reference §8.1) ------------------------------------------------
FP8_BLOCK = 128  # FP8 weights: one ue8m0 scale per 128 x 128 block
FP4_BLOCK = 32  # FP4 weights: one ue8m0 scale per 1 x 32 block along the input
STORAGES = ("fp8", "fp4")


@dataclasses.dataclass(frozen=True)
class WeightFormat:
    """How the weights the release quantises are held: `linear` "fp8" (e4m3, 128x128 ue8m0 blocks) or None (the
    model dtype) for the FP8 linears (attention projections, the indexer's wq_b, the shared expert, MTP's
    e_proj / h_proj); `experts` "fp4" (e2m1 two per byte, 1x32 ue8m0 blocks), "fp8" or None for the routed
    experts."""
    linear: str | None = None
    experts: str | None = None

    def __post_init__(self):
        if self.linear not in (None, "fp8") or self.experts not in (None, *STORAGES):
            raise ValueError(f"weight format: linear must be 'fp8' or None, experts 'fp4', 'fp8' or None; got {self}")

    @property
    def quantized(self) -> bool:
        return self.linear is not None or self.experts is not None


DEQUANTIZED = WeightFormat()
RELEASE = WeightFormat("fp8", "fp4")  # the current release (reference §1.1 `expert_dtype` fp4)


def scale_shape(storage: str, shape) -> tuple[int, ...]:
    """Shape of the ue8m0 scales of a weight of logical shape [..., O, I]."""
    *lead, o, i = shape
    if storage == "fp8":
        return (*lead, -(-o // FP8_BLOCK), -(-i // FP8_BLOCK))
    return (*lead, o, -(-i // FP4_BLOCK))


def stored_shape(storage: str, shape) -> tuple[int, ...]:
    """Shape of the stored values of a weight of logical shape [..., O, I] (FP4: two codes a byte)."""
    *lead, o, i = shape
    return (*lead, o, i) if storage == "fp8" else (*lead, o, -(-i // 2))


STORED_DTYPES = {"fp8": jnp.float8_e4m3fn, "fp4": jnp.uint8}
SCALE_DTYPE = jnp.float8_e8m0fnu


_FP4_LUT = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                    np.float32)


def _expand(s, axis: int, block: int, n: int):
    return jnp.repeat(s, block, axis=axis)[(slice(None),) * (s.ndim + axis) + (slice(0, n),)]


def dequantize(values, scale, storage: str, dtype, shape):
    """The weight [..., O, I] in `dtype` from its stored values and scales (exact: an e4m3 or e2m1 value times a
    power of two is a bf16 number)."""
    *_, o, i = shape
    s = ue8m0_to_f32(scale)
    if storage == "fp8":
        w = values.astype(F32) * _expand(_expand(s, -2, FP8_BLOCK, o), -1, FP8_BLOCK, i)
    else:
        codes = jnp.stack([values & 0x0F, values >> 4], axis=-1).reshape(*values.shape[:-1], -1)[..., :i]
        w = jnp.asarray(_FP4_LUT)[codes.astype(jnp.int32)] * _expand(s, -1, FP4_BLOCK, i)
    return w.astype(dtype)


def _block_scale_exponent(amax, qmax):
    """Integer k with 2^k = 2^ceil(log2(amax / qmax)) (frexp: exact), clipped to the ue8m0 range."""
    mant, exp = jnp.frexp(jnp.maximum(amax, qmax * 2.0 ** -127) / qmax)
    return jnp.clip(jnp.where(mant == 0.5, exp - 1, exp), -127, 127)


def quantize(w, storage: str):
    """(values, scales) of a float weight [..., O, I] in `storage` (reference §8.1: the block amax over the format's
    largest value, rounded up to a power of two; values rounded to nearest, ties to even)."""
    *lead, o, i = w.shape
    w = w.astype(F32)
    if storage == "fp8":
        po, pi = (-o) % FP8_BLOCK, (-i) % FP8_BLOCK
        wp = jnp.pad(w, [(0, 0)] * len(lead) + [(0, po), (0, pi)])
        blocks = wp.reshape(*lead, (o + po) // FP8_BLOCK, FP8_BLOCK, (i + pi) // FP8_BLOCK, FP8_BLOCK)
        k = _block_scale_exponent(jnp.max(jnp.abs(blocks), axis=(-3, -1)), FP8_MAX)
        inv = jnp.ldexp(jnp.ones_like(k, F32), -k)
        q = jnp.clip(w * _expand(_expand(inv, -2, FP8_BLOCK, o), -1, FP8_BLOCK, i), -FP8_MAX, FP8_MAX)
        values = q.astype(jnp.float8_e4m3fn)
    else:
        pi = (-i) % FP4_BLOCK
        wp = jnp.pad(w, [(0, 0)] * (len(lead) + 1) + [(0, pi)])
        k = _block_scale_exponent(jnp.max(jnp.abs(wp.reshape(*lead, o, -1, FP4_BLOCK)), axis=-1), FP4_MAX)
        inv = jnp.ldexp(jnp.ones_like(k, F32), -k)
        q = jnp.clip(w * _expand(inv, -1, FP4_BLOCK, i), -FP4_MAX, FP4_MAX)
        codes = jax.lax.bitcast_convert_type(q.astype(jnp.float4_e2m1fn), jnp.uint4).astype(jnp.uint8)
        codes = jnp.pad(codes, [(0, 0)] * (len(lead) + 1) + [(0, i % 2)])
        values = codes[..., 0::2] | (codes[..., 1::2] << 4)
    scale = jax.lax.bitcast_convert_type((k + 127).astype(jnp.uint8), SCALE_DTYPE)
    return values, scale


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Quantized:
    """A weight [..., O, I] as stored: `values` (e4m3, or e2m1 codes two a byte) and ue8m0 `scale`s. Indexing its
    leading axes (a layer of a stack, the experts of a gather) indexes both; `astype(dtype)` dequantizes, so the
    matmul forms written for float weights read it unchanged (and round their inputs: `act_quant`)."""
    values: jax.Array
    scale: jax.Array
    storage: str = dataclasses.field(metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, ...]:
        *lead, o, i = self.values.shape
        return (*lead, o, i if self.storage == "fp8" else 2 * i)

    @property
    def ndim(self) -> int:
        return self.values.ndim

    def __getitem__(self, index):
        index = index if isinstance(index, tuple) else (index,)
        assert len(index) <= self.ndim - 2, "only the leading (stack, expert) axes are indexed"
        return Quantized(self.values[index], self.scale[index], self.storage)

    def astype(self, dtype):
        return dequantize(self.values, self.scale, self.storage, dtype, self.shape)
