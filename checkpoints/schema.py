"""Every tensor of a DeepSeek-V4 checkpoint in official names (reference §8.2), derived from a ModelConfig.

`official_specs(cfg, include_mtp)` gives, per official name, the LOGICAL (dequantized) shape and the storage
kind of the official release:

    "fp8"  float8_e4m3fn weight + `<module>.scale` float8_e8m0fnu, 128x128 blocks
    "fp4"  int8 (two e2m1 per byte) weight [out, in/2] + `<module>.scale` float8_e8m0fnu [out, in/32]
    "bf16" bfloat16
    "f32"  float32
    "i64"  int64 (the hash-routing table `ffn.gate.tid2eid`)

Layer types come from `cfg.layer_types` / `cfg.compress_ratios` (and `cfg.mtp_layer_type` for `mtp.N.`).
"""
from __future__ import annotations

import dataclasses

from v4jax.config import CSA, HCA, SLIDING, ModelConfig

FP8, FP4, BF16, F32, I64 = "fp8", "fp4", "bf16", "f32", "i64"
QUANTIZED_KINDS = (FP8, FP4)
FP8_BLOCK = (128, 128)
FP4_BLOCK = 32


class CheckpointError(ValueError):
    """A checkpoint that does not match the config; the message names the tensor(s) or file(s)."""


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]  # logical (dequantized) shape
    kind: str  # official storage kind, see module docstring


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def scale_name(weight_name: str) -> str:
    """Official name of the block-scale companion of a quantized weight (`x.wq_a.weight` -> `x.wq_a.scale`)."""
    if not weight_name.endswith(".weight"):
        raise ValueError(f"{weight_name!r} is not a weight")
    return weight_name[: -len(".weight")] + ".scale"


def scale_shape(kind: str, shape: tuple[int, ...]) -> tuple[int, int]:
    """Shape of the ue8m0 scale of a weight with logical `shape` stored as `kind`."""
    out, inp = shape
    if kind == FP8:
        return (_ceil_div(out, FP8_BLOCK[0]), _ceil_div(inp, FP8_BLOCK[1]))
    if kind == FP4:
        return (out, _ceil_div(inp, FP4_BLOCK))
    raise ValueError(f"kind {kind!r} has no scale")


def packed_fp4_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    out, inp = shape
    return (out, _ceil_div(inp, 2))


