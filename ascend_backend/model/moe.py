"""Mixture of experts in torch (deepinfer_jax/model/moe.py): a router (learned top-k or a
hash table), the routed experts, a shared expert. Each expert is a clamped SwiGLU:
silu(min(a, L)) * clamp(b, -L, L).

The routed experts run per expert over the (token, slot) pairs routed to it, only for the
experts that have pairs (a fused grouped-GEMM operator of torch_npu would take the same
sorted pairs); each token's K weighted outputs are then summed in slot order."""

from __future__ import annotations

import torch

from deepinfer_jax.config.model import MlpKind, ScoringFunc

NO_EXPERT = -1      # a (token, slot) pair routed nowhere: a padding token's


def score(logits: torch.Tensor, func: ScoringFunc) -> torch.Tensor:
    if func is ScoringFunc.SQRTSOFTPLUS:
        return torch.sqrt(torch.nn.functional.softplus(logits))
    if func is ScoringFunc.SOFTMAX:
        return torch.softmax(logits, dim=-1)
    return torch.sigmoid(logits)


def swiglu(gate_up: torch.Tensor, limit: float) -> torch.Tensor:
    """[..., 2I] -> [..., I] (no clamp when limit is 0)."""
    gate, up = gate_up.chunk(2, dim=-1)
    if limit > 0:
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return torch.nn.functional.silu(gate) * up


def route(x: torch.Tensor, token_ids: torch.Tensor, p, kind: MlpKind, cfg
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, D], token_ids int[T] -> (experts int[T, K], weights f32[T, K])."""
    scores = score(x.float() @ p.gate.float(), cfg.scoring_func)
    if kind is MlpKind.HASH_MOE:
        experts = p.tid2eid[token_ids]
    else:
        biased = scores + p.bias
        experts = torch.sort(biased, dim=-1, descending=True, stable=True
                             ).indices[:, :cfg.num_experts_per_tok]
    weights = torch.gather(scores, -1, experts)
    if cfg.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return experts, weights * cfg.routed_scaling_factor


def routed_experts(x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, p,
                   limit: float) -> torch.Tensor:
    """x [T, D], experts int[T, K] (NO_EXPERT: skipped), weights f32[T, K] -> [T, D]."""
    per_slot = torch.zeros((*experts.shape, x.shape[-1]), dtype=x.dtype, device=x.device)
    for e in torch.unique(experts[experts != NO_EXPERT]).tolist():
        token, slot = torch.nonzero(experts == e, as_tuple=True)
        hidden = swiglu(x[token] @ p.w13[e], limit)
        per_slot[token, slot] = (hidden @ p.w2[e]) * weights[token, slot, None].to(x.dtype)
    return per_slot.sum(1)


def moe(x: torch.Tensor, token_ids: torch.Tensor, p, kind: MlpKind, cfg,
        valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, D], token_ids int[T], valid bool[T] (False: a padding token, routed nowhere) ->
    (out [T, D], routed experts int[T, K], NO_EXPERT for padding)."""
    experts, weights = route(x, token_ids, p, kind, cfg)
    experts = torch.where(valid[:, None], experts, NO_EXPERT)
    weights = torch.where(valid[:, None], weights, 0.0)
    out = routed_experts(x, experts, weights, p.experts, cfg.swiglu_limit)
    if p.shared is not None:
        out = out + swiglu(x @ p.shared.w13, cfg.swiglu_limit).to(x.dtype) @ p.shared.w2
    return out, experts
