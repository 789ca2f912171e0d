"""mHC's weights from its mix as one kernel: on GPUs all of them (`hc_weights`), on TPUs the Sinkhorn
normalisation (reference §5) after XLA's sigmoids and softmax (`sinkhorn`).

XLA runs the Sinkhorn loop as one small reduce fusion and one divide fusion per half-step: 2 x 19 iterations x 2
per layer (hc_attn and hc_ffn), about 80 launches of a few microseconds each over [tokens, 4, 4] floats (measured on
the H200: a third of the decode step's kernels). Unrolling does not help: fusing the unrolled chain recomputes
each entry's producers per consumer, and the compile grows exponentially with the iterations.

In both kernels the N*N entries of each token are N*N separate vectors of a block of tokens, and the whole loop runs
on them in registers: one launch per mHC. The arithmetic is the reference's (v4jax.model.layers.sinkhorn), in the
same order (sums over the row or column left to right), so the result matches it to rounding.

`hc_weights` goes from each token's mix (the (2 + N) * N values of fn @ x, with the sum of squares that norms them)
to its pre, post and Sinkhorn-normalised comb in one launch, reading the layer's scale and base from their stacks
and writing the weights in the model's token-major layout. Around the Sinkhorn kernel alone XLA ran the sigmoids,
the softmax and the kernel's transposes as five more launches per mHC (H100 profile, flash-slice at batch 1: 40 of
the step's ~310 launches, ~50 us of 1.8 ms), and the mix's norm and scaling one more.
"""
from __future__ import annotations

import functools
import operator

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from . import _compat
from ._common import layer_operand
from ._compat import TritonCompilerParams, interpret_arg, pltriton

BLOCK = 128  # tokens per program on TPU: one lane row
# on GPU a thread runs one token's serial iterations: 32 tokens per one-warp program (H200, the Sinkhorn kernel
# alone: 4.6-4.9 us at 1, 32 and 256 tokens; 128 tokens per one-warp program took 10.6-14.9 us;
# `v4jax bench kernels --tune --only hc_weights` sweeps hc_weights')
GPU_BLOCK = 32


def normalise(entries: list, n: int, iters: int, eps: float) -> list:
    """The reference's loop on the N*N entries of comb (row-major, each a vector of tokens or a scalar): one
    column normalisation, then iters - 1 (row, column) normalisations, sums left to right."""
    def cols(c):
        s = [functools.reduce(operator.add, [c[i][j] for i in range(n)]) for j in range(n)]
        return [[c[i][j] / (s[j] + eps) for j in range(n)] for i in range(n)]

    def rows(c):
        s = [functools.reduce(operator.add, c[i]) for i in range(n)]
        return [[c[i][j] / (s[i] + eps) for j in range(n)] for i in range(n)]

    flat = lambda c: tuple(v for r in c for v in r)
    grid = lambda f: [list(f[i * n:(i + 1) * n]) for i in range(n)]
    c = cols(grid(list(entries)))
    return list(jax.lax.fori_loop(0, iters - 1, lambda _, f: flat(cols(rows(grid(f)))), flat(c)))


def _kernel(x_ref, o_ref, *, n: int, iters: int, eps: float):
    out = normalise([x_ref[k, :] for k in range(n * n)], n, iters, eps)
    for k in range(n * n):
        o_ref[k, :] = out[k]


