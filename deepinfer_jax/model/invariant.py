"""Batch-invariant building blocks: results per row that do not depend on the batch.

A compiler picks a matmul's algorithm (and its reduction order) from the operand shapes, and
XLA fuses differently as shapes change, so a row's result can change with the number of rows
next to it. In batch-invariant mode every matmul-like op is invariant by itself: the Pallas
GEMM kernel by construction (fixed K tiles; K split only into ranges fixed by the weight's
shape), the jnp paths in fixed-size row tiles run one after the other. Elementwise ops are
per row already on a GPU, and so are the per-token segments' row reductions between steps of
one token bucket; on the CPU whole segments run in row tiles (ComputeConfig.tile_segments).
Work over a step's sequences rather than its tokens (the sampled rows' head and sampler, the
compressor's closed rows) has a row count that follows the engine's size, min(bucket, slots),
and XLA's GPU row reductions may round a row by the rows beside it: that work runs in row
tiles (`per_sequence`) or sums in a fixed order (`ordered_sum`) on every device.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from deepinfer_jax.config.compute import ComputeConfig
from pallas_kernels.common import NotSupported, in_row_tiles, ordered_sum
from pallas_kernels.grouped_gemm import api as gemm
from pallas_kernels.grouped_gemm import invariant as invariant_gemm
from pallas_kernels.quantized import Fp8Blocks, dequantize, kernel_blocks


def per_row_tiles(fn: Callable, *args, tile: int):
    """Apply fn (row-wise: pytrees of [tile, ...] -> pytree of [tile, ...]) to fixed-size tiles
    of the leading axis of every array in `args`, one tile after the other."""
    return in_row_tiles(fn, tile, *args)


def whole_batch(fn: Callable, *args):
    return fn(*args)


def sealed_row_tiles(fn: Callable, *args, tile: int):
    """per_row_tiles with each tile's program between optimization barriers. Rows that fit one
    tile make a loop of one trip, which XLA removes, fusing the tile's program with the
    padding around it: a step padded to the tile and one that fills it would compile the same
    rows' arithmetic differently, which a GPU compiler may round differently. Sealed, the
    tile's program compiles alone, the same in every step."""
    barrier = jax.lax.optimization_barrier
    return in_row_tiles(lambda *rows: barrier(fn(*barrier(rows))), tile, *args)


def rowwise(compute: ComputeConfig) -> Callable:
    """How a row-wise computation runs: tile by tile in batch-invariant mode (each tile
    sealed where launches are dear: the GPU formulation), else at once."""
    if not compute.batch_invariant:
        return whole_batch
    tiles = sealed_row_tiles if compute.launch_bound else per_row_tiles
    return functools.partial(tiles, tile=compute.invariant_tile)


def unrolled_row_tiles(fn: Callable, *args, tile: int):
    """per_row_tiles without a loop: the tiles are separate copies of fn's program (a loop's
    iteration is launches of its own on a GPU, and one tile is one copy).

    Each copy's inputs and outputs pass an optimization barrier, so that XLA keeps the copies
    apart: its slice sinking may merge them back into one computation over all the rows, whose
    reductions it splits by the row count, as it split the head's sums when they ran over the
    whole batch (the 8- and 32-slot engines' HLO in session 50, before the head's tiles)."""
    rows = jax.tree.leaves(args)[0].shape[0]
    pad = -rows % tile
    padded = jax.tree.map(lambda a: jnp.pad(a, [(0, pad)] + [(0, 0)] * (a.ndim - 1)), args)
    barrier = jax.lax.optimization_barrier
    outs = [barrier(fn(*barrier(jax.tree.map(lambda a, i=i: a[i: i + tile], padded))))
            for i in range(0, rows + pad, tile)]
    return jax.tree.map(lambda *o: jnp.concatenate(o)[:rows], *outs)


def per_sequence(compute: ComputeConfig) -> Callable:
    """How work over a step's sequences rather than its tokens runs (the sampled rows' head and
    sampler, the speculative step's verify and draft rows): their count follows the engine's
    size, min(bucket, slots), so in batch-invariant mode they run in fixed row tiles on every
    device, unrolled where launches are dear (a decode batch up to a tile is one copy)."""
    if not compute.batch_invariant:
        return whole_batch
    tiles = unrolled_row_tiles if compute.launch_bound else per_row_tiles
    return functools.partial(tiles, tile=compute.invariant_tile)


# Tiles of a row tile's program up to which `per_closed_row` unrolls copies on a GPU (decode
# and small chunks); beyond, the rows run at once, padded to a multiple of that many tiles.
UNROLLED_TILES = 4


