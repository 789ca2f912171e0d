"""The engine: jitted prefill / k-step decode over the pools, and a continuous-batching scheduler.

Shape of JetStream's `Engine` (load_params, init_decode_state, prefill, insert, generate, free_resource,
get_prefix_destination_sharding, max_concurrent_decodes). Steps are jitted with donated pools and static
buckets (prefill chunk: powers of two; pages: powers of two), so after warm-up nothing recompiles. The scheduler
keeps one decode call in flight: call n+1 is dispatched before call n's results are read.
This is the only module that calls jitted steps."""
from __future__ import annotations

import collections
import dataclasses
from typing import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from v4jax import cache as C
from v4jax.config import ModelConfig
from v4jax.memory import engine_layout, page_multiple
from v4jax.model import RunOptions, Transformer
from v4jax.sampling import SamplingParams, sample

MAX_STOP = 8  # stop token ids per request held on device (EOS included)


def _snapshot(table: np.ndarray) -> np.ndarray:
    """A private copy of a host page table as it is now, for a jitted step to take. The host tables are mutated by
    the next reserve() while earlier steps may still be running (dispatch is async), and on CPU a step's input can
    alias numpy memory (zero-copy), so the step must get a copy nobody mutates (measured: aliasing made chunked
    prefill nondeterministic). Passed as numpy: jit's own transfer is cheaper than a separate jnp.asarray."""
    return np.array(table, copy=True)


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@dataclasses.dataclass
class Event:
    request_index: int
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None  # None while running; "stop" | "length" at the end


@dataclasses.dataclass
class Prefix:
    """A prefilled request's handle: its slot (compressor state), pages, length and first sampled token."""
    slot: int
    length: int
    first_token: int
    first_logprob: float


@dataclasses.dataclass
class _InFlight:
    """A dispatched decode call: its device outputs, the device-side slot state after it, and the requests it
    decoded (slot, the _Running it decoded for)."""
    outs: tuple  # device (tokens [S, k], logprobs [S, k], counts [S], stopped [S])
    io: "_DecodeIO"
    running: list


@dataclasses.dataclass
class _Running:
    request_index: int
    params: SamplingParams
    seed: int
    pos: int  # position of the next token to feed (= tokens held)
    next_token: int
    generated: int
    stop_ids: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class _DecodeIO:
    """Per-slot decode inputs (all arrays, so sampling parameters never recompile)."""
    tokens: jax.Array  # [S] int32 next token to feed
    pos: jax.Array  # [S] int32 its position
    active: jax.Array  # [S] bool
    temperature: jax.Array
    top_p: jax.Array
    top_k: jax.Array
    seed: jax.Array
    request_index: jax.Array
    token_index: jax.Array  # [S] index of the token to be sampled next
    remaining: jax.Array  # [S] tokens still allowed
    stop_ids: jax.Array  # [S, MAX_STOP] (-1 = none)


jax.tree_util.register_dataclass(_DecodeIO)


