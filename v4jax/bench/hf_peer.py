"""The HF peer of the decode benchmark: transformers' DeepseekV4ForCausalLM with the JAX model's weights, bf16,
eager attention, on the same device (torch is imported here only). Works with transformers 5.17
(`past_key_values=`) and 5.24 (`cache=`)."""
from __future__ import annotations

import statistics
import time

from v4jax.config import ModelConfig

_KEEP_FP32 = ("attn_hc", "ffn_hc", "hc_head", "sinks", "position_bias", "e_score_correction_bias", "q_a_norm",
              "kv_norm", "input_layernorm", "post_attention_layernorm", "norm")


def _jax_param(model, official: str):
    """The JAX model's array of one official tensor (a slice of its stack / expert axis)."""
    from v4jax.model.weights import official_to_path
    path, index = official_to_path(official, model.cfg)
    node = model
    for p in path:
        node = node[p] if isinstance(p, int) else getattr(node, p)
    arr = node[...]
    return arr[index] if index else arr


def _to_torch(arr, device):
    import torch
    try:
        t = torch.from_dlpack(arr)
    except Exception:  # noqa: BLE001 - fall back to a host copy
        import numpy as np
        t = torch.from_numpy(np.asarray(arr.astype("float32")))
    return t.to(device)


def build_hf_model(cfg: ModelConfig, model, device: str, keep_fp32: bool = True):
    """transformers' DeepseekV4ForCausalLM with `cfg` and the JAX model's weights, bf16 (fp32 where HF keeps
    fp32: `_keep_in_fp32_modules_strict`, unless keep_fp32=False), eval mode, on `device`."""
    import re

    import torch
    import transformers
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
    from transformers.utils import logging as hf_logging

    from checkpoints.names import map_name
    hf_logging.set_verbosity_error()
    hf_cfg = DeepseekV4Config(**cfg.to_hf_dict())
    keep = getattr(DeepseekV4ForCausalLM, "_keep_in_fp32_modules_strict", None) or list(_KEEP_FP32)
    keep_re = re.compile("|".join(rf"((^|\.){re.escape(m)}($|\.))" for m in keep))
    with torch.device(device):
        hf = DeepseekV4ForCausalLM(hf_cfg)
    hf.eval()
    n_set = 0
    with torch.no_grad():
        for name, t in list(hf.named_parameters()) + list(hf.named_buffers()):
            if "rotary_emb" in name:
                continue
            nm = map_name(name)
            names = nm.expand(cfg.n_routed_experts)
            if not names:
                raise KeyError(f"HF tensor {name!r} (transformers {transformers.__version__}) has no official name")
            if nm.stack:
                m = len(nm.stack)
                parts = [_to_torch(_jax_param(model, n), device) for n in names]
                val = torch.stack([torch.cat(parts[e * m:(e + 1) * m], 0) for e in range(cfg.n_routed_experts)])
            else:
                val = _to_torch(_jax_param(model, names[0]), device)
            if tuple(val.shape) != tuple(t.shape):
                raise ValueError(f"{name}: HF shape {tuple(t.shape)} != JAX {tuple(val.shape)} ({names[0]})")
            if t.is_floating_point():
                dt = torch.float32 if keep_fp32 and keep_re.search(name) else torch.bfloat16
                t.data = val.to(dt, copy=True).contiguous()  # a copy: never alias the JAX buffers
            else:
                t.data = val.to(t.dtype, copy=True).contiguous()
            n_set += 1
    return hf, {"transformers": transformers.__version__, "tensors_set": n_set, "fp32_modules_kept": keep_fp32,
                "experts_implementation": getattr(hf.config, "_experts_implementation", None),
                "attn_implementation": getattr(hf.config, "_attn_implementation", None)}


def hf_probe(hf, device: str) -> None:
    """One tiny cached forward (raises what the real run would raise, e.g. a dtype mismatch)."""
    import torch
    with torch.no_grad():
        out = hf(input_ids=torch.full((1, 2), 2, dtype=torch.long, device=device), use_cache=True)
        hf(input_ids=torch.full((1, 1), 2, dtype=torch.long, device=device), use_cache=True,
           **{_cache_kw(hf): _cache_of(out)})


