"""Compiles for a real TPU on a CPU machine (libtpu AOT: XLA-TPU + Mosaic), nothing allocated:

`v4jax bench tpu-aot`: every Pallas TPU kernel (at the Flash shapes) and the engine's jitted steps. Lowering
(`jax.export(..., platforms=["tpu"])`, in CI) does not run Mosaic's own checks (tile alignment of DMA slices, VMEM
limits); this does. Prints one line per kernel (OK with the compiled memory analysis, or the error) and exits 1
if any failed.

`v4jax bench tpu-plan`: the engine's prefill and decode steps of a preset for a TPU pod slice, with abstract
weights and pools sharded by sharding/rules.py. Prints, per device, XLA's memory_analysis() beside the analytic
bytes of the weights and pools as the mesh splits them: one JSON line per step (`PLAN {...}`).

  pip install --no-deps --target .libtpu libtpu==0.0.42.1   # aside: with libtpu importable JAX looks for a TPU
  PYTHONPATH=.libtpu:. JAX_PLATFORMS=cpu v4jax bench tpu-aot [--topology v5e:2x2] [--only NAME ...]
  PYTHONPATH=.libtpu:. JAX_PLATFORMS=cpu v4jax bench tpu-plan --preset flash --topology v5p:2x2x2 --mesh tensor=8
  PYTHONPATH=.libtpu:. JAX_PLATFORMS=cpu v4jax bench tpu-plan --preset pro --topology v5p:4x4x2 \
      --mesh tensor=8,expert=4

tests/test_tpu_aot.py (-m slow) runs both (the Flash plan).
"""
from __future__ import annotations

import argparse
import functools
import importlib
import json
import math
import os
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

SA = importlib.import_module("pallas_kernels.sparse_attention")
IX = importlib.import_module("pallas_kernels.indexer")
TK = importlib.import_module("pallas_kernels.topk")
C = importlib.import_module("pallas_kernels.compressor")
FL = importlib.import_module("pallas_kernels.fp8_linear_tpu")
FX = importlib.import_module("pallas_kernels.fp4_experts_tpu")
BF16, F32, I32 = jnp.bfloat16, jnp.float32, jnp.int32


