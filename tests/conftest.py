"""Shared pytest setup: float32 numerics at full matmul precision for every JAX test."""
import importlib.util
import os
import shutil
import subprocess
import sys

import jax
import pytest

# `import hf_reference` (and xla_flags) from any test module, whatever the rootdir / import mode.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import xla_flags  # noqa: E402

jax.config.update("jax_enable_x64", False)
jax.config.update("jax_default_matmul_precision", "highest")

# The persistent compilation cache (v4jax.compile_cache, on by default) in a temporary directory for the run, one
# for all of a run's xdist workers: programs one worker compiled, the other loads.
if "V4JAX_COMPILATION_CACHE" not in os.environ:
    import tempfile
    _run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if _run:
        os.environ["V4JAX_COMPILATION_CACHE"] = os.path.join(tempfile.gettempdir(), f"v4jax-test-jax-cache-{_run}")
    else:
        os.environ["V4JAX_COMPILATION_CACHE"] = tempfile.mkdtemp(prefix="v4jax-test-jax-cache-")

# On a CPU-only machine the suite's time is mostly XLA compiling; LLVM at -O0 compiles it faster (xla_flags.py).
_accelerator = shutil.which("nvidia-smi") or any(
    importlib.util.find_spec(m) for m in ("jax_cuda12_plugin", "jax_cuda13_plugin", "libtpu"))
if not _accelerator:
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {xla_flags.CPU_OPT}".strip()


@pytest.fixture
def rng():
    import numpy as np
    return np.random.default_rng(0)


@pytest.fixture
def single_device(request):
    """TPU interpret mode wants one device: under a multi-device CPU setup, run the test in a subprocess."""
    if jax.device_count() == 1:
        yield
        return
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", request.node.nodeid],
                       env=env, cwd=str(request.config.rootpath), capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    pytest.skip("passed in a single-device subprocess")


def _mapped_regions() -> int:
    try:
        with open(f"/proc/{os.getpid()}/maps") as f:
            return sum(1 for _ in f)
    except OSError:
        return 0


@pytest.fixture(autouse=True)
def _bounded_compiled_code():
    """XLA:CPU maps each compiled program's code into memory (measured: ~2,000 regions per engine built), and JAX
    keeps every program it compiled until `jax.clear_caches()`, even after its engine is gone. One test process
    builds dozens of engines: past the kernel's vm.max_map_count (65,530) the compiler segfaults. Clear the
    caches between tests once the count is high."""
    yield
    if _mapped_regions() > 25_000:
        import gc
        gc.collect()
        jax.clear_caches()


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """The tiny preset's weights (seed 0, float32) as an HF-format directory."""
    import jax.numpy as jnp
    from flax import nnx

    from checkpoints import write_official_checkpoint
    from v4jax.config import preset
    from v4jax.model import Transformer
    from v4jax.model.weights import model_to_official
    cfg = preset("tiny")
    d = tmp_path_factory.mktemp("tiny-ckpt")
    write_official_checkpoint(d, cfg, model_to_official(Transformer(cfg, rngs=nnx.Rngs(0), dtype=jnp.float32)),
                              fp8=False, fp4_experts=False, bf16=False)
    return str(d)


@pytest.fixture(scope="session")
def real_ckpt(tmp_path_factory):
    """cfg_real_ratios (window 128, CSA 4 with a binding top-16, HCA 128) with random weights, float32 on disk."""
    import hf_reference as H
    from checkpoints import write_official_checkpoint
    cfg = H.cfg_real_ratios()
    d = tmp_path_factory.mktemp("real")
    write_official_checkpoint(d, cfg, H.random_official_tensors(cfg, seed=5, include_mtp=False), fp8=False,
                              fp4_experts=False, bf16=False)
    return str(d)
