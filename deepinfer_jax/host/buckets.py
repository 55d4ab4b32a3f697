"""Declared shape buckets: the smallest compiled token bucket that fits a step (no jax)."""

from __future__ import annotations

import bisect


def token_bucket(buckets: tuple[int, ...], num_tokens: int) -> int:
    i = bisect.bisect_left(buckets, num_tokens)
    if i == len(buckets):
        raise ValueError(f"{num_tokens} tokens exceed the largest bucket {buckets[-1]}")
    return buckets[i]
