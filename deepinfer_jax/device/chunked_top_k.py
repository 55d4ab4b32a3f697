"""Exact top-k over a long last axis without sorting it.

`lax.top_k` with k > 16 over a vocabulary-sized row becomes a full sort on GPUs (XLA's own
top-k kernel stops at k = 16): a multi-pass sort of ~129k keys per row, every step, just for
the logprobs' 20 alternatives. Instead the row is cut into chunks and only the k chunks with
the best maxima are sorted. That is exact, ties included, under top_k's order (larger value
first, then lower index): an element of the top k lies in a chunk whose best element is at
least as good, and if k other chunks had better best elements, those k elements would all
rank above it. Chunks are ranked by (maximum, chunk index), the same order on their best
elements, and the chosen chunks are laid out in index order, so the final top_k's ties (lower
position first) are ties by index.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# 129280 / 128 = 1010 chunk maxima and 20 x 128 = 2560 candidates a row: both sorts short
CHUNK = 128


def chunked_top_k(x: jax.Array, k: int, chunk: int = CHUNK) -> tuple[jax.Array, jax.Array]:
    """x f32[N, V] -> (values f32[N, k], indices i32[N, k]), exactly as `lax.top_k(x, k)`."""
    n, v = x.shape
    n_chunks = -(-v // chunk)
    if k == 0 or k > n_chunks or v <= 4 * chunk:
        return jax.lax.top_k(x, k)
    padded = jnp.pad(x, ((0, 0), (0, n_chunks * chunk - v)), constant_values=-jnp.inf)
    chunks = padded.reshape(n, n_chunks, chunk)
    _, best_chunks = jax.lax.top_k(jnp.max(chunks, axis=-1), k)                   # [N, k]
    chosen = jnp.sort(best_chunks, axis=-1)                                       # index order
    candidates = jnp.take_along_axis(chunks, chosen[:, :, None], axis=1)          # [N, k, chunk]
    values, pick = jax.lax.top_k(candidates.reshape(n, k * chunk), k)
    index = jnp.take_along_axis(chosen, pick // chunk, axis=-1) * chunk + pick % chunk
    return values, index.astype(jnp.int32)
