"""The host-memory tier: block sets kept as numpy arrays in this process, within a byte
budget. What its budget pushes out is handed back to the caller with its last-use time (the
store sends it to disk, where it keeps that time); what expires is gone."""

from __future__ import annotations

import dataclasses

from deepinfer_jax.host.kv_tiers.entry import TierEntry, TierStats
from deepinfer_jax.host.kv_tiers.lru import LruIndex


class HostTier:
    def __init__(self, budget_bytes: int, retention_s: float):
        self._index: LruIndex[TierEntry] = LruIndex(budget_bytes, retention_s)
        self.stats = TierStats()

    def __contains__(self, key: int) -> bool:
        return key in self._index

    def expire(self, now: float) -> None:
        for _ in self._index.expired(now):
            self.stats.expirations += 1

    def put(self, entry: TierEntry, now: float) -> list[tuple[TierEntry, float]]:
        """Keep `entry` as most recently used; returns the entries the budget pushed out, least
        recently used first, with their last-use times (`entry` itself, at `now`, if it alone
        exceeds the budget). Those times never decrease from one call to the next: all entries
        come in at `now` and leave oldest first."""
        self.expire(now)
        if entry.key in self._index:          # same key, same content: refresh only
            self._index.touch(entry.key, now)
            return []
        if entry.nbytes > self._index.budget_bytes:
            self.stats.rejected += 1
            return [(entry, now)]
        out = [(slot.value, slot.last_used) for _, slot in self._index.make_room(entry.nbytes)]
        self.stats.evictions += len(out)
        self._index.add(entry.key, entry, entry.nbytes, now)
        self.stats.bytes_written += entry.nbytes
        return out

    def get(self, key: int, now: float) -> TierEntry | None:
        self.expire(now)
        slot = self._index.get(key)
        if slot is None:
            self.stats.misses += 1
            return None
        self._index.touch(key, now)
        self.stats.hits += 1
        self.stats.bytes_read += slot.nbytes
        return slot.value

    def current_stats(self) -> TierStats:
        return dataclasses.replace(self.stats, entries=len(self._index), bytes=self._index.bytes)
