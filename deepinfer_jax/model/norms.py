"""RMS normalisations, computed in float32 and cast back to the input dtype."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from deepinfer_jax.model.invariant import ordered_sum


def mean_of_squares(x: jax.Array, ordered: bool = False) -> jax.Array:
    """The float32 mean of x's squares over its last axis, kept as a size-1 axis.

    ordered: summed as an ordered_sum (elementwise adds in a fixed tree), whose bits follow the
    row alone. XLA's GPU row reduction may round a row by the shapes around it (it splits a
    reduction into partial sums by the row count, and its vector width follows the fusion it
    builds), which matters where the row count follows the engine's size rather than the
    token bucket: the 8-slot engine's head, over the whole batch, summed [8, 256] in [8, 8]
    partials where the 32-slot one's summed [32, 256] at once (both engines' HLO, session
    50)."""
    x32 = x.astype(jnp.float32)
    squares = x32 * x32
    if ordered:
        return ordered_sum(squares, -1)[..., None] / x.shape[-1]
    return jnp.mean(squares, axis=-1, keepdims=True)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, *, ordered: bool = False) -> jax.Array:
    """Weighted RMSNorm over the last axis; the (float32) weight multiplies before the cast.
    ordered: `mean_of_squares`'."""
    normed = x.astype(jnp.float32) * jax.lax.rsqrt(mean_of_squares(x, ordered) + eps)
    return (weight.astype(jnp.float32) * normed).astype(x.dtype)


def unweighted_rms_norm(x: jax.Array, eps: float, *, ordered: bool = False) -> jax.Array:
    """RMS-normalise the last axis without a weight (per-head q, and the flattened mHC input)."""
    inv = jax.lax.rsqrt(mean_of_squares(x, ordered) + eps)
    return x * inv.astype(x.dtype)
