"""Memory report: bytes of every pool kind, per context token and per request, for any ModelConfig.

Formats (entry layouts):
  "bf16"  every entry in bf16, as the official buffers hold them (reference deepseek_v4_architecture.md §4.3):
          main KV entry head_dim * 2 B (1024 B), indexer key index_head_dim * 2 B (256 B).
  "f32"   the same in float32 (what an engine run with dtype="float32" allocates).
  "fp8"   vLLM / SGLang / FlashMLA "MODEL1 FP8" (reference serving_systems.md §1.1): main entry = nope dims in
          e4m3 (448 B) + rope dims in bf16 (64 x 2 = 128 B) + one ue8m0 scale byte per 64 nope dims (7 B) padded
          to a multiple of 8 B = 584 B; indexer key = index_head_dim e4m3 bytes + one fp32 scale = 132 B.
  "fp4"   as "fp8" but MXFP4 indexer keys: index_head_dim / 2 + a ue8m0 scale per 32 dims = 68 B. What an engine
          with kv_cache_dtype="fp8" allocates (the byte layouts: pallas_kernels.kv_format).
The window (SWA) entry has the main entry's format. Compressor partial state is float32 in every format.
Token ids are int32 (4 B per token) and are reported apart from the KV figure, which (like both references)
excludes them.

Pool kinds (names used in every dict below):
  swa          window ring, `window_size` entries per layer and request (constant per request)
  csa_kv       C4 (CSA) compressed entries, 1 per `ratio` tokens per CSA layer
  csa_index    C4 indexer keys, 1 per `ratio` tokens per CSA layer
  hca_kv       C128 (HCA) compressed entries, 1 per `ratio` tokens per HCA layer
  state        compressor partial state per request: CSA main [2m, 2K] kv + score, its indexer [2m, 2Ki] kv + score,
               HCA [m, K] kv + score, all float32
  tokens       token ids, int32
The MTP layer (a sliding layer in the released models) is counted apart, under `mtp`.

The report above is analytical: bytes per context token and per request in any format, including those the
engine does not allocate yet (FP8 / FP4). What an engine allocates comes from its own layout, never from these
formulas: `engine_pools` reads v4jax.cache.layout (`pool_layout`: pages and slots for the engine's options,
`pool_sizes`: every pool's bytes off its shapes, over the whole mesh and on one device of it), so the memory
command, the fit check (`check_engine_fits`) and admission (memory_budget_bytes) agree with the engine to the byte.
`decode_read_bytes` is reference serving_systems.md §1.2: what one decode step must read per sequence.
`param_bytes` / `decode_weight_bytes` count the weights (the roofline of v4jax.bench), in the model dtype or as the
release stores them (FP8 linears, FP4 routed experts: a quant.WeightFormat); `weight_stats` a model's own.
`device_memory_bytes`, `model_weight_bytes` / `weight_bytes_per_device` / `weight_bytes_on_mesh` and the
`check_*_fit` functions compare what a model and its pools need with what a device holds, before allocating.
"""
from __future__ import annotations

import dataclasses
import math
import os

from v4jax.cache.layout import (FULL_PAGE_POOLS, PoolLayout, PoolSize, kv_cache_dtype, mesh_shards, pool_cost,
                                pool_layout, pool_sizes)
from v4jax.config import CSA, HCA, SLIDING, ModelConfig

FORMATS = ("bf16", "f32", "fp8", "fp4")
_ALIASES = {"bfloat16": "bf16", "float32": "f32", "fp32": "f32", "fp8-fp4idx": "fp4"}
KINDS = ("swa", "csa_kv", "csa_index", "hca_kv", "state", "tokens")
TOKEN_ID_BYTES = 4
STATE_BYTES = 4  # compressor partial state is float32
GiB = 1 << 30
MiB = 1 << 20


def _fmt(fmt: str) -> str:
    f = _ALIASES.get(fmt, fmt)
    if f not in FORMATS:
        raise ValueError(f"format {fmt!r}: expected one of {FORMATS}")
    return f


def main_entry_bytes(cfg: ModelConfig, fmt: str = "bf16") -> int:
    """Bytes of one main KV entry (window, C4 or C128): 1024 bf16 / 584 FP8 for head_dim 512, rope 64."""
    f = _fmt(fmt)
    if f == "bf16":
        return 2 * cfg.head_dim
    if f == "f32":
        return 4 * cfg.head_dim
    return cfg.fp8_entry_bytes  # e4m3 nope + bf16 rope + ue8m0 scale per 64 nope dims + pad (583 -> 584)


def index_key_bytes(cfg: ModelConfig, fmt: str = "bf16") -> int:
    """Bytes of one C4 indexer key: 256 bf16 / 132 FP8 (128 + fp32 scale) / 68 FP4 (64 + a ue8m0 scale per 32)."""
    f = _fmt(fmt)
    d = cfg.index_head_dim
    return {"bf16": 2 * d, "f32": 4 * d, "fp8": d + 4, "fp4": cfg.fp4_key_bytes}[f]


def _layers(cfg: ModelConfig, mtp: bool = False) -> list[tuple[str, int]]:
    """(kind, ratio) of the main layers, or of the MTP layers."""
    if mtp:
        return [(cfg.mtp_layer_type, cfg.mtp_compress_ratio)] * cfg.n_mtp_layers
    return list(zip(cfg.layer_types, cfg.compress_ratios))


def _per_token(cfg: ModelConfig, layers, fmt: str) -> dict[str, float]:
    main, idx = main_entry_bytes(cfg, fmt), index_key_bytes(cfg, fmt)
    out = {"csa_kv": 0.0, "csa_index": 0.0, "hca_kv": 0.0}
    for kind, m in layers:
        if kind == CSA:
            out["csa_kv"] += main / m
            out["csa_index"] += idx / m
        elif kind == HCA:
            out["hca_kv"] += main / m
    return out


