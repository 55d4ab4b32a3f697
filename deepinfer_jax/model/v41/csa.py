"""CSA2 attention of V4.1, cache-free over a padded batch, in plain float32 jnp: the shared
compressor (KV sources), the two-level sparse indexer (candidate blocks, then top-k inside)
and the latent attention over the sliding window plus the selected compressed entries.

Shapes: B batch, S tokens, D hidden, H heads, hd head_dim, G compressed entries
(S // ratio), IH/Id indexer heads/dim, k index_topk. `live` bool[B, S] marks real tokens
(pads are skipped by the compressor, masked as keys); `positions` i32[B, S] count live
tokens (left padding shifts nothing). `quant` switches the QAT fake quantization (off only
to compare with the reference's diagnostic `logits_noquant`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from deepinfer_jax.config.v41 import V41Config
from deepinfer_jax.model.norms import rms_norm
from deepinfer_jax.model.rope import apply_rope
from deepinfer_jax.model.v41.fake_quant import fake_quant_fp4, fake_quant_fp8
from deepinfer_jax.model.v41.params import (
    V41AttentionParams,
    V41CompressorParams,
    V41IndexerParams,
)

Rope = tuple[jax.Array, jax.Array]     # (cos, sin) f32[B, S or G, rope_dim // 2]


def live_counts(live: jax.Array) -> jax.Array:
    """i32[B, S]: live tokens up to and including each one."""
    return jnp.cumsum(live.astype(jnp.int32), axis=-1)


def compress(x: jax.Array, live: jax.Array, positions: jax.Array, p: V41CompressorParams,
             ratio: int, cfg: V41Config) -> tuple[jax.Array, jax.Array]:
    """x [B, S, D] (the normed attention input) -> (latents f32[B, G, hd] before RoPE, zero
    past each row's complete groups; their first tokens' positions i32[B, G]). A group is
    `ratio` consecutive live tokens (pads skipped), pooled by a per-channel softmax gate."""
    b, s = live.shape
    n_groups = s // ratio
    kv = x @ p.wkv
    # Live tokens compacted to the front of each row (pads sent to a discarded slot s).
    dest = jnp.where(live, live_counts(live) - 1, s)
    rows = jnp.arange(b)[:, None]
    order = jnp.zeros((b, s + 1), jnp.int32).at[rows, dest].set(jnp.arange(s, dtype=jnp.int32))
    members = order[:, : n_groups * ratio]                                   # [B, G*ratio]
    group_positions = positions[rows, members[:, ::ratio]]
    grouped = kv[rows, members].reshape(b, n_groups, ratio, -1)
    if p.wgate is None:
        latent = grouped[:, :, 0]
    else:
        gate = (x @ p.wgate)[rows, members].reshape(b, n_groups, ratio, -1)
        latent = jnp.sum(grouped * jax.nn.softmax(gate, axis=2), axis=2)
    complete = jnp.arange(n_groups)[None, :] < (jnp.sum(live, -1) // ratio)[:, None]
    latent = jnp.where(complete[..., None], latent, 0.0)
    return rms_norm(latent, p.norm, cfg.rms_norm_eps), group_positions


def compressed_entries(latent: jax.Array, rope: Rope, quant: bool) -> jax.Array:
    """The cache entries every layer of the group attends: rotated, then FP4 (e4m3 scales)."""
    rotated = apply_rope(latent, *rope)
    return fake_quant_fp4(rotated, 16, e4m3_scales=True) if quant else rotated


def index_keys(latent: jax.Array, rope: Rope, p: V41IndexerParams, cfg: V41Config,
               quant: bool) -> jax.Array:
    """f32[B, G, Id]: the group's indexer keys, from the pre-RoPE latents."""
    k = apply_rope(rms_norm(latent @ p.wk, p.k_norm, cfg.rms_norm_eps), *rope)
    return fake_quant_fp4(k, 32) if quant else k


def index_queries(x: jax.Array, q_residual: jax.Array, rope: Rope, p: V41IndexerParams,
                  cfg: V41Config, quant: bool) -> tuple[jax.Array, jax.Array]:
    """Per token (any leading axes): (roped queries f32[..., IH, Id], head weights f32[..., IH])."""
    ih, idim = cfg.index_n_heads, cfg.index_head_dim
    q = apply_rope((q_residual @ p.wq_b).reshape(*x.shape[:-1], ih, idim), rope[0][..., None, :],
                   rope[1][..., None, :])
    q = fake_quant_fp4(q, 32) if quant else q
    return q, (x @ p.weights_proj) * ih ** -0.5


def head_sum(dots: jax.Array, weights: jax.Array, cfg: V41Config) -> jax.Array:
    """dots f32[..., IH, G] (q_h . k), weights f32[..., IH] -> sum_h w_h * relu(dot) * Id^-0.5."""
    per_head = jax.nn.relu(dots) * cfg.index_head_dim ** -0.5
    return jnp.sum(per_head * weights[..., None], axis=-2)


