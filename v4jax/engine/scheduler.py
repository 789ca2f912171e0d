"""Which request runs where, and with which pages: continuous batching under every pool's limits (host only).

Each engine step decodes every running slot (k tokens in one jitted call) and runs one prefill step of at most
`prefill_chunk` tokens in all: a chunk of each request still prefilling, oldest first, as the rows of one batch
(up to MAX_PREFILL_ROWS), so a long prompt is interleaved with the running decodes instead of stalling them and
many short prompts share one call. Admission takes a waiting request into a free slot when the full-page pool
(C4 KV, C4 indexer keys, C128 KV and token ids share it), the SWA pool (window KV and the boundary states) and the
compressor-state slots can hold it, counting pages the prefix cache could give back. When a pool runs dry
mid-run the newest request is preempted (its pages freed; the prefix cache keeps its full pages) and recomputed
later from its tokens. Prefill chunks end on full-page boundaries so that the compressor state is saved there
and a later request can resume from it."""
from __future__ import annotations

import collections
import dataclasses
import itertools
from typing import Sequence

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
    def _page_need(self, req: Request, hit_pages: int = 0) -> int:
        p = self.layout.page_size
        return max(0, -(-min(len(req.tokens) + self.k, req.limit) // p) - hit_pages)

    def _room(self, n_full: int, n_swa: int) -> bool:
        """Free (evicting from the prefix cache if needed) n_full full and n_swa SWA pages; whether it worked."""
        t = self.tables
        if self.prefix is not None:
            if t.full_alloc.n_free < n_full:
                self.prefix.evict_full(n_full)
            if t.swa_alloc.n_free < n_swa:
                self.prefix.evict_swa(n_swa)
        return t.full_alloc.n_free >= n_full and t.swa_alloc.n_free >= n_swa

    def reserve(self, req: Request, lo: int, upto: int) -> bool:
        """Pages for positions [lo, upto) of `req`, preempting newer requests if a pool is dry. False if `req`
        itself had to be preempted (it is then back in the waiting queue)."""
        while True:
            n_full, n_swa = self.tables.needs(req.slot, lo, upto)
            refs = self.tables.swa_alloc.refs
            n_swa = max(0, n_swa - sum(1 for pg in self.tables.dead_swa(req.slot, lo) if refs[pg] == 1))
            if self._room(n_full, n_swa):
                self.tables.reserve(req.slot, lo, upto)
                return True
            victim = max((r for r in self.slots if r is not None), key=lambda r: r.arrival)
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
            slot = next((i for i, s in enumerate(self.slots) if s is None), None)
            if slot is None:
                break
            req = self.waiting[0]
            nodes = self._match(req)
            pending = sum(self._page_need(r, len(r.nodes)) - max(0, len(self.tables.held[r.slot].full)
                                                                 - len(r.nodes)) for r in self.prefilling())
            n_full = self._page_need(req, len(nodes)) + max(0, pending)
            n_swa = self._swa_need(req)
            if not self._room_if_evicted(n_full, n_swa, nodes):
                break
            self.waiting.popleft()
            req.slot, req.status = slot, PREFILLING
            self.slots[slot] = req
            self._map_prefix(req, nodes)
            admitted.append(req)
        return admitted

    def _may_share(self, req: Request) -> bool:
        """Whether `req` could match full pages that a request still prefilling will cache: their first pages
        are equal (every prefix match starts at page 0)."""
        p = self.layout.page_size
        if len(req.tokens) <= p:
            return False  # the last position is always computed: no full page of it can be reused
        head = req.tokens[:p]
        return any(r.tokens[:p] == head for r in self.prefilling())

    def _swa_need(self, req: Request) -> int:
        ps, w = self.layout.swa_page_size, self.tables.cfg.window_size
        span = min(self.chunk, len(req.tokens)) + w + 2 * self.k
        return -(-span // ps) + 1

    def _room_if_evicted(self, n_full: int, n_swa: int, keep: list[Node]) -> bool:
        t = self.tables
        free_full, free_swa = t.full_alloc.n_free, t.swa_alloc.n_free
        if free_full >= n_full and free_swa >= n_swa:
            return True
        if self.prefix is None:
            return False
        ev_full, ev_swa = self.prefix.evictable()
        # the matched path stays (it is about to be mapped): do not count it as evictable
        ev_full -= sum(1 for n in keep if t.full_alloc.refs[n.page] == 1)
        ev_swa -= sum(len(n.tail) for n in keep[-1:] if all(t.swa_alloc.refs[pg] == 1 for pg in n.tail.values()))
        return free_full + ev_full >= n_full and free_swa + ev_swa >= n_swa

    def _match(self, req: Request) -> list[Node]:
        if self.prefix is None:
            return []
        # at least one token is computed, so the last position's logits exist
        return self.prefix.match(req.tokens, (len(req.tokens) - 1) // self.layout.page_size)

    def _map_prefix(self, req: Request, nodes: list[Node]) -> None:
        if self.prefix is not None:
            self.prefix.count_query(len(req.tokens), len(nodes))
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
            n, start = len(req.tokens), req.computed
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
        toks = None
        while (len(req.nodes) + 1) * p <= req.fed:
            i = len(req.nodes)
            b = (i + 1) * p
            tail = None
            if b in req.saved:
                first = self.tables._first_swa_needed(b)
                js = range(first, -(-b // self.layout.swa_page_size))
                if all(j in held.swa for j in js):
                    tail = {j: held.swa[j] for j in js}
            toks = req.tokens if toks is None else toks
            parent = req.nodes[-1] if req.nodes else self.prefix.root
            req.nodes.append(self.prefix.insert(parent, toks[i * p:b], held.full[i], tail))


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def chunk_bucket(n: int) -> int:
    """The compiled length of a prefill row of n tokens."""
    return max(MIN_CHUNK_BUCKET, _pow2(n))
