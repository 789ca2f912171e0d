"""The one source of pool shapes and bytes: page sizes, how many pages of each kind an engine holds, and what
they cost. The memory report, admission, the replay budget and the server's fit check all read it."""
from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np

from v4jax.cache.boundary import init_boundary_store, store_bytes
from v4jax.cache.pools import PoolLayout, init_pools, pool_bytes
from v4jax.config import ModelConfig


_NAMED_ITEMSIZE = {"bf16": 2, "bfloat16": 2, "f32": 4, "float32": 4, "fp32": 4}


def full_page_size(cfg: ModelConfig, requested: int | None = None) -> int:
    """P: the requested page size (default 256) rounded up to a multiple of every compression ratio."""
    return -(-(requested or 256) // cfg.lcm_ratio()) * cfg.lcm_ratio()


def page_multiple(cfg: ModelConfig, page_size: int, dtype=None) -> int:
    """Full pages come in multiples of this, so that every compressed pool holds whole TPU HBM tiles of rows (32
    bytes of rows: 8 f32 / 16 bf16 rows): the TPU kernels DMA whole tiles, and a pool ending mid-tile is padded,
    i.e. copied, on every call (the HCA pool of 2 rows per Flash page needs 8 pages)."""
    itemsize = 2 if dtype is None else _NAMED_ITEMSIZE.get(dtype) or np.dtype(dtype).itemsize
    tile = 32 // itemsize
    mult = 1
    for m in cfg.ratios_in_use:
        mult = math.lcm(mult, tile // math.gcd(tile, page_size // m))
    return mult


def engine_layout(cfg: ModelConfig, page_size: int | None = None, max_num_seqs: int = 8, prefill_chunk: int = 256,
                  decode_steps: int = 8, data_shards: int = 1) -> tuple[int, int, int]:
    """(P, Ps, SWA pages) of the paged layout. Over `data_shards` shards (the mesh's `data` axis) each shard holds
    max_num_seqs / data_shards slots and its own SWA pages for them."""
    p = full_page_size(cfg, page_size)
    ps = math.gcd(p, 64)
    # Per decoding slot a window plus 2k tokens (the scheduler dispatches the next k-step call before the host
    # has read how far the current one got), plus one prefill chunk for the one request prefilling (per shard:
    # each shard's SWA pages serve its own slots only).
    slots = -(-max_num_seqs // data_shards)
    n_swa = slots * (-(-(cfg.window_size + 2 * decode_steps) // ps) + 1) + -(-prefill_chunk // ps) + 1
    return p, ps, data_shards * n_swa


def pool_cost(cfg: ModelConfig, dtype, p: int, ps: int, n_swa: int, slots: int, caching: bool) -> tuple[int, int]:
    """(fixed bytes, bytes per full page) of the engine's pools over the whole mesh, from the pools' own shapes:
    the window pages, compressor states and (caching) boundary store are fixed; each full page adds its rows of
    the token and compressed pools."""
    def total(n_pages):
        lay = PoolLayout(page_size=p, swa_page_size=ps, n_pages=n_pages, n_swa_pages=n_swa, max_slots=slots,
                         max_pages_per_seq=1, max_swa_pages_per_seq=1)
        pools = jax.eval_shape(lambda: init_pools(cfg, lay, dtype))
        extra = store_bytes(jax.eval_shape(lambda: init_boundary_store(pools, n_swa))) if caching else 0
        return sum(pool_bytes(pools).values()) + extra
    one, two = total(1), total(2)
    return one - (two - one), two - one


def pool_layout(cfg: ModelConfig, options, dtype, max_model_len: int, n_data: int = 1, n_ctx: int = 1) -> PoolLayout:
    """The engine's pool layout for these options over a mesh of `n_data` x `n_ctx` (data, context) shards: page
    sizes, SWA pages per shard, full pages (every slot's whole context, or what memory_budget_bytes holds; in
    whole TPU tiles in every block)."""
    slots = options.max_num_seqs
    dense = options.kv_layout == "dense"
    caching = options.enable_prefix_caching and not dense
    p, ps, n_swa = engine_layout(cfg, options.page_size, slots, options.prefill_chunk, options.decode_steps, n_data)
    if caching:
        # window tails the prefix cache may keep (LRU beyond that): four per slot
        n_swa += 4 * slots * (-(-cfg.window_size // ps) + 1)
    max_pages = -(-max_model_len // p)
    max_swa = -(-max_model_len // ps)
    n_blocks = n_data * n_ctx  # full pages per block: what one device of a (data, context) pair holds
    if dense:
        n_pages, n_swa = n_blocks * (slots // n_data) * -(-max_pages // n_ctx), slots * max_swa
    else:
        mult = math.lcm(page_multiple(cfg, p, dtype), n_blocks)  # whole TPU tiles in every block
        n_pages = -(-slots * max_pages // mult) * mult
        budget = options.memory_budget_bytes
        if budget:
            fixed, per_page = pool_cost(cfg, dtype, p, ps, n_swa, slots, caching)
            n_pages = int((budget - fixed) // per_page)
            if n_pages < 1:
                raise ValueError(f"memory_budget_bytes={budget} is below the fixed pools ({fixed} bytes: window "
                                 f"and compressor state for {slots} slots) plus one page ({per_page} bytes)")
            if n_pages < n_blocks:
                raise ValueError(f"memory_budget_bytes={budget} holds {n_pages} full pages: fewer than one per "
                                 f"block of the mesh's data x context ({n_blocks})")
            n_pages -= n_pages % (mult if n_pages >= mult else n_blocks)
    return PoolLayout(page_size=p, swa_page_size=ps, n_pages=n_pages, n_swa_pages=n_swa, max_slots=slots,
                      max_pages_per_seq=max_pages, max_swa_pages_per_seq=max_swa, data_shards=n_data,
                      context_shards=n_ctx)


@dataclasses.dataclass(frozen=True)
class PoolSize:
    """One pool's size: `units` pages (or slots) of `unit_bytes` each, over the whole mesh."""
    units: int
    unit_bytes: int
    unit: str  # what one unit is: "256 tokens", "slot"

    @property
    def bytes(self) -> int:
        return self.units * self.unit_bytes


def pool_sizes(cfg: ModelConfig, layout: PoolLayout, dtype, caching: bool) -> dict[str, PoolSize]:
    """Every pool an engine with this layout holds, by the names of `stats()["pools"]`, read off the pools' own
    shapes (init_pools under eval_shape): `swa` (window pages; with the prefix cache, each page's boundary-state
    row rides in it), `c4_kv`, `c4_index`, `c128_kv` (full pages: the rows of one page in every layer of that
    kind), `tokens` (full pages), `compressor_state` (slots). The sum is exactly what the engine allocates."""
    pools = jax.eval_shape(lambda: init_pools(cfg, layout, dtype))
    nbytes = lambda a: 0 if a is None else a.size * a.dtype.itemsize
    full = {"c4_kv": 0, "c4_index": 0, "c128_kv": 0}
    swa = state = 0
    for lp in pools.stacks:
        swa += nbytes(lp.swa)
        state += sum(nbytes(getattr(lp, f)) for f in ("state_kv", "state_score", "idx_state_kv", "idx_state_score"))
        if lp.idx is not None:
            full["c4_kv"] += nbytes(lp.kv)
            full["c4_index"] += nbytes(lp.idx)
        elif lp.kv is not None:
            full["c128_kv"] += nbytes(lp.kv)
    if caching:
        swa += store_bytes(jax.eval_shape(lambda: init_boundary_store(pools, layout.n_swa_pages)))
    page = f"{layout.page_size} tokens"
    out = {"swa": PoolSize(layout.n_swa_pages, swa // layout.n_swa_pages, f"{layout.swa_page_size} tokens")}
    for name, b in full.items():
        if b:
            out[name] = PoolSize(layout.n_pages, b // layout.n_pages, page)
    out["tokens"] = PoolSize(layout.n_pages, nbytes(pools.tokens) // layout.n_pages, page)
    out["compressor_state"] = PoolSize(layout.max_slots, state // layout.max_slots, "slot")
    return out