def hf_check(cfg: ModelConfig, model, hf, device: str, n_tokens: int = 32, seed: int = 0) -> dict:
    """Evidence that HF runs the same weights: uncached logits of one random sequence from both models (bf16),
    compared relative to the logits' spread, and the agreement of their argmax."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch
    from flax import nnx

    from v4jax.model import RunOptions
    ids = np.random.default_rng(seed).integers(2, cfg.vocab_size, (1, n_tokens)).astype(np.int32)
    graphdef, state = nnx.split(model)
    fwd = jax.jit(lambda st, t: nnx.merge(graphdef, st)(t, RunOptions()))
    lj = np.asarray(fwd(state, jnp.asarray(ids)))[0].astype(np.float64)
    with torch.no_grad():
        lh = hf(input_ids=torch.as_tensor(ids, dtype=torch.long, device=device), use_cache=False).logits
    lh = lh[0].float().cpu().numpy().astype(np.float64)
    err = np.abs(lj - lh).max(-1) / lj.std(-1)
    return {"tokens": n_tokens, "max_abs_diff_over_std": float(err.max()), "median_over_std": float(np.median(err)),
            "argmax_agree": float((lj.argmax(-1) == lh.argmax(-1)).mean()),
            "corr": float(np.corrcoef(lj.ravel(), lh.ravel())[0, 1])}


def _cache_of(out):
    for name in ("cache", "past_key_values"):
        c = getattr(out, name, None)
        if c is not None:
            return c
    raise RuntimeError("the HF output carries no cache")


def _cache_kw(hf) -> str:
    import inspect
    params = inspect.signature(hf.forward).parameters
    return "past_key_values" if "past_key_values" in params else "cache"


def hf_decode(hf, batch: int, context: int, chunk: int, n_warm: int, n_iter: int, device: str, deadline: float,
              seed: int = 0) -> dict:
    """Chunked prefill of `context` random tokens, then cached one-token decode steps; median step time."""
    import inspect

    import torch
    kw = _cache_kw(hf)
    takes_keep = "logits_to_keep" in inspect.signature(hf.forward).parameters
    gen = torch.Generator(device="cpu").manual_seed(seed)
    ids = torch.randint(2, hf.config.vocab_size, (batch, context + n_warm + n_iter), generator=gen).to(device)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    row = {"batch": batch, "context": context, "chunk": chunk, "cache_kwarg": kw}
    cache = None
    t0 = time.perf_counter()
    with torch.no_grad():
        for a in range(0, context, chunk):
            extra = {"logits_to_keep": 1} if takes_keep else {}
            out = hf(input_ids=ids[:, a:a + chunk], use_cache=True, **{kw: cache}, **extra)
            cache = _cache_of(out)
            del out
            if time.perf_counter() > deadline:
                sync()
                row["error"] = (f"too slow: prefill reached {a + chunk} of {context} tokens in "
                                f"{time.perf_counter() - t0:.0f} s (past --deadline-s)")
                return row
        sync()
        row["prefill_s"] = time.perf_counter() - t0
        times = []
        for i in range(n_warm + n_iter):
            pos = context + i
            sync()
            t1 = time.perf_counter()
            out = hf(input_ids=ids[:, pos:pos + 1], use_cache=True, **{kw: cache})
            nxt = out.logits[:, -1].argmax(-1)
            sync()
            dt = time.perf_counter() - t1
            cache = _cache_of(out)
            del out, nxt
            if i >= n_warm:
                times.append(dt)
    row["ms_per_step"] = statistics.median(times) * 1e3
    row["ms_all"] = [t * 1e3 for t in times]
    if device.startswith("cuda"):
        row["peak_gpu_bytes"] = torch.cuda.max_memory_allocated()
    return row


def have_transformers() -> bool:
    try:
        import torch  # noqa: F401
        from transformers import DeepseekV4ForCausalLM  # noqa: F401
    except Exception:  # noqa: BLE001
        return False
    return True


def free_device_cache() -> None:
    """Give torch's cached GPU memory back (between HF rows, so that JAX rows find it free)."""
    import torch
    torch.cuda.empty_cache()
