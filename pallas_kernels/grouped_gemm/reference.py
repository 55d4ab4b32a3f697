"""The grouped GEMM in plain jnp: the CPU path and the kernel's test oracle.

rows lhs [M, K] sorted by group (group_sizes i32[G] rows each), weights rhs [G, K, N]:
out[r] = lhs[r] @ rhs[group of r], accumulated in float32. Options:
* swiglu_limit: rhs holds gate | up ([G, K, 2I]); out = silu(min(gate, L)) * clip(up, -L, L)
  computed in float32 ([M, I]); L = 0 means no clamp;
* rhs_scale: rhs is FP8 E4M3 with one float32 scale per 128 x 128 block
  ([G, K/128, N/128]), the DeepSeek release's format; it is dequantized to lhs's dtype first.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

SCALE_BLOCK = 128


def dequantize(rhs: jax.Array, rhs_scale: jax.Array, dtype) -> jax.Array:
    """FP8 rhs [G, K, N] with block scales [G, K/128, N/128] -> dtype."""
    full = jnp.repeat(jnp.repeat(rhs_scale, SCALE_BLOCK, axis=1), SCALE_BLOCK, axis=2)
    return (rhs.astype(jnp.float32) * full[:, : rhs.shape[1], : rhs.shape[2]]).astype(dtype)


def swiglu(gate_up: jax.Array, limit: float) -> jax.Array:
    """[..., 2I] -> silu(min(gate, L)) * clip(up, -L, L) [..., I] (no clamp when L = 0)."""
    gate, up = jnp.split(gate_up, 2, axis=-1)
    if limit > 0:
        gate = jnp.minimum(gate, limit)
        up = jnp.clip(up, -limit, limit)
    return jax.nn.silu(gate) * up


def grouped_matmul(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *,
                   rhs_scale: jax.Array | None = None,
                   swiglu_limit: float | None = None) -> jax.Array:
    if rhs_scale is not None:
        rhs = dequantize(rhs, rhs_scale, lhs.dtype)
    out = jax.lax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=jnp.float32)
    if swiglu_limit is not None:
        out = swiglu(out, swiglu_limit)
    return out.astype(lhs.dtype)
