"""Programs do not grow with depth: the layer stack runs as scans over stacked parameters (config.layer_stacks),
so a 24-layer model's programs are the size of a 4-layer one's and compile in about the same time; a 61-layer
Pro-shaped step compiles ahead of time from abstract weights."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from v4jax.cache.layout import full_page_size
from v4jax import cache as C
from v4jax.config import CSA, HCA, SLIDING, layer_stacks, preset
from v4jax.model import RunOptions, Transformer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def deep_tiny(n_layers: int):
    """tiny at the real Flash pattern: two sliding layers (the first hash-routed), then CSA / HCA alternating."""
    kinds = (SLIDING, SLIDING) + tuple(CSA if i % 2 == 0 else HCA for i in range(n_layers - 2))
    return preset("tiny").replace(n_layers=n_layers, layer_types=kinds,
                                  compress_ratios=tuple({SLIDING: 0, CSA: 4, HCA: 16}[k] for k in kinds))


def test_plan_scans_the_periodic_run():
    for n in (4, 24, 43):
        plan = layer_stacks(deep_tiny(n))
        bodies = sum(len(s.period) for s in plan.segments)
        assert bodies <= 5, [(s.period, s.repeats) for s in plan.segments]
        covered = [s.start + i for s in plan.segments for i in range(s.n_layers)]
        assert covered == list(range(n))
        for s in plan.segments:  # every layer is where the plan says, at its stack index
            for r in range(s.repeats):
                for j, g in enumerate(s.period):
                    assert plan.where[s.start + r * len(s.period) + j] == (g, s.base[j] + r * s.step[j])
    flash = layer_stacks(preset("flash-1gpu"))
    assert [(s.period, s.repeats) for s in flash.segments][-1][1] == 20  # [HCA, CSA] x 20, one scan


def _lowered_decode(cfg, batch=2, pages=2, dtype=jnp.float32):
    model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0), dtype=dtype, mtp=False))
    graphdef, state = nnx.split(model)
    p = full_page_size(cfg)
    lay = C.PoolLayout(page_size=p, swa_page_size=64, n_pages=batch * pages, n_swa_pages=batch * 4,
                       max_slots=batch, max_pages_per_seq=pages, max_swa_pages_per_seq=4 * pages)
    pools = jax.eval_shape(lambda: C.init_pools(cfg, lay, dtype))

    def step(state, pools, tokens, pos, pt, st):
        meta = C.make_meta(cfg, lay, pos, jnp.ones_like(pos), jnp.zeros(pos.shape, bool), None, pt, st, 1)
        return nnx.merge(graphdef, state).cached(tokens, meta, pools, RunOptions())

    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)
    return jax.jit(step, donate_argnums=1).lower(state, pools, i32(batch, 1), i32(batch), i32(batch, pages),
                                                 i32(batch, 4 * pages))


def test_program_size_flat_in_depth():
    small = len(_lowered_decode(deep_tiny(4)).as_text())
    deep = len(_lowered_decode(deep_tiny(24)).as_text())
    assert deep < 1.3 * small, (small, deep)


_FIRST_GENERATE = textwrap.dedent("""
    import json, sys, time
    import jax
    from v4jax import LLM, SamplingParams
    from v4jax.config import CSA, HCA, SLIDING, preset
    n = int(sys.argv[1])
    kinds = (SLIDING, SLIDING) + tuple(CSA if i % 2 == 0 else HCA for i in range(n - 2))
    cfg = preset("tiny").replace(n_layers=n, layer_types=kinds,
                                 compress_ratios=tuple({SLIDING: 0, CSA: 4, HCA: 16}[k] for k in kinds))
    import v4jax.api as api
    api.preset = lambda name: cfg  # the "tiny" preset at this depth
    llm = LLM("tiny", dtype="float32", max_num_seqs=2, max_model_len=128, prefill_chunk=32, decode_steps=4)
    jax.block_until_ready(jax.tree.leaves(llm._state))
    t0 = time.perf_counter()
    llm.generate([[3, 4, 5] * 7], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    print(json.dumps({"first_generate_s": time.perf_counter() - t0}))
""")


def _first_generate_s(n_layers: int) -> float:
    env = dict(os.environ, V4JAX_COMPILATION_CACHE="off", JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-c", _FIRST_GENERATE, str(n_layers)], env=env, cwd=ROOT,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])["first_generate_s"]


@pytest.mark.slow  # ~2 min on 2 CPU cores: four fresh processes, each compiling the engine's steps
def test_first_generate_compile_flat_in_depth():
    """A 24-layer model's first generate (prefill + decode programs compiled, no persistent cache) costs
    within 1.6x of a 4-layer one's: the best of two runs each, interleaved, so that a busy machine slows both."""
    t4, t24 = [], []
    for _ in range(2):
        t4.append(_first_generate_s(4))
        t24.append(_first_generate_s(24))
    assert min(t24) < 1.6 * min(t4), (t4, t24)


@pytest.mark.slow  # ~1 min on CPU: lowering and compiling a Pro-sized decode step
def test_pro_decode_step_compiles_from_abstract_weights():
    """All 61 Pro layers (real widths, 384 experts; 1.6T parameters, never allocated) in one decode step, compiled
    ahead of time for this CPU from ShapeDtypeStructs."""
    cfg = preset("pro")
    assert cfg.n_layers == 61
    lowered = _lowered_decode(cfg, batch=1, pages=1, dtype=jnp.bfloat16)
    text = lowered.as_text()
    assert "while" in text  # the periodic run is a loop, not 61 unrolled layers
    compiled = lowered.compile()
    assert compiled is not None
