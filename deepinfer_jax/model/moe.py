"""Mixture of experts: a router (learned top-k or hash table), grouped routed experts, a shared expert.

Routing: scores = f(x W_g) with f in {sqrt(softplus), softmax, sigmoid} (float32). Routed
layers pick top-k of `scores + bias` (the bias steers selection only); hash layers take
`tid2eid[token]`. Weights are the chosen scores, renormalised when `norm_topk_prob`, times
`routed_scaling_factor`. Each expert is a clamped SwiGLU: silu(min(a, L)) * clamp(b, -L, L).

Routed experts run grouped: the (token, expert) pairs are sorted by expert and pushed through
the grouped GEMM (pallas_kernels/grouped_gemm: the Mosaic GPU kernel on a GPU, jnp's
`ragged_dot` elsewhere) over the stacked weights; then each token's K outputs are summed in a
fixed order (slot 0..K-1), whatever the grouping. The kernel computes each row on its own, so
it also serves batch-invariant mode; without it that mode runs each pair on its own.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from deepinfer_jax.config.model import MlpKind, ModelConfig, ScoringFunc
from deepinfer_jax.model.invariant import f32_linear, linear, ordered_sum
from deepinfer_jax.model.params import ExpertParams, MoEParams, SharedExpertParams
from pallas_kernels.common import settled
from pallas_kernels.grouped_gemm import api as gemm
from pallas_kernels.grouped_gemm import invariant as invariant_gemm
from pallas_kernels.grouped_gemm.reference import swiglu  # the clamped SwiGLU, one definition

NO_EXPERT = -1      # a (token, slot) pair routed nowhere: a padding row's


def score(logits: jax.Array, func: ScoringFunc) -> jax.Array:
    match func:
        case ScoringFunc.SQRTSOFTPLUS:
            return jnp.sqrt(jax.nn.softplus(logits))
        case ScoringFunc.SOFTMAX:
            return jax.nn.softmax(logits, axis=-1)
        case ScoringFunc.SIGMOID:
            return jax.nn.sigmoid(logits)


def route(x: jax.Array, token_ids: jax.Array, p: MoEParams, kind: MlpKind,
          cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """x [N, D], token_ids i32[N] -> (experts i32[N, K], weights f32[N, K])."""
    logits = f32_linear(x, p.gate, cfg.batch_invariant)
    scores = score(logits, cfg.scoring_func)
    if kind is MlpKind.HASH_MOE:
        experts = p.tid2eid[token_ids]
    else:
        _, experts = jax.lax.top_k(scores + p.bias, cfg.num_experts_per_tok)
    weights = jnp.take_along_axis(scores, experts, axis=-1)
    if cfg.norm_topk_prob:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    return experts.astype(jnp.int32), weights * cfg.routed_scaling_factor


def sort_by_expert(flat_expert: jax.Array, n_experts: int) -> jax.Array:
    """The stable argsort of pairs by expert, as one sort of unique int32 keys (expert * P +
    pair): a keys-only sort, the simplest for XLA's GPU backend to hand to a radix sort. An
    8k prefill step's profile on the H200 holds a 1 ms sort, this argsort's or the indexer's
    top-k (the next profile names it). Falls back to argsort where the keys would not fit
    in int32."""
    pairs = flat_expert.shape[0]
    if (n_experts + 1) * pairs >= 2**31:      # (+1: NO_EXPERT, the padding rows')
        return jnp.argsort(flat_expert, stable=True)
    keys = flat_expert.astype(jnp.int32) * pairs + jnp.arange(pairs, dtype=jnp.int32)
    return jnp.sort(keys) % pairs


def routed_experts(x: jax.Array, experts: jax.Array, weights: jax.Array, p: ExpertParams,
                   limit: float, configs=None, invariant: bool = False) -> jax.Array:
    """x [N, D], experts i32[N, K] (NO_EXPERT: the pair is skipped), weights f32[N, K] ->
    [N, D]. configs: the grouped GEMM's (gate/up, down) tile configs, its defaults for this
    batch if None."""
    n_tokens, top_k = experts.shape
    n_experts = p.w13.shape[0]
    flat_expert = jnp.where(experts == NO_EXPERT, n_experts, experts).reshape(-1)   # [N*K]
    # Skipped pairs sort last, past every group (group_sizes does not count them): the grouped
    # GEMM gives them no tile, and their rows of its result are undefined (masked below).
    order = sort_by_expert(flat_expert, n_experts)                       # pairs sorted by expert
    # each pair's place in that order (a permutation's inverse: unique indices)
    rank = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype),
                                                 unique_indices=True)
    group_sizes = jnp.bincount(flat_expert, length=n_experts).astype(jnp.int32)
    out = gemm.expert_mlp(x, p.w13, p.w2, group_sizes, limit, configs=configs,
                          source_rows=settled(order // top_k), out_order=settled(rank))
    routed = (flat_expert < n_experts)[:, None]
    out = jnp.where(routed, out * weights.reshape(-1)[:, None].astype(out.dtype), 0)  # [N*K, D]
    # Each weighted output rounded to the activations' type before the sum over the K slots,
    # whatever XLA fuses (it may otherwise keep the products in float32 inside the fused sum).
    finfo = jnp.finfo(out.dtype)
    out = jax.lax.reduce_precision(out, exponent_bits=finfo.nexp, mantissa_bits=finfo.nmant)
    per_slot = out.reshape(n_tokens, top_k, -1)
    return ordered_sum(per_slot, 1) if invariant else jnp.sum(per_slot, axis=1)


def routed_experts_invariant(x: jax.Array, experts: jax.Array, weights: jax.Array,
                             p: ExpertParams, limit: float) -> jax.Array:
    """Batch-invariant routed experts: each (token, expert) pair runs on its own, with the
    same shapes whatever the batch (a grouped matmul's per-row result depends on how many rows
    its group has); the K outputs are summed in slot order."""
    n_tokens, top_k = experts.shape

    def one(pair):
        row, expert, weight = pair
        hidden = swiglu(row[None] @ p.w13[expert], limit).astype(row.dtype)
        return (hidden @ p.w2[expert])[0] * weight.astype(row.dtype)

    rows = jnp.repeat(x, top_k, axis=0)                                      # [N*K, D]
    out = jax.lax.map(one, (rows, experts.reshape(-1), weights.reshape(-1)))
    return jnp.sum(out.reshape(n_tokens, top_k, -1), axis=1)


def shared_expert(x: jax.Array, p: SharedExpertParams, limit: float,
                  invariant: bool = False) -> jax.Array:
    hidden = swiglu(linear(x, p.w13, invariant), limit).astype(x.dtype)
    return linear(hidden, p.w2, invariant)


def _expert_configs(num_tokens: int, p: MoEParams, cfg: ModelConfig):
    """The grouped GEMM's (gate/up, down) configs: in batch-invariant mode ones that do not
    follow the batch (grouped GEMM api), else its defaults (None)."""
    inter, dim = p.experts.w2.shape[1:]
    pairs = num_tokens * cfg.num_experts_per_tok
    return invariant_gemm.expert_invariant_configs(pairs, dim, inter) if cfg.batch_invariant else None


def experts_on_kernel(num_tokens: int, dtype, p: MoEParams, cfg: ModelConfig) -> bool:
    """Whether the routed experts of num_tokens tokens (activations of `dtype`) run on the
    grouped-GEMM kernel."""
    inter, dim = p.experts.w2.shape[1:]
    pairs = num_tokens * cfg.num_experts_per_tok
    up_cfg, down_cfg = _expert_configs(num_tokens, p, cfg) or (None, None)
    return (gemm.kernel_runs(pairs, dim, inter, dtype=dtype, config=up_cfg)
            and gemm.kernel_runs(pairs, inter, dim, dtype=dtype, config=down_cfg))


def moe(x: jax.Array, token_ids: jax.Array, p: MoEParams, kind: MlpKind, cfg: ModelConfig,
        valid: jax.Array | None = None) -> jax.Array:
    """x [..., D], token_ids i32[...], valid bool[...] (False: a padding row of the step's
    bucket) -> [..., D] (the shared expert's output alone in padding rows).

    Padding rows are routed to no expert: they would read experts of their own otherwise (a
    decode step of one request in a 16-token bucket read ~12 experts' weights a layer instead
    of 6 on the H200; step-profile-gpu.md)."""
    flat = x.reshape(-1, x.shape[-1])
    experts, weights = route(flat, token_ids.reshape(-1), p, kind, cfg)
    if valid is not None:
        keep = valid.reshape(-1, 1)
        experts, weights = jnp.where(keep, experts, NO_EXPERT), jnp.where(keep, weights, 0.0)
    on_kernel = experts_on_kernel(flat.shape[0], flat.dtype, p, cfg)
    if cfg.batch_invariant and not on_kernel:
        out = routed_experts_invariant(flat, experts, weights, p.experts, cfg.swiglu_limit)
    else:
        out = routed_experts(flat, experts, weights, p.experts, cfg.swiglu_limit,
                             _expert_configs(flat.shape[0], p, cfg), cfg.batch_invariant)
    if p.shared is not None:
        out = out + shared_expert(flat, p.shared, cfg.swiglu_limit, cfg.batch_invariant)
    return out.reshape(x.shape)
