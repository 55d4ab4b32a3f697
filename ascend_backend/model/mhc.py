"""Manifold-constrained hyper-connections in float32 (deepinfer_jax/model/mhc.py): the
residual is `hc` streams; a sublayer reads their `pre`-weighted sum and writes back
`post_k * f + sum_j comb[j, k] X_j`, comb pushed towards doubly-stochastic by Sinkhorn."""

from __future__ import annotations

import torch

from ascend_backend.model.norms import unweighted_rms_norm


def _mixes(streams: torch.Tensor, fn: torch.Tensor, eps: float) -> torch.Tensor:
    """streams [..., hc, D] -> f32[..., n_mix]: the RMS-normalised flat streams @ fn."""
    flat = streams.reshape(*streams.shape[:-2], -1).float()
    return unweighted_rms_norm(flat, eps) @ fn


def sinkhorn(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """f32[..., hc, hc]: row softmax (+ eps), a column normalisation, then iters - 1 times
    rows then columns (each sum + eps)."""
    comb = torch.softmax(logits, dim=-1) + eps
    comb = comb / (comb.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + eps)
        comb = comb / (comb.sum(-2, keepdim=True) + eps)
    return comb


def _collapse(pre: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
    return (pre[..., None] * streams.float()).sum(-2)


def hc_pre(streams: torch.Tensor, p, *, hc_eps: float, norm_eps: float, sinkhorn_iters: int
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """streams [..., hc, D] -> (collapsed [..., D], post f32[..., hc], comb f32[..., hc, hc])."""
    hc = streams.shape[-2]
    mixes = _mixes(streams, p.fn, norm_eps)
    pre_w, post_w, comb_w = mixes[..., :hc], mixes[..., hc:2 * hc], mixes[..., 2 * hc:]
    pre = torch.sigmoid(pre_w * p.scale[0] + p.base[:hc]) + hc_eps
    post = 2.0 * torch.sigmoid(post_w * p.scale[1] + p.base[hc:2 * hc])
    comb_logits = (comb_w * p.scale[2] + p.base[2 * hc:]).reshape(*comb_w.shape[:-1], hc, hc)
    comb = sinkhorn(comb_logits, sinkhorn_iters, hc_eps)
    return _collapse(pre, streams).to(streams.dtype), post, comb


def hc_post(block_out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor,
            comb: torch.Tensor) -> torch.Tensor:
    """X'_k = post_k * f + sum_j comb[j, k] X_j; block_out [..., D], streams [..., hc, D]."""
    mixed = torch.einsum("...jk,...jd->...kd", comb, streams.float())
    return (post[..., None] * block_out[..., None, :].float() + mixed).to(streams.dtype)


def hc_head(streams: torch.Tensor, p, *, hc_eps: float, norm_eps: float) -> torch.Tensor:
    """The final collapse [..., hc, D] -> [..., D] (sigmoid weights, no Sinkhorn)."""
    pre = torch.sigmoid(_mixes(streams, p.fn, norm_eps) * p.scale[0] + p.base) + hc_eps
    return _collapse(pre, streams).to(streams.dtype)