def compressor_state_bytes(cfg: ModelConfig, kind: str, ratio: int) -> dict[str, int]:
    """Per request and layer, float32 kv + score: CSA main 2 x [2m, 2K] (64 KiB), its indexer 2 x [2m, 2Ki]
    (16 KiB), HCA 2 x [m, K] (512 KiB) for the released sizes (reference §4.1, §4.3)."""
    if kind == CSA:
        return {"csa": 2 * (2 * ratio) * (2 * cfg.head_dim) * STATE_BYTES,
                "csa_index": 2 * (2 * ratio) * (2 * cfg.index_head_dim) * STATE_BYTES}
    if kind == HCA:
        return {"hca": 2 * ratio * cfg.head_dim * STATE_BYTES}
    return {}


def _per_request(cfg: ModelConfig, layers, fmt: str) -> dict[str, int]:
    main = main_entry_bytes(cfg, fmt)
    out = {"swa": 0, "state_csa": 0, "state_csa_index": 0, "state_hca": 0}
    for kind, m in layers:
        out["swa"] += cfg.window_size * main
        for k, v in compressor_state_bytes(cfg, kind, m).items():
            out["state_" + k] += v
    return out


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    fmt: str
    context_tokens: int
    n_requests: int
    n_sliding: int
    n_csa: int
    n_hca: int
    main_entry_bytes: int
    index_key_bytes: int
    per_token: dict  # kind -> bytes per context token (csa_kv, csa_index, hca_kv), main layers
    per_token_kv: float  # the reference figure: compressed KV bytes per context token (no token ids)
    per_token_total: float  # + token ids
    per_request: dict  # constant bytes per request: swa, state_csa, state_csa_index, state_hca (main layers)
    per_request_const: int  # their sum
    mtp_per_request: int  # the MTP layer(s): window ring (+ state if compressed)
    mtp_per_token: float  # 0 for the released (sliding) MTP layer
    pools: dict  # kind -> bytes for n_requests x context_tokens (kinds of KINDS, plus "mtp")
    total: int  # sum of pools

    @property
    def per_request_bytes(self) -> float:
        """Everything one request of `context_tokens` holds (MTP included)."""
        return (self.context_tokens * (self.per_token_total + self.mtp_per_token)
                + self.per_request_const + self.mtp_per_request)


