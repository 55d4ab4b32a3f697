"""The grouped GEMM in batch-invariant mode: the dense GEMM (one group) and the configs.

A row's result must not depend on the batch: every config sums a row's K in one order (64-wide
steps, in order; K split only into ranges fixed by the weight's shape), and on a GPU wgmma's
per-element sums do not depend on the tile's shape either, so tiles may follow the batch
(more programs for small batches) while the ranges may not. `matmul` and `batched_matmul`
run the kernel of api.py on one group, or on equal groups, without its tile layout.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp

from pallas_kernels.common import implementation
from pallas_kernels.grouped_gemm import mosaic_gpu, mosaic_gpu_persistent
from pallas_kernels.grouped_gemm.api import (
    KERNEL_DTYPES,
    VALIDATED_ON_GPU,
    Config,
    default_config,
    grouped_matmul,
    kernel_fits,
    kernel_mode,
)
from pallas_kernels.grouped_gemm.mosaic_gpu import TileConfig
from pallas_kernels.grouped_gemm.mosaic_gpu_persistent import PersistentConfig
from pallas_kernels.grouped_gemm.mosaic_gpu_ws import WarpSpecializedConfig

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
# The warp-specialised kernel sums a row as the one-warpgroup kernel does (both run wgmma
# over the same 64-wide K steps): test_rows_do_not_depend_on_the_tile_shape passed on the
# H200 with it (2026-11-30), so this mode's large MoE batches may take it too.
WS_INVARIANT = True
# Large batches (a prefill chunk of 4096+ rows) take the persistent kernel, chaining the same
# K ranges (mosaic_gpu_persistent.py: the same bits as the split-K kernel's partials summed after):
# on the H200 the per-tile kernels reached 56-66% of the bf16 matmul ceiling there and jax's
# example of the persistent form 88-91% (kernels-dense-gpu.md).
# DEEPINFER_INVARIANT_PERSISTENT=0 keeps the per-tile kernels (for comparison).
PERSISTENT_ON_GPU = os.environ.get("DEEPINFER_INVARIANT_PERSISTENT", "1") == "1"
PERSISTENT_MIN_ROWS = 4096


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


def persistent_config(n_out: int, splits: int) -> PersistentConfig:
    """The persistent kernel's tiles: K whole, 256 columns where N allows (as jax's example's
    best on the H200: 99-104% of XLA's dot). Two K ranges: both in one call, an accumulator
    each, so 128 columns (the registers): 6 stages 93% / 87% of XLA's dot at 4096 / 8192
    rows, 4 stages 86% / 90% (kernels-dense-ranges-gpu.md; that run's 50% row with 5 stages
    was the engine's own call, which fell back to the split-K kernel: `persistent_fits`).
    More: a chain of calls, whose float32 slots and carry piece take the shared memory of a
    pipeline stage (79-85% of XLA's dot for two ranges, kernels-dense-gpu.md)."""
    block_n = 256 if n_out % 256 == 0 else 128
    if splits == 1:
        return PersistentConfig(block_n=block_n)
    if splits == 2:
        return PersistentConfig(block_n=128, max_concurrent_steps=6, ranges=2)
    return PersistentConfig(block_n=block_n, max_concurrent_steps=3, store_n=32)


def dense_invariant_config(num_rows: int, n_out: int, k: int | None = None
                           ) -> TileConfig | PersistentConfig:
    """matmul's config for M = num_rows in batch-invariant mode (k: the weight's rows, for
    the K split)."""
    splits = invariant_split_k(k, n_out) if k else 1
    if k and PERSISTENT_ON_GPU and num_rows >= PERSISTENT_MIN_ROWS and n_out % 128 == 0:
        config = persistent_config(n_out, splits)
        if k % (splits * config.block_k) == 0 and n_out % config.block_n == 0:
            return config
    if splits > 1:      # (any tile shape sums a row the same way: TILE_SHAPE_FREE_ON_GPU)
        block_m, steps = (128, 6) if num_rows >= 4096 else (64, 4)
        return TileConfig(block_m=block_m, block_n=split_block_n(n_out),
                          max_concurrent_steps=steps, split_k=splits, group_tiles=GROUP_TILES)
    if not TILE_SHAPE_FREE_ON_GPU or num_rows >= 4096:
        return default_config(LARGE_BATCH, n_out, warp_specialized=False)
    widths = [b for b in (128, 64, 32, 16) if n_out % b == 0]
    if not widths:                  # no tile fits N (the kernel does not run)
        return default_config(LARGE_BATCH, n_out, warp_specialized=False)
    row_tiles = -(-num_rows // 64)
    block_n = next((b for b in widths if row_tiles * (n_out // b) >= SMS), widths[-1])
    return TileConfig(block_m=64, block_n=block_n, max_concurrent_steps=4,
                      group_tiles=GROUP_TILES)


def expert_invariant_configs(num_rows: int, dim: int, inter: int) -> tuple[TileConfig, TileConfig]:
    """expert_mlp's (gate/up, down) configs for num_rows (token, expert) pairs in
    batch-invariant mode: by the batch only once the tile shape is known not to matter."""
    rows = num_rows if TILE_SHAPE_FREE_ON_GPU else SMALL_BATCH
    return (default_config(rows, inter, swiglu=True, warp_specialized=WS_INVARIANT),
            default_config(rows, dim, warp_specialized=WS_INVARIANT))


def persistent_fits(w: jax.Array, config: PersistentConfig, splits: int, dtype) -> bool:
    """Whether the persistent kernel runs w [K, N] in `splits` K ranges with this config.
    (Checked without the split, a config summing two ranges per call did not fit one range,
    and every large batch fell back to the per-tile split-K kernel: 48-50% of XLA's dot on
    the H200 where the config runs at 87-89%, kernels-moe-gpu.md's dense rows.)"""
    if jnp.dtype(dtype) not in KERNEL_DTYPES:
        return False
    try:
        config.check(w.shape[0], w.shape[1], splits=splits)
    except ValueError:
        return False
    return True


def matmul(x: jax.Array, w: jax.Array, *, impl: str | None = None,
           config: Config | None = None, out_dtype=None) -> jax.Array:
    """Batch-invariant x [M, K] @ w [K, N] -> [M, N] in out_dtype (default: x's dtype), the
    products summed in f32.

    A row's K sum runs in one order whatever M (dense_invariant_config)."""
    impl = impl or implementation(VALIDATED_ON_GPU, "grouped_gemm")
    config = config or dense_invariant_config(x.shape[0], w.shape[1], w.shape[0])
    out_dtype = out_dtype or x.dtype
    if isinstance(config, PersistentConfig):   # the same K ranges as every other M's
        splits = invariant_split_k(w.shape[0], w.shape[1])
        if impl != "reference" and persistent_fits(w, config, splits, x.dtype):
            with kernel_mode(impl):
                return mosaic_gpu_persistent.chained_matmul(x, w, splits=splits, out_dtype=out_dtype,
                                                       config=config)
        config = dense_invariant_config(1, w.shape[1], w.shape[0])   # (the reference path)
    if (impl == "reference" or isinstance(config, WarpSpecializedConfig)
            or not kernel_fits(w.shape[0], w.shape[1], config, False, x.dtype)):
        if out_dtype != x.dtype:
            return jnp.matmul(x, w, preferred_element_type=jnp.float32).astype(out_dtype)
        sizes = jnp.full((1,), x.shape[0], jnp.int32)
        return grouped_matmul(x, w[None], sizes, impl=impl, config=config)
    with kernel_mode(impl):   # one group: its tiles are the rows padded, no layout to build
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
    with kernel_mode(impl):
        padded = jnp.pad(x, ((0, 0), (0, -rows % config.block_m), (0, 0)))
        tiles = padded.shape[1] // config.block_m
        tile_group = jnp.repeat(jnp.arange(groups, dtype=jnp.int32), tiles)
        out = mosaic_gpu.tiled_group_matmul(padded.reshape(-1, k), w, tile_group, config=config)
        return out.reshape(groups, -1, w.shape[2])[:, :rows]
