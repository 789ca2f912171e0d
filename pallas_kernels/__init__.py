"""Pallas kernels for DeepSeek-V4 inference: compressor, indexer scores + exact top-k, sparse attention.

Each kernel has a jnp reference `*_ref` (the model's XLA path) and a Pallas version with the same signature plus
`interpret=`: on GPU a Pallas Triton implementation, on TPU a Mosaic one, and with interpret=True (or on CPU) the
TPU-style kernel in TPU interpret mode. See each module's docstring for the design.
"""
from .compressor import (compressor_decode, compressor_decode_ref, compressor_prefill, compressor_prefill_ref,
                         finish_entry, prefill_entry_count, prefill_entry_positions)
from .indexer import indexer_scores, indexer_scores_ref, indexer_topk
from .topk import topk, topk_ref
from .sparse_attention import sparse_attention, sparse_attention_ref

__all__ = [
    "compressor_decode", "compressor_decode_ref", "compressor_prefill", "compressor_prefill_ref",
    "finish_entry", "prefill_entry_count", "prefill_entry_positions",
    "indexer_scores", "indexer_scores_ref", "indexer_topk", "topk", "topk_ref",
    "sparse_attention", "sparse_attention_ref",
]
