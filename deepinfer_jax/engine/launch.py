"""Device calls on a thread of their own, so that launching step N overlaps planning step N+1.

On a GPU, XLA launches a step's kernels from the calling thread, a few microseconds each:
for a V4-Flash decode step milliseconds of host time on the H200, about as long as the
device's own work at small batches (docs/performance-log.md). jax releases the GIL
while it launches, so the engine loop hands each step's device calls (snapshot restores, the
step, snapshot saves) to one worker thread, in submission order, and goes on reading the
last step's tokens and planning the next; it waits only where it reads tokens. The device state is
touched by the worker alone while the loop runs (the loop reads nothing of it).

`Launcher(threaded=False)` runs each call in place (the synchronous loop, where nothing would
overlap). jax's transfer guards are thread-local: the caller's travel with each call, so a
"disallow" around the loop still covers the step.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import weakref
from collections.abc import Callable
from typing import TypeVar

import jax
from jax._src import config as jax_config  # the guards' thread-local levels: no public getter

T = TypeVar("T")

_GUARDS = {"host_to_device": jax.transfer_guard_host_to_device,
           "device_to_host": jax.transfer_guard_device_to_host,
           "device_to_device": jax.transfer_guard_device_to_device}


def _current_guards() -> dict[str, str | None]:
    return {name: getattr(jax_config, f"transfer_guard_{name}").value for name in _GUARDS}


def _run_under(guards: dict[str, str | None], fn: Callable[[], T]) -> T:
    with contextlib.ExitStack() as stack:
        for name, level in guards.items():
            if level is not None:
                stack.enter_context(_GUARDS[name](level))
        return fn()


class Launcher:
    def __init__(self, threaded: bool = True):
        self._pool = (concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="deepinfer-launch")
                      if threaded else None)
        if self._pool is not None:    # a dropped launcher (its engine gone) frees its thread
            weakref.finalize(self, self._pool.shutdown, wait=False)

    def submit(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        """Run fn after every call submitted before it; its result (or error) in the future."""
        guards = _current_guards()
        if self._pool is not None:
            return self._pool.submit(_run_under, guards, fn)
        done: concurrent.futures.Future[T] = concurrent.futures.Future()
        try:
            done.set_result(_run_under(guards, fn))
        except Exception as error:      # raised where the result is read, as on the thread
            done.set_exception(error)
        return done
