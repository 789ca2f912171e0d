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
import warnings
from typing import Sequence

from v4jax.cache.manager import KVCacheManager, PrefixHit
from v4jax.engine.sampling import SamplingParams

WAITING, PREFILLING, RUNNING = "waiting", "prefilling", "running"
# a prefill-only request (prefill/decode disaggregation) that has its first token: it holds its pages, is never
# decoded here, and waits for the engine to export its state
PREFILLED = "prefilled"
MAX_PREFILL_ROWS = 8  # rows of one prefill step (powers of two up to this are compiled)
MAX_SHARING_SKIPPED = 16  # waiting requests admission looks past while they wait for a prefix being prefilled
MIN_CHUNK_BUCKET = 16  # shortest compiled chunk: shorter ones are padded (fewer programs; the cost is a decode's)


@dataclasses.dataclass
class RequestDelta:
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[float]  # empty unless the request asked for logprobs
    finish_reason: str | None  # None while running; "stop" | "length" | "abort" at the end
    # per new token, its position's `top_logprobs` most likely (token id, log-prob) pairs, most likely first; empty
    # unless the request asked for them
    new_top_logprobs: list[list[tuple[int, float]]] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(eq=False)
class Request:
    """One request's lifecycle (status, slot, computed, output): written by the Scheduler only."""
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
    # positions below this were computed before (by this request before a preemption, or by another whose
    # pages the prefix cache holds but cannot resume from): computing them again counts as recomputed
    seen: int = 0
    prefill_only: bool = False  # stops at PREFILLED after its first token (its state is exported)

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


@dataclasses.dataclass
class DecodePlan:
    """One k-step decode call: the running requests (slot order), which slots continue the previous call's
    device-side state, and the furthest position the call may reach (its page-table bucket)."""
    running: list[Request]
    carried: set[int]
    upto: int


@dataclasses.dataclass
class StepPlan:
    """What one engine step runs, decided before anything is dispatched: the compressor states to restore
    (slot, boundary-store row) for requests admitted on a prefix hit, the decode call, the prefill rows
    (request, start, end), and the deltas of requests ended here (a queue head that can never fit)."""
    restores: list[tuple[int, int]]
    decode: DecodePlan | None
    prefill: list[tuple[Request, int, int]]
    ended: list[RequestDelta]


