"""HF transformers reference fixtures for parity tests: randomised `DeepseekV4ForCausalLM` models, their logits,
their weights in official names, and a few canonical small configs.

Every value comes from `init_value(official_name, ...)`, seeded per tensor from (seed, name), so
`build_hf_model(cfg, s)` and `random_official_tensors(cfg, s)` agree on every tensor they share (the latter
adds the MTP block, which HF does not implement).

Randomisation (reference §10.2: HF's own init leaves sinks, biases, position_bias and mHC base at 0 and mHC
scale at 1, which hides ordering bugs):
  norms 1 + 0.1 randn; attention sinks randn; compressor ape 0.5 randn; mHC fn randn/sqrt(fan_in), base 0.5 randn,
  scale 1 + 0.25 randn; router bias 0.3 randn; tid2eid distinct random expert ids per token row; embed randn;
  other linears randn/sqrt(fan_in), except the SwiGLU inputs: routed expert e's w1/w3 use
  scale (1 + 4 e/(E-1)) and the shared expert 3.0, so the swiglu_limit clamp is active in the larger experts
  (w2 divides by the same scale to keep outputs comparable). See `swiglu_clamp_stats`.
"""
from __future__ import annotations

import os
import re
import zlib

import numpy as np

from checkpoints.names import map_name
from checkpoints.schema import official_specs
from v4jax.config import CSA, HCA, SLIDING, ModelConfig

SHARED_EXPERT_SCALE = 3.0


# ---- canonical test configs ------------------------------------------------------------------------------
def cfg_small_ratios() -> ModelConfig:
    """6 layers of all three types at toy ratios: window 8, CSA ratio 4 (indexer 16 heads, top-3 binds from
    ~13 tokens on), HCA ratio 8, two hash layers (a sliding and a CSA one), head_dim 128 with a 64-dim rope
    (nope part a multiple of 64, as the official FP8 KV simulation needs), YaRN active from 64 tokens."""
    return ModelConfig(
        vocab_size=512, dim=64, n_layers=6, n_heads=4, head_dim=128, rope_head_dim=64, q_lora_rank=32,
        o_groups=2, o_lora_rank=32, window_size=8,
        layer_types=(SLIDING, CSA, HCA, CSA, HCA, SLIDING), compress_ratios=(0, 4, 8, 4, 8, 0),
        index_n_heads=16, index_head_dim=64, index_topk=3,
        n_routed_experts=8, n_shared_experts=1, n_activated_experts=2, moe_inter_dim=32, n_hash_layers=2,
        route_scale=1.5, swiglu_limit=10.0, original_seq_len=64, max_seq_len=4096)


def cfg_real_ratios() -> ModelConfig:
    """The real attention geometry at toy width: window 128, CSA ratio 4 (16 indexer heads, top-16 binds from
    68 tokens on), HCA ratio 128, one hash layer, real YaRN settings (factor 16, original 65536)."""
    return ModelConfig(
        vocab_size=512, dim=64, n_layers=4, n_heads=4, head_dim=128, rope_head_dim=64, q_lora_rank=32,
        o_groups=2, o_lora_rank=32, window_size=128,
        layer_types=(SLIDING, CSA, HCA, CSA), compress_ratios=(0, 4, 128, 4),
        index_n_heads=16, index_head_dim=64, index_topk=16,
        n_routed_experts=8, n_shared_experts=1, n_activated_experts=2, moe_inter_dim=32, n_hash_layers=1,
        route_scale=1.5, swiglu_limit=10.0, original_seq_len=65536, max_seq_len=1 << 20)


def cfg_pro_pattern() -> ModelConfig:
    """Pro-style layer pattern (HCA first, no sliding layer, no hash layer) at toy size, 3 active experts."""
    return ModelConfig(
        vocab_size=256, dim=64, n_layers=4, n_heads=4, head_dim=128, rope_head_dim=64, q_lora_rank=32,
        o_groups=2, o_lora_rank=32, window_size=8,
        layer_types=(HCA, CSA, HCA, CSA), compress_ratios=(16, 4, 16, 4),
        index_n_heads=16, index_head_dim=64, index_topk=4,
        n_routed_experts=8, n_shared_experts=1, n_activated_experts=3, moe_inter_dim=32, n_hash_layers=0,
        route_scale=2.5, swiglu_limit=10.0, original_seq_len=64, max_seq_len=4096)


