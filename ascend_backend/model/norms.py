"""RMS normalisations in float32 (deepinfer_jax/model/norms.py)."""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * normed).to(x.dtype)


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return x * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps).to(x.dtype)
