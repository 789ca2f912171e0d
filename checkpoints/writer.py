"""Write a checkpoint directory in official names and official storage formats (reference §8.1 / §8.2).

Used by the tests (official FP8/FP4 fixtures from a randomised HF model) and by `v4jax convert`.
"""
from __future__ import annotations

import json
import os
from typing import Mapping

import numpy as np

from v4jax.config import ModelConfig

from . import formats
from .schema import (BF16, F32, FP4, FP4_BLOCK, FP8, FP8_BLOCK, I64, CheckpointError, TensorSpec,
                     official_specs, packed_fp4_shape, scale_name, scale_shape)

INDEX_FILE = "model.safetensors.index.json"
QUANTIZATION_CONFIG = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "scale_fmt": "ue8m0",
    "weight_block_size": [128, 128],
    "activation_scheme": "dynamic",
}


def _storage(spec: TensorSpec, fp8: bool, fp4_experts: bool, bf16: bool) -> str:
    """How one tensor is written: "fp8" | "fp4" | "bf16" | "f32" | "i64"."""
    if spec.kind == FP4:
        return FP4 if fp4_experts else FP8 if fp8 else (BF16 if bf16 else F32)
    if spec.kind == FP8:
        return FP8 if fp8 else (BF16 if bf16 else F32)
    if spec.kind == BF16:
        return BF16 if bf16 else F32
    return spec.kind


def _stored_nbytes(spec: TensorSpec, how: str) -> int:
    n = int(np.prod(spec.shape))
    if how == FP8:
        return n + int(np.prod(scale_shape(FP8, spec.shape)))
    if how == FP4:
        return int(np.prod(packed_fp4_shape(spec.shape))) + int(np.prod(scale_shape(FP4, spec.shape)))
    return n * {BF16: 2, F32: 4, I64: 8}[how]


def encode(name: str, spec: TensorSpec, array: np.ndarray, how: str) -> dict[str, np.ndarray]:
    """Stored tensors (official names) for one logical tensor written as `how`."""
    a = np.asarray(array)
    if how == FP8:
        w, s = formats.quant_fp8_blocks(a.astype(np.float32), FP8_BLOCK)
        return {name: w, scale_name(name): s}
    if how == FP4:
        w, s = formats.quant_fp4(a.astype(np.float32), FP4_BLOCK)
        return {name: w, scale_name(name): s}
    if how == BF16:
        return {name: a.astype(np.float32).astype(formats.BF16)}
    if how == F32:
        return {name: a.astype(np.float32)}
    if how == I64:
        return {name: a.astype(np.int64)}
    raise ValueError(f"unknown storage {how!r}")


def decode(name: str, spec: TensorSpec, stored: dict[str, np.ndarray], how: str) -> np.ndarray:
    """Inverse of `encode`, as the reader does it (float32, or int32 for integer tensors)."""
    w = stored[name]
    if how == FP8:
        return formats.dequant_fp8_blocks(w, stored[scale_name(name)], FP8_BLOCK)
    if how == FP4:
        return formats.unpack_fp4(w, stored[scale_name(name)], FP4_BLOCK)[:, : spec.shape[1]]
    if how == I64:
        return w.astype(np.int32)
    return w.astype(np.float32)


def storage_roundtrip(cfg: ModelConfig, name: str, array: np.ndarray, fp8: bool = True,
                      fp4_experts: bool = True, bf16: bool = True) -> np.ndarray:
    """What a reader gets back for `array` written under `name` with these options."""
    spec = official_specs(cfg, include_mtp=name.startswith("mtp."))[name]
    how = _storage(spec, fp8, fp4_experts, bf16)
    return decode(name, spec, encode(name, spec, array, how), how)


