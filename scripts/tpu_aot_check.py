#!/usr/bin/env python
"""Compile every Pallas TPU kernel (at the Flash shapes) and the engine's jitted steps for a real TPU target on a
CPU machine (libtpu AOT: XLA-TPU + Mosaic). Lowering (`jax.export(..., platforms=["tpu"])`, in CI) does not run
Mosaic's own checks (tile alignment of DMA slices, VMEM limits); this does.

  pip install --no-deps --target .libtpu libtpu==0.0.42.1   # aside: with libtpu importable JAX looks for a TPU
  PYTHONPATH=.libtpu:. python scripts/tpu_aot_check.py [--topology v5e:2x2] [--only NAME ...]

Prints one line per kernel (OK with the compiled memory analysis, or the error) and exits 1 if any failed.
tests/test_tpu_aot.py (-m slow) runs it.
"""
import argparse
import functools
import importlib
import os
import sys
import traceback

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

SA = importlib.import_module("pallas_kernels.sparse_attention")
IX = importlib.import_module("pallas_kernels.indexer")
TK = importlib.import_module("pallas_kernels.topk")
C = importlib.import_module("pallas_kernels.compressor")
BF16, F32, I32 = jnp.bfloat16, jnp.float32, jnp.int32


def cases():
  B, H, D, W, K, Hi, Di, Dm = 32, 64, 512, 128, 512, 64, 128, 4096
  S = 131072 // 4
  A = jax.ShapeDtypeStruct
  out = {}
  for T in (1, 2):
    out[f"sparse_attention T={T} (CSA, B={B})"] = (
        functools.partial(SA._sparse_attention_tpu, scale=D ** -0.5),
        (A((B, T, H, D), BF16), A((B * W, D), BF16), A((B, T, W), I32), A((B * S, D), BF16), A((B, T, K), I32),
         A((H,), F32)))
  out["indexer_scores (B=32, 128K)"] = (
      IX._indexer_scores_tpu, (A((B, 1, Hi, Di), BF16), A((B, 1, Hi), F32), A((B * S, Di), BF16), A((B, S), I32),
                               A((B, 1), I32)))
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
  out.update(engine_cases())
  return out


def engine_cases():
  """The engine's jitted prefill and decode steps (XLA attention path) for the `tiny` preset: every op the
  serving loop uses, compiled for the TPU."""
  import functools
  from v4jax import LLM
  from v4jax.engine import steps as S
  eng = LLM("tiny", dtype="bfloat16", max_num_seqs=4, max_model_len=512, prefill_chunk=64).engine
  spec = lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype)
  s = eng.layout.max_slots
  z = lambda n, dt=np.int32: np.zeros((n,), dt)
  state = S.DecodeState(z(s), z(s), z(s, bool), z(s), np.full((s, S.MAX_STOP), -1, np.int32),
                        S.SamplingState(z(s, np.float32), np.ones((s,), np.float32), z(s), z(s), z(s), z(s)))
  pt, swa = eng.kv.decode_tables(2)
  samp = S.SamplingState(z(1, np.float32), np.ones((1,), np.float32), z(1), z(1), z(1), z(1))
  batch = S.PrefillBatch(np.zeros((1, 64), np.int32), z(1), z(1), z(1, bool), z(1))
  return {
      "engine decode step (tiny, XLA attention)": (
          functools.partial(S._decode, eng.spec),
          jax.tree.map(spec, (eng._leaves, eng.pools, eng.store, state, pt, swa))),
      "engine prefill step (tiny, XLA attention, chunk 64)": (
          functools.partial(S._prefill, eng.spec),
          jax.tree.map(spec, (eng._leaves, eng.pools, eng.store, batch, pt[:1], swa[:1], samp))),
  }


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
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


if __name__ == "__main__":
  sys.exit(main())
