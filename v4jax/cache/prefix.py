"""The prefix cache: a radix tree over full pages, keyed by token ids (host only; holds page ids, never arrays).

Each node is one full page of P tokens below its parent: the page's rows of every compressed pool (C4 KV, C4
indexer keys, C128 KV) and of the token pool, shared by reference count. A node may also keep the *tail* of its
boundary: the SWA pages of the 128 positions before the page's end, whose last page carries the CSA compressors'
state at that boundary (v4jax.cache.boundary). A request can resume exactly at a node only if the node keeps its
tail: the window and the compressor state are then restored without recomputing anything.

Why keep tails instead of recomputing the window: a layer's window KV at position p depends on its layer input
there, which depends on the window of the layer below, so recomputing the last 128 positions exactly means
recomputing 128 x n_layers positions back: a cold prefill of the prefix in all but name. A tail costs 128 tokens
of SWA KV per layer plus 4 positions of f32 compressor state per CSA layer, and is dropped first under pressure
("tombstone"): the node keeps its compressed pages, so deeper nodes that still keep their tails go on hitting.

Eviction: LRU per pool. SWA pressure tombstones the least recently used tails that no slot maps, *shadowed* ones
first: a tail the request that saved it passed with two deeper tails on the same path, and that no request has
resumed from. A prefill saves a tail at every page boundary (a 4K prompt: 16), where the pool keeps about four per
slot; in plain LRU a batch of 32 such prompts kept every tail of the last few and none of the first ones' deepest
(at which an identical prompt, or the next turn of a conversation, resumes): 75 % of the prompt tokens hit where
100 % could.
A shadowed tail serves only a later prompt that shares part of the path, and once one resumes from it, it is an
ordinary tail. Full-page pressure removes the least recently used leaves that no slot maps (with their tails).

On a mesh with a `data` axis there is one tree per data shard (`roots`), over that shard's pages only: a page
never moves between shards (v4jax.cache.pages.PageTables), so a request can reuse a prefix only in the shard
that computed it, and pressure in one shard evicts only from that shard's tree."""
from __future__ import annotations

import dataclasses
import heapq
import itertools

import numpy as np

from v4jax.cache.pages import PageAllocator


@dataclasses.dataclass(eq=False)
class Node:
    tokens: tuple  # the page's P token ids
    page: int  # full page id (-1 at the root)
    parent: "Node | None"
    depth: int  # pages from the root (this node's page is page depth-1 of a sequence)
    children: dict = dataclasses.field(default_factory=dict)
    tail: dict | None = None  # SWA logical index -> SWA page id, the 128 positions before this page's end
    stamp: int = 0  # last use (LRU)
    tail_stamp: int = 0  # last use of the tail: its insertion, or a request resuming from it (tail LRU)
    resumed: bool = False  # a request has resumed from this node's tail


