"""Every Pallas TPU kernel, and the engine's jitted steps, compiled for a real TPU (libtpu AOT on this CPU machine: XLA-TPU + Mosaic), at Flash
shapes: catches what `jax.export` lowering does not (Mosaic's DMA tile-alignment checks, VMEM limits).

Slow and optional: needs libtpu, kept out of the default environment (with libtpu importable, JAX looks for a
TPU at start-up). Install it aside and point the test at it:
    pip install --no-deps --target .libtpu libtpu==0.0.42.1
    V4JAX_LIBTPU_DIR=.libtpu python -m pytest -q -m slow tests/test_tpu_aot.py
"""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIBTPU_DIR = os.environ.get("V4JAX_LIBTPU_DIR", os.path.join(ROOT, ".libtpu"))

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not os.path.isdir(os.path.join(LIBTPU_DIR, "libtpu")),
                                 reason=f"libtpu not found in {LIBTPU_DIR} (see the module docstring)")]

# Kernels known not to compile for a TPU yet (strict: one that starts compiling must be taken off the list).
# Empty since the row gathers move whole HBM tiles (pallas_kernels._common.tpu_gather_start).
KNOWN_FAILING: set[str] = set()
KERNELS = ["sparse_attention T=1", "sparse_attention T=2", "indexer_scores", "topk", "compressor_decode CSA main",
           "compressor_decode HCA", "compressor_decode CSA indexer", "compressor_prefill CSA main",
           "compressor_prefill HCA", "compressor_prefill CSA indexer", "engine decode step", "engine prefill step",
           "fp4_experts tensor-8 shard (M=1)", "bf16_experts tensor-8 shard (M=32)"]


@pytest.fixture(scope="module")
def report():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([LIBTPU_DIR, ROOT]), JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    r = subprocess.run([sys.executable, "-m", "v4jax.cli", "bench", "tpu-aot"], env=env, cwd=ROOT,
                       capture_output=True, text=True, timeout=1800)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith(("OK", "FAIL"))]
    assert lines, r.stdout[-3000:] + r.stderr[-3000:]
    return lines


@pytest.mark.parametrize("kernel", KERNELS)
def test_kernel_compiles_for_tpu(report, kernel):
    line = next(ln for ln in report if ln.split(None, 1)[1].startswith(kernel))
    if kernel in KNOWN_FAILING:
        assert line.startswith("FAIL"), f"{kernel} compiles now: drop it from KNOWN_FAILING"
        pytest.xfail(line[:300])
    assert line.startswith("OK"), line


def test_flash_pod_plan_compiles_on_a_v5p_slice():
    """Flash's prefill and decode steps compiled for v5p-16 (8 chips, tensor=8) with abstract weights and pools:
    the compiled arguments are the analytic weights + pools per device (`v4jax bench tpu-plan`)."""
    import json
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([LIBTPU_DIR, ROOT]), JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    r = subprocess.run([sys.executable, "-m", "v4jax.cli", "bench", "tpu-plan", "--preset", "flash",
                        "--topology", "v5p:2x2x2", "--mesh", "tensor=8", "--slots", "8", "--context", "4096"],
                       env=env, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    rows = [json.loads(ln[len("PLAN "):]) for ln in r.stdout.splitlines() if ln.startswith("PLAN ")]
    assert [row["step"] for row in rows] == ["decode", "prefill"], r.stdout[-3000:] + r.stderr[-3000:]
    for row in rows:
        assert row["ok"], row
        static = row["weights_per_device"] + row["pools_per_device"]
        assert abs(row["argument_size_in_bytes"] - static) <= 0.01 * static, row
