"""The MTP (next-n) block: drafts token t+2 from the main model's state at t and token t+1.

Pairing convention (the one DeepSeek-V3 trained MTP with and vLLM's proposer uses): at
position t the block reads the main model's final residual streams H_t (before the hc head)
and the embedding of the *next* token x_{t+1}; its logits are a draft for x_{t+2}. The block
keeps position t for its own (window-only, main-rope) attention. Drafting further reuses the
block recursively, feeding its output streams back as H.

    e = enorm(Emb(x_{t+1}));  Z_j = e W_e + hnorm(H_{t,j}) W_h  (every stream j)
    Z' = Block(Z);            logits = head(norm(hc_head_mtp(Z')))
"""

from __future__ import annotations

import jax

from deepinfer_jax.config.compute import ComputeConfig
from deepinfer_jax.config.model import AttentionKind, MlpKind, ModelConfig
from deepinfer_jax.model import reference_forward
from deepinfer_jax.model.invariant import linear
from deepinfer_jax.model.norms import rms_norm
from deepinfer_jax.model.params import ModelParams, MTPParams


def mtp_input(p: MTPParams, embed: jax.Array, streams: jax.Array, next_tokens: jax.Array,
              cfg: ModelConfig, compute: ComputeConfig) -> jax.Array:
    """streams [..., hc, D], next_tokens i32[...] -> the block's input streams [..., hc, D]."""
    e = rms_norm(embed[next_tokens], p.enorm, cfg.rms_norm_eps)
    h = rms_norm(streams, p.hnorm, cfg.rms_norm_eps)
    return linear(e, p.e_proj, compute)[..., None, :] + linear(h, p.h_proj, compute)


def mtp_logits(params: ModelParams, token_ids: jax.Array, cfg: ModelConfig,
               compute: ComputeConfig, depth: int = 0) -> jax.Array:
    """Full-sequence reference: token_ids i32[B, S] -> f32[B, S-1, V]; row t drafts x_{t+2}."""
    p = params.mtp[depth]
    streams = reference_forward.forward_streams(params, token_ids, cfg, compute)[:, :-1]
    next_tokens = token_ids[:, 1:]
    z = mtp_input(p, params.embed, streams, next_tokens, cfg, compute)
    positions = jax.numpy.arange(next_tokens.shape[1], dtype=jax.numpy.int32)
    z = reference_forward.layer(p.layer, z, positions, next_tokens, AttentionKind.SLIDING,
                                MlpKind.MOE, cfg, compute)
    return reference_forward.project_logits(z, p.hc_head, p.norm, params.head, cfg, compute)
