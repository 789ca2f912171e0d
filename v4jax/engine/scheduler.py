"""Which request runs where, and with which pages: continuous batching under every pool's limits (host only).

Each engine step decodes every running slot (k tokens in one jitted call) and runs one prefill step of at most
`prefill_chunk` tokens in all: a chunk of each request still prefilling, oldest first, as the rows of one batch
(up to MAX_PREFILL_ROWS), so a long prompt is interleaved with the running decodes instead of stalling them and
many short prompts share one call. Admission takes a waiting request into a free slot when the full-page pool
(C4 KV, C4 indexer keys, C128 KV and token ids share it), the SWA pool (window KV and the boundary states) and the
compressor-state slots can hold it, counting pages the prefix cache could give back. When a pool runs dry
mid-run the newest request is preempted (its pages freed; the prefix cache keeps its full pages) and recomputed
later from its tokens. Prefill chunks end on full-page boundaries so that the compressor state is saved there
and a later request can resume from it.

On a mesh with a `data` axis the slots, their pages and the prefix tree are split into data shards
(v4jax.cache.pages.PageTables): a request is admitted into a shard that has a free slot and the pages it needs
(its prefix hit's shard first, else the least loaded), and a dry pool preempts only within the shard that is
short, since another shard's pages could not be used there."""
from __future__ import annotations

import collections
import dataclasses
import itertools
from typing import Sequence

import numpy as np

from v4jax.cache.pages import PageTables
from v4jax.cache.prefix import Node, PrefixCache
from v4jax.sampling import SamplingParams

WAITING, PREFILLING, RUNNING = "waiting", "prefilling", "running"
MAX_PREFILL_ROWS = 8  # rows of one prefill step (powers of two up to this are compiled)
MIN_CHUNK_BUCKET = 16  # shortest compiled chunk: shorter ones are padded (fewer programs; the cost is a decode's)


@dataclasses.dataclass(eq=False)
class Request:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    seed: int
    sample_index: int  # part of the sampling key: (seed, sample_index, token index)
    stop_ids: tuple[int, ...]
    arrival: int
    output: list[int] = dataclasses.field(default_factory=list)
    status: str = WAITING
    slot: int | None = None
    computed: int = 0  # tokens whose KV is in the pools
    nodes: list = dataclasses.field(default_factory=list)  # prefix-tree path of its full pages
    saved: set = dataclasses.field(default_factory=set)  # full-page boundaries where its compressor state was saved
    hit_row: int | None = None  # boundary-store row to restore at admission (a prefix hit)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def n_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    def token_slice(self, a: int, b: int) -> list[int]:
        """tokens[a:b] without building `tokens` (a copy of the whole sequence: ~5 ms for a 1M-token prompt, and
        a prefill step takes a slice per chunk)."""
        n = len(self.prompt)
        if b <= n:
            return self.prompt[a:b]
        if a >= n:
            return self.output[a - n:b - n]
        return self.prompt[a:] + self.output[:b - n]

    @property
    def fed(self) -> int:
        """Tokens whose KV is written while decoding: all but the last generated one (the next to feed)."""
        return len(self.prompt) + len(self.output) - 1 if self.status == RUNNING else self.computed

    @property
    def limit(self) -> int:
        """Positions this request can ever hold."""
        return len(self.prompt) + self.params.max_tokens


