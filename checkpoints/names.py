"""Map a stored tensor name to its official name (reference §8.2 / §8.4). A pure function of the name.

Three spellings are understood:

* official names (`layers.3.attn.wq_a.weight`, `hc_head_fn`, `mtp.0.e_proj.weight`) pass through;
* what transformers' `DeepseekV4ForCausalLM.save_pretrained` writes (its reverse conversion mapping):
  `model.` prefixes, `model.embed_tokens.weight`, `model.hc_head.hc_fn`, and `model.layers.i.attn.norm.weight`
  for the attention kv_norm (observed with transformers 5.24);
* HF module (state_dict) names: `model.layers.0.self_attn.q_a_proj.weight`, `...mlp.shared_experts.up_proj...`,
  `lm_head.weight`, and the stacked experts `mlp.experts.gate_up_proj` [E, 2I, D] (w1 rows then w3 rows per
  expert) and `mlp.experts.down_proj` [E, D, I], which map to per-expert official names.

HF's FP8 spelling of a block scale (`<module>.weight_scale_inv`) is read as the official `<module>.scale`.
"""
from __future__ import annotations

import dataclasses
import re


@dataclasses.dataclass(frozen=True)
class NameMap:
    """Where a stored tensor goes.

    `official` is the official name, or for a stacked HF expert tensor a template with `{e}` for the expert
    index; `stack` then names the per-expert parts along dim 1 of the stored [E, rows, cols] tensor:
    ("w1", "w3") for gate_up_proj (two equal halves) and ("w2",) for down_proj.
    `official` is None for a name that cannot be mapped. `ignored` marks known duplicates to skip.
    """
    stored: str
    official: str | None
    stack: tuple[str, ...] = ()
    ignored: bool = False

    def expand(self, n_experts: int) -> list[str]:
        """Official names this stored tensor provides."""
        if self.official is None or self.ignored:
            return []
        if not self.stack:
            return [self.official]
        return [self.official.format(e=e, w=w) for e in range(n_experts) for w in self.stack]


# Names directly under the model (after dropping `model.`).
_TOP = {
    "embed_tokens.weight": "embed.weight",
    "lm_head.weight": "head.weight",
    "hc_head.hc_fn": "hc_head_fn",
    "hc_head.hc_base": "hc_head_base",
    "hc_head.hc_scale": "hc_head_scale",
}

# Compressor sub-module leaves, HF -> official.
_COMPRESSOR_LEAF = {"kv_proj": "wkv", "gate_proj": "wgate", "kv_norm": "norm", "position_bias": "ape"}
# Attention leaves, HF -> official; `norm` is what save_pretrained writes for the kv_norm.
_ATTN_LEAF = {"q_a_proj": "wq_a", "q_a_norm": "q_norm", "q_b_proj": "wq_b", "kv_proj": "wkv",
              "o_a_proj": "wo_a", "o_b_proj": "wo_b", "norm": "kv_norm"}
_SHARED_LEAF = {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}

_BLOCK_RE = re.compile(r"^((?:layers|mtp)\.\d+\.)(.*)$")
# Known duplicates some MTP exports carry (official convert.py drops them): shared embedding / head copies.
_MTP_DUPLICATE_RE = re.compile(r"^mtp\.\d+\.(emb\..*|embed\..*|head\.weight)$")


def _leaf_suffix(rest: str) -> tuple[str, str]:
    """Split `module.path.weight` / `.scale` / `.weight_scale_inv` into (module path, official suffix)."""
    for hf, off in ((".weight_scale_inv", ".scale"), (".weight", ".weight"), (".scale", ".scale")):
        if rest.endswith(hf):
            return rest[: -len(hf)], off
    return rest, ""


def _map_attn(rest: str) -> str | None:
    """`rest` is the part after `attn.` / `self_attn.`; returns the official part after `attn.`."""
    if rest == "sinks":
        return "attn_sink"
    if rest == "attn_sink":
        return rest
    module, suffix = _leaf_suffix(rest)
    parts = module.split(".")
    if len(parts) == 1:  # a direct leaf of the attention
        leaf = _ATTN_LEAF.get(parts[0], parts[0])
        return leaf + suffix
    if parts[0] == "compressor":
        if parts[1] == "indexer":  # HF nests the indexer inside the compressor
            tail = parts[2:]
            if tail == ["q_b_proj"]:
                return "indexer.wq_b" + suffix
            if tail == ["scorer", "weights_proj"]:
                return "indexer.weights_proj" + suffix
            if len(tail) == 1:
                return "indexer.compressor." + _COMPRESSOR_LEAF.get(tail[0], tail[0]) + suffix
            return None
        if len(parts) == 2:
            return "compressor." + _COMPRESSOR_LEAF.get(parts[1], parts[1]) + suffix
        return None
    if parts[0] == "indexer":  # already official spelling
        return module + suffix
    return None


def _map_block(rest: str) -> tuple[str | None, tuple[str, ...]]:
    """Part of a name after `layers.N.` / `mtp.N.` -> (official part, expert stack)."""
    for hf, off in (("input_layernorm.", "attn_norm."), ("post_attention_layernorm.", "ffn_norm.")):
        if rest.startswith(hf):
            return off + rest[len(hf):], ()
    m = re.fullmatch(r"(attn|ffn)_hc\.(fn|base|scale)", rest)
    if m:
        return f"hc_{m.group(1)}_{m.group(2)}", ()
    m = re.fullmatch(r"hc_head\.hc_(fn|base|scale)", rest)
    if m:
        return f"hc_head_{m.group(1)}", ()
    for head in ("self_attn.", "attn."):
        if rest.startswith(head):
            sub = _map_attn(rest[len(head):])
            return (None if sub is None else "attn." + sub), ()
    for head in ("mlp.", "ffn."):
        if rest.startswith(head):
            sub = rest[len(head):]
            if sub == "gate.e_score_correction_bias":
                return "ffn.gate.bias", ()
            if sub == "experts.gate_up_proj":
                return "ffn.experts.{e}.{w}.weight", ("w1", "w3")
            if sub == "experts.down_proj":
                return "ffn.experts.{e}.{w}.weight", ("w2",)
            m = re.fullmatch(r"shared_experts\.(gate_proj|down_proj|up_proj)(\..+)", sub)
            if m:
                module, suffix = _leaf_suffix(m.group(2)[1:])
                return f"ffn.shared_experts.{_SHARED_LEAF[m.group(1)]}" + (
                    "." + module if module else "") + suffix, ()
            module, suffix = _leaf_suffix(sub)
            return "ffn." + module + suffix, ()
    module, suffix = _leaf_suffix(rest)
    return module + suffix, ()


def map_name(stored: str) -> NameMap:
    """Official name (or expert-stack template) of a stored tensor name."""
    name = stored[len("model."):] if stored.startswith("model.") else stored
    if _MTP_DUPLICATE_RE.match(name):
        return NameMap(stored, name, ignored=True)
    if name in _TOP:
        return NameMap(stored, _TOP[name])
    m = _BLOCK_RE.match(name)
    if m:
        off, stack = _map_block(m.group(2))
        return NameMap(stored, None if off is None else m.group(1) + off, stack)
    module, suffix = _leaf_suffix(name)
    return NameMap(stored, module + suffix)


def official_name(stored: str) -> str | None:
    """Official name of a stored (non-stacked) tensor name, None if it cannot be mapped."""
    nm = map_name(stored)
    return None if nm.stack or nm.ignored else nm.official
