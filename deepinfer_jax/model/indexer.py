"""The lightning indexer of CSA layers: which compressed rows each query attends to.

score(t, s) = sum_h w[t, h] * relu(q[t, h] . k[s]) / sqrt(Id), with w = x W_w / sqrt(IH),
q the indexer's query heads (roped at t), k the indexer's own compressed keys (same windows
as the main compressor, d = Id). Each query keeps the top `index_topk` rows among the ones it
may see (s < (t+1) // m); no softmax.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from deepinfer_jax.config.compute import ComputeConfig
from deepinfer_jax.model.invariant import linear
from deepinfer_jax.model.params import IndexerParams
from deepinfer_jax.model.rope import apply_rope


def index_queries(q_latent: jax.Array, p: IndexerParams, cos: jax.Array, sin: jax.Array,
                  n_heads: int, compute: ComputeConfig) -> jax.Array:
    """q_latent [..., R] -> roped f32 queries [..., IH, Id] (cos/sin [..., rope_dim/2])."""
    q = linear(q_latent, p.wq_b, compute).astype(jnp.float32)
    q = q.reshape(*q.shape[:-1], n_heads, -1)
    return apply_rope(q, cos[..., None, :], sin[..., None, :])


def head_weights(x: jax.Array, p: IndexerParams, n_heads: int, compute: ComputeConfig
                 ) -> jax.Array:
    """x [..., D] -> f32[..., IH]."""
    return linear(x, p.weights_proj, compute).astype(jnp.float32) * (n_heads ** -0.5)


def index_scores(q: jax.Array, weights: jax.Array, keys: jax.Array) -> jax.Array:
    """q f32[B, S, IH, Id], weights f32[B, S, IH], keys [B, T, Id] -> f32[B, S, T]."""
    dots = jnp.einsum("bshd,btd->bsht", q, keys.astype(jnp.float32))
    scaled = jax.nn.relu(dots) * (q.shape[-1] ** -0.5)
    return jnp.einsum("bsht,bsh->bst", scaled, weights)


def select_top_k(scores: jax.Array, visible: jax.Array, top_k: int) -> jax.Array:
    """Pick the best visible rows per query.

    scores f32[..., T], visible bool[..., T] -> selected bool[..., T] (at most top_k True,
    only visible rows). Ties keep the lower row index.
    """
    n_rows = scores.shape[-1]
    k = min(top_k, n_rows)
    if k == 0:
        return jnp.zeros(scores.shape, bool)
    masked = jnp.where(visible, scores, -jnp.inf)
    _, idx = jax.lax.top_k(masked, k)                                   # [..., k]
    chosen = jnp.any(idx[..., :, None] == jnp.arange(n_rows), axis=-2)   # [..., T]
    return chosen & visible
