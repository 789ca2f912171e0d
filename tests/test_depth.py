"""Programs do not grow with depth: the layer stack runs as scans over stacked parameters (config.layer_stacks),
so a 24-layer model's programs are the size of a 4-layer one's and compile in about the same time, for Flash's
pattern and for any pattern of layer shapes that repeats (the hash layers do not break it); a 61-layer Pro-shaped
step compiles ahead of time from abstract weights."""
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

from v4jax import cache as C
from v4jax.cache.layout import full_page_size
from v4jax.config import CSA, HCA, SLIDING, layer_stacks, preset
from v4jax.model import RunOptions, Transformer
from v4jax.model.transformer import Block

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


_RATIO = {SLIDING: 0, CSA: 4, HCA: 16}  # tiny's


def deep_tiny(n_layers: int):
    """tiny at the real Flash pattern: two sliding layers (the first hash-routed), then CSA / HCA alternating."""
    kinds = (SLIDING, SLIDING) + tuple(CSA if i % 2 == 0 else HCA for i in range(n_layers - 2))
    return preset("tiny").replace(n_layers=n_layers, layer_types=kinds,
                                  compress_ratios=tuple(_RATIO[k] for k in kinds))


def periodic_tiny(n_layers: int, unit=(SLIDING, CSA, HCA, CSA), n_hash_layers: int = 1):
    """tiny with its layer types repeating `unit` (by default period 4: sliding, CSA, HCA, CSA), the first
    n_hash_layers hash-routed (tiny's own: one)."""
    kinds = tuple(unit[i % len(unit)] for i in range(n_layers))
    return preset("tiny").replace(n_layers=n_layers, layer_types=kinds, n_hash_layers=n_hash_layers,
                                  compress_ratios=tuple(_RATIO[k] for k in kinds))


def _check_cover(plan, cfg):
    covered = [s.start + i for s in plan.segments for i in range(s.n_layers)]
    assert covered == list(range(cfg.n_layers))
    for s in plan.segments:  # every layer is where the plan says, at its stack index, with its router kind
        for r in range(s.repeats):
            for j, g in enumerate(s.period):
                layer = s.start + r * len(s.period) + j
                assert plan.where[layer] == (g, s.base[j] + r * s.step[j])
                assert s.hashed[j] in (cfg.is_hash_layer(layer), None)
    for st in plan.stacks:  # a stack's hash layers are its first
        assert [i for i in st.layers if cfg.is_hash_layer(i)] == list(st.layers[:st.n_hashed])


def test_plan_scans_the_periodic_run():
    for n in (4, 24, 43):
        plan = layer_stacks(deep_tiny(n))
        bodies = sum(len(s.period) for s in plan.segments)
        assert bodies <= 5, [(s.period, s.repeats) for s in plan.segments]
        _check_cover(plan, deep_tiny(n))
    flash = layer_stacks(preset("flash-1gpu"))
    assert [(s.period, s.repeats) for s in flash.segments][-1][1] == 20  # [HCA, CSA] x 20, one scan
    assert all(h is not None for s in flash.segments for h in s.hashed)  # a static router kind in every slot


@pytest.mark.parametrize("unit", [(CSA,), (SLIDING, CSA), (CSA, HCA, HCA), (SLIDING, CSA, HCA, CSA),
                                  (SLIDING, SLIDING, CSA, HCA), (CSA, HCA, CSA, SLIDING, HCA, HCA)])
