"""The disk tier: one file per block set in a directory, within a byte budget (file sizes).

A file appears whole or not at all: it is written to a temporary name, fsynced, given its
last-use time as mtime, and renamed over its final name (then the directory is fsynced, so
the rename itself survives a power loss). A process killed mid-write leaves only a temporary
file, removed when a store next opens the directory.

The index is rebuilt from the files when a store opens: each header's key and sizes, the
mtime as last-use time (hits refresh it, so LRU order and retention survive a restart). A
file whose header or size is wrong is dropped then; one whose payload was altered fails its
checksum on the read that would serve it, and is dropped there. One store per directory:
two processes sharing one would each remove the other's files from under its index.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os

from deepinfer_jax.host.kv_tiers import blockfile
from deepinfer_jax.host.kv_tiers.entry import TierEntry, TierFileCorrupt, TierStats
from deepinfer_jax.host.kv_tiers.lru import LruIndex

SUFFIX = ".kvblk"
TEMP_SUFFIX = ".tmp"


def file_name(key: int) -> str:
    # a fixed-length name for any int key; the key inside the file settles a name collision
    return hashlib.blake2b(str(key).encode(), digest_size=16).hexdigest() + SUFFIX


class DiskTier:
    def __init__(self, directory: str, budget_bytes: int, retention_s: float, now: float):
        self.directory = os.path.abspath(os.path.expanduser(directory))
        os.makedirs(self.directory, exist_ok=True)
        self._index: LruIndex[str] = LruIndex(budget_bytes, retention_s)
        self.stats = TierStats()
        self._rebuild()
        self.expire(now)
        self._drop_all(self._index.make_room(0), "evictions")   # a smaller budget than before

    def _path(self, name: str) -> str:
        return os.path.join(self.directory, name)

    def _rebuild(self) -> None:
        found = []
        for name in os.listdir(self.directory):
            path = self._path(name)
            if name.endswith(TEMP_SUFFIX):
                _unlink(path)                  # a write that never reached its rename
                continue
            if not name.endswith(SUFFIX):
                continue
            try:
                meta, size = blockfile.read_meta(path)
                stat = os.stat(path)
                if stat.st_size != size or file_name(int(meta["key"])) != name:
                    raise TierFileCorrupt("size or name does not match the header")
            except (OSError, TierFileCorrupt):
                _unlink(path)
                self.stats.corrupt_dropped += 1
                continue
            found.append((stat.st_mtime, int(meta["key"]), name, size))
        for mtime, key, name, size in sorted(found):
            self._index.add(key, name, size, mtime)

    def __contains__(self, key: int) -> bool:
        return key in self._index

    def keys(self) -> list[int]:
        return [key for key, _ in self._index.items_by_age()]

    def expire(self, now: float) -> None:
        self._drop_all(self._index.expired(now), "expirations")

    def _drop_all(self, slots, counter: str) -> None:
        for _, slot in slots:
            _unlink(self._path(slot.value))
            setattr(self.stats, counter, getattr(self.stats, counter) + 1)

    def put(self, entry: TierEntry, now: float, last_used: float | None = None) -> bool:
        """Write `entry` (or refresh it if present); False if it alone exceeds the budget or
        the write failed.
        `last_used`: when the entry was last used in a tier above (default: now); entries must
        come in with non-decreasing times, which keeps LRU order the order of last use."""
        self.expire(now)
        last_used = now if last_used is None else last_used
        # same key, same content: refresh only (a file gone from under us is written again)
        if entry.key in self._index and self._refresh(entry.key, last_used):
            return True
        parts = blockfile.encode(entry)
        size = sum(len(p) if isinstance(p, bytes) else p.nbytes for p in parts)
        if size > self._index.budget_bytes:
            self.stats.rejected += 1
            return False
        # room first: the budget holds while the new file is being written
        self._drop_all(self._index.make_room(size), "evictions")
        name = file_name(entry.key)
        try:
            self._write_atomically(name, parts, last_used)
        except OSError:
            # a full or failing disk loses a cache entry, not the engine: counted, not raised
            self.stats.write_errors += 1
            return False
        self._index.add(entry.key, name, size, last_used)
        self.stats.bytes_written += size
        return True

    def _write_atomically(self, name: str, parts, last_used: float) -> None:
        temp = self._path(f".{name}.{os.getpid()}{TEMP_SUFFIX}")
        try:
            with open(temp, "wb") as f:
                for part in parts:
                    f.write(part)
                f.flush()
                os.fsync(f.fileno())
            os.utime(temp, (last_used, last_used))
            os.replace(temp, self._path(name))
        except BaseException:
            _unlink(temp)
            raise
        _fsync_dir(self.directory)

    def _refresh(self, key: int, when: float) -> bool:
        try:
            os.utime(self._path(self._index.get(key).value), (when, when))
        except OSError:                        # gone from under us: forget it
            self._index.pop(key)
            self.stats.corrupt_dropped += 1
            return False
        self._index.touch(key, when)
        return True

    def get(self, key: int, now: float, touch: bool = True) -> TierEntry | None:
        """The block set `key`, checked against its checksum; a file that fails is dropped
        and counted, and the lookup is a miss. `touch=False` leaves its last-use time (a tier
        above takes the entry and its recency, and hands both back when it lets it go)."""
        self.expire(now)
        slot = self._index.get(key)
        if slot is None:
            self.stats.misses += 1
            return None
        path = self._path(slot.value)
        try:
            with open(path, "rb") as f:
                data = f.read()
            entry = blockfile.decode(data, key)
        except (OSError, TierFileCorrupt):
            self._index.pop(key)
            _unlink(path)
            self.stats.corrupt_dropped += 1
            self.stats.misses += 1
            return None
        if touch and not self._refresh(key, now):
            self.stats.misses += 1
            return None
        self.stats.hits += 1
        self.stats.bytes_read += len(data)
        return entry

    def current_stats(self) -> TierStats:
        return dataclasses.replace(self.stats, entries=len(self._index), bytes=self._index.bytes)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