def per_closed_row(compute: ComputeConfig) -> Callable:
    """How the compressors' newly closed rows are pooled and finished (paged_compressor.py).
    Their count, T // rate + N, follows the engine's slot count N, and a GPU compiler fuses
    the elementwise work around their ordered sums by that count (an 8- and a 32-slot step
    compiled for the H200 fused it differently, docs/batch_invariance.md). In batch-invariant
    mode where launches are dear, up to UNROLLED_TILES row tiles run as per_sequence's
    unrolled copies of one tile's program, the same in every engine; more rows (a long
    chunk's T // rate) run at once, padded to a multiple of UNROLLED_TILES tiles and sealed
    by optimization barriers, so that engines whose counts round alike compile them alike,
    with no loop and no copies by the hundred. Elsewhere it is the per-token segments' rule,
    row tiles in a loop (the CPU formulation) or the whole batch (the default mode)."""
    if not compute.batch_invariant:
        return whole_batch
    if not compute.launch_bound:
        return rowwise(compute)
    tile = compute.invariant_tile

    def tiles(fn: Callable, *args):
        rows, granule = jax.tree.leaves(args)[0].shape[0], UNROLLED_TILES * tile
        return unrolled_row_tiles(fn, *args,
                                  tile=tile if rows <= granule else -(-rows // granule) * granule)
    return tiles


def segments(compute: ComputeConfig) -> Callable:
    """How a per-token segment of the layer (projections, norms, mixing) runs: in row tiles
    only where its elementwise code is not invariant by itself (the CPU formulation)."""
    return rowwise(compute) if compute.tile_segments else whole_batch


def linear(x: jax.Array, w: jax.Array, compute: ComputeConfig, out_dtype=None,
           k_ranges: int | None = None) -> jax.Array:
    """x [..., K] @ w [K, N], the result in out_dtype (default: the operands' type). With
    out_dtype float32 and bf16 operands this is a float32 matmul of them (each product is
    exact in float32, the sum is float32) without converting w first. Float32 operands are
    multiplied in float32: a GPU's default for them is TF32 (10-bit mantissas), which the
    reference model, torch with TF32 off, does not use.

    w may be FP8 (Fp8Blocks): the GEMM kernel dequantizes it tile by tile as it reads
    (fp8_linear); where no kernel takes it, it is dequantized in the step first.
    k_ranges: batch-invariant mode's K split for this weight (invariant_gemm.matmul), a
    function of its shape; the default mode's one product has no ranges to fix."""
    if isinstance(w, Fp8Blocks):
        return fp8_linear(x, w, compute, out_dtype)
    if not compute.batch_invariant:
        precision = jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
        return jnp.matmul(x, w, preferred_element_type=out_dtype, precision=precision)
    flat = x.reshape(-1, x.shape[-1])
    out = invariant_gemm.matmul(flat, w, implementation=compute.kernels.grouped_gemm,
                                out_dtype=out_dtype, row_tile=compute.invariant_tile,
                                k_ranges=k_ranges)
    return out.reshape(*x.shape[:-1], w.shape[-1])


def _fp8_kernels(compute: ComputeConfig) -> tuple[str, ...]:
    return tuple(name for name in compute.kernels.grouped_gemm if name not in ("dense", "reference"))


def fp8_linear(x: jax.Array, w: Fp8Blocks, compute: ComputeConfig, out_dtype=None) -> jax.Array:
    """x [..., K] @ FP8 w [K, N]: the GEMM kernel on one group (it reads the E4M3
    codes and their block scales), else the dequantized weight through `linear`. Batch-
    invariant mode takes the latter (its dense GEMM reads 16-bit weights only), and so do
    blocks other than the kernels' 128 x 128 (V4.1's 32 x 32)."""
    kernels = _fp8_kernels(compute)
    if kernels and not compute.batch_invariant and kernel_blocks(w):
        flat = x.reshape(1, -1, x.shape[-1])
        try:
            out = gemm.batched_matmul(flat, w.codes[None], rhs_scale=w.scale[None],
                                      implementation=kernels)
            return out.reshape(*x.shape[:-1], w.shape[-1]).astype(out_dtype or x.dtype)
        except NotSupported:
            pass
    return linear(x, dequantize(w, x.dtype), compute, out_dtype)


def f32_linear(x: jax.Array, w: jax.Array, compute: ComputeConfig) -> jax.Array:
    """x @ w in float32 (the compressor's and the router's projections, float32 in the
    reference model). With both in bf16 every product is exact in float32 and the sum is
    float32, so it is the same quantity as the float32 matmul of their values, without a
    float32 copy of w and on a GPU at bf16 tensor-core speed; otherwise both go to float32."""
    if isinstance(w, Fp8Blocks):
        w = dequantize(w, x.dtype if x.dtype == jnp.bfloat16 else jnp.float32)
    if x.dtype == w.dtype == jnp.bfloat16:
        return linear(x, w, compute, out_dtype=jnp.float32)
    return linear(x.astype(jnp.float32), w.astype(jnp.float32), compute)


def grouped_linear(x: jax.Array, w: jax.Array, compute: ComputeConfig) -> jax.Array:
    """x [..., G, K] @ w [G, K, N] per group g -> [..., G, N] (the attention's grouped
    low-rank output projection): one batched product, not G of them (G launches on a GPU).
    An FP8 w: the grouped GEMM kernel, each group's rows its own group."""
    if isinstance(w, Fp8Blocks):
        kernels = _fp8_kernels(compute)
        if kernels and not compute.batch_invariant and kernel_blocks(w):
            groups, k, n = w.shape
            rows = x.reshape(-1, groups, k).swapaxes(0, 1)                   # [G, M, K]
            try:
                out = gemm.batched_matmul(rows, w.codes, rhs_scale=w.scale,
                                          implementation=kernels)                # [G, M, N]
                return out.swapaxes(0, 1).reshape(*x.shape[:-1], n)
            except NotSupported:
                pass
        w = dequantize(w, x.dtype)
    if not compute.batch_invariant:
        return jnp.einsum("...gk,gkn->...gn", x, w)
    groups, k, n = w.shape
    flat = x.reshape(-1, groups, k)
    out = invariant_gemm.batched_matmul(flat.swapaxes(0, 1), w,
                                        implementation=compute.kernels.grouped_gemm,
                                        row_tile=compute.invariant_tile).swapaxes(0, 1)
    return out.reshape(*x.shape[:-1], n)


def ordered_softmax(x: jax.Array, axis: int) -> jax.Array:
    """Softmax over `axis` with an ordered sum (the max is exact in any order)."""
    e = jnp.exp(x - jnp.max(x, axis=axis, keepdims=True))
    return e / jnp.expand_dims(ordered_sum(e, axis), axis)
