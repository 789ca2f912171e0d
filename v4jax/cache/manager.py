"""The KV-cache manager: the scheduler's only door to pages (host only; never holds device arrays).

    kv = KVCacheManager(cfg, layout, dense=False, caching=True, dtype=dtype)
    hit = kv.find_prefix(tokens, n_tokens, shard)       # a cached prefix of a request's tokens in a data shard
    kv.admissible(hit, upto, swa_tokens, pending)       # would its pages fit (evicting what no slot maps)?
    row = kv.map_prefix(slot, hit, n_tokens)            # map the hit into a slot: the boundary row to restore
    kv.allocate(slot, lo, upto)                         # pages for positions [lo, upto); False if they do not fit
    kv.commit(slot, token_slice, upto, saved)           # full pages written up to `upto` into the prefix tree
    kv.free(slot)                                       # its pages return (the tree keeps what it holds)
    kv.decode_tables(n_pages, rows), kv.prefill_tables(...)  # the page tables of a step: private host arrays
    kv.usage(slots_in_use), kv.prefix_stats()           # pages and bytes per pool; the prefix cache's counters

Behind it, private: the page allocators and page tables (v4jax.cache.pages; the data-shard / context-shard rules
of PageTables hold unchanged), the prefix tree (v4jax.cache.prefix: LRU, tombstoned window tails, one tree per data
shard) and the boundary-row bookkeeping (v4jax.cache.boundary: a boundary's compressor state rides in the SWA page
holding its position b-1, so a hit's row is that page's id). As vLLM v1's KVCacheManager: the scheduler asks for
pages by positions and never sees a free list, a refcount or a tree node."""
from __future__ import annotations

import dataclasses
from typing import Callable, Iterable

import numpy as np

from v4jax.cache.boundary import recorded_boundaries
from v4jax.cache.layout import pool_sizes
from v4jax.cache.pages import PageTables
from v4jax.cache.pools import PoolLayout
from v4jax.cache.prefix import Node, PrefixCache
from v4jax.config import ModelConfig


def _snapshot(table: np.ndarray) -> np.ndarray:
    """A private copy of a host page table as it is now, for a jitted step to take. The host tables are mutated by
    the next allocation while earlier steps may still be running (dispatch is async), and on CPU a step's input can
    alias numpy memory (zero-copy), so the step must get a copy nobody mutates (measured: aliasing made chunked
    prefill nondeterministic). Passed as numpy: jit's own transfer is cheaper than a separate jnp.asarray."""
    return np.array(table, copy=True)


@dataclasses.dataclass(frozen=True, eq=False)
class PrefixHit:
    """A cached prefix of a request's tokens in one data shard: `n_pages` full pages the request can resume after
    (their window tail and compressor state are kept), of `cached_pages` the tree holds (past a tombstoned tail,
    or a boundary whose state was never saved, the pages are there but cannot be resumed from)."""
    shard: int
    _nodes: tuple = ()
    cached_pages: int = 0

    @property
    def n_pages(self) -> int:
        return len(self._nodes)


@dataclasses.dataclass
class _SlotState:
    nodes: list = dataclasses.field(default_factory=list)  # prefix-tree path of the slot's full pages
    saved: set = dataclasses.field(default_factory=set)  # full-page boundaries whose compressor state was saved
    # the two deepest nodes of `nodes` the slot inserted that keep a tail: both stay unshadowed, since a prompt
    # of whole pages repeated resumes one page before its end (its last token must be computed), any other
    # prompt or its next turn at its deepest boundary
    tailed: list = dataclasses.field(default_factory=list)


