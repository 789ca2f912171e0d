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
