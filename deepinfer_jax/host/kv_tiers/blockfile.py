"""One block set as bytes: the disk tier's file format, checked on every read.

    magic (8 bytes) | meta length (u32 LE) | digest (32 bytes) | meta (JSON) | payload

meta names the key, the caller's small `info` facts and each array's dtype and shape; the
payload is the arrays' bytes in order, C-contiguous. The digest is BLAKE2b over meta and
payload together, so an altered shape or key is caught as surely as an altered byte of data;
the sizes in meta also let an index rebuild reject a truncated file from its header alone.
"""

from __future__ import annotations

import hashlib
import json
import struct

import numpy as np

from deepinfer_jax.host.kv_tiers.entry import TierEntry, TierFileCorrupt, TierPayloadError

MAGIC = b"DIKVBLK1"
_HEADER = struct.Struct("<8sI32s")
HEADER_BYTES = _HEADER.size
_MAX_META = 1 << 24              # a sane bound: a corrupt length must not allocate gigabytes


def _digest() -> hashlib.blake2b:
    return hashlib.blake2b(digest_size=32)


def _as_bytes(array: np.ndarray) -> np.ndarray:
    """The array's bytes as a flat uint8 view (one copy only if it is not contiguous)."""
    return np.ascontiguousarray(array).reshape(-1).view(np.uint8)


def _dtype(name: str) -> np.dtype:
    try:
        return np.dtype(name)
    except TypeError:
        # bfloat16 and the float8 types live in ml_dtypes (numpy extension types, not jax)
        import ml_dtypes
        if not hasattr(ml_dtypes, name):
            raise TierFileCorrupt(f"unknown dtype {name!r}") from None
        return np.dtype(getattr(ml_dtypes, name))


def _meta(entry: TierEntry) -> bytes:
    arrays = []
    for a in entry.arrays:
        if a.dtype.hasobject or a.dtype.fields is not None:
            raise TierPayloadError(f"cannot store arrays of dtype {a.dtype}")
        arrays.append([a.dtype.name, list(a.shape)])
    try:
        return json.dumps({"key": entry.key, "info": dict(entry.info), "arrays": arrays,
                           "payload_bytes": entry.nbytes}, sort_keys=True).encode()
    except (TypeError, ValueError) as e:
        raise TierPayloadError(f"info of block set {entry.key} is not JSON: {e}") from None


def encode(entry: TierEntry) -> list[bytes | memoryview]:
    """The file's parts in order (header, meta, each array's bytes), written without joining
    them (a block set can be tens of megabytes)."""
    meta = _meta(entry)
    parts = [_as_bytes(a) for a in entry.arrays]
    digest = _digest()
    digest.update(meta)
    for part in parts:
        digest.update(part)
    return [_HEADER.pack(MAGIC, len(meta), digest.digest()), meta, *map(memoryview, parts)]


def encoded_size(entry: TierEntry) -> int:
    return HEADER_BYTES + len(_meta(entry)) + entry.nbytes


def _split_header(head: bytes) -> tuple[int, bytes]:
    if len(head) < HEADER_BYTES:
        raise TierFileCorrupt("shorter than its header")
    magic, meta_len, digest = _HEADER.unpack_from(head)
    if magic != MAGIC or meta_len > _MAX_META:
        raise TierFileCorrupt("not a block file")
    return meta_len, digest


def _parse_meta(raw: bytes) -> dict:
    try:
        meta = json.loads(raw)
        int(meta["key"]), int(meta["payload_bytes"])
        meta["arrays"], meta["info"]
        return meta
    except (ValueError, KeyError, TypeError) as e:
        raise TierFileCorrupt(f"unreadable meta: {e}") from None


def read_meta(path: str) -> tuple[dict, int]:
    """(meta, expected file size) from the header alone: what an index rebuild needs. The
    payload is not hashed here (that is every read's job)."""
    with open(path, "rb") as f:
        meta_len, _ = _split_header(f.read(HEADER_BYTES))
        raw = f.read(meta_len)
    if len(raw) != meta_len:
        raise TierFileCorrupt("truncated meta")
    meta = _parse_meta(raw)
    return meta, HEADER_BYTES + meta_len + int(meta["payload_bytes"])


def decode(data: bytes, key: int) -> TierEntry:
    """The block set `key` from a whole file's bytes, or TierFileCorrupt: never a partial or
    altered entry. Arrays are read-only views of `data`."""
    meta_len, digest = _split_header(data)
    raw = data[HEADER_BYTES: HEADER_BYTES + meta_len]
    payload = memoryview(data)[HEADER_BYTES + meta_len:]
    check = _digest()
    check.update(raw)
    check.update(payload)
    if len(raw) != meta_len or check.digest() != digest:
        raise TierFileCorrupt("checksum mismatch")
    meta = _parse_meta(raw)
    if int(meta["key"]) != key:
        raise TierFileCorrupt(f"holds block set {meta['key']}, not {key}")
    if int(meta["payload_bytes"]) != len(payload):
        raise TierFileCorrupt("payload size mismatch")
    arrays, offset = [], HEADER_BYTES + meta_len
    for name, shape in meta["arrays"]:
        dtype = _dtype(name)
        count = int(np.prod(shape, dtype=np.int64))
        arrays.append(np.frombuffer(data, dtype, count, offset).reshape(shape))
        offset += count * dtype.itemsize
    if offset != len(data):
        raise TierFileCorrupt("arrays do not fill the payload")
    return TierEntry(key, tuple(arrays), meta["info"])
