"""Read and write safetensors files with every dtype the DeepSeek release uses.

The `safetensors` package's numpy backend cannot represent F8_E4M3 or F8_E8M0 (numpy has no
such dtypes), so this module implements the documented format directly (8-byte little-endian
header size, a JSON header, then the raw little-endian data) on top of `ml_dtypes`, and reads
tensors (or runs of their rows) straight into buffers the caller owns, no memory map, so that
a large checkpoint is never copied whole.
"""

from __future__ import annotations

import json
import math
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
    """A safetensors file that is not one (empty, truncated, a broken header); names the file
    and, where one is at fault, the tensor."""


class SafetensorsFile:
    """A lazily read safetensors file: `keys()`, `dtype_name(k)`, `shape(k)`, `get(k)`.

    The header is checked when the file is opened (every tensor's dtype, shape and byte range
    against the file's size), so that a truncated or damaged file fails there, by name, and
    never as a reshape of too few bytes later."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        size = self.path.stat().st_size
        with open(self.path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise SafetensorsError(f"{self.path}: {size} bytes, too short for a safetensors "
                                       f"file (expected an 8-byte header size, then a JSON header)")
            (header_len,) = struct.unpack("<Q", prefix)
            if 8 + header_len > size:
                raise SafetensorsError(f"{self.path}: truncated: the header alone needs "
                                       f"{8 + header_len} bytes, the file has {size}")
            try:
                header = json.loads(f.read(header_len))
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise SafetensorsError(f"{self.path}: the header is not valid JSON ({e})") from None
        if not isinstance(header, dict):
            raise SafetensorsError(f"{self.path}: the header is not a JSON object")
        header.pop("__metadata__", None)
        self._header = header
        self._data_start = 8 + header_len
        data_size = size - self._data_start
        cut = [key for key, entry in header.items() if self._check(key, entry) > data_size]
        if cut:
            raise SafetensorsError(
                f"{self.path}: truncated: the data section holds {data_size} bytes, "
                f"{len(cut)} tensor(s) reach past it: {', '.join(cut[:8])}"
                + (f" and {len(cut) - 8} more" if len(cut) > 8 else ""))

    def _check(self, key: str, entry) -> int:
        """Check one header entry; returns where its data ends."""
        where = f"{self.path}: tensor {key}"
        try:
            dtype, shape, (start, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
            shape, start, end = [int(d) for d in shape], int(start), int(end)
        except (KeyError, TypeError, ValueError):
            raise SafetensorsError(f"{where}: expected dtype, shape and data_offsets [start, "
                                   f"end] in the header, got {entry!r:.200}") from None
        if dtype not in DTYPES:     # an error if it is read (get), not if it is never used
            return end
        nbytes = DTYPES[dtype].itemsize * math.prod(shape)
        if not 0 <= start <= end or end - start != nbytes:
            raise SafetensorsError(f"{where}: data_offsets [{start}, {end}] hold {end - start} "
                                   f"bytes, expected {nbytes} for {dtype} {shape}")
        return end

    def keys(self) -> list[str]:
        return list(self._header)

    def dtype_name(self, key: str) -> str:
        return self._header[key]["dtype"]

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._header[key]["shape"])

    def _entry(self, key: str) -> tuple[np.dtype, tuple[int, ...], int, int]:
        entry = self._header[key]
        if entry["dtype"] not in DTYPES:
            raise SafetensorsError(f"{self.path}: tensor {key} has unsupported dtype "
                                   f"{entry['dtype']} (expected one of {sorted(DTYPES)})")
        start, end = entry["data_offsets"]
        return DTYPES[entry["dtype"]], tuple(entry["shape"]), self._data_start + start, end - start

    def get(self, key: str) -> np.ndarray:
        dtype, shape, _, _ = self._entry(key)
        out = np.empty(shape, dtype)
        self.read_into(key, out)
        return out

    def read_into(self, key: str, out: np.ndarray) -> None:
        """Read tensor `key` into `out` (C-contiguous, of its byte size; any dtype view)."""
        _, _, offset, size = self._entry(key)
        if not out.flags.c_contiguous or out.nbytes != size:
            raise ValueError(f"{key}: a contiguous buffer of {size} bytes is needed, got "
                             f"{out.nbytes} bytes")
        self._read(key, offset, out)

    def read_rows_into(self, key: str, first: int, out: np.ndarray) -> None:
        """Rows first ... first + len(out) - 1 (along the first axis) of tensor `key` into
        `out` (C-contiguous, of those rows' byte size; any dtype view)."""
        dtype, shape, offset, size = self._entry(key)
        row = dtype.itemsize * math.prod(shape[1:])
        if (not out.flags.c_contiguous or out.nbytes % max(row, 1) or first < 0
                or (first * row + out.nbytes) > size):
            raise ValueError(f"{key}: {out.nbytes} contiguous bytes from row {first} do not lie "
                             f"in its {size} bytes of {row}-byte rows")
        self._read(key, offset + first * row, out)

    def _read(self, key: str, offset: int, out: np.ndarray) -> None:
        size = out.nbytes
        view = memoryview(out.reshape(-1).view(np.uint8))
        with open(self.path, "rb") as f:
            f.seek(offset)
            done = 0
            while done < size:
                got = f.readinto(view[done:])
                if not got:
                    raise SafetensorsError(f"{self.path}: tensor {key}: the file ended after "
                                           f"{done} of its {size} bytes")
                done += got


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
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                files = sorted(set(weight_map.values()))
            except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError,
                    AttributeError) as e:
                raise SafetensorsError(f"{index}: expected a JSON object with a weight_map of "
                                       f"tensor -> file ({type(e).__name__}: {e})") from None
            absent = [name for name in files if not (directory / name).is_file()]
            if absent:
                raise SafetensorsError(f"{index} lists shard(s) that are not there: {absent}")
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

    def read_into(self, key: str, out: np.ndarray) -> None:
        self._where[key].read_into(key, out)

    def read_rows_into(self, key: str, first: int, out: np.ndarray) -> None:
        self._where[key].read_rows_into(key, first, out)
