"""Host-side page bookkeeping: free lists and page tables. Never holds device arrays."""
from __future__ import annotations

import dataclasses

import numpy as np

from v4jax.cache.pools import PoolLayout
from v4jax.config import ModelConfig


class PageAllocator:
    """A free list of page ids. Host-only bookkeeping: never holds device arrays."""

    def __init__(self, n_pages: int):
        self.n_pages = n_pages
        self._free = list(range(n_pages - 1, -1, -1))

    @property
    def n_free(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise MemoryError(f"need {n} pages, {len(self._free)} free")
        out = [self._free.pop() for _ in range(n)]
        return out

    def free(self, pages) -> None:
        for pg in pages:
            if not 0 <= pg < self.n_pages:
                raise ValueError(f"page {pg} out of range")
        self._free.extend(pages)


@dataclasses.dataclass
class SlotPages:
    """The pages one request holds: full pages in order, and SWA pages by logical index."""
    full: list[int] = dataclasses.field(default_factory=list)
    swa: dict[int, int] = dataclasses.field(default_factory=dict)


class PageTables:
    """Host page tables of every slot, and the allocators behind them (paged), or a fixed identity
    mapping (dense: one contiguous span per slot; nothing is allocated or freed)."""

    def __init__(self, cfg: ModelConfig, layout: PoolLayout, dense: bool):
        self.cfg, self.layout, self.dense = cfg, layout, dense
        s = layout.max_slots
        self.full = np.full((s, layout.max_pages_per_seq), -1, np.int32)
        self.swa = np.full((s, layout.max_swa_pages_per_seq), -1, np.int32)
        self.held = [SlotPages() for _ in range(s)]
        if dense:
            self.full[:] = np.arange(s * layout.max_pages_per_seq, dtype=np.int32).reshape(s, -1)
            self.swa[:] = np.arange(s * layout.max_swa_pages_per_seq, dtype=np.int32).reshape(s, -1)
        else:
            self.full_alloc = PageAllocator(layout.n_pages)
            self.swa_alloc = PageAllocator(layout.n_swa_pages)

    def reserve(self, slot: int, lo: int, upto: int) -> None:
        """Make positions [lo, upto) writable and readable for the slot; earlier SWA pages that no query
        at or after `lo` can see are freed (the window moved past them)."""
        if self.dense:
            return
        lay = self.layout
        held = self.held[slot]
        need_full = -(-upto // lay.page_size)
        if need_full > lay.max_pages_per_seq:
            raise MemoryError(f"slot {slot}: {upto} tokens exceed the per-request page table")
        new = self.full_alloc.alloc(max(0, need_full - len(held.full)))
        for pg in new:
            self.full[slot, len(held.full)] = pg
            held.full.append(pg)
        first_needed = max(0, lo - (self.cfg.window_size - 1)) // lay.swa_page_size
        for j in [j for j in held.swa if j < first_needed]:
            self.swa_alloc.free([held.swa.pop(j)])
            self.swa[slot, j] = -1
        for j in range(first_needed, -(-upto // lay.swa_page_size)):
            if j not in held.swa:
                pg, = self.swa_alloc.alloc(1)
                held.swa[j] = pg
                self.swa[slot, j] = pg

    def release(self, slot: int) -> None:
        held = self.held[slot]
        if not self.dense:
            self.full_alloc.free(held.full)
            self.swa_alloc.free(list(held.swa.values()))
            self.full[slot] = -1
            self.swa[slot] = -1
        self.held[slot] = SlotPages()


