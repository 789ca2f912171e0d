"""Speculative decoding: the option, the MTP block's drafter, the rejection rule and the exact rollback (shared by
the DSpark drafter, v4jax.engine.dspark).

A speculative step of a decode call (v4jax.engine.steps, `_spec_decode`), per slot, all on the device:
  draft    the MTP block at the positions it has not seen (the main streams of the last verify step's accepted
           tokens, with the token after each), then k-1 more steps on its own output streams: k draft tokens
  verify   the main model over the slot's next token and the k drafts (k+1 query tokens, one `cached` step)
  accept   greedy rows: the drafts up to the first that differs from the model's own choice, plus the model's
           token after them (1 .. k+1 tokens); sampled rows: the standard rejection rule (`accept_sampled`), so their
           tokens are distributed exactly as plain sampling's, with keys from (seed, request, token index) as a
           plain step's, so a seeded request is reproducible
  commit   what the accepted tokens wrote is kept and what the rejected ones wrote is undone or never read

What the rejected tokens touched and why each is exact:
  - window KV (SWA rows), compressed entries (C4, C128), indexer keys, the MTP block's window: written by position
    (or entry index), read only by queries at later positions. A rejected token's rows lie at positions past the
    accepted end, in the request's own pages (compressed windows never straddle a full page, and full pages are
    shared only once complete), so the next step writes them again before any query reads them; a row past the
    pages reserved for the call is dropped.
  - token coordinates: written for the accepted tokens only.
  - compressor partial states (main, indexer, HCA; the CSA overlap halves): one state per slot, which a closed
    window shifts (CSA) or a wrapped one overwrites (HCA). The verify step leaves them as they were and records
    each compressor's inputs (a, z) of its k+1 tokens instead; the commit folds the accepted ones in with the same
    `compress_chunk` a prefill chunk uses. Bytes, Flash per slot and token of the step: the inputs are
    (2x1024 + 2x256) x 4 B per CSA layer and 2x512 x 4 B per HCA layer, 0.3 MB over its 41 compressed layers;
    keeping a state per position instead would copy the whole state k+1 times (an HCA state alone is
    128 x 512 x 2 x 4 B = 512 KB a layer, 12 MB a slot in all), and recomputing the accepted tokens would run the
    model again. The fold reads the old state once, as a plain decode token's update does.
  - the prefix cache's boundary states: a full-page boundary crossed inside the accepted tokens gets the CSA
    states folded to exactly that boundary, saved as a plain decode step ending there saves them.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from v4jax import cache as C
from v4jax.config import CSA, ModelConfig, layer_stacks
from v4jax.engine.sampling import filtered_probs, request_key, steered
from v4jax.fields import FieldError, is_int
from v4jax.model import layers as L
from v4jax.model.attention import pending_of

METHODS = ("mtp", "dspark")
MAX_SPECULATIVE_TOKENS = 15
_STATES = ("state_kv", "state_score", "idx_state_kv", "idx_state_score")


def speculative_method(config) -> str | None:
    """The method of a `speculative_config` that speculative_tokens accepted ("mtp" | "dspark"), None for None."""
    return None if config is None else config["method"]


def speculative_tokens(config, decode_steps: int) -> int:
    """k of `speculative_config` ({"method": "mtp" | "dspark", "num_speculative_tokens": k}, vLLM's shape), or 0
    for None; a FieldError naming the option for anything else (what the checkpoint's drafter allows is checked
    at load)."""
    if config is None:
        return 0
    name = "speculative_config"
    if not isinstance(config, dict):
        raise FieldError(name, f"{name} must be a dict such as {{'method': 'mtp', 'num_speculative_tokens': 3}}, "
                               f"got {config!r}")
    unknown = sorted(set(config) - {"method", "num_speculative_tokens"})
    if unknown:
        raise FieldError(name, f"{name}: unknown key(s) {unknown}; known: ['method', 'num_speculative_tokens']")
    method = config.get("method")
    if method not in METHODS:
        raise FieldError(name, f"{name}: method must be one of {list(METHODS)}, got {method!r}")
    k = config.get("num_speculative_tokens")
    if not is_int(k) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
        raise FieldError(name, f"{name}: num_speculative_tokens must be an integer in [1, {MAX_SPECULATIVE_TOKENS}]"
                               f", got {k!r}")
    if k + 1 > decode_steps:
        raise FieldError(name, f"{name}: num_speculative_tokens={k} needs decode_steps >= {k + 1} (a decode call "
                               f"emits at most decode_steps={decode_steps} tokens a slot, a step up to k+1)")
    return int(k)


# ---- the compressor states: verify leaves them, commit folds the accepted tokens in ----
def with_pending(pools: C.KVPools, t: int) -> C.KVPools:
    """The pools of a verify step of t tokens a row: every compressed stack gets zeroed input records
    [n, B, t, C*K] (B = the per-slot arrays' slots), which tell its compressors to keep their states."""
    stacks = []
    for lp in pools.stacks:
        upd = {}
        for name in _STATES:
            st = getattr(lp, name)
            if st is not None:
                upd[pending_of(name)] = jnp.zeros(st.shape[:2] + (t, st.shape[-1]), jnp.float32)
        stacks.append(dataclasses.replace(lp, **upd))
    return dataclasses.replace(pools, stacks=tuple(stacks))


def _fold(cfg: ModelConfig, pools: C.KVPools, start, n, csa_only: bool) -> list[dict]:
    """Per stack, the compressor states after the first n [B] recorded tokens (from position start [B]) folded
    into the states they had before the verify step ({} for stacks without states, or not CSA with csa_only)."""
    out = []
    for lp, st in zip(pools.stacks, layer_stacks(cfg).stacks):
        new = {}
        if lp.state_kv is not None and (st.kind == CSA or not csa_only):
            overlap = st.kind == CSA
            for kv_name, sc_name in (("state_kv", "state_score"), ("idx_state_kv", "idx_state_score")):
                if getattr(lp, kv_name) is None:
                    continue

                def one(kv, sc, a, z):
                    return L.compress_chunk(kv, sc, a, z, start, n, jnp.zeros_like(start, bool), st.ratio,
                                            overlap)[3:]

                kv, sc = (getattr(lp, f) for f in (kv_name, sc_name))
                nkv, nsc = jax.vmap(one)(kv, sc, getattr(lp, pending_of(kv_name)), getattr(lp, pending_of(sc_name)))
                keep = (n > 0)[None, :, None, None]
                new[kv_name], new[sc_name] = jnp.where(keep, nkv, kv), jnp.where(keep, nsc, sc)
        out.append(new)
    return out


def commit(cfg: ModelConfig, pools: C.KVPools, start, n) -> C.KVPools:
    """The pools after a verify step whose first n [B] tokens (from start [B]) are accepted: states folded, the
    records dropped."""
    folded = _fold(cfg, pools, start, n, csa_only=False)
    drop = {pending_of(name): None for name in _STATES}
    return dataclasses.replace(pools, stacks=tuple(dataclasses.replace(lp, **new, **drop)
                                                   for lp, new in zip(pools.stacks, folded)))


def states_at(cfg: ModelConfig, pools: C.KVPools, start, n) -> C.KVPools:
    """The pools with the CSA stacks' states as they stand after the first n [B] recorded tokens (what a
    full-page boundary inside the accepted tokens saves); the other stacks as they are."""
    folded = _fold(cfg, pools, start, n, csa_only=True)
    return dataclasses.replace(pools, stacks=tuple(dataclasses.replace(lp, **new)
                                                   for lp, new in zip(pools.stacks, folded)))


# ---- the drafter ----
def prefill_drafter(model, cfg, layout, pools: C.KVPools, streams, batch, sampled, page_table, swa_table, opts):
    """The MTP block over a prefill chunk (its window KV at the chunk's positions), and each row's drafter state:
    the main streams of its last position, whose next token is the sampled one (or the next chunk's first).
    streams [B, T, N, D]: the main model's final streams of the chunk; sampled [B]: each row's sampled token.

    The MTP block at position i reads the main streams at i and token i+1: in a chunk from s, positions s-1 (with
    the streams the slot kept from its previous chunk, when it has them) to s+n-2."""
    d = pools.draft
    slot, start, n_valid = batch.slot, batch.start, batch.n_valid
    count = d.count[slot]  # out-of-range slots (empty rows) read a clamped one, masked below
    carried = (n_valid > 0) & ~batch.fresh & (count > 0) & (d.start[slot] + count == start)
    kept = jnp.take_along_axis(d.hidden[slot], jnp.maximum(count - 1, 0)[:, None, None, None], axis=1)
    c4 = carried[:, None, None, None]
    hidden = jnp.where(c4, jnp.concatenate([kept, streams[:, :-1]], axis=1), streams)
    nxt = jnp.where(carried[:, None], batch.tokens,
                    jnp.concatenate([batch.tokens[:, 1:], jnp.zeros_like(batch.tokens[:, :1])], axis=1))
    c = carried.astype(jnp.int32)
    t = batch.tokens.shape[1]
    meta = C.make_meta(cfg, layout, start - c, jnp.maximum(n_valid - 1 + c, 0), batch.fresh, slot, page_table,
                       swa_table, t)
    _, mpool = model.mtp_cached(hidden, nxt, meta, C.LayerPool(swa=d.swa), opts)
    at = jnp.where(n_valid > 0, slot, d.count.shape[0])  # empty rows write nothing
    last = jnp.take_along_axis(streams, jnp.maximum(n_valid - 1, 0)[:, None, None, None], axis=1)
    return dataclasses.replace(pools, draft=C.DraftState(
        swa=mpool.swa,
        hidden=d.hidden.at[at, :1].set(last.astype(d.hidden.dtype), mode="drop"),
        start=d.start.at[at].set(start + n_valid - 1, mode="drop"),
        count=d.count.at[at].set(1, mode="drop"),
        tokens=d.tokens.at[at, 0].set(sampled, mode="drop")))


def token_keys(sm, n: int):
    """[B, n] sampling keys of each row's next n tokens: request_key(seed, request position, token index + j)."""
    ti = sm.token_index[:, None] + jnp.arange(n)[None, :]
    return jax.vmap(jax.vmap(request_key, (None, None, 0)), (0, 0, 0))(sm.seed, sm.sample_index, ti)


def purpose(keys, i: int):
    """Independent keys for one use of a token's key (1: its draft, 2: its acceptance, 3: its correction)."""
    return jax.vmap(jax.vmap(lambda key: jax.random.fold_in(key, i)))(keys)


def proposal(logits, sm, keys, sampled: bool, ahead: int, cut: bool = True):
    """A draft token [B] from the MTP block's logits [B, V] for the token `ahead` of each row's next, and its
    distribution [B, V] (None if no row samples): greedy rows take the argmax, sampled rows draw from the logits
    filtered as their own sampling filters them (steered first, as the target's). cut: whether some sampled row
    cuts by top-k / top-p (the step's form, sampling.kept)."""
    logits = steered(logits, sm, ahead)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if not sampled:
        return greedy, None
    q = filtered_probs(logits, sm.temperature, sm.top_p, sm.top_k, sm.min_p, cut)
    drawn = jax.vmap(jax.random.categorical)(keys, jnp.log(q)).astype(jnp.int32)
    return jnp.where(sm.temperature > 0, drawn, greedy), q


def accept_sampled(p, q, drafts, u, keys):
    """The standard rejection rule (lossless: the tokens kept are distributed as the target's own samples, whatever
    the drafts). p [B, k+1, V]: the target's distributions at the k+1 verified positions; q [B, k, V]: the
    drafter's, drafts [B, k] drawn from them; u [B, k] uniform in [0, 1); keys [B, k+1]: the key of the token
    drawn after the accepted drafts. Draft j is kept while u_j < p_j(d_j) / q_j(d_j); at the first rejected j the
    token is drawn from max(p_j - q_j, 0) (normalised), and after k kept drafts from p_k. Returns (drafts kept [B],
    tokens [B, k+1]: the kept drafts, then the drawn token)."""
    b, k = drafts.shape
    pd = jnp.take_along_axis(p[:, :k], drafts[..., None], axis=-1)[..., 0]
    qd = jnp.take_along_axis(q, drafts[..., None], axis=-1)[..., 0]
    n = jnp.sum(jnp.cumprod(u * qd < pd, axis=1), axis=1)
    rows = jnp.arange(b)
    pn = p[rows, n]
    residual = jnp.maximum(pn - jnp.concatenate([q, jnp.zeros_like(q[:, :1])], axis=1)[rows, n], 0.0)
    dist = jnp.where(jnp.sum(residual, -1, keepdims=True) > 0, residual, pn)
    drawn = jax.vmap(jax.random.categorical)(keys[rows, n], jnp.log(dist)).astype(jnp.int32)
    tokens = jnp.concatenate([drafts, jnp.zeros_like(drafts[:, :1])], axis=1).at[rows, n].set(drawn)
    return n, tokens


@dataclasses.dataclass(frozen=True)
class MTPDrafter:
    """The MTP block's hooks into the speculative decode call (v4jax.engine.steps; v4jax.engine.dspark has the
    DSpark drafter's)."""
    taps = False  # the verify step's final streams are all it reads

    @staticmethod
    def cut(d, s):
        """The state of slots [0, s) (a decode call's rows)."""
        return dataclasses.replace(d, hidden=d.hidden[:s], start=d.start[:s], count=d.count[:s], tokens=d.tokens[:s])

    @staticmethod
    def put(whole, part):
        """`part` (cut, then advanced) back into `whole`."""
        put = lambda a, b: jax.lax.dynamic_update_slice_in_dim(a, b, 0, axis=0)
        return dataclasses.replace(part, hidden=put(whole.hidden, part.hidden), start=put(whole.start, part.start),
                                   count=put(whole.count, part.count), tokens=put(whole.tokens, part.tokens))

    @staticmethod
    def prefill(model, cfg, layout, pools, streams, taps, batch, sampled, page_table, swa_table, opts):
        return prefill_drafter(model, cfg, layout, pools, streams, batch, sampled, page_table, swa_table, opts)

    @staticmethod
    def propose(model, cfg, layout, d, tokens, pos, live, k, page_table, swa_table, rows, opts, sm, sampled,
                table=None, cut=True):
        drafts, q, swa = draft(model, cfg, layout, d, pos, live, k, page_table, swa_table, rows, opts, sm, sampled,
                               table, cut)
        return drafts, q, dataclasses.replace(d, swa=swa)

    @staticmethod
    def advance(model, cfg, layout, d, streams, taps, pos, n, live, target, page_table, swa_table, opts):
        """The drafter state after a verify step that kept n [B] tokens from pos: the main streams of the step's
        positions and the token after each (the MTP block reads them at the next draft)."""
        l4 = live[:, None, None, None]
        return C.DraftState(swa=d.swa, hidden=jnp.where(l4, streams.astype(d.hidden.dtype), d.hidden),
                            start=jnp.where(live, pos, d.start), count=jnp.where(live, n, d.count),
                            tokens=jnp.where(live[:, None], target, d.tokens))


MTP = MTPDrafter()


def draft(model, cfg, layout, d: C.DraftState, pos, live, k: int, page_table, swa_table, rows, opts, sm,
          sampled: bool, table=None, cut: bool = True):
    """k draft tokens [B, k] per row (slot b = row b) whose next token sits at position pos [B]: the MTP block over
    the positions it has not seen (its drafter state: the main streams up to pos-1), then k-1 steps on its own
    output streams and drafts. Rows not `live` write nothing. Greedy rows draft the argmax, sampled rows draw from
    the MTP block's distribution filtered as their sampling filters (sm: their SamplingState). Returns (drafts,
    their distributions [B, k, V] (None unless `sampled`), the MTP window pool swa).
    table: tests only, [B, max positions] tokens to draft instead (drafts of position p+1.. read table[b, p+1..]).
    cut: as `proposal`'s."""
    t = d.hidden.shape[1]
    mpool = C.LayerPool(swa=d.swa)
    ok = live & (d.count > 0) & (d.start + d.count == pos)
    n = jnp.where(ok, d.count, 0)
    meta = C.make_meta(cfg, layout, d.start, n, jnp.zeros_like(live), None, page_table, swa_table, t, rows)
    y, mpool = model.mtp_cached(d.hidden, d.tokens, meta, mpool, opts)
    y = jnp.take_along_axis(y, jnp.maximum(n - 1, 0)[:, None, None, None], axis=1)[:, 0]
    keys = purpose(token_keys(sm, k), 1) if sampled else jnp.zeros((live.shape[0], k), jnp.uint32)
    first, q0 = proposal(model.mtp_head(y), sm, keys[:, 0], sampled, 0, cut)

    def step(carry, i):
        y, tok, swa = carry
        meta = C.make_meta(cfg, layout, pos + i, live.astype(jnp.int32), jnp.zeros_like(live), None, page_table,
                           swa_table, 1, rows)
        y, p = model.mtp_cached(y[:, None], tok[:, None], meta, C.LayerPool(swa=swa), opts)
        y = y[:, 0]
        tok, q = proposal(model.mtp_head(y), sm, jnp.take(keys, i + 1, axis=1), sampled, i + 1, cut)
        return (y, tok, p.swa), (tok, q)

    swa = mpool.swa
    drafts, qs = first[:, None], None if q0 is None else q0[:, None]
    if k > 1:
        (_, _, swa), (more, q_more) = jax.lax.scan(step, (y, first, swa), jnp.arange(k - 1, dtype=jnp.int32))
        drafts = jnp.concatenate([drafts, more.T], axis=1)
        if sampled:
            qs = jnp.concatenate([qs, jnp.moveaxis(q_more, 0, 1)], axis=1)
    if table is not None:
        at = jnp.clip(pos[:, None] + 1 + jnp.arange(k)[None, :], 0, table.shape[1] - 1)
        drafts = jnp.take_along_axis(table, at, axis=1)
        if sampled:  # forced drafts count as drawn from a point mass: the rule stays lossless
            qs = jax.nn.one_hot(drafts, qs.shape[-1], dtype=qs.dtype)
    return drafts, qs, swa