# ---- randomisation, in official names --------------------------------------------------------------------
def _rng(seed: int, name: str) -> np.random.Generator:
    return np.random.default_rng([int(seed), zlib.crc32(name.encode())])


def expert_scale(cfg: ModelConfig, e: int) -> float:
    E = cfg.n_routed_experts
    return 1.0 + 4.0 * e / max(E - 1, 1)


def init_value(name: str, shape: tuple[int, ...], cfg: ModelConfig, seed: int) -> np.ndarray:
    """The random value of one official tensor (float32; int32 for tid2eid)."""
    rng = _rng(seed, name)

    def randn():
        return rng.standard_normal(shape, dtype=np.float32)

    if name.endswith("ffn.gate.tid2eid"):
        V, k = shape
        return np.argsort(rng.random((V, cfg.n_routed_experts)), axis=1)[:, :k].astype(np.int32)
    if name.endswith("ffn.gate.bias"):
        return 0.3 * randn()
    if name.endswith("norm.weight"):  # every RMSNorm: attn/ffn/q/kv/compressor/indexer/final/mtp norms
        return 1.0 + 0.1 * randn()
    if name.endswith("attn.attn_sink"):
        return randn()
    if name.endswith(".ape"):
        return 0.5 * randn()
    if re.search(r"hc_(attn|ffn|head)_fn$", name):
        return randn() / np.float32(np.sqrt(shape[1]))
    if re.search(r"hc_(attn|ffn|head)_base$", name):
        return 0.5 * randn()
    if re.search(r"hc_(attn|ffn|head)_scale$", name):
        return 1.0 + 0.25 * randn()
    if name == "embed.weight":
        return randn()
    m = re.search(r"ffn\.experts\.(\d+)\.(w[123])\.weight$", name)
    if m:
        s = expert_scale(cfg, int(m.group(1)))
        s = 1.0 / s if m.group(2) == "w2" else s
        return randn() * np.float32(s / np.sqrt(shape[1]))
    m = re.search(r"ffn\.shared_experts\.(w[123])\.weight$", name)
    if m:
        s = 1.0 / SHARED_EXPERT_SCALE if m.group(1) == "w2" else SHARED_EXPERT_SCALE
        return randn() * np.float32(s / np.sqrt(shape[1]))
    if name.endswith(".weight") and len(shape) == 2:
        return randn() / np.float32(np.sqrt(shape[1]))
    raise KeyError(f"no randomisation rule for {name!r}")


def random_official_tensors(cfg: ModelConfig, seed: int, include_mtp: bool = True) -> dict[str, np.ndarray]:
    """Every tensor of the checkpoint in official names, randomised as `build_hf_model(cfg, seed)` does."""
    return {n: init_value(n, s.shape, cfg, seed) for n, s in official_specs(cfg, include_mtp).items()}


# ---- the HF model ----------------------------------------------------------------------------------------
def hf_config(cfg: ModelConfig):
    from transformers import DeepseekV4Config
    return DeepseekV4Config(**cfg.to_hf_dict())


def _quiet_transformers():
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()  # the YaRN "explicit factor" warning is expected here (reference §10.2)


def build_hf_model(cfg: ModelConfig, seed: int):
    """A float32 eval-mode `DeepseekV4ForCausalLM` with every learned parameter and buffer randomised."""
    import torch
    from transformers import DeepseekV4ForCausalLM

    if cfg.n_shared_experts != 1:
        raise ValueError(f"n_shared_experts = {cfg.n_shared_experts}: HF 5.24 always builds exactly one shared expert")
    _quiet_transformers()
    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(hf_config(cfg)).float().eval()
    specs = official_specs(cfg, include_mtp=False)
    seen = set()
    with torch.no_grad():
        for hf_name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if ".rotary_emb." in hf_name or hf_name.startswith("model.rotary_emb."):
                continue  # derived RoPE frequencies, not learned
            nm = map_name(hf_name)
            names = nm.expand(cfg.n_routed_experts)
            if not names or any(n not in specs for n in names):
                raise KeyError(f"HF tensor {hf_name!r} maps to {names[:2]} which are not official tensors of cfg")
            if nm.stack:
                parts = [init_value(n, specs[n].shape, cfg, seed) for n in names]
                m = len(nm.stack)
                val = np.stack([np.concatenate(parts[e * m:(e + 1) * m], axis=0)
                                for e in range(cfg.n_routed_experts)])
            else:
                val = init_value(names[0], specs[names[0]].shape, cfg, seed)
            if tuple(val.shape) != tuple(t.shape):
                raise ValueError(f"{hf_name}: HF shape {tuple(t.shape)} != official {val.shape} for {names[0]}")
            t.copy_(torch.from_numpy(val).to(t.dtype))
            seen.update(names)
    unset = set(specs) - seen
    if unset:
        raise RuntimeError(f"HF model has no tensor for official {sorted(unset)[:5]}")
    return model