def _block(cfg: ModelConfig, p: str, kind: str, ratio: int, hash_layer: bool, specs: dict) -> None:
    """Tensors of one transformer block (main layer or MTP block) under prefix p."""
    D, H, hd, hc = cfg.dim, cfg.n_heads, cfg.head_dim, cfg.hc_mult
    mix = (2 + hc) * hc

    def add(name, shape, k):
        specs[p + name] = TensorSpec(tuple(int(s) for s in shape), k)

    add("attn_norm.weight", (D,), BF16)
    add("ffn_norm.weight", (D,), BF16)
    for site in ("attn", "ffn"):
        add(f"hc_{site}_fn", (mix, hc * D), F32)
        add(f"hc_{site}_base", (mix,), F32)
        add(f"hc_{site}_scale", (3,), F32)

    add("attn.attn_sink", (H,), F32)
    add("attn.wq_a.weight", (cfg.q_lora_rank, D), FP8)
    add("attn.q_norm.weight", (cfg.q_lora_rank,), BF16)
    add("attn.wq_b.weight", (H * hd, cfg.q_lora_rank), FP8)
    add("attn.wkv.weight", (hd, D), FP8)
    add("attn.kv_norm.weight", (hd,), BF16)
    add("attn.wo_a.weight", (cfg.o_groups * cfg.o_lora_rank, H * hd // cfg.o_groups), FP8)
    add("attn.wo_b.weight", (D, cfg.o_groups * cfg.o_lora_rank), FP8)
    if kind in (CSA, HCA):
        coff = 2 if kind == CSA else 1  # CSA keeps two overlapping series (kv and score halves)
        add("attn.compressor.wkv.weight", (coff * hd, D), BF16)
        add("attn.compressor.wgate.weight", (coff * hd, D), BF16)
        add("attn.compressor.ape", (ratio, coff * hd), F32)
        add("attn.compressor.norm.weight", (hd,), BF16)
    if kind == CSA:
        ihd, ih = cfg.index_head_dim, cfg.index_n_heads
        add("attn.indexer.wq_b.weight", (ih * ihd, cfg.q_lora_rank), FP8)
        add("attn.indexer.weights_proj.weight", (ih, D), BF16)
        add("attn.indexer.compressor.wkv.weight", (2 * ihd, D), BF16)
        add("attn.indexer.compressor.wgate.weight", (2 * ihd, D), BF16)
        add("attn.indexer.compressor.ape", (ratio, 2 * ihd), F32)
        add("attn.indexer.compressor.norm.weight", (ihd,), BF16)

    E, I = cfg.n_routed_experts, cfg.moe_inter_dim
    add("ffn.gate.weight", (E, D), BF16)
    if hash_layer:
        add("ffn.gate.tid2eid", (cfg.vocab_size, cfg.n_activated_experts), I64)
    else:
        add("ffn.gate.bias", (E,), F32)
    for e in range(E):
        add(f"ffn.experts.{e}.w1.weight", (I, D), FP4)
        add(f"ffn.experts.{e}.w2.weight", (D, I), FP4)
        add(f"ffn.experts.{e}.w3.weight", (I, D), FP4)
    if cfg.n_shared_experts:
        SI = cfg.n_shared_experts * I
        add("ffn.shared_experts.w1.weight", (SI, D), FP8)
        add("ffn.shared_experts.w2.weight", (D, SI), FP8)
        add("ffn.shared_experts.w3.weight", (SI, D), FP8)


def official_specs(cfg: ModelConfig, include_mtp: bool) -> dict[str, TensorSpec]:
    """Official name -> TensorSpec for every tensor of the checkpoint (MTP blocks only if include_mtp)."""
    specs: dict[str, TensorSpec] = {}
    D, V, hc = cfg.dim, cfg.vocab_size, cfg.hc_mult
    specs["embed.weight"] = TensorSpec((V, D), BF16)
    for i in range(cfg.n_layers):
        _block(cfg, f"layers.{i}.", cfg.layer_types[i], cfg.compress_ratios[i], cfg.is_hash_layer(i), specs)
    specs["norm.weight"] = TensorSpec((D,), BF16)
    specs["head.weight"] = TensorSpec((V, D), BF16)
    specs["hc_head_fn"] = TensorSpec((hc, hc * D), F32)
    specs["hc_head_base"] = TensorSpec((hc,), F32)
    specs["hc_head_scale"] = TensorSpec((1,), F32)
    if include_mtp and cfg.dspark_block_size:
        _dspark(cfg, specs)
    elif include_mtp:
        for k in range(cfg.n_mtp_layers):
            p = f"mtp.{k}."
            specs[p + "e_proj.weight"] = TensorSpec((D, D), FP8)
            specs[p + "h_proj.weight"] = TensorSpec((D, D), FP8)
            specs[p + "enorm.weight"] = TensorSpec((D,), BF16)
            specs[p + "hnorm.weight"] = TensorSpec((D,), BF16)
            specs[p + "norm.weight"] = TensorSpec((D,), BF16)
            specs[p + "hc_head_fn"] = TensorSpec((hc, hc * D), F32)
            specs[p + "hc_head_base"] = TensorSpec((hc,), F32)
            specs[p + "hc_head_scale"] = TensorSpec((1,), F32)
            _block(cfg, p, cfg.mtp_layer_type, cfg.mtp_compress_ratio, False, specs)
    return specs


def _dspark(cfg: ModelConfig, specs: dict) -> None:
    """The DSpark drafter of the 0731 / -DSpark releases: n_mtp_layers draft layers `mtp.N.` (full sliding-window
    blocks, non-hash MoE), the first with `main_proj` (the target layers' concatenated hidden -> D) and
    `main_norm`, the last with the head's `norm`, `hc_head_*`, the Markov head and the confidence head."""
    D, V, hc, r = cfg.dim, cfg.vocab_size, cfg.hc_mult, cfg.dspark_markov_rank
    last = cfg.n_mtp_layers - 1
    for k in range(cfg.n_mtp_layers):
        p = f"mtp.{k}."
        _block(cfg, p, cfg.mtp_layer_type, cfg.mtp_compress_ratio, False, specs)
        if k == 0:
            specs[p + "main_proj.weight"] = TensorSpec((D, D * len(cfg.dspark_target_layer_ids)), FP8)
            specs[p + "main_norm.weight"] = TensorSpec((D,), BF16)
        if k == last:
            specs[p + "norm.weight"] = TensorSpec((D,), BF16)
            specs[p + "hc_head_fn"] = TensorSpec((hc, hc * D), F32)
            specs[p + "hc_head_base"] = TensorSpec((hc,), F32)
            specs[p + "hc_head_scale"] = TensorSpec((1,), F32)
            specs[p + "markov_head.markov_w1.weight"] = TensorSpec((V, r), BF16)
            specs[p + "markov_head.markov_w2.weight"] = TensorSpec((V, r), BF16)
            specs[p + "confidence_head.proj.weight"] = TensorSpec((1, D + r), BF16)


def official_shapes(cfg: ModelConfig, include_mtp: bool) -> dict[str, tuple[int, ...]]:
    """Official name -> logical (dequantized) shape of every tensor of a V4 checkpoint."""
    return {k: v.shape for k, v in official_specs(cfg, include_mtp).items()}


__all__ = ["CheckpointError", "TensorSpec", "official_specs", "official_shapes", "scale_name", "scale_shape",
           "packed_fp4_shape", "FP8", "FP4", "BF16", "F32", "I64", "SLIDING", "CSA", "HCA"]
