"""The full-sequence forward pass without a cache: the reference the engine is tested against.

Sequences start at position 0 and all rows of the batch share positions. Causality is exact,
so right-padding a sequence never changes the outputs at its real positions.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from deepinfer_jax.config.compute import ComputeConfig
from deepinfer_jax.config.model import AttentionKind, MlpKind, ModelConfig
from deepinfer_jax.model import attention, indexer
from deepinfer_jax.model.compressor import compress_sequence
from deepinfer_jax.model.invariant import linear, whole_batch
from deepinfer_jax.model.mhc import hc_head, hc_post, hc_pre
from deepinfer_jax.model.moe import moe
from deepinfer_jax.model.norms import rms_norm
from deepinfer_jax.model.params import AttentionParams, HyperHeadParams, LayerParams, ModelParams
from deepinfer_jax.model.precision import follows_weights
from deepinfer_jax.model.rope import cos_sin, layer_inv_freq


def _window_visible(positions: jax.Array, window: int) -> jax.Array:
    """bool[S, S]: query i sees raw row j iff i - window < j <= i."""
    q, k = positions[:, None], positions[None, :]
    return (k <= q) & (k > q - window)


def attention_block(x: jax.Array, positions: jax.Array, p: AttentionParams, kind: AttentionKind,
                    cfg: ModelConfig, compute: ComputeConfig) -> jax.Array:
    """x [B, S, D] (normed) -> [B, S, D]."""
    batch, seq, _ = x.shape
    freqs = layer_inv_freq(cfg, kind)
    cos, sin = cos_sin(positions, freqs)                                  # [S, r/2]
    q, q_latent = attention.project_queries(x, p, cos, sin, cfg, compute)   # [B, S, H, hd]
    keys = attention.project_kv(x, p, cos, sin, cfg, compute)               # [B, S, hd]
    visible = jnp.broadcast_to(_window_visible(positions, cfg.sliding_window), (batch, seq, seq))

    if kind is not AttentionKind.SLIDING:
        rate = cfg.compress_rate(kind)
        rows = compress_sequence(x, p.compressor, rate=rate, overlap=kind is AttentionKind.CSA,
                                 freqs=freqs, eps=cfg.rms_norm_eps,
                                 compute=compute)                        # [B, S//rate, hd]
        row_visible = jnp.arange(rows.shape[1]) < ((positions + 1) // rate)[:, None]   # [S, T]
        row_visible = jnp.broadcast_to(row_visible, (batch, *row_visible.shape))
        if kind is AttentionKind.CSA:
            row_visible = _indexer_selection(x, q_latent, cos, sin, row_visible, p, cfg,
                                             compute, freqs)
        keys = jnp.concatenate([keys, rows], axis=1)
        visible = jnp.concatenate([visible, row_visible], axis=-1)

    out = attention.sink_attention(q, keys, visible, p.sinks, compute)
    return attention.output_projection(out, p, cos, sin, cfg, compute)


def _indexer_selection(x, q_latent, cos, sin, row_visible, p: AttentionParams, cfg, compute,
                       freqs):
    """bool[B, S, T]: the compressed rows each query attends to (top-k of the indexer)."""
    keys = compress_sequence(x, p.indexer.compressor, rate=cfg.compress_rate_csa, overlap=True,
                             freqs=freqs, eps=cfg.rms_norm_eps, compute=compute)  # [B, T, Id]
    queries = indexer.index_queries(q_latent, p.indexer, cos, sin, cfg.index_n_heads, compute)
    weights = indexer.head_weights(x, p.indexer, cfg.index_n_heads, compute)
    scores = indexer.index_scores(queries, weights, keys)
    return indexer.select_top_k(scores, row_visible, cfg.index_topk)


def layer(p: LayerParams, streams: jax.Array, positions: jax.Array, token_ids: jax.Array,
          kind: AttentionKind, mlp_kind: MlpKind, cfg: ModelConfig, compute: ComputeConfig
          ) -> jax.Array:
    """One block on the hc residual streams [B, S, hc, D]."""
    hc_args = dict(hc_eps=cfg.hc_eps, norm_eps=cfg.rms_norm_eps,
                   sinkhorn_iters=cfg.hc_sinkhorn_iters, compute=compute)
    collapsed, post, comb = hc_pre(streams, p.attn_hc, **hc_args)
    a = attention_block(rms_norm(collapsed, p.attn_norm, cfg.rms_norm_eps), positions, p.attn,
                        kind, cfg, compute)
    streams = hc_post(a, streams, post, comb, compute)
    collapsed, post, comb = hc_pre(streams, p.ffn_hc, **hc_args)
    f, _ = moe(rms_norm(collapsed, p.ffn_norm, cfg.rms_norm_eps), token_ids, p.moe, mlp_kind,
               cfg, compute)
    return hc_post(f, streams, post, comb, compute)


@follows_weights
def forward_streams(params: ModelParams, token_ids: jax.Array, cfg: ModelConfig,
                    compute: ComputeConfig) -> jax.Array:
    """token_ids i32[B, S] -> final residual streams [B, S, hc, D] (before the hc head)."""
    x = params.embed[token_ids]
    streams = jnp.broadcast_to(x[:, :, None, :], (*x.shape[:2], cfg.hc_mult, x.shape[-1]))
    positions = jnp.arange(token_ids.shape[1], dtype=jnp.int32)
    for i, layer_params in enumerate(params.layers):
        streams = layer(layer_params, streams, positions, token_ids, cfg.layer_types[i],
                        cfg.mlp_types[i], cfg, compute)
    return streams


def project_logits(streams: jax.Array, head_params: HyperHeadParams, norm: jax.Array,
                   head: jax.Array, cfg: ModelConfig, compute: ComputeConfig,
                   rows: Callable = whole_batch) -> jax.Array:
    """Residual streams [..., hc, D] -> f32 logits [..., V] (hc head, final norm, lm head).

    rows(fn, *args): how the hc head and the norm run over the rows. The engine's steps pass
    `invariant.per_sequence`: they project their sequences' rows, whose count follows the
    engine's size, and in batch-invariant mode XLA's GPU row reductions may round a row by the
    rows beside it (an 8-slot and a 32-slot engine's logprobs differed on an H100). The LM
    head is invariant itself."""
    lead = streams.shape[:-2]

    def head_input(s):                                                    # [t, hc, D] -> [t, D]
        y = hc_head(s, head_params, hc_eps=cfg.hc_eps, norm_eps=cfg.rms_norm_eps,
                    compute=compute)
        return rms_norm(y, norm, cfg.rms_norm_eps, ordered=compute.batch_invariant)

    y = rows(head_input, streams.reshape(-1, *streams.shape[-2:]))
    y = y.reshape(*lead, y.shape[-1])
    # The reference's head runs in float32. bf16 operands with a float32 result are that
    # (exact products, float32 sums) without a float32 copy of the 129280 x 4096 head each
    # step unless the compiler fuses the convert into its GEMM (faster on the CPU; no
    # difference on the H200, where XLA likely fuses it: docs/performance-log.md).
    return linear(y, head, compute, out_dtype=jnp.float32)


@follows_weights
def logits(params: ModelParams, token_ids: jax.Array, cfg: ModelConfig,
           compute: ComputeConfig) -> jax.Array:
    """token_ids i32[B, S] -> f32[B, S, V]."""
    streams = forward_streams(params, token_ids, cfg, compute)
    return project_logits(streams, params.hc_head, params.norm, params.head, cfg, compute)
