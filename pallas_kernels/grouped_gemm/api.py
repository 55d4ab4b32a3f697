"""Grouped GEMM dispatch: the Mosaic GPU kernel or the jnp reference, same contract.

`grouped_matmul(lhs, rhs, group_sizes, ...)` is reference.grouped_matmul's contract (rows
sorted by group). On the kernel path the rows are laid out in whole tiles per group
(layout.py), multiplied, and gathered back. `expert_mlp` chains the gate/up GEMM (SwiGLU in
its epilogue) and the down GEMM in that tiled layout, so the intermediate is never re-laid.
`matmul(x, w)` is the batch-invariant dense GEMM: the same kernel with one group, so a row's
result never depends on the number of rows.

Shapes the kernel cannot tile (K or N not a multiple of its blocks, as in tiny test models)
take the reference path; `kernel_runs(...)` says which path a shape gets.
"""

from __future__ import annotations

import contextlib
import os

import jax
import jax.numpy as jnp

from pallas_kernels.common import gpu_interpret, implementation
from pallas_kernels.grouped_gemm import layout, mosaic_gpu, mosaic_gpu_ws, reference
from pallas_kernels.grouped_gemm.mosaic_gpu import TileConfig
from pallas_kernels.grouped_gemm.mosaic_gpu_ws import WarpSpecializedConfig

Config = TileConfig | WarpSpecializedConfig

# tests/kernels passed on the H200 (2026-11-29): the kernel is the default on SM90+ GPUs.
VALIDATED_ON_GPU = True


def default_config(num_rows: int, n_out: int, fp8: bool = False,
                   swiglu: bool = False) -> TileConfig:
    """Measured on the H200 (bench/results/kernels-moe-gpu.md). Small (decode) batches:
    64-row tiles, since a hit expert usually has one or two rows and the padded layout grows
    with the tile. Large batches: 128-row tiles; with the SwiGLU epilogue's two accumulators
    64 columns each (128 x 128 x 2 f32 accumulators spill: 111 vs 267 TFLOP/s)."""
    if num_rows < 4096:
        block_m, widths, steps = 64, (128, 64, 32, 16), 4
    else:
        block_m, widths, steps = 128, ((64, 32, 16) if swiglu else (128, 64, 32, 16)), 6
    if fp8:
        widths = tuple(w for w in widths if w in (64, 128))
    block_n = next((b for b in widths if n_out % b == 0), 0)
    return TileConfig(block_m=block_m, block_n=block_n, max_concurrent_steps=steps)


KERNEL_DTYPES = (jnp.bfloat16, jnp.float16)   # wgmma's 16-bit inputs (f32 would run as tf32)


def kernel_fits(k: int, n_out: int, config: Config, fp8: bool, dtype=jnp.bfloat16) -> bool:
    if jnp.dtype(dtype) not in KERNEL_DTYPES:
        return False
    try:
        config.check(k, n_out, fp8)
    except ValueError:
        return False
    return True


def kernel_runs(num_rows: int, k: int, n_out: int, fp8: bool = False,
                impl: str | None = None, dtype=jnp.bfloat16, config: Config | None = None) -> bool:
    """Whether grouped_matmul takes the kernel path for this shape and dtype (and config,
    default_config's if None)."""
    impl = impl or implementation(VALIDATED_ON_GPU, "grouped_gemm")
    config = config or default_config(num_rows, n_out, fp8)
    return impl != "reference" and kernel_fits(k, n_out, config, fp8, dtype)


