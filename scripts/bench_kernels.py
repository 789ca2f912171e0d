#!/usr/bin/env python
"""Kernel benchmark (see pallas_kernels/bench.py): each Pallas kernel vs the XLA reference and the HBM roofline.

GPU (the H200):  python scripts/bench_kernels.py            -> $OUT/bench_kernels.{json,md}
Smoke test:      python scripts/bench_kernels.py --small --out /tmp/bench
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from pallas_kernels.bench import main  # noqa: E402

if __name__ == "__main__":
  sys.exit(main())