@pytest.mark.parametrize("n_hash_layers", [0, 1, 3])
def test_plan_scans_by_the_smallest_period(unit, n_hash_layers):
    """A pattern of layer types that repeats is one scan over its smallest period, whichever its first layers'
    router kind; when the depth is not a multiple of the period, at most one partial period is unrolled."""
    p = len(unit)
    for n in (3 * p, 24 // p * p, 8 * p):
        cfg = periodic_tiny(n, unit, n_hash_layers)
        plan = layer_stacks(cfg)
        _check_cover(plan, cfg)
        assert [(len(s.period), s.repeats) for s in plan.segments] == [(p, n // p)], plan.segments
    for n in (3 * p + 1, 4 * p + p - 1):
        cfg = periodic_tiny(n, unit, n_hash_layers)
        plan = layer_stacks(cfg)
        _check_cover(plan, cfg)
        assert sum(len(s.period) for s in plan.segments) <= 2 * p - 1, plan.segments


def _traced_bodies(cfg) -> dict:
    """How many layer bodies the cached decode step and the full forward trace (Block.cached / Block.__call__
    calls while tracing: an unrolled layer is one, a scan one per slot of its period)."""
    calls = {"cached": 0, "forward": 0}
    cached, forward = Block.cached, Block.__call__

    def count(name, fn):
        def wrapped(*a, **k):
            calls[name] += 1
            return fn(*a, **k)
        return wrapped

    try:
        Block.cached, Block.__call__ = count("cached", cached), count("forward", forward)
        model = _abstract_model(cfg)
        step, args = _decode_step(cfg, model=model)
        jax.eval_shape(step, *args)
        jax.eval_shape(lambda m: m(jnp.zeros((1, 8), jnp.int32)), model)
    finally:
        Block.cached, Block.__call__ = cached, forward
    return calls


def hash_heavy_tiny(n_layers: int):
    """Period 4 led by HCA, three hash layers (a whole period's first three: hash and top-k layers share stacks)."""
    return periodic_tiny(n_layers, (HCA, CSA, CSA, SLIDING), n_hash_layers=3)


@pytest.mark.parametrize("make", [deep_tiny, periodic_tiny, hash_heavy_tiny])
def test_traced_layer_bodies_flat_in_depth(make):
    """The programs hold as many layer bodies at 24 layers as at 4: a compile costs the smallest repeating unit
    of the pattern, whatever the depth."""
    small, deep = _traced_bodies(make(4)), _traced_bodies(make(24))
    assert small == {"cached": 4, "forward": 4} and deep == small, (small, deep)


def _abstract_model(cfg, dtype=jnp.float32):
    return nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0), dtype=dtype, mtp=False))


def _decode_step(cfg, batch=2, pages=2, dtype=jnp.float32, model=None):
    """(the cached decode step of cfg's model, its abstract arguments)."""
    graphdef, state = nnx.split(_abstract_model(cfg, dtype) if model is None else model)
    p = full_page_size(cfg)
    lay = C.PoolLayout(page_size=p, swa_page_size=64, n_pages=batch * pages, n_swa_pages=batch * 4,
                       max_slots=batch, max_pages_per_seq=pages, max_swa_pages_per_seq=4 * pages)
    pools = jax.eval_shape(lambda: C.init_pools(cfg, lay, dtype))

    def step(state, pools, tokens, pos, pt, st):
        meta = C.make_meta(cfg, lay, pos, jnp.ones_like(pos), jnp.zeros(pos.shape, bool), None, pt, st, 1)
        return nnx.merge(graphdef, state).cached(tokens, meta, pools, RunOptions())

    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)
    return step, (state, pools, i32(batch, 1), i32(batch), i32(batch, pages), i32(batch, 4 * pages))


def _lowered_decode(cfg, batch=2, pages=2, dtype=jnp.float32):
    step, args = _decode_step(cfg, batch, pages, dtype)
    return jax.jit(step, donate_argnums=1).lower(*args)


def test_program_size_flat_in_depth():
    small = len(_lowered_decode(deep_tiny(4)).as_text())
    deep = len(_lowered_decode(deep_tiny(24)).as_text())
    assert deep < 1.3 * small, (small, deep)


_FIRST_GENERATE = textwrap.dedent("""
    import json, sys, time
    import jax
    from v4jax import LLM, SamplingParams
    from v4jax.config import preset
    n, unit, head = int(sys.argv[1]), json.loads(sys.argv[2]), json.loads(sys.argv[3])
    ratios = (head + [unit[i % len(unit)] for i in range(n)])[:n]
    kinds = tuple({0: "sliding", 4: "csa", 16: "hca"}[r] for r in ratios)
    cfg = preset("tiny").replace(n_layers=n, layer_types=kinds, compress_ratios=tuple(ratios))
    import v4jax.api as api
    api.preset = lambda name: cfg  # the "tiny" preset (one hash layer) at this pattern and depth
    llm = LLM("tiny", dtype="float32", max_num_seqs=2, max_model_len=128, prefill_chunk=32, decode_steps=4)
    jax.block_until_ready(jax.tree.leaves(llm._state))
    t0, c0 = time.perf_counter(), time.process_time()
    llm.generate([[3, 4, 5] * 7], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    print(json.dumps({"wall_s": time.perf_counter() - t0, "cpu_s": time.process_time() - c0}))
""")

