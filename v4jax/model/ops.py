"""The ops table of the cached path: one interface, two implementations (DESIGN §2 "one ops table").

`OPS["xla"]` holds the jnp reference maths, `OPS["pallas"]` the kernels of pallas_kernels (TPU interpret mode on
CPU, Triton / Mosaic on GPU and TPU); the Transformer's forward passes resolve one from `RunOptions.attention_impl`
once (`ops_for`) and hand it to every layer, so layers hold no `attention_impl` branches. Every entry reads the
pools as flat row arrays ([rows, K], all layers of a stack one after another) through row ids (-1 = none). On a
mesh the entries run per shard (inside jax.shard_map, v4jax.model.attention) on the shard's rows, the others
masked to -1: `select` and `attend` return what sharding/context.py merges across shards. On a mesh a table of
Pallas calls (`per_shard`) runs all its entries per shard (v4jax.model.transformer.mesh_ops: a Mosaic call cannot
be partitioned automatically); XLA partitions the jnp forms itself.

  compress(comp, x, meta, st_kv, st_sc, rope, proj=None) -> (entries [B, E, K] in x's dtype, entry index [B, E],
      emitted [B, E] bool, new state_kv, new state_score): the compressor over the step's tokens from the rows'
      states (st_* [B, C*m, C*K] f32), before the layer's storage rounding. When row b is slot b (decode, off a
      mesh) st_* may be L.LayerOf(stack [n, slots, ...], layer): the new states then come back as the whole stack
      (the GPU kernel updates it in place). proj: (x @ wkv.T, x @ wgate.T) in f32 where `project` gave them
      (a kernel that projects inside itself ignores them).
  select(iq, w, idx_pool, rows, n_ready, k, key_format=None) -> (scores, positions) [B, T, min(k, S)]: the
      Lightning Indexer's top-k of each query over the entries of `rows` [B, S] it may see (entry e < n_ready
      [B, T]): positions along S, best first (higher score, then lower position), -1 (score -inf) where fewer are
      valid. key_format: the keys' byte format where the pool stores bytes (pallas_kernels.kv_format.Fp4Key).
  attend(q, sink, scale, swa, win_rows, win_pos, pos, window, kv, hca_rows, n_ready, sel_rows, with_lse=False,
         entry_format=None)
      -> o [B, T, H, K]: one softmax with the sink (-inf: none) over each query's window (win_rows / win_pos
      [B, U]: the rows and positions of the chunk's window union) and either all ready entries of hca_rows [B, S]
      (HCA) or its selected rows sel_rows [B, T, k] (CSA); kv is None on sliding layers. with_lse: (o in f32,
      lse [B, T, H] the log of the softmax denominator, -inf where nothing is valid and there is no sink), what
      shards merge (the kernels' partial states cost a write and a read of o in f32, so only then). entry_format:
      the entries' byte format where swa and kv store bytes (pallas_kernels.kv_format.Fp8Entry).
  hc_weights(dot, ssq, count, norm_eps, scale, base, n, iters, eps) -> (pre [..., N], post [..., N], comb
      [..., N, N]): mHC's weights from its mix (L.mix_of(dot, ssq, count, norm_eps): dot [..., (2 + N) * N], ssq
      [..., 1], f32), comb Sinkhorn-normalised (v4jax.model.layers.hc_weights); scale [3] and base [(2 + N) * N]
      arrays, or L.LayerOf of their stacks.
  experts(x, weights, experts, w1, w2, w3, limit, layer=None, form=None, act_quant=False) -> [M, D] f32: the
      routed experts' weighted sum (v4jax.model.layers.routed_experts); experts [M, k] ids, -1 = none (a pair of
      another shard's expert, weight 0); with `layer` (a scalar) w1/w2/w3 are layer stacks [n, E, ...] and the
      layer's experts are used, else [E, ...]; w1/w2/w3 may be quant.Quantized (kept as stored); form: the XLA
      form where the XLA forms run (None: by size); act_quant: the release's FP8 rounding of both matmuls'
      inputs (the kernels do not round: the XLA forms run it).
  project(x, ws, scales=None, act_quant=False) -> [[..., O_k] f32 or None]: x @ w.T for several weights of one
      input in one launch, each w an L.LayerOf of a layer stack [n, O_k, D] (None for a weight the kernel does not
      take: the caller projects it itself; all None in the XLA table, whose matmuls are XLA's to schedule);
      scales: FP8 weights, the L.LayerOf of each one's block scales, act_quant as `linear`'s.
  hc_post(f, x, post, comb) -> [..., N, D] in x's dtype: mHC's expansion (v4jax.model.layers.hc_post); f an
      array [..., D] or L.Sums (`linear`'s partial sums, added up as L.Sums.total).
  hc_collapse(pre, x, weight, eps) -> [..., D] in x's dtype: mHC's collapse sum_i pre_i X_i (pre [..., N] f32, x
      [..., N, D]) RMS-normed with the next sublayer's weight (an array [D] or L.LayerOf of a stack [n, D]):
      v4jax.model.layers.rms_norm of layers.collapse.
  linear(x, w, layer, groups, scale=None, act_quant=False) -> [..., O] in x's dtype: x @ w[layer].T with f32
      accumulation for a layer stack w [n, O, D] (v4jax.model.layers.linear, groups included); with `scale` (the
      ue8m0 block scales, the stack's [n, O/128, D/128] or layer `layer`'s), w is the release's e4m3 stack;
      act_quant: x is rounded to FP8 in 1 x 128 blocks first (the release's act_quant, which layers.Linear asks for
      but for the grouped wo_a); off a mesh only (on one the projections are XLA's, partitioned by the rules).
      sums=True: the output may come as L.Sums, for hc_post (only the Pallas table's kernel has partial sums).
The kernels are read from their modules at call time (tests patch them to count calls).

Which table runs where (`ops_for`, resolved once per forward pass from RunOptions.attention_impl and the backend):
  "xla" everywhere: the jnp maths below and in v4jax.model.layers.
  "pallas" (OPS["pallas"]): the kernels as they run portably (the TPU-style kernels, interpreted on CPU) plus the
      kernels written for Triton (experts, linear, project, hc_post, hc_collapse, hc_weights), interpreted on
      CPU. On a GPU `compress` also takes the GPU decode kernel on the state stacks (pallas_kernels.compressor_gpu)
      where it takes the shapes. On a TPU the Triton kernels cannot run (Triton loads, whole-array weight refs that
      do not fit VMEM): the table takes the XLA table's project, hc_post and hc_collapse, named in `Ops.from_xla`,
      and its own `experts`, `linear` and `hc_weights` (TPU_OWN): FP4 experts as stored through
      pallas_kernels.fp4_experts_tpu, bf16 experts through pallas_kernels.experts_tpu, FP8 weights as stored
      through pallas_kernels.fp8_linear_tpu, XLA's forms for the rest; mHC's Sinkhorn loop in Mosaic
      (pallas_kernels.sinkhorn) after XLA's sigmoids and softmax.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

from pallas_kernels import _compat
from pallas_kernels import compressor as pallas_compressor
from pallas_kernels import compressor_gpu as pallas_compressor_gpu
from pallas_kernels import experts as pallas_experts
from pallas_kernels import experts_grouped as pallas_experts_grouped
from pallas_kernels import experts_tpu as pallas_experts_tpu
from pallas_kernels import fp4_experts_tpu as pallas_fp4_experts_tpu
from pallas_kernels import fp8_linear_tpu as pallas_fp8_linear_tpu
from pallas_kernels import hc_post as pallas_hc_post
from pallas_kernels import indexer as pallas_indexer
from pallas_kernels import kv_format
from pallas_kernels import layer_linear as pallas_linear
from pallas_kernels import sinkhorn as pallas_sinkhorn
from pallas_kernels import sparse_attention as pallas_sparse_attention
from pallas_kernels import topk as pallas_topk
from v4jax.model import layers as L
from v4jax.model import quant

F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class Ops:
    name: str
    compress: Callable
    select: Callable
    attend: Callable
    hc_weights: Callable
    experts: Callable
    linear: Callable
    project: Callable
    hc_post: Callable
    hc_collapse: Callable
    per_shard: bool = False  # Pallas calls: on a mesh every entry runs per shard
    from_xla: tuple[str, ...] = ()  # entries of a Pallas table that are the XLA table's on this backend


def _broadcast_rows(rows, t):
    """rows [B, S] -> [B, T, S]."""
    return jnp.broadcast_to(rows[:, None, :], (rows.shape[0], t, rows.shape[1]))


def _ready(rows, n_ready):
    """[B, T, S]: entry e exists and query t may see it."""
    return (jnp.arange(rows.shape[1])[None, None, :] < n_ready[:, :, None]) & (rows[:, None, :] >= 0)


# ---- XLA (jnp) ----------------------------------------------------------------------------------------
def _state_rows(st):
    """A compressor state as compress receives it: the rows' states, or L.LayerOf(stack, layer) (every slot)."""
    return st[...] if isinstance(st, L.LayerOf) else st


