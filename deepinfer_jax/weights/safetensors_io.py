"""Read and write safetensors files with every dtype the DeepSeek release uses.

The `safetensors` package's numpy backend cannot represent F8_E4M3 or F8_E8M0 (numpy has no
such dtypes), so this module implements the documented format directly (8-byte little-endian
header size, a JSON header, then the raw little-endian data) on top of `ml_dtypes`, and reads
tensors through a memory map so that a large checkpoint is never copied whole.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "U8": np.dtype(np.uint8), "I8": np.dtype(np.int8),
    "I16": np.dtype(np.int16), "U16": np.dtype(np.uint16),
    "I32": np.dtype(np.int32), "U32": np.dtype(np.uint32),
    "I64": np.dtype(np.int64), "U64": np.dtype(np.uint64),
    "F16": np.dtype(np.float16), "F32": np.dtype(np.float32), "F64": np.dtype(np.float64),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),
}
_NAMES = {dtype: name for name, dtype in DTYPES.items()}


class SafetensorsError(ValueError):
    pass


class SafetensorsFile:
    """A lazily read safetensors file: `keys()`, `dtype_name(k)`, `shape(k)`, `get(k)`."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        with open(self.path, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(header_len))
        header.pop("__metadata__", None)
        self._header = header
        self._data_start = 8 + header_len
        self._mmap: np.memmap | None = None

    def keys(self) -> list[str]:
        return list(self._header)

    def dtype_name(self, key: str) -> str:
        return self._header[key]["dtype"]

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._header[key]["shape"])

    def get(self, key: str) -> np.ndarray:
        entry = self._header[key]
        if entry["dtype"] not in DTYPES:
            raise SafetensorsError(f"{self.path.name}: {key} has unsupported dtype {entry['dtype']}")
        if self._mmap is None:
            self._mmap = np.memmap(self.path, dtype=np.uint8, mode="r")
        start, end = entry["data_offsets"]
        raw = self._mmap[self._data_start + start: self._data_start + end]
        return raw.view(DTYPES[entry["dtype"]]).reshape(entry["shape"])


def save_file(tensors: dict[str, np.ndarray], path: str | Path,
              metadata: dict[str, str] | None = None) -> None:
    """Write `tensors` (numpy arrays of any dtype in DTYPES) to `path`, keys in sorted order."""
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = metadata
    offset = 0
    blobs = []
    for key in sorted(tensors):
        array = np.ascontiguousarray(tensors[key])
        if array.dtype not in _NAMES:
            raise SafetensorsError(f"{key}: cannot store dtype {array.dtype}")
        blob = array.tobytes()
        header[key] = {"dtype": _NAMES[array.dtype], "shape": list(array.shape),
                       "data_offsets": [offset, offset + len(blob)]}
        offset += len(blob)
        blobs.append(blob)
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # keep the data 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        for blob in blobs:
            f.write(blob)


class Checkpoint:
    """All tensors of a model directory: one `model.safetensors`, or shards listed by
    `model.safetensors.index.json`, or any `*.safetensors` files found there."""

    def __init__(self, directory: str | Path):
        directory = Path(directory)
        index = directory / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in directory.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no safetensors files in {directory}")
        self._where: dict[str, SafetensorsFile] = {}
        for name in files:
            shard = SafetensorsFile(directory / name)
            for key in shard.keys():
                self._where[key] = shard

    def keys(self) -> list[str]:
        return list(self._where)

    def __contains__(self, key: str) -> bool:
        return key in self._where

    def dtype_name(self, key: str) -> str:
        return self._where[key].dtype_name(key)

    def shape(self, key: str) -> tuple[int, ...]:
        return self._where[key].shape(key)

    def get(self, key: str) -> np.ndarray:
        return self._where[key].get(key)
