"""The engine's forward pass over a ragged batch with the paged state cache.

Same math as `forward.py`, but each token sees: its raw window (this step's rows of its
sequence plus the slot's ring), and the compressed rows in its sequence's pages (all of them
for HCA, the indexer's top-k for CSA). State in, state out.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from deepinfer_jax.config import AttentionKind, MlpKind, ModelConfig
from deepinfer_jax.engine_config import ResolvedEngineConfig
from deepinfer_jax.model import attention, indexer
from deepinfer_jax.model.mhc import hc_post, hc_pre
from deepinfer_jax.model.moe import moe
from deepinfer_jax.model.norms import rms_norm
from deepinfer_jax.model.paged_compressor import close_rows, visible_rows
from deepinfer_jax.model.params import AttentionParams, LayerParams, ModelParams
from deepinfer_jax.model.ragged import (
    TokenContext,
    row_index,
    token_context,
    window_keys,
    write_ring,
)
from deepinfer_jax.model.rope import cos_sin, layer_inv_freq
from deepinfer_jax.state import LayerState, StateCache

Array = jax.Array


def _selected_rows(x, q_latent, cos, sin, ls: LayerState, ctx: TokenContext, p: AttentionParams,
                   cfg: ModelConfig, ecfg: ResolvedEngineConfig) -> tuple[Array, Array]:
    """CSA: the indexer's top-k rows per token -> (rows [T, k, hd], visible bool[T, k])."""
    rate = cfg.compress_rate_csa
    keys, visible = visible_rows(ls.index_keys, ctx, rate=rate, page_size=ecfg.page_size,
                                 max_rows=ecfg.max_rows(rate))              # [T, R, Id]
    queries = indexer.index_queries(q_latent, p.indexer, cos, sin, cfg.index_n_heads)
    weights = indexer.head_weights(x, p.indexer, cfg.index_n_heads)
    scores = indexer.index_scores(queries[:, None], weights[:, None], keys)[:, 0]   # [T, R]
    k = min(cfg.index_topk, scores.shape[-1])
    _, top = jax.lax.top_k(jnp.where(visible, scores, -jnp.inf), k)          # [T, k]
    index = row_index(ctx.block_table, ctx.seq[:, None], top, rate, ecfg.page_size)
    return ls.rows[index], jnp.take_along_axis(visible, top, axis=-1)


def attention_step(x: Array, ctx: TokenContext, p: AttentionParams, kind: AttentionKind,
                   ls: LayerState, cfg: ModelConfig, ecfg: ResolvedEngineConfig
                   ) -> tuple[Array, LayerState]:
    """x [T, D] (normed) -> ([T, D], the layer's new state)."""
    freqs = layer_inv_freq(cfg, kind)
    cos, sin = cos_sin(ctx.positions, freqs)                                 # [T, r/2]
    q, q_latent = attention.project_queries(x, p, cos, sin, cfg)            # [T, H, hd]
    kv = attention.project_kv(x, p, cos, sin, cfg)                          # [T, hd]
    keys, visible = window_keys(kv, ls.window, ctx)                         # [T, W, hd]

    if kind is not AttentionKind.SLIDING:
        rate = cfg.compress_rate(kind)
        common = dict(rate=rate, freqs=freqs, eps=cfg.rms_norm_eps, page_size=ecfg.page_size,
                      max_new_rows=x.shape[0] // rate + ctx.block_table.shape[0])
        rows, tail = close_rows(x, p.compressor, ls.tail, ls.rows, ctx,
                                overlap=kind is AttentionKind.CSA, **common)
        ls = dataclasses.replace(ls, rows=rows, tail=tail)
        if kind is AttentionKind.CSA:
            index_keys, index_tail = close_rows(x, p.indexer.compressor, ls.index_tail,
                                                ls.index_keys, ctx, overlap=True, **common)
            ls = dataclasses.replace(ls, index_keys=index_keys, index_tail=index_tail)
            rows_seen, rows_visible = _selected_rows(x, q_latent, cos, sin, ls, ctx, p, cfg, ecfg)
        else:
            rows_seen, rows_visible = visible_rows(ls.rows, ctx, rate=rate,
                                                   page_size=ecfg.page_size,
                                                   max_rows=ecfg.max_rows(rate))
        keys = jnp.concatenate([keys, rows_seen], axis=1)
        visible = jnp.concatenate([visible, rows_visible], axis=1)

    out = attention.sink_attention(q[:, None], keys, visible[:, None], p.sinks)[:, 0]
    ls = dataclasses.replace(ls, window=write_ring(ls.window, kv, ctx))
    return attention.output_projection(out, p, cos, sin, cfg), ls


def layer_step(p: LayerParams, streams: Array, token_ids: Array, ctx: TokenContext,
               kind: AttentionKind, mlp_kind: MlpKind, ls: LayerState, cfg: ModelConfig,
               ecfg: ResolvedEngineConfig) -> tuple[Array, LayerState]:
    hc_args = dict(hc_eps=cfg.hc_eps, norm_eps=cfg.rms_norm_eps,
                   sinkhorn_iters=cfg.hc_sinkhorn_iters)
    collapsed, post, comb = hc_pre(streams, p.attn_hc, **hc_args)
    a, ls = attention_step(rms_norm(collapsed, p.attn_norm, cfg.rms_norm_eps), ctx, p.attn, kind,
                           ls, cfg, ecfg)
    streams = hc_post(a, streams, post, comb)
    collapsed, post, comb = hc_pre(streams, p.ffn_hc, **hc_args)
    f = moe(rms_norm(collapsed, p.ffn_norm, cfg.rms_norm_eps), token_ids, p.moe, mlp_kind, cfg)
    return hc_post(f, streams, post, comb), ls


def forward_step(params: ModelParams, state: StateCache, plan, token_ids: Array,
                 cfg: ModelConfig, ecfg: ResolvedEngineConfig) -> tuple[StateCache, Array]:
    """One ragged step over token_ids i32[T] -> (new state, final residual streams [T, hc, D])."""
    ctx = token_context(plan)
    x = params.embed[token_ids]
    streams = jnp.broadcast_to(x[:, None, :], (x.shape[0], cfg.hc_mult, x.shape[-1]))
    layer_states = []
    for i, (lp, ls) in enumerate(zip(params.layers, state.layers, strict=True)):
        streams, ls = layer_step(lp, streams, token_ids, ctx, cfg.layer_types[i],
                                 cfg.mlp_types[i], ls, cfg, ecfg)
        layer_states.append(ls)
    return dataclasses.replace(state, layers=tuple(layer_states)), streams
