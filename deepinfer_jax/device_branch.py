"""Skipping work inside the step without stalling the host.

XLA runs a `lax.cond` on a GPU by copying its predicate to the host and waiting for the stream
(ConditionalThunk: BlockHostUntilDone): every such branch makes the host wait for the device
mid-step, which defeats the asynchronous loop (the host could not plan step N+1 while step N
runs). So a branch that only skips work is a real branch where execution is synchronous anyway
(the CPU), and elsewhere the work always runs: the result is the same, because every caller
skips work whose result would be ignored.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import jax


def runtime_branches() -> bool:
    """Whether `skip_unless` may branch at run time (traced per compile, so per backend).
    DEEPINFER_RUNTIME_BRANCHES=0/1 overrides it (tests run the GPU formulation on the CPU)."""
    forced = os.environ.get("DEEPINFER_RUNTIME_BRANCHES")
    if forced is not None:
        return forced == "1"
    return jax.default_backend() == "cpu"


def skip_unless(needed: jax.Array, work: Callable, skipped: Callable, *operands):
    """`work(*operands)` if `needed` (a traced bool) else `skipped(*operands)`; the caller
    guarantees that where `needed` is False, `work`'s result is as good as `skipped`'s."""
    if runtime_branches():
        return jax.lax.cond(needed, work, skipped, *operands)
    return work(*operands)
