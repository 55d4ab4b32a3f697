"""DeepSeek-V4 attention: one shared K=V head, low-rank queries, sinks, grouped output.

Per token: q = rope(rmsnorm_unweighted(W_qb rmsnorm(W_qa x))) per head; kv = rope(rmsnorm(W_kv x)),
used as key and value by all heads. A query attends to raw window rows and, in CSA/HCA layers,
to compressed rows, in one softmax that also holds a per-head sink logit (zero value). Because
V = K carries rope, the output's rope slice is rotated back at the query position. The output
projection is grouped low-rank: each group of heads -> L dims, then all groups -> D.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from deepinfer_jax.config.compute import ComputeConfig
from deepinfer_jax.config.model import ModelConfig
from deepinfer_jax.model.invariant import grouped_linear, linear, per_row_tiles
from deepinfer_jax.model.norms import rms_norm, unweighted_rms_norm
from deepinfer_jax.model.params import AttentionParams
from deepinfer_jax.model.rope import apply_rope
from pallas_kernels.sink_attention import api as attention_op


def project_queries(x: jax.Array, p: AttentionParams, cos: jax.Array, sin: jax.Array,
                    cfg: ModelConfig, compute: ComputeConfig) -> tuple[jax.Array, jax.Array]:
    """x [..., D] -> (q [..., H, hd] roped, q_latent [..., R]: the indexer's query input)."""
    q_latent = rms_norm(linear(x, p.wq_a, compute), p.q_norm, cfg.rms_norm_eps)
    q = linear(q_latent, p.wq_b, compute).reshape(*x.shape[:-1], cfg.num_heads, cfg.head_dim)
    q = unweighted_rms_norm(q, cfg.rms_norm_eps)
    return apply_rope(q, cos[..., None, :], sin[..., None, :]), q_latent


def project_kv(x: jax.Array, p: AttentionParams, cos: jax.Array, sin: jax.Array,
               cfg: ModelConfig, compute: ComputeConfig) -> jax.Array:
    """x [..., D] -> the token's raw K=V row [..., hd], roped at its position."""
    kv = rms_norm(linear(x, p.wkv, compute), p.kv_norm, cfg.rms_norm_eps)
    return apply_rope(kv, cos, sin)


def sink_attention(q: jax.Array, keys: jax.Array, visible: jax.Array, sinks: jax.Array,
                   compute: ComputeConfig) -> jax.Array:
    """One softmax over visible keys plus a per-head sink logit with a zero value vector.

    q [B, S, H, hd], keys [B, T, hd] (also the values), visible bool[B, S, T],
    sinks f32[H] -> [B, S, H, hd]. The full-sequence (reference) forward's form: every query
    of a row sees the row's keys."""
    if compute.batch_invariant:
        return per_row_tiles(lambda *a: _attend(*a, sinks), q, keys, visible,
                             tile=compute.invariant_tile)
    return _attend(q, keys, visible, sinks)


def sink_attention_parts(q: jax.Array, keys: tuple[jax.Array, ...],
                         visible: tuple[jax.Array, ...], sinks: jax.Array,
                         compute: ComputeConfig) -> jax.Array:
    """The engine step's attention: one query per token over several row sets at once.

    q [T, H, hd], keys: [T, R_i, hd] each, visible: bool[T, R_i] each -> [T, H, hd]. The
    step attends over each token's window rows and its compressed rows; the op's jnp path
    takes them as separate sets (concatenated, every token's 640 rows would be written once
    more), its kernel concatenated. In batch-invariant mode the jnp path runs in row tiles."""
    return attention_op.sink_attention(
        q, keys, visible, sinks, implementation=compute.kernels.sink_attention,
        min_tokens=compute.kernels.attention_min_tokens,
        row_tile=compute.invariant_tile if compute.batch_invariant else None)


def _attend(q: jax.Array, keys: jax.Array, visible: jax.Array, sinks: jax.Array) -> jax.Array:
    """The jnp softmax: q [B, S, H, hd], keys [B, T, hd], visible bool[B, S, T]."""
    scale = q.shape[-1] ** -0.5
    logits = jnp.where(visible[:, :, None, :],
                       jnp.einsum("bshd,btd->bsht", q, keys,
                                  preferred_element_type=jnp.float32) * scale, -jnp.inf)
    peak = jnp.maximum(jnp.max(logits, axis=-1), sinks)                    # [B, S, H]
    probs = jnp.exp(logits - peak[..., None])
    denom = jnp.sum(probs, axis=-1) + jnp.exp(sinks - peak)
    out = jnp.einsum("bsht,btd->bshd", probs.astype(keys.dtype), keys,
                     preferred_element_type=jnp.float32)
    return (out / denom[..., None]).astype(q.dtype)


def output_projection(o: jax.Array, p: AttentionParams, cos: jax.Array, sin: jax.Array,
                      cfg: ModelConfig, compute: ComputeConfig) -> jax.Array:
    """Attention output o [..., H, hd] -> [..., D]: de-rope at the query position, then the
    grouped low-rank projection (groups of consecutive heads)."""
    o = apply_rope(o, cos[..., None, :], sin[..., None, :], inverse=True)
    grouped = o.reshape(*o.shape[:-2], cfg.o_groups, -1)                 # [..., G, H*hd/G]
    low_rank = grouped_linear(grouped, p.wo_a, compute)                  # [..., G, L]
    return linear(low_rank.reshape(*o.shape[:-2], -1), p.wo_b, compute)