def _state_put(st, new):
    """The new rows' states in the form compress received them (a LayerOf: the whole stack, that layer updated)."""
    return st.stack.at[st.index].set(new) if isinstance(st, L.LayerOf) else new


def _compress_xla(comp, x, meta, st_kv, st_sc, rope, proj=None):
    a, z = comp.project(x, meta.positions, proj)
    pooled, ent, ok, nkv, nsc = L.compress_chunk(_state_rows(st_kv), _state_rows(st_sc), a, z, meta.start,
                                                 meta.n_valid, meta.fresh, comp.ratio, comp.overlap)
    cos, sin = rope(ent * comp.ratio)
    pooled = jnp.where(ok[..., None], pooled, 0.0)
    return comp.finish(pooled, cos, sin, x.dtype), ent, ok, _state_put(st_kv, nkv), _state_put(st_sc, nsc)


def _select_xla(iq, w, idx_pool, rows, n_ready, k, key_format=None):
    keys = kv_format.decode_rows(idx_pool, jnp.maximum(rows, 0), key_format, iq.dtype)
    scores = L.index_scores(iq, w, keys)  # [B, T, S]
    # -0.0 is the score 0: lax.top_k orders floats totally (-0.0 below 0.0), the tie rule by number
    scores = jnp.where(_ready(rows, n_ready), jnp.where(scores == 0, 0.0, scores), -jnp.inf)
    vals, at = jax.lax.top_k(scores, min(k, rows.shape[1]))
    return vals, jnp.where(vals > -jnp.inf, at, -1)


