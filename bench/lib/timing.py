"""Host-side timing: back-to-back calls of a jitted function closed by block_until_ready,
repeated; the median over the repeats and their spread (min, max), so that a figure says how
steady it was. At least 5 repeats: fewer give a median that one outlier can move."""

from __future__ import annotations

import dataclasses
import statistics
import time

import jax
import numpy as np

MIN_REPEATS = 5


@dataclasses.dataclass(frozen=True)
class Timing:
    """Milliseconds per call: the median over `repeats` samples, and the extremes."""
    ms: float
    min_ms: float
    max_ms: float
    repeats: int

    @classmethod
    def of(cls, samples_ms: list[float]) -> Timing:
        return cls(statistics.median(samples_ms), min(samples_ms), max(samples_ms),
                   len(samples_ms))

    def row(self) -> dict:
        """The fields a result row records (its "ms" is the median)."""
        return {"ms": self.ms, "ms_min": self.min_ms, "ms_max": self.max_ms,
                "repeats": self.repeats}


def spread(row: dict) -> str:
    """A result row's min-max, for a table cell ('' where the row has none)."""
    if "ms_min" not in row:
        return ""
    return f"{row['ms_min']:.3f}-{row['ms_max']:.3f} ({row['repeats']})"


def timing(fn, *args, calls: int = 10, repeats: int = MIN_REPEATS) -> Timing:
    """`repeats` samples, each the mean time of `calls` back-to-back launches (after one
    untimed call: compilation and autotuning are not timed)."""
    if repeats < MIN_REPEATS:
        raise ValueError(f"{repeats} repeats: at least {MIN_REPEATS} give a median to trust")
    jax.block_until_ready(fn(*args))
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - start) / calls * 1e3)
    return Timing.of(samples)


def timed_ms(fn, *args, calls: int = 10, repeats: int = MIN_REPEATS) -> float:
    """The median of timing()."""
    return timing(fn, *args, calls=calls, repeats=repeats).ms


def rel_err(out, ref) -> float:
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))
