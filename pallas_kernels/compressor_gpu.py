"""GPU compressor decode: the projections are two XLA GEMMs (cuBLAS-class bandwidth on the [coff*d, Dm] weights,
which dominate the bytes); one Pallas Triton kernel then does everything that touches the state: writes each
active slot's row, pools the closing slots (reading only their state blocks) and shifts them (CSA), so a decode
step moves the weights + one row per slot (+ one state block per closing slot), instead of the whole state as
the XLA reference's masked updates do. RMSNorm + RoPE on the pooled [B, d] is a small XLA epilogue.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from . import _compat
from ._common import F32, layer_operand, round_up
from .compressor_common import finish_entry, project_f32, state_dims

_CB = 32   # channels per program (per half)
_BB = 16   # slots per program


def decode_supported(x, kv_state, norm_w, ratio, overlap):
    d = norm_w.shape[0]
    return d % _CB == 0 and (d & (d - 1)) == 0


def _state_kernel(layer_ref, pos_ref, a_ref, z_ref, kv_in, sc_in, pooled_ref, kv_ref, sc_ref, *, m, coff, d, cb,
                  bb, B):
    del kv_in, sc_in  # aliased with kv_ref / sc_ref
    j = pl.program_id(0)
    ib = pl.program_id(1)
    off = (coff - 1) * m
    b = ib * bb + lax.broadcasted_iota(jnp.int32, (bb, 1), 0)                  # [bb, 1]
    c = j * cb + lax.broadcasted_iota(jnp.int32, (1, cb), 1)                   # [1, cb]
    p = pos_ref[...][:, None]                                                  # [bb, 1]
    active = (p >= 0) & (b < B)
    close = active & (lax.rem(p + 1, m) == 0)
    slot = off + lax.rem(jnp.maximum(p, 0), m)
    # the state refs are a stack of layers, flat [n * B, ...]: this layer's slot b is row layer * B + b. Rows past
    # B point past the whole stack: masked on GPU, and dropped (instead of clobbering a real row with a stale
    # value) by interpret mode's scatter
    bsafe = jnp.where(b < B, layer_ref[0] * B + b, kv_ref.shape[0])
    new_a = [a_ref[:, h, :] for h in range(coff)]                              # [bb, cb]
    new_z = [z_ref[:, h, :] for h in range(coff)]
    load = _compat.pltriton.load
    store = _compat.pltriton.store

    def at(ref, s, h):
        return ref.at[bsafe, jnp.broadcast_to(s, (bb, 1)), h * d + c]

    def get(ref, s, h, other):
        return load(at(ref, s, h), mask=jnp.broadcast_to(close, (bb, cb)), other=other)

    mx = jnp.full((bb, cb), -jnp.inf, F32)
    num = jnp.zeros((bb, cb), F32)
    den = jnp.zeros((bb, cb), F32)

    def accum(carry, zz, aa):
        mx, num, den = carry
        mx_new = jnp.maximum(mx, zz)
        safe = jnp.where(mx_new > -jnp.inf, mx_new, 0.0)
        alpha = jnp.exp(mx - safe)
        e = jnp.exp(zz - safe)
        return mx_new, alpha * num + e * aa, alpha * den + e

    carry = (mx, num, den)
    cur_last = off + m - 1
    if coff == 2:
        # previous window, first half of the channels
        for s in range(m):
            carry = accum(carry, get(sc_ref, s, 0, -jnp.inf), get(kv_ref, s, 0, 0.0))
        # current window: second half pooled; both halves kept for the shift (the last slot is the new row)
        cur = []
        for s in range(m, 2 * m):
            if s == cur_last:
                vals = (new_a[0], new_z[0], new_a[1], new_z[1])
            else:
                vals = (get(kv_ref, s, 0, 0.0), get(sc_ref, s, 0, -jnp.inf), get(kv_ref, s, 1, 0.0),
                        get(sc_ref, s, 1, -jnp.inf))
            cur.append(vals)
            carry = accum(carry, vals[3], vals[2])
        _, num, den = carry
        pooled_ref[...] = jnp.where(close, num / jnp.where(den > 0, den, 1.0), 0.0)
    else:
        # the m - 1 masked loads per slot run only in programs where some slot closes (HCA m = 128: 1 step in 128
        # per slot; a 127-step loop in every program was 35 us per call on the H200 for 2.5 us of bytes)
        pooled_ref[...] = jnp.zeros((bb, cb), F32)

        @pl.when(jnp.max(close.astype(jnp.int32)) > 0)
        def _():
            def body(s, carry):
                return accum(carry, get(sc_ref, s, 0, -jnp.inf), get(kv_ref, s, 0, 0.0))
            _, num, den = accum(lax.fori_loop(0, m - 1, body, carry), new_z[0], new_a[0])
            pooled_ref[...] = jnp.where(close, num / jnp.where(den > 0, den, 1.0), 0.0)

    # stores last (every load above has been issued): the new row, then (CSA, closing) the shift
    act = jnp.broadcast_to(active, (bb, cb))
    for h in range(coff):
        store(at(kv_ref, slot, h), new_a[h], mask=act)
        store(at(sc_ref, slot, h), new_z[h], mask=act)
    if coff == 2:
        cl = jnp.broadcast_to(close, (bb, cb))
        for i, (a0, z0, a1, z1) in enumerate(cur):
            store(at(kv_ref, i, 0), a0, mask=cl)
            store(at(sc_ref, i, 0), z0, mask=cl)
            store(at(kv_ref, i, 1), a1, mask=cl)
            store(at(sc_ref, i, 1), z1, mask=cl)


def _state_update(pos, a, z, kv_state, score_state, layer=None, *, m, coff, d, interpret=False):
    """States [B, ...], or with `layer` a stack of layers' states [n, B, ...] updated in place at that layer (the
    slice of a stack and its write-back were two copies of the state per layer and step: 0.18 ms of a 2.9 ms
    flash-slice step at batch 32)."""
    B = pos.shape[0]
    shape = kv_state.shape
    kv_state, score_state = (st.reshape(-1, *shape[-2:]) for st in (kv_state, score_state))
    layer = layer_operand(layer)
    cb, bb = _CB, _BB
    Bp = round_up(B, bb)
    pad = Bp - B
    posp = jnp.pad(pos, (0, pad), constant_values=-1)
    a3 = jnp.pad(a, ((0, pad), (0, 0))).reshape(Bp, coff, d)
    z3 = jnp.pad(z, ((0, pad), (0, 0))).reshape(Bp, coff, d)
    kernel = functools.partial(_state_kernel, m=m, coff=coff, d=d, cb=cb, bb=bb, B=B)
    full = lambda x: pl.BlockSpec(x.shape, lambda *_: (0,) * x.ndim)
    pooled, kv, sc = pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((Bp, d), F32), jax.ShapeDtypeStruct(kv_state.shape, F32),
                   jax.ShapeDtypeStruct(score_state.shape, F32)),
        grid=(d // cb, Bp // bb),
        in_specs=[full(layer), pl.BlockSpec((bb,), lambda j, i: (i,)),
                  pl.BlockSpec((bb, coff, cb), lambda j, i: (i, 0, j)),
                  pl.BlockSpec((bb, coff, cb), lambda j, i: (i, 0, j)),
                  full(kv_state), full(score_state)],
        out_specs=(pl.BlockSpec((bb, cb), lambda j, i: (i, j)), full(kv_state), full(score_state)),
        input_output_aliases={4: 1, 5: 2},
        compiler_params=_compat.TritonCompilerParams(num_warps=4, num_stages=1),
        interpret=bool(interpret),
        name="v4_compressor_state_gpu",
    )(layer, posp, a3, z3, kv_state, score_state)
    return pooled[:B], kv.reshape(shape), sc.reshape(shape)


def compressor_decode_gpu(x, pos, kv_state, score_state, wkv, wgate, ape, norm_w, cos_sin, *, ratio, overlap, eps,
                          entry_dtype=F32, interpret=None, layer=None, project=project_f32, projected=None):
    """The decode contract of compressor.compressor_decode_ref. With `layer`, the states are stacks of layers'
    states [n, B, ...], read and returned whole (updated in place at that layer). `project(x, w)` computes the
    f32 projections (default: XLA's matmul; the ops table passes the layer-stack projection kernel); `projected`:
    (x @ wkv.T, x @ wgate.T) [B, coff*d] f32 computed by the caller (with its other projections of x), then
    `project` is not called."""
    m, coff, d = state_dims(kv_state, norm_w, ratio, overlap)
    if interpret is None:
        interpret = _compat.backend() == "cpu"
    pos = pos.astype(jnp.int32)
    a, g = projected if projected is not None else (project(x, wkv), project(x, wgate))
    z = g + ape.astype(F32)[jnp.mod(pos, m)]
    pooled, kv, sc = _state_update(pos, a, z, kv_state.astype(F32), score_state.astype(F32), layer, m=m, coff=coff,
                                   d=d, interpret=interpret)
    close = (pos >= 0) & (jnp.mod(pos + 1, m) == 0)
    cos, sin = cos_sin
    entry = jnp.where(close[:, None], finish_entry(pooled, norm_w, cos, sin, eps=eps, entry_dtype=entry_dtype), 0.0)
    return entry, close, kv, sc
