"""The pool pytree (device side): every byte of per-request state lives in these arrays.

Pools (DESIGN §4), one `LayerPool` per layer stack (`config.layer_stacks`: the layers of one shape, the model's
parameter stacks), every array stacked on a leading axis of the stack's n layers, rows flat per layer so that
any layout turns into row ids:
  tokens       [n_pages, P]               int32  token ids of every full page (the prefix tree keys on these)
  swa          [n, n_swa_pages * Ps, K]          raw token KV of the window; small pages of Ps tokens
  kv           [n, n_pages * P/m, K]             compressed entries (C4 on CSA layers, C128 on HCA layers)
  idx          [n, n_pages * P/m, Ki]            C4 indexer keys (CSA layers)
With kv_cache_dtype="fp8" these three are uint8 rows of the release's formats (pallas_kernels.kv_format): K is
then the FP8 entry's bytes (584 for Flash), Ki the FP4 key's (68); the model encodes what it writes and decodes
what it reads.
  state_*      [n, slots, C*m, C*K]       f32    compressor partial windows, per slot (never shared)
Layer N of the model is `pools.stacks[g]` at index i, (g, i) = `layer_stacks(cfg).where[N]` (`layer_pool`).
A full page of P tokens addresses its rows of every compressed pool by arithmetic: entry e of ratio m lives
on full page (e*m)//P at row page*(P/m) + e % (P/m). One page table serves every compressed pool (and every
layer: the row ids are the same in each layer of a stack).
The dense layout is the same pytree with a fixed identity page table (one contiguous span per slot)."""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from sharding.rules import POOL_AXES
from v4jax.config import CSA, SLIDING, ModelConfig, layer_stacks

F32 = jnp.float32
FP8 = "fp8"  # the pools' dtype under kv_cache_dtype="fp8" (init_pools)

LOGICAL_AXES = POOL_AXES  # pool field -> logical axis names of its dims (sharding/rules.py maps names to mesh axes)


def pool_shardings(pools: "KVPools", sharding_of) -> "KVPools":
    """The same tree with each array's sharding, `sharding_of(logical axes, shape)` (sharding.MeshRules.sharding)
    applied to LOGICAL_AXES by field; pools may be abstract (jax.eval_shape)."""
    def one(name, arr):
        return None if arr is None else sharding_of(LOGICAL_AXES[name], arr.shape)

    stacks = tuple(dataclasses.replace(lp, **{f.name: one(f.name, getattr(lp, f.name)) for f in dataclasses.fields(lp)})
                   for lp in pools.stacks)
    draft = pools.draft
    if draft is not None:  # the drafter's window rows as the window pool's; its per-slot fields over the slots
        per_slot = lambda a: None if a is None else sharding_of(("slots",) + (None,) * (a.ndim - 1), a.shape)
        draft = DraftState(swa=one("swa", draft.swa), hidden=per_slot(draft.hidden), start=per_slot(draft.start),
                           count=per_slot(draft.count), tokens=per_slot(draft.tokens))
    return dataclasses.replace(pools, tokens=one("tokens", pools.tokens), stacks=stacks, draft=draft)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LayerPool:
    """The pools of one layer stack; every array has a leading axis of the stack's n layers."""
    swa: jax.Array  # [n, R_swa, K]
    kv: jax.Array | None = None  # [n, R_m, K]
    idx: jax.Array | None = None  # [n, R_m, Ki]
    state_kv: jax.Array | None = None  # [n, slots, C*m, C*K] f32
    state_score: jax.Array | None = None
    idx_state_kv: jax.Array | None = None  # [n, slots, 2m, 2Ki] f32
    idx_state_score: jax.Array | None = None
    # Set only inside a speculative verify step (v4jax.engine.spec): each compressor's inputs (a, z) of the step's
    # tokens [n, B, T, C*K] f32, written instead of new states, which stay as they were until the accepted tokens
    # are known and folded in (v4jax.model.attention.pending_of names the state each one belongs to).
    pending_kv: jax.Array | None = None
    pending_score: jax.Array | None = None
    idx_pending_kv: jax.Array | None = None
    idx_pending_score: jax.Array | None = None
    # Set only inside a prefill step of the prefix cache (v4jax.cache.boundary.record_boundaries): on CSA stacks,
    # each compressor's inputs (a, z) at the m positions before each full-page boundary inside the chunk
    # (StepMeta.page_ends) [n, B, NB*m, C*K] f32: the previous window that boundary's saved state holds.
    boundary_kv: jax.Array | None = None
    boundary_score: jax.Array | None = None
    idx_boundary_kv: jax.Array | None = None
    idx_boundary_score: jax.Array | None = None
    # Host offload of `kv` on CSA stacks (enable_hisparse, v4jax.model.offload): `kv` then lives in host memory and
    # these hold the device's hot copies of some of its rows, their table and LRU state, and the counters.
    kv_hot: jax.Array | None = None  # [n, H, K]
    hot_table: jax.Array | None = None  # [n, R_m] int32: kv row -> hot row (-1: not resident)
    hot_owner: jax.Array | None = None  # [n, H] int32: hot row -> kv row (-1: none)
    hot_used: jax.Array | None = None  # [n, H] int32: last layer step that read it
    hot_clock: jax.Array | None = None  # [n] int32
    hot_counts: jax.Array | None = None  # [n, 2, F] int32 (offload.COUNTERS)

    def hot_rows(self) -> dict | None:
        """The offload state as v4jax.model.offload takes it (None: `kv` on the device)."""
        if self.kv_hot is None:
            return None
        return {f: getattr(self, HOT_FIELDS[f]) for f in HOT_FIELDS}


