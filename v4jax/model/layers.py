"""Pure jnp building blocks of the DeepSeek-V4 forward (reference §2-§6), and the small NNX modules that attention,
the MoE and the layer stack share (Table, Linear, RMSNorm).

Einsum letters, used throughout v4jax:
  B batch, T query tokens, S key entries, D hidden, H query heads, K head_dim (512), Q q_lora rank,
  G output groups, R o_lora rank, E experts, I expert width, N hc streams, M window slots of a compressor.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pallas_kernels.experts import swiglu  # noqa: F401  (the clamped SwiGLU: one definition, the kernels' too)
from v4jax.config import SLIDING, ModelConfig
from v4jax.model import quant

F32 = jnp.float32
HI = jax.lax.Precision.HIGHEST  # for matmuls of f32 inputs: the default rounds them to TF32 on the H200


@dataclasses.dataclass(frozen=True)
class RunOptions:
    """Static numerics switches of a forward pass."""
    quant_sim: bool = False  # the official FP8 KV / FP4 indexer / FP8 activation rounding (reference §9.1)
    attention_impl: str = "xla"  # "xla" | "pallas": the ops table (v4jax.model.ops)
    # sharding.MeshRules (mesh + logical-axis table) when the model runs on a mesh: the MoE's routed experts and
    # the Pallas calls run per shard (shard_map) and the steps replicate what the host reads; None = one device
    mesh_rules: Any = None
    # Training / evaluation only (full-sequence forward):
    indexer_aux: bool = False  # sow IndexerAux (indexer log-probs and the attention-mass target) per CSA stack
    routing_aux: bool = False  # sow RoutingAux (the experts of every top-k-routed layer)
    drop_compressed: bool = False  # teacher-forced forward only: the window alone (what compressed entries earn)
    # teacher-forced forward only: the keys rounded as the engine's pools of this kv_cache_dtype store them (None:
    # kept in the compute dtype; "bfloat16"; "fp8": the release's FP8 entries and FP4 indexer keys), so that the
    # forward stays the reference for an engine whose cache rounds (the cached path rounds by writing its pools)
    cache_dtype: str | None = None
    # The ops table of attention_impl as the forward runs it (ops_for, on a mesh mesh_ops): Transformer sets it once
    # per forward pass and the layers read it (a Linear inside the layer loop: its `linear`), never the string.
    ops: Any = None


def rms_norm(x, weight, eps):
    """Weighted RMS norm in f32, cast back to x's dtype (the weight is held in f32)."""
    xf = x.astype(F32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    if weight is not None:
        y = y * weight.astype(F32)
    return y.astype(x.dtype)


def linear(x, w, groups: int = 1):
    """y = x @ w.T with w in checkpoint layout [out, in]; f32 accumulation, output in x's dtype. With G groups,
    x [..., G, in] and group g's outputs [..., g, out/G] are rows g*out/G .. of w against x[..., g, :]. w may be
    quant.Quantized (dequantized to x's dtype: exact)."""
    if isinstance(w, quant.Quantized):
        w = w.astype(x.dtype)
    if groups > 1:
        wg = w.reshape(groups, w.shape[0] // groups, w.shape[1]).astype(x.dtype)
        return jnp.einsum("...gi,gri->...gr", x, wg, preferred_element_type=F32).astype(x.dtype)
    return jnp.einsum("...i,oi->...o", x, w.astype(x.dtype), preferred_element_type=F32).astype(x.dtype)


# ---- RoPE ------------------------------------------------------------------------------------------
def rope_inv_freq(cfg: ModelConfig, layer_type: str) -> np.ndarray:
    """Per-pair inverse frequencies [rd/2]: plain base on sliding layers, base + YaRN blend on compressed ones."""
    rd = cfg.rope_head_dim
    if layer_type == SLIDING:
        return 1.0 / (cfg.rope_theta ** (np.arange(0, rd, 2, dtype=np.float64) / rd))
    base = cfg.compress_rope_theta
    freqs = 1.0 / (base ** (np.arange(0, rd, 2, dtype=np.float64) / rd))
    if cfg.rope_factor != 1.0:
        def corr(rot):
            return rd * math.log(cfg.original_seq_len / (rot * 2 * math.pi)) / (2 * math.log(base))
        low = max(math.floor(corr(cfg.beta_fast)), 0)
        high = min(math.ceil(corr(cfg.beta_slow)), rd - 1)
        if low == high:
            high += 0.001
        ramp = np.clip((np.arange(rd // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
        freqs = freqs / cfg.rope_factor * ramp + freqs * (1.0 - ramp)
    return freqs


def rope_cos_sin(inv_freq, positions):
    """positions [...] int -> (cos, sin) [..., rd/2] f32."""
    ang = positions.astype(F32)[..., None] * jnp.asarray(inv_freq, F32)
    return jnp.cos(ang), jnp.sin(ang)


def apply_rope(x, cos, sin, inverse: bool = False):
    """Interleaved (GPT-J) RoPE on the last 2*cos.shape[-1] dims of x. cos/sin broadcast against x[..., :1]
    once a heads axis is inserted by the caller. Math in f32, result in x's dtype."""
    rd = 2 * cos.shape[-1]
    nope, rope = x[..., :-rd], x[..., -rd:].astype(F32)
    even, odd = rope[..., 0::2], rope[..., 1::2]
    if inverse:
        sin = -sin
    out = jnp.stack([even * cos - odd * sin, even * sin + odd * cos], axis=-1).reshape(rope.shape)
    # A concatenation, although it rewrites all of x (a query rotates 64 of its 512 dims; 41 ms of a 128K
    # flash-slice prefill). The in-place form, x.at[..., -rd:].set(out), equals this on every input tried alone, but
    # in the model XLA:CPU (JAX 0.10.2) made the engine's greedy tokens leave the teacher-forced ones, and XLA:GPU
    # (JAX 0.11.2, H200) failed to compile the batch-1 4096-token prefill with it (a RET_CHECK in its MLIR emitter).
    return jnp.concatenate([nope, out.astype(x.dtype)], axis=-1)


# ---- mHC (reference §5) -----------------------------------------------------------------------------
def _hc_mix(x, fn):
    """x [..., N, D] -> (fn @ flat(x), sum(flat(x)^2) [..., 1]), f32: mHC's mix is `mix_of` them."""
    flat = x.reshape(*x.shape[:-2], -1).astype(F32)
    return jnp.einsum("...i,oi->...o", flat, fn.astype(F32), precision=HI), jnp.sum(flat * flat, -1, keepdims=True)


def mix_of(dot, ssq, count: int, norm_eps: float):
    """mHC's mix: fn @ flat(x) RMS-normed, dot * rsqrt(mean(flat(x)^2) + norm_eps) (`count` = N * D values)."""
    return dot * jax.lax.rsqrt(ssq / count + norm_eps)


def collapse(pre, x):
    """sum_i pre_i X_i: pre [..., N] f32, x [..., N, D] -> [..., D] in x's dtype."""
    return jnp.einsum("...n,...nd->...d", pre, x.astype(F32), precision=HI).astype(x.dtype)


def hc_weights(dot, ssq, count: int, norm_eps: float, scale, base, n: int, iters: int, eps: float,
               normalise=None):
    """mHC's weights from its mix (`mix_of(dot, ssq, count, norm_eps)`; dot [..., (2 + N) * N], ssq [..., 1], f32):
    (pre [..., N], post [..., N], comb [..., N, N]), comb Sinkhorn-normalised by `normalise(comb, iters, eps)`
    (default `sinkhorn`, the jnp reference). scale, base: arrays, or the LayerOf of their stacks."""
    mix = mix_of(dot, ssq, count, norm_eps)
    scale, base = scale[...], base[...].astype(F32)
    pre = jax.nn.sigmoid(mix[..., :n] * scale[0] + base[:n]) + eps
    post = 2.0 * jax.nn.sigmoid(mix[..., n:2 * n] * scale[1] + base[n:2 * n])
    comb = mix[..., 2 * n:].reshape(*mix.shape[:-1], n, n) * scale[2] + base[2 * n:].reshape(n, n)
    comb = jax.nn.softmax(comb, axis=-1) + eps
    return pre, post, (normalise or sinkhorn)(comb, iters, eps)


def hc_pre_weights(x, fn, base, scale, cfg: ModelConfig, weights=None):
    """Streams x [..., N, D] -> (pre [..., N], post [..., N], comb [..., N, N]). `weights` takes `hc_weights`'
    arguments (default `hc_weights`, the jnp reference)."""
    dot, ssq = _hc_mix(x, fn)
    return (weights or hc_weights)(dot, ssq, x.shape[-2] * x.shape[-1], cfg.norm_eps, scale, base, cfg.hc_mult,
                                   cfg.hc_sinkhorn_iters, cfg.hc_eps)


def hc_pre(x, fn, base, scale, cfg: ModelConfig, weights=None):
    """Streams x [..., N, D] -> (collapsed u [..., D], post [..., N], comb [..., N, N]) (see hc_pre_weights)."""
    pre, post, comb = hc_pre_weights(x, fn, base, scale, cfg, weights)
    return collapse(pre, x), post, comb


SINKHORN_UNROLL = False  # unroll the Sinkhorn loop (no while loop on the device; measured by bench --sinkhorn-unroll)


def sinkhorn(comb, iters: int, eps: float):
    """Alternate column / row normalisation of comb [..., N, N] (reference §5: one column step, then iters - 1
    (row, column) steps). Measured on CPU: writing the N*N entries as separate arrays with explicit sums (so that
    XLA could fuse the whole loop into one kernel) made each mHC's compile grow super-linearly with the
    iterations (~25 s at 20), so the loop stays a scan of reductions."""
    comb = comb / (jnp.sum(comb, axis=-2, keepdims=True) + eps)

    def step(c, _):
        c = c / (jnp.sum(c, axis=-1, keepdims=True) + eps)
        return c / (jnp.sum(c, axis=-2, keepdims=True) + eps), None

    return jax.lax.scan(step, comb, None, length=iters - 1, unroll=SINKHORN_UNROLL)[0]


def hc_post(f, x, post, comb):
    """X'_k = post_k * f + sum_j comb[j, k] X_j; f [..., D], x [..., N, D]. As a per-token [N, N] x [N, D] matmul
    XLA:GPU runs it at about a quarter of the bandwidth (86 ms of a 128K flash-slice prefill, two kernels per call
    in decode); written as N multiply-adds (and the collapse in hc_pre likewise) it failed to compile on the H200
    (JAX 0.11.2: the batch-1 4096-token prefill, a RET_CHECK in XLA's MLIR emitter), so it stays a matmul here,
    the reference; the Pallas ops table runs pallas_kernels.hc_post on GPUs."""
    dt = x.dtype
    out = post.astype(dt)[..., None] * f[..., None, :] + jnp.einsum("...jk,...jd->...kd", comb.astype(dt), x)
    return out.astype(dt)


def hc_head(x, fn, base, scale, cfg: ModelConfig):
    """Final collapse of the N streams (no Sinkhorn): y = sum_i pre_i X_i."""
    mix = mix_of(*_hc_mix(x, fn), x.shape[-2] * x.shape[-1], cfg.norm_eps)
    pre = jax.nn.sigmoid(mix * scale[0] + base.astype(F32)) + cfg.hc_eps
    return collapse(pre, x)


# ---- attention core ---------------------------------------------------------------------------------
def index_scores(q, w, keys):
    """Lightning Indexer scores sum_h w_h relu(q_h . k_s): q [B, T, Hi, Ki], w [B, T, Hi], keys [B, S, Ki] ->
    [B, T, S] f32."""
    s = jnp.einsum("bthk,bsk->bths", q, keys.astype(q.dtype), preferred_element_type=F32)
    return jnp.einsum("bths,bth->bts", jax.nn.relu(s), w)


# ---- compressor (reference §3.4), full-sequence form ------------------------------------------------
def compress_windows(a, z, ratio: int, overlap: bool):
    """Pool every complete window of a chunk that starts at position 0.

    a, z [B, T, C*K] f32 (z includes the position bias ape[t mod m]); C = 2 if overlap (CSA) else 1.
    Returns pooled entries [B, T // m, K] f32 (before norm / RoPE)."""
    b, t, ck = a.shape
    n = t // ratio
    a = a[:, : n * ratio].reshape(b, n, ratio, ck)
    z = z[:, : n * ratio].reshape(b, n, ratio, ck)
    if overlap:
        k = ck // 2
        prev_a = jnp.concatenate([jnp.zeros_like(a[:, :1, :, :k]), a[:, :-1, :, :k]], axis=1)
        prev_z = jnp.concatenate([jnp.full_like(z[:, :1, :, :k], -jnp.inf), z[:, :-1, :, :k]], axis=1)
        a = jnp.concatenate([prev_a, a[..., k:]], axis=2)  # [B, n, 2m, K]
        z = jnp.concatenate([prev_z, z[..., k:]], axis=2)
    w = jax.nn.softmax(z, axis=2)
    return jnp.sum(w * a, axis=2)


# ---- MoE (reference §6) -----------------------------------------------------------------------------
def route(x, gate_w, gate_bias, tid2eid, token_ids, cfg: ModelConfig):
    """Router: sqrtsoftplus scores, bias for selection only (or the hash table), normalised, scaled.
    x [M, D] -> (weights [M, k] f32, experts [M, k] int32)."""
    return route_by(x, gate_w, gate_bias, None if tid2eid is None else tid2eid[token_ids], cfg)


def route_by(x, gate_w, gate_bias, table_experts, cfg: ModelConfig, hashed=None):
    """`route` given the hash table's experts for the tokens [M, k] (a hash layer) or the selection bias [E]; with
    both, `hashed` (a traced bool) picks between the two selections (a scan over hash and top-k layers)."""
    logits = jnp.einsum("md,ed->me", x.astype(F32), gate_w.astype(F32), precision=HI)
    scores = jnp.sqrt(jax.nn.softplus(logits))
    idx = None if table_experts is None else table_experts.astype(jnp.int32)
    if gate_bias is not None:
        # Tie rule: higher score first, then lower index (lax.top_k keeps the lower index first).
        _, top = jax.lax.top_k(scores + gate_bias.astype(F32), cfg.n_activated_experts)
        idx = top if idx is None else jnp.where(hashed, idx, top)
    w = jnp.take_along_axis(scores, idx, axis=-1)
    w = w / (jnp.sum(w, axis=-1, keepdims=True) + 1e-20) * cfg.route_scale
    return w, idx


def combine_pairs(y, weights):
    """sum_k weights[m, k] * y[m, k] in f32 [M, D]: a fused multiply-add (a matmul of f32 inputs would round them
    to TF32 on the H200 by default)."""
    return jnp.sum(y * weights[..., None], axis=1)


def layer_slice(a, i):
    """a[i] along the leading (layer stack) axis; i a Python int or a traced scalar."""
    if isinstance(a, quant.Quantized):
        return a[i]
    return a[i] if isinstance(i, int) else jax.lax.dynamic_index_in_dim(a, i, 0, keepdims=False)


def set_rows(dst, rows, values):
    """dst [R, ...] with rows `rows` [n] set to values [n, ...]; a row outside [0, R) (-1: none) is not written.
    One row (a batch-1 decode step's pool write) is a dynamic_update_slice of the row or of its own old value: as a
    scatter of mode "drop", XLA:GPU made it three launches (the bounds check's reduction, a select, the update)
    where this form is one."""
    if rows.shape[0] != 1:
        return dst.at[jnp.where(rows >= 0, rows, dst.shape[0])].set(values, mode="drop")
    ok = (rows[0] >= 0) & (rows[0] < dst.shape[0])
    i = jnp.where(ok, rows[0], 0)
    old = jax.lax.dynamic_slice_in_dim(dst, i, 1, 0)
    return jax.lax.dynamic_update_slice_in_dim(dst, jnp.where(ok, values.astype(dst.dtype), old), i, 0)


@dataclasses.dataclass(frozen=True)
class LayerOf:
    """Layer `index` of a weight stack [n, ...], left unsliced inside the layer loop so that a kernel can read it
    in place (the ops table's `linear`); indexing it (`weight[...]`) gives the layer's array."""
    stack: jax.Array
    index: int | jax.Array

    def __getitem__(self, key):
        return layer_slice(self.stack, self.index)[key]


@functools.partial(jax.tree_util.register_dataclass, data_fields=["parts"], meta_fields=["dtype"])
@dataclasses.dataclass(frozen=True)
class Sums:
    """A projection's output not yet added up: its f32 partial sums `parts` [S, ..., O] (a kernel's split of the
    input width), the output being their sum rounded to `dtype` (`total`). The ops table's `linear` gives them to
    a consumer that adds them itself (`hc_post`): the sum was a launch of its own before a kernel."""
    parts: jax.Array
    dtype: Any

    def total(self):
        return jnp.sum(self.parts, axis=0).astype(self.dtype)


def total(f):
    """f, or the total of Sums f."""
    return f.total() if isinstance(f, Sums) else f


DENSE_EXPERTS_RATIO = 4  # with at most this many experts per active one, compute every expert densely


def experts_form(m: int, k: int, n_exp: int) -> str:
    """The form `routed_experts` takes for M tokens, k active of E experts (see there)."""
    return "gather" if m * k < n_exp else "dense" if n_exp <= DENSE_EXPERTS_RATIO * k else "grouped"


def routed_experts(x, weights, experts, w1, w2, w3, limit, form: str | None = None, act_quant: bool = False):
    """The routed experts' sum_k w_k FFN_{e_k}(x). x [M, D]; weights/experts [M, k]; w1/w3 [E, I, D]; w2 [E, D, I]
    (arrays, or quant.Quantized: dequantized as read). Three forms, by measurement on the H200 (flash-slice, 16
    experts, 6 active):
    * few tokens (M * k < E, decode at small batch): gather the selected experts' weights; only those are read.
    * few experts (E <= 4k): every expert over every token, weighted by the (mostly zero) combine weights: plain
      large matmuls. XLA:GPU lowers `lax.ragged_dot` as a dense matmul of all M * k sorted rows against every
      expert (k times this form's FLOPs: an 8192-token chunk's experts took 45 ms per layer), and its weights had
      to be transposed every call (14 of 42 ms of a batch-32 decode call).
    * otherwise: tokens sorted by expert, `lax.ragged_dot_general` (grouped matmul) contracting the weights'
      own input axis (no transpose).
    `form` ("gather" | "dense" | "grouped") overrides the choice (the mesh path picks its own per shard).
    act_quant: the release's numerics (reference §8.1; x comes rounded): w2's input is the routing weight times
    the SwiGLU, cast to x's dtype and rounded to FP8 per 1x128 block, as the official Expert scales it before w2."""
    m, k = experts.shape
    n_exp = w1.shape[0]
    dt = x.dtype

    def w2_input(h, w):  # h f32 [..., I], w the routing weight broadcast against it
        return quant.fp8_roundtrip((h * w).astype(dt), 128) if act_quant else h.astype(dt)

    form = form or experts_form(m, k, n_exp)
    if form == "gather":
        g1, g3, g2 = w1[experts].astype(dt), w3[experts].astype(dt), w2[experts].astype(dt)  # [M, k, ...]
        h = swiglu(jnp.einsum("md,mkid->mki", x, g1, preferred_element_type=F32),
                   jnp.einsum("md,mkid->mki", x, g3, preferred_element_type=F32), limit)
        y = jnp.einsum("mki,mkdi->mkd", w2_input(h, weights[..., None] if act_quant else 1.0), g2,
                       preferred_element_type=F32)
        return jnp.sum(y, axis=1) if act_quant else combine_pairs(y, weights)
    if form == "dense":
        combine = jnp.zeros((m, n_exp), F32).at[jnp.arange(m)[:, None], experts].add(weights)  # [M, E]
        h = swiglu(jnp.einsum("md,eid->emi", x, w1.astype(dt), preferred_element_type=F32),
                   jnp.einsum("md,eid->emi", x, w3.astype(dt), preferred_element_type=F32), limit)
        y = jnp.einsum("emi,edi->emd", w2_input(h, combine.T[..., None] if act_quant else 1.0), w2.astype(dt),
                       preferred_element_type=F32)
        return jnp.sum(y, axis=0) if act_quant else jnp.einsum("emd,me->md", y, combine, precision=HI)
    flat_e = experts.reshape(-1)
    order = jnp.argsort(flat_e, stable=True)
    tok = order // k
    xs = x[tok]
    sizes = jnp.bincount(flat_e, length=n_exp).astype(jnp.int32)
    dims = jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(([1], [2]), ([], [])),
                                             lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])
    gmm = lambda a, w: jax.lax.ragged_dot_general(a, w.astype(dt), sizes, dims, preferred_element_type=F32)
    h = swiglu(gmm(xs, w1), gmm(xs, w3), limit)
    sorted_w = weights.reshape(-1)[order][:, None]
    y = gmm(w2_input(h, sorted_w), w2) if act_quant else gmm(h.astype(dt), w2) * sorted_w
    return jnp.zeros((m, x.shape[-1]), F32).at[tok].add(y)


def attend(q, shared_keys, shared_valid, pq_keys, pq_valid, sink, scale):
    """One softmax (plus sink) over two key sets: keys shared by a row's queries [B, S1, K] (the chunk's window
    union, HCA entries) and per-query keys [B, T, S2, K] (CSA's selected entries, or None).
    Valid masks: [B, T, S1] and [B, T, S2]; sink [H] (-inf: none). Returns (o [B, T, H, K] f32, lse [B, T, H] f32,
    the log of the softmax denominator); o = 0 and lse = -inf where nothing is valid and there is no sink."""
    s1 = jnp.einsum("bthk,bsk->bths", q, shared_keys, preferred_element_type=F32) * scale
    s1 = jnp.where(shared_valid[:, :, None, :], s1, -jnp.inf)
    parts = [s1]
    if pq_keys is not None:
        s2 = jnp.einsum("bthk,btsk->bths", q, pq_keys, preferred_element_type=F32) * scale
        parts.append(jnp.where(pq_valid[:, :, None, :], s2, -jnp.inf))
    s = jnp.concatenate(parts, axis=-1)
    sink_b = jnp.broadcast_to(sink.astype(F32)[None, None, :], s.shape[:3])
    m = jnp.maximum(jnp.max(s, axis=-1), sink_b)
    m = jnp.where(m > -jnp.inf, m, 0.0)  # nothing valid and no sink: p = 0 rather than nan
    p = jnp.exp(s - m[..., None])
    denom = jnp.sum(p, axis=-1) + jnp.exp(sink_b - m)
    n1 = shared_keys.shape[1]
    o = jnp.einsum("bths,bsk->bthk", p[..., :n1].astype(shared_keys.dtype), shared_keys, preferred_element_type=F32)
    if pq_keys is not None:
        o = o + jnp.einsum("bths,btsk->bthk", p[..., n1:].astype(pq_keys.dtype), pq_keys,
                           preferred_element_type=F32)
    o = jnp.where(denom[..., None] > 0, o / jnp.where(denom > 0, denom, 1.0)[..., None], 0.0)
    return o, m + jnp.log(denom)


def compress_chunk(state_kv, state_score, a, z, start, n_valid, fresh, ratio: int, overlap: bool):
    """Resume a compressor over a chunk (reference §4.2, vectorised over the chunk).

    state_kv/state_score [B, C*m, C*K] f32: for CSA rows [0, m) hold the previous complete window and rows
    [m, 2m) the current partial one; for HCA rows [0, m) the current partial window. Scores include ape.
    a, z [B, T, C*K] f32: the chunk's projections; the chunk holds positions start .. start+n_valid-1 of each
    row (start, n_valid [B] int32); fresh [B] bool: the request starts here (state reset).
    Returns (pooled [B, NW, K] f32, entry index [B, NW], entry complete [B, NW] bool, state_kv', state_score'),
    NW = T // m + 2 windows of the chunk's span, in order; incomplete windows must not be used."""
    b, t, ck = a.shape
    m = ratio
    nw = t // m + 2
    off = start % m
    w0 = start // m
    cur_kv = state_kv[:, m:] if overlap else state_kv
    cur_sc = state_score[:, m:] if overlap else state_score
    j = jnp.arange(nw * m)[None, :]
    ci = j - off[:, None]
    from_state = (j < off[:, None]) & ~fresh[:, None]
    from_chunk = (ci >= 0) & (ci < n_valid[:, None])
    take = lambda arr, idx: jnp.take_along_axis(arr, idx[..., None], axis=1)
    sj = jnp.clip(j, 0, m - 1) + jnp.zeros_like(ci)
    cj = jnp.clip(ci, 0, t - 1)
    va = jnp.where(from_state[..., None], take(cur_kv, sj),
                   jnp.where(from_chunk[..., None], take(a, cj), 0.0)).reshape(b, nw, m, ck)
    vz = jnp.where(from_state[..., None], take(cur_sc, sj),
                   jnp.where(from_chunk[..., None], take(z, cj), -jnp.inf)).reshape(b, nw, m, ck)
    if overlap:
        k = ck // 2
        f = fresh[:, None, None]
        prev_kv = jnp.where(f, 0.0, state_kv[:, :m])
        prev_sc = jnp.where(f, -jnp.inf, state_score[:, :m])
        full_a = jnp.concatenate([prev_kv[:, None], va], axis=1)  # windows w0-1 .. w0+nw-1
        full_z = jnp.concatenate([prev_sc[:, None], vz], axis=1)
        pa = jnp.concatenate([full_a[:, :-1, :, :k], full_a[:, 1:, :, k:]], axis=2)
        pz = jnp.concatenate([full_z[:, :-1, :, :k], full_z[:, 1:, :, k:]], axis=2)
    else:
        pa, pz = va, vz
    end = start + n_valid
    ent_idx = w0[:, None] + jnp.arange(nw)[None, :]
    ent_ok = (ent_idx + 1) * m <= end[:, None]
    w = jax.nn.softmax(jnp.where(ent_ok[:, :, None, None], pz, 0.0), axis=2)
    pooled = jnp.sum(w * pa, axis=2)
    kw = (end // m - w0)[:, None, None, None]  # the window that is partial after the chunk
    new_cur_kv = jnp.take_along_axis(va, kw, axis=1)[:, 0]
    new_cur_sc = jnp.take_along_axis(vz, kw, axis=1)[:, 0]
    if overlap:
        new_kv = jnp.concatenate([jnp.take_along_axis(full_a, kw, axis=1)[:, 0], new_cur_kv], axis=1)
        new_sc = jnp.concatenate([jnp.take_along_axis(full_z, kw, axis=1)[:, 0], new_cur_sc], axis=1)
    else:
        new_kv, new_sc = new_cur_kv, new_cur_sc
    return pooled, ent_idx, ent_ok, new_kv, new_sc


# ---- NNX modules shared by attention, the MoE and the layer stack -----------------------------------------
@functools.partial(jax.jit, static_argnums=(2, 3))
def _normal(key, std, shape, dtype):
    return (jax.random.normal(key, shape, F32) * std).astype(dtype)


def init_normal(rngs, shape, std, dtype):
    """A random init: N(0, std^2) drawn in f32, cast to dtype. One program per shape and dtype: run eagerly, the
    draw, the scaling and the cast each compiled for every shape (with the stacks' zeros and copies, ~100 compiles
    building flash-slice; on an H200 its random init took 27 s)."""
    return _normal(rngs.params(), jnp.float32(std), tuple(shape), jnp.dtype(dtype))


def ones(shape):
    """An init of ones, made on the host (no program to compile for each shape)."""
    return jnp.asarray(np.ones(shape, np.float32))


class Table(nnx.Module):
    """A [rows, D] table: the embedding or the output head."""

    def __init__(self, rows: int, d: int, std: float, *, rngs: nnx.Rngs, dtype):
        self.weight = nnx.Param(init_normal(rngs, (rows, d), std, dtype), logical_axes=("vocab", "embed"))


class Linear(nnx.Module):
    """y = x @ weight.T, weight in checkpoint layout [out, in]; as the release stores it (`store`): weight e4m3 and
    `scale` its ue8m0 128x128 block scales."""

    def __init__(self, n_in: int, n_out: int, axes: tuple[str, str], *, rngs: nnx.Rngs, dtype, fp8: bool = False,
                 release_fp8: bool | None = None):
        # axes: logical names of (out, in), mapped to mesh axes by sharding/rules.py
        self.weight = nnx.Param(init_normal(rngs, (n_out, n_in), n_in ** -0.5, dtype), logical_axes=tuple(axes))
        self.scale = None
        self.fp8 = fp8  # an FP8/FP4 linear in the release: its input is rounded (1x128 blocks)
        # FP8 in the release's checkpoint (wo_a too, which the official model dequantizes: its input is not rounded)
        self.release_fp8 = fp8 if release_fp8 is None else release_fp8

    def store(self, storage: str | None):
        """Hold the weight as the release does ("fp8"; None: leave it in the model dtype)."""
        if storage is None or not self.release_fp8:
            return
        axes = self.weight.get_metadata()["logical_axes"]
        values, scale = quant.quantize(self.weight[...], storage)
        self.weight = nnx.Param(values, logical_axes=axes)
        self.scale = nnx.data(nnx.Param(scale, logical_axes=axes))

    def __call__(self, x, opts=None, groups: int = 1, sums: bool = False):
        """opts: the forward's RunOptions (v4jax.model.transformer); groups > 1: the grouped form of `linear`
        (x [..., G, in]); sums: the output may come as Sums (for the ops table's hc_post)."""
        act_quant = self.fp8 and (self.scale is not None or (opts is not None and opts.quant_sim))
        w = self.weight.get_value()
        if isinstance(w, LayerOf):  # inside the layer loop, off a mesh: the forward's ops table reads it in place
            scale = None if self.scale is None else self.scale.get_value()  # the stack's scales, read in place too
            scale = scale.stack if isinstance(scale, LayerOf) else scale
            return opts.ops.linear(x, w.stack, w.index, groups, scale, act_quant, sums)  # (a kernel rounds x itself)
        scale = None if self.scale is None else self.scale[...]
        if act_quant:
            x = quant.fp8_roundtrip(x, 128)
        if scale is not None:  # the jnp reference: dequantized inside the matmul
            return linear(x, quant.Quantized(w[...], scale, "fp8"), groups)
        return linear(x, self.weight[...], groups)


class RMSNorm(nnx.Module):
    def __init__(self, n: int, eps: float, axis: str, *, rngs: nnx.Rngs):
        self.weight = nnx.Param(ones((n,)), logical_axes=(axis,))
        self.eps = eps

    def __call__(self, x):
        return rms_norm(x, self.weight[...], self.eps)
