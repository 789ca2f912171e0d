"""`EngineCore`: requests in by id, per-request token deltas out, one `step()` at a time.

    core.add_request("a", prompt_ids, SamplingParams(max_tokens=32))
    while core.has_unfinished_requests():
        for d in core.step():          # RequestDelta(request_id, new_token_ids, new_logprobs, finish_reason)
            ...

The one loop that `LLM.generate` and the server both drive. It owns the device state (parameters, pools, the
boundary-state store) and is the only caller of the jitted steps; the scheduler decides, the cache keeps the books.
Each step dispatches the decode call for the running slots before it reads the previous call's results, so the
host's bookkeeping overlaps the device's work (call n+1 continues from call n's device-side state)."""
from __future__ import annotations

import dataclasses
import itertools
import warnings
from typing import Sequence

import jax
import numpy as np
from flax import nnx

from v4jax import cache as C
from v4jax.cache.boundary import init_boundary_store
from v4jax.cache.pages import PageTables
from v4jax.cache.prefix import PrefixCache
from v4jax.config import ModelConfig
from v4jax.engine import steps as S
from v4jax.engine.checks import RequestCheck
from v4jax.engine.scheduler import MAX_PREFILL_ROWS, PREFILLING, RUNNING, Request, Scheduler, chunk_bucket
from v4jax.cache.layout import pool_layout
from v4jax.model import RunOptions, Transformer
from v4jax.sampling import SamplingParams


def _snapshot(table: np.ndarray) -> np.ndarray:
    """A private copy of a host page table as it is now, for a jitted step to take. The host tables are mutated by
    the next reserve() while earlier steps may still be running (dispatch is async), and on CPU a step's input can
    alias numpy memory (zero-copy), so the step must get a copy nobody mutates (measured: aliasing made chunked
    prefill nondeterministic). Passed as numpy: jit's own transfer is cheaper than a separate jnp.asarray."""
    return np.array(table, copy=True)


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@dataclasses.dataclass
class RequestDelta:
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[float]  # empty unless the request asked for logprobs
    finish_reason: str | None  # None while running; "stop" | "length" | "abort" at the end


@dataclasses.dataclass
class _InFlight:
    """A dispatched decode call: its device outputs and end state, and the requests it decoded by slot."""
    out: S.DecodeOutput
    state: S.DecodeState
    running: list  # (slot, Request)
    fed: dict  # slot -> the request's `fed` when the call was dispatched


