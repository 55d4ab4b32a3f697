"""The engine's forward pass over a ragged batch with the paged state cache.

Same math as `reference_forward.py`, but each token sees: its raw window (this step's rows of
its sequence plus the slot's ring), and the compressed rows in its sequence's pages (all of
them for HCA, the indexer's top-k for CSA). State in, state out.

A layer is four segments: per-token work before attention (hc_pre, projections), the
cross-token part (window gathers, closing compressed rows, indexer selection), per-token
attention (attention, output projection, hc_post), and the MoE sublayer. In batch-invariant
mode every matmul-like op is invariant by itself (model/invariant.py) and, where XLA's
elementwise code is not (the CPU formulation), each per-token segment runs over fixed-size
tiles of rows (`invariant.segments`), so every row is computed by the same program whatever
else is in the batch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import struct

from deepinfer_jax.config.compute import ComputeConfig
from deepinfer_jax.config.model import AttentionKind, MlpKind, ModelConfig
from deepinfer_jax.config.step import StepConfig
from deepinfer_jax.model import attention, compressor, indexer
from deepinfer_jax.model.invariant import per_closed_row, segments
from deepinfer_jax.model.mhc import hc_post, hc_pre
from deepinfer_jax.model.moe import moe
from deepinfer_jax.model.norms import rms_norm
from deepinfer_jax.model.paged_compressor import (
    close_rows,
    row_visibility,
    sequence_rows,
    visible_rows,
)
from deepinfer_jax.model.params import LayerParams, ModelParams
from deepinfer_jax.model.precision import follows_weights
from deepinfer_jax.model.ragged import (
    TokenContext,
    row_index,
    settled,
    token_context,
    window_keys,
    write_ring,
)
from deepinfer_jax.model.rope import cos_sin, layer_inv_freq
from deepinfer_jax.model.state import LayerState, StateCache
from pallas_kernels.indexer import api as indexer_op

Array = jax.Array


@struct.dataclass
class TokenInputs:
    """Per token, everything attention needs from the token itself."""

    post: Array                  # f32[T, hc]
    comb: Array                  # f32[T, hc, hc]
    q: Array                     # [T, H, hd] roped
    kv: Array                    # [T, hd] roped raw K=V row
    comp_kv: Array | None        # f32[T, c*d]  compressor projections (CSA/HCA)
    comp_score: Array | None     # f32[T, c*d]  with the block-position bias
    index_kv: Array | None       # f32[T, 2*Id] indexer compressor (CSA)
    index_score: Array | None    # f32[T, 2*Id]
    index_q: Array | None        # f32[T, IH, Id]
    index_w: Array | None        # f32[T, IH]


def token_inputs(p: LayerParams, kind: AttentionKind, cfg: ModelConfig, compute: ComputeConfig,
                 streams: Array, positions: Array) -> TokenInputs:
    """Rows of tokens: streams [t, hc, D], positions i32[t] -> TokenInputs."""
    cos, sin = cos_sin(positions, layer_inv_freq(cfg, kind))
    collapsed, post, comb = hc_pre(streams, p.attn_hc, hc_eps=cfg.hc_eps,
                                   norm_eps=cfg.rms_norm_eps,
                                   sinkhorn_iters=cfg.hc_sinkhorn_iters, compute=compute)
    x = rms_norm(collapsed, p.attn_norm, cfg.rms_norm_eps)
    q, q_latent = attention.project_queries(x, p.attn, cos, sin, cfg, compute)
    kv = attention.project_kv(x, p.attn, cos, sin, cfg, compute)
    comp = index = (None, None)
    index_q = index_w = None
    if kind is not AttentionKind.SLIDING:
        rate = cfg.compress_rate(kind)
        kv_c, score_c = compressor.project(x, p.attn.compressor, compute)
        comp = (kv_c, score_c + p.attn.compressor.ape[positions % rate])
    if kind is AttentionKind.CSA:
        ip = p.attn.indexer
        kv_i, score_i = compressor.project(x, ip.compressor, compute)
        index = (kv_i, score_i + ip.compressor.ape[positions % cfg.compress_rate_csa])
        index_q = indexer.index_queries(q_latent, ip, cos, sin, cfg.index_n_heads, compute)
        index_w = indexer.head_weights(x, ip, cfg.index_n_heads, compute)
    return TokenInputs(post, comb, q, kv, *comp, *index, index_q, index_w)


def attention_outputs(p: LayerParams, kind: AttentionKind, cfg: ModelConfig,
                      compute: ComputeConfig, t: TokenInputs, keys: tuple[Array, ...],
                      visible: tuple[Array, ...], streams: Array, positions: Array) -> Array:
    """Rows of tokens: attention over their key sets (the window's [t, W, hd], then in
    CSA/HCA layers the compressed rows [t, R, hd]), the output projection and hc_post ->
    streams [t, hc, D] after the attention sublayer."""
    cos, sin = cos_sin(positions, layer_inv_freq(cfg, kind))
    out = attention.sink_attention_parts(t.q, keys, visible, p.attn.sinks, compute)
    return hc_post(attention.output_projection(out, p.attn, cos, sin, cfg, compute), streams,
                   t.post, t.comb, compute)


def ffn_outputs(p: LayerParams, mlp_kind: MlpKind, cfg: ModelConfig, compute: ComputeConfig,
                streams: Array, token_ids: Array, valid: Array | None = None
                ) -> tuple[Array, Array]:
    """Rows of tokens: the MoE sublayer -> (new streams [t, hc, D], routed experts i32[t, K])
    (valid bool[t]: False for the bucket's padding rows, which then read no routed expert)."""
    collapsed, post, comb = hc_pre(streams, p.ffn_hc, hc_eps=cfg.hc_eps,
                                   norm_eps=cfg.rms_norm_eps,
                                   sinkhorn_iters=cfg.hc_sinkhorn_iters, compute=compute)
    f, experts = moe(rms_norm(collapsed, p.ffn_norm, cfg.rms_norm_eps), token_ids, p.moe,
                     mlp_kind, cfg, compute, valid)
    return hc_post(f, streams, post, comb, compute), experts


def select_rows(t_q: Array, t_w: Array, ls: LayerState, ctx: TokenContext, cfg: ModelConfig,
                step_cfg: StepConfig) -> tuple[Array, Array]:
    """CSA: the indexer's top-k rows per token -> (rows [T, k, hd], visible bool[T, k]).

    Each token scores its sequence's keys (gathered once per sequence, not per token). A
    top-k is a selection (ties to the lower index), exact for any batch, so it needs no row
    tiles even in batch-invariant mode."""
    compute = step_cfg.compute
    rate, max_rows = cfg.compress_rate_csa, step_cfg.max_rows(cfg.compress_rate_csa)
    k = min(cfg.index_topk, max_rows)
    keys = sequence_rows(ls.index_keys, ctx.block_table, rate=rate, page_size=step_cfg.page_size,
                         max_rows=max_rows, launch_bound=ctx.launch_bound)      # [N, R, Id]
    scores = indexer_op.indexer_scores(
        t_q, keys, t_w, jnp.where(ctx.valid, ctx.seq, -1),
        implementation=compute.kernels.indexer,
        row_tile=compute.invariant_tile if compute.batch_invariant else None)   # [T, R]
    visible = row_visibility(ctx, rate=rate, max_rows=max_rows)
    _, top = jax.lax.top_k(jnp.where(visible, scores, -jnp.inf), k)
    top_visible = jnp.take_along_axis(visible, top, axis=-1)
    index = settled(ctx.launch_bound,
                    row_index(ctx.block_table, ctx.seq[:, None], top, rate, step_cfg.page_size))
    return ls.rows[index], top_visible


def layer_step(p: LayerParams, streams: Array, token_ids: Array, ctx: TokenContext,
               kind: AttentionKind, mlp_kind: MlpKind, ls: LayerState, cfg: ModelConfig,
               step_cfg: StepConfig, segment: Callable | None = None
               ) -> tuple[Array, LayerState, Array]:
    """One block on the flat batch's residual streams [T, hc, D] -> (streams, the layer's
    state, the routed experts i32[T, K]). segment: how the per-token segments run, by default
    `invariant.segments`; the MTP's draft blocks, whose rows are the step's sequences (their
    count follows the engine's size), pass `invariant.per_sequence`."""
    compute = step_cfg.compute
    segment = segment or segments(compute)
    shards = token_shards(compute)
    t = shards(lambda p, s, pos: segment(lambda s, pos: token_inputs(p, kind, cfg, compute, s,
                                                                     pos), s, pos),
               p, streams, ctx.positions)
    keys, visible = window_keys(t.kv, ls.window, ctx, cfg.sliding_window)   # [T, W, hd]
    ls = dataclasses.replace(ls, window=write_ring(ls.window, t.kv, ctx, compute.batch_invariant))
    if kind is not AttentionKind.SLIDING:
        rate = cfg.compress_rate(kind)
        # a new row's pooling (ordered sums, its norm and rope) is per row, and the rows'
        # count follows the slot count: fixed row tiles in batch-invariant mode
        common = dict(rate=rate, freqs=layer_inv_freq(cfg, kind), eps=cfg.rms_norm_eps,
                      page_size=step_cfg.page_size, rowwise=per_closed_row(compute),
                      invariant=compute.batch_invariant,
                      max_new_rows=streams.shape[0] // rate + ctx.block_table.shape[0])
        rows, tail = close_rows(t.comp_kv, t.comp_score, p.attn.compressor, ls.tail, ls.rows, ctx,
                                overlap=kind is AttentionKind.CSA, **common)
        ls = dataclasses.replace(ls, rows=rows, tail=tail)
        if kind is AttentionKind.CSA:
            index_keys, index_tail = close_rows(t.index_kv, t.index_score, p.attn.indexer.compressor,
                                                ls.index_tail, ls.index_keys, ctx, overlap=True,
                                                **common)
            ls = dataclasses.replace(ls, index_keys=index_keys, index_tail=index_tail)
            rows_seen, rows_visible = select_rows(t.index_q, t.index_w, ls, ctx, cfg, step_cfg)
        else:
            rows_seen, rows_visible = visible_rows(ls.rows, ctx, rate=rate,
                                                   page_size=step_cfg.page_size,
                                                   max_rows=step_cfg.max_rows(rate))
        keys, visible = (keys, rows_seen), (visible, rows_visible)
    else:
        keys, visible = (keys,), (visible,)
    streams = shards(lambda p, *a: segment(lambda *a: attention_outputs(p, kind, cfg, compute,
                                                                        *a), *a),
                     p, t, keys, visible, streams, ctx.positions)
    streams, experts = shards(lambda p, *a: segment(lambda s, ids, ok: ffn_outputs(
        p, mlp_kind, cfg, compute, s, ids, ok), *a), p, streams, token_ids, ctx.valid)
    return streams, ls, experts


def token_shards(compute: ComputeConfig):
    """Context parallelism: fn(layer_params, *args)'s per-token work split over the mesh's
    "cp" axis. Each cp device runs fn on its share of the tokens (every argument's leading
    axis split) inside `shard_map`, with the layer's parameters whole but for the routed
    experts' cp share (model/moe.py exchanges the tokens over "cp" for them); the results
    come back whole on every cp device, where the state's writes (window rings, compressed
    rows and tails, which every cp device keeps whole) and the gathers of each query's keys
    need the chunk's every token. The plain call without it.

    The splits are explicit: left to XLA's SPMD partitioner (sharding constraints on the
    token axis), the row gathers by token indices crashed it (a CHECK in its gather
    partitioning, jax 0.11.2)."""
    if compute.parallel.cp == 1:
        return lambda fn, layer_params, *args: fn(layer_params, *args)
    spec = jax.sharding.PartitionSpec

    def run(fn, layer_params, *args):
        param_specs = jax.tree_util.tree_map_with_path(
            lambda path, _: spec("cp") if ".moe.experts" in jax.tree_util.keystr(path) else spec(),
            layer_params)
        return jax.shard_map(fn, in_specs=(param_specs, *[spec("cp")] * len(args)),
                             out_specs=spec("cp"), axis_names={"cp"}, check_vma=False)(
            layer_params, *args)
    return run


@follows_weights
def forward_step(params: ModelParams, state: StateCache, plan, token_ids: Array,
                 cfg: ModelConfig, step_cfg: StepConfig) -> tuple[StateCache, Array]:
    """One ragged step over token_ids i32[T] -> (new state, final residual streams [T, hc, D])."""
    ctx = token_context(plan, step_cfg.compute.launch_bound)
    x = params.embed[token_ids]
    streams = jnp.broadcast_to(x[:, None, :], (x.shape[0], cfg.hc_mult, x.shape[-1]))
    layer_states, loads = [], []
    for i, (lp, ls) in enumerate(zip(params.layers, state.layers, strict=True)):
        streams, ls, experts = layer_step(lp, streams, token_ids, ctx,
                                          cfg.layer_types[i], cfg.mlp_types[i], ls, cfg,
                                          step_cfg)
        layer_states.append(ls)
        if state.expert_load is not None:
            loads.append(routed_counts(experts, cfg.n_routed_experts))
    state = dataclasses.replace(state, layers=tuple(layer_states))
    if state.expert_load is not None:
        state = dataclasses.replace(state, expert_load=state.expert_load + jnp.stack(loads))
    return state, streams


def routed_counts(experts: Array, n_experts: int) -> Array:
    """Routed experts i32[T, K] (NO_EXPERT: none) -> pairs per expert i32[E]."""
    flat = experts.reshape(-1)
    return jnp.bincount(jnp.where(flat < 0, n_experts, flat), length=n_experts + 1)[:n_experts]
