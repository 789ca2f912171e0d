"""`v4jax bench kernels`: the kernel table (pallas_kernels.bench: each kernel against its reference and the
roofline, GPU time from profiler traces)."""
from __future__ import annotations


def kernels_main(argv=None) -> int:
    from pallas_kernels.bench import main
    return main(argv)
