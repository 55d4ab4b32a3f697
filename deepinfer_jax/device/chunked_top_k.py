"""Exact top-k over a long last axis in two rounds of short ones.

`lax.top_k` with k > 16 over a vocabulary-sized row becomes a full sort on GPUs (XLA's own
top-k kernel stops at k = 16): a multi-pass sort of ~129k keys per row, every step, just for
the logprobs' 20 alternatives. The top k of a row are among the top k of each of its chunks,
so sorting short chunks (one pass each, in shared memory) and then the chunks' winners gives
the same values and indices, ties included: within a chunk the lower index wins (top_k is
stable), and the winners are laid out in index order, so across chunks it wins too.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

CHUNK = 1024


def chunked_top_k(x: jax.Array, k: int, chunk: int = CHUNK) -> tuple[jax.Array, jax.Array]:
    """x f32[N, V] -> (values f32[N, k], indices i32[N, k]), exactly as `lax.top_k(x, k)`."""
    n, v = x.shape
    if k > chunk or v <= 4 * chunk:
        return jax.lax.top_k(x, k)
    n_chunks = -(-v // chunk)
    padded = jnp.pad(x, ((0, 0), (0, n_chunks * chunk - v)), constant_values=-jnp.inf)
    values, within = jax.lax.top_k(padded.reshape(n, n_chunks, chunk), k)     # [N, C, k]
    index = within + (jnp.arange(n_chunks, dtype=within.dtype) * chunk)[:, None]
    values, pick = jax.lax.top_k(values.reshape(n, n_chunks * k), k)
    return values, jnp.take_along_axis(index.reshape(n, n_chunks * k), pick, axis=-1)
