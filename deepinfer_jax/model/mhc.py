"""Manifold-constrained hyper-connections (mHC): the residual is `hc` parallel streams.

Each sublayer reads one collapsed input (`pre`-weighted sum of the streams) and writes back
`post_k * f + sum_j comb[j, k] * X_j`, where `comb` is pushed towards a doubly-stochastic
matrix by Sinkhorn iterations. All mixing math is float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from deepinfer_jax.model.invariant import linear, ordered_sum, per_row_tiles
from deepinfer_jax.model.norms import unweighted_rms_norm
from deepinfer_jax.model.params import HyperConnectionParams, HyperHeadParams
from pallas_kernels.common import launch_bound
from pallas_kernels.sinkhorn import api as sinkhorn_kernel


def _mixes(streams: jax.Array, fn: jax.Array, eps: float, invariant: bool) -> jax.Array:
    """streams [..., hc, D] -> f32[..., n_mix]: a linear map of the RMS-normalised flat streams.

    bf16 streams (the default mode): the norm is one factor per token, so it is applied to
    the n_mix sums instead of the hc * D inputs, and the float32 weight is split into three
    bf16 parts (hi + mid + lo holds its 24-bit mantissa) so the projection is one bf16 GEMM
    with float32 sums of exact products: float32 accuracy, without a float32 copy of the
    streams or a float32 GEMM (on the H200 an 8k-token prefill's took 0.93 ms per sublayer,
    at HIGHEST precision, plus 0.6 ms writing the normalised copy; this reads the streams
    twice). The batch-invariant mode keeps the form proven invariant on the H200."""
    flat = streams.reshape(*streams.shape[:-2], -1)
    if invariant or flat.dtype != jnp.bfloat16:
        return linear(unweighted_rms_norm(flat.astype(jnp.float32), eps), fn, invariant)
    parts = bf16_parts(fn.astype(jnp.float32))                              # [3, K, n_mix]
    n_mix = fn.shape[-1]
    sums = jnp.matmul(flat, jnp.concatenate(parts, axis=-1), preferred_element_type=jnp.float32)
    projected = (sums[..., :n_mix] + sums[..., n_mix:2 * n_mix]) + sums[..., 2 * n_mix:]
    x32 = flat.astype(jnp.float32)
    return projected * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)


def bf16_parts(w: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """f32 w -> bf16 (hi, mid, lo) with hi + mid + lo = w (8 + 8 + 8 mantissa bits). Each
    part is cut from the remainder by masking its low 16 bits, not by rounding to bf16: XLA's
    GPU compiler, allowed excess precision, folds a float32 -> bf16 -> float32 round trip
    away (the remainder was then 0 and the projection bf16-accurate, on the H200)."""
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


def sinkhorn(comb_logits: jax.Array, iters: int, eps: float, unrolled: bool) -> jax.Array:
    """f32[..., hc, hc] -> near doubly-stochastic: row softmax, then alternate column/row scaling
    (1 softmax + `iters` column and `iters - 1` row normalisations).

    Two formulations of the same arithmetic. `unrolled`: elementwise adds over the hc (4)
    entries (pallas_kernels/sinkhorn: the jnp reference, or one kernel launch), which XLA fuses
    into about a kernel per iteration; as a loop of reductions the GPU ran ~5 launches per
    iteration (19 x 2 per layer), most of a small-batch decode step's time (H200, tiny model:
    16.7 -> 6.6 ms per step). On the CPU launches are cheap and the loop compiles twice as
    fast; and there XLA's vectorised elementwise code gives a row different last bits in
    batches of different sizes, so batch-invariant mode keeps the loop (proven invariant on
    the CPU and the H200) unless the kernel runs."""
    if unrolled:
        return sinkhorn_kernel.sinkhorn(comb_logits, iters, eps)
    comb = jax.nn.softmax(comb_logits, axis=-1) + eps
    comb = comb / (jnp.sum(comb, axis=-2, keepdims=True) + eps)

    def row_then_column(_, c):
        c = c / (jnp.sum(c, axis=-1, keepdims=True) + eps)
        return c / (jnp.sum(c, axis=-2, keepdims=True) + eps)

    return jax.lax.fori_loop(0, iters - 1, row_then_column, comb)


def hc_pre(streams: jax.Array, p: HyperConnectionParams, *, hc_eps: float, norm_eps: float,
           sinkhorn_iters: int, invariant: bool = False) -> tuple[jax.Array, jax.Array, jax.Array]:
    """streams [..., hc, D] -> (collapsed [..., D], post f32[..., hc], comb f32[..., hc, hc])."""
    hc = streams.shape[-2]
    mixes = _mixes(streams, p.fn, norm_eps, invariant)
    pre_w, post_w, comb_w = mixes[..., :hc], mixes[..., hc:2 * hc], mixes[..., 2 * hc:]
    pre = jax.nn.sigmoid(pre_w * p.scale[0] + p.base[:hc]) + hc_eps
    post = 2.0 * jax.nn.sigmoid(post_w * p.scale[1] + p.base[hc:2 * hc])
    comb_logits = (comb_w * p.scale[2] + p.base[2 * hc:]).reshape(*comb_w.shape[:-1], hc, hc)
    # In batch-invariant mode the unrolled form only where it is the kernel: the kernel runs
    # every token in its own lanes through the same instructions (row-invariant by
    # construction), XLA's fused jnp chain is not proven so.
    unrolled = launch_bound() and (not invariant or sinkhorn_kernel.kernel_runs(comb_logits))
    comb = sinkhorn(comb_logits, sinkhorn_iters, hc_eps, unrolled)
    return collapse(pre, streams, invariant).astype(streams.dtype), post, comb


def hc_post(block_out: jax.Array, streams: jax.Array, post: jax.Array, comb: jax.Array,
            invariant: bool = False) -> jax.Array:
    """X'_k = post_k * f + sum_j comb[j, k] X_j.  block_out [..., D], streams [..., hc, D]."""
    if invariant:   # per token: [T', D], [T', hc, D], [T', hc], [T', hc, hc]
        n = block_out.ndim - 1
        rows = [a.reshape(-1, *a.shape[n:]) for a in (block_out, streams, post, comb)]
        return per_row_tiles(hc_post, *rows).reshape(streams.shape)
    # The oracle's arithmetic (weights cast to the streams' dtype, the stream mix a product
    # summed in float32 and rounded once, then the bf16 add), written elementwise over the hc
    # streams: XLA fuses it into one pass over them, where the batched 4 x 4 dot was a GEMM
    # fusion taking 0.63 ms per sublayer at 8k tokens on the H200 (~4x that pass).
    dtype = streams.dtype
    weights = comb.astype(dtype).astype(jnp.float32)
    mixed = sum(weights[..., j, :, None] * streams[..., j, None, :].astype(jnp.float32)
                for j in range(streams.shape[-2]))                            # [..., hc, D]
    return post.astype(dtype)[..., None] * block_out[..., None, :] + mixed.astype(dtype)


def hc_head(streams: jax.Array, p: HyperHeadParams, *, hc_eps: float, norm_eps: float,
            invariant: bool = False) -> jax.Array:
    """Final collapse of the streams [..., hc, D] -> [..., D] (sigmoid weights, no Sinkhorn)."""
    mixes = _mixes(streams, p.fn, norm_eps, invariant)
    pre = jax.nn.sigmoid(mixes * p.scale[0] + p.base) + hc_eps
    return collapse(pre, streams, invariant).astype(streams.dtype)
