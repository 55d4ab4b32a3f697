"""The batch-invariant building blocks: ordered sums and softmax against float64 numpy, and
their per-row results bitwise independent of how many rows surround them (bf16 inputs, where
the order of additions shows)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from deepinfer_jax.config.compute import ComputeConfig
from deepinfer_jax.model.invariant import ordered_softmax, ordered_sum, per_row_tiles


@pytest.mark.parametrize("n", [1, 2, 3, 4, 7, 8, 128])
def test_ordered_sum_is_the_sum(n):
    x = np.random.default_rng(n).standard_normal((5, n, 3))
    np.testing.assert_allclose(np.asarray(ordered_sum(jnp.asarray(x, jnp.float32), 1)),
                               x.sum(1), rtol=1e-5, atol=1e-5)


def test_hand_computed_order():
    """[2**24, 1, 1, 1] in float32 (2**24 + 1 rounds back to 2**24): the tree adds x0 + x2 and
    x1 + x3 first, [2**24, 2], then 2**24 + 2, which is exact; left to right would lose
    every 1 and give 2**24."""
    big = float(2 ** 24)
    assert float(ordered_sum(jnp.asarray([big, 1.0, 1.0, 1.0], jnp.float32), 0)) == big + 2
    # odd length: [1, 1, 1] -> [1 + 1, 1] -> 3; [big, 1, 1] -> [big + 1 = big, 1] -> big
    assert float(ordered_sum(jnp.asarray([1.0, 1.0, 1.0], jnp.float32), 0)) == 3.0
    assert float(ordered_sum(jnp.asarray([big, 1.0, 1.0], jnp.float32), 0)) == big


def test_rows_do_not_depend_on_the_batch():
    x = jnp.asarray(np.random.default_rng(0).standard_normal((64, 128, 16)), jnp.bfloat16)
    full_sum, full_softmax = ordered_sum(x, 1), ordered_softmax(x.astype(jnp.float32), 1)
    for m in (1, 3, 17):
        np.testing.assert_array_equal(np.asarray(ordered_sum(x[:m], 1), np.float32),
                                      np.asarray(full_sum[:m], np.float32))
        np.testing.assert_array_equal(np.asarray(ordered_softmax(x[:m].astype(jnp.float32), 1)),
                                      np.asarray(full_softmax[:m]))
    w = jnp.asarray(np.random.default_rng(1).standard_normal((16, 32)), jnp.bfloat16)
    tiled = per_row_tiles(lambda t: t @ w, x[:, 0], tile=8)
    for m in (1, 5, 9):
        np.testing.assert_array_equal(np.asarray(per_row_tiles(lambda t: t @ w, x[:m, 0], tile=8)),
                                      np.asarray(tiled[:m]))


@pytest.mark.parametrize("invariant", [False, True])
def test_float32_linears_ask_for_float32_products(invariant):
    """A float32 linear (mHC's projection) lowers, for a GPU too, with HIGHEST precision: a
    GPU's default for float32 operands is TF32, which rounds them to 10-bit mantissas. bf16
    operands keep the default (their products are exact either way)."""
    import jax

    from deepinfer_jax.model.invariant import linear

    def lowered(dtype):
        x, w = jnp.ones((16, 64), dtype), jnp.ones((64, 24), dtype)
        return jax.jit(lambda a, b: linear(a, b, ComputeConfig(batch_invariant=invariant))
                       ).lower(x, w).as_text()

    assert "HIGHEST" in lowered(jnp.float32)
    assert "HIGHEST" not in lowered(jnp.bfloat16)
