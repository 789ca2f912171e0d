"""Open an HF-format DeepSeek-V4 checkpoint directory, check it against the config, and stream its tensors.

`open_checkpoint` reads only the safetensors headers (and the shard index), maps every stored name to its
official name (names.py), and checks the whole set against `official_specs(cfg)`: every problem found is
reported in one CheckpointError before any tensor data is read. `Checkpoint.iter_tensors` then yields
(official name, numpy array) one tensor at a time, dequantized to float32 (int32 for `ffn.gate.tid2eid`).

Tensor bytes are read straight from the safetensors files at the offsets their headers give: the numpy
backend of `safetensors` cannot return float8 tensors, and the format is a JSON header plus raw
little-endian arrays, so the header is parsed here.
"""
from __future__ import annotations

import dataclasses
import glob
import json
import math
import os
import struct
from typing import Iterator

import numpy as np

from v4jax.config import ConfigError, ModelConfig

from . import formats
from .names import NameMap, map_name
from .schema import (BF16, F32, FP4, FP4_BLOCK, FP8, FP8_BLOCK, I64, CheckpointError, TensorSpec,
                     official_specs, packed_fp4_shape, scale_name, scale_shape)

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_MAX_LISTED = 25  # problems spelled out in one error message

_ST_DTYPES = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16), "BF16": formats.BF16,
    "F8_E4M3": formats.E4M3, "F8_E8M0": formats.E8M0,
    "I64": np.dtype(np.int64), "I32": np.dtype(np.int32), "I16": np.dtype(np.int16), "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8), "U16": np.dtype(np.uint16), "U32": np.dtype(np.uint32), "U64": np.dtype(np.uint64),
    "BOOL": np.dtype(np.bool_),
}
_FLOAT = ("F32", "BF16", "F16", "F64")
_INT = ("I64", "I32", "I16", "U8", "U16", "U32", "I8")
_SCALE_DTYPES = ("F8_E8M0", "U8", "F32", "BF16")


# ---- safetensors headers ---------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class StoredTensor:
    name: str
    file: str  # path
    dtype: str  # safetensors dtype string
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    nbytes: int

    @property
    def where(self) -> str:
        return os.path.basename(self.file)