class Scheduler:
    def __init__(self, kv: KVCacheManager, *, max_num_seqs: int, prefill_chunk: int, decode_steps: int,
                 max_model_len: int):
        self.kv = kv
        self.page_size = kv.page_size
        # a chunk never exceeds the context: no longer program is ever needed
        self.chunk, self.k, self.max_model_len = min(prefill_chunk, max_model_len), decode_steps, max_model_len
        self.step_tokens = chunk_bucket(prefill_chunk)  # a prefill step's rows x compiled length stay within this
        self.waiting: collections.deque[Request] = collections.deque()
        self.slots: list[Request | None] = [None] * max_num_seqs
        self.requests: dict[str, Request] = {}
        self._arrivals = itertools.count()
        self.n_preempted = 0
        self.n_finished = 0
        self.n_aborted = 0
        self.n_exported = 0  # prefill-only requests whose state left the engine
        self.n_imported = 0  # requests that arrived with their state and continued decoding here
        self.recomputed_tokens = 0  # prefill tokens computed again (after preemption, or past an unresumable page)
        self._prefill_steps_without_decode = 0  # consecutive prefill steps that ran no decode call (schedule)

    # ---- requests in and out ----
    def add(self, request_id: str, prompt: Sequence[int], params: SamplingParams, seed: int, sample_index: int,
            stop_ids: tuple[int, ...], prefill_only: bool = False) -> Request:
        req = Request(request_id, list(prompt), params, seed, sample_index, stop_ids, next(self._arrivals),
                      prefill_only=prefill_only)
        self.requests[request_id] = req
        self.waiting.append(req)
        return req

    def running(self) -> list[Request]:
        return [r for r in self.slots if r is not None and r.status == RUNNING]

    def prefilling(self) -> list[Request]:
        return sorted((r for r in self.slots if r is not None and r.status == PREFILLING), key=lambda r: r.arrival)

    def prefilled(self) -> list[Request]:
        return [r for r in self.slots if r is not None and r.status == PREFILLED]

    def slots_in_use(self) -> list[int]:
        return [i for i, r in enumerate(self.slots) if r is not None]

    def remove(self, req: Request) -> None:
        """Forget a request (finished or aborted): its slot and pages are released."""
        if req.slot is not None:
            self._release(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.requests.pop(req.request_id, None)

    def abort(self, request_id: str) -> RequestDelta | None:
        """End a request now (its pages return); its last delta, or None for an unknown id."""
        req = self.requests.get(request_id)
        if req is None:
            return None
        self.remove(req)
        self.n_aborted += 1
        return RequestDelta(request_id, [], [], "abort")

    def export(self, req: Request) -> None:
        """A prefilled request's state has been read out: it leaves the engine (its pages return; the prefix tree
        keeps the full pages it cached)."""
        assert req.status == PREFILLED, req.status
        self.remove(req)
        self.n_exported += 1

    def insert(self, request_id: str, prompt: Sequence[int], output: Sequence[int], params: SamplingParams,
               seed: int, sample_index: int, stop_ids: tuple[int, ...]) -> Request | None:
        """A request that computed its prompt elsewhere, bound to the lowest free slot with pages for its
        positions (the prefix cache evicts if it must), RUNNING from its last token on; None (nothing taken) if no
        slot or pages are free now. The caller writes its state into the slot's pages."""
        req = Request(request_id, list(prompt), params, seed, sample_index, stop_ids, next(self._arrivals),
                      output=list(output), status=RUNNING)
        fed = req.n_tokens - 1
        for slot, r in enumerate(self.slots):
            if r is None:
                if not self.kv.allocate(slot, fed, fed):
                    return None
                req.slot, req.computed, req.seen = slot, fed, fed
                self.slots[slot] = req
                self.requests[request_id] = req
                self.n_imported += 1
                return req
        return None

    def _finish(self, req: Request) -> None:
        self.remove(req)
        self.n_finished += 1

    def _release(self, req: Request) -> None:
        self.kv.free(req.slot)
        self.slots[req.slot] = None
        req.slot = None

    # ---- plan ----
    def schedule(self, in_flight: Sequence[tuple[int, Request]] = ()) -> StepPlan:
        """Plan one step: admit waiting requests, reserve pages for k more tokens of every running slot (2k for a
        slot whose previous call is still in flight: this call continues from where that one ends) and pick the
        prefill rows, preempting where a pool runs dry. `in_flight`: the (slot, request) pairs of the decode call
        dispatched last step and not yet read."""
        restores: list[tuple[Request, int]] = []
        self.admit(restores)
        ended = []
        if self.waiting and all(r is None for r in self.slots):
            # Nothing runs and the queue's head cannot be admitted even with the prefix cache emptied:
            # add_request's checks should make this impossible; end it rather than spin.
            req = self.waiting[0]
            warnings.warn(f"request {req.request_id!r} ({req.n_tokens} tokens) cannot fit in the pools; aborted")
            ended.append(self.abort(req.request_id))
        carried_reqs = dict(in_flight)
        for req in sorted(self.running(), key=lambda r: r.arrival):
            if req.status != RUNNING:
                continue  # preempted while an older request reserved
            mult = 2 if carried_reqs.get(req.slot) is req else 1
            end = min(req.fed + mult * self.k, self.max_model_len, req.limit)
            self.reserve(req, req.fed, end)
        chunks = self.next_chunks()
        decode = None
        running = self.running()
        # While prompts prefill, a decode call (k tokens a running request) runs once every k steps: a running
        # request gets a token a prefill step on average, as in a step that mixes both (vLLM), and the chunks are
        # not each followed by a call over the few requests already running (a call costs nearly its weights'
        # reads however few rows it has). H100, flash-slice, 32 fresh 4K prompts at defaults: 11.70 -> 4.28 ms a
        # decode step through LLM.generate (BENCHMARKS, "A burst of fresh prompts at defaults")
        if running and chunks and self._prefill_steps_without_decode < self.k - 1:
            self._prefill_steps_without_decode += 1
            running = []
        if running:
            self._prefill_steps_without_decode = 0
            carried = {r.slot for r in running if carried_reqs.get(r.slot) is r}
            upto = max(min(r.fed + (2 if r.slot in carried else 1) * self.k, self.max_model_len) for r in running)
            decode = DecodePlan(running, carried, upto)
        rows = [(r.slot, row) for r, row in restores if r.slot is not None and self.slots[r.slot] is r]
        return StepPlan(rows, decode, chunks, ended)

    # ---- pages ----
    def _upto(self, req: Request) -> int:
        """Positions the request holds once admitted and past its first decode call."""
        return min(req.n_tokens + self.k, req.limit)

    def reserve(self, req: Request, lo: int, upto: int) -> bool:
        """Pages for positions [lo, upto) of `req`, preempting newer requests if a pool is dry. False if `req`
        itself had to be preempted (it is then back in the waiting queue)."""
        while True:
            if self.kv.allocate(req.slot, lo, upto):
                return True
            # only a request of the same shard holds pages that this one could use
            shard = self.kv.shard_of(req.slot)
            # a prefilled request waiting for its export keeps its pages (it is about to leave)
            victim = max((r for r in self.slots if r is not None and self.kv.shard_of(r.slot) == shard
                          and (r.status != PREFILLED or r is req)), key=lambda r: r.arrival)
            self.preempt(victim)
            if victim is req:
                return False

    def preempt(self, req: Request) -> None:
        """Recompute later: free the slot and pages (the prefix cache keeps the full pages it holds) and put the
        request back at the front of the queue with the tokens it has generated."""
        req.seen = max(req.seen, req.fed)
        self._release(req)
        req.status, req.computed = WAITING, 0
        self.waiting.appendleft(req)
        self.n_preempted += 1

    # ---- admission ----
    def admit(self, restores: list | None = None) -> list[Request]:
        """Move waiting requests into free slots while every pool can hold them; returns those admitted. Where a
        cached prefix was mapped, (request, boundary row) is appended to `restores`: the engine restores that
        boundary's compressor state into the slot."""
        admitted = []
        i = 0
        while i < len(self.waiting) and None in self.slots:
            req = self.waiting[i]
            if self.kv.caching and self._may_share(req):
                # it may reuse pages a prefilling request has yet to cache: matched once they are; the requests
                # behind it go on (it held back every later request, sharing or not, for a chunk step or more).
                # A few at most: each look walks the tree (38 us for a 4K prompt of 16 pages), and a burst of
                # hundreds behind one document would cost that many at every step
                i += 1
                if i >= MAX_SHARING_SKIPPED:
                    break
                continue
            placed = self._place(req)
            if placed is None:
                break  # first come, first served for room (as vLLM): the requests behind it wait too
            slot, hit = placed
            del self.waiting[i]
            req.slot, req.status = slot, PREFILLING
            self.slots[slot] = req
            row = self.kv.map_prefix(slot, hit, req.n_tokens)
            req.computed = hit.n_pages * self.page_size
            req.seen = max(req.seen, hit.cached_pages * self.page_size)
            if row is not None and restores is not None:
                restores.append((req, row))
            admitted.append(req)
        return admitted

    def _place(self, req: Request) -> tuple[int, PrefixHit] | None:
        """(free slot, prefix hit to map) for `req`, or None if no shard can take it now.

        Shards are tried by their cached prefix of the request (longest first), then by free slots (most first):
        the hit saves its prefill, and an even spread keeps every shard's decode batch full. A shard with no
        free slot or too few pages is skipped even if it holds the longest prefix: the request goes cold to
        another shard rather than wait, as vLLM's data-parallel ranks balance by load and never hold a request
        back for a cache hit (an idle slot costs more than a recomputed prefix; the prefix is then cached in
        that shard too, for the requests after it)."""
        kv = self.kv
        per = kv.slots_per_shard
        free = [[i for i in range(d * per, (d + 1) * per) if self.slots[i] is None] for d in range(kv.n_data)]
        candidates = []
        tokens = req.tokens if kv.caching else None
        for d in range(kv.n_data):
            if free[d]:
                hit = kv.find_prefix(tokens, req.n_tokens, d)
                candidates.append((-hit.n_pages, -len(free[d]), d, hit))
        # pages the shard's prefilling requests will still take, then this request's own
        pending = [(r.slot, self._upto(r)) for r in self.prefilling()]
        for _, _, d, hit in sorted(candidates, key=lambda c: c[:3]):
            # the window of its first chunk: what the hit leaves of the prompt, at most a chunk
            swa_tokens = min(self.chunk, req.n_tokens - hit.n_pages * self.page_size) + 2 * self.k
            if kv.admissible(hit, self._upto(req), swa_tokens, pending):
                # the shard's lowest free slot: a decode call runs slots 0..B-1, B a power of two above the highest
                # running slot (EngineCore._slot_bucket), so compact slots keep its rows few
                return free[d][0], hit
        return None

    def _may_share(self, req: Request) -> bool:
        """Whether `req` could match more full pages than are cached now once a request still prefilling has
        cached its own: the first page past req's cached prefix is a full page of both, equal, and not yet
        written by the other. (Comparing only page 0 held back every request behind one sharing a cached system
        prompt: a burst of them started one per step, each prefilled alone.)"""
        p = self.page_size
        h = self.kv.resumable_pages(req.tokens, req.n_tokens)
        lo, hi = h * p, (h + 1) * p
        if hi > req.n_tokens - 1:
            return False  # the last position is always computed: no further full page of it can be reused
        page = req.token_slice(lo, hi)
        return any(r.computed < hi <= r.n_tokens and r.token_slice(lo, hi) == page for r in self.prefilling())

    # ---- prefill chunks ----
    def next_chunks(self) -> list[tuple[Request, int, int]]:
        """[(request, start, end)]: the next prefill step's rows, oldest prefilling request first, each chunk cut
        at the last full-page boundary inside it (its state is saved there). The first row takes up to
        `prefill_chunk` tokens; further rows join while the step's rows x its compiled length stay within one full
        chunk's (`step_tokens`), so a step costs at most what one full chunk does."""
        plans: list[tuple[Request, int, int]] = []
        p = self.page_size
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

    # ---- update: a step's outputs into request state and deltas ----
    def advance_prefill(self, chunks: list[tuple[Request, int, int]]) -> None:
        """The prefill rows were dispatched: their positions count as computed, and their full pages (written up
        to each chunk's end; the compressor state saved at each full-page boundary of the chunk) go into the
        prefix tree."""
        for req, s0, e0 in chunks:
            req.computed = e0
            self.recomputed_tokens += max(0, min(e0, req.seen) - s0)
            self.kv.commit(req.slot, req.token_slice, req.fed, self.kv.prefill_boundaries(s0, e0))

    def finish_prefill(self, chunks: list[tuple[Request, int, int]], tokens, logprobs, top=None) -> list[RequestDelta]:
        """Rows that were their request's last chunk: its first generated token (row i of `tokens`, `logprobs`,
        and of `top` = (ids [B, N], log-probs [B, N]) when the step computed alternatives), and it starts decoding
        (or ends)."""
        deltas = []
        for row, (req, s0, e0) in enumerate(chunks):
            if e0 != req.n_tokens or req.slot is None or self.slots[req.slot] is not req:
                continue  # more chunks to come (or preempted / aborted meanwhile)
            t, lp = int(tokens[row]), float(logprobs[row])
            req.output.append(t)
            req.status = PREFILLED if req.prefill_only else RUNNING
            self.kv.trim(req.slot, req.fed)  # the window is all it keeps of its prefill's SWA pages
            stopped = t in req.stop_ids
            done = stopped or len(req.output) >= req.params.max_tokens or req.fed + 1 >= self.max_model_len
            reason = ("stop" if stopped else "length") if done else None
            if done:
                self._finish(req)
            deltas.append(RequestDelta(req.request_id, [t], [lp] if req.params.logprobs else [], reason,
                                       _alternatives(req, top, row, 1)))
        return deltas

    def finish_decode(self, running: Sequence[tuple[int, Request]], tokens, logprobs, n_out, stopped,
                      still, top=None) -> list[RequestDelta]:
        """A decode call's outputs (host arrays by slot; `top` = (ids [S, k, N], log-probs [S, k, N]) when the call
        computed alternatives) into its requests. A slot whose request ended, was aborted or preempted after the
        call was dispatched is skipped: its tokens are not wanted."""
        p = self.page_size
        deltas = []
        for i, r in running:
            if self.slots[i] is not r or r.status != RUNNING:
                continue
            n = int(n_out[i])
            f0 = r.fed
            new = tokens[i, :n].tolist()
            r.output.extend(new)
            self.kv.commit(i, r.token_slice, r.fed, range((f0 // p + 1) * p, r.fed + 1, p))  # boundaries reached
            reason = None if still[i] else ("stop" if stopped[i] else "length")
            deltas.append(RequestDelta(r.request_id, new, logprobs[i, :n].tolist() if r.params.logprobs else [],
                                       reason, _alternatives(r, top, i, n)))
            if reason is not None:
                self._finish(r)
        return deltas


def _alternatives(req: Request, top, row: int, n: int) -> list[list[tuple[int, float]]]:
    """The request's own N of the step's top alternatives for its n new tokens (row `row` of `top`)."""
    m = req.params.top_logprobs
    if not m or top is None:
        return []
    ids, lps = top[0][row, ..., :m].reshape(-1, m)[:n].tolist(), top[1][row, ..., :m].reshape(-1, m)[:n].tolist()
    return [list(zip(i, lp)) for i, lp in zip(ids, lps)]


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def chunk_bucket(n: int) -> int:
    """The compiled length of a prefill row of n tokens."""
    return max(MIN_CHUNK_BUCKET, _pow2(n))