def report(cfg: ModelConfig, context_tokens: int = 1 << 20, n_requests: int = 1, fmt: str = "bf16") -> MemoryReport:
    """Bytes per pool kind for `n_requests` requests of `context_tokens` tokens each.
    Compressed pools hold floor(T / m) entries per layer (only complete windows exist)."""
    f = _fmt(fmt)
    main_layers, mtp_layers = _layers(cfg), _layers(cfg, mtp=True)
    pt = _per_token(cfg, main_layers, f)
    pr = _per_request(cfg, main_layers, f)
    mtp_pt = sum(_per_token(cfg, mtp_layers, f).values())
    mtp_pr = sum(_per_request(cfg, mtp_layers, f).values())
    main, idx = main_entry_bytes(cfg, f), index_key_bytes(cfg, f)
    t, n = int(context_tokens), int(n_requests)
    pools = dict.fromkeys(KINDS, 0)
    for kind, m in main_layers:
        if kind == CSA:
            pools["csa_kv"] += n * (t // m) * main
            pools["csa_index"] += n * (t // m) * idx
        elif kind == HCA:
            pools["hca_kv"] += n * (t // m) * main
    pools["swa"] = n * pr["swa"]
    pools["state"] = n * (pr["state_csa"] + pr["state_csa_index"] + pr["state_hca"])
    pools["tokens"] = n * t * TOKEN_ID_BYTES
    mtp_pool = n * mtp_pr
    for kind, m in mtp_layers:
        if kind != SLIDING:
            mtp_pool += n * (t // m) * (main + (idx if kind == CSA else 0))
    pools["mtp"] = mtp_pool
    kv = sum(pt.values())
    return MemoryReport(
        fmt=f, context_tokens=t, n_requests=n,
        n_sliding=sum(k == SLIDING for k, _ in main_layers), n_csa=sum(k == CSA for k, _ in main_layers),
        n_hca=sum(k == HCA for k, _ in main_layers), main_entry_bytes=main, index_key_bytes=idx,
        per_token=pt, per_token_kv=kv, per_token_total=kv + TOKEN_ID_BYTES, per_request=pr,
        per_request_const=sum(pr.values()), mtp_per_request=mtp_pr, mtp_per_token=mtp_pt,
        pools=pools, total=sum(pools.values()))


def _human(b: float) -> str:
    if b >= GiB:
        return f"{b / GiB:.2f} GiB"
    if b >= MiB:
        return f"{b / MiB:.2f} MiB"
    if b >= 1024:
        return f"{b / 1024:.2f} KiB"
    return f"{b:.0f} B"


def _num(x: float) -> str:
    return f"{x:.0f}" if float(x).is_integer() else f"{x:.4f}".rstrip("0")


def format_report(rep: MemoryReport | list[MemoryReport], title: str | None = None) -> str:
    """A markdown table; several reports (e.g. one per format, same context) become columns."""
    reps = rep if isinstance(rep, (list, tuple)) else [rep]
    r0 = reps[0]
    head = ["", *[r.fmt for r in reps]]
    rows = [
        ("layers (sliding / CSA / HCA)", [f"{r.n_sliding} / {r.n_csa} / {r.n_hca}" for r in reps]),
        ("main KV entry / indexer key (B)", [f"{r.main_entry_bytes} / {r.index_key_bytes}" for r in reps]),
        ("C4 KV per token (B)", [_num(r.per_token["csa_kv"]) for r in reps]),
        ("C4 indexer keys per token (B)", [_num(r.per_token["csa_index"]) for r in reps]),
        ("C128 KV per token (B)", [_num(r.per_token["hca_kv"]) for r in reps]),
        ("**KV per context token (B)**", [f"**{_num(r.per_token_kv)}**" for r in reps]),
        ("+ token ids (B/token)", [_num(r.per_token_total) for r in reps]),
        ("window ring per request", [_human(r.per_request["swa"]) for r in reps]),
        ("compressor state per request (f32)",
         [_human(r.per_request["state_csa"] + r.per_request["state_csa_index"] + r.per_request["state_hca"])
          for r in reps]),
        ("MTP layer per request (separate)", [_human(r.mtp_per_request) for r in reps]),
        (f"KV of one {r0.context_tokens}-token request", [_human(r.per_token_kv * r.context_tokens) for r in reps]),
    ]
    for k in KINDS + ("mtp",):
        rows.append((f"pool {k} ({r0.n_requests} x {r0.context_tokens} tokens)", [_human(r.pools[k]) for r in reps]))
    rows.append(("**all pools**", [f"**{_human(r.total)}**" for r in reps]))
    lines = []
    if title:
        lines += [title, ""]
    lines.append("| " + " | ".join(head) + " |")
    lines.append("|" + "---|" * len(head))
    for name, vals in rows:
        lines.append("| " + " | ".join([name, *vals]) + " |")
    return "\n".join(lines)


# ---- decode traffic (reference serving_systems.md §1.2) ----------------------------------------------
def decode_read_bytes(cfg: ModelConfig, context_tokens: int, fmt: str = "bf16") -> dict[str, int]:
    """Pool bytes one decode step must read for ONE sequence holding `context_tokens` tokens: the indexer scans
    every C4 key of every CSA layer; sparse attention reads top-k selected C4 entries per CSA layer; HCA layers
    read all their entries; every layer reads its window. Keys: indexer, sparse, hca, swa, total."""
    f = _fmt(fmt)
    main, idx = main_entry_bytes(cfg, f), index_key_bytes(cfg, f)
    t = int(context_tokens)
    out = {"indexer": 0, "sparse": 0, "hca": 0, "swa": 0}
    for kind, m in _layers(cfg):
        out["swa"] += min(cfg.window_size, t) * main
        if kind == CSA:
            out["indexer"] += (t // m) * idx
            out["sparse"] += min(cfg.index_topk, t // m) * main
        elif kind == HCA:
            out["hca"] += (t // m) * main
    out["total"] = sum(out.values())
    return out


# ---- weights -----------------------------------------------------------------------------------------
def attention_weight_count(cfg: ModelConfig, i: int) -> int:
    """Elements of layer i's attention linears (held in the model dtype; every token of the layer multiplies by all
    of them): wq_a, wq_b, wkv, wo_a, wo_b; on compressed layers the compressor's wkv and wgate; on CSA layers the
    indexer's wq_b, weights_proj and its compressor's wkv and wgate."""
    kind, d = cfg.layer_type(i), cfg.dim
    h, k, q, g, r = cfg.n_heads, cfg.head_dim, cfg.q_lora_rank, cfg.o_groups, cfg.o_lora_rank
    count = q * d + h * k * q + k * d + g * r * (h * k // g) + d * g * r
    if kind != SLIDING:
        count += 2 * (2 if kind == CSA else 1) * k * d
    if kind == CSA:
        hi, ki = cfg.index_n_heads, cfg.index_head_dim
        count += hi * ki * q + hi * d + 2 * 2 * ki * d
    return count


def stored_weight_bytes(shape, storage: str | None, dtype_bytes: int) -> int:
    """Bytes of a weight of logical shape [..., O, I] held as `storage` ("fp8": e4m3 + a ue8m0 scale per 128x128
    block; "fp4": two e2m1 a byte + a ue8m0 scale per 1x32 block; None: the model dtype)."""
    from v4jax.model import quant
    if storage is None:
        return math.prod(shape) * dtype_bytes
    return math.prod(quant.stored_shape(storage, shape)) + math.prod(quant.scale_shape(storage, shape))


def fp8_linear_shapes(cfg: ModelConfig, i: int) -> list[tuple[int, int]]:
    """[out, in] of layer i's attention linears the release stores as FP8: wq_a, wq_b, wkv, wo_a, wo_b, and on CSA
    layers the indexer's wq_b (the rest of attention_weight_count is bf16: compressors, weights_proj)."""
    h, k, q, g, r, d = cfg.n_heads, cfg.head_dim, cfg.q_lora_rank, cfg.o_groups, cfg.o_lora_rank, cfg.dim
    out = [(q, d), (h * k, q), (k, d), (g * r, h * k // g), (d, g * r)]
    if cfg.layer_type(i) == CSA:
        out.append((cfg.index_n_heads * cfg.index_head_dim, q))
    return out


def param_bytes(cfg: ModelConfig, dtype_bytes: int = 2, mtp: bool = True, weights=None) -> dict[str, int]:
    """Bytes of every parameter group of v4jax.model.Transformer (linear / embedding / expert weights in the
    model dtype, or as `weights` (quant.WeightFormat) holds the FP8 linears and routed experts; norms, mHC,
    attention sinks, compressor `ape`, router bias in float32; hash tables int32).
    Keys: embed, head, top (final norm + mHC head), attn (all layers: projections, compressor, indexer, norms,
    sink, mHC of the layer), router, shared_expert, routed_expert (ONE expert of ONE layer), routed_experts
    (all, main layers), mtp (the MTP module, 0 if mtp=False), total."""
    w, f32 = dtype_bytes, 4
    lin = None if weights is None else weights.linear
    exp = None if weights is None else weights.experts
    d, n, v = cfg.dim, cfg.hc_mult, cfg.vocab_size
    inter = cfg.moe_inter_dim
    mix = (2 + n) * n
    one_expert = 2 * stored_weight_bytes((inter, d), exp, w) + stored_weight_bytes((d, inter), exp, w)
    out = dict(embed=v * d * w, head=v * d * w, top=d * f32 + (n * n * d + n + 1) * f32,
               attn=0, router=0, shared_expert=0, routed_expert=one_expert, routed_experts=0)

    def block(i: int) -> dict[str, int]:
        kind, m, k = cfg.layer_type(i), cfg.compress_ratio(i), cfg.head_dim
        attn = 2 * d * f32 + 2 * (mix * n * d + mix + 3) * f32  # attn/ffn norms, hc_attn / hc_ffn fn+base+scale
        fp8 = fp8_linear_shapes(cfg, i)
        attn += (attention_weight_count(cfg, i) - sum(o * c for o, c in fp8)) * w
        attn += sum(stored_weight_bytes(s, lin, w) for s in fp8)
        attn += (cfg.q_lora_rank + k + cfg.n_heads) * f32  # q_norm, kv_norm, attn_sink
        if kind != SLIDING:
            attn += (m * (2 if kind == CSA else 1) * k + k) * f32  # compressor ape, norm
        if kind == CSA:
            ki = cfg.index_head_dim
            attn += (m * 2 * ki + ki) * f32  # indexer compressor ape, norm
        router = cfg.n_routed_experts * d * w
        router += (v * cfg.n_activated_experts * 4) if cfg.is_hash_layer(i) else cfg.n_routed_experts * f32
        si = cfg.moe_inter_dim * cfg.n_shared_experts
        shared = 2 * stored_weight_bytes((si, d), lin, w) + stored_weight_bytes((d, si), lin, w)
        return dict(attn=attn, router=router, shared_expert=shared, routed_experts=cfg.n_routed_experts * one_expert)

    for i in range(cfg.n_layers):
        for key, val in block(i).items():
            out[key] += val
    out["mtp"] = 0
    if mtp:
        for j in range(cfg.n_mtp_layers):
            b = block(cfg.n_layers + j)
            out["mtp"] += (sum(b.values()) + 2 * stored_weight_bytes((d, d), lin, w) + 3 * d * f32
                           + (n * n * d + n + 1) * f32)
    out["total"] = (out["embed"] + out["head"] + out["top"] + out["attn"] + out["router"] + out["shared_expert"]
                    + out["routed_experts"] + out["mtp"])
    return out


def expected_active_experts(cfg: ModelConfig, batch: int) -> float:
    """Expected distinct routed experts per layer when `batch` tokens each pick k of E uniformly at random."""
    e, k = cfg.n_routed_experts, cfg.n_activated_experts
    return e * (1.0 - (1.0 - k / e) ** batch)


def decode_weight_bytes(cfg: ModelConfig, batch: int, dtype_bytes: int = 2, weights=None) -> dict[str, float]:
    """Weight bytes one decode step of `batch` tokens (one per sequence) must read: every attention / router /
    shared-expert / head weight, the embedding rows of the batch's tokens (at most `batch` rows), and only the
    routed experts the batch activates (expected number under random routing). The MTP module is not run.
    weights: a quant.WeightFormat (None: all in the model dtype)."""
    pb = param_bytes(cfg, dtype_bytes, mtp=False, weights=weights)
    act = expected_active_experts(cfg, batch)
    out = {
        "embed_rows": min(batch, cfg.vocab_size) * cfg.dim * dtype_bytes,
        "head": pb["head"], "top": pb["top"], "attn": pb["attn"], "router": pb["router"],
        "shared_expert": pb["shared_expert"],
        "routed_experts": cfg.n_layers * act * pb["routed_expert"],
        "active_experts_per_layer": act,
    }
    out["total"] = sum(v for k, v in out.items() if k != "active_experts_per_layer")
    return out


# ---- what fits on a device ---------------------------------------------------------------------------
MEMORY_ENV = "V4JAX_DEVICE_MEMORY_BYTES"  # overrides the detected memory of one device (bytes)
FRACTION_ENV = "XLA_PYTHON_CLIENT_MEM_FRACTION"  # the share of a GPU's memory JAX's allocator may use
DEFAULT_GPU_FRACTION = 0.75  # JAX's own default


def gpu_memory_fraction() -> float:
    """The share of each GPU's memory XLA's allocator may use: $XLA_PYTHON_CLIENT_MEM_FRACTION, else JAX's 0.75."""
    try:
        return float(os.environ.get(FRACTION_ENV, DEFAULT_GPU_FRACTION))
    except ValueError:
        return DEFAULT_GPU_FRACTION


def _fraction_hint(need: int, limit: int, source: str, headroom: float) -> str:
    """Where a GPU's bytes_limit is XLA's share of the card and a larger share would hold `need`: the setting."""
    if FRACTION_ENV not in source:
        return ""
    card, want = limit / gpu_memory_fraction(), 0.95
    if need > headroom * want * card:
        return ""
    return (f"; or give XLA more of the card: {FRACTION_ENV}={want} in the environment before JAX starts "
            f"({_human(int(want * card))} of {_human(int(card))})")


class DeviceMemoryError(ValueError):
    """What a model (or its pools) needs does not fit the memory of the device it would be placed on."""


class HostMemoryError(ValueError):
    """The pools an engine keeps in host memory (enable_hisparse) do not fit the host's available memory."""


def _host_available_bytes() -> int | None:
    """MemAvailable of /proc/meminfo, else the free physical pages (os.sysconf)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def device_memory_bytes(device=None) -> tuple[int | None, str]:
    """(bytes one device can hold, where the figure comes from). In order: $V4JAX_DEVICE_MEMORY_BYTES; the
    device's `memory_stats()["bytes_limit"]` (GPU / TPU); on CPU the host's available RAM. (None, why) when
    nothing is known."""
    env = os.environ.get(MEMORY_ENV)
    if env:
        try:
            return int(float(env)), f"${MEMORY_ENV}"
        except ValueError:
            raise ValueError(f"${MEMORY_ENV}={env!r} is not a number of bytes") from None
    import jax
    dev = device if device is not None else jax.devices()[0]
    try:
        stats = dev.memory_stats() or {}
    except Exception:  # noqa: BLE001 - backends without memory stats
        stats = {}
    if stats.get("bytes_limit"):
        source = f"{dev.platform} bytes_limit of {dev}"
        if dev.platform == "gpu":  # XLA's allocator takes this share of the card, whatever the card holds
            source += f", {FRACTION_ENV}={gpu_memory_fraction()} of the card"
        return int(stats["bytes_limit"]), source
    if dev.platform == "cpu":
        avail = _host_available_bytes()
        if avail:
            return avail, "available host RAM"
    return None, f"no memory figure for {dev}"


def device_free_bytes(device=None, in_use: int = 0) -> tuple[int | None, str]:
    """Bytes still free on the device now: bytes_limit - bytes_in_use where the device reports them; the host's
    available RAM on CPU; under $V4JAX_DEVICE_MEMORY_BYTES the override less bytes_in_use (or less `in_use`, the
    caller's own count of what it placed, where the device keeps no count)."""
    limit, source = device_memory_bytes(device)
    if limit is None or source == "available host RAM":
        return limit, source
    import jax
    dev = device if device is not None else jax.devices()[0]
    try:
        used = (dev.memory_stats() or {}).get("bytes_in_use")
    except Exception:  # noqa: BLE001
        used = None
    return limit - (used if used is not None else in_use), source


def model_weight_bytes(model) -> int:
    """Bytes of every variable of an NNX model, abstract (nnx.eval_shape: nothing allocated) or concrete."""
    import jax
    from flax import nnx
    return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(nnx.state(model))))


def report_weight_format(cfg: ModelConfig, checkpoint: str | None, quantization: str | None):
    """The quant.WeightFormat the memory report counts: the release's for a preset (its random weights may be held
    so: `quantization="fp8"`) unless quantization="none"; a checkpoint's as its config.json says it stores them
    (`quantization_config` FP8 linears, `expert_dtype` fp4 experts, else FP8 ones), as LLM loads it."""
    import json

    from v4jax.model import quant
    if quantization == "none":
        return quant.DEQUANTIZED
    if checkpoint is None or quantization == "fp8":
        return quant.RELEASE
    path = checkpoint if os.path.isfile(checkpoint) else os.path.join(checkpoint, "config.json")
    with open(path) as f:
        conf = json.load(f)
    if (conf.get("quantization_config") or {}).get("quant_method") != "fp8":
        return quant.DEQUANTIZED
    return quant.WeightFormat("fp8", "fp4" if conf.get("expert_dtype") == "fp4" else "fp8")


def weight_stats(model) -> dict:
    """{"bytes": every variable's bytes, "by_format": bytes by storage format}: "fp8" (e4m3 values and their ue8m0
    block scales), "fp4" (packed e2m1 and their scales), and the dtype name of every other array ("bfloat16",
    "float32", "int32")."""
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx
    flat = {tuple(map(str, p)): v for p, v in nnx.to_flat_state(nnx.state(model))}

    def storage(path, var) -> str:
        dt = np.dtype(var.dtype)
        if dt == np.dtype(jnp.float8_e8m0fnu):  # a scale: its weight's format (Linear.scale, Experts.wN_scale)
            name = path[-1]
            weight = path[:-1] + (("weight",) if name == "scale" else (name[: -len("_scale")],))
            return storage(weight, flat[weight])
        return {np.dtype(jnp.float8_e4m3fn): "fp8", np.dtype(np.uint8): "fp4"}.get(dt, dt.name)

    by_format: dict[str, int] = {}
    for path, var in flat.items():
        fmt = storage(path, var)
        by_format[fmt] = by_format.get(fmt, 0) + int(math.prod(var.shape) * np.dtype(var.dtype).itemsize)
    return {"bytes": sum(by_format.values()), "by_format": dict(sorted(by_format.items()))}


def abstract_model(cfg: ModelConfig, dtype="bfloat16", mtp: bool = True):
    """The model as shapes only (nnx.eval_shape): bytes and shardings without allocating anything."""
    import jax.numpy as jnp
    from flax import nnx

    from v4jax.model import Transformer
    dt = jnp.dtype(dtype)
    return nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0), dtype=dt, mtp=mtp))


def weight_bytes_per_device(model, mesh=None) -> int:
    """Bytes of the model's weights on one device of `mesh` ("expert=8", {"tensor": 2} or None):
    each parameter divided as sharding/rules.py splits it (by the logical axes it was created with). `model` may
    be abstract (see abstract_model)."""
    import numpy as np
    from flax import nnx

    from sharding.place import variable_axes
    from sharding.rules import parse_mesh_spec, split_factor
    shape = parse_mesh_spec(mesh)
    total = 0
    for path, var in nnx.to_flat_state(nnx.state(model)):
        f = split_factor(variable_axes(var, ".".join(map(str, path))), var.shape, shape) if shape else 1
        total += -(-math.prod(var.shape) * np.dtype(var.dtype).itemsize // f)
    return int(total)


def _param_arrays(cfg: ModelConfig, dtype_bytes: int, mtp: bool = True, weights=None):
    """(shape, bytes per element, logical axes) of every parameter array of v4jax.model.Transformer, layer by
    layer, as its modules create them (the leading "layers" axis of a stack is never split, so it is left out);
    `weights` (quant.WeightFormat): the FP8 linears' and routed experts' stored values and scales."""
    from v4jax.model import quant
    w, f32 = dtype_bytes, 4
    lin = None if weights is None else weights.linear
    exp = None if weights is None else weights.experts

    def stored(shape, itemsize, axes, storage):
        if storage is None:
            return [(shape, itemsize, axes)]
        return [(quant.stored_shape(storage, shape), 1, axes), (quant.scale_shape(storage, shape), 1, axes)]
    d, n, v = cfg.dim, cfg.hc_mult, cfg.vocab_size
    mix = (2 + n) * n
    hc = [((mix, n * d), f32, ("hc_mix", "hc_embed")), ((mix,), f32, ("hc_mix",)), ((3,), f32, ("hc_scale",))]

    def block(i: int):
        kind, m = cfg.layer_type(i), cfg.compress_ratio(i)
        h, k, q, g, r = cfg.n_heads, cfg.head_dim, cfg.q_lora_rank, cfg.o_groups, cfg.o_lora_rank
        e, inter = cfg.n_routed_experts, cfg.moe_inter_dim
        out = [((d,), f32, ("embed",))] * 2 + hc * 2
        out += (stored((q, d), w, ("q_lora", "embed"), lin) + [((q,), f32, ("q_lora",))]
                + stored((h * k, q), w, ("heads", "q_lora"), lin) + stored((k, d), w, ("head_dim", "embed"), lin)
                + [((k,), f32, ("head_dim",))] + stored((g * r, h * k // g), w, ("o_lora", "group_heads"), lin)
                + stored((d, g * r), w, ("embed", "o_lora"), lin) + [((h,), f32, ("heads",))])

        def compressor(kk, coff):
            return [((coff * kk, d), w, ("compress", "embed"))] * 2 + [
                ((m, coff * kk), f32, ("ratio", "compress")), ((kk,), f32, ("head_dim",))]

        if kind != SLIDING:
            out += compressor(k, 2 if kind == CSA else 1)
        if kind == CSA:
            hi, ki = cfg.index_n_heads, cfg.index_head_dim
            out += stored((hi * ki, q), w, ("index_heads", "q_lora"), lin) + [((hi, d), w, ("index_heads", "embed"))]
            out += compressor(ki, 2)
        out.append(((e, d), w, ("router", "embed")))
        if cfg.is_hash_layer(i):
            out.append(((v, cfg.n_activated_experts), 4, ("hash_tokens", "routed")))
        else:
            out.append(((e,), f32, ("router",)))
        out += stored((e, inter, d), w, ("experts", "mlp", "embed"), exp) * 2
        out += stored((e, d, inter), w, ("experts", "embed", "mlp"), exp)
        si = inter * cfg.n_shared_experts
        out += stored((si, d), w, ("mlp", "embed"), lin) * 2 + stored((d, si), w, ("embed", "mlp"), lin)
        return out

    head = [((n, n * d), f32, ("hc_mix", "hc_embed")), ((n,), f32, ("hc_mix",)), ((1,), f32, ("hc_scale",))]
    out = [((v, d), w, ("vocab", "embed"))] * 2 + [((d,), f32, ("embed",))] + head
    for i in range(cfg.n_layers):
        out += block(i)
    for j in range(cfg.n_mtp_layers if mtp else 0):
        out += (block(cfg.n_layers + j) + stored((d, d), w, ("embed", "embed"), lin) * 2
                + [((d,), f32, ("embed",))] * 3 + head)
    return out


def weight_bytes_on_mesh(cfg: ModelConfig, mesh=None, dtype_bytes: int = 2, weights=None) -> int:
    """weight_bytes_per_device without building the abstract model (instant for any config): every parameter
    array, as the model creates it, split as sharding/rules.py splits it. tests/test_newcomer.py checks it
    against weight_bytes_per_device of the abstract model."""
    from sharding.rules import parse_mesh_spec, split_factor
    shape = parse_mesh_spec(mesh)
    total = 0
    for dims, itemsize, logical in _param_arrays(cfg, dtype_bytes, weights=weights):
        f = split_factor(logical, dims, shape) if shape else 1
        total += math.prod(dims) * itemsize // f
    return int(total)


@dataclasses.dataclass(frozen=True)
class EnginePools:
    """The pools of an engine built with given options, as v4jax.cache.layout lays them out: the layout (pages,
    slots, the mesh's data x context) and every pool's size (`pool_sizes`: units, bytes over the whole mesh and on
    one device of it). `total` is exactly what the engine allocates (pools and boundary store), `per_device` what
    one device of its mesh holds."""
    layout: PoolLayout
    sizes: dict[str, PoolSize]  # by pool name (pool_sizes)
    kv_layout: str
    caching: bool  # the prefix cache (its window tails and boundary rows are in the `swa` pool)
    max_model_len: int
    kv_cache_dtype: str = "auto"  # the option the pools were laid out for

    @property
    def total(self) -> int:
        return sum(s.bytes for s in self.sizes.values())

    @property
    def per_device(self) -> int:
        return sum(s.device_bytes for s in self.sizes.values())

    @property
    def per_page_bytes(self) -> int:
        """Bytes of one full page: its token ids and its rows of every compressed pool."""
        return sum(self.sizes[k].unit_bytes for k in FULL_PAGE_POOLS if k in self.sizes)

    @property
    def fixed_bytes(self) -> int:
        """The pools that do not grow with full pages: SWA pages (and boundary rows), compressor states."""
        return self.total - self.layout.n_pages * self.per_page_bytes

    def as_dict(self) -> dict:
        lay = self.layout
        return {"max_model_len": self.max_model_len, "max_num_seqs": lay.max_slots, "kv_layout": self.kv_layout,
                "kv_cache_dtype": self.kv_cache_dtype,
                "enable_prefix_caching": self.caching,
                "mesh": {"data": lay.data_shards, "context": lay.context_shards},
                "page_size": lay.page_size, "swa_page_size": lay.swa_page_size, "n_pages": lay.n_pages,
                "n_swa_pages": lay.n_swa_pages, "tokens": lay.n_pages * lay.page_size,
                "per_page_bytes": self.per_page_bytes, "fixed_bytes": self.fixed_bytes,
                "pools": {k: {"units": s.units, "unit": s.unit, "unit_bytes": s.unit_bytes, "bytes": s.bytes,
                              "device_bytes": s.device_bytes, "host_bytes": s.host_bytes}
                          for k, s in self.sizes.items()},
                "total": self.total, "per_device": self.per_device}


def engine_pools(cfg: ModelConfig, options, max_model_len: int, dtype="bfloat16") -> EnginePools:
    """The pools an engine built with `options` (an api.EngineOptions, or anything with its fields: max_num_seqs,
    kv_layout, page_size, prefill_chunk, decode_steps, memory_budget_bytes, enable_prefix_caching, mesh) and
    `max_model_len` allocates, with `dtype` the model's (the pools' is options.kv_cache_dtype's), from the layout
    the engine itself uses. Nothing is allocated. A mesh whose `data` axis does not divide max_num_seqs is a
    ValueError, as in the engine."""
    n_data, n_ctx = mesh_shards(options.mesh)
    dtype = kv_cache_dtype(options.kv_cache_dtype, dtype)
    lay = pool_layout(cfg, options, dtype, max_model_len, n_data, n_ctx)
    caching = bool(options.enable_prefix_caching) and options.kv_layout != "dense"
    return EnginePools(layout=lay, sizes=pool_sizes(cfg, lay, dtype, caching), kv_layout=options.kv_layout,
                       caching=caching, max_model_len=max_model_len, kv_cache_dtype=options.kv_cache_dtype)


def _fits_hint(cfg: ModelConfig, need: int, limit: int, dtype_bytes: int, weights=None) -> str:
    """What would fit instead: the release's weight formats, smaller presets, bf16, and the mesh that brings the
    per-device share under."""
    from v4jax.config import PRESETS, preset
    from v4jax.model import quant
    hints = []
    if weights is None or not weights.quantized:
        stored = param_bytes(cfg, dtype_bytes, weights=quant.RELEASE)["total"]
        if stored <= 0.9 * limit:
            hints.append(f"quantization='fp8' (FP8 linears and FP4 experts as the release stores them: "
                         f"{_human(stored)})")
    smaller = [n for n in sorted(PRESETS) if param_bytes(preset(n), dtype_bytes)["total"] <= 0.9 * limit]
    if smaller:
        hints.append("a smaller preset (" + ", ".join(repr(n) for n in smaller) + ")")
    if dtype_bytes == 4:
        hints.append(f"dtype='bfloat16' (half: {_human(need / 2)})")
    e = 2
    while e <= cfg.n_routed_experts and cfg.n_routed_experts % e == 0:
        per_dev = weight_bytes_on_mesh(cfg, {"expert": e}, dtype_bytes)
        if per_dev <= 0.9 * limit:
            hints.append(f"a mesh over {e} devices, mesh='expert={e}' ({_human(per_dev)} of weights per device, "
                         f"`v4jax memory --mesh expert={e}`)")
            break
        e *= 2
    return "; ".join(hints) if hints else "a device with more memory"


def check_weights_fit(cfg: ModelConfig, weight_bytes: int, dtype=None, *, what: str = "the model",
                      limit: int | None = None, headroom: float = 0.9, weights=None) -> None:
    """Raise DeviceMemoryError if `weight_bytes` exceed `headroom` of one device's memory (`limit`, default
    device_memory_bytes()), saying what would fit. Nothing is allocated; unknown memory skips the check."""
    source = "the given limit"
    if limit is None:
        limit, source = device_memory_bytes()
    if limit is None or weight_bytes <= headroom * limit:
        return
    import numpy as np
    db = 2 if dtype is None else np.dtype(dtype).itemsize
    held = np.dtype(dtype or "bfloat16").name
    if weights is not None and weights.quantized:
        held = f"FP8 / FP4 as the release stores them, the rest {held}"
    raise DeviceMemoryError(
        f"{what}: the weights need {_human(weight_bytes)} ({held}) but one device "
        f"holds {_human(limit)} ({source}); would fit: {_fits_hint(cfg, weight_bytes, limit, db, weights)}"
        f"{_fraction_hint(weight_bytes, limit, source, headroom)}. Set ${MEMORY_ENV} to override the detected memory")


def check_pools_fit(pool_bytes: int, *, free: int | None = None, source: str = "the given limit",
                    max_model_len: int, max_num_seqs: int, budget_hint: int | None = None) -> None:
    """Raise DeviceMemoryError if the engine's pools (`pool_bytes`) exceed the device memory still free."""
    if free is None:
        free, source = device_free_bytes()
    if free is None or pool_bytes <= 0.9 * free:
        return
    budget = budget_hint if budget_hint is not None else int(0.8 * free)
    raise DeviceMemoryError(
        f"the KV pools for max_num_seqs={max_num_seqs} x max_model_len={max_model_len} need {_human(pool_bytes)} "
        f"but {_human(free)} is free ({source}); would fit: memory_budget_bytes={budget} (pools sized to the "
        "budget; requests queue for pages), a lower max_model_len or max_num_seqs, or a mesh with a `data` axis")


def check_step_temporaries(temporaries: dict[str, int], *, free: int | None, source: str,
                           pools: "EnginePools | None" = None) -> None:
    """Raise DeviceMemoryError if the largest compiled step program's temporaries (`temporaries`: bytes by the
    program's description, from XLA's memory analysis) exceed the device memory still free after the weights and
    pools: what would otherwise be an out-of-memory error in the middle of serving, at the first step of that
    shape (flash-1gpu, 32 slots, on an H100: a 32-row prefill asked for 5.25 GiB more than was free)."""
    if free is None or not temporaries:
        return
    name, need = max(temporaries.items(), key=lambda kv: kv[1])
    if need <= free:
        return
    short = need - free
    lower = ("prefill_chunk (the tokens of one prefill step)" if name.startswith("prefill")
             else "max_num_seqs (the decode call's slots)")
    hint = ""
    if pools is not None and pools.per_device > 1.25 * short:
        budget = int(pools.total * (pools.per_device - 1.25 * short) / pools.per_device)
        hint = f", or set memory_budget_bytes={budget} (smaller pools: requests queue for pages)"
    raise DeviceMemoryError(
        f"the step program ({name}) needs {_human(need)} of device memory for its temporaries, but {_human(free)} "
        f"is free after the weights and pools ({source}): lower {lower}{hint}")


def check_host_pools_fit(cfg: ModelConfig, options, pools: EnginePools, dtype="bfloat16") -> None:
    """enable_hisparse: the C4 KV rows the engine keeps in host memory (pinned on a GPU) against the host's available
    memory (_host_available_bytes, read when called), with the headroom of the device check (90 %). The pages and
    so the host rows follow memory_budget_bytes, max_num_seqs and max_model_len; the error names the budget that
    would fit. Unknown memory skips the check."""
    host = sum(s.host_bytes for s in pools.sizes.values())
    if not host:
        return
    avail = _host_available_bytes()
    if avail is None or host <= 0.9 * avail:
        return
    lay = pools.layout
    per_page = sum(s.host_unit_bytes for s in pools.sizes.values())
    fit = int(0.9 * avail // per_page)
    if fit >= 1:
        fixed, device_per_page = pool_cost(cfg, lay, kv_cache_dtype(options.kv_cache_dtype, dtype), pools.caching)
        hint = (f"memory_budget_bytes={fixed + fit * device_per_page} (device bytes: {fit} full pages, whose host rows "
                f"take {_human(fit * per_page)}), or a lower max_model_len or max_num_seqs")
    else:
        hint = f"a machine with more host memory (one full page's host rows take {_human(per_page)})"
    raise HostMemoryError(
        f"enable_hisparse: the C4 KV pool's host rows for {lay.n_pages} full pages of {lay.page_size} tokens need "
        f"{host} bytes ({_human(host)}) of host memory but {avail} bytes ({_human(avail)}) are available "
        f"(MemAvailable; 90% is the limit used); would fit: {hint}")


def budget_for_utilization(cfg: ModelConfig, options, max_model_len: int, dtype="bfloat16",
                           weight_bytes: int = 0) -> int:
    """memory_budget_bytes for options.gpu_memory_utilization (f, vLLM's option): each device's pools get f of its
    memory (device_memory_bytes) less what it holds already (the weights: bytes_in_use where the device counts it,
    else `weight_bytes`), counted over the mesh as memory_budget_bytes is. A ValueError naming the option where f
    leaves the pools too little."""
    f = options.gpu_memory_utilization
    limit, source = device_memory_bytes()
    if limit is None:
        raise ValueError(f"gpu_memory_utilization={f}: this device's memory is not known ({source}); set "
                         f"${MEMORY_ENV} or give memory_budget_bytes instead")
    free, _ = device_free_bytes(in_use=weight_bytes)
    held = limit - free
    per_device = int(f * limit) - held
    if per_device <= 0:
        raise ValueError(f"gpu_memory_utilization={f} gives each device {_human(f * limit)} of its {_human(limit)} "
                         f"({source}), and the weights already hold {_human(held)}: raise it above "
                         f"{held / limit:.2f}")
    plain = dataclasses.replace(options, gpu_memory_utilization=None, memory_budget_bytes=None)
    pools = engine_pools(cfg, plain, max_model_len, dtype)  # how the pools split over the mesh
    budget = int(per_device * pools.total / max(pools.per_device, 1))
    try:
        engine_pools(cfg, dataclasses.replace(plain, memory_budget_bytes=budget), max_model_len, dtype)
    except ValueError as e:
        raise ValueError(f"gpu_memory_utilization={f} leaves each device's pools {_human(per_device)} once the "
                         f"weights hold {_human(held)} of {_human(limit)} ({source}): {e}") from None
    return budget


def check_engine_fits(cfg: ModelConfig, options, max_model_len: int, dtype="bfloat16", weight_bytes: int = 0) -> None:
    """Before an LLM builds its engine: the pools its options ask for on one device of its mesh (engine_pools, the
    engine's own layout) against the device memory still free (the weights, `weight_bytes`, already placed), and
    with enable_hisparse the host rows against the host's available memory (check_host_pools_fit). `options` is an
    api.EngineOptions."""
    pools = engine_pools(cfg, options, max_model_len, dtype)
    check_host_pools_fit(cfg, options, pools, dtype)
    free, source = device_free_bytes(in_use=weight_bytes)
    if free is None:
        return
    budget = None
    if not options.memory_budget_bytes and options.kv_layout == "paged":
        # memory_budget_bytes counts the pools over the whole mesh; 80% of one device's free memory per device
        budget = max(int(0.8 * free * pools.total / max(pools.per_device, 1)), 0)
    check_pools_fit(pools.per_device, free=free, source=source, max_model_len=max_model_len,
                    max_num_seqs=options.max_num_seqs, budget_hint=budget)


def format_device_table(weights: int, weights_per_device: int, pools: EnginePools, mesh: str, n_devices: int,
                        dtype: str, limit: int | None, source: str, weights_held: str | None = None) -> str:
    """Markdown: weights and the engine's pools (every pool, as the engine allocates it), in all and per device of
    the mesh, against one device's memory."""
    lay = pools.layout
    need = weights_per_device + pools.per_device
    cache = ", prefix cache" if pools.caching else ""
    held = f"weights {weights_held}" if weights_held else f"weights in {dtype}"
    kv = dtype if pools.kv_cache_dtype == "auto" else pools.kv_cache_dtype
    lines = [f"## Per device ({mesh}: {n_devices} device(s), {held}, pools in {kv})", "",
             f"Engine pools ({pools.kv_layout}{cache}): {lay.max_slots} slots x max_model_len={pools.max_model_len}; "
             f"{lay.n_pages} full pages of {lay.page_size} tokens ({lay.n_pages * lay.page_size} tokens, "
             f"{pools.per_page_bytes} B a page), {lay.n_swa_pages} SWA pages of {lay.swa_page_size} tokens.", "",
             "| | units | bytes per unit | all devices | per device |", "|---|---|---|---|---|",
             f"| weights | | | {_human(weights)} | {_human(weights_per_device)} |"]
    for name, s in pools.sizes.items():
        unit = "slots" if s.unit == "slot" else f"pages of {s.unit}"
        lines.append(f"| pool {name} | {s.units} {unit} | {s.unit_bytes} | {_human(s.bytes)} | "
                     f"{_human(s.device_bytes)} |")
    host = sum(s.host_bytes for s in pools.sizes.values())
    if host:  # enable_hisparse: the C4 KV's rows in host memory, its hot buffer and table on the device
        lines.append(f"| of which in host memory (C4 KV offloaded) | | | {_human(host)} | 0 |")
    lines += [f"| engine pools | | | {_human(pools.total)} | {_human(pools.per_device)} |",
              f"| **weights + pools** | | | {_human(weights + pools.total)} | **{_human(need)}** |"]
    if limit is not None:
        verdict = "fits" if need <= 0.9 * limit else "does NOT fit"
        lines += ["", f"This machine's device: {_human(limit)} ({source}): {verdict} "
                  f"(activations and compiler scratch need room too; 90% is the limit used)."]
    return "\n".join(lines)