class EngineCore:
    def __init__(self, cfg: ModelConfig, model: Transformer, options, run_options: RunOptions, max_model_len: int):
        self.cfg, self.options, self.run_options = cfg, options, run_options
        self.max_model_len = max_model_len
        self.k = options.decode_steps
        self.dtype = model.dtype
        dense = options.kv_layout == "dense"
        caching = options.enable_prefix_caching and not dense
        slots = options.max_num_seqs
        if run_options.mesh_rules is None and options.mesh:
            from sharding import MeshRules
            run_options = self.run_options = dataclasses.replace(run_options, mesh_rules=MeshRules.make(options.mesh))
        mesh_shape = {} if run_options.mesh_rules is None else dict(run_options.mesh_rules.mesh.shape)
        n_data, n_ctx = mesh_shape.get("data", 1), mesh_shape.get("context", 1)
        if slots % n_data:
            raise ValueError(f"max_num_seqs={slots} does not split over the mesh's data={n_data} (each data shard "
                             f"holds max_num_seqs / {n_data} slots): use a multiple of {n_data}")
        self.layout = pool_layout(cfg, options, self.dtype, max_model_len, n_data, n_ctx)
        self.tables = PageTables(cfg, self.layout, dense)
        self.prefix = (PrefixCache(self.tables.full_alloc, self.tables.swa_alloc, self.layout.page_size, n_data)
                       if caching else None)
        self.scheduler = Scheduler(self.tables, self.prefix, max_num_seqs=slots, prefill_chunk=options.prefill_chunk,
                                   decode_steps=self.k, max_model_len=max_model_len)
        self.pools, self.store = self._create_pools(self.layout.n_swa_pages if caching else 0, caching)
        graphdef, state = nnx.split(model)
        self._leaves, treedef = jax.tree.flatten(state)
        self.spec = S.StepSpec(graphdef, treedef, cfg, self.layout, run_options, self.k, max_model_len, caching)
        # steps where nobody samples: no full-vocabulary sort, and no device-side branch on it (a `lax.cond`, which
        # XLA:GPU resolves by copying the predicate to the host and waiting: the host then cannot prepare the next
        # step while the device runs this one)
        self.greedy_spec = dataclasses.replace(self.spec, any_sampled=False)
        self.steps = S.JittedSteps.make(run_options.mesh_rules)
        self._flight: _InFlight | None = None
        self._finished: list[RequestDelta] = []  # aborts, reported by the next step()
        self._ids = itertools.count()
        self.counts = {"finished": 0, "aborted": 0, "rejected": 0}

    def _create_pools(self, n_boundary_rows: int, caching: bool):
        """The pools and the boundary store, created in their shards on a mesh (one jit, out_shardings from the
        logical axes of every pool dimension)."""
        from sharding.place import create_sharded
        from v4jax.cache.boundary import store_shardings

        def make():
            pools = C.init_pools(self.cfg, self.layout, self.dtype)
            store = init_boundary_store(pools, n_boundary_rows)
            if not caching:
                store = dataclasses.replace(store, layers=tuple(None for _ in store.layers))
            return pools, store

        def shardings(abstract, mr):
            return C.pool_shardings(abstract[0], mr.sharding), store_shardings(abstract[1], mr.sharding)

        return create_sharded(make, shardings, self.run_options.mesh_rules)

    # ---- requests ----
    def add_request(self, request_id: str, prompt_token_ids: Sequence[int], sampling_params: SamplingParams,
                    *, sample_index: int = 0) -> None:
        """Queue a request. Raises ValueError for one that could never run (v4jax.engine.checks: past the context,
        more pages than its data shard holds, an empty prompt or an id outside the vocabulary, too many stop ids);
        everything else is queued, never refused."""
        if request_id in self.scheduler.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        prompt = list(map(int, prompt_token_ids))
        sp = sampling_params
        try:
            RequestCheck.of(self.cfg, self.layout, self.max_model_len, paged=not self.tables.dense)(prompt, sp)
        except ValueError:
            self.counts["rejected"] += 1
            raise
        stop_ids = tuple(sp.stop_token_ids)
        if not sp.ignore_eos and self.cfg.eos_token_id is not None:
            stop_ids = stop_ids + (self.cfg.eos_token_id,)
        seed = sp.resolved_seed()
        if sp.seed is None:
            from sharding.multihost import agree
            seed = agree(seed)  # every process samples with process 0's fresh seed
        self.scheduler.add(request_id, prompt, sp, seed, sample_index, stop_ids)

    def abort(self, request_id: str) -> bool:
        """End a request now; its pages return. Its last delta (finish_reason "abort") comes with the next step."""
        req = self.scheduler.requests.get(request_id)
        if req is None:
            return False
        self.scheduler.remove(req)
        self.counts["aborted"] += 1
        self._finished.append(RequestDelta(request_id, [], [], "abort"))
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self.scheduler.requests) or bool(self._finished)

    def new_request_id(self) -> str:
        return f"req-{next(self._ids)}"

    # ---- one step ----
    def step(self) -> list[RequestDelta]:
        """Admit, dispatch a decode call for every running slot, run one prefill chunk, then read the previous
        decode call. Returns what each request gained since the last step."""
        S.pin_trace_context()
        deltas, self._finished = self._finished, []
        sch = self.scheduler
        for req in sch.admit():
            if req.hit_row is not None:
                self.pools = self.steps.restore(self.pools, self.store, req.slot, req.hit_row)
        if sch.waiting and all(r is None for r in sch.slots):
            # Nothing runs and the queue's head cannot be admitted even with the prefix cache emptied:
            # add_request's checks should make this impossible; end it rather than spin.
            req = sch.waiting[0]
            sch.remove(req)
            self.counts["aborted"] += 1
            warnings.warn(f"request {req.request_id!r} ({req.n_tokens} tokens) cannot fit in the pools; aborted")
            deltas.append(RequestDelta(req.request_id, [], [], "abort"))
        flight = self._dispatch_decode(self._flight)
        prefilled = self._run_prefill()
        if self._flight is not None:
            deltas += self._collect(self._flight)
        self._flight = flight
        for done in prefilled:
            deltas += self._finish_prefill(*done)
        if self._flight is not None and not any(sch.slots[i] is r for i, r in self._flight.running):
            self._flight = None  # every request it decoded has ended: nothing left to read
        return deltas

    def _dispatch_decode(self, prev: _InFlight | None) -> _InFlight | None:
        sch = self.scheduler
        carried_reqs = {i: r for i, r in prev.running} if prev is not None else {}
        for req in sorted(sch.running(), key=lambda r: r.arrival):
            if req.status != RUNNING:
                continue  # preempted while an older request reserved
            mult = 2 if carried_reqs.get(req.slot) is req else 1
            end = min(req.fed + mult * self.k, self.max_model_len, req.limit)
            sch.reserve(req, req.fed, end)
        running = sch.running()
        if not running:
            return None
        s = self.layout.max_slots
        z = lambda dt=np.int32: np.zeros(s, dt)
        tokens, pos, rem, temp, top_k, seed, sidx, tidx = z(), z(), z(), z(np.float32), z(), z(), z(), z()
        active, top_p = z(bool), np.ones(s, np.float32)
        stop = np.full((s, S.MAX_STOP), -1, np.int32)
        carried = z(bool)
        for r in sch.slots:
            if r is not None and r.status == PREFILLING:
                pos[r.slot] = r.computed  # where it stands: its compressor state is left as it is
        upto = 0
        for r in running:
            i = r.slot
            carried[i] = carried_reqs.get(i) is r
            tokens[i], pos[i], active[i] = r.output[-1], r.fed, True
            rem[i] = r.params.max_tokens - len(r.output)
            temp[i], top_p[i], top_k[i] = r.params.temperature, r.params.top_p, max(r.params.top_k, 0)
            seed[i], sidx[i], tidx[i] = r.seed, r.sample_index, len(r.output)
            stop[i, :len(r.stop_ids)] = r.stop_ids
            upto = max(upto, min(r.fed + (2 if carried[i] else 1) * self.k, self.max_model_len))
        # Fresh numpy arrays, never mutated afterwards: jit transfers them itself.
        fresh = S.DecodeState(tokens, pos, active, rem, stop, S.SamplingState(temp, top_p, top_k, seed, sidx, tidx))
        # always through the (tiny) merge, so the decode step sees device arrays every time (numpy and device
        # arguments are different signatures to jit, and warm-up compiles one)
        state = self.steps.carry(prev.state if carried.any() else fresh, fresh, carried)
        pt = self.tables.full[:, :self._page_bucket(upto)]
        self.pools, self.store, out, state = self.steps.decode(self._spec_for(temp), self._leaves, self.pools,
                                                           self.store, state, _snapshot(pt),
                                                           _snapshot(self.tables.swa))
        return _InFlight(out, state, [(r.slot, r) for r in running], {r.slot: r.fed for r in running})

    def _collect(self, flight: _InFlight) -> list[RequestDelta]:
        """Wait for a dispatched call (one device_get) and advance its requests. A slot whose request ended, was
        aborted or preempted after the call was dispatched is skipped: its tokens are not wanted."""
        toks, lps, n_out, stopped, still = jax.device_get((flight.out.tokens, flight.out.logprobs, flight.out.n_out,
                                                           flight.out.stopped, flight.state.active))
        sch, p = self.scheduler, self.layout.page_size
        deltas = []
        for i, r in flight.running:
            if sch.slots[i] is not r or r.status != RUNNING:
                continue
            n = int(n_out[i])
            f0 = r.fed
            new = toks[i, :n].tolist()
            r.output.extend(new)
            r.saved.update(range((f0 // p + 1) * p, r.fed + 1, p))  # boundaries its decode steps reached
            sch.cache_pages(r)
            reason = None if still[i] else ("stop" if stopped[i] else "length")
            deltas.append(RequestDelta(r.request_id, new, lps[i, :n].tolist() if r.params.logprobs else [], reason))
            if reason is not None:
                sch.remove(r)
                self.counts["finished"] += 1
        return deltas

    def _page_bucket(self, upto: int) -> int:
        return min(_pow2(-(-upto // self.layout.page_size)), self.layout.max_pages_per_seq)

    def _spec_for(self, temperature) -> S.StepSpec:
        """The step's program: the sampling one when a row of it samples, else the greedy-only one."""
        return self.spec if (temperature > 0).any() else self.greedy_spec

    def _run_prefill(self) -> list:
        """Dispatch the next prefill step (a chunk of each of up to MAX_PREFILL_ROWS requests, as rows of one
        batch); returns [(request, tokens, logprobs, row)] for the rows that were their request's last chunk."""
        plans = self.scheduler.next_chunks()
        if not plans:
            return []
        n_rows = _pow2(len(plans))
        bucket = chunk_bucket(max(e - s for _, s, e in plans))
        slots = self.layout.max_slots
        chunk = np.zeros((n_rows, bucket), np.int32)
        start, n_valid, slot = (np.zeros(n_rows, np.int32) for _ in range(3))
        slot[:] = slots  # an empty row's slot is out of range: its state writes are dropped
        fresh = np.zeros(n_rows, bool)
        temp, top_p = np.zeros(n_rows, np.float32), np.ones(n_rows, np.float32)
        top_k, seed, sidx, tidx = (np.zeros(n_rows, np.int32) for _ in range(4))
        pt = np.full((n_rows, self._page_bucket(max(s for _, s, _ in plans) + bucket)), -1, np.int32)
        swa = np.full((n_rows, self.tables.swa.shape[1]), -1, np.int32)
        for i, (req, s0, e0) in enumerate(plans):
            sp = req.params
            chunk[i, :e0 - s0] = req.token_slice(s0, e0)
            start[i], n_valid[i], slot[i], fresh[i] = s0, e0 - s0, req.slot, s0 == 0
            temp[i], top_p[i], top_k[i] = sp.temperature, sp.top_p, max(sp.top_k, 0)
            seed[i], sidx[i], tidx[i] = req.seed, req.sample_index, len(req.output)
            pt[i] = self.tables.full[req.slot, :pt.shape[1]]
            swa[i] = self.tables.swa[req.slot]
        samp = S.SamplingState(temp, top_p, top_k, seed, sidx, tidx)
        batch = S.PrefillBatch(chunk, start, n_valid, fresh, slot)
        self.pools, self.store, tok, lp = self.steps.prefill(self._spec_for(temp), self._leaves, self.pools,
                                                             self.store, batch, pt, swa, samp)
        done = []
        for i, (req, s0, e0) in enumerate(plans):
            req.computed = e0
            if e0 % self.layout.page_size == 0:
                req.saved.add(e0)
            self.scheduler.cache_pages(req)
            if e0 == req.n_tokens:
                done.append((req, tok, lp, i))
        return done

    def _finish_prefill(self, req: Request, tok, lp, row: int) -> list[RequestDelta]:
        sch = self.scheduler
        if req.slot is None or sch.slots[req.slot] is not req:
            return []  # aborted or preempted meanwhile
        t, l = int(tok[row]), float(lp[row])
        req.output.append(t)
        req.status = RUNNING
        sch.tables.reserve(req.slot, req.fed, req.fed)  # the window is all it keeps of its prefill's SWA pages
        stopped = t in req.stop_ids
        done = stopped or len(req.output) >= req.params.max_tokens or req.fed + 1 >= self.max_model_len
        reason = ("stop" if stopped else "length") if done else None
        if done:
            sch.remove(req)
            self.counts["finished"] += 1
        return [RequestDelta(req.request_id, [t], [l] if req.params.logprobs else [], reason)]

    # ---- compile and report ----
    def warmup(self) -> int:
        """Compile every bucket the engine will use (prefill chunk x pages and decode x pages, each in its sampling
        and greedy-only forms, the prefix restore) with no-op calls (no valid tokens). Returns the number of
        compiled variants; afterwards nothing recompiles."""
        S.pin_trace_context()
        s = self.layout.max_slots
        page_buckets = sorted({self._page_bucket(n * self.layout.page_size)
                               for n in range(1, self.layout.max_pages_per_seq + 1)})
        top = self.scheduler.step_tokens
        row_buckets = sorted({_pow2(r) for r in range(1, min(MAX_PREFILL_ROWS, s) + 1)})
        shapes = [(rb, cb) for rb in row_buckets for cb in sorted({chunk_bucket(c) for c in range(1, top + 1)})
                  if rb == 1 or rb * cb <= top]
        empty = [i for i, r in enumerate(self.scheduler.slots) if r is None]
        if self.prefix is not None and empty:
            self.pools = self.steps.restore(self.pools, self.store, empty[0], 0)
        for nb in page_buckets:
            pt = _snapshot(self.tables.full[:, :nb])
            for (rb, cb), spec in itertools.product(shapes, (self.spec, self.greedy_spec)):
                z = lambda dt=np.int32: np.zeros(rb, dt)
                samp = S.SamplingState(z(np.float32), np.ones(rb, np.float32), z(), z(), z(), z())
                batch = S.PrefillBatch(np.zeros((rb, cb), np.int32), z(), z(), z(bool), np.full(rb, s, np.int32))
                self.pools, self.store, _, _ = self.steps.prefill(spec, self._leaves, self.pools, self.store, batch,
                                                                  np.full((rb, nb), -1, np.int32),
                                                                  np.full((rb, self.tables.swa.shape[1]), -1, np.int32),
                                                                  samp)
            n = lambda dt=np.int32: np.zeros((s,), dt)
            st = S.DecodeState(n(), n(), n(bool), n(), np.full((s, S.MAX_STOP), -1, np.int32),
                               S.SamplingState(n(np.float32), np.ones(s, np.float32), n(), n(), n(), n()))
            st = self.steps.carry(st, st, n(bool))
            for spec in (self.spec, self.greedy_spec):
                self.pools, self.store, *_ = self.steps.decode(spec, self._leaves, self.pools, self.store, st, pt,
                                                               _snapshot(self.tables.swa))
        return self.compiled_variants()

    def compiled_variants(self) -> int:
        return self.steps.compiled_variants()

    def stats(self) -> dict:
        t, lay, sch = self.tables, self.layout, self.scheduler
        if t.dense:
            used_slots = sum(r is not None for r in sch.slots)
            full_used, swa_used = used_slots * lay.max_pages_per_seq, used_slots * lay.max_swa_pages_per_seq
        else:
            full_used, swa_used = t.full_alloc.n_used, t.swa_alloc.n_used
        pools = {"swa": {"used": swa_used, "total": lay.n_swa_pages, "unit": f"{lay.swa_page_size} tokens"}}
        kinds = {self.cfg.layer_type(i) for i in range(self.cfg.n_layers)}
        for name, kind in (("c4_kv", "csa"), ("c4_index", "csa"), ("c128_kv", "hca")):
            if kind in kinds:
                pools[name] = {"used": full_used, "total": lay.n_pages, "unit": f"{lay.page_size} tokens"}
        pools["tokens"] = {"used": full_used, "total": lay.n_pages, "unit": f"{lay.page_size} tokens"}
        pools["compressor_state"] = {"used": sum(r is not None for r in sch.slots), "total": lay.max_slots,
                                     "unit": "slot"}
        pc = self.prefix
        in_use = [i for i, r in enumerate(sch.slots) if r is not None]
        return {
            "pools": pools,
            # on a mesh with data / context axes: each shard's own pages (a request uses only its shard's)
            "shards": t.shard_usage(in_use) if t.n_data * t.n_context > 1 else [],
            "prefix_cache": {
                "enabled": pc is not None,
                "queried_tokens": pc.queried_tokens if pc else 0,
                "hit_tokens": pc.hit_tokens if pc else 0,
                "cached_pages": pc.n_nodes() if pc else 0,
                "evicted_pages": pc.evicted_pages if pc else 0,
                "tombstoned_tails": pc.tombstoned if pc else 0,
            },
            "requests": {
                "running": len(sch.running()), "prefilling": len(sch.prefilling()), "waiting": len(sch.waiting),
                "finished": self.counts["finished"], "aborted": self.counts["aborted"],
                "preempted": sch.n_preempted, "rejected": self.counts["rejected"],
            },
        }
