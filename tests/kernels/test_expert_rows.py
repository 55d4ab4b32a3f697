"""Batch-invariant mode's jnp expert MLP (`reference.expert_rows_one_by_one`, the CPU path)
against numpy and against each row computed alone."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from pallas_kernels.grouped_gemm import reference


def test_rows_one_by_one_are_each_row_alone_and_the_numpy_products():
    """Batch-invariant mode's jnp expert MLP: each sorted row through its group's expert, an
    empty group among them and rows past the groups' total (0), equal to numpy's float32
    products rounded as XLA rounds a bf16 dot (to the rounding of the row's largest value), and
    bitwise to the row computed alone."""
    rng = np.random.default_rng(5)
    d, hidden, limit = 32, 24, 7.0
    w13 = jnp.asarray(rng.normal(size=(4, d, 2 * hidden)) / np.sqrt(d), jnp.bfloat16)
    w2 = jnp.asarray(rng.normal(size=(4, hidden, d)) / np.sqrt(hidden), jnp.bfloat16)
    sizes = jnp.asarray([3, 0, 4, 2], jnp.int32)                      # 9 rows routed of 11
    x = jnp.asarray(rng.normal(size=(11, d)), jnp.bfloat16)
    out = np.asarray(jax.jit(functools.partial(reference.expert_rows_one_by_one,
                                               swiglu_limit=limit))(x, w13, w2, sizes))
    bf16 = lambda a: np.asarray(a, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)  # noqa: E731
    f32 = lambda a: np.asarray(a, np.float32)  # noqa: E731
    experts = np.repeat(np.arange(4), np.asarray(sizes))
    for i, e in enumerate(experts):
        up = bf16(f32(x[i]) @ f32(w13[e]))
        gate, lin = np.split(up, 2)
        act = bf16(np.asarray(reference.swiglu(jnp.asarray(up, jnp.bfloat16)[None], limit))[0])
        assert np.allclose(act, bf16(gate.clip(max=limit) / (1 + np.exp(-gate.clip(max=limit)))
                                     * lin.clip(-limit, limit)), rtol=2e-2, atol=1e-2)
        # bf16 roundings before and after the activation move an output by about a bf16 step
        # of the row's largest value (an H200: 0.011 where its largest is 3.7); a wrong
        # expert or row is off by the values' own size
        expected = bf16(act @ f32(w2[e]))
        np.testing.assert_allclose(out[i].astype(np.float32), expected,
                                   rtol=1e-2, atol=1e-2 * np.abs(expected).max())
        one = np.zeros(4, np.int32)
        one[e] = 1
        alone = reference.expert_rows_one_by_one(x[i][None], w13, w2, jnp.asarray(one), limit)
        assert np.array_equal(np.asarray(alone)[0], out[i])
    assert not np.any(np.asarray(out[9:], np.float32))
