"""Host-side page bookkeeping: refcounted free lists and the page tables of every slot. Never holds device arrays.

Two page kinds: full pages (P tokens; one id addresses the page's rows of every compressed pool and of the token
pool) and SWA pages (Ps tokens of window KV; the boundary-state store rides in them, v4jax.cache.boundary).
A page is shared by reference count: each slot that maps it holds one reference, and the prefix tree holds one
for every page it keeps; a page returns to its free list when its count drops to zero."""
from __future__ import annotations

import dataclasses

import numpy as np

from v4jax.cache.pools import PoolLayout
from v4jax.config import ModelConfig


class PageAllocator:
    """A free list of page ids with a reference count per page."""

    def __init__(self, n_pages: int):
        self.n_pages = n_pages
        self.refs = np.zeros(n_pages, np.int32)
        self._free = list(range(n_pages - 1, -1, -1))  # pop() hands out low ids first

    @property
    def n_free(self) -> int:
        return len(self._free)

    @property
    def n_used(self) -> int:
        return self.n_pages - len(self._free)

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise MemoryError(f"need {n} pages, {len(self._free)} free")
        out = [self._free.pop() for _ in range(n)]
        self.refs[out] = 1
        return out

    def incref(self, pages) -> None:
        for pg in pages:
            if self.refs[pg] <= 0:
                raise ValueError(f"page {pg} is not allocated")
            self.refs[pg] += 1

    def decref(self, pages) -> list[int]:
        """Drop one reference from each page; returns the pages that became free."""
        freed = []
        for pg in pages:
            if not 0 <= pg < self.n_pages or self.refs[pg] <= 0:
                raise ValueError(f"page {pg} is not allocated")
            self.refs[pg] -= 1
            if self.refs[pg] == 0:
                freed.append(pg)
        self._free.extend(freed)
        return freed


@dataclasses.dataclass
class SlotPages:
    """The pages one slot maps: full pages in order, and SWA pages by logical index (position // Ps)."""
    full: list[int] = dataclasses.field(default_factory=list)
    swa: dict[int, int] = dataclasses.field(default_factory=dict)


class PageTables:
    """Host page tables of every slot and the allocators behind them (paged), or a fixed identity mapping
    (dense: one contiguous span per slot; nothing is allocated, freed or shared)."""

    def __init__(self, cfg: ModelConfig, layout: PoolLayout, dense: bool):
        self.cfg, self.layout, self.dense = cfg, layout, dense
        s = layout.max_slots
        self.full = np.full((s, layout.max_pages_per_seq), -1, np.int32)
        self.swa = np.full((s, layout.max_swa_pages_per_seq), -1, np.int32)
        self.held = [SlotPages() for _ in range(s)]
        self.full_alloc = PageAllocator(layout.n_pages)
        self.swa_alloc = PageAllocator(layout.n_swa_pages)
        if dense:
            self.full[:] = np.arange(s * layout.max_pages_per_seq, dtype=np.int32).reshape(s, -1)
            self.swa[:] = np.arange(s * layout.max_swa_pages_per_seq, dtype=np.int32).reshape(s, -1)

    def _first_swa_needed(self, lo: int) -> int:
        """The first SWA page that a query at or after position `lo` can see."""
        return max(0, lo - (self.cfg.window_size - 1)) // self.layout.swa_page_size

    def needs(self, slot: int, lo: int, upto: int) -> tuple[int, int]:
        """(full, SWA) pages that reserve(slot, lo, upto) would allocate, before any it frees."""
        if self.dense:
            return 0, 0
        held, lay = self.held[slot], self.layout
        full = max(0, -(-upto // lay.page_size) - len(held.full))
        swa = sum(1 for j in range(self._first_swa_needed(lo), -(-upto // lay.swa_page_size)) if j not in held.swa)
        return full, swa

    def reserve(self, slot: int, lo: int, upto: int) -> None:
        """Make positions [lo, upto) writable and readable for the slot. First drops the SWA pages that no query
        at or after `lo` can see; then raises MemoryError (allocating nothing) if a pool has too few free pages."""
        if self.dense:
            return
        lay = self.layout
        held = self.held[slot]
        if -(-upto // lay.page_size) > lay.max_pages_per_seq:
            raise MemoryError(f"slot {slot}: {upto} tokens exceed the per-request page table")
        first = self._first_swa_needed(lo)
        gone = [j for j in held.swa if j < first]
        self.swa_alloc.decref([held.swa.pop(j) for j in gone])
        self.swa[slot, gone] = -1
        n_full, n_swa = self.needs(slot, lo, upto)
        if n_full > self.full_alloc.n_free or n_swa > self.swa_alloc.n_free:
            raise MemoryError(f"need {n_full} full and {n_swa} SWA pages; {self.full_alloc.n_free} and "
                              f"{self.swa_alloc.n_free} free")
        for pg in self.full_alloc.alloc(n_full):
            self.full[slot, len(held.full)] = pg
            held.full.append(pg)
        for j in range(first, -(-upto // lay.swa_page_size)):
            if j not in held.swa:
                pg, = self.swa_alloc.alloc(1)
                held.swa[j] = pg
                self.swa[slot, j] = pg

    def dead_swa(self, slot: int, lo: int) -> list[int]:
        """The SWA pages of the slot that no query at or after `lo` can see (reserve drops them)."""
        if self.dense:
            return []
        first = self._first_swa_needed(lo)
        return [pg for j, pg in self.held[slot].swa.items() if j < first]

    def adopt(self, slot: int, full_pages: list[int], swa_pages: dict[int, int]) -> None:
        """Map shared pages (a prefix hit) into an empty slot: one more reference to each."""
        held = self.held[slot]
        assert not held.full and not held.swa, "adopt into an empty slot"
        self.full_alloc.incref(full_pages)
        self.swa_alloc.incref(swa_pages.values())
        held.full.extend(full_pages)
        self.full[slot, :len(full_pages)] = full_pages
        for j, pg in swa_pages.items():
            held.swa[j] = pg
            self.swa[slot, j] = pg

    def release(self, slot: int) -> None:
        held = self.held[slot]
        if not self.dense:
            self.full_alloc.decref(held.full)
            self.swa_alloc.decref(list(held.swa.values()))
            self.full[slot] = -1
            self.swa[slot] = -1
        self.held[slot] = SlotPages()
