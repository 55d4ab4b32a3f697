"""RMS normalisations, computed in float32 and cast back to the input dtype."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """Weighted RMSNorm over the last axis; the (float32) weight multiplies before the cast."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (weight.astype(jnp.float32) * normed).astype(x.dtype)


def unweighted_rms_norm(x: jax.Array, eps: float) -> jax.Array:
    """RMS-normalise the last axis without a weight (per-head q, and the flattened mHC input)."""
    x32 = x.astype(jnp.float32)
    inv = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return x * inv.astype(x.dtype)
