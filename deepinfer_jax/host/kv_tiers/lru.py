"""The bookkeeping both tiers share: entries in least-recently-used order with their sizes
and last-use times, a byte total, and which ones the budget or the retention time sends out.

Last-use times come from the tier's injected clock. LRU order is use order, so with a clock
that does not go back the expired entries are always a prefix of it, found without a scan.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Iterator
from typing import Generic, TypeVar

V = TypeVar("V")


@dataclasses.dataclass
class Slot(Generic[V]):
    value: V
    nbytes: int
    last_used: float


class LruIndex(Generic[V]):
    def __init__(self, budget_bytes: int, retention_s: float):
        self.budget_bytes, self.retention_s = budget_bytes, retention_s
        self._slots: OrderedDict[int, Slot[V]] = OrderedDict()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._slots)

    def __contains__(self, key: int) -> bool:
        return key in self._slots

    def get(self, key: int) -> Slot[V] | None:
        return self._slots.get(key)

    def add(self, key: int, value: V, nbytes: int, now: float) -> None:
        """Insert as most recently used (the caller made room first)."""
        self.pop(key)
        self._slots[key] = Slot(value, nbytes, now)
        self.bytes += nbytes

    def touch(self, key: int, now: float) -> None:
        self._slots[key].last_used = now
        self._slots.move_to_end(key)

    def pop(self, key: int) -> Slot[V] | None:
        slot = self._slots.pop(key, None)
        if slot is not None:
            self.bytes -= slot.nbytes
        return slot

    def expired(self, now: float) -> Iterator[tuple[int, Slot[V]]]:
        """Remove and yield the entries unused for the retention time (an entry expires at
        exactly last_used + retention_s)."""
        while self._slots:
            key, slot = next(iter(self._slots.items()))
            if slot.last_used + self.retention_s > now:
                return
            yield key, self.pop(key)

    def make_room(self, nbytes: int) -> Iterator[tuple[int, Slot[V]]]:
        """Remove and yield least recently used entries until `nbytes` more fit the budget."""
        while self._slots and self.bytes + nbytes > self.budget_bytes:
            key = next(iter(self._slots))
            yield key, self.pop(key)

    def items_by_age(self) -> list[tuple[int, Slot[V]]]:
        return list(self._slots.items())
