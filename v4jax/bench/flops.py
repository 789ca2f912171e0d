"""The prefill's FLOP roofline: the floating-point work a prompt's prefill must do, and the bf16 matmul rate
measured on the device that runs it.

Per prompt token (2 FLOPs per multiply-add):
  projections  every main layer's matmul weights a token passes through: wq_a, wq_b, wkv, wo_a, wo_b; the
               compressors' wkv and wgate; the CSA indexer's wq_b, weights_proj and compressor; the mHC mixes
               (attention and FFN sides); the router
  experts      the shared experts and the n_activated routed experts the token is sent to
  attention    QK and PV over the rows the token's query reads: its window (min(W, p + 1) at position p) plus,
               on CSA layers, min(top_k, (p + 1) // 4) selected entries, on HCA layers every (p + 1) // m entry
  indexer      the CSA indexer's scores: index_heads x index_dim per ready entry ((p + 1) // 4 of them)
plus the LM head for the prompt's last token. Elementwise work (norms, RoPE, softmax, the mHC Sinkhorn, top-k) is
not counted: it is memory-bound, and it is part of what the ratio to this roofline measures.
"""
from __future__ import annotations

import time

import numpy as np

from v4jax import memory as M
from v4jax.config import CSA, SLIDING, ModelConfig


def _token_weights(cfg: ModelConfig) -> tuple[int, int]:
    """(projection, expert) weights one prompt token multiplies by, summed over the main layers."""
    d, n = cfg.dim, cfg.hc_mult
    proj = experts = 0
    for i in range(cfg.n_layers):
        proj += M.attention_weight_count(cfg, i)
        proj += 2 * (2 + n) * n * n * d                                       # mHC mixes, both sides
        proj += cfg.n_routed_experts * d                                      # router
        experts += 3 * cfg.moe_inter_dim * d * (cfg.n_shared_experts + cfg.n_activated_experts)
    return proj, experts


def prefill_flops(cfg: ModelConfig, prompt_len: int, batch: int = 1) -> dict[str, float]:
    """FLOPs of prefilling `batch` prompts of `prompt_len` tokens each, by part (see the module doc)."""
    proj, experts = _token_weights(cfg)
    p = np.arange(prompt_len, dtype=np.float64)
    ready = lambda m: np.floor((p + 1) / m)
    rows = np.zeros_like(p)
    index_keys = np.zeros_like(p)
    for i in range(cfg.n_layers):
        kind, m = cfg.layer_type(i), cfg.compress_ratio(i)
        rows += np.minimum(cfg.window_size, p + 1)
        if kind == CSA:
            rows += np.minimum(cfg.index_topk, ready(m))
            index_keys += ready(m)
        elif kind != SLIDING:
            rows += ready(m)
    out = {"projections": 2.0 * proj * prompt_len, "experts": 2.0 * experts * prompt_len,
           "attention": 4.0 * cfg.n_heads * cfg.head_dim * float(rows.sum()),
           "indexer": 2.0 * cfg.index_n_heads * cfg.index_head_dim * float(index_keys.sum()),
           "head": 2.0 * cfg.vocab_size * cfg.dim}
    out = {key: batch * v for key, v in out.items()}
    out["total"] = sum(out.values())
    return out


def measure_matmul_rate(n: int = 8192, reps: int = 10) -> float:
    """bf16 FLOP/s of one n x n x n matmul (f32 accumulation, bf16 out) on the default device: the fastest of
    `reps` timed calls after a warm-up (the median read 447-455 TFLOP/s in two calls of one H200 session and
    593 in another)."""
    import jax
    import jax.numpy as jnp
    ka, kb = jax.random.split(jax.random.key(3))
    a = jax.random.normal(ka, (n, n), jnp.bfloat16)
    b = jax.random.normal(kb, (n, n), jnp.bfloat16)
    mm = jax.jit(lambda a, b: jnp.matmul(a, b, preferred_element_type=jnp.float32).astype(jnp.bfloat16))
    jax.block_until_ready(mm(a, b))
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(mm(a, b))
        ts.append(time.perf_counter() - t0)
    return 2.0 * n ** 3 / min(ts)