class Scheduler:
    def __init__(self, tables: PageTables, prefix: PrefixCache | None, *, max_num_seqs: int, prefill_chunk: int,
                 decode_steps: int, max_model_len: int):
        self.tables, self.prefix = tables, prefix
        self.layout = tables.layout
        self.chunk, self.k, self.max_model_len = prefill_chunk, decode_steps, max_model_len
        self.step_tokens = chunk_bucket(prefill_chunk)  # a prefill step's rows x compiled length stay within this
        self.waiting: collections.deque[Request] = collections.deque()
        self.slots: list[Request | None] = [None] * max_num_seqs
        self.requests: dict[str, Request] = {}
        self._arrivals = itertools.count()
        self.n_preempted = 0

    # ---- requests in and out ----
    def add(self, request_id: str, prompt: Sequence[int], params: SamplingParams, seed: int, sample_index: int,
            stop_ids: tuple[int, ...]) -> Request:
        req = Request(request_id, list(prompt), params, seed, sample_index, stop_ids, next(self._arrivals))
        self.requests[request_id] = req
        self.waiting.append(req)
        return req

    def running(self) -> list[Request]:
        return [r for r in self.slots if r is not None and r.status == RUNNING]

    def prefilling(self) -> list[Request]:
        return sorted((r for r in self.slots if r is not None and r.status == PREFILLING), key=lambda r: r.arrival)

    def remove(self, req: Request) -> None:
        """Forget a request (finished or aborted): its slot and pages are released."""
        if req.slot is not None:
            self._release(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.requests.pop(req.request_id, None)

    def _release(self, req: Request) -> None:
        self.tables.release(req.slot)
        self.slots[req.slot] = None
        req.slot = None

    # ---- pages ----
    def _pages_upto(self, req: Request) -> int:
        """Full pages the request holds once admitted and past its first decode call."""
        return -(-min(req.n_tokens + self.k, req.limit) // self.layout.page_size)

    def _room(self, n_full: np.ndarray, n_swa: np.ndarray) -> bool:
        """Free (evicting from the prefix cache if needed) n_full full and n_swa SWA pages per block; whether it
        worked."""
        t = self.tables
        if self.prefix is not None:
            if (t.full_alloc.free_per_block < n_full).any():
                self.prefix.evict_full(n_full)
            if (t.swa_alloc.free_per_block < n_swa).any():
                self.prefix.evict_swa(n_swa)
        return (t.full_alloc.free_per_block >= n_full).all() and (t.swa_alloc.free_per_block >= n_swa).all()

    def reserve(self, req: Request, lo: int, upto: int) -> bool:
        """Pages for positions [lo, upto) of `req`, preempting newer requests if a pool is dry. False if `req`
        itself had to be preempted (it is then back in the waiting queue)."""
        while True:
            n_full, n_swa = self.tables.needs(req.slot, lo, upto)
            refs = self.tables.swa_alloc.refs
            dead = sum(1 for pg in self.tables.dead_swa(req.slot, lo) if refs[pg] == 1)  # reserve frees them
            n_swa = np.maximum(0, n_swa - self.tables.swa_need(self.tables.shard_of(req.slot), dead))
            if self._room(n_full, n_swa):
                self.tables.reserve(req.slot, lo, upto)
                return True
            # only a request of the same shard holds pages that this one could use
            shard = self.tables.shard_of(req.slot)
            victim = max((r for r in self.slots if r is not None and self.tables.shard_of(r.slot) == shard),
                         key=lambda r: r.arrival)
            self.preempt(victim)
            if victim is req:
                return False

    def preempt(self, req: Request) -> None:
        """Recompute later: free the slot and pages (the prefix cache keeps the full pages it holds) and put the
        request back at the front of the queue with the tokens it has generated."""
        self._release(req)
        req.status, req.computed, req.nodes, req.saved, req.hit_row = WAITING, 0, [], set(), None
        self.waiting.appendleft(req)
        self.n_preempted += 1

    # ---- admission ----
    def admit(self) -> list[Request]:
        """Move waiting requests into free slots while every pool can hold them; returns those admitted (with
        `hit_row` set where a cached prefix was mapped: the engine restores that boundary's compressor state)."""
        admitted = []
        while self.waiting:
            if self.prefix is not None and self._may_share(self.waiting[0]):
                break  # it may reuse pages a prefilling request has yet to cache: match it once they are cached
            req = self.waiting[0]
            placed = self._place(req)
            if placed is None:
                break
            slot, nodes = placed
            self.waiting.popleft()
            req.slot, req.status = slot, PREFILLING
            self.slots[slot] = req
            self._map_prefix(req, nodes)
            admitted.append(req)
        return admitted

    def _place(self, req: Request) -> tuple[int, list[Node]] | None:
        """(free slot, prefix path to map) for `req`, or None if no shard can take it now.

        Shards are tried by their cached prefix of the request (longest first), then by free slots (most first):
        the hit saves its prefill, and an even spread keeps every shard's decode batch full. A shard with no
        free slot or too few pages is skipped even if it holds the longest prefix: the request goes cold to
        another shard rather than wait, as vLLM's data-parallel ranks balance by load and never hold a request
        back for a cache hit (an idle slot costs more than a recomputed prefix; the prefix is then cached in
        that shard too, for the requests after it)."""
        t = self.tables
        free = [[i for i in range(d * t.slots_per_shard, (d + 1) * t.slots_per_shard) if self.slots[i] is None]
                for d in range(t.n_data)]
        candidates = []
        for d in range(t.n_data):
            if free[d]:
                nodes = self._match(req, d)
                candidates.append((-len(nodes), -len(free[d]), d, nodes))
        for _, _, d, nodes in sorted(candidates, key=lambda c: c[:3]):
            if nodes:
                self.prefix.match(req.tokens, len(nodes), d)  # the path it is about to map is used (LRU)
            # pages the shard's prefilling requests will still take, then this request's own
            n_full = self.tables.full_need(d, len(nodes), self._pages_upto(req))
            for r in self.prefilling():
                if t.shard_of(r.slot) == d:
                    n_full += t.full_need(d, max(len(r.nodes), len(t.held[r.slot].full)), self._pages_upto(r))
            if self._room_if_evicted(n_full, t.swa_need(d, self._swa_need(req)), nodes):
                return free[d][0], nodes
        return None

    def _may_share(self, req: Request) -> bool:
        """Whether `req` could match full pages that a request still prefilling will cache: their first pages
        are equal (every prefix match starts at page 0)."""
        p = self.layout.page_size
        if req.n_tokens <= p:
            return False  # the last position is always computed: no full page of it can be reused
        head = req.token_slice(0, p)
        return any(r.token_slice(0, p) == head for r in self.prefilling())

    def _swa_need(self, req: Request) -> int:
        ps, w = self.layout.swa_page_size, self.tables.cfg.window_size
        span = min(self.chunk, req.n_tokens) + w + 2 * self.k
        return -(-span // ps) + 1

    def _room_if_evicted(self, n_full: np.ndarray, n_swa: np.ndarray, keep: list[Node]) -> bool:
        """Whether n_full full and n_swa SWA pages per block are free, or would be once the prefix cache evicted
        what no slot maps (except the path `keep`, about to be mapped)."""
        t = self.tables
        free_full, free_swa = t.full_alloc.free_per_block, t.swa_alloc.free_per_block
        if (free_full >= n_full).all() and (free_swa >= n_swa).all():
            return True
        if self.prefix is None:
            return False
        ev_full, ev_swa = self.prefix.evictable()
        # the matched path stays (it is about to be mapped): do not count it as evictable
        for n in keep:
            if t.full_alloc.refs[n.page] == 1:
                ev_full[t.full_alloc.block_of(n.page)] -= 1
        for n in keep[-1:]:
            if all(t.swa_alloc.refs[pg] == 1 for pg in n.tail.values()):
                for pg in n.tail.values():
                    ev_swa[t.swa_alloc.block_of(pg)] -= 1
        return (free_full + ev_full >= n_full).all() and (free_swa + ev_swa >= n_swa).all()

    def _match(self, req: Request, shard: int) -> list[Node]:
        """The cached prefix of `req` in `shard`'s tree (not touched: admission may pick another shard)."""
        if self.prefix is None:
            return []
        # at least one token is computed, so the last position's logits exist
        return self.prefix.lookup(req.tokens, (req.n_tokens - 1) // self.layout.page_size, shard)

    def _map_prefix(self, req: Request, nodes: list[Node]) -> None:
        if self.prefix is not None:
            self.prefix.count_query(req.n_tokens, len(nodes))
        if not nodes:
            return
        last = nodes[-1]
        self.tables.adopt(req.slot, [n.page for n in nodes], last.tail)
        req.nodes = list(nodes)
        req.computed = len(nodes) * self.layout.page_size
        req.saved = {req.computed}
        req.hit_row = last.tail[max(last.tail)]  # the SWA page holding position b-1 carries the state

    # ---- prefill chunks ----
    def next_chunks(self) -> list[tuple[Request, int, int]]:
        """[(request, start, end)]: the next prefill step's rows, oldest prefilling request first, each chunk cut
        at the last full-page boundary inside it (its state is saved there). The first row takes up to
        `prefill_chunk` tokens; further rows join while the step's rows x its compiled length stay within one full
        chunk's (`step_tokens`), so a step costs at most what one full chunk does."""
        plans: list[tuple[Request, int, int]] = []
        p = self.layout.page_size
        for req in self.prefilling():
            if len(plans) == MAX_PREFILL_ROWS:
                break
            n, start = req.n_tokens, req.computed
            end = min(n, start + self.chunk)
            if end % p and end // p * p > start:
                end = end // p * p
            if plans:
                longest = max([e - s for _, s, e in plans] + [end - start])
                if _pow2(len(plans) + 1) * chunk_bucket(longest) > self.step_tokens:
                    break
            if not self.reserve(req, start, end):
                break  # it was preempted: the rest waits for the next step
            plans.append((req, start, end))
        # reserving pages for a later row may have preempted an earlier one
        return [(r, s, e) for r, s, e in plans if r.status == PREFILLING]

    # ---- the prefix tree ----
    def cache_pages(self, req: Request) -> None:
        """Insert every full page of `req` whose tokens are all written (up to `fed`) into the prefix tree."""
        if self.prefix is None or req.slot is None:
            return
        p = self.layout.page_size
        held = self.tables.held[req.slot]
        while (len(req.nodes) + 1) * p <= req.fed:
            i = len(req.nodes)
            b = (i + 1) * p
            tail = None
            if b in req.saved:
                first = self.tables._first_swa_needed(b)
                js = range(first, -(-b // self.layout.swa_page_size))
                if all(j in held.swa for j in js):
                    tail = {j: held.swa[j] for j in js}
            parent = req.nodes[-1] if req.nodes else self.prefix.roots[self.tables.shard_of(req.slot)]
            req.nodes.append(self.prefix.insert(parent, req.token_slice(i * p, b), held.full[i], tail))


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def chunk_bucket(n: int) -> int:
    """The compiled length of a prefill row of n tokens."""
    return max(MIN_CHUNK_BUCKET, _pow2(n))