class PrefixCache:
    def __init__(self, full_alloc: PageAllocator, swa_alloc: PageAllocator, page_size: int, n_shards: int = 1):
        self.full_alloc, self.swa_alloc, self.page_size = full_alloc, swa_alloc, page_size
        self.roots = [Node(tokens=(), page=-1, parent=None, depth=0) for _ in range(n_shards)]
        self._blocks_per_shard = full_alloc.n_blocks // n_shards  # full-page blocks of one data shard
        self._clock = itertools.count(1)
        self.queried_tokens = 0
        self.hit_tokens = 0
        self.evicted_pages = 0
        self.tombstoned = 0
        # the nodes keeping a tail, least recently used tail first (dict order; a use moves it to the end): the
        # tail evictions and counts walk these, not the whole tree (32,000 nodes took 6 ms a walk). The shadowed
        # tails (module docstring) are in `_shadowed`, dropped before any of `_tails`.
        self._tails: dict[Node, None] = {}
        self._shadowed: dict[Node, None] = {}
        self._leaves: set[Node] = set()  # the nodes without children: what full-page eviction removes first
        # per full-page block, a heap of (stamp, page, push count, node) over its leaves, least recently used on
        # top; an entry is stale once its node is no leaf or has a newer stamp (skipped when popped, the heap rebuilt
        # when mostly stale): an eviction pops the leaves it removes (heaping every leaf took 1.05 ms at 2,000)
        self._leaf_heaps: list[list] = [[] for _ in range(full_alloc.n_blocks)]
        self._pushes = itertools.count()  # (a node can be pushed twice with one stamp: never compare nodes)
        self._by_page: dict[int, Node] = {}  # full page id -> its node
        self._pages_per_block = np.zeros(full_alloc.n_blocks, np.int64)  # the tree's full pages in each block
        self._tail_pages_per_block = np.zeros(swa_alloc.n_blocks, np.int64)  # the tails' SWA pages in each block
        self._tails_of_page: dict[int, list[Node]] = {}  # SWA page id -> the nodes whose tails hold it

    @property
    def root(self) -> Node:
        """The tree of data shard 0 (the only one without a `data` axis)."""
        return self.roots[0]

    # ---- lookup ----
    def walk(self, tokens, max_pages: int, shard: int = 0) -> list[Node]:
        """The longest path of nodes of `shard`'s tree matching `tokens` page by page (at most `max_pages` pages),
        resumable or not. Touches nothing."""
        p = self.page_size
        node, path = self.roots[shard], []
        for i in range(max_pages):
            child = node.children.get(tuple(tokens[i * p:(i + 1) * p]))
            if child is None:
                break
            path.append(child)
            node = child
        return path

    @staticmethod
    def resumable(path: list[Node]) -> list[Node]:
        """`path` cut back to its last node that keeps its tail ([] if none does)."""
        path = list(path)
        while path and path[-1].tail is None:
            path.pop()  # a tombstone (or a node that never had a tail): back off to the last resumable point
        return path

    def lookup(self, tokens, max_pages: int, shard: int = 0) -> list[Node]:
        """The longest path of nodes of `shard`'s tree matching `tokens` page by page (at most `max_pages` pages)
        that ends at a node keeping its tail; [] when no resumable prefix is cached there. Touches nothing."""
        return self.resumable(self.walk(tokens, max_pages, shard))

    def touch(self, path: list[Node]) -> None:
        """Mark a path used (LRU): every node on it, and the tail it resumes from."""
        stamp = next(self._clock)
        for n in path:
            self._stamp(n, stamp)
        if path:
            n = path[-1]  # only the tail it resumes from is used
            n.tail_stamp, n.resumed = stamp, True
            if n.tail is not None:
                self._index(n).pop(n)
                self._tails[n] = None

    def match(self, tokens, max_pages: int, shard: int = 0) -> list[Node]:
        """lookup(), and the path is touched (LRU)."""
        path = self.lookup(tokens, max_pages, shard)
        self.touch(path)
        return path

    def count_query(self, n_prompt: int, hit_pages: int) -> None:
        self.queried_tokens += n_prompt
        self.hit_tokens += hit_pages * self.page_size

    # ---- insertion ----
    def insert(self, parent: Node, tokens, page: int, tail: dict | None, shadows: Node | None = None) -> Node:
        """Add (or find) the child of `parent` for this page's tokens. A new node takes a reference to `page`
        and to the tail's pages; an existing node keeps its own page and adopts the tail if it has none.
        `shadows`: a node above on the inserting request's path that keeps a tail; once this node keeps one, that
        tail is shadowed (dropped first) unless a request has resumed from it."""
        key = tuple(tokens)
        assert len(key) == self.page_size
        node = parent.children.get(key)
        if node is None:
            node = Node(tokens=key, page=page, parent=parent, depth=parent.depth + 1)
            parent.children[key] = node
            self._leaves.discard(parent)
            self._leaves.add(node)
            self.full_alloc.incref([page])
            self._by_page[page] = node
            self._pages_per_block[self.full_alloc.block_of(page)] += 1
        if node.tail is None and tail is not None:
            node.tail = dict(tail)
            self.swa_alloc.incref(node.tail.values())
            self._count_tail(node, +1)
            node.tail_stamp = next(self._clock)
            self._tails[node] = None
        if node.tail is not None and shadows is not None and shadows.tail is not None and not shadows.resumed:
            self._index(shadows).pop(shadows)
            self._shadow(shadows)
        self._stamp(node, next(self._clock))
        return node

    def _shadow(self, n: Node) -> None:
        """Add n to the shadowed tails, kept in the order of their last use: a request extending another's path
        shadows tails older than some already shadowed (then the index is rebuilt in order)."""
        last = next(reversed(self._shadowed), None)
        self._shadowed[n] = None
        if last is not None and last.tail_stamp > n.tail_stamp:
            self._shadowed = dict.fromkeys(sorted(self._shadowed, key=lambda m: m.tail_stamp))

    def _stamp(self, n: Node, stamp: int) -> None:
        n.stamp = stamp
        if n in self._leaves:
            self._push_leaf(n)

    def _push_leaf(self, n: Node) -> None:
        heap = self._leaf_heaps[self.full_alloc.block_of(n.page)]
        heapq.heappush(heap, (n.stamp, n.page, next(self._pushes), n))
        if len(heap) > 64 and len(heap) > 4 * len(self._leaves):
            fresh = [e for e in heap if self._live(e)]
            heapq.heapify(fresh)
            heap[:] = fresh

    def _live(self, entry) -> bool:
        return entry[3] in self._leaves and entry[3].stamp == entry[0]

    def _count_tail(self, n: Node, sign: int) -> None:
        """Add (sign +1) or take away (-1) n's tail in the per-block count and the page -> tails map."""
        for pg in n.tail.values():
            self._tail_pages_per_block[self.swa_alloc.block_of(pg)] += sign
            holders = self._tails_of_page.setdefault(pg, [])
            if sign > 0:
                holders.append(n)
            else:
                holders.remove(n)
                if not holders:
                    del self._tails_of_page[pg]

    def _index(self, n: Node) -> dict:
        """The tail index holding `n` (it keeps a tail)."""
        return self._shadowed if n in self._shadowed else self._tails

    # ---- eviction ----
    def _nodes(self, shards=None):
        stack = [c for i, r in enumerate(self.roots) if shards is None or i in shards for c in r.children.values()]
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())

    def _tail_unmapped(self, n: Node) -> bool:
        return all(self.swa_alloc.refs[pg] == 1 for pg in n.tail.values())

    def evictable(self, keep: list[Node] = ()) -> tuple[np.ndarray, np.ndarray]:
        """([full-page blocks], [SWA blocks]) pages per block that eviction could free now (pages no slot maps),
        not counting the nodes of `keep` (a matched path about to be mapped) nor the tail of its last node.

        A node's page is freeable once no slot maps it nor any node below it: the tree's pages less the nodes on
        the paths to the pages slots map (shared pages: more than the tree's reference), found from those pages
        upwards. The work grows with the pages slots map, not with the tree (a walk of a 32,000-node tree took
        40 ms of host time, at every admission a waiting request tried once the cache had filled the pools)."""
        full = self._pages_per_block.copy()
        pinned: set[Node] = set()

        def pin(n: Node | None) -> None:
            while n is not None and n.page >= 0 and n not in pinned:
                pinned.add(n)
                full[self.full_alloc.block_of(n.page)] -= 1
                n = n.parent

        for pg in np.flatnonzero(self.full_alloc.refs > 1).tolist():
            pin(self._by_page.get(pg))  # (a shared page outside the tree: none today)
        if keep:
            pin(keep[-1])  # a path from the root: its last node pins the rest
        # likewise a tail is freeable unless a slot maps one of its pages (or it is the kept path's): the tails'
        # pages less those tails, found from the SWA pages slots map (iterating 2,000 tails took 2 ms)
        swa = self._tail_pages_per_block.copy()
        held = {n for pg in np.flatnonzero(self.swa_alloc.refs > 1).tolist() for n in self._tails_of_page.get(pg, ())}
        if keep and keep[-1].tail is not None:
            held.add(keep[-1])
        for n in held:
            for pg in n.tail.values():
                swa[self.swa_alloc.block_of(pg)] -= 1
        return full, swa

    def drop_tail(self, n: Node) -> None:
        self.swa_alloc.decref(n.tail.values())
        self._count_tail(n, -1)
        n.tail = None
        del self._index(n)[n]
        self.tombstoned += 1

    def evict_swa(self, n_pages) -> int:
        """Tombstone least recently used tails that no slot maps, the shadowed ones first, until `n_pages` SWA pages
        are free in every block (an int, or one figure per block; or none are left to drop). Returns the SWA pages
        freed."""
        freed = 0
        alloc = self.swa_alloc
        short = lambda: alloc.free_per_block < n_pages  # noqa: E731
        # a shard's tails hold pages of its own SWA block only: look where pages are short
        shards = set(np.flatnonzero(short()).tolist())
        for n in [*self._shadowed, *self._tails]:  # least recently used first
            if not short().any():
                break
            if alloc.block_of(next(iter(n.tail.values()))) not in shards or not self._tail_unmapped(n):
                continue
            freed += len(n.tail)
            self.drop_tail(n)
        return freed

    def evict_full(self, n_pages) -> int:
        """Remove least recently used leaves that no slot maps (and their tails) until `n_pages` full pages are
        free in every block (an int, or one figure per block; or nothing is left to remove). Returns the full
        pages freed. Leaves in the blocks that are short go first; others of the same shard go after them, since
        removing a leaf can make its parent (in another block under `context`) a leaf."""
        freed = 0
        alloc = self.full_alloc
        mapped = []  # popped leaves a slot maps: back into their heaps at the end
        while (need := alloc.free_per_block < n_pages).any():
            shards = set((np.flatnonzero(need) // self._blocks_per_shard).tolist())
            blocks = [b for b in range(alloc.n_blocks) if b // self._blocks_per_shard in shards]
            n = self._pop_leaf([b for b in blocks if need[b]], mapped) or self._pop_leaf(
                [b for b in blocks if not need[b]], mapped)
            if n is None:
                break
            self._remove(n)  # a parent left childless becomes a leaf, pushed with its stamp: a long prefix's chain
            freed += 1       # goes in one pass
        for e in mapped:
            heapq.heappush(self._leaf_heaps[alloc.block_of(e[1])], e)
        return freed

    def _pop_leaf(self, blocks: list[int], mapped: list) -> Node | None:
        """The least recently used leaf of `blocks` that no slot maps (ties by page: a fixed order), popped from its
        heap; stale entries are dropped on the way, mapped leaves' entries set aside in `mapped`."""
        while True:
            best = None
            for b in blocks:
                heap = self._leaf_heaps[b]
                while heap and not self._live(heap[0]):
                    heapq.heappop(heap)
                if heap and (best is None or heap[0] < self._leaf_heaps[best][0]):
                    best = b
            if best is None:
                return None
            e = heapq.heappop(self._leaf_heaps[best])
            if self.full_alloc.refs[e[1]] == 1:
                return e[3]
            mapped.append(e)

    def _remove(self, n: Node) -> None:
        if n.tail is not None:
            self.swa_alloc.decref(n.tail.values())
            self._count_tail(n, -1)
            n.tail = None
            del self._index(n)[n]
        self.full_alloc.decref([n.page])
        del self._by_page[n.page]
        self._pages_per_block[self.full_alloc.block_of(n.page)] -= 1
        del n.parent.children[n.tokens]
        self._leaves.discard(n)
        if n.parent.page >= 0 and not n.parent.children:
            self._leaves.add(n.parent)
            self._push_leaf(n.parent)
        self.evicted_pages += 1

    def clear(self) -> None:
        """Drop every node (pages mapped by slots stay theirs)."""
        for n in reversed(list(self._nodes())):  # children before parents
            self._remove(n)
        self._leaf_heaps = [[] for _ in self._leaf_heaps]

    def check(self) -> None:
        """The tail and leaf indexes hold exactly the tree's nodes with a tail and without children, the tails in
        the order of their last use; AssertionError otherwise."""
        nodes = list(self._nodes())
        assert not set(self._tails) & set(self._shadowed)
        assert {*self._tails, *self._shadowed} == {n for n in nodes if n.tail is not None}
        assert not any(n.resumed for n in self._shadowed), "a tail resumed from is not shadowed"
        for index in (self._tails, self._shadowed):
            stamps = [n.tail_stamp for n in index]
            assert stamps == sorted(stamps), "a tail index is out of LRU order"
        assert self._leaves == {n for n in nodes if not n.children}
        live = {e[3] for b, heap in enumerate(self._leaf_heaps) for e in heap
                if self._live(e) and self.full_alloc.block_of(e[1]) == b}
        assert live == self._leaves, "a leaf is missing from its block's heap"
        assert self._by_page == {n.page: n for n in nodes}
        tails = [n for n in nodes if n.tail is not None]
        assert self._tail_pages_per_block.tolist() == np.bincount(
            [self.swa_alloc.block_of(pg) for n in tails for pg in n.tail.values()],
            minlength=self.swa_alloc.n_blocks).tolist()
        holders: dict[int, set] = {}
        for n in tails:
            for pg in n.tail.values():
                holders.setdefault(pg, set()).add(n)
        assert {pg: set(ns) for pg, ns in self._tails_of_page.items()} == holders
        assert self._pages_per_block.tolist() == np.bincount(
            [self.full_alloc.block_of(n.page) for n in nodes], minlength=self.full_alloc.n_blocks).tolist()

    def n_nodes(self) -> int:
        return sum(1 for _ in self._nodes())
