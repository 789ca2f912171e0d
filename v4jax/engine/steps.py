"""The jitted steps: module-level functions of (params, pools, inputs), pools donated, shapes bucketed.

    prefill   B rows of T tokens (chunks of prompts) -> one sampled token per row (its log-prob, and its top-N
              alternatives in the programs that compute them)
    decode    k tokens for slots 0..B-1 in one loop of k steps (sampling, stop and length checks on device); with
              speculative decoding, a loop of draft + verify steps that keep 1..d+1 tokens each (v4jax.engine.spec)
    restore   a slot's compressor state set to a cached boundary's (a prefix hit)

Everything static about a step lives in one `StepSpec` (hashed by identity: jit looks it up on every call, and
hashing a model's graph definition each time would cost more than the lookup). Sampling parameters are traced
arrays, so changing them never recompiles. Both steps save the CSA compressor state at every full-page boundary
a row reaches (v4jax.cache.boundary) when the prefix cache is on."""
from __future__ import annotations

import dataclasses
import functools
import importlib
import threading
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from v4jax import cache as C
from v4jax.cache.boundary import (inner_page_ends, record_boundaries, restore_slot_states, save_boundary_states,
                                  save_recorded_boundaries)
from v4jax.config import ModelConfig
from v4jax.model import RunOptions
from v4jax.engine import dspark as DS
from v4jax.engine import spec as SP
from v4jax.engine.programs import in_background
from v4jax.engine.sampling import (apply_penalties, count_token, filtered_probs, sample, steered, token_counts,
                                   top_alternatives)
from v4jax.fields import MAX_LOGIT_BIAS
from v4jax.model.layers import set_rows
from v4jax.model.transformer import last_valid

MAX_STOP = 8  # stop token ids per request held on device (EOS included)

# JAX 0.11's Pallas fuser keeps a thread-local state ("disable nested fuse") in jit's cache key, and its first use
# in a thread turns the state from unset to an explicit False: every program traced before that misses the cache
# once afterwards. On the H200 the second `LLM.generate` of a process traced and compiled its prefill again
# (6 s for a 16-token prompt, 18 s for a 128K one). Setting the state before a step runs keeps the key stable.
# JAX 0.10 has no such state.
def _nested_fuse_state():
    try:
        module = importlib.import_module("jax._src.pallas.fuser.jaxpr_fusion")
    except ImportError:  # a JAX without the Pallas fuser
        return None
    return getattr(module, "_disable_nested_fuse", None)


_NESTED_FUSE = _nested_fuse_state()


def pin_trace_context() -> None:
    """Call in each thread before it runs a step (cheap: one thread-local write)."""
    if _NESTED_FUSE is not None:
        _NESTED_FUSE.set_local(False)


