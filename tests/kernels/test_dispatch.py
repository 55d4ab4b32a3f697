"""The implementation tables' dispatch: the first implementation that takes the operands runs;
a kernel that does not take them falls through on NotSupported."""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.common import NotSupported, dispatch
from pallas_kernels.sinkhorn import api as sinkhorn


def test_the_first_implementation_that_takes_the_operands_runs():
    calls = []

    def refuses(x):
        calls.append("refuses")
        raise NotSupported("never")

    def takes(x):
        calls.append("takes")
        return x + 1

    table = {"mosaic_gpu": refuses, "interpret": takes, "reference": lambda x: x - 1}
    assert dispatch("op", table, ("mosaic_gpu", "interpret", "reference"), 1) == 2
    assert calls == ["refuses", "takes"]
    assert dispatch("op", table, "reference", 1) == 0


def test_no_implementation_left_names_every_reason():
    def refuses(x):
        raise NotSupported("K not a multiple of 64")

    with pytest.raises(NotSupported, match="mosaic_gpu: K not a multiple of 64"):
        dispatch("op", {"mosaic_gpu": refuses}, ("mosaic_gpu",), 1)


def test_an_unknown_implementation_is_a_value_error():
    with pytest.raises(ValueError, match="unknown implementation 'triton'"):
        dispatch("op", {"reference": lambda x: x}, ("triton", "reference"), 1)


def test_a_kernel_falls_through_to_the_reference_for_operands_it_does_not_take():
    """The Sinkhorn kernel takes float32 only: bf16 logits go to the next implementation."""
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(5, 4, 4)), jnp.bfloat16)
    with pytest.raises(NotSupported, match="float32"):
        sinkhorn.sinkhorn(logits, 3, 1e-6, implementation="interpret")
    got = sinkhorn.sinkhorn(logits, 3, 1e-6, implementation=("interpret", "reference"))
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(
        sinkhorn.sinkhorn(logits, 3, 1e-6, implementation="reference"), np.float32))