def save_hf(model, dir, max_shard_size=None) -> str:
    """`save_pretrained` into dir (sharded with an index when max_shard_size is given, e.g. "20KB")."""
    dir = os.fspath(dir)
    if max_shard_size is None:
        model.save_pretrained(dir)
    else:
        model.save_pretrained(dir, max_shard_size=max_shard_size)
    return dir


def hf_logits(model, token_ids: np.ndarray) -> np.ndarray:
    """Uncached forward of one sequence: float32 logits [T, vocab]."""
    import torch
    ids = torch.as_tensor(np.asarray(token_ids, dtype=np.int64)).reshape(1, -1)
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=False)
    return out.logits[0].float().numpy()


def hf_state_as_official(model) -> dict[str, np.ndarray]:
    """The HF model's weights in official names (float32; int32 for tid2eid), stacked experts split."""
    cfg_E = model.config.n_routed_experts
    out: dict[str, np.ndarray] = {}
    for hf_name, t in model.state_dict().items():
        if ".rotary_emb." in hf_name:
            continue
        nm = map_name(hf_name)
        names = nm.expand(cfg_E)
        if not names:
            raise KeyError(f"HF tensor {hf_name!r} has no official name")
        a = t.detach().cpu().numpy()
        if nm.stack:
            m = len(nm.stack)
            rows = a.shape[1] // m
            for e in range(cfg_E):
                for j, w in enumerate(nm.stack):
                    out[nm.official.format(e=e, w=w)] = np.ascontiguousarray(
                        a[e, j * rows:(j + 1) * rows], dtype=np.float32)
        elif a.dtype.kind in "iu":
            out[names[0]] = a.astype(np.int32)
        else:
            out[names[0]] = a.astype(np.float32)
    return out


def swiglu_clamp_stats(model, token_ids: np.ndarray) -> dict[str, float]:
    """Fraction of routed (token, expert) pairs and of shared-expert tokens whose SwiGLU input hit the clamp
    (gate > limit or |up| > limit) in one uncached forward."""
    import torch
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as mod

    hits = {"routed": [0, 0], "shared": [0, 0]}
    limit = model.config.swiglu_limit

    def routed_hook(module, args, kwargs):
        x, idx = (args + (kwargs.get("hidden_states"), kwargs.get("top_k_index")))[:2]
        for e in range(module.num_experts):
            tok = (idx == e).any(dim=-1)
            if tok.any():
                gu = x[tok] @ module.gate_up_proj[e].T
                g, u = gu.chunk(2, dim=-1)
                clamped = (g > limit).any(-1) | (u.abs() > limit).any(-1)
                hits["routed"][0] += int(clamped.sum())
                hits["routed"][1] += int(tok.sum())

    def shared_hook(module, args):
        x = args[0].reshape(-1, args[0].shape[-1])
        g, u = module.gate_proj(x), module.up_proj(x)
        clamped = (g > limit).any(-1) | (u.abs() > limit).any(-1)
        hits["shared"][0] += int(clamped.sum())
        hits["shared"][1] += int(x.shape[0])

    handles = []
    for m in model.modules():
        if isinstance(m, mod.DeepseekV4Experts):
            handles.append(m.register_forward_pre_hook(routed_hook, with_kwargs=True))
        elif isinstance(m, mod.DeepseekV4SparseMoeBlock) and m.shared_experts is not None:
            handles.append(m.shared_experts.register_forward_pre_hook(shared_hook))
    try:
        with torch.no_grad():
            hf_logits(model, token_ids)
    finally:
        for h in handles:
            h.remove()
    return {k: (v[0] / v[1] if v[1] else 0.0) for k, v in hits.items()}