def grouped_matmul(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *,
                   rhs_scale: jax.Array | None = None, swiglu_limit: float | None = None,
                   impl: str | None = None, config: Config | None = None) -> jax.Array:
    """lhs [M, K] rows sorted by group, rhs [G, K, N], group_sizes i32[G] -> [M, N]
    ([M, N/2] with swiglu_limit). impl: "reference", "mosaic_gpu" or "interpret"; config:
    the one-warpgroup kernel's TileConfig or the warp-specialised kernel's config."""
    impl = impl or implementation(VALIDATED_ON_GPU, "grouped_gemm")
    n_out = rhs.shape[2] // (2 if swiglu_limit is not None else 1)
    config = config or default_config(lhs.shape[0], n_out, rhs_scale is not None,
                                      swiglu_limit is not None)
    if impl == "reference" or not kernel_fits(lhs.shape[1], n_out, config,
                                              rhs_scale is not None, lhs.dtype):
        return reference.grouped_matmul(lhs, rhs, group_sizes, rhs_scale=rhs_scale,
                                        swiglu_limit=swiglu_limit)
    with _mode(impl):
        tiles = layout.tile_layout(group_sizes, lhs.shape[0], config.block_m)
        out = _tiled(layout.to_tiles(lhs, tiles, config.block_m), rhs, tiles.tile_group,
                     rhs_scale, swiglu_limit, config)
        return layout.from_tiles(out, tiles)


def expert_mlp(x: jax.Array, w13: jax.Array, w2: jax.Array, group_sizes: jax.Array,
               swiglu_limit: float, *, w13_scale: jax.Array | None = None,
               w2_scale: jax.Array | None = None, impl: str | None = None,
               configs: tuple[Config, Config] | None = None, source_rows: jax.Array | None = None,
               out_order: jax.Array | None = None) -> jax.Array:
    """Each row through its group's clamped-SwiGLU expert: x [M, D] sorted by group,
    w13 [G, D, 2I] (gate | up), w2 [G, I, D] -> [M, D] in x's dtype. configs: the gate/up
    and down kernels' (their tiles must have the same rows).

    source_rows i32[M]: x is [N, D] and sorted row i is x[source_rows[i]]; out_order i32[M]:
    row j of the result is sorted row out_order[j]. The routed experts pass both (tokens in,
    (token, slot) pairs out), and on the kernel path the rows then move straight between x,
    the tiles and the result, without sorted copies in between."""
    impl = impl or implementation(VALIDATED_ON_GPU, "grouped_gemm")
    rows = x.shape[0] if source_rows is None else source_rows.shape[0]
    dim, inter = x.shape[1], w2.shape[1]
    fp8 = w13_scale is not None
    up_cfg, down_cfg = configs or (default_config(rows, inter, fp8, swiglu=True),
                                   default_config(rows, dim, fp8))
    if up_cfg.block_m != down_cfg.block_m:
        raise ValueError("the gate/up and down kernels must tile the same rows")
    if (impl == "reference" or not kernel_fits(dim, inter, up_cfg, fp8, x.dtype)
            or not kernel_fits(inter, dim, down_cfg, fp8, x.dtype)):
        sorted_x = x if source_rows is None else x[source_rows]
        hidden = reference.grouped_matmul(sorted_x, w13, group_sizes, rhs_scale=w13_scale,
                                          swiglu_limit=swiglu_limit)
        out = reference.grouped_matmul(hidden, w2, group_sizes, rhs_scale=w2_scale)
        return out if out_order is None else out[out_order]
    with _mode(impl):
        tiles = layout.tile_layout(group_sizes, rows, up_cfg.block_m)
        tiled = (layout.to_tiles(x, tiles, up_cfg.block_m) if source_rows is None else
                 layout.gather_to_tiles(x, source_rows, tiles, up_cfg.block_m))
        hidden = _tiled(tiled, w13, tiles.tile_group, w13_scale, swiglu_limit, up_cfg)
        out = _tiled(hidden, w2, tiles.tile_group, w2_scale, None, down_cfg)
        return layout.from_tiles(out, tiles, out_order)


