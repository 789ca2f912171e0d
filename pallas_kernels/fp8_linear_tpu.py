"""y = x @ w[layer].T on a TPU for w as the release stores it (e4m3 values, one ue8m0 scale per 128 x 128 block),
read in place from its layer stack: a decode step's few tokens and a prefill chunk alike (Mosaic).

Why: XLA-TPU does not fuse the dequantization into the matmul. Compiled with libtpu for v5e and v6e (the AOT
compiler; no TPU attached), the XLA form of an FP8 linear (v4jax.model.layers.linear on a quant.Quantized weight,
ops._linear_xla) at Flash's wq_b, [32768, 1024] of a 4-layer stack, batch 1: 268 MB of temporaries, the widened
weight written to HBM and read back, for 33.5 MB of e4m3 bytes; batch 32 and 2048: 134 MB. This kernel reads the
e4m3 tiles from HBM into VMEM and widens them there, so the matmul moves the stored bytes once.

The products are the reference's: an e4m3 value widened to x's dtype is exact, and a 128 x 128 block's partial
sums are scaled by the block's power of two in f32 (exact, where the reference scales the weight before the
matmul); only the order of the f32 sums differs. x is taken as it comes (the model's FP8 linears round their
input to FP8 before: layers.Linear; the grouped wo_a's input the release does not round).

Einsum letters: M tokens, D input width (in blocks of 128), O outputs, G groups, n layers.

  x [..., D] (groups: [..., G, D]) in bf16 or f32; w [n, O, D] e4m3 (or [O, D] without `layer`); scale [O/128,
  D/128] ue8m0 (layer `layer`'s) -> y [..., O] f32 (groups: [..., G, O/G]).

  Grid (M/BM, O/BO): program (i, j) holds x's row tile [BM, D] (for a group's outputs, that group's D columns)
  and the weight tile w[layer, j*BO : (j+1)*BO, :] in VMEM (the layer index is a prefetched scalar, so the tile
  is DMA'd from the stack where it lies), and for each 128-row block r of the tile and each 128-wide D block kb:
      y[:, r] += (x[:, kb] @ widen(w[r, kb]).T) * scale[r, kb]          [BM, 128] f32
  The layer's scales, converted to f32 before the call (one small XLA fusion), sit in SMEM and are read as
  scalars. BO is chosen so that a weight tile is about TILE_BYTES (the grid step's fixed cost, ~0.35 us, against
  the tile's DMA); not yet timed on a TPU.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from . import _compat
from ._common import ue8m0_to_f32

F32 = jnp.float32
E4M3 = jnp.float8_e4m3fn
BLOCK = 128  # the release's weight block: one ue8m0 scale per 128 x 128
TILE_BYTES = 1 << 20  # e4m3 bytes of one program's weight tile
MAX_ROWS = 256  # x rows per program (a prefill chunk's tile: 256 x D in bf16 beside the weight tile in VMEM)


def supported(x, w, groups: int = 1) -> bool:
    """e4m3 weights whose outputs per group and inputs are whole 128-blocks, x in bf16 or f32 with the weight's
    input width (per group)."""
    n_out, d = w.shape[-2:]
    return (w.dtype == E4M3 and x.dtype in (jnp.bfloat16, F32) and x.shape[-1] == d and n_out % groups == 0
            and (n_out // groups) % BLOCK == 0 and d % BLOCK == 0
            and (groups == 1 or (x.ndim >= 2 and x.shape[-2] == groups)))


def block_out(group_out: int, d: int, tile_bytes: int = TILE_BYTES) -> int:
    """Outputs per program: the largest multiple of 128 dividing a group's outputs whose e4m3 tile [BO, D] is at
    most tile_bytes (at least 128)."""
    bo = max(BLOCK, min(group_out, tile_bytes // d) // BLOCK * BLOCK)
    while group_out % bo:
        bo -= BLOCK
    return bo


def _kernel(layer_ref, x_ref, w_ref, s_ref, y_ref, *, bo: int, d: int):
    del layer_ref  # used by the index maps
    j = pl.program_id(1)
    nk = d // BLOCK
    for r in range(bo // BLOCK):
        srow = j * (bo // BLOCK) + r

        def step(kb, acc, r=r, srow=srow):
            col = pl.multiple_of(kb * BLOCK, BLOCK)
            xb = x_ref[:, pl.ds(col, BLOCK)]
            wb = w_ref[pl.ds(r * BLOCK, BLOCK), pl.ds(col, BLOCK)].astype(xb.dtype)
            part = lax.dot_general(xb, wb, (((1,), (1,)), ((), ())), preferred_element_type=F32)
            return acc + part * s_ref[srow, kb]

        y_ref[:, r * BLOCK:(r + 1) * BLOCK] = lax.fori_loop(
            0, nk, step, jnp.zeros((x_ref.shape[0], BLOCK), F32))


def fp8_linear(x, w, layer=None, groups: int = 1, *, scale, interpret=None, tile_bytes: int = TILE_BYTES,
               max_rows: int = MAX_ROWS):
    """x @ w[layer].T in f32 for e4m3 w with 128 x 128 ue8m0 scales (the module doc); interpret=None: Pallas's
    interpreter unless on a TPU. Shapes must pass `supported`."""
    if interpret is None:
        interpret = _compat.backend() != "tpu"
    if not supported(x, w, groups):
        raise ValueError(f"x {x.shape} {x.dtype}, w {w.shape} {w.dtype}, groups {groups}: expected e4m3 weights "
                         f"of whole 128-blocks per group and x of their input width")
    if layer is None:
        w, layer = w[None], 0
    _, n_out, d = w.shape
    go = n_out // groups
    lead = x.shape[:-2] if groups > 1 else x.shape[:-1]
    # groups: the [M, G * D] view, a group's input a block of D columns (a squeezed G axis is not a TPU block).
    # On a TPU, whose arrays are tiled over their last two dims, the view is a relayout: a copy of x (libtpu AOT,
    # v5e, the grouped wo_a: none at batch 1 and 32, 134 MB at a 2048-token chunk)
    x2 = x.reshape(-1, groups * d)
    m = x2.shape[0]
    bm = m if m <= max_rows else max_rows
    mp = -(-m // bm) * bm
    if mp != m:
        x2 = jnp.pad(x2, ((0, mp - m), (0, 0)))
    bo = block_out(go, d, tile_bytes)
    per_group = go // bo
    s = ue8m0_to_f32(scale)
    layer = jnp.asarray(layer, jnp.int32).reshape(1)
    y = pl.pallas_call(
        functools.partial(_kernel, bo=bo, d=d),
        out_shape=jax.ShapeDtypeStruct((mp, n_out), F32),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(mp // bm, n_out // bo),
            in_specs=[pl.BlockSpec((bm, d), lambda i, j, lr: (i, j // per_group)),
                      pl.BlockSpec((None, bo, d), lambda i, j, lr: (lr[0], j, 0)),
                      pl.BlockSpec(memory_space=pltpu.SMEM)],
            out_specs=pl.BlockSpec((bm, bo), lambda i, j, lr: (i, j))),
        compiler_params=_compat.TPUCompilerParams(dimension_semantics=("parallel", "parallel")),
        interpret=_compat.interpret_arg(interpret, "hlo"),
        name="v4_fp8_linear_tpu",
    )(layer, x2, w, s)
    y = y[:m]
    if groups > 1:
        return y.reshape(*lead, groups, go)
    return y.reshape(*lead, n_out)

