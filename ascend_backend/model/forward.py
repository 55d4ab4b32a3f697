"""The step's forward pass over a ragged batch with the paged state cache, in torch
(deepinfer_jax/model/paged_forward.py): each token sees its raw window (this step's rows of
its sequence and the slot's ring) and the compressed rows in its sequence's pages (all of
them in HCA layers, the indexer's top-k in CSA layers). The state is updated in place.

A layer: per-token work before attention (hc_pre, projections), the cross-token part (window
gathers, closing compressed rows, indexer selection), attention with the output projection
and hc_post, then the MoE sublayer."""

from __future__ import annotations

import torch

from ascend_backend.model import attention, compressor, indexer
from ascend_backend.model.mhc import hc_head, hc_post, hc_pre
from ascend_backend.model.moe import moe
from ascend_backend.model.norms import rms_norm
from ascend_backend.model.paged_compressor import (
    close_rows,
    row_visibility,
    sequence_rows,
    visible_rows,
)
from ascend_backend.model.ragged import TokenContext, gather, row_index, window_keys, write_ring
from ascend_backend.model.rope import cos_sin, layer_inv_freq
from ascend_backend.model.state import LayerState, StateCache
from deepinfer_jax.config.model import AttentionKind, MlpKind, ModelConfig
from deepinfer_jax.config.step import StepConfig


def _hc_pre(streams, p, cfg):
    return hc_pre(streams, p, hc_eps=cfg.hc_eps, norm_eps=cfg.rms_norm_eps,
                  sinkhorn_iters=cfg.hc_sinkhorn_iters)


def compressed_rows(p, kind: AttentionKind, x, q_latent, cos, sin, ls: LayerState,
                    ctx: TokenContext, cfg: ModelConfig, step_cfg: StepConfig
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """CSA/HCA: close this step's rows (in place), then the rows each token sees ->
    (rows [T, R, hd], visible bool[T, R])."""
    rate = cfg.compress_rate(kind)
    common = dict(rate=rate, freqs=layer_inv_freq(cfg, kind), eps=cfg.rms_norm_eps,
                  page_size=step_cfg.page_size)
    kv_c, score_c = compressor.project(x, p.attn.compressor)
    close_rows(kv_c, score_c + p.attn.compressor.ape[ctx.positions % rate], p.attn.compressor,
               ls.tail, ls.rows, ctx, overlap=kind is AttentionKind.CSA, **common)
    max_rows = step_cfg.max_rows(rate)
    if kind is AttentionKind.HCA:
        return visible_rows(ls.rows, ctx, rate=rate, page_size=step_cfg.page_size,
                            max_rows=max_rows)
    ip = p.attn.indexer
    kv_i, score_i = compressor.project(x, ip.compressor)
    close_rows(kv_i, score_i + ip.compressor.ape[ctx.positions % rate], ip.compressor,
               ls.index_tail, ls.index_keys, ctx, overlap=True, **common)
    q = indexer.index_queries(q_latent, ip, cos, sin, cfg.index_n_heads)
    w = indexer.head_weights(x, ip, cfg.index_n_heads)
    keys = sequence_rows(ls.index_keys, ctx.block_table, rate=rate,
                         page_size=step_cfg.page_size, max_rows=max_rows)       # [N, R, Id]
    scores = indexer.indexer_scores(q, keys, w, torch.where(ctx.valid, ctx.seq, -1))
    visible = row_visibility(ctx, rate=rate, max_rows=max_rows)
    top = indexer.top_k_indices(scores.masked_fill(~visible, float("-inf")),
                                min(cfg.index_topk, max_rows))
    index = row_index(ctx.block_table, ctx.seq[:, None], top, rate, step_cfg.page_size)
    return gather(ls.rows, index), torch.gather(visible, 1, top)


def layer_step(p, streams: torch.Tensor, token_ids: torch.Tensor, ctx: TokenContext,
               kind: AttentionKind, mlp_kind: MlpKind, ls: LayerState, cfg: ModelConfig,
               step_cfg: StepConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """One block on the residual streams [T, hc, D] -> (streams, routed experts int[T, K]);
    the layer's state is updated in place."""
    cos, sin = cos_sin(ctx.positions, layer_inv_freq(cfg, kind))
    collapsed, post, comb = _hc_pre(streams, p.attn_hc, cfg)
    x = rms_norm(collapsed, p.attn_norm, cfg.rms_norm_eps)
    q, q_latent = attention.project_queries(x, p.attn, cos, sin, cfg)
    kv = attention.project_kv(x, p.attn, cos, sin, cfg)
    keys, visible = window_keys(kv, ls.window, ctx, cfg.sliding_window)       # [T, W, hd]
    write_ring(ls.window, kv, ctx)
    keys, visible = (keys,), (visible,)
    if kind is not AttentionKind.SLIDING:
        rows, rows_visible = compressed_rows(p, kind, x, q_latent, cos, sin, ls, ctx, cfg,
                                             step_cfg)
        keys, visible = keys + (rows,), visible + (rows_visible,)
    out = attention.sink_attention_parts(q, keys, visible, p.attn.sinks)
    streams = hc_post(attention.output_projection(out, p.attn, cos, sin, cfg), streams, post,
                      comb)
    collapsed, post, comb = _hc_pre(streams, p.ffn_hc, cfg)
    f, experts = moe(rms_norm(collapsed, p.ffn_norm, cfg.rms_norm_eps), token_ids, p.moe,
                     mlp_kind, cfg, ctx.valid)
    return hc_post(f, streams, post, comb), experts


def forward_step(params, state: StateCache, ctx: TokenContext, token_ids: torch.Tensor,
                 cfg: ModelConfig, step_cfg: StepConfig) -> torch.Tensor:
    """One ragged step over token_ids int[T] -> the final residual streams [T, hc, D]; the
    state's layers are updated in place."""
    x = params.embed[token_ids]
    streams = x[:, None, :].expand(x.shape[0], cfg.hc_mult, x.shape[-1]).contiguous()
    for i, (lp, ls) in enumerate(zip(params.layers, state.layers, strict=True)):
        streams, _ = layer_step(lp, streams, token_ids, ctx, cfg.layer_types[i],
                                cfg.mlp_types[i], ls, cfg, step_cfg)
    return streams


def project_logits(streams: torch.Tensor, head_params, norm: torch.Tensor, head: torch.Tensor,
                   cfg: ModelConfig) -> torch.Tensor:
    """Residual streams [..., hc, D] -> f32 logits [..., V] (hc head, final norm, lm head);
    the model's own head params, or the MTP block's hc head and norm."""
    y = hc_head(streams, head_params, hc_eps=cfg.hc_eps, norm_eps=cfg.rms_norm_eps)
    return rms_norm(y, norm, cfg.rms_norm_eps).float() @ head.float()
