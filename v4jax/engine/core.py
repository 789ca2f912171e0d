"""`EngineCore`: requests in by id, per-request token deltas out, one `step()` at a time.

    core.add_request("a", prompt_ids, SamplingParams(max_tokens=32))
    while core.has_unfinished_requests():
        for d in core.step():          # RequestDelta(request_id, new_token_ids, new_logprobs, finish_reason)
            ...

The one loop that `LLM.generate` and the server both drive. It owns the device state (parameters, pools, the
boundary-state store) and is the only caller of the jitted steps; the scheduler decides (and alone writes a
request's state), the KV-cache manager (v4jax.cache.manager) keeps the books of pages. A step is
plan -> dispatch -> update: the scheduler's plan (admissions with prefix hits to restore, the decode call, the
prefill rows), then the jitted calls, then the outputs turned into per-request deltas. The decode call of step n+1
is dispatched before step n's results are read, so the host's bookkeeping overlaps the device's work (call n+1
continues from call n's device-side state)."""
from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import os
import time
import warnings
from typing import Callable, Sequence

import jax
import numpy as np
from flax import nnx

from v4jax import cache as C
from v4jax.cache import transfer as T
from v4jax.cache.boundary import init_boundary_store
from v4jax.cache.layout import kv_cache_dtype, pool_layout
from v4jax.cache.manager import KVCacheManager
from v4jax.config import ModelConfig
from v4jax.engine import steps as S
from v4jax.engine.checks import RequestCheck
from v4jax.engine.programs import Program, ProgramBook, form_parts, runs_form
from v4jax.engine.scheduler import (MAX_PREFILL_ROWS, PREFILLED, DecodePlan, Request, RequestDelta,  # noqa: F401
                                    Scheduler, chunk_bucket)
from v4jax.model import RunOptions, Transformer
from v4jax.model.ops import ops_for
from v4jax.model.weights import weights_checksum
from v4jax.engine.sampling import SamplingParams
from v4jax.fields import MAX_TOP_LOGPROBS


# Threads compiling at once in warm-up (each holds a program's compile memory)
MAX_COMPILE_THREADS = 8
# A step slower than this is logged with the programs it ran (a stall of every stream: which program, whether on
# its first run, whether a covering one)
SLOW_STEP_S = 2.0
log = logging.getLogger("v4jax.engine")


class StepMemoryError(MemoryError):
    """A step's program needed more device memory than was free (XLA's RESOURCE_EXHAUSTED)."""


