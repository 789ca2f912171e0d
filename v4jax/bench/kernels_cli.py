"""`v4jax bench kernels`'s command line: the kernel table (`kernels.py`) or its tile sweeps (`sweeps.py`)."""
from __future__ import annotations

import argparse
import os

from v4jax.bench import kernels, sweeps


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="v4jax bench kernels", description=kernels.__doc__.split("\n")[0],
                              epilog="Tile sweeps (--tune, --sweep NAME): " + sweeps.__doc__.split("\n\n", 1)[1],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--small", action="store_true", help="tiny shapes (smoke test; runs on CPU in interpret mode)")
  p.add_argument("--out", default=None, help="output directory (default $OUT or .)")
  p.add_argument("--only", nargs="*", choices=sorted(set(kernels.ALL) | set(sweeps.TUNE)),
                 help=f"subset of kernels ({', '.join(kernels.ALL)}; with --tune: {', '.join(sweeps.TUNE)})")
  p.add_argument("--iters", type=int, default=None, help="chained runs per jitted call")
  p.add_argument("--repeats", type=int, default=None, help="timed calls (median)")
  p.add_argument("--harness", choices=("unrolled", "loop", "trace"), default="unrolled",
                 help="chain the runs unrolled or in a lax.fori_loop (see time_fn), or sum the kernels' device "
                      "time in a profiler trace (see time_trace)")
  p.add_argument("--tune", action="store_true", help="the decode-sized tile sweeps instead of the table "
                 "(-> tune_kernels.json)")
  p.add_argument("--attention-configs", nargs="*", default=None, metavar="BLOCK:HEADS:WARPS:STAGES:SPLIT",
                 help="--tune: sparse attention configs to sweep (default: a built-in grid)")
  p.add_argument("--sweep", choices=list(sweeps.SWEEPS), default=None, help="one tile sweep instead of the table")
  p.add_argument("--tokens", type=lambda v: [int(x) for x in v.split(",")], default=None, metavar="N[,N]",
                 help="--sweep: tokens of the prefill chunk (prefill_experts: a list; kv_formats: the decode batches)")
  p.add_argument("--keys", type=int, default=None, help="--sweep topk_prefill / indexer_prefill: compressed keys")
  p.add_argument("--k", type=int, default=None, help="--sweep topk_prefill: k")
  p.add_argument("--configs", nargs="*", default=None, metavar="HEADS:WARPS:BLOCK:STAGES:SKIP_TAIL",
                 help="--sweep attention_prefill: tiles to sweep (default: a built-in grid)")
  a = p.parse_args(argv)
  out_dir = a.out or os.environ.get("OUT") or "."
  if a.tune and a.sweep:
    p.error("--tune and --sweep are two different runs")
  if a.tune:
    a.iters = a.iters or (2 if a.small else 10)
    a.repeats = a.repeats or (1 if a.small else 5)
    return sweeps.tune(a, out_dir)
  if a.sweep:
    return sweeps.sweep(a, out_dir)
  if a.only and set(a.only) - set(kernels.ALL):
    p.error(f"--only {' '.join(sorted(set(a.only) - set(kernels.ALL)))}: only with --tune")
  return kernels.run(a)
