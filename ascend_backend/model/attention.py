"""DeepSeek-V4 attention in torch (deepinfer_jax/model/attention.py): one shared K=V head,
low-rank queries, a per-head sink logit, and a grouped low-rank output projection.

`sink_attention_parts` is the plain-torch path and the oracle for a fused NPU operator."""

from __future__ import annotations

import torch

from ascend_backend.model.norms import rms_norm, unweighted_rms_norm
from ascend_backend.model.rope import apply_rope


def project_queries(x: torch.Tensor, p, cos: torch.Tensor, sin: torch.Tensor, cfg
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, D] -> (q [T, H, hd] roped, q_latent [T, R]: the indexer's query input)."""
    q_latent = rms_norm(x @ p.wq_a, p.q_norm, cfg.rms_norm_eps)
    q = (q_latent @ p.wq_b).reshape(*x.shape[:-1], cfg.num_heads, cfg.head_dim)
    q = unweighted_rms_norm(q, cfg.rms_norm_eps)
    return apply_rope(q, cos[..., None, :], sin[..., None, :]), q_latent


def project_kv(x: torch.Tensor, p, cos: torch.Tensor, sin: torch.Tensor, cfg) -> torch.Tensor:
    """x [T, D] -> each token's raw K=V row [T, hd], roped at its position."""
    return apply_rope(rms_norm(x @ p.wkv, p.kv_norm, cfg.rms_norm_eps), cos, sin)


def sink_attention_parts(q: torch.Tensor, keys: tuple[torch.Tensor, ...],
                         visible: tuple[torch.Tensor, ...], sinks: torch.Tensor) -> torch.Tensor:
    """q [T, H, hd], row sets keys [T, R_i, hd] (also the values), visible bool[T, R_i] ->
    [T, H, hd]: one softmax per head over every visible row of every set and the sink logit
    (whose value vector is zero)."""
    scale = q.shape[-1] ** -0.5
    logits = torch.cat([torch.einsum("thd,trd->thr", q.float(), k.float()) * scale
                        for k in keys], dim=-1)
    mask = torch.cat(visible, dim=-1)[:, None, :]
    logits = logits.masked_fill(~mask, float("-inf"))
    peak = torch.maximum(logits.amax(-1), sinks)                                  # [T, H]
    probs = torch.exp(logits - peak[..., None])
    denom = probs.sum(-1) + torch.exp(sinks - peak)
    out = torch.einsum("thr,trd->thd", probs, torch.cat(keys, dim=1).float())
    return (out / denom[..., None]).to(q.dtype)


def output_projection(o: torch.Tensor, p, cos: torch.Tensor, sin: torch.Tensor, cfg
                      ) -> torch.Tensor:
    """o [T, H, hd] -> [T, D]: de-rope at the query position, each group of consecutive heads
    -> L dims (wo_a [G, H*hd/G, L]), then all groups -> D."""
    o = apply_rope(o, cos[..., None, :], sin[..., None, :], inverse=True)
    grouped = o.reshape(*o.shape[:-2], cfg.o_groups, -1)
    low_rank = torch.einsum("tgk,gkn->tgn", grouped, p.wo_a)
    return low_rank.reshape(*o.shape[:-2], -1) @ p.wo_b