def cases():
    B, H, D, W, K, Hi, Di, Dm = 32, 64, 512, 128, 512, 64, 128, 4096
    S = 131072 // 4
    A = jax.ShapeDtypeStruct
    out = {}
    for T in (1, 2):
        out[f"sparse_attention T={T} (CSA, B={B})"] = (
            functools.partial(SA._sparse_attention_tpu, scale=D ** -0.5),
            (A((B, T, H, D), BF16), A((B * W, D), BF16), A((B, T, W), I32), A((B * S, D), BF16),
             A((B, T, K), I32), A((H,), F32)))
    out["indexer_scores (B=32, 128K)"] = (
        IX._indexer_scores_tpu, (A((B, 1, Hi, Di), BF16), A((B, 1, Hi), F32), A((B * S, Di), BF16),
                                 A((B, S), I32), A((B, 1), I32)))
    out["topk (approx_max_k + verify, B=32)"] = (functools.partial(TK._topk_approx, k=512), (A((B, 1, S), F32),))
    for name, m, ov, d in (("CSA main", 4, True, 512), ("HCA", 128, False, 512), ("CSA indexer", 4, True, 128)):
        coff = 2 if ov else 1
        rd = 64
        kw = dict(ratio=m, overlap=ov, eps=1e-6)
        state = (A((B, coff * m, coff * d), F32), A((B, coff * m, coff * d), F32))
        weights = (A((coff * d, Dm), BF16), A((coff * d, Dm), BF16), A((m, coff * d), F32), A((d,), F32))
        out[f"compressor_decode {name}"] = (
            functools.partial(C._compressor_decode_tpu, **kw),
            (A((B, Dm), BF16), A((B,), I32)) + state + weights + ((A((B, rd // 2), F32), A((B, rd // 2), F32)),))
        T = 1024
        E = T // m + 2
        out[f"compressor_prefill {name} (T={T})"] = (
            functools.partial(C._compressor_prefill_tpu, **kw),
            (A((4, T, Dm), BF16), A((4,), I32), A((4,), I32), A((4, coff * m, coff * d), F32),
             A((4, coff * m, coff * d), F32)) + weights + (A((4, E, rd // 2), F32), A((4, E, rd // 2), F32)))
    # FP8 linears as stored (a 4-layer stack read in place): Flash's wq_b and the grouped wo_a, a decode step of 32
    # tokens and a 2048-token prefill chunk
    # beside XLA's forms of the same ("XLA": what a TPU ran before; compare their temporaries)
    from v4jax.model import layers as L
    from v4jax.model import ops, quant
    for proj, o, d, g in (("wq_b", 32768, 1024, 1), ("wo_a", 8192, 4096, 8)):
        for m in (1, 32, 2048):
            args = (A((m, g, d) if g > 1 else (m, d), BF16), A((4, o, d), FL.E4M3),
                    A((4, o // 128, d // 128), jnp.float8_e8m0fnu), A((), I32))
            out[f"fp8_linear {proj} (M={m})"] = (
                lambda x, w, s, layer, g=g: FL.fp8_linear(x, w, layer, g, scale=s[layer], interpret=False), args)
            out[f"fp8_linear {proj} (M={m}) XLA"] = (
                lambda x, w, s, layer, g=g: L.linear(x, quant.Quantized(w[layer], s[layer], "fp8"), g), args)
    # FP4 experts as stored, 6 active: a 2-layer stack of 16 Flash-sized experts (I 2048; decode steps of 1 and 32
    # tokens, a 256-token prefill chunk, each against XLA's form), and one device's shard of them under tensor=8
    # (I 256): w2's scales [.., D, I/32] keep 8 columns a row, the lane-sparse stack a whole-model plan showed
    # copied and padded every decode call (a stack of 21 layers of 256 experts, as Flash's CSA layers: a small one
    # is moved into VMEM whole and its relayout does not show)
    e8 = jnp.float8_e8m0fnu
    for name, (n, e, i), ms, xla in (("fp4_experts", (2, 16, 2048), (1, 32, 256), True),
                                     ("fp4_experts tensor-8 shard", (21, 256, 256), (1, 32), False)):
        for m in ms:
            args = (A((m, Dm), BF16), A((m, 6), F32), A((m, 6), I32),
                    A((n, e, i, Dm // 2), jnp.uint8), A((n, e, i, Dm // 32), e8),
                    A((n, e, Dm, i // 2), jnp.uint8), A((n, e, Dm, i // 32), e8),
                    A((n, e, i, Dm // 2), jnp.uint8), A((n, e, i, Dm // 32), e8), A((), I32))
            out[f"{name} (M={m})"] = (
                lambda x, wt, ex, c1, s1, c2, s2, c3, s3, layer: FX.routed_experts_fp4(
                    x, wt, ex, (c1, s1), (c2, s2), (c3, s3), 10.0, lambda h, w: (h * w).astype(BF16), layer=layer,
                    interpret=False), args)
            if xla:
                out[f"{name} (M={m}) XLA"] = (
                    lambda x, wt, ex, c1, s1, c2, s2, c3, s3, layer: ops._experts_xla(
                        x, wt, ex, *(quant.Quantized(c, s, "fp4") for c, s in ((c1, s1), (c2, s2), (c3, s3))), 10.0,
                        layer, act_quant=True), args)
    # bf16 experts, one device's shard under tensor=8 of a 4-layer stack of 256 (XLA copies the layer's experts out
    # of the stack: 512 MB a weight; 4 layers, not Flash's 21: 6 GB of weights that fit a v5e's 15.75 GB)
    EX = importlib.import_module("pallas_kernels.experts_tpu")
    for m in (1, 32, 256):
        args = (A((m, Dm), BF16), A((m, 6), F32), A((m, 6), I32), A((4, 256, 256, Dm), BF16),
                A((4, 256, Dm, 256), BF16), A((4, 256, 256, Dm), BF16), A((), I32))
        out[f"bf16_experts tensor-8 shard (M={m})"] = (
            lambda x, wt, ex, w1, w2, w3, layer: EX.routed_experts(x, wt, ex, w1, w2, w3, 10.0, layer=layer,
                                                                   interpret=False), args)
        out[f"bf16_experts tensor-8 shard (M={m}) XLA"] = (
            lambda x, wt, ex, w1, w2, w3, layer: ops._experts_xla(x, wt, ex, w1, w2, w3, 10.0, layer), args)
    out.update(engine_cases())
    return out


def engine_cases():
    """The engine's jitted prefill and decode steps (XLA attention path) for the `tiny` preset: every op the
    serving loop uses, compiled for the TPU."""
    from v4jax import LLM
    eng = LLM("tiny", dtype="bfloat16", max_num_seqs=4, max_model_len=512, prefill_chunk=64).engine
    steps = engine_steps(eng, 64)
    return {"engine decode step (tiny, XLA attention)": steps["decode"],
            "engine prefill step (tiny, XLA attention, chunk 64)": steps["prefill"]}


def engine_steps(eng, chunk: int) -> dict:
    """An engine's decode step and its prefill step of one row of `chunk` tokens, each as (function, abstract
    arguments): what a backend's compiler or lowering takes without running them."""
    from v4jax.engine import steps as S
    spec = lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype)  # noqa: E731
    s = eng.layout.max_slots
    z = lambda n, dt=np.int32: np.zeros((n,), dt)  # noqa: E731
    state = S.DecodeState(z(s), z(s), z(s, bool), z(s), S.SamplingState.neutral(s))
    pt, swa = eng.kv.decode_tables(2)
    samp = S.SamplingState.neutral(1)
    batch = S.PrefillBatch(np.zeros((1, chunk), np.int32), z(1), z(1), z(1, bool), z(1))
    return {
        "decode": (functools.partial(S._decode, eng.spec),
                   jax.tree.map(spec, (eng._leaves, eng.pools, eng.store, state, pt, swa))),
        "prefill": (functools.partial(S._prefill, eng.spec),
                    jax.tree.map(spec, (eng._leaves, eng.pools, eng.store, batch, pt[:1], swa[:1], samp))),
    }


def aot_main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="v4jax bench tpu-aot", description=__doc__.split("\n\n")[1])
    ap.add_argument("--topology", default="v5e:2x2")
    ap.add_argument("--only", nargs="*", default=None, help="substrings of kernel names")
    a = ap.parse_args(argv)
    from jax.experimental import topologies
    from jax.sharding import Mesh, NamedSharding, PartitionSpec
    topo = topologies.get_topology_desc(platform="tpu", topology_name=a.topology)
    mesh = Mesh(np.array(topo.devices[:1]), ("x",))
    sharding = NamedSharding(mesh, PartitionSpec())
    failed = 0
    for name, (fn, shapes) in cases().items():
        if a.only and not any(s in name for s in a.only):
            continue
        args = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding), shapes)
        try:
            with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):   # lowering rules ask the chip kind
                traced = jax.jit(fn).trace(*args)
            mem = traced.lower().compile().memory_analysis()
            print(f"OK    {name}: temp {getattr(mem, 'temp_size_in_bytes', '?')} B", flush=True)
        except Exception as e:  # noqa: BLE001 - every kernel is tried; the failures are listed
            failed += 1
            msg = str(e).strip().splitlines()
            print(f"FAIL  {name}: {type(e).__name__}: {' | '.join(msg[:3])[:400]}", flush=True)
            if os.environ.get("V4JAX_AOT_TRACEBACK"):
                traceback.print_exc()
    print(f"{topo.devices[0].device_kind} ({a.topology}): {failed} failed")
    return 1 if failed else 0


def per_device_bytes(abstract_tree, shardings) -> int:
    """Bytes one device holds of a tree of arrays placed by these shardings."""
    total = 0
    for a, s in zip(jax.tree.leaves(abstract_tree), jax.tree.leaves(shardings)):
        total += math.prod(s.shard_shape(a.shape)) * np.dtype(a.dtype).itemsize
    return total


def plan(preset_name: str, topology: str, mesh_spec: str, slots: int, context: int, chunk: int, k: int,
         quantization: str = "none", attention_impl: str = "xla"):
    """quantization "fp8": the weights as the release stores them (FP8 linears, FP4 experts); attention_impl
    "pallas": the TPU's Pallas table (its Mosaic kernels, the stored-weight ones included), as a TPU would run it."""
    from jax.experimental import topologies

    from pallas_kernels import _compat
    from v4jax.model import quant

    from sharding import MeshRules, make_mesh
    from sharding.place import state_shardings
    from v4jax import cache as C
    from v4jax.config import preset
    from v4jax.engine import steps as S
    from v4jax.api import EngineOptions
    from v4jax.cache.layout import pool_layout
    from v4jax.model import RunOptions, Transformer

    topo = topologies.get_topology_desc(platform="tpu", topology_name=topology)
    mr = MeshRules(make_mesh(mesh_spec, topo.devices))
    cfg = preset(preset_name)
    dtype = jnp.bfloat16
    weights = quant.RELEASE if quantization == "fp8" else quant.DEQUANTIZED
    abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0), dtype=dtype, mtp=False,  # no MTP run
                                                  weights=weights))
    graphdef, state = nnx.split(abstract)
    leaves, treedef = jax.tree.flatten(state)
    sh_leaves = jax.tree.leaves(state_shardings(state, mr))
    leaves = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s) for a, s in zip(leaves, sh_leaves)]

    # the engine's layout (EngineCore's pool_layout): full pages in data x context blocks, SWA pages per data shard
    n_data, n_ctx = mr.mesh.shape["data"], mr.mesh.shape["context"]
    options = EngineOptions(max_num_seqs=slots, prefill_chunk=chunk, decode_steps=k, enable_prefix_caching=False)
    layout = pool_layout(cfg, options, dtype, context, n_data, n_ctx)
    max_pages, max_swa = layout.max_pages_per_seq, layout.max_swa_pages_per_seq
    pools = jax.eval_shape(lambda: C.init_pools(cfg, layout, dtype))
    pool_sh = C.pool_shardings(pools, mr.sharding)
    pools = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), pools, pool_sh)
    from v4jax.cache.boundary import BoundaryStore
    store = BoundaryStore(layers=tuple(None for _ in pools.stacks))  # prefix cache off
    spec = S.StepSpec(graphdef, treedef, cfg, layout, RunOptions(attention_impl=attention_impl, mesh_rules=mr), k,
                      context, False)
    rep = mr.replicated
    A = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=rep)  # noqa: E731
    i32 = jnp.int32
    samp = lambda n: jax.tree.map(lambda a: A(a.shape, a.dtype), S.SamplingState.neutral(n))  # noqa: E731
    state = S.DecodeState(A((slots,), i32), A((slots,), i32), A((slots,), jnp.bool_), A((slots,), i32), samp(slots))
    batch = S.PrefillBatch(A((1, chunk), i32), A((1,), i32), A((1,), i32), A((1,), jnp.bool_), A((1,), i32))
    steps = {
        "decode": (functools.partial(S._decode, spec),
                   (leaves, pools, store, state, A((slots, max_pages), i32), A((slots, max_swa), i32))),
        "prefill": (functools.partial(S._prefill, spec),
                    (leaves, pools, store, batch, A((1, max_pages), i32), A((1, max_swa), i32), samp(1))),
    }
    weights_dev = per_device_bytes(leaves, sh_leaves)
    pools_dev = per_device_bytes(pools, pool_sh)
    for name, (fn, args) in steps.items():
        t0 = time.time()
        row = dict(step=name, preset=preset_name, topology=topology, device_kind=topo.devices[0].device_kind,
                   devices=len(topo.devices), mesh=mesh_spec, quantization=quantization,
                   attention_impl=attention_impl, slots=slots, context=context,
                   chunk=chunk if name == "prefill" else None, weights_per_device=weights_dev,
                   pools_per_device=pools_dev)
        backend = _compat.backend
        _compat.backend = lambda: "tpu"  # the kernels and the ops table as on the TPU this compiles for
        try:
            compiled = jax.jit(fn, donate_argnums=(1, 2)).trace(*args).lower().compile()
            mem = compiled.memory_analysis()
            row.update(ok=True, **{f: int(getattr(mem, f)) for f in (
                "argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes", "temp_size_in_bytes",
                "generated_code_size_in_bytes") if getattr(mem, f, None) is not None})
        except Exception as e:  # noqa: BLE001 - an OOM or a compile error is the finding
            row.update(ok=False, error=f"{type(e).__name__}: {' | '.join(str(e).strip().splitlines()[:3])[:600]}")
        finally:
            _compat.backend = backend
        row["compile_seconds"] = round(time.time() - t0, 1)
        print("PLAN " + json.dumps(row), flush=True)


def plan_main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="v4jax bench tpu-plan", description=__doc__.split("\n\n")[2])
    ap.add_argument("--preset", default="flash")
    ap.add_argument("--topology", default="v5p:2x2x2")
    ap.add_argument("--mesh", default="tensor=8")
    ap.add_argument("--slots", type=int, default=32)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--decode-steps", type=int, default=8)
    ap.add_argument("--quantization", choices=("none", "fp8"), default="none",
                    help="fp8: the weights as the release stores them (FP8 linears, FP4 routed experts)")
    ap.add_argument("--attention-impl", choices=("xla", "pallas"), default="xla",
                    help="pallas: the TPU's Pallas table (Mosaic kernels, the stored-weight kernels included)")
    a = ap.parse_args(argv)
    plan(a.preset, a.topology, a.mesh, a.slots, a.context, a.chunk, a.decode_steps, a.quantization,
         a.attention_impl)
    return 0
