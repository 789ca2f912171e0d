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

Eviction: LRU per pool. SWA pressure tombstones the least recently used tails that no slot maps; full-page
pressure removes the least recently used leaves that no slot maps (with their tails)."""
from __future__ import annotations

import dataclasses
import itertools

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


class PrefixCache:
    def __init__(self, full_alloc: PageAllocator, swa_alloc: PageAllocator, page_size: int):
        self.full_alloc, self.swa_alloc, self.page_size = full_alloc, swa_alloc, page_size
        self.root = Node(tokens=(), page=-1, parent=None, depth=0)
        self._clock = itertools.count(1)
        self.queried_tokens = 0
        self.hit_tokens = 0
        self.evicted_pages = 0
        self.tombstoned = 0

    # ---- lookup ----
    def match(self, tokens, max_pages: int) -> list[Node]:
        """The longest path of nodes matching `tokens` page by page (at most `max_pages` pages) that ends at a
        node keeping its tail; [] when no resumable prefix is cached. Touches the path (LRU)."""
        p = self.page_size
        node, path = self.root, []
        for i in range(max_pages):
            child = node.children.get(tuple(tokens[i * p:(i + 1) * p]))
            if child is None:
                break
            path.append(child)
            node = child
        while path and path[-1].tail is None:
            path.pop()  # a tombstone (or a node that never had a tail): back off to the last resumable point
        stamp = next(self._clock)
        for n in path:
            n.stamp = stamp
        if path:
            path[-1].tail_stamp = stamp  # only the tail it resumes from is used
        return path

    def count_query(self, n_prompt: int, hit_pages: int) -> None:
        self.queried_tokens += n_prompt
        self.hit_tokens += hit_pages * self.page_size

    # ---- insertion ----
    def insert(self, parent: Node, tokens, page: int, tail: dict | None) -> Node:
        """Add (or find) the child of `parent` for this page's tokens. A new node takes a reference to `page`
        and to the tail's pages; an existing node keeps its own page and adopts the tail if it has none."""
        key = tuple(tokens)
        assert len(key) == self.page_size
        node = parent.children.get(key)
        if node is None:
            node = Node(tokens=key, page=page, parent=parent, depth=parent.depth + 1)
            parent.children[key] = node
            self.full_alloc.incref([page])
        if node.tail is None and tail is not None:
            node.tail = dict(tail)
            self.swa_alloc.incref(node.tail.values())
            node.tail_stamp = next(self._clock)
        node.stamp = next(self._clock)
        return node

    # ---- eviction ----
    def _nodes(self):
        stack = list(self.root.children.values())
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())

    def _tail_unmapped(self, n: Node) -> bool:
        return all(self.swa_alloc.refs[pg] == 1 for pg in n.tail.values())

    def evictable(self) -> tuple[int, int]:
        """(full, SWA) pages that eviction could free now (pages no slot maps)."""
        full = swa = 0
        for n in self._nodes():
            if n.tail is not None and self._tail_unmapped(n):
                swa += len(n.tail)
        # A node's page is freeable once its whole subtree is: count nodes whose subtree no slot maps.
        def walk(n: Node) -> bool:
            nonlocal full
            free_below = all([walk(c) for c in n.children.values()])
            free = free_below and self.full_alloc.refs[n.page] == 1
            if free:
                full += 1
            return free
        for c in self.root.children.values():
            walk(c)
        return full, swa

    def drop_tail(self, n: Node) -> None:
        self.swa_alloc.decref(n.tail.values())
        n.tail = None
        self.tombstoned += 1

    def evict_swa(self, n_pages: int) -> int:
        """Tombstone least recently used tails that no slot maps until `n_pages` SWA pages are free (or none
        are left to drop). Returns the SWA pages freed."""
        freed = 0
        for n in sorted((n for n in self._nodes() if n.tail is not None and self._tail_unmapped(n)),
                        key=lambda n: n.tail_stamp):
            if self.swa_alloc.n_free >= n_pages:
                break
            freed += len(n.tail)
            self.drop_tail(n)
        return freed

    def evict_full(self, n_pages: int) -> int:
        """Remove least recently used leaves that no slot maps (and their tails) until `n_pages` full pages are
        free (or nothing is left to remove). Returns the full pages freed."""
        freed = 0
        while self.full_alloc.n_free < n_pages:
            leaves = [n for n in self._nodes() if not n.children and self.full_alloc.refs[n.page] == 1]
            if not leaves:
                break
            leaves.sort(key=lambda n: n.stamp)
            for n in leaves:
                if self.full_alloc.n_free >= n_pages:
                    break
                self._remove(n)
                freed += 1
        return freed

    def _remove(self, n: Node) -> None:
        if n.tail is not None:
            self.swa_alloc.decref(n.tail.values())
            n.tail = None
        self.full_alloc.decref([n.page])
        del n.parent.children[n.tokens]
        self.evicted_pages += 1

    def clear(self) -> None:
        """Drop every node (pages mapped by slots stay theirs)."""
        while self.root.children:
            for n in [n for n in self._nodes() if not n.children]:
                self._remove(n)

    def n_nodes(self) -> int:
        return sum(1 for _ in self._nodes())
