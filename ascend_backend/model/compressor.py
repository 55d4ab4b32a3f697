"""Time-axis KV compression, the pooling and finishing of rows (deepinfer_jax/model/
compressor.py): a row pools, per channel, sum softmax(B) * A over its slots (the m tokens of
its block; with overlap the first halves of block w-1's tokens and the second halves of block
w's), then is RMS-normalised and roped at its block's first position."""

from __future__ import annotations

import numpy as np
import torch

from ascend_backend.model.norms import rms_norm
from ascend_backend.model.rope import apply_rope, cos_sin


def project(x: torch.Tensor, p) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, D] -> (kv, score) f32[T, c*d]; the score still lacks the block-position bias."""
    return x.float() @ p.wkv.float(), x.float() @ p.wgate.float()


def pool_closing_rows(kv: torch.Tensor, score: torch.Tensor, *, rate: int, overlap: bool
                      ) -> torch.Tensor:
    """Gathered slots of rows that close: kv, score f32[n, span, c*d] (span = 2m with
    overlap: block w-1's tokens, then block w's) -> pooled f32[n, d]."""
    if overlap:
        d = kv.shape[-1] // 2
        kv = torch.cat([kv[:, :rate, :d], kv[:, rate:, d:]], dim=1)          # [n, 2m, d]
        score = torch.cat([score[:, :rate, :d], score[:, rate:, d:]], dim=1)
    return (torch.softmax(score, dim=1) * kv).sum(1)


def finish_rows(pooled: torch.Tensor, norm: torch.Tensor, row_positions: torch.Tensor,
                freqs: np.ndarray, eps: float, dtype: torch.dtype) -> torch.Tensor:
    """Normalise and rope pooled rows f32[n, d] at their first-token positions int[n]."""
    cos, sin = cos_sin(row_positions, freqs)
    return apply_rope(rms_norm(pooled, norm, eps), cos, sin).to(dtype)