# v4jax.model.offload.COUNTERS (the cache does not import the model; a test checks they agree)
HOT_COUNTERS = ("selected", "hits", "fetched_rows", "transferred_rows", "overflow")
# offload's names -> LayerPool fields
HOT_FIELDS = {"hot": "kv_hot", "table": "hot_table", "owner": "hot_owner", "used": "hot_used", "clock": "hot_clock",
              "counts": "hot_counts"}


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DraftState:
    """The drafter's state (speculative decoding). Its window KV lives in rows of the SWA pool's shape, addressed
    by the same SWA page ids (so a page's main and drafter window rows come and go together). The MTP block's: its
    window, and per slot the main model's final streams at the positions the drafter has not been fed yet (the MTP
    block at position i reads the main streams at i and token i+1), at most k+1 of them (one verify step's). The
    DSpark drafter's: one window ring of keys per draft layer, nothing per slot (v4jax.engine.dspark)."""
    swa: jax.Array  # [1, R_swa, K] (MTP) | [n_stages, R_swa, head_dim] (DSpark, the model's dtype)
    hidden: jax.Array | None = None  # [slots, k+1, N, D]: main streams at positions start .. start+count-1
    start: jax.Array | None = None  # [slots] int32
    count: jax.Array | None = None  # [slots] int32 (0: none)
    tokens: jax.Array | None = None  # [slots, k+1] int32: the token after each of those positions


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVPools:
    tokens: jax.Array  # [n_pages, P] int32
    stacks: tuple  # LayerPool per layer stack (config.layer_stacks(cfg).stacks)
    draft: DraftState | None = None  # with speculative decoding (PoolLayout.draft_tokens > 0)

    def layer_pool(self, cfg: ModelConfig, layer: int) -> LayerPool:
        """Main layer `layer`'s pools (views of its stack's arrays at its index), e.g. for tests and reports."""
        g, i = layer_stacks(cfg).where[layer]
        lp = self.stacks[g]
        return LayerPool(**{f.name: None if getattr(lp, f.name) is None else getattr(lp, f.name)[i]
                            for f in dataclasses.fields(lp)})


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class StepMeta:
    """Per-token metadata of one step, computed on device from (slot, start, page tables).
    B rows (slots), T tokens per row, U = W - 1 + T window-union rows, S_m entries per ratio m."""
    positions: jax.Array  # [B, T] int32
    start: jax.Array  # [B] int32, position of the row's first token
    n_valid: jax.Array  # [B] int32, valid tokens of the row (rest is padding)
    fresh: jax.Array  # [B] bool, the request starts at this step (compressor state reset)
    slot: jax.Array | None  # [B] int32, compressor-state index of the row; None: row b is slot b (decode)
    swa_write: jax.Array  # [B, T] int32 rows of the SWA pool to write (out of range = drop)
    win_rows: jax.Array  # [B, U] int32 SWA rows of positions start-W+1 .. start+T-1 (-1 = none)
    win_pos: jax.Array  # [B, U] int32 those positions
    entry_rows: dict  # ratio m -> [B, S_m] int32 row of entry e in the ratio's pools (-1 = none)
    # [B, NB] int32: full-page boundaries inside a prefill chunk whose CSA state the step records (-1 = none);
    # set with the pools' boundary_* records (v4jax.cache.boundary.record_boundaries)
    page_ends: jax.Array | None = None