def read_header(path: str) -> tuple[dict[str, StoredTensor], dict[str, str]]:
    """Tensors and metadata of one safetensors file, checked for consistency with the file size."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) != 8:
                raise CheckpointError(f"{path}: not a safetensors file (shorter than 8 bytes)")
            (n,) = struct.unpack("<Q", head)
            if n > min(size - 8, 1 << 30):
                raise CheckpointError(f"{path}: header length {n} does not fit the file ({size} bytes)")
            header = json.loads(f.read(n))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: cannot read the safetensors header: {e}") from e
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: safetensors header is not a JSON object")
    meta = header.pop("__metadata__", None) or {}
    base = 8 + n
    out: dict[str, StoredTensor] = {}
    for name, info in header.items():
        try:
            dtype, shape, (b, e) = info["dtype"], tuple(int(s) for s in info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError) as err:
            raise CheckpointError(f"{path}: malformed header entry for tensor {name!r}: {err}") from err
        if dtype not in _ST_DTYPES:
            raise CheckpointError(f"{path}: tensor {name!r} has unsupported dtype {dtype}")
        want = math.prod(shape) * _ST_DTYPES[dtype].itemsize
        if e - b != want or b < 0 or base + e > size:
            raise CheckpointError(f"{path}: tensor {name!r} ({dtype} {list(shape)}) has data offsets [{b}, {e}] "
                                  f"that do not fit its size ({want} bytes) or the file ({size} bytes)")
        out[name] = StoredTensor(name, path, dtype, shape, base + int(b), int(e - b))
    return out, meta


def _find_files(path: str) -> tuple[list[str], dict[str, str] | None, list[str]]:
    """(safetensors files, weight_map from the index or None, problems)."""
    problems: list[str] = []
    if os.path.isfile(path):
        if path.endswith(".json"):
            path = os.path.dirname(path)
        else:
            return [path], None, problems
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint path {path!r} does not exist")
    index = os.path.join(path, INDEX_FILE)
    if os.path.exists(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError("weight_map is not an object")
        except (OSError, KeyError, TypeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{index}: cannot read the shard index: {e}") from e
        files = []
        for shard in dict.fromkeys(weight_map.values()):
            full = os.path.join(path, shard)
            if not os.path.isfile(full):
                names = [k for k, v in weight_map.items() if v == shard]
                problems.append(f"{INDEX_FILE} names shard {shard!r} (holding {names[0]!r}"
                                f"{f' and {len(names) - 1} more' if len(names) > 1 else ''}), "
                                f"which does not exist in {path}")
            else:
                files.append(full)
        return files, weight_map, problems
    single = os.path.join(path, SINGLE_FILE)
    if os.path.isfile(single):
        return [single], None, problems
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise CheckpointError(f"no {SINGLE_FILE}, {INDEX_FILE} or *.safetensors in {path}")
    return files, None, problems


# ---- the plan: where each official tensor comes from ------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Source:
    official: str
    stored: StoredTensor
    spec: TensorSpec
    decode: str  # "float" | "fp8" | "fp4" | "int"
    scale: StoredTensor | None = None
    part: tuple[int, int, tuple[int, ...]] | None = None  # (element offset, element count, shape) in a stack

    @property
    def stored_label(self) -> str:
        return self.stored.name if self.part is None else f"{self.stored.name}[...]"

    @property
    def nbytes(self) -> int:
        n = self.stored.nbytes if self.part is None else self.part[1] * _ST_DTYPES[self.stored.dtype].itemsize
        return n + (self.scale.nbytes if self.scale is not None else 0)

    def sort_key(self):
        off = 0 if self.part is None else self.part[0]
        return (self.stored.file, self.stored.start, off)


def _fmt_shape(s) -> str:
    return "[" + ", ".join(str(x) for x in s) + "]"


def _label(official: str, stored: StoredTensor) -> str:
    if stored.name == official:
        return f"tensor {official!r} (in {stored.where})"
    return f"tensor {official!r} (stored as {stored.name!r} in {stored.where})"


def _plan_one(official: str, spec: TensorSpec, st: StoredTensor, scale: StoredTensor | None,
              problems: list[str]) -> _Source | None:
    """Check one stored tensor (and its scale) against its spec; return its source or record problems."""
    lab = _label(official, st)
    kind = spec.kind
    if st.dtype in _FLOAT and kind in (FP8, FP4, BF16, F32):
        if st.shape != spec.shape:
            problems.append(f"{lab} has shape {_fmt_shape(st.shape)}, expected {_fmt_shape(spec.shape)}")
            return None
        if scale is not None:
            problems.append(f"unexpected tensor {scale.name!r} (in {scale.where}): {official!r} is stored "
                            f"unquantized as {st.dtype}, so it has no scale")
            return None
        return _Source(official, st, spec, "float")
    if st.dtype in _INT and kind == I64:
        if st.shape != spec.shape:
            problems.append(f"{lab} has shape {_fmt_shape(st.shape)}, expected {_fmt_shape(spec.shape)}")
            return None
        return _Source(official, st, spec, "int")
    if (st.dtype == "F8_E4M3" and kind in (FP8, FP4)) or (st.dtype in ("I8", "U8") and kind == FP4):
        fp8 = st.dtype == "F8_E4M3"
        want = spec.shape if fp8 else packed_fp4_shape(spec.shape)
        ok = True
        if st.shape != want:
            what = "" if fp8 else f" (packed FP4 of logical {_fmt_shape(spec.shape)})"
            problems.append(f"{lab} has shape {_fmt_shape(st.shape)}, expected {_fmt_shape(want)}{what}")
            ok = False
        sname = scale_name(official)
        if scale is None:
            problems.append(f"missing tensor {sname!r}: the block scale of {official!r}, which is stored "
                            f"as {st.dtype}")
            return None
        want_s = scale_shape(FP8 if fp8 else FP4, spec.shape)
        if scale.dtype not in _SCALE_DTYPES:
            problems.append(f"{_label(sname, scale)} has dtype {scale.dtype}, expected F8_E8M0 (ue8m0) or F32")
            ok = False
        elif scale.shape != want_s:
            problems.append(f"{_label(sname, scale)} has shape {_fmt_shape(scale.shape)}, expected "
                            f"{_fmt_shape(want_s)} ({'128x128' if fp8 else '1x32'} blocks of "
                            f"{_fmt_shape(spec.shape)})")
            ok = False
        return _Source(official, st, spec, "fp8" if fp8 else "fp4", scale) if ok else None
    allowed = {FP8: "F8_E4M3 (+ .scale) or a float dtype", FP4: "I8 packed FP4 or F8_E4M3 (+ .scale) or a "
               "float dtype", BF16: "a float dtype", F32: "a float dtype", I64: "an integer dtype"}[kind]
    problems.append(f"{lab} has dtype {st.dtype}, expected {allowed}")
    return None


class Checkpoint:
    """A checked checkpoint: `names`, `has_mtp`, `shapes`; `iter_tensors()` streams the data."""

    def __init__(self, path: str, cfg: ModelConfig, sources: dict[str, _Source], has_mtp: bool,
                 files: list[str], ignored: list[str], layout: str):
        self.path = path
        self.cfg = cfg
        self.has_mtp = has_mtp
        self.files = files
        self.ignored = ignored  # stored names skipped as known duplicates
        self.layout = layout  # "official" | "save_pretrained" | "hf_modules" (informational)
        self._sources = dict(sorted(sources.items(), key=lambda kv: kv[1].sort_key()))
        self.names: list[str] = list(self._sources)
        self.shapes: dict[str, tuple[int, ...]] = {k: s.spec.shape for k, s in self._sources.items()}

    def __len__(self) -> int:
        return len(self.names)

    def __contains__(self, name: str) -> bool:
        return name in self._sources

    def stored_name(self, official: str) -> str:
        return self._sources[official].stored.name

    def stored_dtype(self, official: str) -> str:
        """safetensors dtype as stored ("F8_E4M3", "I8" for packed FP4, "BF16", ...)."""
        return self._sources[official].stored.dtype

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self._sources.values())

    def _read_raw(self, st: StoredTensor, fh, part=None) -> np.ndarray:
        dt = _ST_DTYPES[st.dtype]
        if part is None:
            start, count, shape = st.start, math.prod(st.shape), st.shape
        else:
            start, count, shape = st.start + part[0] * dt.itemsize, part[1], part[2]
        buf = np.empty(count * dt.itemsize, dtype=np.uint8)
        fh.seek(start)
        got = fh.readinto(buf)
        if got != buf.size:
            raise CheckpointError(f"{st.file}: tensor {st.name!r} is truncated ({got} of {buf.size} bytes)")
        arr = buf.view(dt).reshape(shape)
        return arr if dt.byteorder in ("=", "|", "<") else arr.astype(dt.newbyteorder("="))

    def weight_format(self) -> tuple[str | None, str | None]:
        """How the tensors the release quantises are stored: ("fp8" if every FP8 linear is e4m3 with block scales,
        else None; "fp4" / "fp8" if every routed expert weight is packed e2m1 / e4m3, else None)."""
        def common(kind: str) -> str | None:
            got = {s.decode for s in self._sources.values() if s.spec.kind == kind}
            return got.pop() if len(got) == 1 and got <= {"fp8", "fp4"} else None
        return common(FP8), common(FP4)

    def _stored(self, src: _Source, handles: dict) -> list[tuple[str, np.ndarray]]:
        """(name, e4m3 or packed int8 weight), (its `.scale`, ue8m0 scales) as stored."""
        arr = self._read_raw(src.stored, self._handle(handles, src.stored.file), src.part)
        scale = self._read_raw(src.scale, self._handle(handles, src.scale.file))
        if scale.dtype != formats.E8M0:
            exp = formats.pow2_scale_exponent(formats.e8m0_to_float(scale), 1.0)
            if not np.array_equal(np.ldexp(np.float32(1.0), exp), formats.e8m0_to_float(scale)):
                raise CheckpointError(f"{_label(scale_name(src.official), src.scale)} holds scales that are not "
                                      f"powers of two: load it with quantization='none'")
            scale = formats.e8m0_from_exponent(exp)
        return [(src.official, arr), (scale_name(src.official), scale)]

    @staticmethod
    def _handle(handles: dict, path: str):
        if path not in handles:
            handles[path] = open(path, "rb")
        return handles[path]

    def _load(self, src: _Source, handles: dict) -> np.ndarray:
        def fh(path):
            return self._handle(handles, path)

        arr = self._read_raw(src.stored, fh(src.stored.file), src.part)
        if src.decode == "float":
            return self._finite(src, arr.astype(np.float32))
        if src.decode == "int":
            if src.official.endswith("ffn.gate.tid2eid"):
                lo, hi = int(arr.min(initial=0)), int(arr.max(initial=0))
                if lo < 0 or hi >= self.cfg.n_routed_experts:
                    raise CheckpointError(f"{_label(src.official, src.stored)} holds expert ids in [{lo}, {hi}], "
                                          f"outside [0, {self.cfg.n_routed_experts})")
            return arr.astype(np.int32)
        scale = self._read_raw(src.scale, fh(src.scale.file))
        if src.decode == "fp8":
            return self._finite(src, formats.dequant_fp8_blocks(arr, scale, FP8_BLOCK))
        out = formats.unpack_fp4(arr, scale, FP4_BLOCK)
        return self._finite(src, out[:, : src.spec.shape[1]] if out.shape[1] != src.spec.shape[1] else out)

    @staticmethod
    def _finite(src: _Source, arr: np.ndarray) -> np.ndarray:
        """Every weight must be finite: random bytes in a file decode to NaN / inf somewhere (and a model with
        one NaN weight emits token 0 forever). A host pass at memory speed (~6 GB/s), as each tensor arrives, so
        a corrupt file fails at its first bad tensor."""
        if not np.isfinite(arr).all():
            bad = int(arr.size - np.isfinite(arr).sum())
            raise CheckpointError(f"{_label(src.official, src.stored)} holds {bad} non-finite value(s) (NaN or "
                                  f"inf) of {arr.size}: the checkpoint is corrupt")
        return arr

    def read(self, official: str) -> np.ndarray:
        """One tensor by official name (dequantized float32, or int32 for tid2eid)."""
        if official not in self._sources:
            raise KeyError(f"{official!r} is not in this checkpoint")
        handles: dict = {}
        try:
            return self._load(self._sources[official], handles)
        finally:
            for h in handles.values():
                h.close()

    def iter_tensors(self, progress: bool = True, names=None,
                     stored: tuple[str, ...] = ()) -> Iterator[tuple[str, np.ndarray]]:
        """Yield (official name, array) for every tensor (or `names`), in storage order, one at a time. A tensor
        stored quantized in one of the `stored` formats ("fp8", "fp4") comes as stored, followed by its `.scale`
        (ue8m0); every other one dequantized."""
        wanted = None if names is None else set(names)
        todo = self.names if wanted is None else [n for n in self.names if n in wanted]
        if wanted is not None:
            unknown = wanted - set(self._sources)
            if unknown:
                raise KeyError(f"not in this checkpoint: {sorted(unknown)[:5]}")
        bar = None
        if progress:
            from tqdm import tqdm  # a text bar, on terminals only (disable=None): not in notebooks or logs
            bar = tqdm(total=sum(self._sources[n].nbytes for n in todo), unit="B", unit_scale=True, disable=None,
                       desc=f"loading {os.path.basename(os.path.normpath(self.path))}", leave=False)
        handles: dict = {}
        try:
            for n in todo:
                src = self._sources[n]
                pieces = (self._stored(src, handles) if src.decode in stored
                          else [(n, self._load(src, handles))])
                if bar is not None:
                    bar.update(src.nbytes)
                yield from pieces
        finally:
            for h in handles.values():
                h.close()
            if bar is not None:
                bar.close()

    def __repr__(self) -> str:
        return (f"Checkpoint({self.path!r}, {len(self.names)} tensors, layout={self.layout}, "
                f"has_mtp={self.has_mtp}, {len(self.files)} file(s))")


def _raise(path: str, problems: list[str]) -> None:
    shown = problems[:_MAX_LISTED]
    more = len(problems) - len(shown)
    msg = (f"checkpoint {path} does not match the config ({len(problems)} problem(s)):\n  - "
           + "\n  - ".join(shown) + (f"\n  ... and {more} more" if more else ""))
    raise CheckpointError(msg)


def open_checkpoint(path, cfg: ModelConfig | None = None) -> Checkpoint:
    """Check a checkpoint directory against `cfg` (default: its own config.json) from headers alone."""
    path = os.fspath(path)
    if cfg is None:
        try:
            cfg = ModelConfig.from_hf(path if os.path.isdir(path) else os.path.dirname(path))
        except ConfigError as e:
            raise CheckpointError(f"config of {path}: {e}") from e
        except json.JSONDecodeError as e:
            raise CheckpointError(f"config.json of {path} is not valid JSON (line {e.lineno}, column {e.colno}: "
                                  f"{e.msg})") from None
    files, weight_map, problems = _find_files(path)

    # 1. headers
    stored: dict[str, StoredTensor] = {}
    for f in files:
        tensors, _ = read_header(f)
        for name, st in tensors.items():
            if name in stored:
                problems.append(f"tensor {name!r} is stored twice, in {stored[name].where} and {st.where}")
            stored[name] = st
    if weight_map is not None:
        for name, shard in weight_map.items():
            full = os.path.join(path, shard)
            if os.path.isfile(full) and (name not in stored or stored[name].file != full):
                problems.append(f"{INDEX_FILE} puts tensor {name!r} in {shard!r}, which does not hold it")

    # 2. names
    weights: dict[str, tuple[NameMap, StoredTensor]] = {}
    scales: dict[str, StoredTensor] = {}
    ignored: list[str] = []
    layouts: set[str] = set()
    for name, st in stored.items():
        nm = map_name(name)
        if nm.ignored:
            ignored.append(name)
            continue
        if nm.official is None:
            problems.append(f"unexpected tensor {name!r} (in {st.where}): no official name")
            continue
        if nm.stack or any(t in name for t in ("self_attn.", "mlp.", "lm_head.", "_layernorm.")):
            layouts.add("hf_modules")
        elif nm.official != name:
            layouts.add("save_pretrained")
        if nm.official.endswith(".scale") and not nm.stack:
            key = nm.official[: -len(".scale")] + ".weight"
            if key in scales:
                problems.append(f"tensors {scales[key].name!r} and {name!r} both map to {nm.official!r}")
            scales[key] = st
            continue
        key = nm.official if not nm.stack else f"{nm.official}|{'/'.join(nm.stack)}"
        if key in weights:
            problems.append(f"tensors {weights[key][1].name!r} and {name!r} both map to {key!r}")
        weights[key] = (nm, st)

    has_mtp = any(k.startswith("mtp.") for k in list(weights) + list(scales))
    specs = official_specs(cfg, include_mtp=has_mtp)

    # 3. check every stored tensor against its spec
    sources: dict[str, _Source] = {}
    provided: set[str] = set()
    for key, (nm, st) in weights.items():
        if nm.stack:
            E = cfg.n_routed_experts
            exp_names = nm.expand(E)
            first = specs.get(exp_names[0])
            if first is None or any(n not in specs for n in exp_names):
                problems.append(f"unexpected tensor {st.name!r} (in {st.where}): maps to "
                                f"{nm.official.format(e='*', w='/'.join(nm.stack))!r}, not in this config")
                continue
            rows, cols = first.shape
            want = (E, rows * len(nm.stack), cols)
            provided.update(exp_names)
            if st.dtype not in _FLOAT:
                problems.append(f"{_label(nm.official.format(e='*', w='/'.join(nm.stack)), st)} has dtype "
                                f"{st.dtype}; stacked HF expert tensors are read unquantized only")
                continue
            if st.shape != want:
                problems.append(f"{_label(nm.official.format(e='*', w='/'.join(nm.stack)), st)} has shape "
                                f"{_fmt_shape(st.shape)}, expected {_fmt_shape(want)} "
                                f"([n_routed_experts, {len(nm.stack)} x {rows}, {cols}])")
                continue
            for e in range(E):
                for j, w in enumerate(nm.stack):
                    n = nm.official.format(e=e, w=w)
                    if n in weights:
                        problems.append(f"tensors {weights[n][1].name!r} and {st.name!r} both provide {n!r}")
                    off = (e * want[1] + j * rows) * cols
                    sources[n] = _Source(n, st, specs[n], "float", None, (off, rows * cols, (rows, cols)))
            continue
        spec = specs.get(key)
        if spec is None:
            hint = ""
            if key.startswith("mtp.") and cfg.n_mtp_layers == 0:
                hint = " (the config has no MTP layers)"
            elif key.startswith("mtp.") and cfg.dspark_block_size:
                hint = (f" (the config's dspark_* keys describe the DSpark drafter: {cfg.n_mtp_layers} draft layers "
                        "mtp.0.* .. with main_proj, markov_head and confidence_head)")
            elif key.startswith("mtp.") and any(part in key for part in ("main_proj", "markov_head", "confidence_head")):
                hint = " (a DSpark drafter's tensor: the config has no dspark_* keys)"
            what = f"{st.name!r}" + (f" (official name {key!r})" if key != st.name else "")
            problems.append(f"unexpected tensor {what} in {st.where}{hint}")
            continue
        provided.add(key)
        src = _plan_one(key, spec, st, scales.pop(key, None), problems)
        if src is not None:
            sources[key] = src
    for key, st in scales.items():  # scales whose weight is absent or not a quantizable tensor
        if key in weights or key in provided:
            continue
        sname = key[: -len(".weight")] + ".scale"
        if key in specs:
            continue  # the weight itself is reported missing below
        problems.append(f"unexpected tensor {st.name!r} (in {st.where})"
                        + (f" (official name {sname!r})" if sname != st.name else ""))
    missing = [k for k in specs if k not in provided]
    if missing:
        mtp_missing = [k for k in missing if k.startswith("mtp.")]
        for k in missing:
            hint = " (mtp.* tensors are present, so all of them must be)" if k in mtp_missing else ""
            problems.append(f"missing tensor {k!r}{hint}")
    if problems:
        _raise(path, problems)
    layout = "hf_modules" if "hf_modules" in layouts else "save_pretrained" if layouts else "official"
    return Checkpoint(path, cfg, sources, has_mtp, files, ignored, layout)