@dataclasses.dataclass(frozen=True, eq=False)
class StepSpec:
    """What the steps close over: the model's structure, the pool layout and the loop's static sizes."""
    graphdef: Any
    treedef: Any
    cfg: ModelConfig
    layout: C.PoolLayout
    opts: RunOptions
    decode_steps: int  # k
    max_model_len: int
    save_boundaries: bool  # the prefix cache is on
    # whether some row of the step samples (temperature > 0); False compiles a greedy-only step (the host knows
    # the step's requests, so the device never branches on it)
    any_sampled: bool = True
    # whether some sampled row cuts by top_k or top_p (False: no full-vocabulary sort; sampling.kept)
    any_cut: bool = True
    # most likely alternatives computed per sampled token: 0, or MAX_TOP_LOGPROBS in the programs of steps where a
    # request asked for them. A top-20 over a 129K vocabulary cost nothing measurable on CPU up to batch 32 (a
    # fifth more than the chosen token's log-softmax at batch 128); on a GPU it is two selection kernels
    # (sampling.top_alternatives), still work the programs most steps run leave out
    top_logprobs: int = 0
    # whether some row of the step has a presence / frequency / repetition penalty (sampling.penalized: each row's
    # sequence so far read back from the token pool and counted over the vocabulary, work no other step does)
    any_penalty: bool = False
    # tests only: with speculative decoding, drafts read from this [slots, positions] token table instead of the
    # drafter (right or wrong on purpose, so that every acceptance path runs)
    draft_table: Any = None
    # benchmarks only: each draft kept with this probability whatever it is (a coin per slot position and draft),
    # so a step's cost at a given acceptance can be measured with the real drafter where its drafts are never
    # right (random weights) or where bf16 rounding makes the verify step's choices differ from plain decoding's
    forced_acceptance: float | None = None

    def model(self, leaves):
        return nnx.merge(self.graphdef, jax.tree.unflatten(self.treedef, leaves))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SamplingState:
    """Per row: how to draw the next token. All [B]."""
    temperature: jax.Array  # f32, 0 = greedy
    top_p: jax.Array  # f32
    top_k: jax.Array  # int32, 0 = off
    seed: jax.Array  # int32
    sample_index: jax.Array  # int32, the request's position in its batch (part of the sampling key)
    token_index: jax.Array  # int32, index of the token to be sampled next
    min_p: jax.Array  # f32, 0 = off
    bias_ids: jax.Array  # [B, MAX_LOGIT_BIAS] int32, the tokens of the row's logit bias (-1 = none)
    bias: jax.Array  # [B, MAX_LOGIT_BIAS] f32, their biases
    stop_ids: jax.Array  # [B, MAX_STOP] int32, the tokens that end the row (-1 = none)
    min_tokens: jax.Array  # int32, the token index from which the stop ids may be drawn
    presence: jax.Array  # f32, presence penalty (0 = off)
    frequency: jax.Array  # f32, frequency penalty (0 = off)
    repetition: jax.Array  # f32, repetition penalty (1 = off)
    prompt_len: jax.Array  # int32, the row's prompt tokens (the output starts there)

    @staticmethod
    def neutral(n: int) -> "SamplingState":
        """n greedy rows of no filter, no bias, no stop ids and no penalty (host arrays): what rows no request
        fills hold."""
        z = lambda dt=np.int32: np.zeros(n, dt)  # noqa: E731
        return SamplingState(z(np.float32), np.ones(n, np.float32), z(), z(), z(), z(), z(np.float32),
                             np.full((n, MAX_LOGIT_BIAS), -1, np.int32), np.zeros((n, MAX_LOGIT_BIAS), np.float32),
                             np.full((n, MAX_STOP), -1, np.int32), z(), z(np.float32), z(np.float32),
                             np.ones(n, np.float32), z())

    def set_row(self, i: int, params, seed: int, sample_index: int, token_index: int,
                stop_ids: Sequence[int], prompt_len: int = 0) -> None:
        """Row i (of host arrays) from a request's SamplingParams, its sampling key's parts, its stop ids and its
        prompt's length."""
        self.temperature[i], self.top_p[i], self.top_k[i] = params.temperature, params.top_p, max(params.top_k, 0)
        self.presence[i], self.frequency[i] = params.presence_penalty, params.frequency_penalty
        self.repetition[i], self.prompt_len[i] = params.repetition_penalty, prompt_len
        self.seed[i], self.sample_index[i], self.token_index[i] = seed, sample_index, token_index
        self.min_p[i], self.min_tokens[i] = params.min_p, params.min_tokens
        self.stop_ids[i, :len(stop_ids)] = stop_ids
        if params.logit_bias:
            ids, vals = zip(*params.logit_bias)
            self.bias_ids[i, :len(ids)], self.bias[i, :len(ids)] = ids, vals


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DecodeState:
    """Per slot, what a decode call carries from step to step (and from one call to the next). Every slot, S =
    max_slots rows, whatever the call's B: a call updates its first B rows and passes the others on, so the state
    carries across calls of any B without a program per pair of sizes."""
    tokens: jax.Array  # [S] int32, the next token to feed
    pos: jax.Array  # [S] int32, its position (for an inactive slot: where its request stands)
    active: jax.Array  # [S] bool
    remaining: jax.Array  # [S] int32, tokens it may still generate
    sampling: SamplingState  # its stop ids too


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PrefillBatch:
    tokens: jax.Array  # [B, T] int32 (right-padded)
    start: jax.Array  # [B] int32, position of the first token
    n_valid: jax.Array  # [B] int32 (0: an empty row)
    fresh: jax.Array  # [B] bool, the request starts at position 0 (compressor state reset)
    slot: jax.Array  # [B] int32


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DecodeOutput:
    """What a decode call of B rows produced, row b for slot b."""
    tokens: jax.Array  # [B, k] int32 (-1 past a slot's last token)
    logprobs: jax.Array  # [B, k] f32
    n_out: jax.Array  # [B] int32, tokens each slot produced
    stopped: jax.Array  # [B] bool, ended on a stop token
    top_ids: jax.Array  # [B, k, N] int32, the N = spec.top_logprobs most likely tokens at each step (N may be 0)
    top_logprobs: jax.Array  # [B, k, N] f32
    # speculative decoding (else [B, 0] and zeros): per slot, its draft steps and how often each draft position
    # was accepted
    drafts: jax.Array  # [B] int32
    accepted: jax.Array  # [B, d] int32, d drafts a step