def _attend_xla(q, sink, scale, swa, win_rows, win_pos, pos, window, kv, hca_rows, n_ready, sel_rows,
                with_lse=False, entry_format=None):
    def rows(pool, r):  # pool[r] in q's dtype (decoded where the pool stores bytes)
        return kv_format.decode_rows(pool, jnp.maximum(r, 0), entry_format, q.dtype)

    keys = rows(swa, win_rows)  # [B, U, K]: the chunk's window union, shared by its queries
    wp = win_pos[:, None, :]
    valid = (win_rows[:, None, :] >= 0) & (wp <= pos[:, :, None]) & (wp > pos[:, :, None] - window)
    sel_keys = sel_valid = None
    if hca_rows is not None:
        keys = jnp.concatenate([keys, rows(kv, hca_rows)], axis=1)
        valid = jnp.concatenate([valid, _ready(hca_rows, n_ready)], axis=-1)
    if sel_rows is not None:
        sel_keys, sel_valid = rows(kv, sel_rows), sel_rows >= 0  # [B, T, k, K]
    o, lse = L.attend(q, keys, valid, sel_keys, sel_valid, sink, scale)
    return (o, lse) if with_lse else o.astype(q.dtype)


# ---- Pallas --------------------------------------------------------------------------------------------
def _compress_pallas(comp, x, meta, st_kv, st_sc, rope, proj=None):
    """pallas_kernels.compressor: the decode kernel for one token per row, the prefill kernel for a chunk."""
    t, m = x.shape[1], comp.ratio
    static = dict(ratio=m, overlap=comp.overlap, eps=comp.norm.eps, entry_dtype=x.dtype)
    st_kv_in, st_sc_in = st_kv, st_sc
    st_kv, st_sc = _state_rows(st_kv), _state_rows(st_sc)
    # The kernels resume from the state they are given; a row that starts a new request starts empty.
    fresh = meta.fresh[:, None, None]
    kv0 = jnp.where(fresh, 0.0, st_kv)
    sc0 = jnp.where(fresh, -jnp.inf, st_sc)
    weights = (comp.wkv.weight[...], comp.wgate.weight[...], comp.ape[...], comp.norm.weight[...])
    if t == 1:
        pos = jnp.where(meta.n_valid > 0, meta.start, -1)  # < 0: padding row, its state is left alone
        entry, emitted, nkv, nsc = pallas_compressor.compressor_decode(
            x[:, 0], pos, kv0, sc0, *weights, rope(pos + 1 - m), **static)
        entries, ent, ok = entry[:, None], (pos // m)[:, None], emitted[:, None]
    else:
        cos, sin = rope(pallas_compressor.prefill_entry_positions(meta.start, t, m))
        entries, n_emitted, first, nkv, nsc = pallas_compressor.compressor_prefill(
            x, meta.start, meta.n_valid, kv0, sc0, *weights, cos, sin, **static)
        i = jnp.arange(entries.shape[1])[None, :]
        ent, ok = first[:, None] + i, i < n_emitted[:, None]
    return entries.astype(x.dtype), ent, ok, _state_put(st_kv_in, nkv), _state_put(st_sc_in, nsc)


def _compress_pallas_gpu(comp, x, meta, st_kv, st_sc, rope, proj=None):
    """The GPU's compress: a decode step on the state stacks of every slot (st_kv a LayerOf) runs the GPU decode
    kernel on them in place where it takes the shapes; the rest as `_compress_pallas`."""
    if x.shape[1] == 1 and isinstance(st_kv, L.LayerOf) and pallas_compressor_gpu.decode_supported(
            x, st_kv.stack, comp.norm.weight[...], comp.ratio, comp.overlap):
        return _compress_decode_gpu_stack(comp, x, meta, st_kv, st_sc, rope, proj)
    return _compress_pallas(comp, x, meta, st_kv, st_sc, rope, proj)


def _compress_decode_gpu_stack(comp, x, meta, st_kv, st_sc, rope, proj=None):
    """GPU decode on the stacks of every slot's states, updated in place at the layer (no slice and write-back
    copies), the projections read from the weight stacks in place where they are LayerOf too (or given)."""
    m = comp.ratio
    static = dict(ratio=m, overlap=comp.overlap, eps=comp.norm.eps, entry_dtype=x.dtype)
    wkv, wgate = comp.wkv.weight.get_value(), comp.wgate.weight.get_value()
    fresh = meta.fresh[None, :, None, None]  # decode passes constant False: folded away
    kv0 = jnp.where(fresh, 0.0, st_kv.stack)
    sc0 = jnp.where(fresh, -jnp.inf, st_sc.stack)

    def project(x, w):
        if isinstance(w, L.LayerOf) and pallas_linear.supported(x, w.stack):
            return pallas_linear.layer_linear(x, w.stack, w.index)  # bf16 products exact in f32, f32 sums
        return pallas_compressor.project_f32(x, w[...])

    pos = jnp.where(meta.n_valid > 0, meta.start, -1)  # < 0: padding row, its state is left alone
    entry, emitted, nkv, nsc = pallas_compressor_gpu.compressor_decode_gpu(
        x[:, 0], pos, kv0, sc0, wkv, wgate, comp.ape[...], comp.norm.weight[...], rope(pos + 1 - m), **static,
        layer=st_kv.index, project=project, projected=None if proj is None else (proj[0][:, 0], proj[1][:, 0]))
    return entry.astype(x.dtype)[:, None], (pos // m)[:, None], emitted[:, None], nkv, nsc


def _select_pallas(iq, w, idx_pool, rows, n_ready, k, key_format=None):
    """pallas_kernels.indexer's scores, then pallas_kernels.topk (the scores of the k are read back for the
    cross-shard merge)."""
    scores = pallas_indexer.indexer_scores(iq, w, idx_pool, rows, n_ready, key_format=key_format)
    at = pallas_topk.topk(scores, min(k, rows.shape[1]))
    vals = jnp.take_along_axis(scores, jnp.maximum(at, 0), axis=2)
    return jnp.where(at >= 0, vals, -jnp.inf), at


def _attend_pallas(q, sink, scale, swa, win_rows, win_pos, pos, window, kv, hca_rows, n_ready, sel_rows,
                   with_lse=False, entry_format=None):
    """pallas_kernels.sparse_attention over per-query row lists, gathered inside the kernel. An HCA layer's prefill
    chunk on a GPU (T >= sparse_attention._PREFIX_MIN_T, bf16 / f32 pools) takes dense_prefix_attention instead:
    blocks of consecutive queries read their shared rows once (its doc)."""
    b, t = q.shape[:2]
    if hca_rows is not None and pallas_sparse_attention.dense_prefix_applies(q, swa, kv, entry_format):
        return pallas_sparse_attention.dense_prefix_attention(q, swa, win_rows, kv, hca_rows, n_ready, sink,
                                                              scale=scale, window=window, return_lse=with_lse)
    # Query t's window is win_rows[t : t + W] (win_pos starts at start - W + 1).
    swa_rows = jnp.take_along_axis(_broadcast_rows(win_rows, t),
                                   jnp.arange(t)[None, :, None] + jnp.arange(window)[None, None, :], axis=2)
    cmp_rows = sel_rows
    if hca_rows is not None:
        e = jnp.arange(hca_rows.shape[1])[None, None, :]
        cmp_rows = jnp.where(e < n_ready[:, :, None], hca_rows[:, None, :], -1)
    return pallas_sparse_attention.sparse_attention(q, swa, swa_rows, None if cmp_rows is None else kv, cmp_rows, sink,
                                                   scale=scale, return_lse=with_lse,
                                                   valid_prefix=hca_rows is not None,
                                                   entry_format=entry_format)


def _hc_weights_pallas(dot, ssq, count, norm_eps, scale, base, n, iters, eps):
    """pallas_kernels.sinkhorn.hc_weights: mHC's sigmoids, softmax and Sinkhorn loop in one launch, in the model's
    layout (XLA ran the loop as ~80 small kernels per layer; around the Sinkhorn kernel alone, its transposes and
    the sigmoids and softmax were five launches more per mHC).
    Measured and not kept: one Triton kernel for all of mHC's collapse after its matmul (the streams' RMS, the
    sigmoids, the softmax, this loop and the collapse; one program per 4 tokens reading the streams twice in chunks
    of 1024) took 10 us a launch at batch 1 and 23 us at 32 on the H200, against ~16 us for XLA's ten kernels: its
    loads and this loop's divides run one after another. The flash-slice step was no faster, and flash-1gpu's at
    batch 32 was 5-6 % slower. Nor two launches for all of it, the matmul included (the mix split over 32 programs,
    then one program running this loop while the others summed the streams): H100, Flash's width, 50 / 48 / 78 /
    122 us of kernels a call at 1 / 8 / 32 / 64 tokens against 12 / 18 / 19 / 24 us for XLA's eight launches with
    the Sinkhorn kernel (the f32 matmul and the loop's serial divides; docs/results/h100-prefill-first/
    bench_hc_pre.json). This kernel reads no streams: only each token's (2 + N) * N products and its sum of
    squares; the collapse (with the next norm) is a launch of its own, `hc_collapse`, whose programs only load."""
    layer = scale.index if isinstance(scale, L.LayerOf) else None  # scale and base: the layer's of their stacks
    scale, base = (a.stack if isinstance(a, L.LayerOf) else a for a in (scale, base))
    return pallas_sinkhorn.hc_weights(dot, ssq, count, norm_eps, scale, base, n, iters, eps, layer)


def _hc_weights_tpu(dot, ssq, count, norm_eps, scale, base, n, iters, eps):
    """On a TPU: XLA's sigmoids and softmax, then pallas_kernels.sinkhorn's loop (Mosaic, tokens along the lanes)."""
    return L.hc_weights(dot, ssq, count, norm_eps, scale, base, n, iters, eps, normalise=pallas_sinkhorn.sinkhorn)


def _experts_xla(x, weights, experts, w1, w2, w3, limit, layer=None, form=None, act_quant=False):
    if layer is not None:
        w1, w2, w3 = (L.layer_slice(w, layer) for w in (w1, w2, w3))
    # a pair of no expert has weight 0: any expert's output will do
    return L.routed_experts(x, weights, jnp.maximum(experts, 0), w1, w2, w3, limit, form, act_quant)


def _experts_pallas(x, weights, experts, w1, w2, w3, limit, layer=None, form=None, act_quant=False):
    """pallas_kernels.experts for a decode step's few tokens (each chosen expert's weights read once, from the
    layer stack in place) on GPU and, interpreted, on CPU; a prefill chunk's on Hopper GPUs as one grouped matmul
    per weight (pallas_kernels.experts_grouped), experts as stored widened first (the release's rounding
    included); a decode step's FP4 experts as stored through pallas_kernels.experts' FP4 kernels; the XLA forms
    for the sizes none takes, for FP8 experts at decode and for the release's rounding of bf16 weights."""
    dt = x.dtype
    # the release's input of w2: the routing weight times the SwiGLU, rounded to FP8 (as the official expert)
    w2_input = lambda h, w: quant.fp8_roundtrip((h * w).astype(dt), 128)  # noqa: E731
    if (isinstance(w1, quant.Quantized) and w1.storage == "fp4" and act_quant
            and pallas_experts.fp4_supported(x, w1.values)):
        # FP4 as stored, decoded in registers: the XLA forms gather and dequantize the chosen experts to bf16 in
        # memory first (4.5 bytes moved a weight, against 0.53)
        return pallas_experts.routed_experts_fp4(
            x, weights, experts, (w1.values, w1.scale), (w2.values, w2.scale), (w3.values, w3.scale), limit,
            w2_input, layer=layer)
    if (act_quant and isinstance(w1, quant.Quantized) and form in (None, "grouped")
            and pallas_experts_grouped.supported(x, jax.ShapeDtypeStruct(w1.shape[-3:], x.dtype))):
        # a prefill chunk through experts as stored: the layer's experts widened to x's dtype once a chunk
        # (flash-slice, 8192 tokens: 0.8 GB written, ~0.3 ms at the H200's bandwidth, beside 2.5 TFLOP of expert
        # matmuls), then the bf16 grouped matmul. XLA's forms run every expert over every token (E / k times the
        # FLOPs) or, grouped, every sorted row against every expert. Not yet timed on a GPU.
        ws = [(L.layer_slice(w, layer) if layer is not None else w).astype(dt) for w in (w1, w2, w3)]
        return pallas_experts_grouped.routed_experts(x, weights, experts, *ws, limit, w2_input=w2_input)
    if act_quant or isinstance(w1, quant.Quantized):
        return _experts_xla(x, weights, experts, w1, w2, w3, limit, layer, form, act_quant)
    if pallas_experts.supported(x, w1):
        return pallas_experts.routed_experts(x, weights, experts, w1, w2, w3, limit, layer=layer)
    if form in (None, "grouped") and pallas_experts_grouped.supported(x, w1):
        return pallas_experts_grouped.routed_experts(x, weights, experts, w1, w2, w3, limit, layer)
    return _experts_xla(x, weights, experts, w1, w2, w3, limit, layer, form)


def _experts_tpu(x, weights, experts, w1, w2, w3, limit, layer=None, form=None, act_quant=False):
    """On a TPU: FP4 experts as stored through pallas_kernels.fp4_experts_tpu and bf16 / f32 experts through
    pallas_kernels.experts_tpu, decode steps and prefill chunks, each chosen expert read from the layer stack in
    place (XLA-TPU widens FP4 experts in HBM first: libtpu AOT, v5e, 64 Flash-sized experts a layer: 1.0 GB of
    temporaries at one token, 5.4 GB at 32; it copies a bf16 layer's experts out of the stack: 512 MB slices on a
    v5p device under tensor=8); XLA's forms for the rest (FP8 experts, bf16 with the release's rounding)."""
    if (isinstance(w1, quant.Quantized) and w1.storage == "fp4" and act_quant
            and pallas_fp4_experts_tpu.supported(x, w1.values, w2.values)):
        dt = x.dtype
        w2_input = lambda h, w: quant.fp8_roundtrip((h * w).astype(dt), 128)  # noqa: E731 - the release's
        return pallas_fp4_experts_tpu.routed_experts_fp4(
            x, weights, experts, (w1.values, w1.scale), (w2.values, w2.scale), (w3.values, w3.scale), limit,
            w2_input, layer=layer)
    # (`form` picks among XLA's forms, per shard on a mesh: the kernels take any number of pairs)
    if not act_quant and not isinstance(w1, quant.Quantized) and pallas_experts_tpu.supported(x, w1, w2):
        return pallas_experts_tpu.routed_experts(x, weights, experts, w1, w2, w3, limit, layer=layer)
    return _experts_xla(x, weights, experts, w1, w2, w3, limit, layer, form, act_quant)


def _layer_scale(scale, w, layer):
    """Layer `layer`'s block scales from a stack's [n, O/128, D/128] (a layer's [O/128, D/128] as given)."""
    return L.layer_slice(scale, layer) if scale is not None and scale.ndim == w.ndim else scale


def _linear_xla(x, w, layer, groups=1, scale=None, act_quant=False, sums=False):
    if act_quant:
        x = quant.fp8_roundtrip(x, 128)
    scale = _layer_scale(scale, w, layer)
    w = L.layer_slice(w, layer)
    return L.linear(x, w if scale is None else quant.Quantized(w, scale, "fp8"), groups)


def _linear_pallas(x, w, layer, groups=1, scale=None, act_quant=False, sums=False):
    """pallas_kernels.layer_linear for a decode step's few tokens (the layer's weight read from the stack in
    place; FP8 weights as stored) on GPU and, interpreted, on CPU; XLA's matmul for the rest. On the H200 the XLA
    form of an FP8 weight (the layer's slice dequantized, then a bf16 matmul) made a flash-slice decode step 2x
    slower than bf16 weights (3.16 against 1.57 ms at batch 1, 4K). A prefill chunk keeps it: XLA fuses the
    widening into its bf16 GEMM (Flash's projections at 8192 tokens: 0.05-1.1 ms, ~700 TFLOP/s), where a
    block-scaled FP8 GEMM in Pallas (e4m3 tensor-core dots, measured and removed) took 2-3x as long (250-330
    TFLOP/s). The kernel rounds x to FP8 itself (act_quant). sums: its partial sums as L.Sums (their sum and
    rounding were a launch between the kernel and hc_post's)."""
    if pallas_linear.supported(x, w, groups, scaled=scale is not None, act_quant=act_quant):
        y = pallas_linear.layer_linear(x, w, layer, groups, scale=scale, act_quant=act_quant, summed=not sums)
        return L.Sums(y, x.dtype) if sums else y.astype(x.dtype)
    return _linear_xla(x, w, layer, groups, scale, act_quant)


def _linear_tpu(x, w, layer, groups=1, scale=None, act_quant=False, sums=False):
    """On a TPU: FP8 weights as stored through pallas_kernels.fp8_linear_tpu (decode and prefill alike; XLA-TPU
    widens the weight into HBM before its matmul wherever the weight is large, libtpu AOT: 134-403 MB of
    temporaries per Flash projection on v5e / v6e, every one on v5p); XLA's matmul for bf16 weights."""
    if scale is not None and pallas_fp8_linear_tpu.supported(x, w, groups):
        x = quant.fp8_roundtrip(x, 128) if act_quant else x
        return pallas_fp8_linear_tpu.fp8_linear(x, w, layer, groups, scale=_layer_scale(scale, w, layer)
                                                ).astype(x.dtype)
    return _linear_xla(x, w, layer, groups, scale, act_quant)


def _project_xla(x, ws, scales=None, act_quant=False):
    return [None] * len(ws)


def _project_pallas(x, ws, scales=None, act_quant=False):
    """pallas_kernels.layer_linear.layer_linears over the weights it takes, in one launch: on the H200 a CSA
    layer's six projections of the attention input ran in 13 launches and 31 us at batch 1, in one (with its
    split-D sum) and 13 us (v4jax bench kernels --sweep fused_projections). FP8 weights (scales) with their scale
    stacks read in place and x rounded in the kernel."""
    scaled = scales is not None
    scales = scales if scaled else [None] * len(ws)
    takes = [isinstance(w, L.LayerOf) and (not scaled or isinstance(sc, L.LayerOf))
             and pallas_linear.supported(x, w.stack, scaled=scaled, act_quant=act_quant) for w, sc in zip(ws, scales)]
    if sum(takes) < 2:
        return [None] * len(ws)
    pick = lambda xs: [a.stack for a, t in zip(xs, takes) if t]  # noqa: E731
    got = iter(pallas_linear.layer_linears(x, pick(ws), ws[takes.index(True)].index,
                                           scales=pick(scales) if scaled else None, act_quant=act_quant))
    return [next(got) if t else None for t in takes]


def _hc_post_xla(f, x, post, comb):
    return L.hc_post(L.total(f), x, post, comb)


def _hc_post_pallas(f, x, post, comb):
    """pallas_kernels.hc_post on GPU (interpreted on CPU): XLA's form moves its bytes at about a quarter of the
    bandwidth (8192 tokens of Flash: 798 us in XLA, 151 us in the kernel; 2 launches a call in decode, 1 in the
    kernel; v4jax bench kernels --sweep hc_post). f as L.Sums: the kernel adds the parts up itself."""
    n, d = x.shape[-2:]
    parts = f.parts if isinstance(f, L.Sums) else f[None]
    parts, x2 = parts.reshape(parts.shape[0], -1, d), x.reshape(-1, n, d)
    if f.dtype != x.dtype or not pallas_hc_post.supported(parts, x2):
        return _hc_post_xla(f, x, post, comb)
    return pallas_hc_post.hc_post(parts, x2, post.reshape(-1, n), comb.reshape(-1, n, n)).reshape(x.shape)


def _hc_collapse_xla(pre, x, weight, eps):
    return L.rms_norm(L.collapse(pre, x), weight[...], eps)


def _hc_collapse_pallas(pre, x, weight, eps):
    """pallas_kernels.hc_post.collapse_norm for a decode step's few tokens on GPU (interpreted on CPU), the norm's
    weight read from its stack in place: one launch where XLA ran three, all on the layer's chain of launches
    (`v4jax bench gpu-launches`); XLA's fusions for a prefill chunk."""
    n, d = x.shape[-2:]
    pre2, x2 = pre.reshape(-1, n), x.reshape(-1, n, d)
    if not pallas_hc_post.collapse_supported(pre2, x2):
        return _hc_collapse_xla(pre, x, weight, eps)
    stack, layer = (weight.stack, weight.index) if isinstance(weight, L.LayerOf) else (weight, None)
    return pallas_hc_post.collapse_norm(pre2, x2, stack, eps, layer).reshape(x.shape[:-2] + (d,))


XLA = Ops("xla", _compress_xla, _select_xla, _attend_xla, L.hc_weights, _experts_xla, _linear_xla, _project_xla,
          _hc_post_xla, _hc_collapse_xla)
PALLAS = Ops("pallas", _compress_pallas, _select_pallas, _attend_pallas, _hc_weights_pallas, _experts_pallas,
             _linear_pallas, _project_pallas, _hc_post_pallas, _hc_collapse_pallas, per_shard=True)
OPS = {"xla": XLA, "pallas": PALLAS}
# entries of PALLAS whose kernels are written for Triton
TRITON_ONLY = ("experts", "linear", "project", "hc_post", "hc_collapse", "hc_weights")
# of those, the entries a TPU has its own kernels for (weights as stored; Sinkhorn's loop in Mosaic)
TPU_OWN = {"experts": _experts_tpu, "linear": _linear_tpu, "hc_weights": _hc_weights_tpu}


def _backend() -> str:
    return _compat.backend()


def ops_for(attention_impl: str, backend: str | None = None) -> Ops:
    """The table of `attention_impl` as it runs on `backend` ("gpu" | "tpu" | "cpu"; default: this process's).
    See the module doc: on a GPU the Pallas table's compress takes the GPU decode kernel, on a TPU the entries of
    TRITON_ONLY are the XLA table's (Ops.from_xla names them) but those of TPU_OWN."""
    if attention_impl not in OPS:
        raise ValueError(f"attention_impl must be one of {sorted(OPS)}, got {attention_impl!r}")
    ops = OPS[attention_impl]
    if ops is XLA:
        return ops
    backend = backend or _backend()
    if backend == "gpu":
        return dataclasses.replace(ops, compress=_compress_pallas_gpu)
    if backend == "tpu":
        from_xla = tuple(name for name in TRITON_ONLY if name not in TPU_OWN)
        return dataclasses.replace(ops, from_xla=from_xla, **{name: getattr(XLA, name) for name in from_xla}, **TPU_OWN)
    return ops


def on_shards(fn, mesh_rules, in_specs, out_specs):
    """fn over each shard's blocks of its arguments (in_specs, out_specs: PartitionSpecs, pytree prefixes):
    jax.shard_map manual over every mesh axis, as Pallas calls run on a mesh (Mosaic cannot be partitioned
    automatically)."""
    return jax.shard_map(fn, mesh=mesh_rules.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
