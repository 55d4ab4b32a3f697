"""Manifold-constrained hyper-connections (mHC): the residual is `hc` parallel streams.

Each sublayer reads one collapsed input (`pre`-weighted sum of the streams) and writes back
`post_k * f + sum_j comb[j, k] * X_j`, where `comb` is pushed towards a doubly-stochastic
matrix by Sinkhorn iterations. All mixing math is float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from deepinfer_jax.config.compute import ComputeConfig
from deepinfer_jax.model.invariant import linear, ordered_sum, per_row_tiles
from deepinfer_jax.model.norms import mean_of_squares, unweighted_rms_norm
from deepinfer_jax.model.params import HyperConnectionParams, HyperHeadParams
from deepinfer_jax.model.precision import rounded_to
from pallas_kernels.sinkhorn import api as sinkhorn_op

# Batch-invariant mode's mix projection on the invariant GEMM: its columns padded to a
# multiple of MIX_COLUMNS (the kernel's split tile), and its long K (hc * D) summed in ranges
# of MIX_K_RANGE, a function of the weight's shape alone: 16 programs for a decode batch's
# 16384 x 128 (one would read the whole weight), 16 float32 partials a row for a prefill's;
# a K it does not divide takes the weight shape's own split (invariant_split_k).
MIX_COLUMNS = 128
MIX_K_RANGE = 1024


def _mixes(streams: jax.Array, fn: jax.Array, eps: float, compute: ComputeConfig,
           parts: jax.Array | None = None, ordered: bool = False) -> jax.Array:
    """streams [..., hc, D] -> f32[..., n_mix]: a linear map of the RMS-normalised flat streams.

    bf16 streams: the norm is one factor per token, so it is applied to the n_mix sums
    instead of the hc * D inputs, and the float32 weight is split into three bf16 parts
    (hi + mid + lo holds its 24-bit mantissa) so the projection is one bf16 GEMM with float32
    sums of exact products: float32 accuracy, without a float32 copy of the streams or a
    float32 GEMM (that GEMM at HIGHEST precision, over a normalised copy written out, is
    slower on the H200, though this form reads the streams twice: docs/performance-log.md).
    In batch-invariant mode that GEMM is the invariant dense kernel's, its 3 * n_mix columns
    zero-padded and its K in fixed ranges (MIX_COLUMNS, MIX_K_RANGE; float32 operands have no
    kernel: their jnp reference would run in a loop of row tiles). `parts`: those three parts
    side by side, made once (`with_mix_parts`) rather than at every call (a launch a mix on
    a GPU). `ordered`: the mean of squares as an `ordered_sum` (norms.rms_norm says why)."""
    flat = streams.reshape(*streams.shape[:-2], -1)
    if flat.dtype != jnp.bfloat16:
        return linear(unweighted_rms_norm(flat.astype(jnp.float32), eps, ordered=ordered), fn,
                      compute)
    n_mix = fn.shape[-1]
    weight = mix_parts(fn) if parts is None else parts                       # [K, 3 n_mix]
    k = flat.shape[-1]
    if compute.batch_invariant:
        weight = jnp.pad(weight, ((0, 0), (0, -weight.shape[-1] % MIX_COLUMNS)))
    sums = linear(flat, weight, compute, out_dtype=jnp.float32,
                  k_ranges=k // MIX_K_RANGE if k % MIX_K_RANGE == 0 else None)
    projected = (sums[..., :n_mix] + sums[..., n_mix:2 * n_mix]) + sums[..., 2 * n_mix:3 * n_mix]
    return projected * jax.lax.rsqrt(mean_of_squares(flat, ordered) + eps)


def mix_parts(fn: jax.Array) -> jax.Array:
    """f32 fn [K, n_mix] -> bf16 [K, 3 n_mix]: its `bf16_parts` side by side."""
    return jnp.concatenate(bf16_parts(fn.astype(jnp.float32)), axis=-1)


def with_mix_parts(params):
    """params (any model's tree) with every mHC mix's `fn_parts` made from its fn, for a
    model whose streams are bf16 (the only ones `_mixes` splits fn for)."""
    is_mix = lambda x: isinstance(x, (HyperConnectionParams, HyperHeadParams))   # noqa: E731
    parts = jax.jit(mix_parts)
    return jax.tree.map(lambda p: p.replace(fn_parts=parts(p.fn)) if is_mix(p) else p, params,
                        is_leaf=is_mix)


def bf16_parts(w: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """f32 w -> bf16 (hi, mid, lo) with hi + mid + lo = w (8 + 8 + 8 mantissa bits). Each
    part is cut from the remainder by masking its low 16 bits, not by rounding to bf16: XLA's
    GPU compiler, allowed excess precision, folds a float32 -> bf16 -> float32 round trip
    away (seen on the H200: the remainder came out 0, the projection bf16-accurate)."""
    def top_bits(x):
        bits = jax.lax.bitcast_convert_type(x, jnp.uint32) & jnp.uint32(0xFFFF0000)
        return jax.lax.bitcast_convert_type(bits, jnp.float32)

    hi = top_bits(w)
    rest = w - hi                       # exact: the bits hi left out
    mid = top_bits(rest)
    lo = rest - mid                     # exact, and at most 8 significant bits
    return hi.astype(jnp.bfloat16), mid.astype(jnp.bfloat16), lo.astype(jnp.bfloat16)


def collapse(pre: jax.Array, streams: jax.Array, invariant: bool) -> jax.Array:
    """sum_j pre_j X_j: f32[..., hc], [..., hc, D] -> f32[..., D]. In batch-invariant mode in
    a fixed order: a reduction over the small stream axis may otherwise be grouped
    differently for differently shaped inputs (e.g. the speculative step's [N, S, hc, D])."""
    weighted = pre[..., None] * streams.astype(jnp.float32)
    return ordered_sum(weighted, -2) if invariant else jnp.sum(weighted, axis=-2)


def sinkhorn_implementations(compute: ComputeConfig) -> tuple[str, ...]:
    """The Sinkhorn op's implementations for this formulation. Two jnp forms of the same
    arithmetic: the unrolled elementwise one ("reference"), which XLA fuses into about a
    kernel per iteration, and a loop of reductions ("loop"), ~5 launches per iteration on a
    GPU but cheap on the CPU, where it also compiles faster. On the CPU XLA's
    vectorised elementwise code gives a row other last bits in batches of other sizes, so the
    CPU and batch-invariant mode off the kernel take the loop (proven invariant on the CPU
    and the H200); the kernel runs every token in its own lanes through the same
    instructions, invariant by construction."""
    if not compute.launch_bound:
        return ("loop",)
    kernels = tuple(name for name in compute.kernels.sinkhorn if name != "reference")
    return kernels + (("loop",) if compute.batch_invariant else ("reference",))


def hc_pre(streams: jax.Array, p: HyperConnectionParams, *, hc_eps: float, norm_eps: float,
           sinkhorn_iters: int, compute: ComputeConfig
           ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """streams [..., hc, D] -> (collapsed [..., D], post f32[..., hc], comb f32[..., hc, hc])."""
    hc = streams.shape[-2]
    mixes = _mixes(streams, p.fn, norm_eps, compute, p.fn_parts)
    pre_w, post_w, comb_w = mixes[..., :hc], mixes[..., hc:2 * hc], mixes[..., 2 * hc:]
    pre = jax.nn.sigmoid(pre_w * p.scale[0] + p.base[:hc]) + hc_eps
    post = 2.0 * jax.nn.sigmoid(post_w * p.scale[1] + p.base[hc:2 * hc])
    comb_logits = (comb_w * p.scale[2] + p.base[2 * hc:]).reshape(*comb_w.shape[:-1], hc, hc)
    comb = sinkhorn_op.sinkhorn(comb_logits, sinkhorn_iters, hc_eps,
                                implementation=sinkhorn_implementations(compute))
    return collapse(pre, streams, compute.batch_invariant).astype(streams.dtype), post, comb


def hc_post(block_out: jax.Array, streams: jax.Array, post: jax.Array, comb: jax.Array,
            compute: ComputeConfig) -> jax.Array:
    """X'_k = post_k * f + sum_j comb[j, k] X_j.  block_out [..., D], streams [..., hc, D]."""
    # elementwise per token, so invariant by itself on a GPU; the CPU's vectorised loops are
    # not (ComputeConfig.tile_segments): there it runs in row tiles
    if compute.tile_segments:     # per token: [T', D], [T', hc, D], [T', hc], [T', hc, hc]
        n = block_out.ndim - 1
        rows = [a.reshape(-1, *a.shape[n:]) for a in (block_out, streams, post, comb)]
        return per_row_tiles(_mix_streams, *rows, tile=compute.invariant_tile
                             ).reshape(streams.shape)
    return _mix_streams(block_out, streams, post, comb)


def _mix_streams(block_out: jax.Array, streams: jax.Array, post: jax.Array, comb: jax.Array
                 ) -> jax.Array:
    # The oracle's arithmetic (weights cast to the streams' dtype, the stream mix a product
    # summed in float32 and rounded once, then the bf16 add), written elementwise over the hc
    # streams: XLA fuses it into one pass over them, where a batched 4 x 4 dot is a GEMM
    # fusion several times slower on the H200 (docs/performance-log.md).
    dtype = streams.dtype
    weights = rounded_to(comb.astype(jnp.float32), dtype)      # (a cast pair: dropped on a GPU)
    mixed = sum(weights[..., j, :, None] * streams[..., j, None, :].astype(jnp.float32)
                for j in range(streams.shape[-2]))                            # [..., hc, D]
    return post.astype(dtype)[..., None] * block_out[..., None, :] + mixed.astype(dtype)


def hc_head(streams: jax.Array, p: HyperHeadParams, *, hc_eps: float, norm_eps: float,
            compute: ComputeConfig) -> jax.Array:
    """Final collapse of the streams [..., hc, D] -> [..., D] (sigmoid weights, no Sinkhorn).
    Its rows are the step's sequences: in batch-invariant mode their norm is an ordered sum,
    which keeps its order however XLA groups the row tiles they run in
    (invariant.per_sequence); a reduction's split follows the row count."""
    mixes = _mixes(streams, p.fn, norm_eps, compute, p.fn_parts,
                   ordered=compute.batch_invariant)
    pre = jax.nn.sigmoid(mixes * p.scale[0] + p.base) + hc_eps
    return collapse(pre, streams, compute.batch_invariant).astype(streams.dtype)
