"""The lightning indexer's scores over each sequence's compressed keys, in plain jnp: the
engine's CPU path and the kernel's oracle (the cache-free reference forward scores with
model/indexer.py).

    score[t, r] = sum_h w[t, h] * relu(q[t, h] . keys[seq[t], r]) / sqrt(d)

Every token of a sequence scores the same key rows (its sequence's), so the keys come per
sequence, [N, R, d], not gathered per token ([T, R, d]: an 8k prefill's 8192 copies of one
sequence's 2k x 128 keys, 4.4 GB).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.common import ordered_sum


def indexer_scores(q: jax.Array, keys: jax.Array, weights: jax.Array,
                   token_seq: jax.Array, *, ordered_heads: bool = False) -> jax.Array:
    """q [T, H, d], keys [N, R, d], weights f32[T, H], token_seq i32[T] (a token's sequence,
    -1 for padding) -> f32[T, R] (0 for padding tokens). Products of q and keys as given
    (bf16 in the engine), summed in f32.

    ordered_heads: the weighted heads summed in a fixed tree of elementwise adds
    (batch-invariant mode) rather than by a contraction, whose order a GPU compiler picks
    from the fusion and layout around it: these scores matter only through the top-k they
    feed, and two near-equal rows that swap places change the rows a token attends to."""
    own = keys[jnp.maximum(token_seq, 0)]                                     # [T, R, d]
    dots = jnp.einsum("thd,trd->thr", q, own, preferred_element_type=jnp.float32)
    scaled = jax.nn.relu(dots) * q.shape[-1] ** -0.5                          # [T, H, R]
    if ordered_heads:
        scores = ordered_sum(scaled * weights[:, :, None], 1)
    else:
        scores = jnp.einsum("thr,th->tr", scaled, weights)
    return jnp.where((token_seq >= 0)[:, None], scores, 0.0)
