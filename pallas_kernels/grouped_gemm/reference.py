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


# Up to this many products (rows x groups x columns) the dense form (api's "dense") computes
# every group's product for every row and keeps each row's own: XLA's GPU ragged_dot runs a
# loop over the groups (a few launches each), most of a small model's decode step there.
DENSE_PRODUCTS = 1 << 24


def dense_grouped_dot(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """ragged_dot's result from one dense einsum: [M, K] x [G, K, N] -> f32[M, N]; rows past
    the groups' total are 0, as ragged_dot leaves them."""
    rows, groups = lhs.shape[0], rhs.shape[0]
    ends = jnp.cumsum(group_sizes)
    group = jnp.sum(ends[None, :] <= jnp.arange(rows)[:, None], axis=1)   # no search loop
    every = jnp.einsum("mk,gkn->mgn", lhs, rhs, preferred_element_type=jnp.float32)
    own = jnp.take_along_axis(every, jnp.minimum(group, groups - 1)[:, None, None], axis=1)
    return jnp.where((group < groups)[:, None], own[:, 0], 0.0)


def grouped_matmul(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *,
                   rhs_scale: jax.Array | None = None,
                   swiglu_limit: float | None = None, dense: bool = False) -> jax.Array:
    """dense: dense_grouped_dot (one einsum, for small products on launch-bound devices);
    else ragged_dot."""
    if rhs_scale is not None:
        rhs = dequantize(rhs, rhs_scale, lhs.dtype)
    if dense:
        out = dense_grouped_dot(lhs, rhs, group_sizes)
    else:
        out = jax.lax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=jnp.float32)
    if swiglu_limit is not None:
        out = swiglu(out, swiglu_limit)
    return out.astype(lhs.dtype)


def expert_rows_one_by_one(x: jax.Array, w13: jax.Array, w2: jax.Array, group_sizes: jax.Array,
                           swiglu_limit: float) -> jax.Array:
    """Each sorted row [M, D] through its group's expert on its own (batch-invariant mode's jnp
    path: a grouped product's per-row result may depend on how many rows its group has).
    Rows past the groups' total come out 0.

    A loop over the experts, each taking its weights once, around a loop over its rows: a
    loop over the rows alone copied a row's expert weights out in every iteration (XLA's CPU
    dot takes no dynamically sliced operand in place): half of the served tiny model's
    invariant decode step on the CPU."""
    ends = jnp.cumsum(group_sizes)
    starts = ends - group_sizes

    def rows_of(e, out):
        w13_e, w2_e = w13[e], w2[e]

        def row(i, out):
            hidden = swiglu(x[i][None] @ w13_e, swiglu_limit).astype(x.dtype)
            return out.at[i].set((hidden @ w2_e)[0])

        return jax.lax.fori_loop(starts[e], ends[e], row, out)

    def expert(e, out):      # (an expert without rows reads no weights)
        return jax.lax.cond(group_sizes[e] > 0, rows_of, lambda e, out: out, e, out)

    out = jnp.zeros((x.shape[0], w2.shape[-1]), jnp.result_type(x, w2))
    return jax.lax.fori_loop(0, w13.shape[0], expert, out)
