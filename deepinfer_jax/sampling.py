"""Token selection on the device, branch-free per row.

Greedy (argmax) for now; temperature / top-k / top-p / seeded streams come with the sampling
issue and slot in here without changing the step's contract.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def greedy(logits: jax.Array) -> jax.Array:
    """f32[N, V] -> i32[N]; ties pick the lowest token id."""
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
