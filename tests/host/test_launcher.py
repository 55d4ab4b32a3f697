"""The launcher: calls in submission order on one thread, errors where the result is read,
the caller's transfer guards applied to each call."""

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from deepinfer_jax.engine.launch import Launcher

# A bound on waits, so that a broken launcher fails instead of hanging: generous, since the
# first call compiles and the suite's other worker may hold the cores.
WAIT = 120


@pytest.mark.parametrize("threaded", [True, False])
def test_calls_run_in_order_and_errors_reach_the_reader(threaded):
    launcher, seen, release = Launcher(threaded), [], threading.Event()

    def first():
        release.wait(WAIT)               # the caller submits the second call meanwhile
        seen.append(1)
        return 1

    if not threaded:
        release.set()
    futures = [launcher.submit(first), launcher.submit(lambda: seen.append(2) or 2)]
    release.set()
    assert [f.result(WAIT) for f in futures] == [1, 2] and seen == [1, 2]
    failed = launcher.submit(lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        failed.result(WAIT)
    assert launcher.submit(lambda: 3).result(WAIT) == 3      # the launcher keeps serving


@pytest.mark.parametrize("threaded", [True, False])
def test_the_callers_transfer_guard_covers_the_call(threaded):
    launcher, host = Launcher(threaded), np.ones(3, np.float32)
    add = jax.jit(lambda x: x + 1)
    with jax.transfer_guard("disallow"):
        implicit = launcher.submit(lambda: add(host))
        explicit = launcher.submit(lambda: add(jax.device_put(host)))
    with pytest.raises(Exception, match="[Dd]isallowed"):
        implicit.result(WAIT)
    np.testing.assert_array_equal(np.asarray(explicit.result(WAIT)), host + 1)
    assert launcher.submit(lambda: add(host)).result(WAIT).dtype == jnp.float32   # no guard now