class KVCacheManager:
    def __init__(self, cfg: ModelConfig, layout: PoolLayout, *, dense: bool = False, caching: bool = True,
                 dtype=None):
        self.cfg, self.layout = cfg, layout
        self.dense = dense
        self.caching = caching and not dense
        self._tables = PageTables(cfg, layout, dense)
        self._prefix = (PrefixCache(self._tables.full_alloc, self._tables.swa_alloc, layout.page_size,
                                    layout.data_shards) if self.caching else None)
        self._slots = [_SlotState() for _ in range(layout.max_slots)]
        self._dtype = dtype
        self._sizes = None  # pool_sizes, on first use (an eval_shape of the pools)
        self.reused_pages = 0  # full pages mapped from the prefix cache, cumulative

    # ---- shape of the books ----
    @property
    def page_size(self) -> int:
        return self.layout.page_size

    @property
    def n_data(self) -> int:
        return self._tables.n_data

    @property
    def slots_per_shard(self) -> int:
        return self._tables.slots_per_shard

    def shard_of(self, slot: int) -> int:
        """The data shard of a slot: it maps pages of that shard only."""
        return self._tables.shard_of(slot)

    # ---- the prefix cache ----
    def find_prefix(self, tokens, n_tokens: int, shard: int) -> PrefixHit:
        """The cached prefix of a request's tokens in `shard` (touches nothing: admission may pick another shard).
        At least the last position is left to compute, so its logits exist."""
        if self._prefix is None:
            return PrefixHit(shard)
        path = self._prefix.walk(tokens, (n_tokens - 1) // self.page_size, shard)
        return PrefixHit(shard, tuple(PrefixCache.resumable(path)), len(path))

    def resumable_pages(self, tokens, n_tokens: int) -> int:
        """The most full pages of a request's tokens that a prefix hit could map now, in any data shard."""
        return max(self.find_prefix(tokens, n_tokens, d).n_pages for d in range(self.n_data))

    def admissible(self, hit: PrefixHit, upto: int, swa_tokens: int, pending: Iterable[tuple[int, int]] = ()) -> bool:
        """Whether a new sequence of `hit.shard`, mapping `hit` and growing to `upto` positions, fits with
        `swa_tokens` positions of window beyond its window size, while the slots of `pending` ((slot, upto)) still
        grow to theirs: the pages are free, or would be once the prefix cache evicted what no slot maps (the hit's
        own path excepted). The hit's path is marked used (LRU) first."""
        t, d = self._tables, hit.shard
        nodes = list(hit._nodes)
        if nodes:
            self._prefix.touch(nodes)
        p = self.page_size
        n_full = t.full_need(d, len(nodes), -(-upto // p))
        for slot, up in pending:
            if t.shard_of(slot) == d:
                n_full += t.full_need(d, max(len(self._slots[slot].nodes), len(t.held[slot].full)), -(-up // p))
        ps, w = self.layout.swa_page_size, self.cfg.window_size
        n_swa = t.swa_need(d, -(-(swa_tokens + w) // ps) + 1)
        return self._room_if_evicted(n_full, n_swa, nodes)

    def _room_if_evicted(self, n_full: np.ndarray, n_swa: np.ndarray, keep: list[Node]) -> bool:
        t = self._tables
        free_full, free_swa = t.full_alloc.free_per_block, t.swa_alloc.free_per_block
        if (free_full >= n_full).all() and (free_swa >= n_swa).all():
            return True
        if self._prefix is None:
            return False
        # the matched path stays (it is about to be mapped): not counted as evictable
        ev_full, ev_swa = self._prefix.evictable(keep)
        return (free_full + ev_full >= n_full).all() and (free_swa + ev_swa >= n_swa).all()

    def map_prefix(self, slot: int, hit: PrefixHit, n_tokens: int) -> int | None:
        """Map `hit` into an empty slot (shared pages: one more reference each) and count the lookup of a request
        of `n_tokens`. Returns the boundary-store row whose compressor state the slot must restore, or None."""
        if self._prefix is None:
            return None
        self._prefix.count_query(n_tokens, hit.n_pages)
        if not hit.n_pages:
            return None
        assert self.shard_of(slot) == hit.shard, "a prefix is mapped only within its shard"
        nodes = list(hit._nodes)
        last = nodes[-1]
        self._tables.adopt(slot, [n.page for n in nodes], last.tail)
        b = len(nodes) * self.page_size
        self._slots[slot] = _SlotState(nodes, {b})
        self.reused_pages += len(nodes)
        return last.tail[max(last.tail)]  # the SWA page holding position b-1 carries the state

    def commit(self, slot: int, token_slice: Callable[[int, int], list], upto: int, saved: Iterable[int] = ()) -> None:
        """Insert every full page of the slot whose tokens are all written (positions < `upto`) into the prefix
        tree. `saved`: the full-page boundaries at which the step just saved the slot's compressor state (a node
        keeps its window tail, and so can be resumed from, only there). `token_slice(a, b)` gives tokens[a:b]."""
        if self._prefix is None:
            return
        st = self._slots[slot]
        st.saved.update(saved)
        p = self.page_size
        held = self._tables.held[slot]
        while (len(st.nodes) + 1) * p <= upto:
            i = len(st.nodes)
            b = (i + 1) * p
            tail = None
            if b in st.saved:
                first = self._tables._first_swa_needed(b)
                js = range(first, -(-b // self.layout.swa_page_size))
                if all(j in held.swa for j in js):
                    tail = {j: held.swa[j] for j in js}
            parent = st.nodes[-1] if st.nodes else self._prefix.roots[self.shard_of(slot)]
            node = self._prefix.insert(parent, token_slice(i * p, b), held.full[i], tail,
                                       shadows=st.tailed[-2] if len(st.tailed) == 2 else None)
            st.nodes.append(node)
            if node.tail is not None:
                st.tailed = [*st.tailed[-1:], node]

    def prefill_boundaries(self, start: int, end: int) -> list[int]:
        """The full-page boundaries at which a prefill step over positions [start, end) of a slot saves its
        compressor state (the prefix cache can resume there): every one inside the chunk, and its end if a
        boundary. Pass them to `commit`."""
        if self._prefix is None:
            return []
        p = self.page_size
        return [*recorded_boundaries(start, end, p), *((end,) if end % p == 0 else ())]

    def reset_prefix_cache(self) -> None:
        """Drop every cached page that no slot maps (pages mapped by slots stay theirs)."""
        if self._prefix is not None:
            self._prefix.clear()

    # ---- pages of a slot ----
    def allocate(self, slot: int, lo: int, upto: int) -> bool:
        """Pages for positions [lo, upto) of the slot, evicting from the prefix cache if a pool is short; the SWA
        pages no query at or after `lo` can see are dropped. False (nothing allocated) if they do not fit."""
        t = self._tables
        # the pages the slot no longer sees go first: the tails that shared them (a prefill's shadowed tails) are
        # then the prefix cache's alone, and evicted before the tails other requests saved (dropped while the
        # slot still mapped them, a long prompt's chunks evicted every earlier prompt's deepest tail)
        t.drop_unseen(slot, lo)
        n_full, n_swa = t.needs(slot, lo, upto)
        if self._prefix is not None:
            if (t.full_alloc.free_per_block < n_full).any():
                self._prefix.evict_full(n_full)
            if (t.swa_alloc.free_per_block < n_swa).any():
                self._prefix.evict_swa(n_swa)
        if (t.full_alloc.free_per_block >= n_full).all() and (t.swa_alloc.free_per_block >= n_swa).all():
            t.reserve(slot, lo, upto)
            return True
        return False

    def slot_tables(self, slot: int) -> tuple[np.ndarray, np.ndarray]:
        """(full, SWA) page-table rows of a slot as they are now: copies (a request's state is read through them)."""
        return self._tables.full[slot].copy(), self._tables.swa[slot].copy()

    def trim(self, slot: int, pos: int) -> None:
        """Drop the slot's SWA pages that no query at or after `pos` can see (all of positions < pos are held)."""
        self._tables.reserve(slot, pos, pos)

    def free(self, slot: int) -> None:
        """The slot's pages return (the prefix tree keeps its references to those it holds)."""
        self._tables.release(slot)
        self._slots[slot] = _SlotState()

    # ---- the page tables of a step ----
    @property
    def max_swa_pages(self) -> int:
        return self._tables.swa.shape[1]

    def decode_tables(self, n_pages: int, rows: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(full [rows, n_pages], SWA [rows, max SWA pages]) page tables of slots 0 .. rows-1 (default: every
        slot), row b slot b: private copies."""
        t = self._tables
        return _snapshot(t.full[:rows, :n_pages]), _snapshot(t.swa[:rows])

    def prefill_tables(self, slots: list[int], n_rows: int, n_pages: int) -> tuple[np.ndarray, np.ndarray]:
        """(full [n_rows, n_pages], SWA [n_rows, max SWA pages]) page tables of the listed slots as rows, -1 for
        the rows past them: fresh arrays."""
        pt = np.full((n_rows, n_pages), -1, np.int32)
        swa = np.full((n_rows, self.max_swa_pages), -1, np.int32)
        for i, s in enumerate(slots):
            pt[i] = self._tables.full[s, :n_pages]
            swa[i] = self._tables.swa[s]
        return pt, swa

    # ---- usage ----
    def usage(self, slots_in_use: list[int]) -> dict:
        """Per pool (the names of stats()["pools"]): `used` and `total` pages (compressor_state: slots), `unit`,
        and `bytes_used` / `bytes_total` from the layout's bytes per unit. Pages only the prefix cache holds count
        as used; in the dense layout a slot in use holds its whole span."""
        t, lay = self._tables, self.layout
        if self.dense:
            n = len(slots_in_use)
            full_used, swa_used = n * lay.max_pages_per_seq, n * lay.max_swa_pages_per_seq
        else:
            full_used, swa_used = t.full_alloc.n_used, t.swa_alloc.n_used
        used = {"swa": swa_used, "mtp_swa": swa_used, "compressor_state": len(slots_in_use),
                "draft_state": len(slots_in_use)}
        if self._sizes is None:
            self._sizes = pool_sizes(self.cfg, lay, self._dtype or "bfloat16", self.caching)
        out = {}
        for name, size in self._sizes.items():
            u = used.get(name, full_used)
            out[name] = {"used": u, "total": size.units, "unit": size.unit, "bytes_used": u * size.unit_bytes,
                         "bytes_total": size.bytes}
            if size.host_bytes:  # host offload: where the bytes are
                out[name].update(device_bytes_total=size.bytes - size.host_bytes, host_bytes_total=size.host_bytes)
        return out

    def shard_usage(self, slots_in_use: list[int]) -> list[dict]:
        """Per data shard on a mesh with data / context axes: its slots and pages in use ([] without such axes)."""
        t = self._tables
        return t.shard_usage(slots_in_use) if t.n_data * t.n_context > 1 else []

    def mapped_pages(self, slots: list[int]) -> tuple[int, int]:
        """(full, SWA) distinct pages the listed slots map (pages only the prefix cache holds excluded)."""
        t, lay = self._tables, self.layout
        if self.dense:
            return len(slots) * lay.max_pages_per_seq, len(slots) * lay.max_swa_pages_per_seq
        full = set().union(*(t.held[i].full for i in slots)) if slots else set()
        swa = set().union(*(t.held[i].swa.values() for i in slots)) if slots else set()
        return len(full), len(swa)

    def prefix_stats(self) -> dict:
        pc = self._prefix
        return {
            "enabled": pc is not None,
            "queried_tokens": pc.queried_tokens if pc else 0,
            "hit_tokens": pc.hit_tokens if pc else 0,
            "reused_pages": self.reused_pages,
            "cached_pages": pc.n_nodes() if pc else 0,
            "evicted_pages": pc.evicted_pages if pc else 0,
            "tombstoned_tails": pc.tombstoned if pc else 0,
        }

    # ---- checks (tests, debugging) ----
    def check(self) -> None:
        """Every page's refcount is the number of slots mapping it plus one if the prefix tree holds it, and the
        free lists hold exactly the pages nobody refers to; AssertionError otherwise."""
        t = self._tables
        if self.dense:
            return
        want_full = np.zeros_like(t.full_alloc.refs)
        want_swa = np.zeros_like(t.swa_alloc.refs)
        for held in t.held:
            for pg in held.full:
                want_full[pg] += 1
            for pg in held.swa.values():
                want_swa[pg] += 1
        if self._prefix is not None:
            self._prefix.check()
            for n in self._prefix._nodes():
                want_full[n.page] += 1
                for pg in (n.tail or {}).values():
                    want_swa[pg] += 1
        np.testing.assert_array_equal(t.full_alloc.refs, want_full)
        np.testing.assert_array_equal(t.swa_alloc.refs, want_swa)
        assert t.full_alloc.n_free == int((want_full == 0).sum())
        assert t.swa_alloc.n_free == int((want_swa == 0).sum())

    def all_free(self) -> bool:
        """No slot maps a page and nobody holds one (empty the prefix cache first to count its pages free)."""
        t = self._tables
        if self.dense:
            return all(not h.full and not h.swa for h in t.held)
        return (t.full_alloc.n_free == self.layout.n_pages and t.swa_alloc.n_free == self.layout.n_swa_pages
                and (t.full_alloc.refs == 0).all() and (t.swa_alloc.refs == 0).all()
                and (t.full == -1).all() and (t.swa == -1).all())
