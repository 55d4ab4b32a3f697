"""The grouped GEMM in batch-invariant mode: the dense GEMM (one group) and the configs.

A row's result must not depend on the batch: every config sums a row's K in one order (64-wide
steps, in order; K split only into ranges fixed by the weight's shape), and on a GPU wgmma's
per-element sums do not depend on the tile's shape either, so tiles may follow the batch
(more programs for small batches) while the ranges may not. `matmul` and `batched_matmul`
run the kernel of api.py on one group, or on equal groups, without its tile layout.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.common import NotSupported, dispatch, in_row_tiles, kernel_mode
from pallas_kernels.grouped_gemm import mosaic_gpu, mosaic_gpu_persistent
from pallas_kernels.grouped_gemm.api import (
    KERNEL_DTYPES,
    Config,
    Implementation,
    default_config,
    grouped_matmul,
    kernel_fits,
)
from pallas_kernels.grouped_gemm.mosaic_gpu import TileConfig
from pallas_kernels.grouped_gemm.mosaic_gpu_persistent import PersistentConfig
from pallas_kernels.grouped_gemm.mosaic_gpu_ws import WarpSpecializedConfig

# Every config sums a row's K in the same order (block_k 64; K split only by the weight's
# shape, invariant_split_k). wgmma's per-element sums also ignore the tile's shape (block_m,
# block_n) and a row's place in its tile (test_rows_do_not_depend_on_the_tile_shape, run on
# the H200), so small batches take narrower tiles, enough programs to fill the SMs
# (dense_invariant_config).
#
# Split K (config.split_k): a decode batch's projection with few output columns (4096 -> 512)
# has too few programs to fill the SMs even in 16-column tiles, and each re-reads the whole
# input. Splitting K into S ranges summed by separate programs, the f32 partials then added in
# a fixed order, is batch-invariant as long as S depends on the weight's shape alone, never on
# M. The price grows with M: S float32 partials per output, written and read once; large
# batches (a prefill chunk of PERSISTENT_MIN_ROWS+ rows) therefore take the persistent kernel,
# which chains the same K ranges in one program (the same bits as the partials summed after).
SMS = 132                       # H200; only sets how narrow small-batch tiles get
LARGE_BATCH = 1 << 20           # the dense config: default_config's large-batch one
MIN_SPLIT_K = 512               # K per program at the least
SPLIT_PROGRAMS = 64             # programs per row tile that split K aims for
GROUP_TILES = 8                 # row tiles per sweep of the column blocks (group_tiles)
PERSISTENT_MIN_ROWS = 4096


def split_block_n(n_out: int) -> int:
    return next((b for b in (128, 64) if n_out % b == 0), 0)


def invariant_split_k(k: int, n_out: int) -> int:
    """K ranges for a k x n_out weight: doubled until one row tile has SPLIT_PROGRAMS
    programs or a range would fall under MIN_SPLIT_K. A function of the weight's shape only:
    every M gets the same ranges, so a row's sum never depends on the batch. (More ranges
    help M = 64 and cost M = 256 the partials' traffic; 64 programs balance the two on the
    H200: docs/performance-log.md.)"""
    block_n = split_block_n(n_out)
    if not block_n:
        return 1
    splits = 1
    while (n_out // block_n) * splits < SPLIT_PROGRAMS and k % (2 * splits * 64) == 0 \
            and k // (2 * splits) >= MIN_SPLIT_K:
        splits *= 2
    return splits


def persistent_config(n_out: int, splits: int) -> PersistentConfig:
    """The persistent kernel's tiles: K whole, 256 columns where N allows (as jax's example's
    best; on par with XLA's dot on the H200). Two K ranges: both in one call, an accumulator
    each, so 128 columns (the registers), 6 pipeline stages (measured against 4 on the H200).
    More: a chain of calls, whose float32 slots and carry piece take the shared memory of a
    pipeline stage (slower than one call for two ranges). Figures: docs/performance-log.md."""
    block_n = 256 if n_out % 256 == 0 else 128
    if splits == 1:
        return PersistentConfig(block_n=block_n)
    if splits == 2:
        return PersistentConfig(block_n=128, max_concurrent_steps=6, ranges=2)
    return PersistentConfig(block_n=block_n, max_concurrent_steps=3, store_n=32)


def dense_invariant_config(num_rows: int, n_out: int, k: int | None = None,
                           k_ranges: int | None = None) -> TileConfig | PersistentConfig:
    """matmul's config for M = num_rows in batch-invariant mode (k: the weight's rows, for
    the K split; k_ranges: the caller's K split instead, on the per-tile kernel at every M)."""
    splits = k_ranges or (invariant_split_k(k, n_out) if k else 1)
    if k and num_rows >= PERSISTENT_MIN_ROWS and n_out % 128 == 0 and not k_ranges:
        config = persistent_config(n_out, splits)
        if k % (splits * config.block_k) == 0 and n_out % config.block_n == 0:
            return config
    if splits > 1:      # (any tile shape sums a row the same way)
        block_m, steps = (128, 6) if num_rows >= 4096 else (64, 4)
        return TileConfig(block_m=block_m, block_n=split_block_n(n_out),
                          max_concurrent_steps=steps, split_k=splits, group_tiles=GROUP_TILES)
    if num_rows >= 4096:
        return default_config(LARGE_BATCH, n_out, warp_specialized=False)
    widths = [b for b in (128, 64, 32, 16) if n_out % b == 0]
    if not widths:                  # no tile fits N (the kernel does not run)
        return default_config(LARGE_BATCH, n_out, warp_specialized=False)
    row_tiles = -(-num_rows // 64)
    block_n = next((b for b in widths if row_tiles * (n_out // b) >= SMS), widths[-1])
    return TileConfig(block_m=64, block_n=block_n, max_concurrent_steps=4,
                      group_tiles=GROUP_TILES)


def persistent_fits(w: jax.Array, config: PersistentConfig, splits: int, dtype) -> bool:
    """Whether the persistent kernel runs w [K, N] in `splits` K ranges with this config.
    Checked with the split, since a config that sums two ranges per call does not fit one
    range: checked without it, every large batch would fall back to the per-tile split-K
    kernel, far slower on the H200 (docs/performance-log.md)."""
    if jnp.dtype(dtype) not in KERNEL_DTYPES:
        return False
    try:
        config.check(w.shape[0], w.shape[1], splits=splits)
    except ValueError:
        return False
    return True


def matmul(x: jax.Array, w: jax.Array, *, implementation: Implementation = "reference",
           config: Config | None = None, out_dtype=None, row_tile: int | None = None,
           k_ranges: int | None = None) -> jax.Array:
    """Batch-invariant x [M, K] @ w [K, N] -> [M, N] in out_dtype (default: x's dtype), the
    products summed in f32 (a row's K sum in one order whatever M: dense_invariant_config).
    row_tile: the reference multiplies the rows in tiles of this many, one after the other
    (None: all at once, which is no longer invariant).

    k_ranges: the kernel sums K in this many ranges at every M, the ranges' partials added
    after (invariant only if the caller derives it from the weight's shape alone). For a
    narrow weight with a long K (the mHC mixes, 16384 x 128): the shape's own split is 32
    ranges, which a large batch would run as a chain of 32 persistent-kernel launches, each
    traced and compiled apart; the partials of fewer ranges cost less than that."""
    return dispatch("invariant_matmul", _MATMUL, implementation, x, w, config=config,
                    out_dtype=out_dtype, row_tile=row_tile, k_ranges=k_ranges)


def _matmul_kernel(x, w, *, config, out_dtype, row_tile, k_ranges, interpret):
    if x.dtype != w.dtype or (out_dtype is not None
                              and jnp.dtype(out_dtype) not in (x.dtype, jnp.float32)):
        raise NotSupported(f"{x.dtype} @ {w.dtype} -> {out_dtype}")
    config = config or dense_invariant_config(x.shape[0], w.shape[1], w.shape[0], k_ranges)
    out_dtype = out_dtype or x.dtype
    if isinstance(config, PersistentConfig):   # the same K ranges as every other M's
        splits = invariant_split_k(w.shape[0], w.shape[1])
        if persistent_fits(w, config, splits, x.dtype):
            with kernel_mode(interpret):
                return mosaic_gpu_persistent.chained_matmul(x, w, splits=splits,
                                                            out_dtype=out_dtype, config=config)
        config = dense_invariant_config(1, w.shape[1], w.shape[0])
    if isinstance(config, WarpSpecializedConfig):   # the grouped kernel on one group
        if jnp.dtype(out_dtype) != x.dtype:
            raise NotSupported(f"{config} stores {x.dtype} only")
        sizes = jnp.full((1,), x.shape[0], jnp.int32)
        return grouped_matmul(x, w[None], sizes, config=config,
                              implementation="interpret" if interpret else "mosaic_gpu")
    if not kernel_fits(w.shape[0], w.shape[1], config, False, x.dtype):
        raise NotSupported(f"K={w.shape[0]}, N={w.shape[1]}, {x.dtype} with {config}")
    with kernel_mode(interpret):   # one group: its tiles are the rows padded, no layout to build
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


def _matmul_reference(x, w, *, config, out_dtype, row_tile, k_ranges):
    """Float32 operands are multiplied in float32: a GPU's default for them is TF32, which
    the reference model (torch with TF32 off) does not use."""
    precision = jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else None

    def product(rows):
        return jnp.matmul(rows, w, preferred_element_type=out_dtype, precision=precision)

    return product(x) if row_tile is None else in_row_tiles(product, row_tile, x)


_MATMUL = {
    "mosaic_gpu": functools.partial(_matmul_kernel, interpret=False),
    "interpret": functools.partial(_matmul_kernel, interpret=True),
    "reference": _matmul_reference,
}


def batched_matmul(x: jax.Array, w: jax.Array, *, implementation: Implementation = "reference",
                   config: TileConfig | None = None, row_tile: int | None = None) -> jax.Array:
    """Batch-invariant x [G, M, K] @ w [G, K, N] -> [G, M, N] in x's dtype: G products with
    M rows each (the attention's grouped output projection) in one launch. Groups of equal
    size need no layout: each is padded to whole tiles in place. row_tile: as matmul's."""
    return dispatch("invariant_batched_matmul", _BATCHED, implementation, x, w, config=config,
                    row_tile=row_tile)


def _batched_kernel(x, w, *, config, row_tile, interpret):
    groups, rows, k = x.shape
    config = config or dense_invariant_config(groups * rows, w.shape[2])
    if x.dtype != w.dtype or config.split_k > 1 or not kernel_fits(k, w.shape[2], config,
                                                                   False, x.dtype):
        raise NotSupported(f"K={k}, N={w.shape[2]}, {x.dtype} @ {w.dtype} with {config}")
    with kernel_mode(interpret):
        padded = jnp.pad(x, ((0, 0), (0, -rows % config.block_m), (0, 0)))
        tiles = padded.shape[1] // config.block_m
        tile_group = jnp.repeat(jnp.arange(groups, dtype=jnp.int32), tiles)
        out = mosaic_gpu.tiled_group_matmul(padded.reshape(-1, k), w, tile_group, config=config)
        return out.reshape(groups, -1, w.shape[2])[:, :rows]


def _batched_reference(x, w, *, config, row_tile):
    if row_tile is None:
        return jnp.einsum("gmk,gkn->gmn", x, w)
    return in_row_tiles(lambda t: jnp.einsum("tgk,gkn->tgn", t, w), row_tile,
                        x.swapaxes(0, 1)).swapaxes(0, 1)


_BATCHED = {
    "mosaic_gpu": functools.partial(_batched_kernel, interpret=False),
    "interpret": functools.partial(_batched_kernel, interpret=True),
    "reference": _batched_reference,
}
