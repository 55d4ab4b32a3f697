"""What the tiers hold and count, and their typed errors."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np


class TierError(Exception):
    """Base of the KV tiers' errors."""


class TierFileCorrupt(TierError):
    """A tier file that is truncated, altered or not a block file: dropped, never served."""


class TierPayloadError(TierError, TypeError):
    """A block set the tiers cannot store (object arrays, info that is not JSON)."""


@dataclasses.dataclass(frozen=True)
class TierEntry:
    """One cached block set below the device. Content per key is immutable: the key is the
    chained hash of the tokens up to the block (host/prefix_cache.py), so storing a key again
    only refreshes its recency. The store keeps the arrays it is given (the caller hands them
    over); arrays read back from disk are read-only."""

    key: int
    arrays: tuple[np.ndarray, ...]      # the pages' rows and the snapshot, in the caller's order
    info: Mapping[str, Any] = dataclasses.field(default_factory=dict)   # small, JSON-able

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays)


@dataclasses.dataclass
class TierStats:
    hits: int = 0
    misses: int = 0
    bytes_written: int = 0        # payload put into the tier (disk: whole files)
    bytes_read: int = 0           # payload served from it (disk: whole files)
    evictions: int = 0            # pushed out by the byte budget, least recently used first
    expirations: int = 0          # unused for the retention time
    corrupt_dropped: int = 0      # files that failed their checks (or vanished): never served
    rejected: int = 0             # block sets larger than the whole budget
    write_errors: int = 0         # disk writes that failed (disk full, I/O error): not kept
    entries: int = 0
    bytes: int = 0                # held now (disk: file sizes)