# Batch-invariant configs. Every config sums a row's K in the same order (block_k 64; K split
# only by the weight's shape, invariant_split_k). wgmma's per-element sums also ignore the
# tile's shape (block_m, block_n) and a row's place in its tile:
# test_rows_do_not_depend_on_the_tile_shape passed on the H200 (2026-11-30,
# bench/results/gpu-tests.md). So small batches take narrower tiles, enough
# programs to fill the SMs (dense_invariant_config): with 128-column tiles a decode batch's
# 4096 -> 512 projection ran on 4 of 132 SMs. DEEPINFER_INVARIANT_FREE_TILES=0 restores the
# configs that depend on N only (for comparison).
TILE_SHAPE_FREE_ON_GPU = os.environ.get("DEEPINFER_INVARIANT_FREE_TILES", "1") == "1"
# Split K (config.split_k): a decode batch's projection with few output columns (4096 -> 512)
# has too few programs to fill the SMs even in 16-column tiles, and each re-reads the whole
# input. Splitting K into S ranges summed by separate programs, the f32 partials then added in
# a fixed order, is batch-invariant as long as S depends on the weight's shape alone, never
# on M (invariant_split_k). On the H200 it took the narrow projections from 2.5-4.5x XLA's
# time to about XLA's (invariant-linears-gpu.md) and the mode's chunked-prefill cost from 30%
# to 16% (batch-invariant-gpu-split-k.md). DEEPINFER_INVARIANT_SPLIT_K=0 turns it off.
# The price grows with M: S float32 partials per output, written and read once. For a whole
# 8192-token chunk that is ~3.5 GB per V4-Flash layer (~0.85 ms at copy bandwidth) against a
# ~21 ms layer: ~4%, not yet measured. (A program summing its S ranges itself, in the same
# order, would give the same bits without the traffic: the next step if it shows.)
SPLIT_K_ON_GPU = os.environ.get("DEEPINFER_INVARIANT_SPLIT_K", "1") == "1"
SMS = 132                       # H200; only sets how narrow small-batch tiles get
LARGE_BATCH = 1 << 20           # the dense config: default_config's large-batch one
SMALL_BATCH = 1                 # the experts' config: default_config's decode-sized one
MIN_SPLIT_K = 512               # K per program at the least
SPLIT_PROGRAMS = 64             # programs per row tile that split K aims for
GROUP_TILES = 8                 # row tiles per sweep of the column blocks (group_tiles)


def split_block_n(n_out: int) -> int:
    return next((b for b in (128, 64) if n_out % b == 0), 0)


