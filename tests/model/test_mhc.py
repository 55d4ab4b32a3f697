"""The mHC Sinkhorn's two formulations (fused unrolled adds for GPUs, a loop of reductions for
the CPU) against a float64 numpy loop written from the formula."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from deepinfer_jax.model.mhc import sinkhorn

ITERS, EPS = 20, 1e-6


def numpy_sinkhorn(logits: np.ndarray) -> np.ndarray:
    x = np.exp(logits - logits.max(-1, keepdims=True))
    c = x / x.sum(-1, keepdims=True) + EPS
    c = c / (c.sum(-2, keepdims=True) + EPS)
    for _ in range(ITERS - 1):
        c = c / (c.sum(-1, keepdims=True) + EPS)
        c = c / (c.sum(-2, keepdims=True) + EPS)
    return c


@pytest.mark.parametrize("unrolled", [False, True])
def test_sinkhorn_matches_the_formula(unrolled):
    logits = 3 * jax.random.normal(jax.random.key(0), (5, 7, 4, 4), jnp.float32)
    got = jax.jit(lambda x: sinkhorn(x, ITERS, EPS, unrolled=unrolled))(logits)
    want = numpy_sinkhorn(np.asarray(logits, np.float64))
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-6, atol=1e-7)
    np.testing.assert_allclose(np.asarray(got).sum(-2), 1.0, atol=1e-5)   # columns last


def test_unrolled_sinkhorn_is_one_fused_chain_without_loops():
    """The point of the unrolled form: no while loop and no reductions left for XLA to launch
    one by one."""
    logits = jnp.zeros((16, 4, 4), jnp.float32)
    hlo = jax.jit(lambda x: sinkhorn(x, ITERS, EPS, unrolled=True)).lower(logits).as_text()
    assert "stablehlo.while" not in hlo and "stablehlo.reduce" not in hlo
    loop = jax.jit(lambda x: sinkhorn(x, ITERS, EPS, unrolled=False)).lower(logits).as_text()
    assert "stablehlo.while" in loop