# Layer ratios of tiny's widths: a unit repeated after a head (Flash: two sliding layers, then CSA / HCA; a
# period of 4: sliding, CSA, HCA, CSA from the first layer)
PATTERNS = {"flash": ([4, 16], [0, 0]), "period4": ([0, 4, 16, 4], [])}


def _first_generate(pattern: str, n_layers: int) -> dict:
    env = dict(os.environ, V4JAX_COMPILATION_CACHE="off", JAX_PLATFORMS="cpu")
    unit, head = PATTERNS[pattern]
    r = subprocess.run([sys.executable, "-c", _FIRST_GENERATE, str(n_layers), json.dumps(unit), json.dumps(head)],
                       env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # ~3 min a pattern on 2 idle CPU cores: four fresh processes, each compiling the engine's steps
@pytest.mark.parametrize("pattern", sorted(PATTERNS))
def test_first_generate_compile_flat_in_depth(pattern):
    """A 24-layer model's first generate (prefill and decode programs compiled, no persistent cache) costs within
    1.6x of a 4-layer one's, in CPU seconds of the process (what the compiles cost, whatever else runs on the
    machine's cores; wall seconds in the message): the best of two runs each, interleaved."""
    r4, r24 = [], []
    for _ in range(2):
        r4.append(_first_generate(pattern, 4))
        r24.append(_first_generate(pattern, 24))
    cpu4, cpu24 = min(r["cpu_s"] for r in r4), min(r["cpu_s"] for r in r24)
    assert cpu24 < 1.6 * cpu4, (r4, r24)


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


@pytest.mark.parametrize("weights", ["dequantized", "release"])
def test_random_init_holds_the_stacks_and_one_layer(monkeypatch, weights):
    """A random init copies each layer into its stack as it is made: the arrays alive while building never exceed
    the finished stacks plus one layer (stacking at the end held every layer beside the stacks: flash-h200's 113.6
    GiB ran an H200 out of memory), and stack g's index j holds exactly the layer the plan puts there (the same
    draws, in layer order, as building each layer alone)."""
    from v4jax.model import quant
    from v4jax.model import transformer as T

    fmt = quant.DEQUANTIZED if weights == "dequantized" else quant.RELEASE
    cfg = hash_heavy_tiny(12)
    live = []
    add = T._StackBuilder.add

    def watched(self, j, block):
        add(self, j, block)
        live.append(sum(a.nbytes for a in jax.live_arrays()))

    base = sum(a.nbytes for a in jax.live_arrays())
    monkeypatch.setattr(T._StackBuilder, "add", watched)
    model = Transformer(cfg, rngs=nnx.Rngs(5), dtype=jnp.float32, mtp=False, weights=fmt)
    stacks = sum(a.nbytes for a in jax.tree.leaves(nnx.state(model.stacks)))
    # each layer alone, from the same draws in the same order (the embedding's first)
    draws = T._Draws(nnx.Rngs(5))
    T.Table(cfg.vocab_size, cfg.dim, 1.0, rngs=draws, dtype=jnp.float32)
    layers = [T._store(Block(cfg, i, rngs=draws, dtype=jnp.float32, experts_storage=fmt.experts), fmt)
              for i in range(cfg.n_layers)]
    largest = max(sum(a.nbytes for a in jax.tree.leaves(nnx.state(b))) for b in layers)
    embed = model.embed.weight[...].nbytes
    assert len(live) == cfg.n_layers
    assert max(live) - base <= embed + stacks + largest, (max(live) - base, embed, stacks, largest)
    plan = layer_stacks(cfg)
    for i, b in enumerate(layers):
        g, j = plan.where[i]
        stack, gate = model.stacks[g], b.ffn.gate
        n_hashed = stack.ffn.gate.n_hashed
        if j < n_hashed:  # a hash layer: its token -> experts table
            assert gate.bias is None and jnp.array_equal(stack.ffn.gate.tid2eid[j], gate.tid2eid), i
        else:
            assert gate.tid2eid is None and jnp.array_equal(stack.ffn.gate.bias[j - n_hashed], gate.bias), i
        gate.tid2eid = gate.bias = None
        want = dict(nnx.to_flat_state(nnx.state(b)))
        got = {k: v for k, v in nnx.to_flat_state(nnx.state(stack)) if k[-1] not in ("tid2eid", "bias")}
        assert got.keys() == want.keys()
        for k, v in want.items():
            assert jnp.array_equal(got[k][...][j], v[...]), (i, k)