def index_scores(x: jax.Array, q_residual: jax.Array, keys: jax.Array, visible: jax.Array,
                 rope: Rope, p: V41IndexerParams, cfg: V41Config, quant: bool) -> jax.Array:
    """f32[B, S, G]: sum_h w_h * relu(q_h . k) * Id^-0.5, -inf past each query's visible count
    (visible i32[B, S])."""
    q, weights = index_queries(x, q_residual, rope, p, cfg, quant)
    scores = head_sum(jnp.einsum("bshd,btd->bsht", q, keys), weights, cfg)
    entry = jnp.arange(keys.shape[1])
    return jnp.where(entry[None, None, :] < visible[..., None], scores, -jnp.inf)


def candidate_blocks(scores: jax.Array, visible: jax.Array, cfg: V41Config) -> jax.Array:
    """Level one: bool[..., G] (scores f32[..., G], visible i32[...]), the best
    `candidate_topk_blocks` blocks of `candidate_block_size` entries per query (block score:
    its best entry); the block holding the newest visible entry is always kept, unreachable
    blocks never."""
    g, size = scores.shape[-1], cfg.candidate_block_size
    pad = ((0, 0),) * (scores.ndim - 1) + ((0, -g % size),)
    padded = jnp.pad(scores, pad, constant_values=-jnp.inf)
    blocks = padded.reshape(*scores.shape[:-1], -1, size).max(-1)           # [..., nb]
    newest = (visible - 1) // size
    blocks = jnp.where(jnp.arange(blocks.shape[-1]) == newest[..., None], jnp.inf, blocks)
    values, picked = jax.lax.top_k(blocks, min(cfg.candidate_topk_blocks, blocks.shape[-1]))
    chosen = jax.nn.one_hot(picked, blocks.shape[-1], dtype=bool) & (values > -jnp.inf)[..., None]
    keep = jnp.any(chosen, axis=-2)                                          # [..., nb]
    return jnp.repeat(keep, size, axis=-1)[..., :g]


def top_k_entries(scores: jax.Array, k: int) -> jax.Array:
    """Level two: i32[B, S, min(k, G)] best entries per query, -1 where fewer are reachable."""
    values, picked = jax.lax.top_k(scores, min(k, scores.shape[-1]))
    return jnp.where(values > -jnp.inf, picked, -1)


def attention_queries(q_residual: jax.Array, rope: Rope, p: V41AttentionParams,
                      cfg: V41Config) -> jax.Array:
    """Per token (any leading axes): roped queries [..., H, hd]."""
    q = (q_residual @ p.wq_b).reshape(*q_residual.shape[:-1], cfg.num_heads, cfg.head_dim)
    return apply_rope(q, rope[0][..., None, :], rope[1][..., None, :])


def window_latents(x: jax.Array, rope: Rope, p: V41AttentionParams, cfg: V41Config) -> jax.Array:
    """Per token: the roped K=V latent [..., hd] (before the FP8 fake quantization)."""
    return apply_rope(rms_norm(x @ p.wkv, p.kv_norm, cfg.rms_norm_eps), *rope)


def output_projection(out: jax.Array, rope: Rope, p: V41AttentionParams,
                      cfg: V41Config) -> jax.Array:
    """Per token: attention output [..., H, hd] -> un-roped, grouped low-rank projection [..., D]."""
    out = apply_rope(out, rope[0][..., None, :], rope[1][..., None, :], inverse=True)
    grouped = out.reshape(*out.shape[:-2], cfg.o_groups, -1)
    low = jnp.einsum("...gi,gil->...gl", grouped, p.wo_a).reshape(*out.shape[:-2], -1)
    return low @ p.wo_b


def attention(x: jax.Array, q_residual: jax.Array, live: jax.Array, rope: Rope,
              p: V41AttentionParams, entries: jax.Array | None, selected: jax.Array | None,
              cfg: V41Config, quant: bool) -> jax.Array:
    """Latent attention (K = V = one rotated latent per token) over the causal sliding window
    plus, when given, each query's selected compressed entries (selected i32[B, S, k] into
    entries f32[B, G, hd], -1 = none), with one sink logit per head in the denominator.
    -> [B, S, D]."""
    b, s, _ = x.shape
    h, hd = cfg.num_heads, cfg.head_dim
    q = attention_queries(q_residual, rope, p, cfg)
    kv = window_latents(x, rope, p, cfg)
    kv = fake_quant_fp8(kv) if quant else kv
    scale = hd ** -0.5
    logits = jnp.einsum("bshd,btd->bhst", q, kv) * scale
    qi, ki = jnp.arange(s)[:, None], jnp.arange(s)[None, :]
    window = (ki <= qi) & (ki > qi - cfg.sliding_window)
    logits = jnp.where(window[None, None] & live[:, None, None, :], logits, -jnp.inf)
    parts = [logits]
    if selected is not None:
        picked = entries[jnp.arange(b)[:, None, None], jnp.maximum(selected, 0)]  # [B, S, k, hd]
        sel = jnp.einsum("bshd,bskd->bhsk", q, picked) * scale
        parts.append(jnp.where((selected >= 0)[:, None], sel, -jnp.inf))
    parts.append(jnp.broadcast_to(p.sinks[None, :, None, None], (b, h, s, 1)))
    probs = jax.nn.softmax(jnp.concatenate(parts, -1), axis=-1)
    out = jnp.einsum("bhst,btd->bshd", probs[..., :s], kv)
    if selected is not None:
        out = out + jnp.einsum("bhsk,bskd->bshd", probs[..., s:-1], picked)
    return output_projection(out, rope, p, cfg)
