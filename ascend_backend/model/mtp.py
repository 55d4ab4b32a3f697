"""The MTP (next-n) block's input (deepinfer_jax/model/mtp.py): at position t it reads the
main model's final streams H_t and the embedding of the next token x_{t+1}:
Z_j = enorm(Emb(x_{t+1})) W_e + hnorm(H_{t,j}) W_h for every stream j."""

from __future__ import annotations

import torch

from ascend_backend.model.norms import rms_norm


def mtp_input(p, embed: torch.Tensor, streams: torch.Tensor, next_tokens: torch.Tensor,
              cfg) -> torch.Tensor:
    """streams [..., hc, D], next_tokens int[...] -> the block's input streams [..., hc, D]."""
    e = rms_norm(embed[next_tokens], p.enorm, cfg.rms_norm_eps)
    h = rms_norm(streams, p.hnorm, cfg.rms_norm_eps)
    return (e @ p.e_proj)[..., None, :] + h @ p.h_proj