class Engine:
    def __init__(self, cfg: ModelConfig, model: Transformer, options, run_options: RunOptions, max_model_len: int):
        self.cfg, self.options, self.run_options = cfg, options, run_options
        self.max_model_len = max_model_len
        self.k = options.decode_steps
        self.dtype = model.dtype
        dense = options.kv_layout == "dense"
        slots = options.max_num_seqs
        p, ps, n_swa = engine_layout(cfg, options.page_size, slots, options.prefill_chunk, self.k)
        max_pages = -(-max_model_len // p)
        max_swa = -(-max_model_len // ps)
        if dense:
            n_pages, n_swa = slots * max_pages, slots * max_swa
        else:
            mult = page_multiple(cfg, p, self.dtype)  # whole TPU tiles in every pool
            n_pages = -(-slots * max_pages // mult) * mult
            if options.memory_budget_bytes:
                n_pages = self._pages_for_budget(options.memory_budget_bytes, p, ps, n_swa, slots)
                if n_pages >= mult:
                    n_pages -= n_pages % mult
        self.layout = C.PoolLayout(page_size=p, swa_page_size=ps, n_pages=n_pages, n_swa_pages=n_swa,
                                   max_slots=slots, max_pages_per_seq=max_pages, max_swa_pages_per_seq=max_swa)
        self.tables = C.PageTables(cfg, self.layout, dense)
        self.pools = C.init_pools(cfg, self.layout, self.dtype)
        if options.mesh:
            from sharding import make_mesh, shard_pools
            self.pools = shard_pools(self.pools, make_mesh(options.mesh))
        graphdef, state = nnx.split(model)
        self._leaves, treedef = jax.tree.flatten(state)
        layout, opts = self.layout, run_options

        def merged(leaves):
            return nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))

        def write_tokens(pools, token_ids, positions, ok, page_table):
            col = positions % layout.page_size
            page = jnp.take_along_axis(page_table, jnp.clip(positions // layout.page_size, 0,
                                                            page_table.shape[1] - 1), axis=1)
            flat = jnp.where(ok & (page >= 0), page * layout.page_size + col, pools.tokens.size)
            tokens = pools.tokens.reshape(-1).at[flat.reshape(-1)].set(token_ids.reshape(-1), mode="drop")
            return dataclasses.replace(pools, tokens=tokens.reshape(pools.tokens.shape))

        def prefill_fn(leaves, pools, tokens, start, n_valid, fresh, slot, page_table, swa_table, samp):
            t = tokens.shape[1]
            meta = C.make_meta(cfg, layout, start, n_valid, fresh, slot, page_table, swa_table, t)
            logits, pools = merged(leaves).cached(tokens, meta, pools, opts)
            pools = write_tokens(pools, tokens, meta.positions, jnp.arange(t)[None] < n_valid[:, None], page_table)
            tok, lp = sample(logits, *samp)
            return pools, tok, lp

        def decode_fn(leaves, pools, io: _DecodeIO, page_table, swa_table):
            model_ = merged(leaves)
            s = io.tokens.shape[0]
            out_tok = jnp.zeros((s, self.k), jnp.int32)
            out_lp = jnp.zeros((s, self.k), jnp.float32)
            rows = C.entry_rows(cfg, layout, page_table)  # the page tables are fixed for the whole call

            def body(carry):
                i, pools, io, out_tok, out_lp, n_out, stopped = carry
                # slot None: row b is slot b, so the compressor states are read and updated in place (an
                # index array would make XLA gather and scatter every slot's state each step)
                meta = C.make_meta(cfg, layout, io.pos, io.active.astype(jnp.int32), jnp.zeros((s,), bool),
                                   None, page_table, swa_table, 1, rows)
                logits, pools = model_.cached(io.tokens[:, None], meta, pools, opts)
                pools = write_tokens(pools, io.tokens[:, None], io.pos[:, None], io.active[:, None], page_table)
                nxt, lp = sample(logits, io.temperature, io.top_p, io.top_k, io.seed, io.request_index,
                                 io.token_index)
                out_tok = out_tok.at[:, i].set(jnp.where(io.active, nxt, -1))
                out_lp = out_lp.at[:, i].set(lp)
                n_out = n_out + io.active
                is_stop = jnp.any(nxt[:, None] == io.stop_ids, axis=-1)
                full = (io.remaining <= 1) | (io.pos + 2 >= max_model_len)
                stopped = stopped | (io.active & is_stop)
                active = io.active & ~is_stop & ~full
                adv = io.active.astype(jnp.int32)
                io = dataclasses.replace(io, tokens=jnp.where(io.active, nxt, io.tokens), pos=io.pos + adv,
                                         active=active, token_index=io.token_index + adv,
                                         remaining=io.remaining - adv)
                return i + 1, pools, io, out_tok, out_lp, n_out, stopped

            def cond(carry):
                return (carry[0] < self.k) & jnp.any(carry[2].active)

            carry = (0, pools, io, out_tok, out_lp, jnp.zeros((s,), jnp.int32), jnp.zeros((s,), bool))
            _, pools, io, out_tok, out_lp, n_out, stopped = jax.lax.while_loop(cond, body, carry)
            return pools, out_tok, out_lp, n_out, stopped, io

        def carry_io(prev: _DecodeIO, fresh: _DecodeIO, carried):
            """Slots still decoding the request of the previous call continue from its device-side state."""
            pick = lambda a, b: jnp.where(carried.reshape(carried.shape + (1,) * (a.ndim - 1)), a, b)
            return jax.tree.map(pick, prev, fresh)

        self._prefill_jit = jax.jit(prefill_fn, donate_argnums=(1,))
        self._decode_jit = jax.jit(decode_fn, donate_argnums=(1,))
        self._carry_io_jit = jax.jit(carry_io)
        self.slots: list[_Running | None] = [None] * slots

    def _pages_for_budget(self, budget, p, ps, n_swa, slots) -> int:
        probe = C.PoolLayout(page_size=p, swa_page_size=ps, n_pages=1, n_swa_pages=n_swa, max_slots=slots,
                             max_pages_per_seq=1, max_swa_pages_per_seq=1)
        fixed = sum(C.pool_bytes(jax.eval_shape(lambda: C.init_pools(self.cfg, probe, self.dtype))).values())
        probe2 = dataclasses.replace(probe, n_pages=2)
        two = sum(C.pool_bytes(jax.eval_shape(lambda: C.init_pools(self.cfg, probe2, self.dtype))).values())
        per_page = two - fixed
        n = int((budget - (fixed - per_page)) // per_page)
        if n < 1:
            raise ValueError(f"memory_budget_bytes={budget} is below the fixed pools ({fixed - per_page} bytes: "
                             f"window and compressor state for {slots} slots) plus one page ({per_page} bytes)")
        return n

    def warmup(self) -> int:
        """Compile every bucket the engine will use (prefill chunk x pages, decode x pages) with no-op calls
        (no valid tokens). Returns the number of compiled variants; afterwards nothing recompiles."""
        s = self.layout.max_slots
        page_buckets = sorted({self._page_bucket(n * self.layout.page_size)
                               for n in range(1, self.layout.max_pages_per_seq + 1)})
        chunk_buckets = sorted({_pow2(c) for c in range(1, self.options.prefill_chunk + 1)})
        z = lambda n, dt=jnp.int32: jnp.zeros((n,), dt)
        samp = (z(1, jnp.float32), jnp.ones((1,), jnp.float32), z(1), z(1), z(1), z(1))
        for nb in page_buckets:
            pt = _snapshot(self.tables.full[:, :nb])
            for cb in chunk_buckets:
                self.pools, _, _ = self._prefill_jit(self._leaves, self.pools, jnp.zeros((1, cb), jnp.int32), z(1),
                                                     z(1), jnp.zeros((1,), bool), z(1), pt[:1],
                                                     _snapshot(self.tables.swa[:1]), samp)
            n = lambda dt=np.int32: np.zeros((s,), dt)
            io = _DecodeIO(n(), n(), n(bool), n(np.float32), np.ones((s,), np.float32), n(), n(), n(), n(), n(),
                           np.full((s, MAX_STOP), -1, np.int32))
            io = self._carry_io_jit(io, io, n(bool))   # device arrays, as _dispatch passes them
            self.pools, *_ = self._decode_jit(self._leaves, self.pools, io, pt, _snapshot(self.tables.swa))
        return self.compiled_variants()

    def compiled_variants(self) -> int:
        """How many shapes the jitted steps have been compiled for (a test counts these)."""
        return self._prefill_jit._cache_size() + self._decode_jit._cache_size()

    # ---- JetStream-shaped interface ----
    @property
    def max_concurrent_decodes(self) -> int:
        return self.layout.max_slots

    def load_params(self):
        return self._leaves

    def init_decode_state(self) -> C.KVPools:
        return self.pools

    def get_prefix_destination_sharding(self):
        return jax.tree.map(lambda a: a.sharding, self.pools)

    def free_resource(self, slot: int) -> None:
        """Return every page a slot holds; the slot can take the next request."""
        self.tables.release(slot)
        self.slots[slot] = None

    def free_slot(self) -> int | None:
        for i, s in enumerate(self.slots):
            if s is None:
                return i
        return None

    def prefill(self, prompt: Sequence[int], slot: int, params: SamplingParams, seed: int,
                request_index: int) -> Prefix:
        """Run the prompt through the pools in chunks (powers of two up to `prefill_chunk`) into a slot."""
        n = len(prompt)
        prompt = np.asarray(prompt, np.int32)
        start = 0
        samp = (jnp.asarray([params.temperature], jnp.float32), jnp.asarray([params.top_p], jnp.float32),
                jnp.asarray([max(params.top_k, 0)], jnp.int32), jnp.asarray([seed], jnp.int32),
                jnp.asarray([request_index], jnp.int32), jnp.asarray([0], jnp.int32))
        tok = lp = None
        while start < n:
            c = min(n - start, self.options.prefill_chunk)
            bucket = _pow2(c)
            self.tables.reserve(slot, start, start + c)
            chunk = np.zeros((1, bucket), np.int32)
            chunk[0, :c] = prompt[start:start + c]
            pt = self._page_table(slot, start + bucket)
            self.pools, tok, lp = self._prefill_jit(
                self._leaves, self.pools, jnp.asarray(chunk), jnp.asarray([start], jnp.int32),
                jnp.asarray([c], jnp.int32), jnp.asarray([start == 0]), jnp.asarray([slot], jnp.int32),
                _snapshot(pt), _snapshot(self.tables.swa[slot:slot + 1]), samp)
            start += c
        return Prefix(slot=slot, length=n, first_token=int(tok[0]), first_logprob=float(lp[0]))

    def _page_bucket(self, upto: int) -> int:
        return min(_pow2(-(-upto // self.layout.page_size)), self.layout.max_pages_per_seq)

    def _page_table(self, slot: int, upto: int) -> np.ndarray:
        return self.tables.full[slot:slot + 1, : self._page_bucket(upto)]

    def insert(self, prefix: Prefix, slot: int, running: _Running) -> None:
        """Bind a prefilled request to a decode slot (the slot it was prefilled in: no copy)."""
        if prefix.slot != slot:
            raise ValueError("a prefix is inserted into the slot it was prefilled in")
        self.slots[slot] = running

    def generate_step(self) -> list[tuple[int, list[int], list[float], bool, bool]]:
        """One jitted call of up to k decode steps for every running slot, waited for.
        Returns per running slot (slot, tokens, logprobs, stopped, still_active)."""
        flight = self._dispatch(None)
        return self._collect(flight) if flight is not None else []

    def _dispatch(self, prev: _InFlight | None) -> _InFlight | None:
        """Start a decode call for every running slot without waiting for it. Slots that `prev` (a call not yet
        collected) decoded for the same request continue from prev's device-side state: their tokens, positions
        and stop state never round-trip through the host, and their pages cover prev's k steps plus these k."""
        s = self.layout.max_slots
        act = [i for i, r in enumerate(self.slots) if r is not None]
        if not act:
            return None
        carried = np.zeros(s, bool)
        for i, r in prev.running if prev is not None else ():
            carried[i] = self.slots[i] is r
        f = lambda: np.zeros(s, np.int32)
        tokens, pos, seed, req, tidx, rem = f(), f(), f(), f(), f(), f()
        active = np.zeros(s, bool)
        temp, top_p, top_k = np.zeros(s, np.float32), np.ones(s, np.float32), f()
        stop = np.full((s, MAX_STOP), -1, np.int32)
        upto = 0
        for i in act:
            r = self.slots[i]
            end = min(r.pos + (2 if carried[i] else 1) * self.k, self.max_model_len)
            self.tables.reserve(i, r.pos, end)
            tokens[i], pos[i], active[i] = r.next_token, r.pos, True
            temp[i], top_p[i], top_k[i] = r.params.temperature, r.params.top_p, max(r.params.top_k, 0)
            seed[i], req[i], tidx[i] = r.seed, r.request_index, r.generated
            rem[i] = r.params.max_tokens - r.generated
            stop[i, : len(r.stop_ids)] = r.stop_ids
            upto = max(upto, end)
        # Fresh numpy arrays, never mutated afterwards: jit transfers them itself (one dispatch, not eleven
        # jnp.asarray calls).
        io = _DecodeIO(tokens, pos, active, temp, top_p, top_k, seed, req, tidx, rem, stop)
        # always through the (tiny) merge, so the decode step sees device arrays every time: numpy and device
        # arguments are different signatures to jit, and warm-up compiles one
        io = self._carry_io_jit(prev.io if carried.any() else io, io, carried)
        pt = self.tables.full[:, : self._page_bucket(upto)]
        self.pools, out_tok, out_lp, n_out, stopped, io = self._decode_jit(
            self._leaves, self.pools, io, _snapshot(pt), _snapshot(self.tables.swa))
        return _InFlight((out_tok, out_lp, n_out, stopped), io, [(i, self.slots[i]) for i in act])

    def _collect(self, flight: _InFlight) -> list[tuple[int, list[int], list[float], bool, bool]]:
        """Wait for a dispatched call (one device_get) and advance its requests. A slot whose request ended (and
        was freed) before this call was collected is skipped: the call saw it inactive and wrote nothing."""
        out_tok, out_lp, n_out, stopped, still = jax.device_get((*flight.outs, flight.io.active))
        results = []
        for i, r in flight.running:
            if self.slots[i] is not r:
                continue
            n = int(n_out[i])
            toks = out_tok[i, :n].tolist()
            r.pos += n
            r.generated += n
            if n:
                r.next_token = toks[-1]
            results.append((i, toks, out_lp[i, :n].tolist(), bool(stopped[i]), bool(still[i])))
        return results

    # ---- the scheduler ----
    def generate(self, prompts: Sequence[Sequence[int]], params: Sequence[SamplingParams]) -> Iterator[Event]:
        """Continuous batching: admit requests into free slots (prefill), decode all running slots k steps at a
        time, free a slot as soon as its request ends. Yields events as tokens arrive."""
        pending = collections.deque(range(len(prompts)))
        flight = None   # the decode call in progress: the next one is dispatched before its results are read
        try:
            while pending or any(s is not None for s in self.slots):
                while pending and self.free_slot() is not None and self._fits(len(prompts[pending[0]])):
                    idx = pending.popleft()
                    yield from self._admit(idx, prompts[idx], params[idx])
                if pending and not any(s is not None for s in self.slots):
                    raise MemoryError(f"request {pending[0]} ({len(prompts[pending[0]])} tokens) does not fit "
                                      "in the KV pools; raise memory_budget_bytes or lower max_model_len")
                # Dispatch call n+1, then read call n: the host's bookkeeping (events, page tables, the next
                # call's inputs) overlaps the device's work instead of leaving it idle between calls.
                nxt = self._dispatch(flight)
                done_flight, flight = flight, nxt
                for slot, toks, lps, stopped, still in (self._collect(done_flight) if done_flight else ()):
                    r = self.slots[slot]
                    done = not still
                    reason = ("stop" if stopped else "length") if done else None
                    yield Event(r.request_index, toks, lps if r.params.logprobs else [], reason)
                    if done:
                        self.free_resource(slot)
                if flight is not None and not any(self.slots[i] is r for i, r in flight.running):
                    flight = None   # every request it decoded has ended: nothing left to read
        finally:
            # A consumer that stops early (a vanished client) gives every page back.
            for i, s in enumerate(self.slots):
                if s is not None:
                    self.free_resource(i)

    def _fits(self, n_prompt: int) -> bool:
        if self.tables.dense:
            return True
        need = -(-(n_prompt + self.k) // self.layout.page_size)
        return need <= self.tables.full_alloc.n_free

    def _admit(self, idx: int, prompt: Sequence[int], sp: SamplingParams) -> Iterator[Event]:
        slot = self.free_slot()
        seed = sp.resolved_seed()
        stop_ids = tuple(sp.stop_token_ids)
        if not sp.ignore_eos and self.cfg.eos_token_id is not None:
            stop_ids = stop_ids + (self.cfg.eos_token_id,)
        if len(stop_ids) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP - 1} stop_token_ids are supported")
        self.slots[slot] = _Running(idx, sp, seed, len(prompt), -1, 0, stop_ids)  # holds the slot
        try:
            prefix = self.prefill(prompt, slot, sp, seed, idx)
        except BaseException:
            self.free_resource(slot)
            raise
        tok = prefix.first_token
        run = _Running(idx, sp, seed, prefix.length, tok, 1, stop_ids)
        stopped = tok in stop_ids
        done = stopped or sp.max_tokens <= 1 or prefix.length + 1 >= self.max_model_len
        yield Event(idx, [tok], [prefix.first_logprob] if sp.logprobs else [],
                    ("stop" if stopped else "length") if done else None)
        if done:
            self.free_resource(slot)
        else:
            self.insert(prefix, slot, run)
