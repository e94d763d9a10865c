"""A reader for safetensors files and sharded folders that knows every dtype DeepSeek-V4 ships
(BF16, F8_E4M3, F8_E8M0, I8-packed FP4, ...) and reports damage by file and tensor.

Tensors are memory-mapped and read one at a time, so a folder is never held in host memory at once.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2, "F8_E8M0": ml_dtypes.float8_e8m0fnu,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message names the file and, where it applies, the tensor."""


class SafetensorsFile:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            size = self.path.stat().st_size
            with open(self.path, "rb") as f:
                prefix = f.read(8)
                if len(prefix) < 8:
                    raise CheckpointError(f"{self.path}: truncated safetensors file (no header)")
                (header_len,) = struct.unpack("<Q", prefix)
                if header_len > size - 8:
                    raise CheckpointError(f"{self.path}: corrupted safetensors header (claims {header_len} bytes, "
                                          f"file has {size})")
                header = json.loads(f.read(header_len))
        except (json.JSONDecodeError, UnicodeDecodeError) as bad:
            raise CheckpointError(f"{self.path}: corrupted safetensors header ({bad})") from None
        except OSError as bad:
            raise CheckpointError(f"{self.path}: cannot read ({bad.strerror})") from None
        header.pop("__metadata__", None)
        self._data_start = 8 + header_len
        self._entries: dict[str, dict] = header
        data_len = size - self._data_start
        for name, entry in header.items():
            start, end = entry["data_offsets"]
            if end > data_len:
                raise CheckpointError(f"{self.path}: truncated safetensors file: tensor {name!r} needs bytes "
                                      f"{start}..{end} but the data section has {data_len}")
            if entry["dtype"] not in DTYPES:
                raise CheckpointError(f"{self.path}: tensor {name!r} has unsupported dtype {entry['dtype']}")

    def keys(self) -> list[str]:
        return list(self._entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._entries[name]["shape"])

    def get(self, name: str) -> np.ndarray:
        entry = self._entries[name]
        dtype = np.dtype(DTYPES[entry["dtype"]])
        start, end = entry["data_offsets"]
        shape = tuple(entry["shape"])
        if (end - start) != int(np.prod(shape)) * dtype.itemsize:
            raise CheckpointError(f"{self.path}: tensor {name!r} has {end - start} bytes, shape {list(shape)} of "
                                  f"{entry['dtype']} needs {int(np.prod(shape)) * dtype.itemsize}")
        array = np.memmap(self.path, dtype=dtype, mode="r", offset=self._data_start + start, shape=shape)
        return np.array(array)  # detach from the mapping


class SafetensorsFolder:
    """All tensors of a checkpoint folder, by name, whichever shard holds them."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        files = sorted(self.folder.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{self.folder}: no *.safetensors files")
        self._where: dict[str, SafetensorsFile] = {}
        for file in files:
            reader = SafetensorsFile(file)
            for name in reader.keys():
                self._where[name] = reader

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def keys(self) -> list[str]:
        return list(self._where)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._where[name].shape(name)

    def file_of(self, name: str) -> Path:
        return self._where[name].path

    def get(self, name: str) -> np.ndarray:
        return self._where[name].get(name)
