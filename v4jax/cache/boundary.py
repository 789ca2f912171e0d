"""The CSA compressors' state at full-page boundaries, kept so that a request can resume at any cached boundary.

At a boundary b (a multiple of P, hence of every ratio) a CSA compressor's state is exactly the previous window's
projections (rows [0, m) of its [2m, 2K] state: kv and gate scores, f32) and an empty current window; an HCA
compressor's state is empty (P is a multiple of 128). So one row of m x 2K per CSA compressor (main and indexer)
is all a boundary needs. The row lives beside the SWA page that holds position b-1 (row id = that SWA page's id,
as SGLang nests its state rings in SWA pages): it is valid exactly as long as the boundary's window tail is, and
dropping a tail (a tombstone) drops its state with it. Device side only: the steps write it, `restore` reads it."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from sharding.rules import STORE_AXES
from v4jax.cache.pools import KVPools, pin_host

F32 = jnp.float32
_FIELDS = (("state_kv", 0.0), ("state_score", -jnp.inf), ("idx_state_kv", 0.0), ("idx_state_score", -jnp.inf))
# state field -> the LayerPool field a prefill step records its inputs in (v4jax.model.attention.boundary_of)
_RECORD = {name: name.replace("state", "boundary") for name, _ in _FIELDS}


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class BoundaryStore:
    """Per layer stack (KVPools.stacks): a dict field -> [n, n_rows, m, C*K] f32 for CSA stacks (the previous
    window at a boundary, for each of the stack's n layers), None for the others."""
    layers: tuple


LOGICAL_AXES = STORE_AXES  # every array of the store (sharding/rules.py)


def store_shardings(store: BoundaryStore, sharding_of) -> BoundaryStore:
    """The same tree with each array's sharding, `sharding_of(logical axes, shape)`; store may be abstract."""
    return BoundaryStore(layers=tuple(
        None if d is None else {k: sharding_of(LOGICAL_AXES, a.shape) for k, a in d.items()} for d in store.layers))


def _is_csa(lp) -> bool:
    return lp.idx is not None


def init_boundary_store(pools: KVPools, n_rows: int) -> BoundaryStore:
    out = []
    for lp in pools.stacks:
        if not _is_csa(lp):
            out.append(None)
            continue
        d = {}
        for name, _ in _FIELDS:
            st = getattr(lp, name)  # [n, slots, 2m, 2K]
            d[name] = jnp.zeros((st.shape[0], n_rows, st.shape[2] // 2, st.shape[3]), F32)
        out.append(d)
    return BoundaryStore(layers=tuple(out))


def save_boundary_states(store: BoundaryStore, pools: KVPools, slots, rows) -> BoundaryStore:
    """store[rows[i]] = the previous-window half of slot slots[i]'s CSA states (rows out of range: no write).
    slots None: slot i for row i."""
    out = []
    for lp, d in zip(pools.stacks, store.layers):
        if d is None:
            out.append(None)
            continue
        nd = {}
        for name, _ in _FIELDS:
            st = getattr(lp, name)
            m = st.shape[2] // 2
            src = st[:, :, :m] if slots is None else st[:, slots, :m]
            nd[name] = d[name].at[:, rows].set(src, mode="drop")
        out.append(nd)
    return BoundaryStore(layers=tuple(out))


def recorded_boundaries(start: int, end: int, page_size: int) -> range:
    """The full-page boundaries inside a prefill chunk [start, end) whose CSA state the step records besides its
    end (host side of inner_page_ends; they must agree): every multiple of P at least P past start (so the m <= P
    positions before it lie in the chunk) and before end. Chunks start on a boundary (at 0, after a prefix hit,
    or where the scheduler cut the one before), so each records every boundary inside it."""
    return range((-(-start // page_size) + 1) * page_size, end, page_size)


def inner_page_ends(start, n_valid, page_size: int, t: int):
    """Device side of recorded_boundaries for rows (start, n_valid) [B] of a t-token chunk: [B, NB] int32, the
    boundaries in order, -1 past them; NB = t // P - 1, the most a chunk of t tokens holds."""
    first = (-(-start // page_size) + 1) * page_size
    ends = first[:, None] + page_size * jnp.arange(max(t // page_size - 1, 0))[None, :]
    return jnp.where(ends < (start + n_valid)[:, None], ends, -1).astype(jnp.int32)


def record_boundaries(pools: KVPools, n_rows: int, n_ends: int) -> KVPools:
    """The pools of a prefill step of n_rows rows that records n_ends boundaries a row: every CSA stack gets zeroed
    records [n, n_rows, n_ends * m, C*K] (LayerPool.boundary_*), which its compressors fill in."""
    stacks = []
    for lp in pools.stacks:
        upd = {}
        if _is_csa(lp):
            for name, _ in _FIELDS:
                st = getattr(lp, name)  # [n, slots, 2m, C*K]
                upd[_RECORD[name]] = jnp.zeros((st.shape[0], n_rows, n_ends * st.shape[2] // 2, st.shape[3]), F32)
        stacks.append(dataclasses.replace(lp, **upd))
    return dataclasses.replace(pools, stacks=tuple(stacks))


def save_recorded_boundaries(store: BoundaryStore, pools: KVPools, rows) -> tuple[BoundaryStore, KVPools]:
    """store[rows[b, j]] = row b's records at its j-th boundary (rows [B, NB]; out of range: no write), and the
    pools without the records."""
    out, stacks = [], []
    for lp, d in zip(pools.stacks, store.layers):
        if d is None:
            out.append(None)
            stacks.append(lp)
            continue
        nd = {}
        for name, _ in _FIELDS:
            rec = getattr(lp, _RECORD[name])  # [n, B, NB*m, C*K]
            n, b, length, ck = rec.shape
            nd[name] = d[name].at[:, rows.reshape(-1)].set(rec.reshape(n, rows.size, length // rows.shape[1], ck),
                                                         mode="drop")
        out.append(nd)
        stacks.append(dataclasses.replace(lp, **{_RECORD[name]: None for name, _ in _FIELDS}))
    return BoundaryStore(layers=tuple(out)), dataclasses.replace(pools, stacks=tuple(stacks))


def restore_slot_states(pools: KVPools, store: BoundaryStore, slot, row) -> KVPools:
    """Set slot `slot`'s compressor states to those of a boundary: CSA from store row `row` (the previous window,
    an empty current one), HCA empty. The slot then resumes at that boundary exactly (fresh=False)."""
    stacks = []
    for lp, d in zip(pools.stacks, store.layers):
        upd = {}
        for name, empty in _FIELDS:
            st = getattr(lp, name)  # [n, slots, C*m, C*K]
            if st is None:
                continue
            if d is None:
                new = jnp.full((st.shape[0],) + st.shape[2:], empty, F32)
            else:
                m = st.shape[2] // 2
                new = jnp.concatenate([d[name][:, row], jnp.full((st.shape[0], m, st.shape[3]), empty, F32)],
                                      axis=1)
            upd[name] = st.at[:, slot].set(new)
        stacks.append(dataclasses.replace(lp, **upd))
    draft = pools.draft
    # the MTP drafter resumes from the main streams of the slot's next prefill; the DSpark drafter keeps nothing per
    # slot (its window rings ride in the SWA pages the prefix hit maps)
    if draft is not None and draft.count is not None:
        draft = dataclasses.replace(draft, count=draft.count.at[slot].set(0))
    return pin_host(dataclasses.replace(pools, stacks=tuple(stacks), draft=draft))


def store_bytes(store: BoundaryStore) -> int:
    return sum(a.size * a.dtype.itemsize for d in store.layers if d is not None for a in d.values())
