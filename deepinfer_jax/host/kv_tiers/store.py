"""TierStore: the tiers below the device in order, host memory then disk.

A block set put in the store goes to the highest tier it has; the host tier's budget pushes
its least recently used entries down to disk, and the disk's budget drops them. A lookup
tries host memory, then disk; a disk hit is copied up into host memory (the next request
for the same prefix is likely near). Tiers are inclusive: a hit leaves the entry where it
was, since content per key never changes.

Retention: an entry is served until `retention_s` after it was last put or served by the
store, whichever tier holds it, by the injected clock. An entry moved down keeps its last-use
time, and a disk hit copied up leaves the disk copy's time alone (the host copy carries the
recency and hands it back when it moves down), so no copy outlives the entry's last use.

Two locks: one for the host tier (held for dictionary work only) and one for the disk tier
(held across its file I/O). The engine's loop only ever takes the first (`locate`,
`get_host`); puts and lookups that may reach the disk run on the tiers' worker thread
(prefetch.py), so a file being written or read never holds the loop up.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable

from deepinfer_jax.config.kv_tiers import KVTierConfig
from deepinfer_jax.host.kv_tiers.disk_tier import DiskTier
from deepinfer_jax.host.kv_tiers.entry import TierEntry, TierStats
from deepinfer_jax.host.kv_tiers.host_tier import HostTier

Clock = Callable[[], float]


@dataclasses.dataclass(frozen=True)
class TierStoreStats:
    host: TierStats | None
    disk: TierStats | None


class TierStore:
    def __init__(self, config: KVTierConfig, clock: Clock = time.time):
        self.config, self._clock = config, clock
        self._host_lock, self._disk_lock = threading.Lock(), threading.Lock()
        now = clock()
        self.host = HostTier(config.host_bytes, config.retention_s) if config.has_host else None
        self.disk = (DiskTier(config.disk_dir, config.disk_bytes, config.retention_s, now)
                     if config.has_disk else None)

    @classmethod
    def from_config(cls, config: KVTierConfig | None, clock: Clock = time.time
                    ) -> TierStore | None:
        return cls(config, clock) if config is not None and config.enabled else None

    def put(self, entry: TierEntry) -> None:
        now = self._clock()
        if self.host is None:
            self._to_disk([(entry, now)], now)
            return
        with self._host_lock:
            pushed = self.host.put(entry, now)
        self._to_disk(pushed, now)

    def _to_disk(self, entries: list[tuple[TierEntry, float]], now: float) -> None:
        if self.disk is not None and entries:
            with self._disk_lock:
                for entry, last_used in entries:
                    self.disk.put(entry, now, last_used)

    def get(self, key: int) -> TierEntry | None:
        return self.lookup(key)[0]

    def lookup(self, key: int) -> tuple[TierEntry | None, str | None]:
        """(the block set `key`, the tier that served it: "host" or "disk"), or (None, None).
        May read a file: the loop calls `get_host` instead."""
        entry = self.get_host(key)
        if entry is not None or self.disk is None:
            return entry, "host" if entry is not None else None
        now = self._clock()
        with self._disk_lock:
            entry = self.disk.get(key, now, touch=self.host is None)
        if entry is None:
            return None, None
        if self.host is not None:
            with self._host_lock:
                pushed = self.host.put(entry, now)
            self._to_disk(pushed, now)
        return entry, "disk"

    def get_host(self, key: int) -> TierEntry | None:
        """The block set `key` from host memory only (a miss there is a miss): no file I/O."""
        if self.host is None:
            return None
        with self._host_lock:
            return self.host.get(key, self._clock())

    def locate(self, key: int) -> str | None:
        """Which tier holds `key` ("host", "disk" or None), without waiting for the disk tier's
        lock, touching recency or expiring anything: a hint for the loop (an entry may still
        expire or move before it is read, and a read that misses is only a miss)."""
        if self.host is not None:
            with self._host_lock:
                if key in self.host:
                    return "host"
        return "disk" if self.disk is not None and key in self.disk else None

    def __contains__(self, key: int) -> bool:
        """Whether a lookup of `key` would find it now (its recency untouched; a disk entry
        whose file turns out corrupt is still a miss on the lookup itself)."""
        with self._host_lock, self._disk_lock:
            self._expire()
            return any(t is not None and key in t for t in (self.host, self.disk))

    def expire(self) -> None:
        """Drop what has outlived the retention time (lookups and puts also do this)."""
        with self._host_lock, self._disk_lock:
            self._expire()

    def _expire(self) -> None:
        now = self._clock()
        for tier in (self.host, self.disk):
            if tier is not None:
                tier.expire(now)

    def stats(self) -> TierStoreStats:
        """The counters now. The disk tier's are read without its lock (a scrape must not wait
        for a file being written): at worst one operation behind."""
        with self._host_lock:
            host = None if self.host is None else self.host.current_stats()
        return TierStoreStats(host, None if self.disk is None else self.disk.current_stats())
