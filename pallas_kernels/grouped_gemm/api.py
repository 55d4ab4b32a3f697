"""The grouped GEMM: implementation tables ("mosaic_gpu", "interpret", "dense", "reference").

`grouped_matmul(lhs, rhs, group_sizes, ...)` is reference.grouped_matmul's contract (rows
sorted by group). On the kernel path the rows are laid out in whole tiles per group
(layout.py), multiplied, and gathered back. `expert_mlp` chains the gate/up GEMM (SwiGLU in
its epilogue) and the down GEMM in that tiled layout, so the intermediate is never re-laid.
The batch-invariant mode's dense GEMM (the same kernel on one group) is in invariant.py.

FP4 weights (`quantized.Fp4Blocks`, the released routed experts' format) take the same
entry points: the jnp forms dequantize them first (`quantized.dequantize`), the kernel names run
mosaic_gpu_fp4.py, which dequantizes as it reads.

The kernels raise NotSupported for shapes they cannot tile (K or N not a multiple of their
blocks, as in tiny test models) and dtypes other than 16-bit floats. "dense" is the jnp form
for launch-bound devices (one einsum over every group, for small products; NotSupported for
large ones), "reference" XLA's ragged_dot, which takes everything.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from pallas_kernels import quantized
from pallas_kernels.common import NotSupported, dispatch, kernel_mode
from pallas_kernels.grouped_gemm import (
    fp4_path,
    layout,
    mosaic_gpu,
    mosaic_gpu_persistent,
    mosaic_gpu_rows,
    mosaic_gpu_ws,
    reference,
)
from pallas_kernels.grouped_gemm.mosaic_gpu import TileConfig
from pallas_kernels.grouped_gemm.mosaic_gpu_persistent import PersistentConfig
from pallas_kernels.grouped_gemm.mosaic_gpu_ws import WarpSpecializedConfig

Config = TileConfig | WarpSpecializedConfig | PersistentConfig
Implementation = str | tuple[str, ...]


def default_config(num_rows: int, n_out: int, fp8: bool = False, swiglu: bool = False,
                   warp_specialized: bool = True) -> Config:
    """Small (decode) batches: 64-row tiles, since a hit expert usually has one or two rows
    and the padded layout grows with the tile. Large batches: 128-row tiles, bf16 ones on the
    warp-specialised kernel; on the one-warpgroup kernel the SwiGLU epilogue's two
    accumulators 64 columns each (128 x 128 x 2 f32 accumulators spill). Each choice was
    measured on the H200 (docs/performance-log.md)."""
    if num_rows >= 4096 and warp_specialized and not fp8:
        block_n = next((b for b in ((128, 64) if swiglu else (256, 128)) if n_out % b == 0), 0)
        if block_n:
            return WarpSpecializedConfig(block_n=block_n, block_k=64,
                                         max_concurrent_steps=4 if swiglu else 3)
    if num_rows < 4096:
        block_m, widths, steps = 64, (128, 64, 32, 16), 4
    else:
        block_m, widths, steps = 128, ((64, 32, 16) if swiglu else (128, 64, 32, 16)), 6
    if fp8:
        widths = tuple(w for w in widths if w in (64, 128))
    block_n = next((b for b in widths if n_out % b == 0), 0)
    return TileConfig(block_m=block_m, block_n=block_n, max_concurrent_steps=steps)


# Decode-sized products with few output columns (an FP8 projection at M = 16: 4096 -> 512 is
# 4 programs of 128 columns) leave most SMs idle, each program streaming its whole K alone.
# Splitting K into ranges (f32 partials, summed after) until the grid has this many programs
# puts the weight's bytes in flight on every SM (two programs per SM fit in shared memory);
# a range keeps at least MIN_SPLIT_K of K (4 pipeline steps of 64). 256 programs: the best
# split of each of V4-Flash's larger FP8 projections at M = 16 on the H200 gave that many
# (docs/performance-log.md, bench/kernels_fp8.py).
TARGET_PROGRAMS = 256
MIN_SPLIT_K = 256


def split_for_small_batches(config: Config, tiles: int, k: int, n_out: int) -> Config:
    """config with K split so that `tiles` row tiles fill the GPU (unchanged where they
    already do, or where the config is not the one-warpgroup kernel's). Not batch-invariant
    (the ranges follow M): the batch-invariant mode's K split is invariant.py's."""
    if not isinstance(config, TileConfig) or not config.block_n or n_out % config.block_n:
        return config
    splits = 1
    while tiles * (n_out // config.block_n) * splits < TARGET_PROGRAMS \
            and k % (2 * splits * config.block_k) == 0 and k // (2 * splits) >= MIN_SPLIT_K:
        splits *= 2
    return dataclasses.replace(config, split_k=splits) if splits > 1 else config


KERNEL_DTYPES = (jnp.bfloat16, jnp.float16)   # wgmma's 16-bit inputs (f32 would run as tf32)


def kernel_fits(k: int, n_out: int, config: Config, fp8: bool, dtype=jnp.bfloat16) -> bool:
    if jnp.dtype(dtype) not in KERNEL_DTYPES:
        return False
    try:
        config.check(k, n_out, fp8)
    except ValueError:
        return False
    return True


def _check_fits(k: int, n_out: int, config: Config, fp8: bool, dtype) -> None:
    if not kernel_fits(k, n_out, config, fp8, dtype):
        raise NotSupported(f"K={k}, N={n_out}, {jnp.dtype(dtype)} with {config}")


def grouped_matmul(lhs: jax.Array, rhs: jax.Array | quantized.Fp4Blocks,
                   group_sizes: jax.Array, *,
                   rhs_scale: jax.Array | None = None, swiglu_limit: float | None = None,
                   implementation: Implementation = "reference",
                   config: Config | None = None) -> jax.Array:
    """lhs [M, K] rows sorted by group, rhs [G, K, N] (or Fp4Blocks of that shape),
    group_sizes i32[G] -> [M, N] ([M, N/2] with swiglu_limit). config: the kernels' tile config
    (default_config's if None; for FP4 weights a mosaic_gpu_fp4.Fp4Config)."""
    return dispatch("grouped_gemm", _MATMUL, implementation, lhs, rhs, group_sizes,
                    rhs_scale=rhs_scale, swiglu_limit=swiglu_limit, config=config)


def _matmul_kernel(lhs, rhs, group_sizes, *, rhs_scale, swiglu_limit, config, interpret):
    if isinstance(rhs, quantized.Fp4Blocks):
        return fp4_path.grouped_matmul(lhs, rhs, group_sizes, swiglu_limit=swiglu_limit,
                                       config=config, interpret=interpret)
    n_out = rhs.shape[2] // (2 if swiglu_limit is not None else 1)
    if config is None:
        config = default_config(lhs.shape[0], n_out, rhs_scale is not None,
                                swiglu_limit is not None)
        if swiglu_limit is None and lhs.shape[0] < 4096:
            tiles = layout.max_tiles(lhs.shape[0], group_sizes.shape[0], config.block_m)
            config = split_for_small_batches(config, tiles, lhs.shape[1], n_out)
    _check_fits(lhs.shape[1], n_out, config, rhs_scale is not None, lhs.dtype)
    with kernel_mode(interpret):
        tiles = layout.tile_layout(group_sizes, lhs.shape[0], config.block_m)
        return _tiled(_rows_to_tiles(lhs, tiles, config.block_m), rhs, tiles, rhs_scale,
                      swiglu_limit, config, sorted_rows=lhs.shape[0])


def _matmul_jnp(lhs, rhs, group_sizes, *, rhs_scale, swiglu_limit, config, dense):
    rhs = quantized.dequantize(rhs, lhs.dtype)
    if dense and lhs.shape[0] * rhs.shape[0] * rhs.shape[2] > reference.DENSE_PRODUCTS:
        raise NotSupported("too many products for the dense form")
    return reference.grouped_matmul(lhs, rhs, group_sizes, rhs_scale=rhs_scale,
                                    swiglu_limit=swiglu_limit, dense=dense)


_MATMUL = {
    "mosaic_gpu": functools.partial(_matmul_kernel, interpret=False),
    "interpret": functools.partial(_matmul_kernel, interpret=True),
    "dense": functools.partial(_matmul_jnp, dense=True),
    "reference": functools.partial(_matmul_jnp, dense=False),
}


def batched_config(groups: int, rows: int, k: int, n_out: int, fp8: bool) -> TileConfig:
    """batched_matmul's config: the one-warpgroup kernel's default tiles, K split where the
    row tiles leave the GPU idle (decode)."""
    config = default_config(groups * rows, n_out, fp8, warp_specialized=False)
    if groups * rows >= 4096:
        return config
    return split_for_small_batches(config, groups * -(-rows // config.block_m), k, n_out)


def batched_matmul(lhs: jax.Array, rhs: jax.Array, *, rhs_scale: jax.Array | None = None,
                   implementation: Implementation = "reference",
                   config: TileConfig | None = None) -> jax.Array:
    """lhs [G, M, K] @ rhs [G, K, N] (bf16, or FP8 E4M3 codes with rhs_scale f32[G, K/128,
    N/128]) -> [G, M, N] in lhs's dtype: groups of equal size, so no tile layout (each group's
    rows padded to whole tiles in place). The FP8 dense projections (G = 1) and the
    attention's grouped output projection take it."""
    return dispatch("batched_gemm", _BATCHED, implementation, lhs, rhs, rhs_scale=rhs_scale,
                    config=config)


def _batched_kernel(lhs, rhs, *, rhs_scale, config, interpret):
    groups, rows, k = lhs.shape
    n_out, fp8 = rhs.shape[2], rhs_scale is not None
    config = config or batched_config(groups, rows, k, n_out, fp8)
    _check_fits(k, n_out, config, fp8, lhs.dtype)
    with kernel_mode(interpret):
        padded = jnp.pad(lhs, ((0, 0), (0, -rows % config.block_m), (0, 0)))
        tile_group = jnp.repeat(jnp.arange(groups, dtype=jnp.int32),
                                padded.shape[1] // config.block_m)
        out = mosaic_gpu.tiled_group_matmul(padded.reshape(-1, k), rhs, tile_group, rhs_scale,
                                            config=config)
        if config.split_k > 1:          # the K ranges' f32 partial sums
            out = out.sum(axis=0).astype(lhs.dtype)
        return out.reshape(groups, -1, n_out)[:, :rows]


def _batched_jnp(lhs, rhs, *, rhs_scale, config):
    if rhs_scale is not None:
        rhs = reference.dequantize(rhs, rhs_scale, lhs.dtype)
    out = jnp.einsum("gmk,gkn->gmn", lhs, rhs, preferred_element_type=jnp.float32)
    return out.astype(lhs.dtype)


_BATCHED = {
    "mosaic_gpu": functools.partial(_batched_kernel, interpret=False),
    "interpret": functools.partial(_batched_kernel, interpret=True),
    "reference": _batched_jnp,
}


def expert_mlp(x: jax.Array, w13: jax.Array | quantized.Fp4Blocks,
               w2: jax.Array | quantized.Fp4Blocks, group_sizes: jax.Array,
               swiglu_limit: float, *, w13_scale: jax.Array | None = None,
               w2_scale: jax.Array | None = None, implementation: Implementation = "reference",
               configs: tuple[Config, Config] | None = None, source_rows: jax.Array | None = None,
               out_order: jax.Array | None = None, invariant: bool = False) -> jax.Array:
    """Each row through its group's clamped-SwiGLU expert: x [M, D] sorted by group,
    w13 [G, D, 2I] (gate | up), w2 [G, I, D] -> [M, D] in x's dtype; both may be Fp4Blocks
    (w13 stored [G, 2I, D/2], gate rows first). configs: the gate/up and down kernels' (their
    tiles must have the same rows).

    source_rows i32[M]: x is [N, D] and sorted row i is x[source_rows[i]]; out_order i32[M]:
    row j of the result is sorted row out_order[j]. The routed experts pass both (tokens in,
    (token, slot) pairs out), and on the kernel path the rows then move straight between x,
    the tiles and the result, without sorted copies in between.

    invariant: a row's result must not depend on the batch. The kernels' rows never do
    (wgmma sums a row the same way whatever the tile's shape or the row's place in it); the
    jnp forms then run each row on its own."""
    return dispatch("expert_mlp", _EXPERT_MLP, implementation, x, w13, w2, group_sizes,
                    swiglu_limit, w13_scale=w13_scale, w2_scale=w2_scale, configs=configs,
                    source_rows=source_rows, out_order=out_order, invariant=invariant)


def _expert_mlp_kernel(x, w13, w2, group_sizes, swiglu_limit, *, w13_scale, w2_scale,
                       configs, source_rows, out_order, invariant, interpret):
    if isinstance(w13, quantized.Fp4Blocks) or isinstance(w2, quantized.Fp4Blocks):
        return fp4_path.expert_mlp(x, w13, w2, group_sizes, swiglu_limit, configs=configs,
                                   source_rows=source_rows, out_order=out_order,
                                   interpret=interpret)
    rows = x.shape[0] if source_rows is None else source_rows.shape[0]
    dim, inter = x.shape[1], w2.shape[1]
    fp8 = w13_scale is not None
    up_cfg, down_cfg = configs or (default_config(rows, inter, fp8, swiglu=True),
                                   default_config(rows, dim, fp8))
    if up_cfg.block_m != down_cfg.block_m:
        raise ValueError("the gate/up and down kernels must tile the same rows")
    _check_fits(dim, inter, up_cfg, fp8, x.dtype)
    _check_fits(inter, dim, down_cfg, fp8, x.dtype)
    with kernel_mode(interpret):
        tiles = layout.tile_layout(group_sizes, rows, up_cfg.block_m)
        if source_rows is None:
            tiled = _rows_to_tiles(x, tiles, up_cfg.block_m)
        elif tiles.tile_group.shape[0] * up_cfg.block_m >= SPARSE_TILES * rows:
            tiled = _rows_to_tiles(x[source_rows], tiles, up_cfg.block_m)
        else:
            tiled = layout.gather_to_tiles(x, source_rows, tiles, up_cfg.block_m)
        hidden = _tiled(tiled, w13, tiles, w13_scale, swiglu_limit, up_cfg)
        if out_order is None:
            return _tiled(hidden, w2, tiles, w2_scale, None, down_cfg, sorted_rows=rows)
        return layout.from_tiles(_tiled(hidden, w2, tiles, w2_scale, None, down_cfg), tiles,
                                 out_order)


def _expert_mlp_jnp(x, w13, w2, group_sizes, swiglu_limit, *, w13_scale, w2_scale, configs,
                    source_rows, out_order, invariant, dense):
    sorted_x = x if source_rows is None else x[source_rows]
    w13, w2 = quantized.dequantize(w13, x.dtype), quantized.dequantize(w2, x.dtype)
    if invariant:
        if dense:
            raise NotSupported("batch-invariant mode runs rows one by one")
        if w13_scale is not None:
            w13 = reference.dequantize(w13, w13_scale, x.dtype)
            w2 = reference.dequantize(w2, w2_scale, x.dtype)
        out = reference.expert_rows_one_by_one(sorted_x, w13, w2, group_sizes, swiglu_limit)
    else:   # the dense form where each product is small enough (each GEMM decides)
        def small(rows, w):
            return dense and rows.shape[0] * w.shape[0] * w.shape[2] <= reference.DENSE_PRODUCTS

        hidden = reference.grouped_matmul(sorted_x, w13, group_sizes, rhs_scale=w13_scale,
                                          swiglu_limit=swiglu_limit, dense=small(sorted_x, w13))
        out = reference.grouped_matmul(hidden, w2, group_sizes, rhs_scale=w2_scale,
                                       dense=small(hidden, w2))
    return out if out_order is None else out[out_order]


_EXPERT_MLP = {
    "mosaic_gpu": functools.partial(_expert_mlp_kernel, interpret=False),
    "interpret": functools.partial(_expert_mlp_kernel, interpret=True),
    "dense": functools.partial(_expert_mlp_jnp, dense=True),
    "reference": functools.partial(_expert_mlp_jnp, dense=False),
}


# Tokens in (source_rows): a gather straight into the tiles writes every possible tile's rows,
# used or not. A decode bucket's layout has room for far more tiles than it fills (16 tokens x
# top-6: 96 rows, room for 96 tiles of 64 = 6144 rows, a 50 MB gather a layer at V4-Flash's
# hidden size). Where the tiles' room is this many times the rows, the rows are gathered in
# sorted order first (M rows) and copied into their tiles by TMA (the used tiles' rows only);
# a prefill's tiles are mostly full, and the one gather is cheaper there.
SPARSE_TILES = 4


def _rows_to_tiles(rows: jax.Array, tiles: layout.TileLayout, block_m: int) -> jax.Array:
    """Sorted rows into whole tiles: by TMA in row pieces (each group's rows read once, the
    padding left unwritten) where K allows, else the jnp layout (a zeroed buffer, a scatter)."""
    block_k = next((b for b in (256, 128, 64) if rows.shape[1] % b == 0), 0)
    if not block_k:
        return layout.to_tiles(rows, tiles, block_m)
    return mosaic_gpu_rows.copy_to_tiles(rows, tiles.tile_first_row, tiles.tile_rows,
                                         tiles=tiles.tile_group.shape[0], block_m=block_m,
                                         block_k=block_k)


def _tiled(lhs, rhs, tiles: layout.TileLayout, rhs_scale, swiglu_limit,
           config: Config, sorted_rows: int | None = None) -> jax.Array:
    """The kernel on tiled rows -> tiled rows, or with sorted_rows=M the M sorted rows (the
    warp-specialised kernel stores them so itself; the others' tiles are gathered back)."""
    if isinstance(config, WarpSpecializedConfig):
        first_row = None if sorted_rows is None else tiles.tile_first_row
        return mosaic_gpu_ws.tiled_group_matmul(lhs, rhs, tiles.tile_group, tiles.tile_rows,
                                                first_row, swiglu_limit=swiglu_limit,
                                                config=config, sorted_rows=sorted_rows)
    if isinstance(config, PersistentConfig):
        out = mosaic_gpu_persistent.tiled_group_matmul(lhs, rhs, tiles.tile_group,
                                                       tiles.tile_rows,
                                                       swiglu_limit=swiglu_limit, config=config)
    else:
        out = mosaic_gpu.tiled_group_matmul(lhs, rhs, tiles.tile_group, rhs_scale,
                                            swiglu_limit=swiglu_limit, config=config)
        if config.split_k > 1:          # the K ranges' f32 partial sums
            out = out.sum(axis=0).astype(lhs.dtype)
    return out if sorted_rows is None else layout.from_tiles(out, tiles)
