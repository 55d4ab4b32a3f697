"""The cache-free reference forward of DeepSeek-V4.1 over a padded batch (plain float32 jnp):
embedding into hc streams, per layer the Engram (where it has one), attention and MoE through
single-pass mHC, then the collapse with the last `pre`, the norm and the head.

The CSA2 group state a KV source publishes (its compressed entries, indexer keys and each
query's visible-entry count) and the latest index source's selection are carried through the
layer loop as `_Group`, the cache-free form of the reference's per-forward `shared` dict.
The Engram row ids come from the host (model/v41/engram_hash.py) with the tokens. Weights
kept in the release's FP8 / FP4 formats are dequantized to float32 as each layer is reached.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from deepinfer_jax.config.v41 import V41Config
from deepinfer_jax.model.norms import rms_norm
from deepinfer_jax.model.precision import follows_weights
from deepinfer_jax.model.rope import cos_sin, inv_freq
from deepinfer_jax.model.v41 import blocks, csa
from deepinfer_jax.model.v41.params import V41LayerParams, V41ModelParams
from pallas_kernels.quantized import dequantize_tree


@struct.dataclass
class V41Selections:
    """What the indexers chose in one forward (for parity checks against the reference)."""

    top_k: tuple[jax.Array | None, ...]   # per layer: i32[B, S, k] at index sources, else None
    candidates: jax.Array | None          # bool[B, S, G] of the candidate source


@dataclasses.dataclass
class _Group:
    entries: jax.Array | None = None      # f32[B, G, hd]  rotated (and quantized) latents
    keys: jax.Array | None = None         # f32[B, G, Id]  indexer keys
    visible: jax.Array | None = None      # i32[B, S]      entries each query may see
    selected: jax.Array | None = None     # i32[B, S, k]   the latest index source's choice
    candidates: jax.Array | None = None   # bool[B, S, G]


def positions_of(live: jax.Array) -> jax.Array:
    """i32[B, S]: live tokens before each one (0 on pads), so left padding shifts nothing."""
    return jnp.where(live, csa.live_counts(live) - 1, 0)


@follows_weights
def forward(params: V41ModelParams, cfg: V41Config, tokens: jax.Array, live: jax.Array,
            engram_ids: jax.Array | None, quant: bool = True
            ) -> tuple[jax.Array, V41Selections]:
    """tokens i32[B, S], live bool[B, S], engram_ids i32[B, S, L_e, C] (None without Engram)
    -> (logits f32[B, S, V], the indexers' selections)."""
    positions = positions_of(live)
    freqs = {False: inv_freq(cfg.rope_head_dim, cfg.rope_theta, None),
             True: inv_freq(cfg.rope_head_dim, cfg.compress_rope_theta, cfg.compress_yarn)}
    token_rope = {k: cos_sin(positions, f) for k, f in freqs.items()}
    x = params.embed[tokens].astype(jnp.float32)
    streams = jnp.broadcast_to(x[:, :, None], (*x.shape[:2], cfg.hc_mult, x.shape[-1]))
    pre = jnp.zeros((*x.shape[:2], cfg.hc_mult), jnp.float32).at[..., 0].set(1.0)
    group, top_k = _Group(), []
    for i, layer in enumerate(params.layers):
        layer = dequantize_tree(layer, jnp.float32)     # FP8 / FP4 weights, a layer at a time
        if cfg.has_engram(i):
            k = cfg.engram.layer_ids.index(i)
            rows = params.engram_tables[k][engram_ids[:, :, k]].astype(jnp.float32)
            streams = blocks.engram(streams, rows, live, layer.engram, cfg)
        streams, pre, group = _layer(streams, pre, group, layer, i, live, positions, token_rope,
                                     freqs[True], cfg, quant)
        top_k.append(group.selected if cfg.is_index_source(i) else None)
    out = rms_norm(blocks.hc_collapse(streams, pre), params.norm, cfg.rms_norm_eps)
    return out @ params.head, V41Selections(top_k=tuple(top_k), candidates=group.candidates)


def _layer(streams, pre, group: _Group, p: V41LayerParams, i: int, live, positions, token_rope,
           compress_freqs: np.ndarray, cfg: V41Config, quant: bool):
    a_pre, a_post, a_comb = blocks.hc_site(streams, p.attn_hc, cfg)
    x = rms_norm(blocks.hc_collapse(streams, pre), p.attn_norm, cfg.rms_norm_eps)
    ratio = cfg.compress_ratios[i]
    attn = p.attn
    q_residual = rms_norm(x @ attn.wq_a, attn.q_norm, cfg.rms_norm_eps)
    if cfg.is_kv_source(i):
        latent, group_positions = csa.compress(x, live, positions, attn.compressor, ratio, cfg)
        group_rope = cos_sin(group_positions, compress_freqs)
        group = _Group(entries=csa.compressed_entries(latent, group_rope, quant),
                       keys=(csa.index_keys(latent, group_rope, attn.indexer, cfg, quant)
                             if cfg.is_index_source(i) else None),
                       visible=jnp.where(live, csa.live_counts(live) // ratio, 0),
                       candidates=group.candidates)
    if cfg.is_index_source(i):
        scores = csa.index_scores(x, q_residual, group.keys, group.visible, token_rope[True],
                                  attn.indexer, cfg, quant)
        candidates = group.candidates
        if i == cfg.candidate_source_layer_id:
            candidates = csa.candidate_blocks(scores, group.visible, cfg)
        elif cfg.uses_candidates(i):
            scores = jnp.where(candidates, scores, -jnp.inf)
        group = dataclasses.replace(group, selected=csa.top_k_entries(scores, cfg.index_topk),
                                    candidates=candidates)
    selected = group.selected if ratio > 0 else None
    y = csa.attention(x, q_residual, live, token_rope[ratio > 0], attn,
                      group.entries if ratio > 0 else None, selected, cfg, quant)
    streams = blocks.hc_expand(y, streams, a_post, a_comb)
    f_pre, f_post, f_comb = blocks.hc_site(streams, p.ffn_hc, cfg)
    x = rms_norm(blocks.hc_collapse(streams, a_pre), p.ffn_norm, cfg.rms_norm_eps)
    streams = blocks.hc_expand(blocks.moe(x, p.moe, cfg), streams, f_post, f_comb)
    return streams, f_pre, group
