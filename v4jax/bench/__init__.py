"""Benchmarks (`v4jax bench ...`, `python -m v4jax.bench ...`):

  decode.py    `v4jax bench decode`: the jitted decode call and the engine loop on synthetic pools, against the
               roofline and the HF peer
  generate.py  `v4jax bench generate`: what a user of LLM.generate sees (first-call compile time, prefill and
               decode ms/step through the API)
  kernels.py   `v4jax bench kernels`: the kernel table (each Pallas kernel against its reference and the roofline)
  serve.py     `v4jax bench serve`: an open-loop load generator against a running `v4jax serve`
  replay.py    `v4jax bench replay`: request traces against dense / paged / paged + prefix cache
  table.py     `v4jax bench table`: one markdown table from decode.json / generate.json files
  profile.py   what a jitted call runs on the device, from a profiler trace
  memory.py    `python -m v4jax.bench memory`: the `v4jax memory` command (v4jax.cli)
  hf_peer.py   transformers' implementation on the same weights (the only module that imports torch)
"""
from v4jax.bench.decode import decode_main, markdown, measure_bandwidth, roofline_bytes, small_config
from v4jax.bench.memory import memory_main

__all__ = ["decode_main", "generate_main", "kernels_main", "markdown", "measure_bandwidth", "memory_main",
           "roofline_bytes", "small_config"]


def kernels_main(argv=None) -> int:
    from v4jax.bench.kernels_cli import main as run
    return run(argv)


def generate_main(argv=None) -> int:
    from v4jax.bench.generate import generate_main as run
    return run(argv)
