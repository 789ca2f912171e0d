"""Context parallelism: a sequence's compressed entries spread over shards, each shard scoring and attending to the
entries it holds, and the two merges that make the shards' partial results exactly the single-device ones.

Placement. A pool whose row axis is split over mesh axes A holds one contiguous block of rows per shard: block
index = the shard's linear index over A, the first axis major (PartitionSpec(("data", "context")) puts block
d * C + c on shard (d, c)). A shard reads and writes only the rows of its block (`RowBlock.local`: a global row id
becomes a local one, -1 outside the block). Every row lives in exactly one block, so the shards' entry sets are
disjoint, and:
  * `merge_topk`: the top-k over all shards is the top-k of the union of every shard's own top-k by the tie rule
    (higher score first, then lower position): an entry of the global top-k is in its shard's top-k under the same
    total order.
  * `merge_softmax`: one softmax over the union, from each shard's partial (its output normalised over its own
    keys, and lse = log of its denominator): o = sum_c exp(lse_c - M) o_c / sum_c exp(lse_c - M).
The attention sink enters on one shard only (`first_along` the merge axes), and a pool that is not split over one of
the merge axes is read on that axis' first shard only, so nothing is counted twice. Everything here runs inside
jax.shard_map (or under vmap with named axes); with no axes the merges are identities."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

F32 = jnp.float32


def axes_of(entry) -> tuple[str, ...]:
    """A PartitionSpec entry as a tuple of mesh axes."""
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def first_along(axes: tuple[str, ...]):
    """True on the shards whose index along every axis of `axes` is 0 (True when there are none)."""
    ok = jnp.bool_(True)
    for a in axes:
        ok = ok & (jax.lax.axis_index(a) == 0)
    return ok


@dataclasses.dataclass(frozen=True)
class RowBlock:
    """One shard's block of a pool's row axis (per layer): `rows` rows, split over mesh axes `axes`."""
    axes: tuple[str, ...]
    rows: int

    def start(self):
        return jax.lax.axis_index(self.axes) * self.rows if self.axes else 0

    def local(self, global_rows):
        """Global row ids (-1 = none) -> rows of this block (-1 where the row is elsewhere or none)."""
        r = global_rows - self.start()
        return jnp.where((global_rows >= 0) & (r >= 0) & (r < self.rows), r, -1)


def _canonical_descending(scores):
    """Sort keys for 'higher score first': -score, with -0.0 and +0.0 made one value (a sort compares floats in
    total order, lax.top_k as numbers)."""
    neg = -scores.astype(F32)
    return jnp.where(neg == 0, jnp.zeros((), F32), neg)


def topk_by_rule(scores, positions, k: int):
    """The k best of candidates (scores, positions) [..., N] by the tie rule: higher score first, then lower
    position; -inf scores are none (position -1). Returns (scores, positions) [..., min(k, N)]."""
    key, pos = jax.lax.sort((_canonical_descending(scores), positions.astype(jnp.int32)), dimension=-1,
                            num_keys=2)
    kk = min(k, scores.shape[-1])
    key, pos = key[..., :kk], pos[..., :kk]
    none = key == jnp.inf
    return jnp.where(none, -jnp.inf, -key), jnp.where(none, -1, pos)


def merge_topk(scores, positions, k: int, axes: tuple[str, ...]):
    """Each shard's top-k candidates (scores, positions along the entries) [..., k'] -> the top-k over all shards
    of `axes`, the same on every shard: what one top-k over all entries gives, ties included. Keeps the
    candidates' count (min(k, k'))."""
    k = min(k, scores.shape[-1])
    if not axes:
        return scores, positions
    every_s = jax.lax.all_gather(scores, axes, axis=scores.ndim - 1, tiled=True)
    every_p = jax.lax.all_gather(positions, axes, axis=positions.ndim - 1, tiled=True)
    return topk_by_rule(every_s, every_p, k)


def merge_softmax(o, lse, axes: tuple[str, ...]):
    """Partial softmaxes -> one: o [..., H, K] (each shard's output normalised over its keys; 0 where it has none),
    lse [..., H] (log of its denominator, -inf where it has none). Returns the f32 output over every shard's keys.
    At least one shard must have a finite lse (the one that holds the sink)."""
    if not axes:
        return o.astype(F32)
    m = jax.lax.pmax(lse, axes)
    w = jnp.where(lse > -jnp.inf, jnp.exp(lse - m), 0.0)
    # one collective for numerator and denominator: [..., H, K + 1]
    both = jax.lax.psum(jnp.concatenate([w[..., None] * o.astype(F32), w[..., None]], axis=-1), axes)
    return both[..., :-1] / both[..., -1:]
