"""Rows sorted by group <-> whole tiles of one group each (what the kernel computes on).

The kernel works on tiles of `block_m` rows that all belong to one group, so each group's
rows are padded up to whole tiles: M rows in G groups need at most cdiv(M, block_m) + G - 1
tiles, and never more tiles than rows. Computed with jnp in fixed shapes (inside the jitted
step, from device-side sizes). Rows past the groups' total (in no group, as in `ragged_dot`)
are in no tile: dropped on the way in, undefined on the way out. The jnp moves here are the
CPU path and the fallback; on the GPU the sorted rows move by TMA (mosaic_gpu_rows.py, from
`tile_first_row`), a fraction of these moves' time in a V4-Flash prefill's expert MLP on the
H200 (docs/performance-log.md).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels.common import settled


def max_tiles(num_rows: int, num_groups: int, block_m: int) -> int:
    # Each group's last tile may be partial (one extra tile per group) but every used tile
    # holds at least one row.
    return max(1, min(num_rows, -(-num_rows // block_m) + num_groups - 1))


class TileLayout(NamedTuple):
    padded_row: jax.Array    # i32[M]  where each sorted row sits in the tiled layout
    tile_group: jax.Array    # i32[T]  each tile's group, -1 for unused tiles
    tile_rows: jax.Array     # i32[T]  rows of its group in each tile (the rest are padding)
    tile_first_row: jax.Array  # i32[T]  the sorted row of each tile's first row (unused: 0)


def tile_layout(group_sizes: jax.Array, num_rows: int, block_m: int) -> TileLayout:
    num_groups = group_sizes.shape[0]
    tiles = max_tiles(num_rows, num_groups, block_m)
    group_end = jnp.cumsum(group_sizes)
    group_start = group_end - group_sizes
    tiles_per_group = -(-group_sizes // block_m)
    tile_end = jnp.cumsum(tiles_per_group)
    tile_start = tile_end - tiles_per_group
    row = jnp.arange(num_rows)
    # compare_all: one fused comparison and count. The default binary search is a while loop,
    # a few launches per step of it on a GPU, for at most a few hundred groups.
    group = jnp.searchsorted(group_end, row, side="right", method="compare_all")
    padded_row = tile_start[group] * block_m + row - group_start[group]
    padded_row = jnp.where(row < group_end[-1], padded_row, tiles * block_m)   # (out of range)
    t = jnp.arange(tiles)
    tile_group = jnp.searchsorted(tile_end, t, side="right", method="compare_all")
    used = t < tile_end[-1]
    tile_group = jnp.where(used, tile_group, -1).astype(jnp.int32)
    owner = jnp.maximum(tile_group, 0)             # (unused tiles: group 0's, masked below)
    before = (t - tile_start[owner]) * block_m             # the group's rows in earlier tiles
    tile_rows = jnp.where(used, jnp.clip(group_sizes[owner] - before, 0, block_m), 0)
    tile_first_row = jnp.where(used, group_start[owner] + before, 0)
    return TileLayout(*settled(padded_row.astype(jnp.int32), tile_group,
                               tile_rows.astype(jnp.int32), tile_first_row.astype(jnp.int32)))


def to_tiles(rows: jax.Array, layout: TileLayout, block_m: int) -> jax.Array:
    """[M, K] sorted rows -> [T * block_m, K], padding rows zero."""
    tiles = layout.tile_group.shape[0]
    out = jnp.zeros((tiles * block_m, rows.shape[1]), rows.dtype)
    return out.at[layout.padded_row].set(rows, unique_indices=True)


def gather_to_tiles(source: jax.Array, rows: jax.Array, layout: TileLayout,
                    block_m: int) -> jax.Array:
    """source [N, K] and rows i32[M] (sorted row i is source[rows[i]]) -> [T * block_m, K],
    gathered straight into the tiles (no sorted copy in between). Padding rows hold some
    source row: the kernel's results for them are never read."""
    tiles = layout.tile_group.shape[0]
    source_row = jnp.zeros((tiles * block_m,), jnp.int32).at[layout.padded_row].set(
        rows.astype(jnp.int32), unique_indices=True)
    return source[settled(source_row)]


def from_tiles(tiled: jax.Array, layout: TileLayout, order: jax.Array | None = None) -> jax.Array:
    """The sorted rows back out of the tiles; with `order` i32[M], row j of the result is
    sorted row order[j] (read straight from the tiles)."""
    return tiled[layout.padded_row if order is None else settled(layout.padded_row[order])]
