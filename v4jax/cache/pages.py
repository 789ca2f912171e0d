"""Host-side page bookkeeping: refcounted free lists and the page tables of every slot. Never holds device arrays.

Two page kinds: full pages (P tokens; one id addresses the page's rows of every compressed pool and of the token
pool) and SWA pages (Ps tokens of window KV; the boundary-state store rides in them, v4jax.cache.boundary).
A page is shared by reference count: each slot that maps it holds one reference, and the prefix tree holds one
for every page it keeps; a page returns to its free list when its count drops to zero. On a mesh with `data`
(and `context`) axes each kind of page is split into blocks, one free list per block, and a slot takes its pages
from its own shard's blocks only (PageTables says exactly which)."""
from __future__ import annotations

import dataclasses

import numpy as np

from v4jax.cache.pools import PoolLayout
from v4jax.config import ModelConfig


class PageAllocator:
    """Free lists of page ids, one per block of contiguous ids, with a reference count per page.

    Block b holds ids [b * n / n_blocks, (b + 1) * n / n_blocks): the pages one shard of the mesh holds (see
    PageTables for which slot takes from which block). A page always returns to its own block's list."""

    def __init__(self, n_pages: int, n_blocks: int = 1):
        if n_pages % n_blocks:
            raise ValueError(f"{n_pages} pages do not split into {n_blocks} equal blocks")
        self.n_pages, self.n_blocks = n_pages, n_blocks
        self.block_size = n_pages // n_blocks
        self.refs = np.zeros(n_pages, np.int32)
        # pop() hands out low ids first
        self._free = [list(range((b + 1) * self.block_size - 1, b * self.block_size - 1, -1)) for b in range(n_blocks)]

    @property
    def n_free(self) -> int:
        return sum(len(f) for f in self._free)

    @property
    def n_used(self) -> int:
        return self.n_pages - self.n_free

    @property
    def free_per_block(self) -> np.ndarray:
        return np.array([len(f) for f in self._free], np.int64)

    def block_of(self, page: int) -> int:
        return page // self.block_size

    def alloc(self, n: int, block: int = 0) -> list[int]:
        free = self._free[block]
        if n > len(free):
            raise MemoryError(f"need {n} pages of block {block}, {len(free)} free")
        out = [free.pop() for _ in range(n)]
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
                self._free[pg // self.block_size].append(pg)
        return freed


@dataclasses.dataclass
class SlotPages:
    """The pages one slot maps: full pages in order, and SWA pages by logical index (position // Ps)."""
    full: list[int] = dataclasses.field(default_factory=list)
    swa: dict[int, int] = dataclasses.field(default_factory=dict)


class PageTables:
    """Host page tables of every slot and the allocators behind them (paged), or a fixed mapping (dense: one
    contiguous span per slot and block; nothing is allocated, freed or shared).

    The layout over a mesh (attention data parallelism). D = the mesh's `data` size, C = its `context` size,
    G = D * C (layout.data_shards, layout.context_shards):
    - Full pages (the token pool and every compressed pool: C4 KV, C4 indexer keys, C128 KV, whose row axis is
      pages x rows per page, so contiguous page blocks are contiguous row blocks) form G equal contiguous blocks;
      block g = d * C + c holds pages [g * n / G, (g + 1) * n / G) (n = layout.n_pages, a multiple of G). On the
      mesh that axis is PartitionSpec(("data", "context")): device (d, c) holds block g.
    - Slot s belongs to data shard d = s // (max_slots / D) (max_slots is a multiple of D). Its j-th full page
      (j = page index within the sequence) comes from block d * C + (j % C).
    - SWA pages (and the boundary-state rows that ride in them) form D blocks, split over `data` only: a slot of
      shard d takes its SWA pages from block d.
    - Pages never move between shards: a slot maps only pages of its own shard (adopt checks it), so the prefix
      cache shares pages within a shard, never across.
    With D = C = 1 there is one block of each kind and page ids are handed out exactly as by one free list."""

    def __init__(self, cfg: ModelConfig, layout: PoolLayout, dense: bool):
        self.cfg, self.layout, self.dense = cfg, layout, dense
        s = layout.max_slots
        self.n_data, self.n_context = layout.data_shards, layout.context_shards
        if s % self.n_data:
            raise ValueError(f"{s} slots do not split over {self.n_data} data shards")
        self.slots_per_shard = s // self.n_data
        self.full = np.full((s, layout.max_pages_per_seq), -1, np.int32)
        self.swa = np.full((s, layout.max_swa_pages_per_seq), -1, np.int32)
        self.held = [SlotPages() for _ in range(s)]
        self.full_alloc = PageAllocator(layout.n_pages, self.n_data * self.n_context)
        self.swa_alloc = PageAllocator(layout.n_swa_pages, self.n_data)
        if dense:
            # slot i of shard d: its page j is entry i * ceil(pages / C) + j // C of block d * C + j % C
            # (with C = 1: pages s * max_pages + j, one span per slot)
            j = np.arange(layout.max_pages_per_seq)
            per_slot = -(-layout.max_pages_per_seq // self.n_context)
            for slot in range(s):
                i = slot % self.slots_per_shard
                self.full[slot] = (self.full_block(slot, j) * self.full_alloc.block_size + i * per_slot
                                   + j // self.n_context)
            self.swa[:] = np.arange(s * layout.max_swa_pages_per_seq, dtype=np.int32).reshape(s, -1)

    # ---- which shard and block ----
    def shard_of(self, slot: int) -> int:
        return slot // self.slots_per_shard

    def full_block(self, slot: int, j):
        """The block that the slot's j-th full page comes from (j may be an array)."""
        return self.shard_of(slot) * self.n_context + j % self.n_context

    def full_need(self, shard: int, j0: int, j1: int) -> np.ndarray:
        """[G] full pages per block that pages j0 .. j1-1 of a sequence in `shard` take."""
        out = np.zeros(self.full_alloc.n_blocks, np.int64)
        if j1 > j0:
            np.add.at(out, shard * self.n_context + np.arange(j0, j1) % self.n_context, 1)
        return out

    def swa_need(self, shard: int, n: int) -> np.ndarray:
        """[D] SWA pages per block: n of `shard`'s block."""
        out = np.zeros(self.swa_alloc.n_blocks, np.int64)
        out[shard] = n
        return out

    def _first_swa_needed(self, lo: int) -> int:
        """The first SWA page that a query at or after position `lo` can see."""
        return max(0, lo - (self.cfg.window_size - 1)) // self.layout.swa_page_size

    def needs(self, slot: int, lo: int, upto: int) -> tuple[np.ndarray, np.ndarray]:
        """([G] full, [D] SWA) pages per block that reserve(slot, lo, upto) would allocate, before any it frees."""
        if self.dense:
            return self.full_need(0, 0, 0), self.swa_need(0, 0)
        held, lay = self.held[slot], self.layout
        d = self.shard_of(slot)
        full = self.full_need(d, len(held.full), -(-upto // lay.page_size))
        swa = sum(1 for j in range(self._first_swa_needed(lo), -(-upto // lay.swa_page_size)) if j not in held.swa)
        return full, self.swa_need(d, swa)

    def reserve(self, slot: int, lo: int, upto: int) -> None:
        """Make positions [lo, upto) writable and readable for the slot. First drops the SWA pages that no query
        at or after `lo` can see; then raises MemoryError (allocating nothing) if a block has too few free pages."""
        if self.dense:
            return
        lay = self.layout
        held = self.held[slot]
        if -(-upto // lay.page_size) > lay.max_pages_per_seq:
            raise MemoryError(f"slot {slot}: {upto} tokens exceed the per-request page table")
        first = self._first_swa_needed(lo)
        self.drop_unseen(slot, lo)
        n_full, n_swa = self.needs(slot, lo, upto)
        if (n_full > self.full_alloc.free_per_block).any() or (n_swa > self.swa_alloc.free_per_block).any():
            raise MemoryError(f"slot {slot} (data shard {self.shard_of(slot)}): need {n_full.sum()} full and "
                              f"{n_swa.sum()} SWA pages; {self.full_alloc.n_free} and {self.swa_alloc.n_free} free "
                              f"(per block {self.full_alloc.free_per_block.tolist()} and "
                              f"{self.swa_alloc.free_per_block.tolist()})")
        while len(held.full) < -(-upto // lay.page_size):
            pg, = self.full_alloc.alloc(1, self.full_block(slot, len(held.full)))
            self.full[slot, len(held.full)] = pg
            held.full.append(pg)
        d = self.shard_of(slot)
        for j in range(first, -(-upto // lay.swa_page_size)):
            if j not in held.swa:
                pg, = self.swa_alloc.alloc(1, d)
                held.swa[j] = pg
                self.swa[slot, j] = pg

    def drop_unseen(self, slot: int, lo: int) -> None:
        """Drop the slot's SWA pages that no query at or after `lo` can see (reserve does this first)."""
        if self.dense:
            return
        held, first = self.held[slot], self._first_swa_needed(lo)
        gone = [j for j in held.swa if j < first]
        self.swa_alloc.decref([held.swa.pop(j) for j in gone])
        self.swa[slot, gone] = -1

    def adopt(self, slot: int, full_pages: list[int], swa_pages: dict[int, int]) -> None:
        """Map shared pages (a prefix hit) into an empty slot: one more reference to each. The pages must be
        where the slot's own would be (its shard's blocks): pages never move between shards."""
        held = self.held[slot]
        assert not held.full and not held.swa, "adopt into an empty slot"
        want = self.full_block(slot, np.arange(len(full_pages)))
        if any(self.full_alloc.block_of(pg) != b for pg, b in zip(full_pages, want)) or any(
                self.swa_alloc.block_of(pg) != self.shard_of(slot) for pg in swa_pages.values()):
            raise ValueError(f"slot {slot} (data shard {self.shard_of(slot)}) cannot map pages of another shard")
        self.full_alloc.incref(full_pages)
        self.swa_alloc.incref(swa_pages.values())
        held.full.extend(full_pages)
        self.full[slot, :len(full_pages)] = full_pages
        for j, pg in swa_pages.items():
            held.swa[j] = pg
            self.swa[slot, j] = pg

    def shard_usage(self, slots_in_use) -> list[dict]:
        """Per data shard: its slots in use (of `slots_in_use`, slot ids), and (paged) its full pages used per
        context block and its SWA pages used (pages held only by the prefix cache count as used)."""
        fa, sa = self.full_alloc, self.swa_alloc
        full_free, swa_free = fa.free_per_block, sa.free_per_block
        out = []
        for d in range(self.n_data):
            row = {"data": d, "slots": {"used": sum(self.shard_of(s) == d for s in slots_in_use),
                                        "total": self.slots_per_shard}}
            if not self.dense:
                row["full_pages"] = [{"used": fa.block_size - int(full_free[d * self.n_context + c]),
                                      "total": fa.block_size} for c in range(self.n_context)]
                row["swa_pages"] = {"used": sa.block_size - int(swa_free[d]), "total": sa.block_size}
            out.append(row)
        return out

    def release(self, slot: int) -> None:
        held = self.held[slot]
        if not self.dense:
            self.full_alloc.decref(held.full)
            self.swa_alloc.decref(list(held.swa.values()))
            self.full[slot] = -1
            self.swa[slot] = -1
        self.held[slot] = SlotPages()
