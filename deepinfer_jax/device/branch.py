"""Skipping work inside the step without stalling the host.

XLA runs a `lax.cond` on a GPU by copying its predicate to the host and waiting for the stream
(ConditionalThunk: BlockHostUntilDone): every such branch makes the host wait for the device
mid-step, which defeats the asynchronous loop (the host could not plan step N+1 while step N
runs). So a branch that only skips work is a real branch where execution is synchronous anyway
(the CPU formulation, `ComputeConfig.launch_bound` False), and otherwise the work always
runs: the result is the same, because every caller skips work whose result would be ignored.
"""

from __future__ import annotations

from collections.abc import Callable

import jax


def skip_unless(launch_bound: bool, needed: jax.Array, work: Callable, skipped: Callable,
                *operands):
    """`work(*operands)` if `needed` (a traced bool) else `skipped(*operands)`; the caller
    guarantees that where `needed` is False, `work`'s result is as good as `skipped`'s.
    launch_bound: the step's formulation (ComputeConfig.launch_bound)."""
    if launch_bound:
        return work(*operands)
    return jax.lax.cond(needed, work, skipped, *operands)
