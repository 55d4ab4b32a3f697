"""RMS normalisations, computed in float32 and cast back to the input dtype."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from deepinfer_jax.model.invariant import ordered_sum


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, *, ordered: bool = False) -> jax.Array:
    """Weighted RMSNorm over the last axis; the (float32) weight multiplies before the cast.

    ordered: the mean of squares as an ordered_sum (elementwise adds in a fixed tree), whose
    bits follow the row alone. XLA's GPU row reduction may round a row by the shapes around it
    (its vector width follows the fusion it builds, and fusions follow shapes), which matters
    where the row count follows the engine's size rather than the token bucket."""
    x32 = x.astype(jnp.float32)
    squares = x32 * x32
    mean = (ordered_sum(squares, -1)[..., None] / x.shape[-1] if ordered
            else jnp.mean(squares, axis=-1, keepdims=True))
    normed = x32 * jax.lax.rsqrt(mean + eps)
    return (weight.astype(jnp.float32) * normed).astype(x.dtype)


def unweighted_rms_norm(x: jax.Array, eps: float) -> jax.Array:
    """RMS-normalise the last axis without a weight (per-head q, and the flattened mHC input)."""
    x32 = x.astype(jnp.float32)
    inv = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return x * inv.astype(x.dtype)
