"""The DeepSeek-V4 model: Flax NNX modules for structure and parameters, run as pure functions of (params, pools,
per-token metadata). Knows nothing of pages or requests.

  transformer  the layer (Block), the MTP block, Transformer and its layer loop, RunOptions
  attention    Compressor, Indexer, Attention, attention_core
  moe          the router, the routed experts (per shard on a mesh), the shared expert
  layers       the jnp maths and the small shared modules (Linear, RMSNorm, Table)
  ops          the ops table: the XLA maths or the Pallas kernels
  quant        the release's FP8 / FP4 rounding (quant_sim) and weight storage (kept as stored)
  weights      official checkpoint names <-> the model's parameters"""
from v4jax.model.attention import attention_core, topk_mask
from v4jax.model.transformer import IndexerAux, RoutingAux, RunOptions, Transformer

__all__ = ["IndexerAux", "RoutingAux", "RunOptions", "Transformer", "attention_core", "topk_mask"]
