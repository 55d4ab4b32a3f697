"""Shared by the grouped-GEMM kernel tests: the problems, the operands of the bitwise tests,
the tolerance, and which implementation the kernel tests run (compiled on an SM90+ GPU,
interpreted elsewhere)."""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from tests.kernels.which import KERNEL

K, N = 128, 256
SIZES = {                                   # rows per group
    "balanced": [40, 40, 40, 40],
    "empty experts": [0, 70, 0, 0, 3, 0, 0, 1, 0],
    "one hot expert": [0, 0, 150, 0],
    "one token": [0, 1, 0],
    "one group": [77],
}


def problem(sizes, fp8: bool, seed: int = 0):
    rng = np.random.default_rng(seed)
    sizes = jnp.asarray(sizes, jnp.int32)
    lhs = jnp.asarray(rng.standard_normal((int(sizes.sum()), K)), jnp.bfloat16)
    weights = rng.standard_normal((len(sizes), K, N)) / 8
    if not fp8:
        return lhs, jnp.asarray(weights, jnp.bfloat16), sizes, None
    scale = rng.uniform(0.01, 0.05, (len(sizes), K // 128, N // 128)).astype(np.float32)
    full = np.repeat(np.repeat(scale, 128, 1), 128, 2)
    codes = (weights / full).astype(ml_dtypes.float8_e4m3fn)
    return lhs, jnp.asarray(codes), sizes, jnp.asarray(scale)


def bitwise_operands(rng, x_shape, w_shape):
    """Operands for the tests that compare rows bitwise. On a GPU: random normals, so that
    the question is wgmma's real rounding order. In interpret mode each tile's product is an
    XLA CPU dot, whose rounding may itself depend on the tile's shape on some CPUs (AMD EPYC:
    one element in 50k differed between 64- and 16-column tiles); there small integers (over
    8 for w), whose sums are exact in any order, so that the test checks the kernel's own
    structure (which rows, K ranges and partial sums meet) and not XLA's CPU dot."""
    if KERNEL != "interpret":
        return (jnp.asarray(rng.standard_normal(x_shape), jnp.bfloat16),
                jnp.asarray(rng.standard_normal(w_shape) / 8, jnp.bfloat16))
    return (jnp.asarray(rng.integers(-4, 5, x_shape), jnp.bfloat16),
            jnp.asarray(rng.integers(-4, 5, w_shape) / 8, jnp.bfloat16))


def close(out, ref):
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert out.shape == ref.shape
    np.testing.assert_allclose(out, ref, rtol=2e-2, atol=2e-2 * max(np.abs(ref).max(), 1e-3))


def routed_pairs(rng, k: int = K):
    """The routed experts' operands for the "empty experts" groups: sizes, tokens [T, k] (about
    two pairs a token), source_rows (the token of each sorted pair) and out_order (a
    permutation of the pairs)."""
    sizes = jnp.asarray(SIZES["empty experts"], jnp.int32)
    pairs = int(sizes.sum())
    tokens = jnp.asarray(rng.standard_normal((pairs // 2 + 1, k)), jnp.bfloat16)
    source_rows = jnp.asarray(rng.integers(0, tokens.shape[0], pairs), jnp.int32)
    return sizes, tokens, source_rows, jnp.asarray(rng.permutation(pairs), jnp.int32)


def expert_weights(rng, groups: int) -> tuple[jnp.ndarray, jnp.ndarray]:
    """An expert MLP's stacked weights for `groups` experts: w13 [G, K, N] (gate | up), w2
    [G, N/2, K]."""
    return (jnp.asarray(rng.standard_normal((groups, K, N)) / 8, jnp.bfloat16),
            jnp.asarray(rng.standard_normal((groups, N // 2, K)) / 8, jnp.bfloat16))