def sinkhorn(comb, iters: int, eps: float, *, interpret=None, block: int = BLOCK):
    """The TPU (Mosaic) version of v4jax.model.layers.sinkhorn (same signature): comb [..., N, N] f32, one column
    normalisation, then iters - 1 (row, column) normalisations, tokens along the lanes. interpret=None: interpret
    on CPU. block: tokens per program (a multiple of 128)."""
    if interpret is None:
        interpret = _compat.backend() == "cpu"
    *lead, n, _ = comb.shape
    m = 1
    for d in lead:
        m *= d
    mp = -(-m // block) * block
    x = jnp.pad(comb.reshape(m, n * n).astype(jnp.float32).T, ((0, 0), (0, mp - m)), constant_values=1.0)
    spec = pl.BlockSpec((n * n, block), lambda i: (0, i))
    kw = {"interpret": interpret_arg(interpret, "hlo")} if interpret else {}
    out = pl.pallas_call(functools.partial(_kernel, n=n, iters=iters, eps=eps),
                         out_shape=jax.ShapeDtypeStruct((n * n, mp), jnp.float32),
                         grid=(mp // block,), in_specs=[spec], out_specs=spec, name="v4_sinkhorn", **kw)(x)
    return out[:, :m].T.reshape(comb.shape)


def _weights_kernel(layer_ref, dot_ref, ssq_ref, scale_ref, base_ref, pre_ref, post_ref, comb_ref, *, n: int,
                    iters: int, eps: float, count: int, norm_eps: float, m: int, block: int):
    """Tokens block*i .. of the flat products dot [M * C] (C = (2 + N) * N) and sums of squares ssq [M] -> their
    flat pre, post [M * N], comb [M * N * N]; the reference's arithmetic (v4jax.model.layers.hc_weights: the mix
    dot * rsqrt(ssq / count + norm_eps), the logits mix * scale + base with the layer's scale and base, then the
    weights), one token per thread."""
    tok = pl.program_id(0) * block + lax.broadcasted_iota(jnp.int32, (block,), 0)
    ok = tok < m
    t = jnp.where(ok, tok, 0)
    c = (2 + n) * n
    layer = layer_ref[0]
    inv = lax.rsqrt(pltriton.load(ssq_ref.at[t], mask=ok, other=1.0) / count + norm_eps)
    scale = [scale_ref[layer, g] for g in range(3)]  # pre's, post's and comb's

    def z(k):
        mix = pltriton.load(dot_ref.at[t * c + k], mask=ok, other=0.0) * inv
        return mix * scale[0 if k < n else 1 if k < 2 * n else 2] + base_ref[layer, k]

    # a lane past the tokens stores to an index past the output (dropped: the interpreter's scatter would let a
    # masked lane's duplicate index write over a real one)
    put = lambda ref, w, k, v: pltriton.store(ref.at[jnp.where(ok, t * w + k, m * w)], v, mask=ok)  # noqa: E731
    for k in range(n):
        put(pre_ref, n, k, jax.nn.sigmoid(z(k)) + eps)
        put(post_ref, n, k, 2.0 * jax.nn.sigmoid(z(n + k)))
    comb = []
    for i in range(n):  # jax.nn.softmax over each row of comb
        row = [z(2 * n + i * n + j) for j in range(n)]
        top = functools.reduce(jnp.maximum, row)
        e = [jnp.exp(v - top) for v in row]
        total = functools.reduce(operator.add, e)
        comb += [v / total + eps for v in e]
    for k, v in enumerate(normalise(comb, n, iters, eps)):
        put(comb_ref, n * n, k, v)


def hc_weights(dot, ssq, count: int, norm_eps: float, scale, base, n: int, iters: int, eps: float, layer=None, *,
               interpret=None, block: int = GPU_BLOCK, num_warps: int = 1):
    """v4jax.model.layers.hc_weights (same signature, then `layer`) as one Triton kernel (interpret=None:
    interpreted on CPU): dot [..., (2 + N) * N] and ssq [..., 1] f32 (the mix is layers.mix_of them), scale [3] and
    base [(2 + N) * N], or their layer stacks [L, 3] and [L, (2 + N) * N] read at `layer` -> (pre [..., N], post
    [..., N], comb [..., N, N]). The mix's norm and scaling are the kernel's: in XLA they were a launch of their
    own between the mix's reductions and this kernel, on the layer's chain of launches."""
    if interpret is None:
        interpret = _compat.backend() == "cpu"
    *lead, c = dot.shape
    m = dot.size // c
    f32 = jnp.float32
    scale, base = scale.reshape(-1, 3).astype(f32), base.reshape(-1, c).astype(f32)
    layer = layer_operand(layer)
    args = (layer, dot.astype(f32).reshape(-1), ssq.astype(f32).reshape(-1), scale, base)
    shapes = [jax.ShapeDtypeStruct((m * k,), f32) for k in (n, n, n * n)]
    full = lambda sh: pl.BlockSpec(sh.shape, lambda i: (0,) * len(sh.shape))  # noqa: E731
    kw = dict(interpret=True) if interpret else dict(
        compiler_params=TritonCompilerParams(num_warps=num_warps, num_stages=1))
    pre, post, comb = pl.pallas_call(
        functools.partial(_weights_kernel, n=n, iters=iters, eps=eps, count=count, norm_eps=float(norm_eps), m=m,
                          block=block),
        out_shape=shapes, grid=(-(-m // block),), in_specs=[full(a) for a in args],
        out_specs=[full(sh) for sh in shapes], name="v4_hc_weights", **kw)(*args)
    return pre.reshape(*lead, n), post.reshape(*lead, n), comb.reshape(*lead, n, n)
