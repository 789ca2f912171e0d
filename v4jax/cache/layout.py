"""The one source of pool shapes and bytes: page sizes, how many pages of each kind an engine holds, what they
cost and how they split over a mesh. The engine (`pool_layout`), admission (memory_budget_bytes), the memory report
and the fit check before an engine is built (v4jax.memory), and the replay budget all read it."""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from v4jax.cache.boundary import LOGICAL_AXES as BOUNDARY_AXES, init_boundary_store
from v4jax.cache.pools import FP8, LOGICAL_AXES, PoolLayout, init_pools
from v4jax.config import CSA, KV_CACHE_DTYPES, ModelConfig


_DTYPE_NAMES = {"bf16": "bfloat16", "f32": "float32", "fp32": "float32"}  # the memory report's names
_NAMED_ITEMSIZE = {"bf16": 2, "bfloat16": 2, "f32": 4, "float32": 4, "fp32": 4, FP8: 1}
# The pools that grow by full pages (the rest: SWA pages with their boundary rows, per-slot compressor state)
FULL_PAGE_POOLS = ("c4_kv", "c4_index", "c128_kv", "tokens")


def kv_cache_dtype(kv_cache_dtype: str, model_dtype):
    """The pools' dtype (init_pools) for the option `kv_cache_dtype`: "auto" = the model's dtype, "bfloat16", or
    "fp8" (the release's FP8 entries and FP4 indexer keys, stored as bytes)."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
    return {"auto": model_dtype, "bfloat16": jnp.bfloat16, "fp8": FP8}[kv_cache_dtype]


def mesh_shards(mesh) -> tuple[int, int]:
    """(data, context) sizes of a mesh spec: "data=2,context=2,tensor=2", {"data": 2}, or None (1, 1)."""
    from sharding.rules import parse_mesh_spec
    shape = parse_mesh_spec(mesh)
    return int(shape.get("data", 1)), int(shape.get("context", 1))


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


def pool_cost(cfg: ModelConfig, layout: PoolLayout, dtype, caching: bool) -> tuple[int, int]:
    """(fixed bytes, bytes per full page) of the engine's device pools over the whole mesh (pool_sizes): the window
    pages (with their boundary rows when caching), the compressor states and an offloaded pool's hot buffer are
    fixed; each full page adds its rows of the token and compressed pools (with host offload, the C4 KV's rows on
    the host do not count: memory_budget_bytes is device memory)."""
    sizes = pool_sizes(cfg, layout, dtype, caching)
    per_page = sum(sizes[k].unit_bytes - sizes[k].host_unit_bytes for k in FULL_PAGE_POOLS if k in sizes)
    fixed = sum(s.bytes - s.host_bytes for k, s in sizes.items() if k not in FULL_PAGE_POOLS)
    fixed += sum(s.fixed_bytes for k, s in sizes.items() if k in FULL_PAGE_POOLS)
    return fixed, per_page


def hot_rows_needed(cfg: ModelConfig, options) -> int:
    """Rows of the C4 KV's hot buffer (per CSA layer) that one query token of every row of a step may select at
    most, so that a block of query tokens' selections is resident at once (v4jax.model.offload; a prefill chunk
    attends in blocks of tokens that fit): max_num_seqs (a step's rows) x index_topk."""
    return options.max_num_seqs * cfg.index_topk


HOT_STEPS = 4  # the default hot buffer holds this many decode steps' selections


def hot_buffer_rows(cfg: ModelConfig, options, page_size: int, max_model_len: int) -> int:
    """enable_hisparse: the hot buffer's rows per CSA layer (hisparse_device_pages pages of P/4 entries; default:
    four decode steps' selections, HOT_STEPS x hot_rows_needed, in whole pages); checks that the option can work
    here, an error naming it otherwise. 0 when off."""
    if not options.enable_hisparse:
        if options.hisparse_device_pages is not None:
            raise ValueError("hisparse_device_pages is set but enable_hisparse is off")
        return 0
    if options.kv_layout == "dense":
        raise ValueError("enable_hisparse needs kv_layout='paged' (the dense layout has no page tables)")
    if options.mesh:
        # the host rows and the hot buffer would be split over the mesh's devices, and the fetch run per shard
        # inside the attention's shard_map: not built
        raise ValueError(f"enable_hisparse keeps one device's C4 KV pool in host memory: mesh={options.mesh!r} is "
                         "not supported with it (leave out mesh, or enable_hisparse)")
    if CSA not in cfg.layer_types:
        raise ValueError("enable_hisparse: this model has no CSA layers (ratio 4), so no C4 KV pool to offload")
    per_page = page_size // 4
    need = hot_rows_needed(cfg, options)
    pages = options.hisparse_device_pages
    if pages is None:
        return -(-HOT_STEPS * need // per_page) * per_page
    if pages * per_page < need:
        raise ValueError(
            f"hisparse_device_pages={pages} holds {pages * per_page} C4 entries per layer; one decode step may "
            f"select {need} (max_num_seqs={options.max_num_seqs} x index_topk={cfg.index_topk}): use at least "
            f"{-(-need // per_page)} pages")
    return pages * per_page


def pool_layout(cfg: ModelConfig, options, dtype, max_model_len: int, n_data: int = 1, n_ctx: int = 1) -> PoolLayout:
    """The engine's pool layout for these options over a mesh of `n_data` x `n_ctx` (data, context) shards: page
    sizes, SWA pages per shard, full pages (every slot's whole context, or what memory_budget_bytes holds; in
    whole TPU tiles in every block). `options`: an api.EngineOptions (or anything with its fields)."""
    slots = options.max_num_seqs
    if slots % n_data:
        raise ValueError(f"max_num_seqs={slots} does not split over the mesh's data={n_data} (each data shard "
                         f"holds max_num_seqs / {n_data} slots): use a multiple of {n_data}")
    dense = options.kv_layout == "dense"
    caching = options.enable_prefix_caching and not dense
    p, ps, n_swa = engine_layout(cfg, options.page_size, slots, min(options.prefill_chunk, max_model_len),
                                 options.decode_steps, n_data)
    if caching:
        # window tails the prefix cache may keep (LRU beyond that): four per slot
        n_swa += 4 * slots * (-(-cfg.window_size // ps) + 1)
    max_pages = -(-max_model_len // p)
    max_swa = -(-max_model_len // ps)
    hot = hot_buffer_rows(cfg, options, p, max_model_len)
    n_blocks = n_data * n_ctx  # full pages per block: what one device of a (data, context) pair holds
    if dense:
        n_pages, n_swa = n_blocks * (slots // n_data) * -(-max_pages // n_ctx), slots * max_swa
    else:
        mult = math.lcm(page_multiple(cfg, p, dtype), n_blocks)  # whole TPU tiles in every block
        n_pages = -(-slots * max_pages // mult) * mult
        budget = options.memory_budget_bytes
        if budget:
            fixed, per_page = pool_cost(cfg, PoolLayout(page_size=p, swa_page_size=ps, n_pages=n_blocks,
                                                        n_swa_pages=n_swa, max_slots=slots, max_pages_per_seq=1,
                                                        max_swa_pages_per_seq=1,
                                                        draft_tokens=options.num_speculative_tokens, hot_rows=hot),
                                        dtype, caching)
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
                      context_shards=n_ctx, draft_tokens=options.num_speculative_tokens, hot_rows=hot)


@dataclasses.dataclass(frozen=True)
class PoolSize:
    """One pool's size: `units` pages (or slots) of `unit_bytes` each, over the whole mesh; `device_bytes` of it
    on one device of the mesh (device_split)."""
    units: int
    unit_bytes: int
    unit: str  # what one unit is: "256 tokens", "slot"
    device_bytes: int | None = None  # None: all of it but host_bytes (one device)
    # host offload (enable_hisparse, the C4 KV): the part of each unit held in host memory, and the device bytes
    # that do not grow with the units (the hot buffer)
    host_unit_bytes: int = 0
    fixed_bytes: int = 0

    def __post_init__(self):
        if self.device_bytes is None:
            object.__setattr__(self, "device_bytes", self.bytes - self.host_bytes)

    @property
    def bytes(self) -> int:
        return self.units * self.unit_bytes + self.fixed_bytes

    @property
    def host_bytes(self) -> int:
        return self.units * self.host_unit_bytes


def device_split(logical: tuple, shape: tuple, layout: PoolLayout) -> int:
    """How many ways the engine splits one pool array (its logical axes, v4jax.cache.LOGICAL_AXES or the boundary
    store's) over a mesh of the layout's `data` x `context` (sharding.rules.spec_for, the table the engine places
    pools by): per-slot compressor state, SWA pages and boundary rows over `data`; full pages (token ids, every
    compressed pool) over `data` x `context` (v4jax.cache.pages.PageTables); the mesh's `tensor` and `expert` axes
    hold copies. A dimension the axes do not divide stays whole."""
    if layout.data_shards == layout.context_shards == 1:
        return 1
    from sharding.rules import split_factor
    return split_factor(logical, shape, {"data": layout.data_shards, "context": layout.context_shards})


def pool_sizes(cfg: ModelConfig, layout: PoolLayout, dtype, caching: bool) -> dict[str, PoolSize]:
    """Every pool an engine with this layout holds, by the names of `stats()["pools"]`, read off the pools' own
    shapes (init_pools under eval_shape): `swa` (window pages; with the prefix cache, each page's boundary-state
    row rides in it), `c4_kv`, `c4_index`, `c128_kv` (full pages: the rows of one page in every layer of that
    kind), `tokens` (full pages), `compressor_state` (slots). The sum is exactly what the engine allocates; each
    pool's `device_bytes` what one device of its mesh holds (device_split)."""
    dtype = _DTYPE_NAMES.get(dtype, dtype) if isinstance(dtype, str) else dtype
    pools = jax.eval_shape(lambda: init_pools(cfg, layout, dtype))
    hot_fixed, host_rows = [], []  # with host offload: the C4 KV's device-only arrays, and its host pool
    arrays = {k: [] for k in ("swa", "c4_kv", "c4_index", "c128_kv", "tokens", "compressor_state", "mtp_swa",
                              "draft_state")}
    for lp in pools.stacks:
        arrays["swa"].append(("swa", lp.swa))
        for f in ("state_kv", "state_score", "idx_state_kv", "idx_state_score"):
            arrays["compressor_state"].append((f, getattr(lp, f)))
        if lp.idx is not None:
            arrays["c4_kv"].append(("kv", lp.kv))
            arrays["c4_index"].append(("idx", lp.idx))
            if lp.kv_hot is not None:
                arrays["c4_kv"].append(("hot_table", lp.hot_table))
                hot_fixed += [getattr(lp, f) for f in ("kv_hot", "hot_owner", "hot_used", "hot_clock", "hot_counts")]
                host_rows += [lp.kv]
        elif lp.kv is not None:
            arrays["c128_kv"].append(("kv", lp.kv))
    arrays["tokens"].append(("tokens", pools.tokens))
    logical = dict(LOGICAL_AXES)
    if pools.draft is not None:  # the MTP layer's window (its own pool) and the drafter's per-slot streams
        arrays["mtp_swa"].append(("swa", pools.draft.swa))
        for f in ("hidden", "start", "count", "tokens"):
            a = getattr(pools.draft, f)
            arrays["draft_state"].append((f"draft_{f}", a))
            if a is not None:
                logical[f"draft_{f}"] = ("slots",) + (None,) * (a.ndim - 1)
    if caching:
        store = jax.eval_shape(lambda: init_boundary_store(pools, layout.n_swa_pages))
        logical["boundary"] = BOUNDARY_AXES
        arrays["swa"] += [("boundary", a) for d in store.layers if d is not None for a in d.values()]

    def nbytes(name):
        return sum(a.size * a.dtype.itemsize for _, a in arrays[name] if a is not None)

    def device_bytes(name):
        return sum(a.size * a.dtype.itemsize // device_split(logical[f], a.shape, layout)
                   for f, a in arrays[name] if a is not None)

    page = f"{layout.page_size} tokens"
    units = {"swa": layout.n_swa_pages, "mtp_swa": layout.n_swa_pages, "compressor_state": layout.max_slots,
             "draft_state": layout.max_slots}
    unit = {"swa": f"{layout.swa_page_size} tokens", "mtp_swa": f"{layout.swa_page_size} tokens",
            "compressor_state": "slot", "draft_state": "slot"}
    out = {}
    for name in arrays:
        b = nbytes(name)
        if b or name in ("swa", "tokens", "compressor_state"):
            n = units.get(name, layout.n_pages)
            out[name] = PoolSize(n, b // n, unit.get(name, page), device_bytes(name))
    if host_rows:  # one device (hot_buffer_rows)
        fixed = sum(a.size * a.dtype.itemsize for a in hot_fixed)
        host = sum(a.size * a.dtype.itemsize for a in host_rows)
        c4 = out["c4_kv"]
        out["c4_kv"] = PoolSize(c4.units, c4.unit_bytes, c4.unit, c4.bytes + fixed - host,
                                host_unit_bytes=host // c4.units, fixed_bytes=fixed)
    return out
