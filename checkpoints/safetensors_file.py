"""A reader for safetensors files and sharded folders that knows every dtype DeepSeek-V4 ships
(BF16, F8_E4M3, F8_E8M0, I8-packed FP4, ...) and reports damage by file and tensor.

Tensors are memory-mapped and read one at a time, so a folder is never held in host memory at once.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn,
    "F8_E5M2": ml_dtypes.float8_e5m2,
    "F8_E8M0": ml_dtypes.float8_e8m0fnu,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
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
                    raise CheckpointError(
                        f"{self.path}: corrupted safetensors header (claims {header_len} bytes, file has {size})"
                    )
                header = json.loads(f.read(header_len))
        except (json.JSONDecodeError, UnicodeDecodeError) as bad:
            raise CheckpointError(f"{self.path}: corrupted safetensors header ({bad})") from None
        except OSError as bad:
            raise CheckpointError(f"{self.path}: cannot read ({bad.strerror})") from None
        if not isinstance(header, dict):
            raise CheckpointError(f"{self.path}: corrupted safetensors header (not a JSON object)")
        header.pop("__metadata__", None)
        self._data_start = 8 + header_len
        self._entries: dict[str, dict] = header
        self._mapped: np.memmap | None = None
        data_len = size - self._data_start
        for name, entry in header.items():
            self._check_entry(name, entry, data_len)

    def _check_entry(self, name: str, entry: Any, data_len: int) -> None:  # untrusted JSON, checked here
        where = f"{self.path}: tensor {name!r}"
        try:
            dtype, shape, (start, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
            shape_ok = all(isinstance(n, int) and n >= 0 for n in shape)
            offsets_ok = isinstance(start, int) and isinstance(end, int) and 0 <= start <= end
        except (TypeError, KeyError, ValueError):
            raise CheckpointError(
                f"{self.path}: corrupted safetensors header: entry for tensor {name!r} needs "
                f"dtype, shape and two data_offsets, got {entry!r}"
            ) from None
        if not (shape_ok and offsets_ok):
            raise CheckpointError(
                f"{self.path}: corrupted safetensors header: tensor {name!r} has shape {shape!r} "
                f"and data_offsets {[start, end]!r}"
            )
        if dtype not in DTYPES:
            raise CheckpointError(f"{where} has unsupported dtype {dtype}")
        if end > data_len:
            raise CheckpointError(
                f"{self.path}: truncated safetensors file: tensor {name!r} needs bytes "
                f"{start}..{end} but the data section has {data_len}"
            )
        need = int(np.prod(shape)) * np.dtype(DTYPES[dtype]).itemsize
        if end - start != need:
            raise CheckpointError(f"{where} has {end - start} bytes, shape {list(shape)} of {dtype} needs {need}")

    def keys(self) -> list[str]:
        return list(self._entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._entries[name]["shape"])

    def dtype(self, name: str) -> str:
        return self._entries[name]["dtype"]

    def get(self, name: str) -> np.ndarray:
        entry = self._entries[name]
        start, end = entry["data_offsets"]
        if self._mapped is None:
            self._mapped = np.memmap(self.path, dtype=np.uint8, mode="r")
        raw = self._mapped[self._data_start + start : self._data_start + end]
        return np.array(raw).view(DTYPES[entry["dtype"]]).reshape(entry["shape"])  # a copy, detached from the map


class SafetensorsFolder:
    """All tensors of a checkpoint folder, by name, whichever shard holds them."""

    INDEX = "model.safetensors.index.json"

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        files = sorted(self.folder.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{self.folder}: no *.safetensors files")
        self._check_index(files)
        self._where: dict[str, SafetensorsFile] = {}
        for file in files:
            reader = SafetensorsFile(file)
            for name in reader.keys():
                if name in self._where:
                    raise CheckpointError(f"{file}: tensor {name!r} is also in {self._where[name].path}")
                self._where[name] = reader

    def _check_index(self, files: list[Path]) -> None:
        """A shard the index names but the folder lacks is reported as such (not as many missing tensors)."""
        index = self.folder / self.INDEX
        if not index.exists():
            return
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            named = {file: name for name, file in weight_map.items()}
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as bad:
            raise CheckpointError(f"{index}: not a valid safetensors index ({bad!r})") from None
        present = {f.name for f in files}
        absent = sorted(set(named) - present)
        if absent:
            raise CheckpointError(
                f"{index}: names shard(s) missing from the folder: "
                + ", ".join(f"{f} (e.g. tensor {named[f]!r})" for f in absent)
            )

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

    def placeholder(self, name: str) -> np.ndarray:
        """Zeros shaped and typed as tensor `name`, read from nothing (for a tensor no device of this process holds:
        the pages stay unwritten, so it costs no memory either)."""
        reader = self._where[name]
        return np.zeros(reader.shape(name), DTYPES[reader.dtype(name)])
