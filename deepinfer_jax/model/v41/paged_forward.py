"""The forward step of DeepSeek-V4.1 over a ragged batch with the paged state (state.py).

Same math as the cache-free `forward.py`, but each token sees: its window (this step's rows
of its sequence plus the slot's ring), and the compressed entries in its sequence's pages of
its group's KV source, chosen by the latest index source. State in, state out.

The CSA2 group state travels through the layer loop as `_StepGroup`, the step's form of the
reference's per-forward `shared` dict: the source's updated pools (consumers read them, they
own none), the latest index source's choice, and the candidate source's block mask, which
later index sources (Reindex) score inside.

Weights: in batch-invariant mode each layer's quantized weights are dequantized to float32
as the step reaches it (the reference's float32 blocks, tested bitwise). Otherwise the
routed and shared experts stay as stored and go to V4's kernels (experts.py) with the
activations in the compute dtype, the embedding's float type as in V4's step (bf16 on a GPU,
float32 in the CPU tests); the rest of the layer, V4.1's FP8 projections of 32 x 32 blocks
(which the V4 GEMM kernels, 128 x 128, do not read), is dequantized to that dtype per layer.

Per-token work (mHC, projections, Engram, attention, MoE) runs in segments (segments.py),
V4.1's `blocks` on rows of the flat batch, in fixed row tiles in batch-invariant mode; the
cross-token part (window gathers, closing groups, the indexer's scores and choice) is exact or
tiled on its own (paged_csa.py), so a row's bits do not depend on the batch. The Engram row
ids arrive as i32[T, L_e, C]. With the tables in host memory (EngineConfig.engram_tables=
"host") the host hashes them (`engram_hash.hash_ids` with the sequence's look-back) and
gathers the rows too, and the step receives those ([T, L_e, C, ed], in the plan); otherwise
the step hashed them (model/family.py, `engram_device`) and gathers them from the device's
`params.engram_tables`. Either way a token reads the same values, so the two agree bit for
bit.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from deepinfer_jax.config.compute import ComputeConfig
from deepinfer_jax.config.step import StepConfig
from deepinfer_jax.config.v41 import V41Config
from deepinfer_jax.model.invariant import per_sequence, rowwise
from deepinfer_jax.model.paged_forward import token_shards
from deepinfer_jax.model.precision import follows_weights
from deepinfer_jax.model.ragged import TokenContext, token_context, window_keys, write_ring
from deepinfer_jax.model.rope import cos_sin, inv_freq
from deepinfer_jax.model.v41 import csa, engram_tables, paged_csa, segments
from deepinfer_jax.model.v41.kv_format import Fp4Rows, Fp8Rows, decode_fp8
from deepinfer_jax.model.v41.params import V41LayerParams, V41ModelParams
from deepinfer_jax.model.v41.state import V41LayerState, V41State
from pallas_kernels.quantized import dequantize_tree

Array = jax.Array


@struct.dataclass
class FinalStreams:
    """What the head needs, and what the indexers chose (parity checks; free to drop)."""

    streams: Array                      # f32[T, hc, D]  residual streams after the last layer
    pre: Array                          # f32[T, hc]     the last site's `pre` (collapse weights)
    top_k: tuple[Array | None, ...]     # per layer: i32[T, k] at index sources, else None
    candidates: Array | None            # bool[T, R] of the candidate source


@dataclasses.dataclass
class _StepGroup:
    entries: Fp4Rows | None = None      # the current KV source's pool, this step's rows written
    keys: Fp4Rows | None = None         # its indexer keys
    selected: Array | None = None       # i32[T, k]  the latest index source's choice
    candidates: Array | None = None     # bool[T, R] the candidate source's blocks


@dataclasses.dataclass(frozen=True)
class _Token:
    """Per-step constants of the layer loop."""

    ctx: TokenContext
    rope: dict                          # {compressed: (cos, sin) f32[T, rope_dim / 2]}
    compress_freqs: np.ndarray
    dtype: jnp.dtype                    # the experts' activations (outside invariant mode)


@follows_weights
def forward_step(params: V41ModelParams, state: V41State, plan, token_ids: Array,
                 engram_ids: Array | None, cfg: V41Config, step_cfg: StepConfig,
                 engram_rows: Array | None = None) -> tuple[V41State, FinalStreams]:
    """One ragged step over token_ids i32[T] (engram_ids i32[T, L_e, C], None without Engram;
    engram_rows [T, L_e, C, ed] the rows the host gathered for them, None where the tables are
    device weights) -> (new state, FinalStreams)."""
    ctx = token_context(plan, step_cfg.compute.launch_bound)
    per_token = _per_token(step_cfg.compute)
    freqs = {False: inv_freq(cfg.rope_head_dim, cfg.rope_theta, None),
             True: inv_freq(cfg.rope_head_dim, cfg.compress_rope_theta, cfg.compress_yarn)}
    tok = _Token(ctx=ctx, rope={k: cos_sin(ctx.positions, f) for k, f in freqs.items()},
                 compress_freqs=freqs[True], dtype=compute_dtype(params))
    invariant = step_cfg.compute.batch_invariant
    x = params.embed[token_ids].astype(jnp.float32)
    streams = jnp.broadcast_to(x[:, None], (x.shape[0], cfg.hc_mult, x.shape[-1]))
    pre = jnp.zeros((x.shape[0], cfg.hc_mult), jnp.float32).at[:, 0].set(1.0)
    group, layers, top_k = _StepGroup(), [], []
    for i, (lp, ls) in enumerate(zip(params.layers, state.layers, strict=True)):
        lp = dequantize_tree(lp, jnp.float32) if invariant else dense_dequantized(lp, tok.dtype)
        if cfg.has_engram(i):
            k = cfg.engram.layer_ids.index(i)
            table_rows = (engram_tables.table_rows(params.engram_tables[k], engram_ids[:, k],
                                                   step_cfg.compute)
                          if engram_rows is None else engram_rows[:, k]).astype(jnp.float32)
            streams = per_token(lambda p, *a: segments.engram_outputs(p, cfg, *a), lp,
                                streams, table_rows, ctx.valid)              # rows [T, C, ed]
        streams, pre, ls, group = layer_step(lp, streams, pre, ls, group, i, tok, cfg, step_cfg)
        layers.append(ls)
        top_k.append(group.selected if cfg.is_index_source(i) else None)
    state = state.replace(layers=tuple(layers))
    return state, FinalStreams(streams=streams, pre=pre, top_k=tuple(top_k),
                               candidates=group.candidates)


def compute_dtype(params: V41ModelParams) -> jnp.dtype:
    """The experts' activation dtype outside batch-invariant mode: the embedding's float
    type (the model's weights dtype), as V4's step takes its activations from it."""
    return jnp.dtype(params.embed.dtype)


def dense_dequantized(lp: V41LayerParams, dtype) -> V41LayerParams:
    """The layer with every quantized weight but the MoE's experts (routed and shared,
    read as stored by the kernels) dequantized to dtype."""
    moe = lp.moe
    rest = dequantize_tree(lp.replace(moe=moe.replace(experts=None, shared=None)), dtype)
    return rest.replace(moe=rest.moe.replace(experts=moe.experts, shared=moe.shared))


@follows_weights
def final_logits(params: V41ModelParams, final: FinalStreams, cfg: V41Config,
                 compute: ComputeConfig) -> Array:
    """FinalStreams of some tokens [t, ...] -> logits f32[t, V] (the last collapse, norm, head),
    in batch-invariant mode in row tiles as V4's head (`invariant.per_sequence`: the sampled
    rows' count follows the engine's size)."""
    return per_sequence(compute)(
        lambda s, p: segments.head_logits(params.norm, params.head, cfg, s, p),
        final.streams, final.pre)


def layer_step(p: V41LayerParams, streams: Array, pre: Array, ls: V41LayerState,
               group: _StepGroup, i: int, tok: _Token, cfg: V41Config, step_cfg: StepConfig):
    """One block on the flat batch's streams [T, hc, D] -> (streams, the next collapse's pre,
    the layer's state, the group state for the layers after it). The per-token segments run
    through `rows` (row tiles in batch-invariant mode, segments.py)."""
    ctx, ratio, compute = tok.ctx, cfg.compress_ratios[i], step_cfg.compute
    per_token = _per_token(compute)
    rope = tok.rope[ratio > 0]
    t = per_token(lambda p, *a: segments.token_inputs(p, i, cfg, *a), p, streams, pre, *rope,
                  *tok.rope[True])
    window, window_visible, ls = _window(t.window, ls, ctx, cfg, step_cfg)
    if cfg.is_kv_source(i):
        ls = paged_csa.publish(t.comp_kv, t.comp_gate, p.attn, ls, ctx, ratio, tok.compress_freqs,
                               cfg, step_cfg)
        group = dataclasses.replace(group, entries=ls.entries, keys=ls.index_keys)
    if cfg.is_index_source(i):
        group = _select(t, group, i, ratio, tok, cfg, step_cfg)
    picked = picked_visible = None
    if ratio > 0:
        picked, picked_visible = paged_csa.selected_entries(group.entries, group.selected, ctx,
                                                            ratio, step_cfg)
    streams = per_token(lambda p, *a: segments.attention_outputs(p, cfg, compute, *a), p, t.q,
                        window, window_visible, picked, picked_visible, streams, t.a_post,
                        t.a_comb, *rope)
    valid = None if compute.batch_invariant else ctx.valid
    streams, f_pre = per_token(lambda p, s, a_pre, v: segments.ffn_outputs(
        p, cfg, compute, tok.dtype, s, a_pre, v), p, streams, t.a_pre, valid)
    return streams, f_pre, ls, group


def _per_token(compute: ComputeConfig):
    """How a per-token segment fn(layer_params, *rows) runs: on the rows in row tiles in
    batch-invariant mode (`rowwise`), and with context parallelism on each "cp" device's share
    of the tokens (V4's `token_shards`: the routed experts' cp share inside, the results whole
    on every cp device, where the cross-token part of the layer needs every token)."""
    rows, shards = rowwise(compute), token_shards(compute)
    return lambda fn, p, *args: shards(lambda p, *a: rows(lambda *a: fn(p, *a), *a), p, *args)


def _window(kv: Fp8Rows, ls: V41LayerState, ctx: TokenContext, cfg: V41Config,
            step_cfg: StepConfig) -> tuple[Array, Array, V41LayerState]:
    """This step's roped K=V latents, FP8-coded as the ring stores them ([T, hd]) -> each
    token's window (read before the ring is written: a long chunk overwrites rows its first
    tokens need) as (rows f32[T, W, hd], visible bool[T, W], the layer state with the ring
    written). Decoding is exact (kv_format), so it needs no row tiles."""
    codes, visible = window_keys(kv.codes, ls.window.codes, ctx, cfg.sliding_window)
    exps, _ = window_keys(kv.exps, ls.window.exps, ctx, cfg.sliding_window)
    order_free = step_cfg.batch_invariant
    ring = Fp8Rows(codes=write_ring(ls.window.codes, kv.codes, ctx, order_free),
                   exps=write_ring(ls.window.exps, kv.exps, ctx, order_free))
    return decode_fp8(Fp8Rows(codes=codes, exps=exps)), visible, ls.replace(window=ring)


def _select(t: segments.TokenInputs, group: _StepGroup, i: int, ratio: int, tok: _Token,
            cfg: V41Config, step_cfg: StepConfig) -> _StepGroup:
    """An index source: score against the group's keys (inside the candidate blocks after the
    candidate source), publish the top-k (and, at the candidate source, the blocks). Block
    maxima and top-k are selections, exact in any batch."""
    scores = paged_csa.index_scores(t.index_q, t.index_w, group.keys, tok.ctx, ratio,
                                    step_cfg)                                  # [T, R]
    candidates = group.candidates
    if i == cfg.candidate_source_layer_id:
        candidates = csa.candidate_blocks(scores, paged_csa.visible_counts(tok.ctx, ratio), cfg)
    elif cfg.uses_candidates(i):
        scores = jnp.where(candidates, scores, -jnp.inf)
    return dataclasses.replace(group, selected=csa.top_k_entries(scores, cfg.index_topk),
                               candidates=candidates)
