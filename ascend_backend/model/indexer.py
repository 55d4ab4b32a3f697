"""The lightning indexer of CSA layers (deepinfer_jax/model/indexer.py and the indexer op's
reference): score(t, s) = sum_h w[t, h] relu(q[t, h] . k[s]) / sqrt(Id), top-k rows kept."""

from __future__ import annotations

import torch

from ascend_backend.model.rope import apply_rope


def index_queries(q_latent: torch.Tensor, p, cos: torch.Tensor, sin: torch.Tensor,
                  n_heads: int) -> torch.Tensor:
    """q_latent [T, R] -> roped f32 queries [T, IH, Id]."""
    q = (q_latent @ p.wq_b).float()
    q = q.reshape(*q.shape[:-1], n_heads, -1)
    return apply_rope(q, cos[..., None, :], sin[..., None, :])


def head_weights(x: torch.Tensor, p, n_heads: int) -> torch.Tensor:
    """x [T, D] -> f32[T, IH]."""
    return (x @ p.weights_proj).float() * (n_heads ** -0.5)


def indexer_scores(q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor,
                   token_seq: torch.Tensor) -> torch.Tensor:
    """q [T, H, d], keys per sequence [N, R, d], weights f32[T, H], token_seq int[T] (-1:
    padding) -> f32[T, R] (0 for padding tokens)."""
    own = keys[token_seq.clamp(min=0)].float()                              # [T, R, d]
    dots = torch.einsum("thd,trd->thr", q.float(), own)
    scores = torch.einsum("thr,th->tr", torch.relu(dots) * q.shape[-1] ** -0.5, weights)
    return torch.where((token_seq >= 0)[:, None], scores, torch.zeros_like(scores))


def top_k_indices(x: torch.Tensor, k: int) -> torch.Tensor:
    """The k largest along the last axis, ties to the lower index (jax.lax.top_k's order):
    a stable sort, where torch.topk leaves the order of ties open."""
    return torch.sort(x, dim=-1, descending=True, stable=True).indices[..., :k]
