"""DeepSeek-V4 checkpoints: official names and shapes, storage formats, a checked streaming reader, a writer.

    from checkpoints import open_checkpoint, CheckpointError, official_shapes
    ckpt = open_checkpoint(path, cfg)          # headers only; raises CheckpointError naming bad tensors
    for name, array in ckpt.iter_tensors():    # official names, float32 (int32 for tid2eid)
        ...
"""
from .formats import dequant_fp8_blocks, quant_fp4, quant_fp8_blocks, unpack_fp4
from .names import NameMap, map_name, official_name
from .reader import Checkpoint, open_checkpoint
from .schema import CheckpointError, TensorSpec, official_shapes, official_specs
from .writer import storage_roundtrip, write_official_checkpoint

__all__ = [
    "Checkpoint", "CheckpointError", "NameMap", "TensorSpec", "dequant_fp8_blocks", "map_name", "official_name",
    "official_shapes", "official_specs", "open_checkpoint", "quant_fp4", "quant_fp8_blocks", "storage_roundtrip",
    "unpack_fp4", "write_official_checkpoint",
]
