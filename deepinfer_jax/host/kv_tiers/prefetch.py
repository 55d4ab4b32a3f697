"""TierWorker: the KV tiers' slow work on one background thread, in the order it was asked
for: puts (which may push entries down to disk files) and prefetches (which may read them).

A request whose prefix continues in blocks only the disk holds is not admitted until those
are read: admission asks the worker for them (`prefetch`) and passes the request over while
any is on its way (host/kv_tiers/blocks.py), so the loop keeps running the other requests and
never waits for a file. A block set read is handed to `stage` on the worker's thread (the
engine starts its copy to the device there) and kept for the admission that asked for it
(`take`). Entries in host memory are read by the loop itself (no I/O, no wait for the disk).

Latency per tier: from the prefetch asked to the block set staged (disk), or the loop's read
of host memory (host); what the tiers' counters report beside their hits and bytes.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor

from deepinfer_jax.host.kv_tiers.entry import TierEntry, TierStats
from deepinfer_jax.host.kv_tiers.latency import LatencyHistogram, LatencySummary
from deepinfer_jax.host.kv_tiers.store import TierStore

log = logging.getLogger(__name__)

PENDING, STAGED, MISSED = "pending", "staged", "missed"
TIERS = ("host", "disk")


@dataclasses.dataclass(frozen=True)
class TierReport:
    """One tier's counters (hits, misses, bytes in and out, evictions, expirations, ...) and
    the latency of bringing a block set up from it."""

    counters: TierStats
    prefetch_latency: LatencySummary


class TierWorker:
    def __init__(self, store: TierStore, stage: Callable[[TierEntry], TierEntry] | None = None):
        self.store = store
        self._stage = stage or (lambda entry: entry)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kv-tiers")
        self._changed = threading.Condition()
        self._staged: dict[int, TierEntry | None] = {}     # None: looked up and missed
        self._pending: set[int] = set()
        self.latency = {tier: LatencyHistogram() for tier in TIERS}
        self.blocks_prefetched = 0          # block sets read from disk ahead of admission
        self.admissions_deferred = 0        # schedules that passed a request over for them

    # ---- the loop's side ------------------------------------------------------------------
    def status(self, key: int) -> str | None:
        with self._changed:
            if key in self._pending:
                return PENDING
            if key in self._staged:
                return MISSED if self._staged[key] is None else STAGED
            return None

    def prefetch(self, keys: list[int]) -> None:
        """Read `keys` (a chain's blocks, in order) on the worker; those asked already are
        not asked again."""
        with self._changed:
            keys = [k for k in keys if k not in self._pending and k not in self._staged]
            self._pending.update(keys)
        if keys:
            self._pool.submit(self._fetch, keys, time.perf_counter())

    def take(self, key: int) -> tuple[bool, TierEntry | None]:
        """(whether `key` was prefetched, its block set or None if the read missed); the worker
        forgets it."""
        with self._changed:
            if key not in self._staged:
                return False, None
            return True, self._staged.pop(key)

    def get_host(self, key: int) -> TierEntry | None:
        start = time.perf_counter()
        entry = self.store.get_host(key)
        if entry is not None:
            self.latency["host"].observe(time.perf_counter() - start)
        return entry

    def discard(self, keys: Iterable[int]) -> None:
        """Forget staged block sets no admission will take (their request was aborted)."""
        with self._changed:
            for key in keys:
                self._staged.pop(key, None)

    @property
    def pending(self) -> bool:
        with self._changed:
            return bool(self._pending)

    def wait(self, timeout_s: float) -> None:
        """Wait until a prefetch lands or `timeout_s` passes (for a loop with nothing else to
        do)."""
        with self._changed:
            if self._pending:
                self._changed.wait(timeout_s)

    # ---- the worker's side ----------------------------------------------------------------
    def put(self, entries: list[TierEntry]) -> None:
        if entries:
            self._pool.submit(self._put_all, entries)

    def _put_all(self, entries: list[TierEntry]) -> None:
        try:
            for entry in entries:
                self.store.put(entry)
        except Exception:              # a lost cache entry, never a lost engine
            log.exception("KV tiers: a put failed")

    def _fetch(self, keys: list[int], asked: float) -> None:
        missed = False
        for key in keys:
            entry = None
            try:
                # after a miss the rest of the chain cannot be used: not read
                entry, tier = (None, None) if missed else self.store.lookup(key)
                if entry is not None:
                    entry = self._stage(entry)
                    self.latency[tier].observe(time.perf_counter() - asked)
            except Exception:
                log.exception("KV tiers: a prefetch failed")
                entry = None
            missed = missed or entry is None
            with self._changed:
                self._pending.discard(key)
                self._staged[key] = entry
                self.blocks_prefetched += entry is not None
                self._changed.notify_all()

    def drain(self) -> None:
        """Wait for every put and prefetch asked so far (the worker runs them in order)."""
        self._pool.submit(lambda: None).result()

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def stats(self) -> dict[str, TierReport]:
        """Per configured tier ("host", "disk"): counters and prefetch latency."""
        counters = self.store.stats()
        return {tier: TierReport(c, self.latency[tier].summary())
                for tier, c in (("host", counters.host), ("disk", counters.disk))
                if c is not None}
