"""Version and backend shims shared by the kernels (JAX 0.10.2 in CI, 0.11.x on the H200).

Everything that differs between the JAX versions we run on, or between backends, is looked up here once,
so the kernel modules can import plain names.
"""
from __future__ import annotations

import warnings

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

# pl.ANY is the general "leave it where it is" memory space (pltpu.ANY is deprecated in 0.11).
ANY = getattr(pl, "ANY", None)
if ANY is None:  # pragma: no cover - very old JAX
    ANY = pltpu.ANY

TPUCompilerParams = getattr(pltpu, "CompilerParams", None) or getattr(pltpu, "TPUCompilerParams")


def _import_triton():
    # The Triton backend is deprecated in JAX 0.11 (it still works there); silence the warning once.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from jax.experimental.pallas import triton as pltriton
    return pltriton


pltriton = _import_triton()
TritonCompilerParams = pltriton.CompilerParams


def backend() -> str:
    """'gpu', 'tpu' or 'cpu' (the default backend of this process)."""
    b = jax.default_backend()
    if b in ("cuda", "rocm"):
        return "gpu"
    return b


def tpu_interpret_params():
    """Interpret params for the TPU-style kernels: uninitialised memory is NaN (so outputs start poisoned)
    and out-of-bounds reads raise."""
    return pltpu.InterpretParams()


def interpret_arg(interpret, default_mode: str):
    """The `interpret=` of a TPU-style pallas_call. interpret may be False, True (-> default_mode), "tpu" (TPU
    interpret mode: simulated DMAs/semaphores, NaN-initialised memory, out-of-bounds checks; strict but slow,
    every DMA is a host callback) or "hlo" (the plain HLO interpreter: ~100x faster; enough for kernels whose DMAs
    only read, not for in-place DMA writes to aliased HBM buffers or strided loads)."""
    if interpret is False or interpret is None:
        return False
    mode = default_mode if interpret is True else interpret
    if mode not in ("tpu", "hlo"):
        raise ValueError(f"interpret must be a bool, 'tpu' or 'hlo', got {interpret!r}")
    return tpu_interpret_params() if mode == "tpu" else True


def tpu_abstract_mesh(device_kind: str = "TPU v6 lite"):
    """A 1-device abstract TPU mesh: lowering rules that query the chip (tpu_info) need it when exporting for
    TPU from a CPU machine (jax_anchors §2.4 level B')."""
    from jax.sharding import AbstractDevice, AbstractMesh
    dev = AbstractDevice(device_kind=device_kind, num_cores=1, platform="tpu")
    return AbstractMesh((1,), ("x",), abstract_device=dev)


def export_for_tpu(fn, *args, device_kind: str = "TPU v6 lite"):
    """jax.export for TPU from any machine; returns the Exported (raises if Mosaic lowering fails)."""
    with jax.sharding.use_abstract_mesh(tpu_abstract_mesh(device_kind)):
        return jax.export.export(jax.jit(fn), platforms=["tpu"])(*args)


def lower_for_cuda(fn, *args, device_kind: str = "NVIDIA H200"):
    """Lowers fn for CUDA from any machine (runs the Pallas->Triton lowering); returns the StableHLO text.
    JAX 0.11 asks the (abstract) device for its compute capability, hence the abstract GPU mesh. Each Triton
    module is run through the MLIR verifier the GPU runs before compiling (an ill-typed loop bound lowered here
    and failed only on the GPU), so a bad module raises here."""
    from unittest import mock

    from jax._src.pallas.triton import pallas_call_registration as registration
    from jax.sharding import AbstractDevice, AbstractMesh
    lower_module = registration.lowering.lower_jaxpr_to_triton_module

    def verified(*a, **k):
        result = lower_module(*a, **k)
        result.module.operation.verify()   # raises on an invalid module
        return result

    mesh = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice(device_kind=device_kind, num_cores=None,
                                                                      platform="gpu"))
    with jax.sharding.use_abstract_mesh(mesh), \
            mock.patch.object(registration.lowering, "lower_jaxpr_to_triton_module", verified):
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
