"""Prefetch latencies per tier: a fixed-bucket histogram (what Prometheus reads) plus the last
samples, for p50 / p99."""

from __future__ import annotations

import bisect
import collections
import dataclasses
import threading

import numpy as np

# seconds: a host-memory read (tens of microseconds) to a slow disk under load (seconds)
BUCKETS = (1e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


@dataclasses.dataclass(frozen=True)
class LatencySummary:
    count: int
    sum_s: float
    p50_s: float | None             # over the last `LatencyHistogram.window` samples
    p99_s: float | None
    buckets: tuple[tuple[float, int], ...]   # (upper bound, cumulative count), +inf last


class LatencyHistogram:
    def __init__(self, window: int = 4096):
        self.window = window
        self._lock = threading.Lock()
        self._counts = [0] * (len(BUCKETS) + 1)
        self._sum, self._recent = 0.0, collections.deque(maxlen=window)

    def observe(self, seconds: float) -> None:
        with self._lock:
            self._counts[bisect.bisect_left(BUCKETS, seconds)] += 1
            self._sum += seconds
            self._recent.append(seconds)

    def summary(self) -> LatencySummary:
        with self._lock:
            recent = np.asarray(self._recent, np.float64)
            cumulative = np.cumsum(self._counts).tolist()
            total = self._sum
        p50, p99 = ((float(np.percentile(recent, 50)), float(np.percentile(recent, 99)))
                    if recent.size else (None, None))
        bounds = (*BUCKETS, float("inf"))
        return LatencySummary(int(cumulative[-1]), total, p50, p99,
                              tuple(zip(bounds, map(int, cumulative), strict=True)))