def _check_tensors(cfg: ModelConfig, tensors: Mapping[str, np.ndarray], mtp: bool | None) -> tuple[dict, bool]:
    has_mtp = any(k.startswith("mtp.") for k in tensors)
    include = has_mtp if mtp is None else bool(mtp)
    specs = official_specs(cfg, include_mtp=include)
    problems = []
    for k in specs:
        if k not in tensors:
            problems.append(f"missing tensor {k!r}")
    for k, v in tensors.items():
        if k.startswith("mtp.") and not include:
            continue  # mtp=False drops them
        if k not in specs:
            problems.append(f"unexpected tensor {k!r}")
        elif tuple(np.shape(v)) != specs[k].shape:
            problems.append(f"tensor {k!r} has shape {list(np.shape(v))}, expected {list(specs[k].shape)}")
    if problems:
        more = f"\n  ... and {len(problems) - 25} more" if len(problems) > 25 else ""
        raise CheckpointError(f"cannot write the checkpoint ({len(problems)} problem(s)):\n  - "
                              + "\n  - ".join(problems[:25]) + more)
    return specs, include


def write_official_checkpoint(dir, cfg: ModelConfig, tensors: Mapping[str, np.ndarray], fp8: bool = True,
                              fp4_experts: bool = True, shard_max_bytes: int | None = None,
                              mtp: bool | None = None, bf16: bool = True, overwrite: bool = False,
                              extra_config: dict | None = None, progress: bool = False) -> list[str]:
    """Write `config.json` + safetensors (official names, official dtypes) into `dir`; return the files written.

    tensors: official name -> array with the logical shape (`official_shapes(cfg, include_mtp)`).
    fp8: the linears the release stores as FP8 get e4m3 + ue8m0 128x128 scales (else bf16/f32).
    fp4_experts: routed experts as packed FP4 + 1x32 ue8m0 scales (else FP8 if fp8, else bf16/f32).
    bf16: tensors the release stores as bf16 are written bf16 (False: float32, exact for parity tests).
    mtp: None = write mtp.* iff given; True = require them; False = drop them.
    shard_max_bytes: split into `model-0000i-of-0000n.safetensors` + `model.safetensors.index.json`.
    """
    from safetensors.numpy import save_file

    dir = os.fspath(dir)
    specs, include_mtp = _check_tensors(cfg, tensors, mtp)
    os.makedirs(dir, exist_ok=True)
    if not overwrite:
        clash = [f for f in os.listdir(dir) if f.endswith(".safetensors") or f in ("config.json", INDEX_FILE)]
        if clash:
            raise FileExistsError(f"{dir} already holds {sorted(clash)[:3]}; pass overwrite=True")
    else:
        for f in os.listdir(dir):
            if f.endswith(".safetensors") or f == INDEX_FILE:
                os.remove(os.path.join(dir, f))

    how = {k: _storage(s, fp8, fp4_experts, bf16) for k, s in specs.items()}
    # shard plan: a weight and its scale stay together
    shards: list[list[str]] = [[]]
    size = 0
    for k, s in specs.items():
        nb = _stored_nbytes(s, how[k])
        if shard_max_bytes is not None and shards[-1] and size + nb > shard_max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(k)
        size += nb

    n = len(shards)
    files = []
    weight_map: dict[str, str] = {}
    total = 0
    bar = None
    if progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=len(specs), unit="tensor", desc=f"writing {os.path.basename(dir)}", leave=False)
    for i, names in enumerate(shards):
        fname = "model.safetensors" if shard_max_bytes is None else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        out: dict[str, np.ndarray] = {}
        for k in names:
            for sk, arr in encode(k, specs[k], tensors[k], how[k]).items():
                out[sk] = np.ascontiguousarray(arr)
                weight_map[sk] = fname
                total += arr.nbytes
            if bar is not None:
                bar.update(1)
        save_file(out, os.path.join(dir, fname), metadata={"format": "pt"})
        files.append(fname)
        del out
    if bar is not None:
        bar.close()
    if shard_max_bytes is not None:
        with open(os.path.join(dir, INDEX_FILE), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, f,
                      indent=2)
        files.append(INDEX_FILE)

    conf = cfg.to_hf_dict()
    kinds = set(how.values())
    if FP8 in kinds or FP4 in kinds:
        conf["quantization_config"] = dict(QUANTIZATION_CONFIG)
    if FP4 in kinds:
        conf["expert_dtype"] = "fp4"
    conf["dtype"] = "bfloat16" if bf16 else "float32"
    conf.update(extra_config or {})
    with open(os.path.join(dir, "config.json"), "w") as f:
        json.dump(conf, f, indent=2)
    files.append("config.json")
    return [os.path.join(dir, f) for f in files]
