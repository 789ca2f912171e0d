"""Pallas kernels for DeepSeek-V4 inference: compressor, indexer scores + exact top-k, sparse attention, and the
GPU kernels of the layer around them (routed experts, layer-stack projections, mHC's Sinkhorn and expansion).

Each kernel has a jnp reference with the same signature: `*_ref` beside it (compressor, indexer, topk,
sparse_attention), or the model's own maths in v4jax.model.layers (sinkhorn, hc_post, routed_experts). The Pallas
version takes `interpret=`: on GPU a Pallas Triton implementation, on TPU a Mosaic one, and with interpret=True (or
on CPU) the TPU-style kernel in TPU interpret mode. See each module's docstring for the design. The modules are the
interface (`from pallas_kernels import topk` is the module pallas_kernels.topk).
"""
