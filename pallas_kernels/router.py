"""The MoE router of a top-k layer (reference: v4jax.model.layers.route_by with the selection bias) as two GPU kernels
in place of XLA's chain.

route_by casts x to f32, multiplies it by the gate [E, D] in f32 (HIGHEST precision), takes sqrt(softplus(.)),
adds the selection bias, picks the top k (lax.top_k: XLA runs it as a sort), gathers the unbiased scores of the
picks and normalises them: about six launches of a microsecond or two a layer at decode sizes (the H200 profile of
a flash-slice decode step, docs/results/h200-spec-fixed, counts 11 sorts a step). Hash layers keep XLA's form.

  scores kernel, grid (M / BM, E / BE): program (i, j) reads its BM tokens' x and its BE experts' gate rows over
  all of D, BD columns a step, and writes sqrt(softplus(x . w)) [BM, BE] f32. The gate (E x D in the model's
  dtype: 3.7 MB bf16 at Flash's sizes) is the largest read: split over the experts it is read by E / BE programs at
  once, where one program per token would read it alone. With BM and BE >= 16 the products are a Triton dot
  accumulated in f32: of x and the gate as they are when both are bf16 (the tensor cores; a product of two bf16
  values is exact in f32), else of their f32 values in IEEE f32 (no TF32). Below that (a few tokens) the program
  accumulates x * w elementwise in f32 over the D steps and sums once at the end, so that BE can be small (more
  programs reading the gate at batch 1).

  select kernel, grid (M / BS,): program i reads its BS tokens' scores [BS, E'] (E' = E rounded up to a power of
  two: Triton's rule for every value; the columns past E are masked) and the bias, and picks the top k of
  scores + bias in k rounds (the max, the lowest index that holds it, that column masked): lax.top_k's order,
  higher value first, then the lower expert index. Each pick's unbiased score is gathered as it is taken; the
  weights are w / (sum w + 1e-20) * route_scale in route_by's order of operations (the sum of the k picks runs
  left to right: an ulp apart from XLA's). Each pick's column of the outputs is written by itself (k = 6 is not a
  power of two).

Numerics: f32 throughout; the gate's sum runs in another order than XLA's (f32 rounding apart), so experts whose
biased scores lie within ~1e-6 of each other may come out in another order than route_by's; exact ties (equal
scores) follow lax.top_k's rule. Not yet timed on a GPU (v4jax bench kernels --sweep router): a candidate.

  x [M, D] (any float dtype), gate_w [E, D] (any float dtype), bias [E] -> weights [M, k] f32, experts [M, k] int32.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ._common import next_pow2, pow2_block
from ._compat import TritonCompilerParams, backend

F32, I32 = jnp.float32, jnp.int32
HI = jax.lax.Precision.HIGHEST
# Not yet timed on a GPU (v4jax bench kernels --sweep router): 16 tokens x 16 experts x 256 columns (the dot form)
# from 16 tokens on; below that 4 experts a program (64 programs read Flash's gate at batch 1, ~57 KB each). The
# select kernel's BS x E' values (the scores, the biased scores, the column ids) are 16 each a thread with 4 warps at
# BS = 8, E' = 256.
BLOCK_TOKENS, BLOCK_EXPERTS, BLOCK_D = 16, 16, 256
SMALL_BLOCK_EXPERTS = 4
SELECT_TOKENS = 8


def supported(x, gate_w, bias, k: int) -> bool:
    """x [M, D] and gate_w [E, D] with D a multiple of a power-of-two block of at least 16, bias [E], 1 <= k <= E."""
    if x.ndim != 2 or gate_w.ndim != 2 or bias is None or bias.ndim != 1:
        return False
    e, d = gate_w.shape
    return x.shape[1] == d and bias.shape[0] == e and 1 <= k <= e and pow2_block(d, BLOCK_D) is not None


def _scores_kernel(layer_ref, x_ref, w_ref, o_ref, *, block_d: int, n_steps: int, dot: bool, bf16_dot: bool,
                   stacked: bool):
    bm, be = o_ref.shape
    li, rows = layer_ref[0], pl.ds(pl.program_id(1) * be, be)

    def step(c, acc):
        off = pl.multiple_of(c * block_d, block_d)
        xb = x_ref[:, pl.ds(off, block_d)]  # [BM, BD]
        # [BE, BD]: stacked, the whole stack's ref and layer li's rows read in place (E a multiple of BE)
        wb = w_ref[li, rows, pl.ds(off, block_d)] if stacked else w_ref[:, pl.ds(off, block_d)]
        if dot and bf16_dot:  # bf16 products are exact in f32: the tensor cores' dot, accumulated in f32
            return acc + jax.lax.dot_general(xb, wb, (((1,), (1,)), ((), ())), preferred_element_type=F32)
        xb, wb = xb.astype(F32), wb.astype(F32)
        if dot:
            return acc + jax.lax.dot_general(xb, wb, (((1,), (1,)), ((), ())), precision=(HI, HI),
                                             preferred_element_type=F32)
        return acc + xb[:, None, :] * wb[None, :, :]

    acc = jnp.zeros((bm, be) if dot else (bm, be, block_d), F32)
    acc = jax.lax.fori_loop(0, n_steps, step, acc)
    logits = acc if dot else jnp.sum(acc, axis=2)
    o_ref[...] = jnp.sqrt(jax.nn.softplus(logits))


def _select_kernel(layer_ref, s_ref, b_ref, w_ref, e_ref, *, n_experts: int, k: int, route_scale: float,
                   stacked: bool):
    bs, ep = s_ref.shape
    s = s_ref[...]  # [BS, E'] unbiased scores
    iota = jax.lax.broadcasted_iota(I32, (bs, ep), 1)
    bias = b_ref[layer_ref[0], :] if stacked else b_ref[...]
    v = jnp.where(iota < n_experts, s + bias[None, :], -jnp.inf)
    picks, ws = [], []
    for _ in range(k):
        top = jnp.max(v, axis=1, keepdims=True)
        idx = jnp.min(jnp.where(v == top, iota, ep), axis=1, keepdims=True)  # the lowest index of the max
        hit = iota == idx
        ws.append(jnp.sum(jnp.where(hit, s, 0.0), axis=1))  # exact: one score and zeros
        picks.append(idx[:, 0])
        v = jnp.where(hit, -jnp.inf, v)
    tot = ws[0]
    for w in ws[1:]:
        tot = tot + w
    den = tot + 1e-20
    for j in range(k):
        w_ref[:, j] = ws[j] / den * route_scale
        e_ref[:, j] = picks[j]


def route(x, gate_w, bias, layer=None, bias_layer=None, *, k: int, route_scale: float, interpret=None,
          block_tokens: int = BLOCK_TOKENS, block_experts: int | None = None, block_d: int = BLOCK_D,
          num_warps: int = 4, select_tokens: int = SELECT_TOKENS, select_warps: int = 4, bf16_dot: bool = True):
    """The Pallas form of route_by(x, gate_w, bias, None, cfg) (v4jax.model.layers) for the
    top-k router: (weights [M, k] f32, experts [M, k] int32). block_experts None: BLOCK_EXPERTS when the token block
    is a dot's (>= 16 tokens), else SMALL_BLOCK_EXPERTS. bf16_dot: with x and the gate both bf16, the dot form
    multiplies them as they are (tensor cores; every product is exact in f32, the sums f32), else in IEEE f32.
    With `layer` (a scalar) gate_w is a layer stack [n, E, D] and bias one [n', E] with `bias_layer` its row: for
    a power-of-two E the kernels read them in place (inside the layer loop a slice fed to a kernel is a copy, a
    launch each), else they are sliced here."""
    if interpret is None:
        interpret = backend() == "cpu"
    stacked = layer is not None
    if stacked and gate_w.shape[-2] != next_pow2(gate_w.shape[-2]):
        gate_w = jax.lax.dynamic_index_in_dim(gate_w, layer, 0, keepdims=False)
        bias = jax.lax.dynamic_index_in_dim(bias, bias_layer, 0, keepdims=False)
        stacked = False
    if not supported(x, gate_w[0] if stacked else gate_w, bias[0] if stacked else bias, k):
        raise ValueError(f"x {x.shape}, gate_w {gate_w.shape}, bias {None if bias is None else bias.shape}, k {k}: "
                         f"expected x [M, D], gate_w [E, D], bias [E], 1 <= k <= E and D a multiple of a "
                         f"power-of-two block of at least 16")
    m, d = x.shape
    e = gate_w.shape[-2]
    ep = next_pow2(e)
    bm = min(block_tokens, next_pow2(m))
    if block_experts is None:
        block_experts = BLOCK_EXPERTS if bm >= 16 else SMALL_BLOCK_EXPERTS
    be = min(block_experts, ep)
    dot = bm >= 16 and be >= 16
    bd = pow2_block(d, block_d)
    kw = lambda warps: (dict(interpret=True) if interpret
                        else dict(compiler_params=TritonCompilerParams(num_warps=warps, num_stages=1)))
    full = lambda a: pl.BlockSpec(a.shape, lambda *_: (0,) * a.ndim)
    layers = jnp.stack([jnp.asarray(layer if stacked else 0, I32), jnp.asarray(bias_layer if stacked else 0, I32)])
    gate_spec = full(gate_w) if stacked else pl.BlockSpec((be, d), lambda i, j: (j, 0))
    scores = pl.pallas_call(
        functools.partial(_scores_kernel, block_d=bd, n_steps=d // bd, dot=dot,
                          bf16_dot=bf16_dot and x.dtype == gate_w.dtype == jnp.bfloat16, stacked=stacked),
        out_shape=jax.ShapeDtypeStruct((m, ep), F32), grid=(pl.cdiv(m, bm), pl.cdiv(e, be)),
        in_specs=[full(layers), pl.BlockSpec((bm, d), lambda i, j: (i, 0)), gate_spec],
        out_specs=pl.BlockSpec((bm, be), lambda i, j: (i, j)), name="v4_router_scores", **kw(num_warps),
    )(layers, x, gate_w)
    bs = min(select_tokens, next_pow2(m))
    bias = bias.astype(F32)
    return pl.pallas_call(
        functools.partial(_select_kernel, n_experts=e, k=k, route_scale=float(route_scale), stacked=stacked),
        out_shape=(jax.ShapeDtypeStruct((m, k), F32), jax.ShapeDtypeStruct((m, k), I32)), grid=(pl.cdiv(m, bs),),
        in_specs=[pl.BlockSpec((1,), lambda i: (1,)), pl.BlockSpec((bs, ep), lambda i: (i, 0)),
                  full(bias) if stacked else pl.BlockSpec((ep,), lambda i: (0,))],
        out_specs=(pl.BlockSpec((bs, k), lambda i: (i, 0)), pl.BlockSpec((bs, k), lambda i: (i, 0))),
        name="v4_router_select", **kw(select_warps),
    )(layers, scores, bias)