def invariant_split_k(k: int, n_out: int) -> int:
    """K ranges for a k x n_out weight: doubled until one row tile has SPLIT_PROGRAMS
    programs or a range would fall under MIN_SPLIT_K. A function of the weight's shape only:
    every M gets the same ranges, so a row's sum never depends on the batch. (On the H200,
    more ranges helped M = 64 and cost M = 256 the partials' traffic; 64 programs was the
    balance: invariant-linears-gpu.md.)"""
    block_n = split_block_n(n_out)
    if not SPLIT_K_ON_GPU or not block_n:
        return 1
    splits = 1
    while (n_out // block_n) * splits < SPLIT_PROGRAMS and k % (2 * splits * 64) == 0 \
            and k // (2 * splits) >= MIN_SPLIT_K:
        splits *= 2
    return splits


def dense_invariant_config(num_rows: int, n_out: int, k: int | None = None) -> TileConfig:
    """matmul's config for M = num_rows in batch-invariant mode (k: the weight's rows, for
    the K split)."""
    splits = invariant_split_k(k, n_out) if k else 1
    if splits > 1:      # (any tile shape sums a row the same way: TILE_SHAPE_FREE_ON_GPU)
        block_m, steps = (128, 6) if num_rows >= 4096 else (64, 4)
        return TileConfig(block_m=block_m, block_n=split_block_n(n_out),
                          max_concurrent_steps=steps, split_k=splits, group_tiles=GROUP_TILES)
    if not TILE_SHAPE_FREE_ON_GPU or num_rows >= 4096:
        return default_config(LARGE_BATCH, n_out)
    widths = [b for b in (128, 64, 32, 16) if n_out % b == 0]
    if not widths:                  # no tile fits N (the kernel does not run)
        return default_config(LARGE_BATCH, n_out)
    row_tiles = -(-num_rows // 64)
    block_n = next((b for b in widths if row_tiles * (n_out // b) >= SMS), widths[-1])
    return TileConfig(block_m=64, block_n=block_n, max_concurrent_steps=4,
                      group_tiles=GROUP_TILES)


def expert_invariant_configs(num_rows: int, dim: int, inter: int) -> tuple[TileConfig, TileConfig]:
    """expert_mlp's (gate/up, down) configs for num_rows (token, expert) pairs in
    batch-invariant mode: by the batch only once the tile shape is known not to matter."""
    rows = num_rows if TILE_SHAPE_FREE_ON_GPU else SMALL_BATCH
    return default_config(rows, inter, swiglu=True), default_config(rows, dim)


def matmul(x: jax.Array, w: jax.Array, *, impl: str | None = None,
           config: Config | None = None, out_dtype=None) -> jax.Array:
    """Batch-invariant x [M, K] @ w [K, N] -> [M, N] in out_dtype (default: x's dtype), the
    products summed in f32.

    A row's K sum runs in one order whatever M (dense_invariant_config)."""
    impl = impl or implementation(VALIDATED_ON_GPU, "grouped_gemm")
    config = config or dense_invariant_config(x.shape[0], w.shape[1], w.shape[0])
    out_dtype = out_dtype or x.dtype
    if (impl == "reference" or isinstance(config, WarpSpecializedConfig)
            or not kernel_fits(w.shape[0], w.shape[1], config, False, x.dtype)):
        if out_dtype != x.dtype:
            return jnp.matmul(x, w, preferred_element_type=jnp.float32).astype(out_dtype)
        sizes = jnp.full((1,), x.shape[0], jnp.int32)
        return grouped_matmul(x, w[None], sizes, impl=impl, config=config)
    with _mode(impl):   # one group: its tiles are the rows padded, no layout to build
        rows = x.shape[0]
        padded = jnp.pad(x, ((0, -rows % config.block_m), (0, 0)))
        tile_group = jnp.zeros((padded.shape[0] // config.block_m,), jnp.int32)
        out = mosaic_gpu.tiled_group_matmul(padded, w[None], tile_group, config=config,
                                            out_dtype=out_dtype)
        if config.split_k > 1:    # the K ranges' partial sums, added first to last
            total = out[0]
            for part in out[1:]:
                total = total + part
            out = total
        return out[:rows].astype(out_dtype)


def batched_matmul(x: jax.Array, w: jax.Array, *, impl: str | None = None,
                   config: TileConfig | None = None) -> jax.Array:
    """Batch-invariant x [G, M, K] @ w [G, K, N] -> [G, M, N] in x's dtype: G products with
    M rows each (the attention's grouped output projection) in one launch. Groups of equal
    size need no layout: each is padded to whole tiles in place."""
    impl = impl or implementation(VALIDATED_ON_GPU, "grouped_gemm")
    groups, rows, k = x.shape
    config = config or dense_invariant_config(groups * rows, w.shape[2])
    if impl == "reference" or not kernel_fits(k, w.shape[2], config, False, x.dtype) \
            or config.split_k > 1:
        return jnp.einsum("gmk,gkn->gmn", x, w, preferred_element_type=jnp.float32
                          ).astype(x.dtype)
    with _mode(impl):
        padded = jnp.pad(x, ((0, 0), (0, -rows % config.block_m), (0, 0)))
        tiles = padded.shape[1] // config.block_m
        tile_group = jnp.repeat(jnp.arange(groups, dtype=jnp.int32), tiles)
        out = mosaic_gpu.tiled_group_matmul(padded.reshape(-1, k), w, tile_group, config=config)
        return out.reshape(groups, -1, w.shape[2])[:, :rows]


def _tiled(lhs, rhs, tile_group, rhs_scale, swiglu_limit, config: Config) -> jax.Array:
    if isinstance(config, WarpSpecializedConfig):
        return mosaic_gpu_ws.tiled_group_matmul(lhs, rhs, tile_group, swiglu_limit=swiglu_limit,
                                                config=config)
    return mosaic_gpu.tiled_group_matmul(lhs, rhs, tile_group, rhs_scale,
                                         swiglu_limit=swiglu_limit, config=config)


def _mode(impl: str):
    """The kernel compiled for the GPU, or simulated on the CPU (impl="interpret")."""
    return gpu_interpret() if impl == "interpret" else contextlib.nullcontext()
