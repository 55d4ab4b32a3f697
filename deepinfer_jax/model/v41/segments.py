"""V4.1's per-token segments of the paged step: everything a token computes from itself alone.

A layer of the step (paged_forward.py) is: `token_inputs` (the mHC site, the attention input,
queries, the token's window latent and compressor projections), the cross-token part (window
gathers, closing groups, the indexer's choice), `attention_outputs` and `ffn_outputs`; an
Engram layer first runs `engram_outputs`. Each segment maps rows [t, ...] to rows [t, ...], so
in batch-invariant mode it runs over fixed-size row tiles one after the other
(`invariant.rowwise`): every row is computed by the same program whatever else is in the batch.
V4.1 tiles them in both formulations: in that mode its matmuls, norms and einsums are the
reference's plain float32 jnp, which only a fixed shape makes invariant on either platform.
Outside it the MoE runs on V4's grouped kernels over the weights as stored (experts.py).
Shapes: t rows, hc streams, D hidden, H heads, hd head_dim, IH/Id indexer heads/dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from deepinfer_jax.config.compute import ComputeConfig
from deepinfer_jax.config.v41 import V41Config
from deepinfer_jax.model.attention import sink_attention_parts
from deepinfer_jax.model.norms import rms_norm
from deepinfer_jax.model.v41 import blocks, csa, experts
from deepinfer_jax.model.v41.kv_format import Fp8Rows, encode_fp8
from deepinfer_jax.model.v41.params import V41LayerParams
from deepinfer_jax.model.v41.state import WINDOW_BLOCK

Array = jax.Array


@struct.dataclass
class TokenInputs:
    a_pre: Array                # f32[t, hc]      the attention site's pre (the FFN's collapse)
    a_post: Array               # f32[t, hc]
    a_comb: Array               # f32[t, hc, hc]
    q: Array                    # f32[t, H, hd]   roped attention queries
    window: Fp8Rows             # [t, hd]         the roped K=V latent, FP8-coded as stored
    comp_kv: Array | None       # f32[t, hd]      KV sources: the compressor's projection
    comp_gate: Array | None     # f32[t, hd]      KV sources of ratio > 1: its pooling logits
    index_q: Array | None       # f32[t, IH, Id]  index sources: roped, FP4 fake-quantized
    index_w: Array | None       # f32[t, IH]      index sources: head weights


def one_row(fn, *args):
    """Run a [B, S, ...] block of the reference on rows [t, ...] as B = 1."""
    return jax.tree.map(lambda out: out[0], fn(*[a[None] for a in args]))


def token_inputs(p: V41LayerParams, i: int, cfg: V41Config, streams: Array, pre: Array,
                 cos: Array, sin: Array, c_cos: Array, c_sin: Array) -> TokenInputs:
    """streams f32[t, hc, D], the previous site's pre f32[t, hc], the layer's rope (cos, sin)
    and the compressed rope (c_cos, c_sin) f32[t, rope_dim / 2] -> TokenInputs."""
    attn, ratio, eps = p.attn, cfg.compress_ratios[i], cfg.rms_norm_eps
    a_pre, a_post, a_comb = one_row(lambda s: blocks.hc_site(s, p.attn_hc, cfg), streams)
    x = rms_norm(blocks.hc_collapse(streams, pre), p.attn_norm, eps)
    q_residual = rms_norm(x @ attn.wq_a, attn.q_norm, eps)
    window = encode_fp8(csa.window_latents(x, (cos, sin), attn, cfg), WINDOW_BLOCK)
    q = csa.attention_queries(q_residual, (cos, sin), attn, cfg)
    comp_kv = comp_gate = index_q = index_w = None
    if cfg.is_kv_source(i):
        comp_kv = x @ attn.compressor.wkv
        if ratio > 1:
            comp_gate = x @ attn.compressor.wgate
    if cfg.is_index_source(i):
        index_q, index_w = csa.index_queries(x, q_residual, (c_cos, c_sin), attn.indexer, cfg,
                                             True)
    return TokenInputs(a_pre, a_post, a_comb, q, window, comp_kv, comp_gate, index_q, index_w)


def attention_outputs(p: V41LayerParams, cfg: V41Config, compute: ComputeConfig, q: Array,
                      window: Array, window_visible: Array, picked: Array | None,
                      picked_visible: Array | None, streams: Array, post: Array, comb: Array,
                      cos: Array, sin: Array) -> Array:
    """Rows: attention over the window f32[t, W, hd] (and the selected entries f32[t, k, hd]),
    the output projection and the site's expansion -> streams f32[t, hc, D]."""
    keys, visible = ((window,), (window_visible,)) if picked is None else (
        (window, picked), (window_visible, picked_visible))
    out = sink_attention_parts(q, keys, visible, p.attn.sinks, compute)
    y = csa.output_projection(out, (cos, sin), p.attn, cfg)
    return one_row(blocks.hc_expand, y, streams, post, comb)


def ffn_outputs(p: V41LayerParams, cfg: V41Config, compute: ComputeConfig, dtype,
                streams: Array, a_pre: Array, valid: Array | None = None) -> tuple[Array, Array]:
    """Rows: the FFN site, collapse (with the attention site's pre), MoE and expansion ->
    (streams f32[t, hc, D], this site's pre f32[t, hc] for the next layer's collapse).
    Batch-invariant mode: the reference's `blocks.moe` (float32, in the step's row tiles);
    otherwise V4's grouped kernels on the weights as stored, in `dtype` (experts.py; valid
    bool[t] False: a padding row, routed to no expert)."""
    f_pre, f_post, f_comb = one_row(lambda s: blocks.hc_site(s, p.ffn_hc, cfg), streams)
    x = rms_norm(blocks.hc_collapse(streams, a_pre), p.ffn_norm, cfg.rms_norm_eps)
    if compute.batch_invariant and compute.parallel.expert_ranks == 1:
        out = blocks.moe(x, p.moe, cfg)
    else:       # on a mesh each device holds some experts: V4's expert-parallel exchange
        out = experts.moe(x, p.moe, cfg, compute, dtype, valid)
    return one_row(blocks.hc_expand, out, streams, f_post, f_comb), f_pre


def engram_outputs(p: V41LayerParams, cfg: V41Config, streams: Array, rows: Array,
                   live: Array) -> Array:
    """Rows: streams f32[t, hc, D], this layer's gathered table rows f32[t, C, ed], live
    bool[t] -> streams with the gated Engram value added."""
    return one_row(lambda s, r, v: blocks.engram(s, r, v, p.engram, cfg), streams, rows, live)


def head_logits(norm: Array, head: Array, cfg: V41Config, streams: Array, pre: Array) -> Array:
    """Rows: the last collapse, norm and LM head -> logits f32[t, V]."""
    return rms_norm(blocks.hc_collapse(streams, pre), norm, cfg.rms_norm_eps) @ head


def pooled(grouped: Array, logits: Array | None) -> Array:
    """A closing group's tokens [n, ratio, hd] pooled by the per-channel softmax of their
    logits (None: ratio 1, the token itself) -> f32[n, hd] before the norm."""
    if logits is None:
        return grouped[:, 0]
    return jnp.sum(grouped * jax.nn.softmax(logits, axis=1), axis=1)
