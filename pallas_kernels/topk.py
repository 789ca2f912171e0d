"""Exact top-k of score rows: positions along S of the k largest, score descending, ties -> lower index first,
-inf positions -> -1 (also the padding when fewer than k are valid, and when k > S). -0.0 counts as +0.0.

Implementations (all exact, all deterministic):
  * `topk_ref`: lax.top_k plus an exact tie repair (only run when a row's k-th value is tied beyond the cut), then
    a (score desc, index asc) sort of the k. The model's XLA path and the CPU path.
  * GPU (`_topk_threshold`): no sort of the row and no host round trip. tau = the k-th largest of 4k strided group
    maxima, so at least k scores are >= tau (a Pallas kernel: a 32-step bisection over the order-preserving
    integer keys); a second kernel compacts the scores >= tau (about 1.15k of them for unstructured data) into a
    2k buffer; a third ranks the candidates by (score desc, index asc) with a pairwise count and scatters the
    first k into place (from 64 rows on, a prefill chunk's, one XLA sort of the candidates does that instead).
    A row whose candidates overflow the buffer (massive ties, adversarial layouts) is redone exactly, inside a
    kernel that does nothing for the other rows: the same bisection over the whole row finds the k-th score,
    then one ordered scan takes everything above it and the lowest-index ties. Device-side branches only: a
    `lax.cond` here costs a device-to-host copy of the predicate and a stream sync per call on GPU.
    Short rows (a power of two up to 4,096 scores with k <= S and fewer than 64 rows: a decode step's CSA rows up
    to a 16K context) skip the threshold: one kernel ranks every score of the row by the same pairwise count and
    scatters the first k (`_rank_rows`), where XLA's sort of the row was three launches on the step's chain.
  * TPU (`_topk_approx`): lax.approx_max_k candidates (Pallas TPU cannot lower top_k), exact top-k among them,
    verified by counting the row's scores >= the k-th value; on a miss, topk_ref (lax.cond). Exact either way.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from . import _compat
from ._common import F32, next_pow2, pad_last

I32 = jnp.int32


# --------------------------------------------------------------------------------------------------------------
# Reference
# --------------------------------------------------------------------------------------------------------------

def _canon(x):
    """f32, with -0.0 -> +0.0 (sorts compare floats in total order, so -0.0 would rank below an equal 0.0)."""
    x = x.astype(F32)
    return jnp.where(x == 0, jnp.zeros((), F32), x)


def _order_and_pad(vals, idx, k):
    """Sorts candidate (vals, idx) [N, C] by (value desc, index asc), keeps the first min(k, C), maps -inf
    candidates to -1 and pads to k with -1."""
    neg = -vals
    neg, idx = lax.sort((neg, idx), dimension=1, num_keys=2)
    kk = min(k, vals.shape[1])
    out = jnp.where(neg[:, :kk] < jnp.inf, idx[:, :kk], -1).astype(I32)
    return pad_last(out, k, -1)


def _topk_rows_ref(x, k):
    """Exact top-k of rows x [N, S] (canonicalised f32) with the tie rule: one sort of each row by (score desc,
    index asc). Branch-free on purpose: lax.top_k's order among equal scores is implementation-defined, and fixing
    it up behind a `lax.cond` cost a device-to-host copy of the predicate and a stream sync per call on GPU (every
    CSA layer of a decode step whose rows are this short)."""
    iota = lax.broadcasted_iota(I32, x.shape, 1)
    return _order_and_pad(x, iota, k)


def topk_ref(scores, k):
    """Exact reference top-k. scores [B, T, S] -> int32 [B, T, k] (see module docstring for the rule)."""
    *lead, S = scores.shape
    x = _canon(scores.reshape(-1, S))
    return _topk_rows_ref(x, int(k)).reshape(*lead, int(k))


# --------------------------------------------------------------------------------------------------------------
# GPU: threshold, compaction, exact redo of overflowing rows, rank-scatter
# --------------------------------------------------------------------------------------------------------------

def _sortable_key(x):
    """int32 keys ordered like the (canonical, non-NaN) floats x: flip the magnitude bits of negatives."""
    b = lax.bitcast_convert_type(x, I32)
    return jnp.where(b >= 0, b, b ^ jnp.int32(0x7FFFFFFF))


def _threshold_params(S, kk):
    n_groups = next_pow2(4 * kk)
    cap = next_pow2(2 * kk)
    return n_groups, cap


def _float_of_key(t):
    """Inverse of `_sortable_key`."""
    return lax.bitcast_convert_type(jnp.where(t >= 0, t, t ^ jnp.int32(0x7FFFFFFF)), F32)


def _bisect_key(count, target, start=None, steps=32):
    """The largest int32 key t with count(lambda key: key >= t) >= target (target >= 1): the target-th largest
    key, built from the top bit down in 32 counting passes (`steps` 0 with `start`: that key, no pass)."""
    def bit(b, t):
        cand = t ^ jnp.left_shift(jnp.int32(1), 31 - b)
        return jnp.where(count(lambda key: key >= cand) >= target, cand, t)
    return lax.fori_loop(0, steps, bit, jnp.int32(-2 ** 31) if start is None else start)


def _kth_kernel(g_ref, o_ref, *, kk):
    g = g_ref[...]                                                          # [G]
    fin = g > -jnp.inf
    key = _sortable_key(jnp.where(g == 0, 0.0, g))
    t = _bisect_key(lambda pred: jnp.sum((fin & pred(key)).astype(I32)), kk)
    # fewer than kk finite maxima: -inf (all finite scores are candidates; a finite threshold would drop the
    # smaller scores of the groups it covers, which may be in the top k)
    o_ref[...] = jnp.where(jnp.sum(fin.astype(I32)) >= kk, _float_of_key(t), -jnp.inf)


def _kth_largest(g, kk, *, interpret=False):
    """k-th largest of each row of g [N, G] (-inf when fewer than kk are finite). One Pallas program per row
    bisects the keys: 8.6 us of GPU time on the H200 (G = 2048, k = 512, N = 1 or 64), where `lax.top_k` took
    15.3-16.6 us (more than the rest of the pipeline together at N = 1) and a pairwise count was slower still."""
    N, G = g.shape
    return pl.pallas_call(
        functools.partial(_kth_kernel, kk=kk),
        out_shape=jax.ShapeDtypeStruct((N,), F32),
        grid=(N,),
        in_specs=[pl.BlockSpec((None, G), lambda n: (n, 0))],
        out_specs=pl.BlockSpec((None,), lambda n: (n,)),
        compiler_params=_compat.TritonCompilerParams(num_warps=4, num_stages=1),
        interpret=bool(interpret),
        name="v4_topk_kth",
    )(g.astype(F32))


def _compact_kernel(x_ref, tau_ref, cnt_in, cs_ref, ci_ref, cnt_ref, *, chunk, cap):
    del cnt_in   # aliased with cnt_ref
    n = pl.program_id(0)
    c = pl.program_id(1)
    s = x_ref[...]                                                           # [chunk]
    m = (s >= tau_ref[...]) & (s > -jnp.inf)
    mi = m.astype(I32)
    rank = jnp.cumsum(mi) - 1
    base = _compat.pltriton.atomic_add(cnt_ref, n, jnp.sum(mi))
    pos = base + rank
    ok = m & (pos < cap)
    # masked-off lanes point past the row: never touched on GPU, and dropped (not clobbering slot 0 with its old
    # value) by interpret mode's scatter
    safe = jnp.where(ok, pos, cap)
    _compat.pltriton.store(cs_ref.at[safe], jnp.where(s == 0, 0.0, s), mask=ok)   # -0.0 -> +0.0 (see _canon)
    _compat.pltriton.store(ci_ref.at[safe], c * chunk + lax.broadcasted_iota(I32, (chunk,), 0), mask=ok)


def _compact(x, tau, cap, *, interpret=False, chunk=None):
    """Scores x [N, S] >= tau[n] (and finite) into (vals [N, cap], idx [N, cap], count [N]); order within a row
    is arbitrary (atomics); slots >= count are garbage; entries past cap are dropped (count still counts them)."""
    N, S = x.shape
    if chunk is None:
        chunk = min(4096, S)
    assert S % chunk == 0
    kernel = functools.partial(_compact_kernel, chunk=chunk, cap=cap)
    return pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((N, cap), F32), jax.ShapeDtypeStruct((N, cap), I32),
                   jax.ShapeDtypeStruct((N,), I32)),
        grid=(N, S // chunk),
        in_specs=[
            pl.BlockSpec((None, chunk), lambda n, c: (n, c)),
            pl.BlockSpec((None,), lambda n, c: (n,)),
            pl.BlockSpec((N,), lambda n, c: (0,)),
        ],
        out_specs=(pl.BlockSpec((None, cap), lambda n, c: (n, 0)),
                   pl.BlockSpec((None, cap), lambda n, c: (n, 0)),
                   pl.BlockSpec((N,), lambda n, c: (0,))),
        input_output_aliases={2: 2},
        compiler_params=_compat.TritonCompilerParams(num_warps=4, num_stages=1),
        interpret=bool(interpret),
        name="v4_topk_compact",
    )(x, tau, jnp.zeros((N,), I32))


def _redo_kernel(x_ref, tau_ref, cs_in, ci_in, cnt_in, cs_ref, ci_ref, cnt_ref, *, S, chunk, cap, kk):
    """Rows whose candidates overflowed `cap`: exact selection (the k-th key, then an ordered scan). Where fewer
    than kk scores lie above tau the k-th score is tau itself (the row overflowed on ties at it): one counting pass
    finds that. Otherwise the k-th key by bisection (~34 passes over the row in this one program: 185 us a call on
    an H100 for 32,768 equal scores, a flash-slice CSA layer at 128K whose FP4-rounded queries came out zero)."""
    del cs_in, ci_in   # aliased with the outputs: rows that did not overflow keep their candidates
    n = pl.program_id(0)
    n_chunks = S // chunk
    iota = lax.broadcasted_iota(I32, (chunk,), 0)

    def load(c):
        x = x_ref[pl.ds(n * S + c * chunk, chunk)]
        return jnp.where(x == 0, 0.0, x), x > -jnp.inf

    def count(pred, chunks=n_chunks):
        def body(c, acc):
            x, fin = load(c)
            return acc + jnp.sum((fin & pred(_sortable_key(x))).astype(I32))
        return lax.fori_loop(0, chunks, body, jnp.int32(0))

    @pl.when(cnt_in[...] > cap)
    def _():
        tau = tau_ref[...]
        at_tau = _sortable_key(jnp.where(tau == 0, 0.0, tau))
        above = count(lambda key: key > at_tau)
        ties = (tau > -jnp.inf) & (above < kk)    # then every finite score >= tau counts: more than cap >= kk
        # the passes skipped on ties. Not jnp.where(ties, 0, n): the Triton lowering types a select of two
        # literals by its predicate (i1), and a loop bound of i1 fails the GPU's verifier
        bisect = (~ties).astype(I32)
        slow = bisect * n_chunks
        target = jnp.where(ties, kk, jnp.minimum(count(lambda key: key == key, slow), kk))  # finite, at most kk
        t = _bisect_key(count, target, jnp.where(ties, at_tau, jnp.int32(-2 ** 31)), bisect * 32)
        need = target - jnp.where(ties, above, count(lambda key: key > t, slow))   # ties at t, lowest index first

        def scan(c, carry):
            w, n_eq = carry
            x, fin = load(c)
            key = _sortable_key(x)
            eq = fin & (key == t)
            take = (fin & (key > t)) | (eq & (n_eq + jnp.cumsum(eq.astype(I32)) <= need))
            ti = take.astype(I32)
            pos = jnp.where(take, w + jnp.cumsum(ti) - 1, cap)
            _compat.pltriton.store(cs_ref.at[pos], x, mask=take)
            _compat.pltriton.store(ci_ref.at[pos], c * chunk + iota, mask=take)
            return w + jnp.sum(ti), n_eq + jnp.sum(eq.astype(I32))

        lax.fori_loop(0, n_chunks, scan, (jnp.int32(0), jnp.int32(0)))
        cnt_ref[...] = jnp.where(target > 0, target, 0)


def _redo_overflow(x, tau, vals, idx, count, kk, *, interpret=False, chunk):
    N, S = x.shape
    kernel = functools.partial(_redo_kernel, S=S, chunk=chunk, cap=vals.shape[1], kk=kk)
    row = lambda a: pl.BlockSpec((None, a.shape[1]), lambda n: (n, 0))
    per_row = pl.BlockSpec((None,), lambda n: (n,))
    return pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct(vals.shape, F32), jax.ShapeDtypeStruct(idx.shape, I32),
                   jax.ShapeDtypeStruct(count.shape, I32)),
        grid=(N,),
        in_specs=[pl.BlockSpec((N * S,), lambda n: (0,)), per_row, row(vals), row(idx), per_row],
        out_specs=(row(vals), row(idx), per_row),
        input_output_aliases={2: 0, 3: 1, 4: 2},
        compiler_params=_compat.TritonCompilerParams(num_warps=4, num_stages=1),
        interpret=bool(interpret),
        name="v4_topk_redo_overflow",
    )(x.reshape(N * S), tau, vals, idx, count)


# candidates per program: 32 puts 32 programs on a row of 1024 candidates (128: 25 us at N = 1 on the H200,
# 8 programs looping serially)
_RANK_BLOCK = 32
# rows from which the candidates are ordered by one XLA sort instead (decode's few rows keep the rank kernel:
# 11 us per CSA layer at batch 1 on the H200, where a sort's launch alone is comparable)
_SORT_ROWS = 64
_RANK_INNER = 128    # candidates compared per loop step
# the longest row `_rank_rows` takes whole (a 16K context's CSA rows); longer rows take the threshold's candidates
_RANK_ROWS_MAX = 4096


def _rank_kernel(cs_ref, ci_ref, cnt_ref, o_ref, *, k, cap, blk, inner):
    p = pl.program_id(1)
    m = jnp.minimum(cnt_ref[...], cap)                                    # candidates in this row
    pos_i = p * blk + lax.broadcasted_iota(I32, (blk,), 0)
    vi = cs_ref[pl.ds(p * blk, blk)]
    ii = ci_ref[pl.ds(p * blk, blk)]
    valid_i = pos_i < m

    def body(j, rank):
        vj = cs_ref[pl.ds(j * inner, inner)]
        ij = ci_ref[pl.ds(j * inner, inner)]
        valid_j = j * inner + lax.broadcasted_iota(I32, (inner,), 0) < m
        before = (vj[None, :] > vi[:, None]) | ((vj[None, :] == vi[:, None]) & (ij[None, :] < ii[:, None]))
        return rank + jnp.sum((before & valid_j[None, :]).astype(I32), axis=1)

    rank = lax.fori_loop(0, (m + inner - 1) // inner, body, jnp.zeros((blk,), I32))
    ok = valid_i & (rank < k)
    _compat.pltriton.store(o_ref.at[jnp.where(ok, rank, k)], ii, mask=ok)
    fill = (pos_i >= m) & (pos_i < k)                                     # fewer than k candidates: pad with -1
    _compat.pltriton.store(o_ref.at[jnp.where(fill, pos_i, k)], jnp.full((blk,), -1, I32), mask=fill)


def _rank_scatter(vals, idx, count, k, *, interpret=False):
    """Candidates (vals, idx)[:, :count] -> their first k by (value desc, index asc), -1 padded: [N, k]."""
    N, cap = vals.shape
    blk = min(_RANK_BLOCK, cap)
    kernel = functools.partial(_rank_kernel, k=k, cap=cap, blk=blk, inner=min(_RANK_INNER, cap))
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((N, k), I32),
        grid=(N, cap // blk),
        in_specs=[pl.BlockSpec((None, cap), lambda n, p: (n, 0)), pl.BlockSpec((None, cap), lambda n, p: (n, 0)),
                  pl.BlockSpec((None,), lambda n, p: (n,))],
        out_specs=pl.BlockSpec((None, k), lambda n, p: (n, 0)),
        compiler_params=_compat.TritonCompilerParams(num_warps=4, num_stages=1),
        interpret=bool(interpret),
        name="v4_topk_rank_scatter",
    )(vals, idx, count)


def _rank_row_kernel(x_ref, o_ref, *, k, blk, inner):
    p = pl.program_id(1)
    pos_i = p * blk + lax.broadcasted_iota(I32, (blk,), 0)
    vi = _canon(x_ref[pl.ds(p * blk, blk)])

    def body(j, carry):
        rank, n_finite = carry
        vj = _canon(x_ref[pl.ds(j * inner, inner)])
        pos_j = j * inner + lax.broadcasted_iota(I32, (inner,), 0)
        # a -inf score is before no finite one: only the finite scores' ranks are kept
        before = (vj[None, :] > vi[:, None]) | ((vj[None, :] == vi[:, None]) & (pos_j[None, :] < pos_i[:, None]))
        return rank + jnp.sum(before.astype(I32), axis=1), n_finite + jnp.sum((vj > -jnp.inf).astype(I32))

    rank, n_finite = lax.fori_loop(0, x_ref.shape[0] // inner, body, (jnp.zeros((blk,), I32), jnp.int32(0)))
    ok = (vi > -jnp.inf) & (rank < k)  # a -inf score's rank would collide with the -1 fill below
    _compat.pltriton.store(o_ref.at[jnp.where(ok, rank, k)], pos_i, mask=ok)
    fill = (pos_i >= n_finite) & (pos_i < k)                              # fewer than k finite: pad with -1
    _compat.pltriton.store(o_ref.at[jnp.where(fill, pos_i, k)], jnp.full((blk,), -1, I32), mask=fill)


def _rank_rows_applies(N: int, S: int, k: int) -> bool:
    """A decode step's short rows (S a power of two from _RANK_INNER up to _RANK_ROWS_MAX, k <= S, fewer than
    _SORT_ROWS rows) are ranked whole by `_rank_rows`."""
    return N < _SORT_ROWS and k <= S <= _RANK_ROWS_MAX and S >= _RANK_INNER and S & (S - 1) == 0


def _rank_rows(x, k, *, interpret=False):
    """Exact top-k of short rows x [N, S] in one launch: every score's rank by (score desc, index asc) among the
    row's finite scores, a pairwise count as `_rank_kernel`'s, the first k scattered into place, -1 padded (the
    sort's form was three launches on a decode step's chain: a negation, the sort, a select)."""
    N, S = x.shape
    kernel = functools.partial(_rank_row_kernel, k=k, blk=_RANK_BLOCK, inner=_RANK_INNER)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((N, k), I32),
        grid=(N, S // _RANK_BLOCK),
        in_specs=[pl.BlockSpec((None, S), lambda n, p: (n, 0))],
        out_specs=pl.BlockSpec((None, k), lambda n, p: (n, 0)),
        compiler_params=_compat.TritonCompilerParams(num_warps=4, num_stages=1),
        interpret=bool(interpret),
        name="v4_topk_rank_rows",
    )(x)


def _sort_candidates(vals, idx, count, k):
    """Candidates (vals, idx)[:, :count] (slots past count hold garbage) -> their first k by (value desc, index
    asc), -1 padded: [N, k]. Same result as `_rank_scatter`."""
    vals = jnp.where(lax.broadcasted_iota(I32, vals.shape, 1) < count[:, None], vals, -jnp.inf)
    return _order_and_pad(vals, idx, k)


def _topk_threshold(scores, k, *, interpret=False):
    *lead, S = scores.shape
    k = int(k)
    x = scores.reshape(-1, S).astype(F32)      # not canonicalised here (a full pass): the kernels do it
    kk = min(k, S)
    n_groups, cap = _threshold_params(S, kk)
    if S <= 2 * n_groups:
        if _rank_rows_applies(x.shape[0], S, k):
            return _rank_rows(x, k, interpret=interpret).reshape(*lead, k)
        return _topk_rows_ref(_canon(x), k).reshape(*lead, k)
    c = -(-S // n_groups)
    xp = pad_last(x, c * n_groups, -jnp.inf)
    N = x.shape[0]
    gmax = jnp.max(xp.reshape(N, c, n_groups), axis=1)                     # strided groups {j, j+n, j+2n, ...}
    tau = _kth_largest(gmax, kk, interpret=interpret)                       # >= kk scores are >= tau
    # 1024 scores per compaction program: 256 programs on a 262,144-score row (4096: 64 programs, 12.7 us at N = 1)
    chunk = min(1024, n_groups)
    vals, idx, count = _compact(xp, tau, cap, interpret=interpret, chunk=chunk)
    vals, idx, count = _redo_overflow(xp, tau, vals, idx, count, kk, interpret=interpret, chunk=chunk)
    if N >= _SORT_ROWS:
        # many rows (a prefill chunk): one XLA sort of each row's candidates. The last 8192-token chunk of a 128K
        # prompt (8192 rows of 32768, k = 512) on the H200: 0.53 ms, where the rank-and-scatter took 4.74
        # (v4jax bench kernels --sweep topk_prefill); both equal to the reference.
        return _sort_candidates(vals, idx, count, k).reshape(*lead, k)
    return _rank_scatter(vals, idx, count, k, interpret=interpret).reshape(*lead, k)


# --------------------------------------------------------------------------------------------------------------
# TPU: approx_max_k candidates + verification
# --------------------------------------------------------------------------------------------------------------

def _topk_approx(scores, k, *, recall_target=0.95):
    *lead, S = scores.shape
    k = int(k)
    x = _canon(scores.reshape(-1, S))
    kk = min(k, S)
    if S <= 4 * kk:
        return _topk_rows_ref(x, k).reshape(*lead, k)
    cv, ci = lax.approx_max_k(x, kk, recall_target=recall_target, aggregate_to_topk=False)
    neg, ci_sorted = lax.sort((-cv, ci.astype(I32)), dimension=1, num_keys=2)
    vk = -neg[:, kk - 1:kk]                                                 # k-th value among candidates
    finite = lambda v: v > -jnp.inf
    # exact iff every score >= vk (finite) is a candidate: then the candidates hold the true top-k and all ties.
    n_row = jnp.sum((x >= vk) & finite(x), axis=1)
    n_cand = jnp.sum((cv >= vk) & finite(cv), axis=1)
    ok = jnp.all(n_row == n_cand)
    fast = lambda _: pad_last(jnp.where(neg[:, :kk] < jnp.inf, ci_sorted[:, :kk], -1), k, -1)
    slow = lambda _: _topk_rows_ref(x, k)
    return lax.cond(ok, fast, slow, None).reshape(*lead, k)


def topk(scores, k, *, interpret=False):
    """Exact top-k (same result as `topk_ref`). GPU: threshold + Triton kernels; TPU: approx_max_k candidates,
    verified; CPU: topk_ref; interpret=True: the GPU algorithm with its Pallas kernels interpreted."""
    be = _compat.backend()
    if interpret:
        return _topk_threshold(scores, k, interpret=True)
    if be == "gpu":
        return _topk_threshold(scores, k)
    if be == "tpu":
        return _topk_approx(scores, k)
    return topk_ref(scores, k)