def _chosen(spec: StepSpec, logits, sm: SamplingState, pools, page_table, last):
    """What each row's token is chosen from: its logits [B, V] steered (the logit bias, the stop ids held back
    before min_tokens) and, in a step with penalties, penalized by its sequence so far: positions 0 .. last [B] of
    the token pool, read through the page table [B, pages]."""
    chosen = steered(logits, sm)
    if not spec.any_penalty:
        return chosen
    return apply_penalties(chosen, sm, *_pool_counts(spec, logits.shape[-1], sm, pools, page_table, last + 1))


def _pool_counts(spec: StepSpec, v: int, sm: SamplingState, pools, page_table, end):
    """token_counts of each row's positions 0 .. end - 1 [B] in the token pool, read through the page table."""
    p = spec.layout.page_size
    seq = pools.tokens[jnp.maximum(page_table, 0)].reshape(page_table.shape[0], -1)  # [B, pages * P]
    at = jnp.arange(seq.shape[1])[None, :]
    seen = (at < end[:, None]) & jnp.repeat(page_table >= 0, p, axis=1)
    return token_counts(v, seq, seen, seen & (at >= sm.prompt_len[:, None]))


def _write_tokens(spec: StepSpec, pools, token_ids, positions, ok, page_table):
    p = spec.layout.page_size
    col = positions % p
    page = jnp.take_along_axis(page_table, jnp.clip(positions // p, 0, page_table.shape[1] - 1), axis=1)
    flat = jnp.where(ok & (page >= 0), page * p + col, -1)
    tokens = set_rows(pools.tokens.reshape(-1), flat.reshape(-1), token_ids.reshape(-1))
    return dataclasses.replace(pools, tokens=tokens.reshape(pools.tokens.shape))


def _boundary_rows(spec: StepSpec, end, ok, swa_table):
    """Store row (the SWA page holding position end-1) for rows whose step ends on a full-page boundary, else an
    out-of-range row (no write)."""
    lay = spec.layout
    at = ok & (end > 0) & (end % lay.page_size == 0)
    j = jnp.clip((end - 1) // lay.swa_page_size, 0, swa_table.shape[1] - 1)
    page = jnp.take_along_axis(swa_table, j[:, None], axis=1)[:, 0]
    return jnp.where(at & (page >= 0), page, lay.n_swa_pages)


def _host_readable(spec: StepSpec, tree):
    """What the host reads, replicated on a mesh: every process then holds all of it (a process may only read
    the shards on its own devices)."""
    mr = spec.opts.mesh_rules
    return tree if mr is None else mr.replicate(tree)


def _placed(spec: StepSpec, pools, store):
    """Pools and store pinned to the shardings of their logical axes on a mesh: without this XLA propagates the
    layout of the step's activations into them (the compressor states came out split over `tensor`), and a step
    fed its own outputs would compile again for the new layout."""
    mr = spec.opts.mesh_rules
    if mr is None:
        return (C.pin_host(pools) if spec.layout.hot_rows else pools), store
    from v4jax.cache.boundary import store_shardings
    return jax.lax.with_sharding_constraint(
        (pools, store), (C.pool_shardings(pools, mr.sharding), store_shardings(store, mr.sharding)))


def _prefill(spec: StepSpec, leaves, pools, store, batch: PrefillBatch, page_table, swa_table, samp: SamplingState):
    t = batch.tokens.shape[1]
    meta = C.make_meta(spec.cfg, spec.layout, batch.start, batch.n_valid, batch.fresh, batch.slot, page_table,
                       swa_table, t)
    p = spec.layout.page_size
    ends = None
    if spec.save_boundaries and t >= 2 * p:  # a chunk with full-page boundaries inside: record their states too
        ends = inner_page_ends(batch.start, batch.n_valid, p, t)
        meta = dataclasses.replace(meta, page_ends=ends)
        pools = record_boundaries(pools, batch.tokens.shape[0], ends.shape[1])
    model = spec.model(leaves)
    drafter = _drafter(spec.cfg) if pools.draft is not None else None
    taps = None
    if drafter is not None and drafter.taps:
        streams, pools, taps = model.cached_streams(batch.tokens, meta, pools, spec.opts, taps=True)
    else:
        streams, pools = model.cached_streams(batch.tokens, meta, pools, spec.opts)
    logits = model.logits_from_streams(last_valid(streams, batch.n_valid))
    pools = _write_tokens(spec, pools, batch.tokens, meta.positions, jnp.arange(t)[None] < batch.n_valid[:, None],
                          page_table)
    if spec.save_boundaries:
        rows = _boundary_rows(spec, batch.start + batch.n_valid, batch.n_valid > 0, swa_table)
        store = save_boundary_states(store, pools, batch.slot, rows)
    if ends is not None:
        rows = _boundary_rows(spec, ends.reshape(-1), ends.reshape(-1) >= 0, jnp.repeat(swa_table, ends.shape[1], 0))
        store, pools = save_recorded_boundaries(store, pools, rows.reshape(ends.shape))
    last = batch.start + batch.n_valid - 1  # the chunk's last position: the sequence so far is in the pool
    tok, lp, top_ids, top_lp = sample(logits, _chosen(spec, logits, samp, pools, page_table, last), samp.temperature,
                                      samp.top_p, samp.top_k, samp.min_p, samp.seed, samp.sample_index,
                                      samp.token_index, spec.any_sampled, spec.top_logprobs, spec.any_cut)
    if drafter is not None:
        pools = drafter.prefill(model, spec.cfg, spec.layout, pools, streams, taps, batch, tok, page_table, swa_table,
                                spec.opts)
    return *_placed(spec, pools, store), *_host_readable(spec, (tok, lp, (top_ids, top_lp)))


def _drafter(cfg: ModelConfig):
    """The speculative drafter's hooks (v4jax.engine.spec.MTPDrafter's shape): the DSpark drafter for a config with
    dspark_* keys, else the MTP block (the load checks that the method fits the weights)."""
    return DS.DSPARK if cfg.dspark_block_size else SP.MTP


def early_exit() -> bool:
    """Whether a decode call stops once every slot has stopped. Not on GPU: XLA:GPU reads a data-dependent loop
    predicate on the host each step and waits (with the sampling branch and the short-row top-k fix-up, three
    such waits per step; without them the engine step at flash-slice batch 1 / 4K on the H200 went from 2.60 to
    1.79 ms). On CPU and TPU the predicate stays on the device, and the early exit saves the idle steps (CPU
    tests with a few tokens per request ran up to k times the steps)."""
    return jax.default_backend() != "gpu"


def _empty_output(spec: StepSpec, s: int) -> DecodeOutput:
    k, n_top = spec.decode_steps, spec.top_logprobs
    return DecodeOutput(tokens=jnp.zeros((s, k), jnp.int32), logprobs=jnp.zeros((s, k), jnp.float32),
                        n_out=jnp.zeros((s,), jnp.int32), stopped=jnp.zeros((s,), bool),
                        top_ids=jnp.zeros((s, k, n_top), jnp.int32), top_logprobs=jnp.zeros((s, k, n_top), jnp.float32),
                        drafts=jnp.zeros((s,), jnp.int32),
                        accepted=jnp.zeros((s, spec.layout.draft_tokens), jnp.int32))


# A plain decode step's per-row counters travel the loop as one [B, 7] int32 array, columns in _row's order: as seven
# arrays XLA:GPU updated each in a launch of its own (with the stop check's reduction, 12 launches a step of a
# few bytes each)
_TOKENS, _POS, _ACTIVE, _REMAINING, _TOKEN_INDEX, _N_OUT, _STOPPED = range(7)


def _row(tokens, pos, active, remaining, token_index, n_out, stopped):
    return jnp.stack([tokens, pos, active.astype(jnp.int32), remaining, token_index, n_out, stopped.astype(jnp.int32)],
                     axis=1)


def _row_state(row, state: DecodeState) -> DecodeState:
    """state with its per-row counters read from `row` (_row's columns)."""
    return DecodeState(tokens=row[:, _TOKENS], pos=row[:, _POS], active=row[:, _ACTIVE] > 0,
                       remaining=row[:, _REMAINING], sampling=dataclasses.replace(state.sampling,
                                                                                  token_index=row[:, _TOKEN_INDEX]))


def _decode(spec: StepSpec, leaves, pools, store, state: DecodeState, page_table, swa_table):
    """k steps of slots 0..B-1, B = the page tables' rows (a power of two covering every running slot; the engine's
    slot bucket). Only those slots' compressor states are read and written: a lone request in a 32-slot engine
    would otherwise run attention, the MoE (its idle rows' dummy tokens route to experts, whose weights are then
    read) and the compressors for every slot (flash-slice on the H200: 2.10 ms a step against ~1.7 ms on a
    1-slot engine). state: every slot's (DecodeState), its rows past B passed on as they are."""
    if spec.layout.draft_tokens:
        return _spec_decode(spec, leaves, pools, store, state, page_table, swa_table)
    model = spec.model(leaves)
    s, k = page_table.shape[0], spec.decode_steps
    rows = C.entry_rows(spec.cfg, spec.layout, page_table)  # the page tables are fixed for the whole call
    all_pools, all_state = pools, state
    if s < spec.layout.max_slots:
        # the call's slots' states, cut once per call (not per step), written back in place at the end
        pools, _ = _placed(spec, C.first_slots(pools, s), store)
        state = jax.tree.map(lambda a: a[:s], state)

    def body(i, carry):
        pools, store, row, wide, counted = carry
        st = _row_state(row, state)
        # slot None: row b is slot b, so the compressor states are read and updated in place (an index array
        # would make XLA gather and scatter every slot's state each step)
        meta = C.make_meta(spec.cfg, spec.layout, st.pos, st.active.astype(jnp.int32), jnp.zeros((s,), bool), None,
                           page_table, swa_table, 1, rows)
        logits, pools = model.cached(st.tokens[:, None], meta, pools, spec.opts)
        pools = _write_tokens(spec, pools, st.tokens[:, None], st.pos[:, None], st.active[:, None], page_table)
        if spec.save_boundaries:
            store = save_boundary_states(store, pools, None, _boundary_rows(spec, st.pos + 1, st.active, swa_table))
        sm = st.sampling
        chosen = steered(logits, sm)
        if spec.any_penalty:  # the fed token joins the counts of the sequence so far
            counted = count_token(*counted, st.tokens, st.active, st.pos >= sm.prompt_len)
            chosen = apply_penalties(chosen, sm, *counted)
        nxt, lp, top_ids, top_lp = sample(logits, chosen, sm.temperature, sm.top_p, sm.top_k, sm.min_p, sm.seed,
                                          sm.sample_index, sm.token_index, spec.any_sampled, spec.top_logprobs,
                                          spec.any_cut)
        # elementwise over the stop ids (not jnp.any's reduction), so it joins the row's update below
        is_stop = functools.reduce(jnp.logical_or, [nxt == sm.stop_ids[:, j] for j in range(sm.stop_ids.shape[1])])
        # column i written by dynamic_update_slice (i < k): `.at[:, i].set` adds a bounds check, a launch a step
        put = lambda a, v: jax.lax.dynamic_update_index_in_dim(a, v, i, axis=1)  # noqa: E731
        wide = DecodeOutput(tokens=put(wide.tokens, jnp.where(st.active, nxt, -1)), logprobs=put(wide.logprobs, lp),
                            n_out=wide.n_out, stopped=wide.stopped, top_ids=put(wide.top_ids, top_ids),
                            top_logprobs=put(wide.top_logprobs, top_lp), drafts=wide.drafts, accepted=wide.accepted)
        full = (st.remaining <= 1) | (st.pos + 2 >= spec.max_model_len)
        adv = st.active.astype(jnp.int32)
        row = _row(tokens=jnp.where(st.active, nxt, st.tokens), pos=st.pos + adv, active=st.active & ~is_stop & ~full,
                   remaining=st.remaining - adv, token_index=sm.token_index + adv, n_out=row[:, _N_OUT] + adv,
                   stopped=(row[:, _STOPPED] > 0) | (st.active & is_stop))
        return pools, store, row, wide, counted

    out = _empty_output(spec, s)
    # With penalties, each row's sequence is counted from the token pool once a call (its positions before the fed
    # token's), then a token a step: counted every step from the pool, a flash-slice call at batch 32 / 4K took
    # 0.76 ms a step more than without penalties (H100: 3.74 against 2.98 ms)
    counted = (_pool_counts(spec, spec.cfg.vocab_size, state.sampling, pools, page_table, state.pos)
               if spec.any_penalty else None)
    carry = (pools, store, _row(state.tokens, state.pos, state.active, state.remaining, state.sampling.token_index,
                                out.n_out, out.stopped), out, counted)
    if early_exit():
        _, carry = jax.lax.while_loop(lambda c: (c[0] < k) & jnp.any(c[1][2][:, _ACTIVE] > 0),
                                      lambda c: (c[0] + 1, body(c[0], c[1])), (0, carry))
    else:
        # A fixed trip count: the steps after every slot stopped change nothing (every write is masked by
        # `active`), and XLA:GPU runs the loop without reading a predicate on the host each step, so the call is
        # enqueued whole and the host's next call overlaps it. Every branch inside is device-side too.
        carry = jax.lax.fori_loop(0, k, body, carry)
    pools, store, row, out, _ = carry
    state = _row_state(row, state)
    out = dataclasses.replace(out, n_out=row[:, _N_OUT], stopped=row[:, _STOPPED] > 0)
    if s < spec.layout.max_slots:
        pools = C.put_first_slots(all_pools, pools)
        state = jax.tree.map(lambda a, b: jax.lax.dynamic_update_slice_in_dim(a, b, 0, axis=0), all_state, state)
    return *_placed(spec, pools, store), *_host_readable(spec, (out, state))


def _spec_decode(spec: StepSpec, leaves, pools, store, state: DecodeState, page_table, swa_table):
    """`_decode` with speculation (v4jax.engine.spec): each step drafts d tokens per slot (the MTP block, or the
    DSpark drafter: `_drafter`), verifies them in one step of d+1 query tokens and keeps 1 .. d+1 tokens. A call
    runs `spec_steps` = k // (d+1) such steps (k = decode_steps), so a slot gets at most k tokens, what the pages
    reserved for the call hold, and at least one a step until it stops or ends."""
    model, cfg, lay = spec.model(leaves), spec.cfg, spec.layout
    drafter = _drafter(cfg)
    s, k, d = page_table.shape[0], spec.decode_steps, lay.draft_tokens
    rows = C.entry_rows(cfg, lay, page_table)
    all_pools, all_state = pools, state
    if s < lay.max_slots:
        pools, _ = _placed(spec, C.first_slots(pools, s), store)
        state = jax.tree.map(lambda a: a[:s], state)
    pools = dataclasses.replace(pools, draft=drafter.cut(pools.draft, s))
    j = jnp.arange(d + 1)[None, :]
    table = None if spec.draft_table is None else jnp.asarray(spec.draft_table)[:s]

    def body(carry):
        pools, store, st, out = carry
        sm = st.sampling
        live = st.active & (out.n_out < k)
        greedy = sm.temperature <= 0
        drafts, q, dstate = drafter.propose(model, cfg, lay, pools.draft, st.tokens, st.pos, live, d, page_table,
                                            swa_table, rows, spec.opts, sm, spec.any_sampled, table, spec.any_cut)
        # verify the slot's next token and the drafts, the compressor states kept (SP.with_pending)
        fed = jnp.concatenate([st.tokens[:, None], drafts], axis=1)  # [s, d+1]
        meta = C.make_meta(cfg, lay, st.pos, live.astype(jnp.int32) * (d + 1), jnp.zeros((s,), bool), None,
                           page_table, swa_table, d + 1, rows)
        verified = model.cached_streams(fed, meta, SP.with_pending(pools, d + 1), spec.opts, taps=drafter.taps)
        streams, vpools, taps = verified if drafter.taps else (*verified, None)
        logits = model.logits_from_streams(streams)  # [s, d+1, V]
        # accept (greedy): the drafts up to the first the model would not have chosen, then the model's own token
        chosen = steered(logits, sm, j)  # what tokens are chosen from at each position (log-probs: raw)
        target = jnp.argmax(chosen, axis=-1).astype(jnp.int32)
        n_acc = jnp.sum(jnp.cumprod(drafts == target[:, :d], axis=1), axis=1)
        if spec.any_sampled:  # sampled rows: the rejection rule
            keys = SP.token_keys(sm, d + 1)
            p = jax.vmap(lambda lg: filtered_probs(lg, sm.temperature, sm.top_p, sm.top_k, sm.min_p, spec.any_cut),
                         1, 1)(chosen)
            u = jax.vmap(jax.vmap(jax.random.uniform))(SP.purpose(keys[:, :d], 2))
            n_smp, t_smp = SP.accept_sampled(p, q, drafts, u, SP.purpose(keys, 3))
            n_acc = jnp.where(greedy, n_acc, n_smp)
            target = jnp.where(greedy[:, None], target, t_smp)
        if spec.forced_acceptance is not None:  # benchmarks: the accepted drafts are emitted as the step's tokens
            # a coin per slot and position: drawn per position alone, every slot of a batch of equal prompts
            # saw the same few dozen coins (0.8 came out as 91 % kept on the H200)
            coins = jax.random.key(0)
            u = jax.vmap(lambda i, p: jax.random.uniform(jax.random.fold_in(jax.random.fold_in(coins, i), p), (d,)))(
                jnp.arange(s), st.pos)
            n_acc = jnp.sum(jnp.cumprod(u < spec.forced_acceptance, axis=1), axis=1).astype(n_acc.dtype)
            target = target.at[:, :d].set(jnp.where(j[:, :d] < n_acc[:, None], drafts, target[:, :d]))
        is_stop = jnp.any(target[:, :, None] == sm.stop_ids[:, None, :], axis=-1)  # [s, d+1]
        first_stop = jnp.min(jnp.where(is_stop, j, d + 1), axis=1)
        cap = jnp.maximum(1, jnp.minimum(jnp.minimum(k - out.n_out, st.remaining), spec.max_model_len - st.pos - 1))
        n = jnp.where(live, jnp.minimum(jnp.minimum(n_acc + 1, cap), first_stop + 1), 0)
        # commit
        kept = j < n[:, None]
        pools = SP.commit(cfg, vpools, st.pos, n)
        pools = _write_tokens(spec, pools, fed, meta.positions, kept, page_table)
        if spec.save_boundaries:
            p = lay.page_size
            to_boundary = (st.pos // p + 1) * p - st.pos
            at = live & (to_boundary <= n)
            store = save_boundary_states(store, SP.states_at(cfg, vpools, st.pos, jnp.where(at, to_boundary, 0)),
                                         None, _boundary_rows(spec, st.pos + to_boundary, at, swa_table))
        pools = dataclasses.replace(pools, draft=drafter.advance(model, cfg, lay, dstate, streams, taps, st.pos, n,
                                                                 live, target, page_table, swa_table, spec.opts))
        # outputs: token j of the step goes to column n_out + j
        all_lp = jax.nn.log_softmax(logits, axis=-1)
        lp = jnp.take_along_axis(all_lp, target[..., None], axis=-1)[..., 0]
        col = jnp.where(kept, out.n_out[:, None] + j, k)  # out of range: dropped
        b = jnp.arange(s)[:, None]
        top_lp, top_ids = top_alternatives(all_lp, spec.top_logprobs)
        stopped = live & (first_stop < n)
        drafting = live
        out = DecodeOutput(tokens=out.tokens.at[b, col].set(target, mode="drop"),
                           logprobs=out.logprobs.at[b, col].set(lp, mode="drop"), n_out=out.n_out + n,
                           stopped=out.stopped | stopped, top_ids=out.top_ids.at[b, col].set(top_ids, mode="drop"),
                           top_logprobs=out.top_logprobs.at[b, col].set(top_lp, mode="drop"),
                           drafts=out.drafts + drafting,
                           accepted=out.accepted + (drafting[:, None] & (j[:, :d] < n_acc[:, None])))
        pos, remaining = st.pos + n, st.remaining - n
        full = (remaining <= 0) | (pos + 1 >= spec.max_model_len)
        last = jnp.take_along_axis(target, jnp.maximum(n - 1, 0)[:, None], axis=1)[:, 0]
        st = DecodeState(tokens=jnp.where(live, last, st.tokens), pos=pos,
                         active=st.active & ~(live & (stopped | full)), remaining=remaining,
                         sampling=dataclasses.replace(sm, token_index=sm.token_index + n))
        return pools, store, st, out

    # A fixed number of steps: on the H200 (flash-slice, batch 1) a loop until every slot had its k tokens spent
    # 0.8 ms a token idle (2.29 ms a token at k = 1 against 1.5 ms of kernels): the GPU read the loop's predicate on
    # the host each step and then waited for the next step's launches (see early_exit).
    m = spec_steps(k, d)
    carry = (pools, store, state, _empty_output(spec, s))
    if early_exit():
        _, carry = jax.lax.while_loop(lambda c: (c[0] < m) & jnp.any(c[1][2].active & (c[1][3].n_out < k)),
                                      lambda c: (c[0] + 1, body(c[1])), (0, carry))
    else:
        carry = jax.lax.fori_loop(0, m, lambda i, c: body(c), carry)
    pools, store, state, out = carry
    if s < lay.max_slots:
        pools = C.put_first_slots(all_pools, dataclasses.replace(pools, draft=drafter.put(all_pools.draft,
                                                                                          pools.draft)))
        state = jax.tree.map(lambda a, b: jax.lax.dynamic_update_slice_in_dim(a, b, 0, axis=0), all_state, state)
    return *_placed(spec, pools, store), *_host_readable(spec, (out, state))


def spec_steps(k: int, d: int) -> int:
    """Speculative steps in a decode call of k tokens a slot with d drafts a step: as many as fit k tokens when
    every draft is kept (speculative_tokens checks d + 1 <= k)."""
    return max(1, k // (d + 1))


def _carry(prev: DecodeState, fresh: DecodeState, carried):
    """Slots still decoding the request of the previous call continue from its device-side state."""
    pick = lambda a, b: jnp.where(carried.reshape(carried.shape + (1,) * (a.ndim - 1)), a, b)
    return jax.tree.map(pick, prev, fresh)


def single_device() -> jax.sharding.SingleDeviceSharding:
    """The placement of an engine's arrays without a mesh: committed to the default device's own memory. With host
    offload the placement of every argument is part of a step's signature, and a step's outputs come back
    committed: an argument first passed uncommitted (a fresh array) compiled the step again at its second call
    (seconds of a stall, on the GPU 6-16 s a program)."""
    dev = jax.devices()[0]
    return jax.sharding.SingleDeviceSharding(dev, memory_kind=dev.default_memory().kind)


@dataclasses.dataclass(frozen=True)
class JittedSteps:
    """The steps jitted for one engine: its compiled programs live and die with it (one process may build many
    engines; programs cached at module level would never be freed)."""
    prefill: Any
    decode: Any
    carry: Any
    restore: Any

    @staticmethod
    def make(mesh_rules=None) -> "JittedSteps":
        # On a mesh the decode state lives replicated on the mesh's devices from its first merge on (its inputs
        # are host arrays then: without out_shardings it would land on one local device). On one device it is
        # committed there from the first merge on, as the decode's own outputs are (single_device).
        carry_out = single_device() if mesh_rules is None else mesh_rules.replicated
        return JittedSteps(prefill=jax.jit(_prefill, static_argnums=0, donate_argnums=(2, 3)),
                           decode=jax.jit(_decode, static_argnums=0, donate_argnums=(2, 3)),
                           carry=jax.jit(_carry, out_shardings=carry_out),
                           restore=jax.jit(restore_slot_states, donate_argnums=0))



_STEP_NAMES = {n for f in (_prefill, _decode) for n in (f.__name__, f"jit({f.__name__})")}
_compiled = {"programs": 0, "seconds": 0.0, "background": 0}
_counting = threading.Lock()


def _count_compile(event: str, secs: float, *, fun_name: str = "", **kwargs) -> None:
    if event == "/jax/core/compile/backend_compile_duration" and fun_name in _STEP_NAMES:
        with _counting:
            _compiled["programs"] += 1
            _compiled["seconds"] += secs
            _compiled["background"] += in_background()


jax.monitoring.register_event_duration_secs_listener(_count_compile)


def compiled_programs(*, background: bool = False) -> int:
    """Prefill and decode programs compiled (or loaded from the persistent cache) in this process so far: JAX's
    backend-compile event, which an ahead-of-time compile (warm-up) and a call's own compile both send.
    `background`: only those compiled on the background threads (v4jax.engine.programs)."""
    return _compiled["background" if background else "programs"]


def compile_seconds() -> float:
    """The seconds those compiles (or cache loads) took, summed over the threads that ran them."""
    return _compiled["seconds"]
