"""The DeepSeek-V4 model: Flax NNX modules for structure and parameters, run as pure functions of (params, pools,
per-token metadata). Knows nothing of pages or requests."""
from v4jax.model.transformer import (IndexerAux, RoutingAux, RunOptions, Transformer, attention_core,  # noqa: F401
                                     topk_mask)
