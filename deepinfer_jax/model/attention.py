"""DeepSeek-V4 attention: one shared K=V head, low-rank queries, sinks, grouped output.

Per token: q = rope(rmsnorm_unweighted(W_qb rmsnorm(W_qa x))) per head; kv = rope(rmsnorm(W_kv x)),
used as key and value by all heads. A query attends to raw window rows and, in CSA/HCA layers,
to compressed rows, in one softmax that also holds a per-head sink logit (zero value). Because
V = K carries rope, the output's rope slice is rotated back at the query position. The output
projection is grouped low-rank: each group of heads -> L dims, then all groups -> D.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from deepinfer_jax.config.model import ModelConfig
from deepinfer_jax.model.invariant import grouped_linear, linear, per_row_tiles
from deepinfer_jax.model.norms import rms_norm, unweighted_rms_norm
from deepinfer_jax.model.params import AttentionParams
from deepinfer_jax.model.rope import apply_rope
from pallas_kernels.sink_attention import api as attention_kernel


def project_queries(x: jax.Array, p: AttentionParams, cos: jax.Array, sin: jax.Array,
                    cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """x [..., D] -> (q [..., H, hd] roped, q_latent [..., R]: the indexer's query input)."""
    inv = cfg.batch_invariant
    q_latent = rms_norm(linear(x, p.wq_a, inv), p.q_norm, cfg.rms_norm_eps)
    q = linear(q_latent, p.wq_b, inv).reshape(*x.shape[:-1], cfg.num_heads, cfg.head_dim)
    q = unweighted_rms_norm(q, cfg.rms_norm_eps)
    return apply_rope(q, cos[..., None, :], sin[..., None, :]), q_latent


def project_kv(x: jax.Array, p: AttentionParams, cos: jax.Array, sin: jax.Array,
               cfg: ModelConfig) -> jax.Array:
    """x [..., D] -> the token's raw K=V row [..., hd], roped at its position."""
    kv = rms_norm(linear(x, p.wkv, cfg.batch_invariant), p.kv_norm, cfg.rms_norm_eps)
    return apply_rope(kv, cos, sin)


def sink_attention(q: jax.Array, keys: jax.Array, visible: jax.Array, sinks: jax.Array,
                   invariant: bool = False) -> jax.Array:
    """One softmax over visible keys plus a per-head sink logit with a zero value vector.

    q [B, S, H, hd], keys [B, T, hd] (also the values), visible bool[B, S, T],
    sinks f32[H] -> [B, S, H, hd].

    One query per row (the engine's step) runs on the Pallas kernel where it runs (a GPU, for
    prefill-sized batches: pallas_kernels/sink_attention/api.py): one program per token
    reading its rows in a fixed order.
    """
    if q.shape[1] == 1 and attention_kernel.kernel_runs(q[:, 0], keys, invariant=invariant):
        return attention_kernel.sink_attention(q[:, 0], keys, visible[:, 0], sinks)[:, None]
    if invariant:
        return per_row_tiles(lambda *a: sink_attention(*a, sinks), q, keys, visible)
    return _attend(q, (keys,), (visible,), sinks)


def sink_attention_parts(q: jax.Array, keys: tuple[jax.Array, ...],
                         visible: tuple[jax.Array, ...], sinks: jax.Array,
                         invariant: bool = False) -> jax.Array:
    """sink_attention over the concatenation of several key sets, without building it.

    q [B, H, hd] (one query per row), keys: [B, T_i, hd] each, visible: bool[B, T_i] each ->
    [B, H, hd]. The engine's step attends over each token's window rows and its compressed
    rows: concatenated, that is every token's 640 rows written once more (bf16[8192, 640,
    512], 5.4 GB, 2.5 ms of an 8k prefill step on the H200). The kernel path takes them
    concatenated."""
    if attention_kernel.kernel_runs(q, keys[0], invariant=invariant):
        return sink_attention(q[:, None], jnp.concatenate(keys, axis=1),
                              jnp.concatenate(visible, axis=1)[:, None], sinks, invariant)[:, 0]
    return _attend(q[:, None], keys, tuple(v[:, None] for v in visible), sinks)[:, 0]


def _attend(q: jax.Array, keys: tuple[jax.Array, ...], visible: tuple[jax.Array, ...],
            sinks: jax.Array) -> jax.Array:
    """The jnp softmax: q [B, S, H, hd], key sets [B, T_i, hd], visible bool[B, S, T_i]. Its
    max and its sum run over every set and the sink; the sets' weighted values are added in
    set order."""
    scale = q.shape[-1] ** -0.5
    logits = [jnp.where(v[:, :, None, :], jnp.einsum("bshd,btd->bsht", q, k,
                                                      preferred_element_type=jnp.float32) * scale,
                        -jnp.inf) for k, v in zip(keys, visible, strict=True)]
    peak = functools.reduce(jnp.maximum, [jnp.max(x, axis=-1) for x in logits], sinks)
    probs = [jnp.exp(x - peak[..., None]) for x in logits]                 # peak: [B, S, H]
    denom = functools.reduce(jnp.add, [jnp.sum(p, axis=-1) for p in probs],
                             jnp.exp(sinks - peak))
    out = functools.reduce(jnp.add, [
        jnp.einsum("bsht,btd->bshd", p.astype(k.dtype), k, preferred_element_type=jnp.float32)
        for p, k in zip(probs, keys, strict=True)])
    return (out / denom[..., None]).astype(q.dtype)


def output_projection(o: jax.Array, p: AttentionParams, cos: jax.Array, sin: jax.Array,
                      cfg: ModelConfig) -> jax.Array:
    """Attention output o [..., H, hd] -> [..., D]: de-rope at the query position, then the
    grouped low-rank projection (groups of consecutive heads)."""
    o = apply_rope(o, cos[..., None, :], sin[..., None, :], inverse=True)
    grouped = o.reshape(*o.shape[:-2], cfg.o_groups, -1)                 # [..., G, H*hd/G]
    inv = cfg.batch_invariant
    low_rank = grouped_linear(grouped, p.wo_a, inv)                      # [..., G, L]
    return linear(low_rank.reshape(*o.shape[:-2], -1), p.wo_b, inv)
