"""The release's precision end to end: a checkpoint stored as the release stores it (FP8 e4m3 linears with 128x128
ue8m0 scales, FP4 e2m1 routed experts), loaded as stored, with FP8 cache entries and FP4 indexer keys, on a
data=2 mesh of fake CPU devices, gives the greedy tokens and log-probs (within 1e-4) of the same checkpoint
dequantized at load with the release's numerics simulated (quantization="none", quant_sim=True, bf16 pools) on
one device: hundreds of tokens over prompts that cross every compression boundary, a prefix hit, and an engine
small enough to preempt. A slow test: three engines compile (~15 min on one CPU core).

The device count is fixed when JAX starts, so the runs happen in a subprocess: `python tests/test_native_precision.py
DIR` prints one JSON line per check."""
import json
import os
import subprocess
import sys

import pytest
import xla_flags

HERE = os.path.dirname(os.path.abspath(__file__))
ENGINE = dict(dtype="float32", quant_sim=True, max_num_seqs=4, max_model_len=1200, prefill_chunk=256)


@pytest.mark.slow
def test_native_formats_on_a_mesh_equal_simulated(tmp_path):
    env = dict(os.environ, XLA_FLAGS=xla_flags.cpu(8),
               PYTHONPATH=os.pathsep.join([os.path.dirname(HERE), HERE, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, __file__, str(tmp_path)], env=env, capture_output=True, text=True,
                          timeout=3600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    checks = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [c["check"] for c in checks] == ["batch", "prefix hit", "preempted"], proc.stdout
    for c in checks:
        assert c["same_tokens"] and c["max_logprob_diff"] <= 1e-4, c
    assert checks[1]["hit_tokens"] == 512
    assert checks[2]["preempted"] > 0
    assert checks[0]["weight_bytes_ratio"] <= 0.6  # FP8 linears and FP4 experts against the dequantized load


def _compare(check, got, want, **extra):
    import numpy as np
    same = all(g.token_ids == w.token_ids for g, w in zip(got, want, strict=True))
    diff = max(float(np.max(np.abs(np.asarray(g.logprobs) - np.asarray(w.logprobs))))
               for g, w in zip(got, want, strict=True)) if same else float("inf")
    print(json.dumps(dict(check=check, same_tokens=same, max_logprob_diff=diff, **extra)), flush=True)


def main(directory: str) -> int:
    import dataclasses

    import jax
    import numpy as np

    jax.config.update("jax_default_matmul_precision", "highest")
    import hf_reference as H
    from checkpoints import write_official_checkpoint
    from v4jax import LLM, SamplingParams
    from v4jax.api import EngineOptions
    from v4jax.cache.layout import pool_layout, pool_sizes

    assert jax.device_count() == 8, jax.devices()
    cfg = H.cfg_real_ratios()  # window 128, CSA 4 with a binding top-16, HCA 128
    write_official_checkpoint(directory, cfg, H.random_official_tensors(cfg, seed=5, include_mtp=False), fp8=True,
                              fp4_experts=True, bf16=False)
    ref = LLM(directory, quantization="none", kv_cache_dtype="bfloat16", **ENGINE)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(2, cfg.vocab_size, n).tolist() for n in (1, 128, 255, 700)]
    variant = prompts[3][:512] + rng.integers(2, cfg.vocab_size, 40).tolist()
    params = SamplingParams(max_tokens=150, temperature=0.0, ignore_eos=True, logprobs=True)
    want, want_v = ref.generate(prompts, params), ref.generate([variant], params)
    ref_weights = ref.stats()["weights"]["bytes"]
    del ref

    native = LLM(directory, kv_cache_dtype="fp8", mesh="data=2", **ENGINE)
    ratio = native.stats()["weights"]["bytes"] / ref_weights
    _compare("batch", native.generate(prompts, params), want, weight_bytes_ratio=ratio)
    hit = native.stats()["prefix_cache"]["hit_tokens"]
    _compare("prefix hit", native.generate([variant], params), [want_v[0]],
             hit_tokens=native.stats()["prefix_cache"]["hit_tokens"] - hit)
    del native

    # each data shard's pools hold 5 of the 9 full pages its two requests need: preemption by recompute
    opts = EngineOptions(kv_cache_dtype="fp8", **{k: v for k, v in ENGINE.items() if k != "dtype"})
    lay = dataclasses.replace(pool_layout(cfg, opts, "fp8", 1200, 2), n_pages=10)
    budget = sum(s.bytes for s in pool_sizes(cfg, lay, "fp8", True).values())
    small = LLM(directory, kv_cache_dtype="fp8", mesh="data=2", memory_budget_bytes=budget, **ENGINE)
    _compare("preempted", small.generate(prompts, params), want, pages=small.engine.layout.n_pages,
             preempted=small.stats()["requests"]["preempted"])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