@dataclasses.dataclass(frozen=True)
class PoolLayout:
    """Static sizes of the pools."""
    page_size: int  # P, tokens per full page
    swa_page_size: int  # Ps
    n_pages: int
    n_swa_pages: int
    max_slots: int
    max_pages_per_seq: int
    max_swa_pages_per_seq: int
    # The mesh's `data` and `context` sizes: full pages form data_shards x context_shards blocks, SWA pages and
    # slots data_shards blocks (the contract: v4jax.cache.pages.PageTables)
    data_shards: int = 1
    context_shards: int = 1
    draft_tokens: int = 0  # k, drafts per speculative step (0: no drafter state)
    # enable_hisparse: rows of the device's hot buffer per CSA layer (0: the C4 KV pool on the device)
    hot_rows: int = 0


def init_pools(cfg: ModelConfig, layout: PoolLayout, dtype) -> KVPools:
    """Zero pools. dtype: the entries' dtype, or "fp8" (kv_cache_dtype="fp8"): uint8 rows of the release's
    formats, FP8 entries in `swa` and `kv` (cfg.fp8_entry_bytes), FP4 keys in `idx` (cfg.fp4_key_bytes)."""
    p = layout.page_size
    k, ki = cfg.head_dim, cfg.index_head_dim
    model_dtype = dtype
    if isinstance(dtype, str) and dtype == FP8:
        dtype, k, ki = jnp.uint8, cfg.fp8_entry_bytes, cfg.fp4_key_bytes
        model_dtype = jnp.bfloat16
    stacks = []
    for stack in layer_stacks(cfg).stacks:
        n, kind, m = len(stack.layers), stack.kind, stack.ratio
        swa = jnp.zeros((n, layout.n_swa_pages * layout.swa_page_size, k), dtype)
        if kind == SLIDING:
            stacks.append(LayerPool(swa=swa))
            continue
        coff = 2 if kind == CSA else 1
        rows = layout.n_pages * (p // m)
        st = lambda d: (jnp.zeros((n, layout.max_slots, coff * m, coff * d), F32),
                        jnp.full((n, layout.max_slots, coff * m, coff * d), -jnp.inf, F32))
        skv, ssc = st(cfg.head_dim)
        lp = LayerPool(swa=swa, kv=jnp.zeros((n, rows, k), dtype), state_kv=skv, state_score=ssc)
        if kind == CSA:
            ikv, isc = st(cfg.index_head_dim)
            lp = dataclasses.replace(lp, idx=jnp.zeros((n, rows, ki), dtype),
                                     idx_state_kv=ikv, idx_state_score=isc)
            if layout.hot_rows:
                h = layout.hot_rows
                lp = dataclasses.replace(
                    lp, kv_hot=jnp.zeros((n, h, k), dtype), hot_table=jnp.full((n, rows), -1, jnp.int32),
                    hot_owner=jnp.full((n, h), -1, jnp.int32), hot_used=jnp.full((n, h), -1, jnp.int32),
                    hot_clock=jnp.zeros((n,), jnp.int32), hot_counts=jnp.zeros((n, 2, len(HOT_COUNTERS)), jnp.int32))
        stacks.append(lp)
    draft = None
    if layout.draft_tokens:
        r = layout.n_swa_pages * layout.swa_page_size
        if cfg.dspark_block_size:  # the DSpark drafter's window rings (v4jax.engine.dspark), in the model's dtype
            draft = DraftState(swa=jnp.zeros((cfg.n_mtp_layers, r, cfg.head_dim), model_dtype))
        else:
            n, slots, t = cfg.hc_mult, layout.max_slots, layout.draft_tokens + 1
            draft = DraftState(swa=jnp.zeros((1, r, k), dtype), hidden=jnp.zeros((slots, t, n, cfg.dim), dtype),
                               start=jnp.zeros((slots,), jnp.int32), count=jnp.zeros((slots,), jnp.int32),
                               tokens=jnp.zeros((slots, t), jnp.int32))
    return KVPools(tokens=jnp.zeros((layout.n_pages, p), jnp.int32), stacks=tuple(stacks), draft=draft)


def pin_host(pools: KVPools) -> KVPools:
    """The offloaded pools (`kv` of the stacks with a hot buffer) in host memory: inside a jitted step, so that its
    outputs stay there; outside, to place them after init_pools."""
    return dataclasses.replace(pools, stacks=tuple(
        lp if lp.kv_hot is None else dataclasses.replace(lp, kv=jax.device_put(lp.kv, _host_place(lp.kv)))
        for lp in pools.stacks))


def hot_counts(pools: KVPools) -> dict | None:
    """Host side: the offload counters (HOT_COUNTERS) summed over every CSA layer, as ints (None: no offload).
    Stored as a low 24-bit word and the rest (v4jax.model.offload.add_counts)."""
    import numpy as np
    arrays = [np.asarray(lp.hot_counts).astype(np.int64) for lp in pools.stacks if lp.hot_counts is not None]
    if not arrays:
        return None
    tot = sum((a[:, 0] + (a[:, 1] << 24)).sum(axis=0) for a in arrays)
    return {name: int(v) for name, v in zip(HOT_COUNTERS, tot)}


def _host_place(arr):
    if isinstance(arr, jax.core.Tracer):
        return jax.memory.Space.Host
    return arr.sharding.with_memory_kind("pinned_host")


# The per-slot arrays [n, slots, ...] (the compressor states): the pools a decode call may cut to its rows.
SLOT_FIELDS = tuple(name for name, axes in LOGICAL_AXES.items() if axes[1:2] == ("slots",))


def first_slots(pools: KVPools, n: int) -> KVPools:
    """The pools with every per-slot array cut to slots [0, n) (the others as they are): a decode call of n rows
    runs on these, so the slots past its rows are neither read nor written."""
    def cut(a):
        return a if a is None or a.shape[1] == n else jax.lax.slice_in_dim(a, 0, n, axis=1)

    return dataclasses.replace(pools, stacks=tuple(
        dataclasses.replace(lp, **{f: cut(getattr(lp, f)) for f in SLOT_FIELDS}) for lp in pools.stacks))


def put_first_slots(pools: KVPools, part: KVPools) -> KVPools:
    """`part` (first_slots(pools, n) after a step wrote it) back into `pools`: part's per-slot arrays written over
    slots [0, n) in place (a dynamic_update_slice of a donated buffer), the others taken from part whole."""
    def put(a, b):
        if a is None or a.shape == b.shape:
            return b
        return jax.lax.dynamic_update_slice_in_dim(a, b, 0, axis=1)

    stacks = tuple(dataclasses.replace(new, **{f: put(getattr(old, f), getattr(new, f)) for f in SLOT_FIELDS})
                   for old, new in zip(pools.stacks, part.stacks))
    return dataclasses.replace(part, stacks=stacks)


def entry_rows(cfg: ModelConfig, layout: PoolLayout, page_table) -> dict:
    """ratio m -> [B, NP * P/m] row of each compressed entry in the ratio's pools (-1 where no page)."""
    out = {}
    for m in cfg.ratios_in_use:
        per_page = layout.page_size // m
        e = jnp.arange(page_table.shape[1] * per_page)
        page = page_table[:, e // per_page]
        out[m] = jnp.where(page >= 0, page * per_page + (e % per_page)[None, :], -1)
    return out


def make_meta(cfg: ModelConfig, layout: PoolLayout, start, n_valid, fresh, slot, page_table, swa_table,
              t: int, rows: dict | None = None) -> StepMeta:
    """Device-side: rows to read and write for B rows of T tokens, from each row's page tables.
    page_table [B, NP] (full pages, -1 = none), swa_table [B, NS] (SWA pages by logical index pos // Ps);
    `rows`: entry_rows(page_table) when the caller already has them (a decode loop computes them once)."""
    ps, w = layout.swa_page_size, cfg.window_size
    positions = start[:, None] + jnp.arange(t)[None, :]
    tok_ok = jnp.arange(t)[None, :] < n_valid[:, None]

    def swa_row(pos):
        lp = jnp.clip(pos // ps, 0, swa_table.shape[1] - 1)
        page = jnp.take_along_axis(swa_table, lp, axis=1)
        ok = (pos >= 0) & (pos // ps < swa_table.shape[1]) & (page >= 0)
        return jnp.where(ok, page * ps + pos % ps, -1)

    swa_rows_all = layout.n_swa_pages * ps
    swa_write = jnp.where(tok_ok, swa_row(positions), swa_rows_all)
    swa_write = jnp.where(swa_write < 0, swa_rows_all, swa_write)
    win_pos = start[:, None] - (w - 1) + jnp.arange(w - 1 + t)[None, :]
    win_rows = swa_row(win_pos)
    return StepMeta(positions=positions, start=start, n_valid=n_valid, fresh=fresh, slot=slot,
                    swa_write=swa_write, win_rows=win_rows, win_pos=win_pos,
                    entry_rows=entry_rows(cfg, layout, page_table) if rows is None else rows)


def pool_bytes(tree: Any) -> dict[str, int]:
    """Bytes held by each pool kind across layers."""
    out: dict[str, int] = {}
    for lp in tree.stacks:
        for f in dataclasses.fields(lp):
            arr = getattr(lp, f.name)
            if arr is not None:
                out[f.name] = out.get(f.name, 0) + arr.size * arr.dtype.itemsize
    out["tokens"] = tree.tokens.size * tree.tokens.dtype.itemsize
    if tree.draft is not None:
        for f in dataclasses.fields(tree.draft):
            arr = getattr(tree.draft, f.name)
            out[f"draft_{f.name}"] = arr.size * arr.dtype.itemsize
    return out
