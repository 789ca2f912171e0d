"""Model configuration: a frozen dataclass, presets, and readers for HF / official config files.

Layer types come from the config, never from code: `layer_types[i]` is "sliding", "csa" or "hca" and
`compress_ratios[i]` is that layer's ratio (0 for sliding). Nothing here assumes 4 / 128 / 128.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from typing import Any

SLIDING, CSA, HCA = "sliding", "csa", "hca"
LAYER_TYPES = (SLIDING, CSA, HCA)

_HF_LAYER_TYPE = {
    "sliding_attention": SLIDING,
    "compressed_sparse_attention": CSA,
    "heavily_compressed_attention": HCA,
}
_HF_LAYER_TYPE_NAME = {v: k for k, v in _HF_LAYER_TYPE.items()}


# Storage of the KV pools (`kv_cache_dtype`): "auto" = the model's dtype; "fp8" = the release's formats: window,
# C4 and C128 entries as FP8 entries, C4 indexer keys as FP4 keys (fp8_entry_bytes / fp4_key_bytes).
KV_CACHE_DTYPES = ("auto", "bfloat16", "fp8")
FP8_BLOCK, FP4_BLOCK = 64, 32  # values per ue8m0 scale: FP8 entry NoPE dims, FP4 indexer key dims


class ConfigError(ValueError):
    """A config value that v4jax cannot run; the message names the key."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    dim: int  # hidden size D
    n_layers: int
    n_heads: int  # query heads H (one shared KV head)
    head_dim: int  # d = 512 in the real models
    rope_head_dim: int  # rd: RoPE on the last rd dims of each head
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    window_size: int  # sliding window, self included
    layer_types: tuple[str, ...]  # per main layer: "sliding" | "csa" | "hca"
    compress_ratios: tuple[int, ...]  # per main layer: 0 for sliding
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    n_routed_experts: int
    n_shared_experts: int
    n_activated_experts: int
    moe_inter_dim: int
    n_hash_layers: int
    route_scale: float
    swiglu_limit: float = 10.0
    score_func: str = "sqrtsoftplus"
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    rope_factor: float = 16.0  # YaRN on compressed layers; 1.0 = off
    original_seq_len: int = 65536
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    max_seq_len: int = 1 << 20
    n_mtp_layers: int = 1
    mtp_layer_type: str = SLIDING
    mtp_compress_ratio: int = 0
    bos_token_id: int | None = 0
    eos_token_id: int | None = 1
    # The DSpark drafter of the 0731 / -DSpark releases (`dspark_*` keys of config.json): its n_mtp_layers draft
    # layers (`mtp.N.*`, sliding-window blocks) draft a block of dspark_block_size tokens from the mean over the
    # streams of the main layers dspark_target_layer_ids (v4jax.engine.dspark). 0 = no DSpark (an MTP block).
    dspark_block_size: int = 0
    dspark_noise_token_id: int = 0
    dspark_target_layer_ids: tuple[int, ...] = ()
    dspark_markov_rank: int = 256

    def __post_init__(self):
        if len(self.layer_types) != self.n_layers:
            raise ConfigError(f"layer_types has {len(self.layer_types)} entries, n_layers is {self.n_layers}")
        if len(self.compress_ratios) != self.n_layers:
            raise ConfigError(f"compress_ratios has {len(self.compress_ratios)} entries, n_layers is {self.n_layers}")
        for i, (kind, ratio) in enumerate(zip(self.layer_types + (self.mtp_layer_type,),
                                               self.compress_ratios + (self.mtp_compress_ratio,))):
            if kind not in LAYER_TYPES:
                raise ConfigError(f"layer_types[{i}] = {kind!r}: expected one of {LAYER_TYPES}")
            if (kind == SLIDING) != (ratio == 0):
                raise ConfigError(f"compress_ratios[{i}] = {ratio} does not fit layer type {kind!r}")
            if ratio < 0:
                raise ConfigError(f"compress_ratios[{i}] = {ratio} must be >= 0")
        if self.score_func != "sqrtsoftplus":
            raise ConfigError(f"score_func = {self.score_func!r}: only 'sqrtsoftplus' is supported")
        if self.rope_head_dim % 2 or self.rope_head_dim > self.head_dim:
            raise ConfigError(f"rope_head_dim = {self.rope_head_dim} must be even and <= head_dim {self.head_dim}")
        if self.n_heads % self.o_groups:
            raise ConfigError(f"o_groups = {self.o_groups} must divide n_heads = {self.n_heads}")
        if self.n_activated_experts > self.n_routed_experts:
            raise ConfigError("n_activated_experts > n_routed_experts")
        if self.n_shared_experts not in (0, 1):
            raise ConfigError(f"n_shared_experts = {self.n_shared_experts}: only 0 or 1 is supported")
        if self.index_head_dim < self.rope_head_dim:
            raise ConfigError("index_head_dim must be >= rope_head_dim")
        if self.hc_mult < 1:
            raise ConfigError("hc_mult must be >= 1")
        if self.dspark_block_size:
            self._check_dspark()

    def _check_dspark(self):
        ids = self.dspark_target_layer_ids
        if self.dspark_block_size < 1:
            raise ConfigError(f"dspark_block_size = {self.dspark_block_size} must be >= 1")
        if not ids or len(set(ids)) != len(ids) or not all(0 <= i < self.n_layers for i in ids):
            raise ConfigError(f"dspark_target_layer_ids = {list(ids)} must be distinct main layers in "
                              f"[0, {self.n_layers})")
        if not 0 <= self.dspark_noise_token_id < self.vocab_size:
            raise ConfigError(f"dspark_noise_token_id = {self.dspark_noise_token_id} is outside the vocabulary "
                              f"[0, {self.vocab_size})")
        if self.dspark_markov_rank < 1:
            raise ConfigError(f"dspark_markov_rank = {self.dspark_markov_rank} must be >= 1")
        if self.n_mtp_layers < 1:
            raise ConfigError("the dspark_* keys need draft layers: compress_ratios entries past num_hidden_layers "
                              "(one per layer, 0 = sliding window)")
        if self.mtp_layer_type != SLIDING:
            raise ConfigError(f"DSpark draft layers are sliding-window layers (compress ratio 0), got "
                              f"{self.mtp_layer_type!r} (compress_ratios past num_hidden_layers)")

    # ---- derived ---------------------------------------------------------------------------------
    def layer_type(self, i: int) -> str:
        """Type of main layer i, or of the MTP layer for i >= n_layers."""
        return self.layer_types[i] if i < self.n_layers else self.mtp_layer_type

    def compress_ratio(self, i: int) -> int:
        return self.compress_ratios[i] if i < self.n_layers else self.mtp_compress_ratio

    def is_hash_layer(self, i: int) -> bool:
        return i < self.n_hash_layers

    @property
    def nope_head_dim(self) -> int:
        return self.head_dim - self.rope_head_dim

    @property
    def fp8_entry_bytes(self) -> int:
        """One FP8 KV entry: NoPE dims in e4m3, RoPE dims in bf16, a ue8m0 scale per 64 NoPE dims, padded to a
        multiple of 8 (448 + 128 + 7 + 1 pad = 584 B for head_dim 512, rope 64: vLLM / FlashMLA's layout)."""
        nope = self.nope_head_dim
        return -(-(nope + 2 * self.rope_head_dim + -(-nope // FP8_BLOCK)) // 8) * 8

    @property
    def fp4_key_bytes(self) -> int:
        """One FP4 indexer key: two e2m1 codes per byte, a ue8m0 scale per 32 dims, padded to a multiple of 4 (the
        kernels gather 32-bit words): 64 + 4 = 68 B for 128 dims."""
        return -(-(self.index_head_dim // 2 + self.index_head_dim // FP4_BLOCK) // 4) * 4

    @property
    def ratios_in_use(self) -> tuple[int, ...]:
        return tuple(sorted({r for r in self.compress_ratios if r > 0}))

    def lcm_ratio(self) -> int:
        out = 1
        for r in self.ratios_in_use:
            out = math.lcm(out, r)
        return out

    def replace(self, **kw) -> "ModelConfig":
        return dataclasses.replace(self, **kw)

    # ---- readers ---------------------------------------------------------------------------------
    @classmethod
    def from_hf(cls, path: str | os.PathLike) -> "ModelConfig":
        """Read `config.json` from a directory (or a file): HF keys, legacy `compress_ratios`, or the
        official `inference/config.json` keys."""
        path = os.fspath(path)
        cfg_file = path if os.path.isfile(path) else os.path.join(path, "config.json")
        if not os.path.exists(cfg_file):
            alt = os.path.join(path, "inference", "config.json")
            if os.path.exists(alt):
                cfg_file = alt
            else:
                raise ConfigError(f"no config.json in {path}")
        with open(cfg_file) as f:
            raw = json.load(f)
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "ModelConfig":
        if "dim" in raw and "hidden_size" not in raw:
            return _from_official(raw)
        return _from_hf(raw)

    def to_hf_dict(self) -> dict[str, Any]:
        """An HF `config.json` dict (DeepseekV4Config keys) describing this config."""
        rates = {}
        for kind, r in zip(self.layer_types, self.compress_ratios):
            if kind != SLIDING:
                rates.setdefault(_HF_LAYER_TYPE_NAME[kind], r)
        rates.setdefault("compressed_sparse_attention", 4)
        rates.setdefault("heavily_compressed_attention", 128)
        return {
            "architectures": ["DeepseekV4ForCausalLM"],
            "model_type": "deepseek_v4",
            "vocab_size": self.vocab_size,
            "hidden_size": self.dim,
            "num_hidden_layers": self.n_layers,
            "num_attention_heads": self.n_heads,
            "num_key_value_heads": 1,
            "head_dim": self.head_dim,
            "qk_rope_head_dim": self.rope_head_dim,
            "q_lora_rank": self.q_lora_rank,
            "o_groups": self.o_groups,
            "o_lora_rank": self.o_lora_rank,
            "sliding_window": self.window_size,
            "layer_types": [_HF_LAYER_TYPE_NAME[k] for k in self.layer_types],
            "compress_rates": rates,
            "compress_ratios": list(self.compress_ratios) + [self.mtp_compress_ratio] * self.n_mtp_layers,
            "index_n_heads": self.index_n_heads,
            "index_head_dim": self.index_head_dim,
            "index_topk": self.index_topk,
            "n_routed_experts": self.n_routed_experts,
            "n_shared_experts": self.n_shared_experts,
            "num_experts_per_tok": self.n_activated_experts,
            "moe_intermediate_size": self.moe_inter_dim,
            "num_hash_layers": self.n_hash_layers,
            "routed_scaling_factor": self.route_scale,
            "norm_topk_prob": True,
            "scoring_func": self.score_func,
            "swiglu_limit": self.swiglu_limit,
            "hc_mult": self.hc_mult,
            "hc_sinkhorn_iters": self.hc_sinkhorn_iters,
            "hc_eps": self.hc_eps,
            "rms_norm_eps": self.norm_eps,
            "rope_theta": self.rope_theta,
            "compress_rope_theta": self.compress_rope_theta,
            "rope_scaling": {
                "type": "yarn", "rope_type": "yarn", "factor": self.rope_factor,
                "original_max_position_embeddings": self.original_seq_len,
                "beta_fast": self.beta_fast, "beta_slow": self.beta_slow,
            },
            "max_position_embeddings": self.max_seq_len,
            "num_nextn_predict_layers": self.n_mtp_layers,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "tie_word_embeddings": False,
            **self._dspark_keys(),
        }

    def _dspark_keys(self) -> dict[str, Any]:
        if not self.dspark_block_size:
            return {}
        return {"dspark_block_size": self.dspark_block_size, "dspark_noise_token_id": self.dspark_noise_token_id,
                "dspark_target_layer_ids": list(self.dspark_target_layer_ids),
                "dspark_markov_rank": self.dspark_markov_rank}


def _layers_from_ratios(ratios: list[int], csa_ratio: int = 4) -> tuple[tuple[str, ...], tuple[int, ...]]:
    kinds = []
    for r in ratios:
        if r == 0:
            kinds.append(SLIDING)
        elif r == csa_ratio:
            kinds.append(CSA)
        elif r > 0:
            kinds.append(HCA)
        else:
            raise ConfigError(f"compress_ratios entry {r} must be >= 0")
    return tuple(kinds), tuple(int(r) for r in ratios)


DSPARK_KEYS = ("dspark_block_size", "dspark_noise_token_id", "dspark_target_layer_ids", "dspark_markov_rank")


def _dspark(raw: dict[str, Any], n_draft_layers: int | None) -> dict[str, Any]:
    """The DSpark fields of a config (HF or official keys; the same names in both). n_draft_layers: the draft
    layers the layer pattern lists past the main layers (compress_ratios), None if it lists none."""
    keys = sorted(k for k in raw if k.startswith("dspark_"))
    if not keys:
        return {}
    unknown = [k for k in keys if k not in DSPARK_KEYS]
    if unknown:
        raise ConfigError(f"unsupported DSpark config key(s) {unknown}; supported: {list(DSPARK_KEYS)}")
    missing = [k for k in DSPARK_KEYS[:3] if raw.get(k) is None]
    if missing:
        raise ConfigError(f"DSpark config is missing {missing} (the dspark_* keys come together)")
    ids = raw["dspark_target_layer_ids"]
    if not isinstance(ids, (list, tuple)) or not all(isinstance(i, int) for i in ids):
        raise ConfigError(f"dspark_target_layer_ids = {ids!r} must be a list of layer indices")
    out = dict(dspark_block_size=int(raw["dspark_block_size"]),
               dspark_noise_token_id=int(raw["dspark_noise_token_id"]),
               dspark_target_layer_ids=tuple(int(i) for i in ids),
               dspark_markov_rank=int(raw.get("dspark_markov_rank", 256)))
    # The 0731 config keeps num_nextn_predict_layers = 1 and lists its 3 draft layers in compress_ratios; the
    # official inference config says n_mtp_layers.
    n = raw.get("n_mtp_layers", n_draft_layers)
    if n is None:
        raise ConfigError("DSpark config: the number of draft layers is neither in n_mtp_layers nor in "
                          "compress_ratios (one entry per draft layer past the main layers)")
    out["n_mtp_layers"] = int(n)
    return out


def _require(raw: dict, key: str):
    if key not in raw:
        raise ConfigError(f"config is missing required key {key!r}")
    return raw[key]


def _from_hf(raw: dict[str, Any]) -> ModelConfig:
    n = int(_require(raw, "num_hidden_layers"))
    n_mtp = int(raw.get("num_nextn_predict_layers", 1))
    if raw.get("num_key_value_heads", 1) != 1:
        raise ConfigError(f"num_key_value_heads = {raw['num_key_value_heads']}: DeepSeek-V4 has one shared KV head")
    if raw.get("tie_word_embeddings", False):
        raise ConfigError("tie_word_embeddings = true is not supported")
    rates = dict(raw.get("compress_rates") or {})
    csa_rate = int(rates.get("compressed_sparse_attention", raw.get("compress_rate_csa", 4)))
    hca_rate = int(rates.get("heavily_compressed_attention", raw.get("compress_rate_hca", 128)))
    mtp_kind, mtp_ratio = SLIDING, 0
    n_draft = None
    if raw.get("layer_types") is not None:
        names = list(raw["layer_types"])
        bad = [t for t in names if t not in _HF_LAYER_TYPE]
        if bad:
            raise ConfigError(f"layer_types has unsupported entries {bad}")
        kinds = tuple(_HF_LAYER_TYPE[t] for t in names[:n])
        ratios = tuple({SLIDING: 0, CSA: csa_rate, HCA: hca_rate}[k] for k in kinds)
        legacy = raw.get("compress_ratios")
        if legacy is not None and len(legacy) > n:
            mtp_kind, mtp_ratio = _layers_from_ratios([legacy[n]], csa_rate)[0][0], int(legacy[n])
            n_draft = len(legacy) - n
    elif raw.get("compress_ratios") is not None:
        legacy = list(raw["compress_ratios"])
        if len(legacy) < n:
            raise ConfigError(f"compress_ratios has {len(legacy)} entries, need >= num_hidden_layers = {n}")
        kinds, ratios = _layers_from_ratios(legacy[:n], csa_rate)
        if len(legacy) > n:
            mtp_kind, mtp_ratio = _layers_from_ratios([legacy[n]], csa_rate)[0][0], int(legacy[n])
            n_draft = len(legacy) - n
    else:
        raise ConfigError("config has neither 'layer_types' nor 'compress_ratios': the layer pattern must be explicit")
    if len(kinds) != n:
        raise ConfigError(f"layer_types has {len(kinds)} entries, num_hidden_layers is {n}")

    n_hash = raw.get("num_hash_layers")
    if n_hash is None and raw.get("mlp_layer_types") is not None:
        n_hash = sum(1 for t in raw["mlp_layer_types"] if t == "hash_moe")
    n_hash = 3 if n_hash is None else int(n_hash)

    head_dim = int(_require(raw, "head_dim"))
    if raw.get("qk_rope_head_dim") is not None:
        rope_dim = int(raw["qk_rope_head_dim"])
    elif raw.get("partial_rotary_factor") is not None:
        rope_dim = int(round(head_dim * float(raw["partial_rotary_factor"])))
    else:
        rope_dim = 64
    rope = _hf_rope(raw)
    if raw.get("norm_topk_prob", True) is not True:
        raise ConfigError("norm_topk_prob = false is not supported")
    eos = raw.get("eos_token_id", 1)
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    return ModelConfig(
        vocab_size=int(_require(raw, "vocab_size")),
        dim=int(_require(raw, "hidden_size")),
        n_layers=n,
        n_heads=int(_require(raw, "num_attention_heads")),
        head_dim=head_dim,
        rope_head_dim=rope_dim,
        q_lora_rank=int(_require(raw, "q_lora_rank")),
        o_groups=int(raw.get("o_groups", 8)),
        o_lora_rank=int(raw.get("o_lora_rank", 1024)),
        window_size=int(raw.get("sliding_window", 128)),
        layer_types=kinds,
        compress_ratios=ratios,
        index_n_heads=int(raw.get("index_n_heads", 64)),
        index_head_dim=int(raw.get("index_head_dim", 128)),
        index_topk=int(raw.get("index_topk", 512)),
        n_routed_experts=int(raw.get("n_routed_experts", raw.get("num_local_experts", 256))),
        n_shared_experts=int(raw.get("n_shared_experts", 1)),
        n_activated_experts=int(raw.get("num_experts_per_tok", 6)),
        moe_inter_dim=int(raw.get("moe_intermediate_size", 2048)),
        n_hash_layers=n_hash,
        route_scale=float(raw.get("routed_scaling_factor", 1.5)),
        swiglu_limit=float(raw.get("swiglu_limit", 10.0)),
        score_func=str(raw.get("scoring_func", "sqrtsoftplus")),
        hc_mult=int(raw.get("hc_mult", 4)),
        hc_sinkhorn_iters=int(raw.get("hc_sinkhorn_iters", 20)),
        hc_eps=float(raw.get("hc_eps", 1e-6)),
        norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_seq_len=int(raw.get("max_position_embeddings", 1 << 20)),
        mtp_layer_type=mtp_kind,
        mtp_compress_ratio=mtp_ratio,
        bos_token_id=raw.get("bos_token_id", 0),
        eos_token_id=eos,
        **rope,
        **{"n_mtp_layers": n_mtp, **_dspark(raw, n_draft)},
    )


def _hf_rope(raw: dict[str, Any]) -> dict[str, Any]:
    """Rope bases and YaRN params from either a flat `rope_scaling` or HF's nested `rope_parameters`."""
    main_theta = float(raw.get("rope_theta", 10000.0))
    comp_theta = float(raw.get("compress_rope_theta", 160000.0))
    yarn: dict[str, Any] | None = None
    rp = raw.get("rope_parameters")
    if isinstance(rp, dict) and isinstance(rp.get("compress"), dict):
        main_theta = float(rp.get("main", {}).get("rope_theta", main_theta))
        comp = rp["compress"]
        comp_theta = float(comp.get("rope_theta", comp_theta))
        yarn = comp if comp.get("rope_type", comp.get("type")) == "yarn" else {}
    else:
        src = rp if isinstance(rp, dict) and rp else raw.get("rope_scaling")
        if isinstance(src, dict):
            kind = src.get("rope_type", src.get("type", "default"))
            if kind not in ("yarn", "default"):
                raise ConfigError(f"rope type {kind!r} is not supported (only yarn / default)")
            yarn = src if kind == "yarn" else {}
    if yarn is None:
        yarn = {"factor": 16.0, "original_max_position_embeddings": 65536, "beta_fast": 32, "beta_slow": 1}
    if yarn and float(yarn.get("attention_factor", 1.0)) != 1.0:
        raise ConfigError("rope attention_factor != 1.0 is not supported (V4 uses no YaRN mscale)")
    return dict(
        rope_theta=main_theta,
        compress_rope_theta=comp_theta,
        rope_factor=float(yarn.get("factor", 1.0)) if yarn else 1.0,
        original_seq_len=int(yarn.get("original_max_position_embeddings", 65536)) if yarn else 65536,
        beta_fast=float(yarn.get("beta_fast", 32)) if yarn else 32.0,
        beta_slow=float(yarn.get("beta_slow", 1)) if yarn else 1.0,
    )


def _from_official(raw: dict[str, Any]) -> ModelConfig:
    n = int(_require(raw, "n_layers"))
    ratios = list(_require(raw, "compress_ratios"))
    if len(ratios) < n:
        raise ConfigError(f"compress_ratios has {len(ratios)} entries, need >= n_layers = {n}")
    kinds, main_ratios = _layers_from_ratios(ratios[:n])
    mtp_kind, mtp_ratio = SLIDING, 0
    if len(ratios) > n:
        mtp_kind, mtp_ratio = _layers_from_ratios([ratios[n]])[0][0], int(ratios[n])
    dspark = _dspark(raw, len(ratios) - n if len(ratios) > n else None)
    return ModelConfig(
        vocab_size=int(_require(raw, "vocab_size")),
        dim=int(raw["dim"]),
        n_layers=n,
        n_heads=int(_require(raw, "n_heads")),
        head_dim=int(raw.get("head_dim", 512)),
        rope_head_dim=int(raw.get("rope_head_dim", 64)),
        q_lora_rank=int(_require(raw, "q_lora_rank")),
        o_groups=int(_require(raw, "o_groups")),
        o_lora_rank=int(_require(raw, "o_lora_rank")),
        window_size=int(raw.get("window_size", 128)),
        layer_types=kinds,
        compress_ratios=main_ratios,
        index_n_heads=int(raw.get("index_n_heads", 64)),
        index_head_dim=int(raw.get("index_head_dim", 128)),
        index_topk=int(raw.get("index_topk", 512)),
        n_routed_experts=int(_require(raw, "n_routed_experts")),
        n_shared_experts=int(raw.get("n_shared_experts", 1)),
        n_activated_experts=int(_require(raw, "n_activated_experts")),
        moe_inter_dim=int(_require(raw, "moe_inter_dim")),
        n_hash_layers=int(raw.get("n_hash_layers", 0)),
        route_scale=float(raw.get("route_scale", 1.0)),
        swiglu_limit=float(raw.get("swiglu_limit", 10.0)),
        score_func=str(raw.get("score_func", "sqrtsoftplus")),
        hc_mult=int(raw.get("hc_mult", 4)),
        hc_sinkhorn_iters=int(raw.get("hc_sinkhorn_iters", 20)),
        hc_eps=float(raw.get("hc_eps", 1e-6)),
        norm_eps=float(raw.get("norm_eps", 1e-6)),
        rope_theta=float(raw.get("rope_theta", 10000.0)),
        compress_rope_theta=float(raw.get("compress_rope_theta", 160000.0)),
        rope_factor=float(raw.get("rope_factor", 16.0)),
        original_seq_len=int(raw.get("original_seq_len", 65536)),
        beta_fast=float(raw.get("beta_fast", 32)),
        beta_slow=float(raw.get("beta_slow", 1)),
        max_seq_len=int(raw.get("max_seq_len", 1 << 20)),
        mtp_layer_type=mtp_kind,
        mtp_compress_ratio=mtp_ratio,
        **{"n_mtp_layers": int(raw.get("n_mtp_layers", 1)), **dspark},
    )


# ---- presets ---------------------------------------------------------------------------------------
def _pattern(first: list[int], n: int) -> list[int]:
    rest = [4 if i % 2 == 0 else 128 for i in range(len(first), n)]
    return first + rest


def _preset_flash() -> ModelConfig:
    kinds, ratios = _layers_from_ratios(_pattern([0, 0], 43))
    return ModelConfig(
        vocab_size=129280, dim=4096, n_layers=43, n_heads=64, head_dim=512, rope_head_dim=64, q_lora_rank=1024,
        o_groups=8, o_lora_rank=1024, window_size=128, layer_types=kinds, compress_ratios=ratios,
        index_n_heads=64, index_head_dim=128, index_topk=512, n_routed_experts=256, n_shared_experts=1,
        n_activated_experts=6, moe_inter_dim=2048, n_hash_layers=3, route_scale=1.5)


def _preset_pro() -> ModelConfig:
    kinds, ratios = _layers_from_ratios(_pattern([128, 128], 61))
    return ModelConfig(
        vocab_size=129280, dim=7168, n_layers=61, n_heads=128, head_dim=512, rope_head_dim=64, q_lora_rank=1536,
        o_groups=16, o_lora_rank=1024, window_size=128, layer_types=kinds, compress_ratios=ratios,
        index_n_heads=64, index_head_dim=128, index_topk=1024, n_routed_experts=384, n_shared_experts=1,
        n_activated_experts=6, moe_inter_dim=3072, n_hash_layers=3, route_scale=2.5)


def _preset_flash_slice() -> ModelConfig:
    return _preset_flash().replace(
        n_layers=4, layer_types=(CSA, HCA, CSA, HCA), compress_ratios=(4, 128, 4, 128),
        n_routed_experts=16, n_hash_layers=0)


def _preset_flash_1gpu() -> ModelConfig:
    # Every Flash layer (the real pattern: 2 sliding, then CSA / HCA alternating), real attention, indexer and
    # expert widths, routed experts cut to 16 (6 active + 1 shared), no hash layers: ~50 GB in bf16, one H200.
    return _preset_flash().replace(n_routed_experts=16, n_hash_layers=0)


def _preset_flash_h200() -> ModelConfig:
    # Flash whole but for its routed experts: 192 of 256, the most one H200 (139.7 GiB) holds in the release's
    # formats (quantization="fp8": 113.56 GiB of weights, v4jax.memory.param_bytes; 200 experts would be 117.94)
    # with room for the pools and the step's temporaries within the 90 % the fit check allows. In bf16 it needs
    # ~400 GiB: the fit check refuses it there.
    return _preset_flash().replace(n_routed_experts=192)


def _preset_tiny() -> ModelConfig:
    # Every feature on at toy size: sliding, CSA (indexer, 16 heads), HCA, a hash layer, MTP.
    return ModelConfig(
        vocab_size=512, dim=64, n_layers=4, n_heads=4, head_dim=64, rope_head_dim=16, q_lora_rank=32,
        o_groups=2, o_lora_rank=32, window_size=8, layer_types=(SLIDING, CSA, HCA, CSA),
        compress_ratios=(0, 4, 16, 4), index_n_heads=16, index_head_dim=32, index_topk=4,
        n_routed_experts=8, n_shared_experts=1, n_activated_experts=2, moe_inter_dim=32, n_hash_layers=1,
        route_scale=1.5, original_seq_len=64, max_seq_len=4096)


PRESETS = {
    "flash": _preset_flash,
    "pro": _preset_pro,
    "flash-slice": _preset_flash_slice,
    "flash-1gpu": _preset_flash_1gpu,
    "flash-h200": _preset_flash_h200,
    "tiny": _preset_tiny,
}


def preset(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; known: {sorted(PRESETS)}")
    return PRESETS[name]()


# ---- the layer stack: stacks of layers of one shape, and the order in which the model runs them -----------
@dataclasses.dataclass(frozen=True)
class LayerStack:
    """Main layers whose parameters and pools have one shape: same type and ratio. They are held stacked on a
    leading axis, in layer order. The router kind does not split a stack: its first `n_hashed` layers (hash layers
    are the model's first) route by their hash tables, the rest by the top-k gate; the stack holds the tables of
    the first ([n_hashed, V, k]) and the selection biases of the rest ([n - n_hashed, E])."""
    kind: str
    ratio: int
    layers: tuple[int, ...]
    n_hashed: int = 0

    @property
    def n_topk(self) -> int:
        """How many of the stack's layers route by the top-k gate (its last ones)."""
        return len(self.layers) - self.n_hashed


@dataclasses.dataclass(frozen=True)
class Segment:
    """`repeats` repetitions of a period of layers, from layer `start`: layer start + i * len(period) + j belongs
    to stack period[j] at index base[j] + i * step[j]. repeats == 1: run unrolled; > 1: one `lax.scan`.
    hashed[j]: whether the layers of slot j route by the hash table (True), by the top-k gate (False), or some of
    each (None: a scan over the stack's first layers, each picks by its index)."""
    start: int
    period: tuple[int, ...]
    repeats: int
    base: tuple[int, ...]
    step: tuple[int, ...]
    hashed: tuple[bool | None, ...] = ()

    @property
    def n_layers(self) -> int:
        return len(self.period) * self.repeats


@dataclasses.dataclass(frozen=True)
class StackPlan:
    stacks: tuple[LayerStack, ...]
    where: tuple[tuple[int, int], ...]  # main layer -> (stack, index in the stack)
    segments: tuple[Segment, ...]


MAX_PERIOD = 8  # longest period of layer shapes the plan looks for


@functools.lru_cache(maxsize=None)
def layer_stacks(cfg: ModelConfig) -> StackPlan:
    """Group the main layers into stacks of one shape and cover them, in order, with the fewest layer bodies a
    program must hold: periodic runs (Flash's [CSA, HCA] x 20; any pattern of layer shapes that repeats, hash
    layers included) become one scan over their smallest period, an irregular head and tail are unrolled. A
    program's size then depends on the pattern, not on the depth."""
    keys, where, stacks = {}, [], []
    for i in range(cfg.n_layers):
        key = (cfg.layer_type(i), cfg.compress_ratio(i))
        if key not in keys:
            keys[key] = len(stacks)
            stacks.append([])
        g = keys[key]
        where.append((g, len(stacks[g])))
        stacks[g].append(i)
    n_hashed = [sum(cfg.is_hash_layer(i) for i in ls) for ls in stacks]
    gid = [g for g, _ in where]
    n = len(gid)

    def hashed(i, p, r, j):
        """Router kind of slot j of r repetitions of gid[i:i + p]: True / False / None (both)."""
        g = gid[i + j]
        first, last = where[i + j][1], where[i + (r - 1) * p + j][1]
        return True if last < n_hashed[g] else False if first >= n_hashed[g] else None

    # cost of covering layers [0, i): (layer bodies + scans, scan slots that run both router kinds, scans); a
    # scan costs one body more than its period
    inf = (float("inf"), 0, 0)
    best = [inf] * (n + 1)
    back: list = [None] * (n + 1)
    best[0] = (0, 0, 0)
    for i in range(n):
        if best[i] == inf:
            continue
        cands = [(1, 1)]  # one unrolled layer
        for p in range(1, MAX_PERIOD + 1):
            r = 1
            while i + p * (r + 1) <= n and gid[i + p * r:i + p * (r + 1)] == gid[i:i + p]:
                r += 1
            cands += [(p, rr) for rr in range(2, r + 1)]
        for p, r in cands:
            mixed = sum(hashed(i, p, r, j) is None for j in range(p))
            c = best[i][0] + p + (r > 1), best[i][1] + mixed, best[i][2] + (r > 1)
            if c < best[i + p * r]:
                best[i + p * r], back[i + p * r] = c, (i, p, r)
    segs = []
    j = n
    while j > 0:
        i, p, r = back[j]
        period = tuple(gid[i:i + p])
        segs.append(Segment(start=i, period=period, repeats=r, base=tuple(where[i + k][1] for k in range(p)),
                            step=tuple(period.count(g) for g in period),
                            hashed=tuple(hashed(i, p, r, k) for k in range(p))))
        j = i
    names = list(keys)
    return StackPlan(stacks=tuple(LayerStack(*names[g], tuple(ls), n_hashed[g]) for g, ls in enumerate(stacks)),
                     where=tuple(where), segments=tuple(reversed(segs)))
