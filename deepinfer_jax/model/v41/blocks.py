"""V4.1's per-token blocks in plain float32 jnp, for the cache-free reference forward:
single-pass mHC sites, the Engram gate, and the MoE (routing weight applied before the down
projection, as the reference does). Shapes: B batch, S tokens, hc streams, D hidden."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from deepinfer_jax.config.v41 import V41Config
from deepinfer_jax.model.norms import unweighted_rms_norm
from deepinfer_jax.model.params import HyperConnectionParams, MoEParams, SharedExpertParams
from deepinfer_jax.model.v41.params import EngramParams
from pallas_kernels.sinkhorn import api as sinkhorn_op

_ENGRAM_CLAMP = 1e-6          # |dot| floor under the signed square root of the Engram gate


def hc_site(streams: jax.Array, p: HyperConnectionParams, cfg: V41Config):
    """streams f32[B, S, hc, D] -> (pre f32[B, S, hc], post f32[B, S, hc], comb f32[B, S, hc, hc]).
    V4.1 hands `pre` to the NEXT site's collapse (single-pass mHC), so none is applied here."""
    hc = cfg.hc_mult
    flat = unweighted_rms_norm(streams.reshape(*streams.shape[:-2], -1), cfg.rms_norm_eps)
    mixes = flat @ p.fn                                                        # [B, S, (2+hc)*hc]
    pre = jax.nn.sigmoid(mixes[..., :hc] * p.scale[0] + p.base[:hc]) + cfg.hc_eps
    post = 2.0 * jax.nn.sigmoid(mixes[..., hc:2 * hc] * p.scale[1] + p.base[hc:2 * hc])
    logits = (mixes[..., 2 * hc:] * p.scale[2] + p.base[2 * hc:]).reshape(*mixes.shape[:-1], hc, hc)
    comb = sinkhorn_op.sinkhorn(logits, cfg.hc_sinkhorn_iters, cfg.hc_eps, implementation="loop")
    return pre, post, comb


def hc_collapse(streams: jax.Array, pre: jax.Array) -> jax.Array:
    """sum_k pre_k X_k: [B, S, hc, D], [B, S, hc] -> [B, S, D]."""
    return jnp.sum(pre[..., None] * streams, axis=-2)


def hc_expand(out: jax.Array, streams: jax.Array, post: jax.Array, comb: jax.Array) -> jax.Array:
    """X'_k = post_k * out + sum_j comb[j, k] X_j."""
    return post[..., None] * out[..., None, :] + jnp.einsum("bsjk,bsjd->bskd", comb, streams)


def engram(streams: jax.Array, rows: jax.Array, live: jax.Array, p: EngramParams,
           cfg: V41Config) -> jax.Array:
    """streams [B, S, hc, D], rows f32[B, S, C, ed] (this layer's gathered table rows),
    live bool[B, S] (False: DEAD, gate shut) -> streams + gate_k * value."""
    hc, d = cfg.hc_mult, cfg.hidden_size
    kv = rows.reshape(*rows.shape[:-2], -1) @ p.wkv                            # [B, S, (hc+1)*D]
    key = kv[..., :hc * d].reshape(*kv.shape[:-1], hc, d)
    value = kv[..., hc * d:]
    eps = cfg.rms_norm_eps
    # Normalised per (token, stream) over D, not jointly over the streams.
    rstd = (jax.lax.rsqrt(jnp.mean(streams * streams, -1) + eps)
            * jax.lax.rsqrt(jnp.mean(key * key, -1) + eps))
    dot = jnp.sum(streams * (p.q_weight * p.k_weight) * key, -1) * rstd * d ** -0.5
    gate = jax.nn.sigmoid(jnp.sign(dot) * jnp.sqrt(jnp.maximum(jnp.abs(dot), _ENGRAM_CLAMP)))
    gate = jnp.where(live[..., None], gate, 0.0)
    return streams + gate[..., None] * value[..., None, :]


def _swiglu(gate: jax.Array, up: jax.Array, limit: float) -> jax.Array:
    if limit > 0:
        up = jnp.clip(up, -limit, limit)
        gate = jnp.minimum(gate, limit)
    return jax.nn.silu(gate) * up


def route(x: jax.Array, p: MoEParams, cfg: V41Config) -> tuple[jax.Array, jax.Array]:
    """x f32[N, D] -> (experts i32[N, K], weights f32[N, K]): top-k of sqrt(softplus) scores
    plus the selection bias; weights the unbiased scores, normalised, scaled."""
    scores = jnp.sqrt(jax.nn.softplus((x @ p.gate) / cfg.gate_temp))
    _, experts = jax.lax.top_k(scores + p.bias, cfg.num_experts_per_tok)
    weights = jnp.take_along_axis(scores, experts, axis=-1)
    if cfg.norm_topk_prob and cfg.num_experts_per_tok > 1:
        weights = weights / (jnp.sum(weights, -1, keepdims=True) + 1e-20)
    return experts, weights * cfg.routed_scaling_factor


def moe(x: jax.Array, p: MoEParams, cfg: V41Config) -> jax.Array:
    """x f32[B, S, D] -> routed + shared expert outputs. Each token gathers its K experts'
    weights: a reference for tiny models, not a kernel."""
    # I from the stacks: FP4 stacks are held zero-padded past the config's I (weights/fp4_pad.py)
    shape, inter = x.shape, p.experts.w13.shape[-1] // 2
    flat = x.reshape(-1, shape[-1])
    experts, weights = route(flat, p, cfg)
    w13 = p.experts.w13[experts]                                           # [N, K, D, 2I]
    h = jnp.einsum("nd,nkdi->nki", flat, w13)
    a = _swiglu(h[..., :inter], h[..., inter:], cfg.swiglu_limit) * weights[..., None]
    routed = jnp.einsum("nki,nkid->nd", a, p.experts.w2[experts])
    return (routed + _shared(flat, p.shared, cfg)).reshape(shape)


def _shared(x: jax.Array, p: SharedExpertParams | None, cfg: V41Config) -> jax.Array:
    if p is None:
        return jnp.zeros_like(x)
    h = x @ p.w13
    inter = h.shape[-1] // 2
    return _swiglu(h[..., :inter], h[..., inter:], cfg.swiglu_limit) @ p.w2