def _described(program: Program, covering: bool, first: bool) -> str:
    """A dispatched program as the slow-step log names it."""
    return f"{program}" + (" on a covering program" if covering else "") + (", its first run" if first else "")


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@dataclasses.dataclass
class _InFlight:
    """A dispatched decode call: its device outputs and end state, and the requests it decoded by slot."""
    out: S.DecodeOutput  # [rows, ...]: row b is slot b
    state: S.DecodeState  # [max_slots, ...]: every slot
    rows: int  # the call's slot bucket: it decoded slots 0 .. rows-1
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
        ops = ops_for(run_options.attention_impl)
        if ops.from_xla:  # said once, here, rather than found out from a profile
            warnings.warn(f"attention_impl={run_options.attention_impl!r} on this backend: {', '.join(ops.from_xla)} "
                          "run as the XLA table's (their kernels are written for Triton)")
        self.kv_dtype = kv_cache_dtype(options.kv_cache_dtype, self.dtype)  # the pools' (init_pools)
        self.layout = pool_layout(cfg, options, self.kv_dtype, max_model_len, n_data, n_ctx)
        self.kv = KVCacheManager(cfg, self.layout, dense=dense, caching=caching, dtype=self.kv_dtype)
        self.request_check = RequestCheck.of(cfg, self.layout, max_model_len, paged=not dense)
        self.scheduler = Scheduler(self.kv, max_num_seqs=slots, prefill_chunk=options.prefill_chunk,
                                   decode_steps=self.k, max_model_len=max_model_len)
        self.pools, self.store = self._create_pools(self.layout.n_swa_pages if caching else 0, caching)
        graphdef, state = nnx.split(model)
        self._leaves, treedef = jax.tree.flatten(state)
        self.spec = S.StepSpec(graphdef, treedef, cfg, self.layout, run_options, self.k, max_model_len, caching)
        # steps where nobody samples: no full-vocabulary sort, and no device-side branch on it (a `lax.cond`, which
        # XLA:GPU resolves by copying the predicate to the host and waiting: the host then cannot prepare the next
        # step while the device runs this one)
        self.greedy_spec = dataclasses.replace(self.spec, any_sampled=False)
        # decode steps whose sampled rows cut by neither top_k nor top_p (vLLM's and OpenAI's defaults): no
        # full-vocabulary sort either (sampling.kept); its results are the sampling form's for such rows
        self.plain_spec = dataclasses.replace(self.spec, any_cut=False)
        # steps where a row has a presence / frequency / repetition penalty: each of the three forms counting each
        # row's sequence so far (a decode call once, then a token a step: steps._decode). One form for all (the
        # sampling one with the cut) made a greedy penalised flash-slice step at batch 32 / 4K 0.55 ms slower than
        # greedy on an H100 (3.37 against 2.83 ms), nearly all of it the cut's search; with its own forms the step
        # pays for the counts alone. The sampling one with the top-N alternatives is the covers' form, the others
        # are compiled at their first use. `penalty_spec`: the sampling one (prefill steps run the sampling form).
        self.penalty_specs = {spec: dataclasses.replace(spec, any_penalty=True)
                              for spec in (self.spec, self.plain_spec, self.greedy_spec)}
        self.penalty_spec = self.penalty_specs[self.spec]
        # each of the six with the top-N alternatives per token, for steps where a request asked for them
        # (SamplingParams.top_logprobs); compiled at their first use, not by warmup()
        forms = (self.spec, self.plain_spec, self.greedy_spec, *self.penalty_specs.values())
        self.top_specs = {spec: dataclasses.replace(spec, top_logprobs=MAX_TOP_LOGPROBS) for spec in forms}
        self.steps = S.JittedSteps.make(run_options.mesh_rules)
        # the compiled step programs, and the one each step runs (a covering one while its own compiles, after
        # warm-up): a form runs on any that is at least as wide in each of its parts, the lightest first: greedy
        # rows on the sampling forms (temperature 0 is greedy there), rows that do not cut on the form with the cut,
        # rows without penalties on the forms with them (neutral penalties leave the logits as they are), and any
        # form on its twin with the top-N alternatives (read only for the requests that asked); the widest, the
        # sampling form with the cut, penalties and the alternatives, covers every step
        every = (*forms, *self.top_specs.values())
        self.programs = ProgramBook(self._compile_program, {
            form: tuple(sorted((w for w in every if runs_form(w, form)), key=form_parts)) for form in every})
        # device bytes of temporaries of each program compiled ahead of time (XLA's memory analysis): what a step
        # needs beside the weights and pools, which the caller checks against what is free (v4jax.memory)
        self.step_temporaries: dict[Program, int] = {}
        self._flight: _InFlight | None = None
        self._step_programs: list[tuple] = []  # (program, covering, first run) of this step's dispatches
        self._finished: list[RequestDelta] = []  # aborts, reported by the next step()
        self._ids = itertools.count()
        self.counts = {"rejected": 0}  # requests refused at add_request (finished and aborted: the scheduler's)
        # engine steps, their wall seconds and the part spent waiting on the device for a call's outputs: the rest
        # is the host's (scheduling, dispatch, the deltas), so a driver that steps slower than LLM.generate shows
        # whether its host side or the device takes the time (the server's threads share the GIL with this one);
        # and what the steps dispatched (prefill steps and their rows, decode calls and their running requests), so
        # the same requests arriving together (LLM.generate) and apart (a server's clients) compare step by step
        self.step_time = {"steps": 0, "seconds": 0.0, "device_wait_seconds": 0.0, "prefill_steps": 0,
                          "prefill_rows": 0, "decode_calls": 0, "decode_rows": 0}
        # speculative decoding: draft steps of the slots (each proposes draft_tokens), drafts accepted, by position
        self.spec_decode = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0,
                            "accepted_by_position": [0] * self.layout.draft_tokens}
        # (before, after): called around each step until the engine is first idle, and around warmup; whoever
        # builds the engine may set them (the API's one-line notice that a first run compiles)
        self.compile_hooks: tuple[Callable[[], None], Callable[[], None]] | None = None
        self._imports: dict = {}  # request id -> (RequestState, SamplingParams): imported, not yet in a slot
        self._first: dict = {}  # prefilled request id -> its first token's log-prob and alternatives
        self._transfer_jits = None
        self._format = None  # transfer_format(), once
        self._merged_example = None  # _decode_state_merge(), once

    def _create_pools(self, n_boundary_rows: int, caching: bool):
        """The pools and the boundary store, created in their shards on a mesh (one jit, out_shardings from the
        logical axes of every pool dimension)."""
        from sharding.place import create_sharded
        from v4jax.cache.boundary import store_shardings

        def make():
            pools = C.init_pools(self.cfg, self.layout, self.kv_dtype)
            store = init_boundary_store(pools, n_boundary_rows)
            if not caching:
                store = dataclasses.replace(store, layers=tuple(None for _ in store.layers))
            return pools, store

        def shardings(abstract, mr):
            return C.pool_shardings(abstract[0], mr.sharding), store_shardings(abstract[1], mr.sharding)

        pools, store = create_sharded(make, shardings, self.run_options.mesh_rules)
        if self.run_options.mesh_rules is None:
            pools, store = jax.device_put((pools, store), S.single_device())  # as the steps return them
        return (C.pin_host(pools) if self.layout.hot_rows else pools), store

    # ---- requests ----
    def add_request(self, request_id: str, prompt_token_ids: Sequence[int], sampling_params: SamplingParams,
                    *, sample_index: int = 0, prefill_only: bool = False) -> None:
        """Queue a request. Raises ValueError for one that could never run (v4jax.engine.checks: past the context,
        more pages than its data shard holds, an empty prompt or an id outside the vocabulary, too many stop ids);
        everything else is queued, never refused. `prefill_only`: it stops after its first token, holding its pages
        until `export_request` takes its state (prefill/decode disaggregation)."""
        if request_id in self.scheduler.requests or request_id in self._imports:
            raise ValueError(f"request id {request_id!r} is already in use")
        prompt = list(map(int, prompt_token_ids))
        sp = sampling_params
        try:
            self.request_check(prompt, sp)
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
        self.scheduler.add(request_id, prompt, sp, seed, sample_index, stop_ids, prefill_only)

    # ---- a request's state between engines (prefill/decode disaggregation) ----
    def export_request(self, request_id: str) -> T.RequestState:
        """The whole state of a prefill-only request that has its first token (v4jax.cache.transfer: its compressed
        entries, window rows, compressor and drafter states as numpy arrays, its tokens and sampler in `meta`); the
        request then leaves this engine and its pages return (the prefix cache keeps its full pages)."""
        self._check_transferable()
        sch = self.scheduler
        req = sch.requests.get(request_id)
        if req is None or req.status != PREFILLED:
            raise ValueError(f"request {request_id!r} is not a prefilled request waiting for export"
                             + ("" if req is None else f" (it is {req.status})"))
        fed = req.fed
        full, swa = self.kv.slot_tables(req.slot)
        padded = self._transfer_steps()[0](self.pools, np.int32(req.slot),
                                           *T.gather_inputs(self.cfg, self.layout, full, swa, fed))
        arrays = T.cut(self.cfg, jax.device_get(padded),
                       T.expected_shapes(self.cfg, self.pools, fed, self.pools.draft is not None))
        sp = req.params
        meta = {"format": self.transfer_format(), "position": fed,
                "request": {"request_id": request_id, "prompt": req.prompt, "output": req.output,
                            "params": dataclasses.asdict(sp), "seed": req.seed, "sample_index": req.sample_index,
                            "stop_ids": list(req.stop_ids)},
                "first": self._first.pop(request_id, None)}
        sch.export(req)
        return T.RequestState(json.loads(json.dumps(meta)), arrays)  # as the receiver will read it

    def import_request(self, state: T.RequestState, request_id: str | None = None) -> str:
        """Continue a request whose state another engine exported: checked now (TransferError, a ValueError, for
        another model or KV format, missing, truncated or mis-shaped arrays; ValueError for a request this engine
        could never hold), bound to a free slot at the next step that has one (its pages then written), and
        decoded from there. Its first delta repeats the token the other engine produced (with its log-prob and
        alternatives), so this engine's deltas are the request's whole output. Returns its id here."""
        self._check_transferable()
        rq = state.meta["request"]
        request_id = request_id or rq["request_id"]
        if request_id in self.scheduler.requests or request_id in self._imports:
            raise ValueError(f"request id {request_id!r} is already in use")
        fed = int(state.meta["position"])
        if fed != len(rq["prompt"]) + len(rq["output"]) - 1 or not rq["output"]:
            raise T.TransferError(f"the request's state is at position {fed}, its tokens say "
                                  f"{len(rq['prompt']) + len(rq['output']) - 1}")
        T.check_state(state, self.transfer_format(),
                      T.expected_shapes(self.cfg, self.pools, fed, self.pools.draft is not None))
        params = SamplingParams(**rq["params"])
        self.request_check(rq["prompt"], params)
        self._imports[request_id] = (state, params)
        return request_id

    def transfer_format(self) -> dict:
        """What a request's state must share with this engine to move in or out (v4jax.cache.transfer.format_of):
        the configuration's digest, the pools' format and the weights' digest, computed once (one pass over the
        weights where they lie; a disaggregated server computes it at start)."""
        if self._format is None:
            self._format = T.format_of(self.cfg, self.kv_dtype, weights_checksum(self._leaves))
        return self._format

    def _check_transferable(self) -> None:
        if self.cfg.dspark_block_size and self.layout.draft_tokens:
            raise T.TransferError("speculative_config with the DSpark drafter: moving its state between engines "
                                  "is not supported yet (decode without speculative_config on a disaggregated "
                                  "server, or use the MTP drafter)")

    def _bind_imports(self) -> list[RequestDelta]:
        """Imported requests into free slots, in arrival order, while slots and pages last: their state written
        into the slot's pages; their first deltas."""
        deltas = []
        for rid in list(self._imports):
            state, params = self._imports[rid]
            rq, m = state.meta["request"], state.meta
            req = self.scheduler.insert(rid, rq["prompt"], rq["output"], params, int(rq["seed"]),
                                        int(rq["sample_index"]), tuple(rq["stop_ids"]))
            if req is None:
                break
            del self._imports[rid]
            self._write_state(req, state)
            first = m.get("first") or {}
            tops = [[tuple(p) for p in first["top"]]] if first.get("top") else []
            deltas.append(RequestDelta(rid, list(rq["output"]), first.get("logprobs", []), None, tops))
        return deltas

    def _write_state(self, req, state: T.RequestState) -> None:
        full, swa = self.kv.slot_tables(req.slot)
        inputs = T.scatter_inputs(self.cfg, self.layout, state.arrays, full, swa, req.fed,
                                  req.token_slice(0, req.fed))
        self.pools = self._transfer_steps()[1](self.pools, np.int32(req.slot), *inputs)

    def _transfer_steps(self):
        """(gather, scatter) of a request's state, jitted for this engine (the scatter donates the pools). The
        scatter's pools come out placed as this engine's are (its mesh, its devices, host memory under offload),
        whatever mesh the state was gathered on: the arrays arrive from the host and go where the pools are."""
        if self._transfer_jits is None:
            cfg, lay = self.cfg, self.layout
            placed = None if self.run_options.mesh_rules is None else jax.tree.map(lambda a: a.sharding, self.pools)
            self._transfer_jits = (
                jax.jit(lambda pools, slot, pages, swa: T.gather_request(cfg, lay, pools, slot, pages, swa)),
                jax.jit(lambda pools, slot, arrays, entries, swa, tr, ti: T.scatter_request(
                    cfg, lay, pools, slot, arrays, entries, swa, tr, ti), donate_argnums=0, out_shardings=placed))
        return self._transfer_jits

    def abort(self, request_id: str) -> bool:
        """End a request now; its pages return. Its last delta (finish_reason "abort") comes with the next step."""
        if self._imports.pop(request_id, None) is not None:
            self._finished.append(RequestDelta(request_id, [], [], "abort"))
            return True
        self._first.pop(request_id, None)
        delta = self.scheduler.abort(request_id)
        if delta is None:
            return False
        self._finished.append(delta)
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self.scheduler.requests) or bool(self._finished) or bool(self._imports)

    def new_request_id(self) -> str:
        return f"req-{next(self._ids)}"

    # ---- one step ----
    def step(self) -> list[RequestDelta]:
        """Plan (admit, reserve pages, pick prefill rows), dispatch a decode call for every running slot and one
        prefill step, then read the previous decode call and the prefill's first tokens. Returns what each request
        gained since the last step. A step the device has no memory for raises StepMemoryError."""
        try:
            return self._step()
        except jax.errors.JaxRuntimeError as e:
            if "RESOURCE_EXHAUSTED" not in str(e):
                raise
            ran = ", ".join(str(p) for p, _, _ in self._step_programs) or "its programs"
            raise StepMemoryError(
                f"an engine step ran out of device memory ({ran}): {str(e).splitlines()[0][:300]}. The engine cannot "
                "go on (its pools were donated to the step). Build it again with a lower prefill_chunk (prefill "
                "steps) or max_num_seqs (decode calls), or a memory_budget_bytes; LLM.warmup() (the server's "
                "warm-up) checks every step's memory before serving.") from e

    def _step(self) -> list[RequestDelta]:
        S.pin_trace_context()
        if self.compile_hooks is not None:
            self.compile_hooks[0]()
        t0, self._step_programs = time.perf_counter(), []
        deltas, self._finished = self._finished, []
        sch = self.scheduler
        if self._imports:
            deltas += self._bind_imports()
        plan = sch.schedule(self._flight.running if self._flight is not None else ())
        deltas += plan.ended
        # dispatch
        for slot, row in plan.restores:
            self.pools = self.steps.restore(self.pools, self.store, slot, row)
        flight = self._dispatch_decode(plan.decode, self._flight)
        prefill_out = self._dispatch_prefill(plan.prefill)
        # update
        sch.advance_prefill(plan.prefill)
        if self._flight is not None:
            deltas += self._collect(self._flight)
        self._flight = flight
        if any(e == r.n_tokens for r, _, e in plan.prefill):
            tok, lp, top = self._device_get(prefill_out)
            done = sch.finish_prefill(plan.prefill, tok, lp, top)
            for d in done:  # what an export hands on with the state: the first token's log-prob and alternatives
                if d.finish_reason is None and sch.requests[d.request_id].prefill_only:
                    self._first[d.request_id] = {"logprobs": d.new_logprobs, "top": d.new_top_logprobs[0]
                                                 if d.new_top_logprobs else []}
            deltas += done
        if self._flight is not None and not any(sch.slots[i] is r for i, r in self._flight.running):
            self._flight = None  # every request it decoded has ended: nothing left to read
        if self.compile_hooks is not None and not self.has_unfinished_requests():
            self.compile_hooks, (_, after) = None, self.compile_hooks
            after()
        seconds = time.perf_counter() - t0
        self.step_time["steps"] += 1
        self.step_time["seconds"] += seconds
        if seconds > SLOW_STEP_S:
            log.info("an engine step took %.1f s (dispatching %s; reading the decode call before)", seconds,
                     ", ".join(_described(*ran) for ran in self._step_programs) or "nothing")
        return deltas

    def _ran(self, program: Program, exact: Program) -> None:
        """Record a dispatched step program (described only if the step is slow)."""
        self._step_programs.append((program, program != exact, self.programs.ran(program)))

    def _dispatch_decode(self, plan: DecodePlan | None, prev: _InFlight | None) -> _InFlight | None:
        if plan is None:
            return None
        self.step_time["decode_calls"] += 1
        self.step_time["decode_rows"] += len(plan.running)
        sch = self.scheduler
        s = self.layout.max_slots
        z = lambda dt=np.int32: np.zeros(s, dt)
        tokens, pos, rem, active = z(), z(), z(), z(bool)
        samp = S.SamplingState.neutral(s)
        carried = z(bool)
        for r in sch.prefilling() + sch.prefilled():
            pos[r.slot] = r.computed  # where it stands: its compressor state is left as it is
        for r in plan.running:
            i = r.slot
            carried[i] = i in plan.carried
            tokens[i], pos[i], active[i] = r.output[-1], r.fed, True
            rem[i] = r.params.max_tokens - len(r.output)
            samp.set_row(i, r.params, r.seed, r.sample_index, len(r.output), r.stop_ids, len(r.prompt))
        # Fresh numpy arrays, never mutated afterwards: jit transfers them itself.
        fresh = S.DecodeState(tokens, pos, active, rem, samp)
        # always through the (tiny) merge, so the decode step sees device arrays every time (numpy and device
        # arguments are different signatures to jit, and warm-up compiles one)
        state = self.steps.carry(prev.state if carried.any() else fresh, fresh, carried)
        spec = self._spec_for(samp.temperature, samp.top_p, samp.top_k,
                              any(r.params.top_logprobs for r in plan.running),
                              any(r.params.penalized for r in plan.running))
        exact = Program("decode", spec, self._slot_bucket(max(r.slot for r in plan.running)), 0,
                        self._page_bucket(plan.upto))
        program = self.programs.choose(exact)
        pt, swa = self.kv.decode_tables(program.pages, program.rows)
        self.pools, self.store, out, state = self.steps.decode(program.spec, self._leaves, self.pools, self.store,
                                                               state, pt, swa)
        self._ran(program, exact)
        return _InFlight(out, state, program.rows, [(r.slot, r) for r in plan.running],
                         {r.slot: r.fed for r in plan.running})

    def _programs_ahead(self, plans: list[tuple[Request, int, int]], exact: Program) -> list[Program]:
        """The programs a prefill step's prompts will need after it, where some prompt has chunks left: its next
        chunks' (the page bucket grows with the position) over the rows with chunks left, then its first decode
        call's (over the slots of the requests admitted so far, in the form its sampling asks for). Each is needed
        before the request ends unless it stops at its first token (a decode call crossing into a wider page bucket
        later compiles its program then). Compiled ahead in the background on an engine without covers
        (ProgramBook.ahead); a guess that misses (other requests join) costs a background compile, not a step."""
        left = [p for p in plans if p[2] < p[0].n_tokens]
        if not left or not self.programs.compiles_ahead or jax.process_count() > 1:
            return []
        req, _, end = max(left, key=lambda p: p[1])   # the furthest row sets the page table's width
        step, n, out = max(e - s for _, s, e in plans), req.n_tokens, []
        for s in range(end, n, step):
            bucket = chunk_bucket(min(step, n - s))
            last = s + step >= n  # the chunk whose token is read: in the request's own form
            base = self.penalty_spec if req.params.penalized and last else self.spec
            form = self.top_specs[base] if req.params.top_logprobs and last else base
            out.append(Program("prefill", form, _pow2(len(left)), bucket, self._page_bucket(s + bucket)))
        if req.params.max_tokens > 1 and not req.prefill_only:   # (a prefill server hands decoding on)
            pr = req.params
            form = self._spec_for(np.array([pr.temperature]), np.array([pr.top_p]), np.array([pr.top_k]),
                                  bool(pr.top_logprobs), pr.penalized)
            sch = self.scheduler
            rows = self._slot_bucket(max(r.slot for r in sch.running() + sch.prefilling() + [req]))
            out.append(Program("decode", form, rows, 0, self._page_bucket(min(n + self.k, self.max_model_len))))
        return [p for p in dict.fromkeys(out) if p != exact]

    def _slot_bucket(self, highest: int) -> int:
        """Rows of a decode call whose highest running slot is `highest`: the next power of two (at most every
        slot), rows 0..B-1 being slots 0..B-1, so that a few requests in a many-slot engine do not pay for every
        slot (the scheduler admits into the lowest free slot, keeping them low). On a mesh with a `data` axis every
        slot: the slots are split into data shards (shard-major), and the call's rows split as they do."""
        s = self.layout.max_slots
        return s if self.layout.data_shards > 1 else min(_pow2(highest + 1), s)

    def _slot_buckets(self) -> list[int]:
        """Every decode call's row count (warm-up compiles each)."""
        return sorted({self._slot_bucket(i) for i in range(self.layout.max_slots)})

    def _device_get(self, tree):
        """jax.device_get, its wait counted in step_time."""
        t0 = time.perf_counter()
        try:
            return jax.device_get(tree)
        finally:
            self.step_time["device_wait_seconds"] += time.perf_counter() - t0

    def _collect(self, flight: _InFlight) -> list[RequestDelta]:
        """Wait for a dispatched call (one device_get) and advance its requests (its outputs' row b is slot b, and
        every running slot is below its row count)."""
        out = flight.out
        top = (out.top_ids, out.top_logprobs) if out.top_ids.shape[-1] else None  # read only where computed
        spec = (out.drafts, out.accepted) if self.layout.draft_tokens else None
        toks, lps, n_out, stopped, still, top, spec = self._device_get((out.tokens, out.logprobs, out.n_out,
                                                                        out.stopped, flight.state.active, top, spec))
        if spec is not None:
            slots = [i for i, _ in flight.running]
            drafts, accepted = spec[0][slots], spec[1][slots]
            c = self.spec_decode
            c["num_drafts"] += int(drafts.sum())
            c["num_draft_tokens"] += int(drafts.sum()) * self.layout.draft_tokens
            c["num_accepted_tokens"] += int(accepted.sum())
            c["accepted_by_position"] = [a + int(b) for a, b in zip(c["accepted_by_position"], accepted.sum(0))]
        return self.scheduler.finish_decode(flight.running, toks, lps, n_out, stopped, still, top)

    def _page_bucket(self, upto: int) -> int:
        return min(_pow2(-(-upto // self.layout.page_size)), self.layout.max_pages_per_seq)

    def _spec_for(self, temperature, top_p, top_k, top_logprobs: bool = False, penalty: bool = False) -> S.StepSpec:
        """The step's program: the sampling one when a row of it samples (without the top-k / top-p sort when no
        sampled row cuts by them), else the greedy-only one; its twin with penalties when a request of the step has
        one; with the top-N alternatives when a request of the step asked for them."""
        sampled = temperature > 0
        if not sampled.any():
            base = self.greedy_spec
        else:
            base = self.spec if (sampled & ((top_k > 0) | (top_p < 1))).any() else self.plain_spec
        base = self.penalty_specs[base] if penalty else base
        return self.top_specs[base] if top_logprobs else base

    def _dispatch_prefill(self, plans: list[tuple[Request, int, int]]):
        """Dispatch one prefill step (a chunk of each of up to MAX_PREFILL_ROWS requests, as rows of one batch);
        returns its device outputs (a sampled token, its log-prob and the top alternatives per row), or None
        without rows."""
        if not plans:
            return None
        self.step_time["prefill_steps"] += 1
        self.step_time["prefill_rows"] += len(plans)
        # One program per prefill shape and sampling form, the sampling one: its full-vocabulary sort of at most
        # MAX_PREFILL_ROWS rows is small beside a prefill step, and a greedy-only twin of every shape doubled what
        # warm-up compiles. The top-N variant only where a row ends its prompt (only that row's token is read).
        top_n = any(r.params.top_logprobs and e == r.n_tokens for r, _, e in plans)
        form = self.penalty_spec if any(r.params.penalized and e == r.n_tokens for r, _, e in plans) else self.spec
        furthest = max(s for _, s, _ in plans)
        bucket = chunk_bucket(max(e - s for _, s, e in plans))
        # a row's table reaches past its chunk's compiled length (a covering program's longer chunk too)
        exact = Program("prefill", self.top_specs[form] if top_n else form, _pow2(len(plans)), bucket,
                        self._page_bucket(furthest + bucket))
        self.programs.ahead(self._programs_ahead(plans, exact))
        program = self.programs.choose(exact, fits=lambda p: p.pages >= self._page_bucket(furthest + p.chunk))
        n_rows, bucket = program.rows, program.chunk
        slots = self.layout.max_slots
        chunk = np.zeros((n_rows, bucket), np.int32)
        start, n_valid, slot = (np.zeros(n_rows, np.int32) for _ in range(3))
        slot[:] = slots  # an empty row's slot is out of range: its state writes are dropped
        fresh = np.zeros(n_rows, bool)
        samp = S.SamplingState.neutral(n_rows)
        for i, (req, s0, e0) in enumerate(plans):
            sp = req.params
            chunk[i, :e0 - s0] = req.token_slice(s0, e0)
            start[i], n_valid[i], slot[i], fresh[i] = s0, e0 - s0, req.slot, s0 == 0
            samp.set_row(i, sp, req.seed, req.sample_index, len(req.output), req.stop_ids, len(req.prompt))
        pt, swa = self.kv.prefill_tables([r.slot for r, _, _ in plans], n_rows, program.pages)
        batch = S.PrefillBatch(chunk, start, n_valid, fresh, slot)
        self.pools, self.store, tok, lp, top = self.steps.prefill(program.spec, self._leaves, self.pools, self.store,
                                                                  batch, pt, swa, samp)
        self._ran(program, exact)
        return tok, lp, top

    # ---- compile and report ----
    def warmup(self, progress: Callable[[int, int], None] | None = None, *, cover_only: bool = False) -> int:
        """Compile the step programs ahead of time, several at once, with the prefix restore and the decode-state
        merge; `progress(done, total)` after each. Returns the number of step programs compiled.

        Every program the engine can dispatch (prefill rows x chunk x pages, decode slots x pages in the sampling
        and greedy-only forms): afterwards nothing compiles but the variants with top-N alternatives
        (`top_specs`), at the first request that asks for them (compiling them here would double the warm-up for
        what most deployments never use). `cover_only`: only the programs that cover every other one, the top-N
        variants included (v4jax.engine.programs: a few instead of well over a hundred); afterwards a step whose
        own program is missing runs on a covering one while its own compiles in the background, so no step waits
        for the compiler either. On several processes every process must run the same program each step, which a
        background compile's timing would not guarantee: there that needs the processes to agree on what is
        compiled (`programs.agreed`, as the multi-process server does: `take_compiled_programs` /
        `agree_programs`), else the steps whose programs are missing compile them.

        The step programs are compiled ahead of time (`lower(...).compile()` on the engine's own arrays, which
        fills the caches a later call looks in, and runs nothing: the pools are untouched), in threads: XLA's
        compiler releases the GIL, and one program compiles on few cores."""
        S.pin_trace_context()
        if self.compile_hooks is not None:
            self.compile_hooks[0]()
        empty = [i for i, r in enumerate(self.scheduler.slots) if r is None]
        if self.kv.caching and empty:
            self.pools = self.steps.restore(self.pools, self.store, empty[0], 0)
        self._decode_state_merge()
        programs = self._cover_programs() if cover_only else self._prefill_programs() + self._decode_programs()
        self.programs.compile_now(programs, min(os.cpu_count() or 1, MAX_COMPILE_THREADS), progress)
        self.programs.substitute = cover_only and (jax.process_count() == 1 or self.programs.agreed)
        if self.compile_hooks is not None:
            self.compile_hooks, (_, after) = None, self.compile_hooks
            after()
        return len(programs)

    def take_compiled_programs(self) -> list:
        """The leader of several processes, before a step: the programs it compiled in the background since the
        last call (agreed to here), named for the other processes (`agree_programs`)."""
        names = {spec: name for name, spec in self._named_specs().items()}
        return [[p.kind, names[p.spec], p.rows, p.chunk, p.pages] for p in self.programs.take_compiled()]

    def agree_programs(self, named: list) -> None:
        """The other processes, before the same step: the leader's `take_compiled_programs`."""
        specs = self._named_specs()
        self.programs.agree([Program(kind, specs[name], rows, chunk, pages) for kind, name, rows, chunk, pages
                             in named])

    def _named_specs(self) -> dict:
        named = {"sampled": self.spec, "plain": self.plain_spec, "greedy": self.greedy_spec}
        named |= {f"penalty_{name}": self.penalty_specs[spec] for name, spec in named.items()}
        return named | {f"top_{name}": self.top_specs[spec] for name, spec in named.items()}

    def _compile_program(self, program: Program) -> None:
        """Compile one step program ahead of time on arguments of its shape (the pools are only read for their
        shapes and placement: lowering takes arrays a step has since donated)."""
        S.pin_trace_context()  # in the compiling thread: its trace context must match the engine thread's
        rb, s = program.rows, self.layout.max_slots
        # empty tables of the step's shape (the host's own tables belong to the engine thread)
        pt, swa = self.kv.prefill_tables([], rb, program.pages)
        if program.kind == "prefill":
            z = lambda dt=np.int32: np.zeros(rb, dt)
            samp = S.SamplingState.neutral(rb)
            batch = S.PrefillBatch(np.zeros((rb, program.chunk), np.int32), z(), z(), z(bool),
                                   np.full(rb, s, np.int32))
            compiled = self.steps.prefill.lower(program.spec, self._leaves, self.pools, self.store, batch, pt, swa,
                                                samp).compile()
        else:
            compiled = self.steps.decode.lower(program.spec, self._leaves, self.pools, self.store,
                                               self._decode_state_merge(), pt, swa).compile()
        stats = compiled.memory_analysis()
        if stats is not None:
            self.step_temporaries[program] = int(stats.temp_size_in_bytes)

    def _decode_state_merge(self):
        """A decode state as the decode call sees it: the merge's device arrays (a signature of their own; the
        merge compiled once)."""
        if self._merged_example is not None:
            return self._merged_example
        s = self.layout.max_slots
        n = lambda dt=np.int32: np.zeros((s,), dt)
        st = S.DecodeState(n(), n(), n(bool), n(), S.SamplingState.neutral(s))
        self._merged_example = self.steps.carry(st, st, n(bool))
        return self._merged_example

    def _page_buckets(self) -> list[int]:
        lay = self.layout
        return sorted({self._page_bucket(n * lay.page_size) for n in range(1, lay.max_pages_per_seq + 1)})

    def _prefill_shapes(self) -> list[tuple[int, int]]:
        """(rows, chunk bucket) of every prefill step: rows x length within the step's token budget."""
        s, top = self.layout.max_slots, self.scheduler.step_tokens
        row_buckets = sorted({_pow2(r) for r in range(1, min(MAX_PREFILL_ROWS, s) + 1)})
        return [(rb, cb) for rb in row_buckets for cb in sorted({chunk_bucket(c) for c in range(1, top + 1)})
                if rb == 1 or rb * cb <= top]

    def _prefill_programs(self) -> list[Program]:
        """Every prefill step shape, each with the page buckets its rows can need (a row of compiled length T
        needs T's pages at least)."""
        return [Program("prefill", self.spec, rb, cb, nb) for nb in self._page_buckets()
                for rb, cb in self._prefill_shapes() if nb >= self._page_bucket(cb)]

    def _decode_programs(self) -> list[Program]:
        """The decode call at every slot bucket x page bucket, sampling (with and without the top-k / top-p cut)
        and greedy-only."""
        return [Program("decode", spec, rows, 0, nb)
                for nb, rows in itertools.product(self._page_buckets(), self._slot_buckets())
                for spec in (self.spec, self.plain_spec, self.greedy_spec)]

    def _cover_programs(self) -> list[Program]:
        """The fewest programs that cover every step: per prefill row count its longest chunk, and the decode call
        over every slot, all at the widest page table and in the sampling form with penalties and the top-N
        alternatives (so a first request with a penalty or asking for log-prob alternatives waits for no compile
        either); and the decode call's twins without the top-k / top-p cut and greedy-only, so that sampling at the
        defaults (what OpenAI clients send) and greedy decoding (evaluations, benchmarks) run their lighter forms
        from the start (the sort alone is 1.6 ms of a batch-32 flash-slice step on an H100)."""
        widest = max(self._page_buckets())
        longest = {}
        for rb, cb in self._prefill_shapes():
            longest[rb] = max(longest.get(rb, 0), cb)
        form = self.top_specs[self.penalty_spec]
        return ([Program("prefill", form, rb, cb, widest) for rb, cb in sorted(longest.items())]
                + [Program("decode", spec, max(self._slot_buckets()), 0, widest)
                   for spec in (form, self.plain_spec, self.greedy_spec)])

    def compiled_variants(self) -> int:
        """Prefill and decode programs compiled (or loaded from the persistent cache) in this process so far."""
        return S.compiled_programs()

    def hisparse_stats(self) -> dict:
        """The C4 KV's hot buffer (enable_hisparse): its rows per CSA layer, and since the engine was built, the
        entries the top-k selected (one per query token, layer and pick), how many were resident (hit_rate), the
        distinct entries fetched from the host, and the rows and bytes moved (a fetch moves one of a few fixed
        sizes, the smallest that holds its misses); `overflow` counts layer steps whose selection did not fit the
        buffer (0 by construction: the layout sizes it for a step's selection)."""
        counts = C.hot_counts(self.pools)
        row_bytes = next(lp.kv_hot for lp in self.pools.stacks if lp.kv_hot is not None)
        row_bytes = row_bytes.shape[-1] * row_bytes.dtype.itemsize
        return {"device_rows": self.layout.hot_rows, **counts,
                "hit_rate": counts["hits"] / counts["selected"] if counts["selected"] else None,
                "fetched_bytes": counts["fetched_rows"] * row_bytes,
                "transferred_bytes": counts["transferred_rows"] * row_bytes}

    def stats(self) -> dict:
        """Pools (pages or slots in use and in all, and their bytes, from the layout's bytes per unit), per data
        shard on a mesh, the prefix cache's counters, the requests' and the steps' (`step_time`)."""
        kv, sch = self.kv, self.scheduler
        in_use = sch.slots_in_use()
        pools = kv.usage(in_use)
        if self.layout.hot_rows:
            pools["c4_kv"].update(self.hisparse_stats())
        return {
            "pools": pools,
            # on a mesh with data / context axes: each shard's own pages (a request uses only its shard's)
            "shards": kv.shard_usage(in_use),
            "prefix_cache": kv.prefix_stats(),
            # programs compiled (or loaded from the persistent cache) in this process: one more while serving is a
            # request waiting for the compiler
            # `background`: of those, compiled while a covering program ran the steps (no request waited);
            # `substituted_steps`: steps that ran on a covering program meanwhile
            "programs": {"compiled": S.compiled_programs(), "compile_seconds": S.compile_seconds(),
                         "background": S.compiled_programs(background=True), **self.programs.counts()},
            "spec_decode": dict(self.spec_decode, accepted_by_position=list(self.spec_decode["accepted_by_position"])),
            "steps": dict(self.step_time),
            "requests": {
                "running": len(sch.running()), "prefilling": len(sch.prefilling()), "waiting": len(sch.waiting),
                "finished": sch.n_finished, "aborted": sch.n_aborted, "preempted": sch.n_preempted,
                "exported": sch.n_exported, "imported": sch.n_imported, "importing": len(self._imports),
                "rejected": self.counts["rejected"], "recomputed_tokens": sch.recomputed_tokens,
            },
        }
