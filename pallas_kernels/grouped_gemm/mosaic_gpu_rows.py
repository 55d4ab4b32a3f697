"""Rows between sorted order and whole tiles by TMA, in row pieces (Mosaic GPU, SM90).

A group's rows start anywhere in the sorted rows, and its last tile is partly padding. The
jnp layout (layout.py) moves them with XLA: a zeroed tile buffer, a scatter into it, and a
gather back out (a sizeable share of a V4-Flash 8k-token prefill's expert MLP on the H200:
docs/performance-log.md). Here the rows move by TMA copies between global and shared
memory instead, and only the group's own rows are ever read or written: a tile's `n` rows
go as one copy of the whole tile when full, else as pieces of 64, 32, ..., 1 rows (one per
set bit of n), so that a partial tile never touches its neighbour group's rows. Padding rows
of a tile are left as they were: a GEMM row depends on its own row only, and nothing reads
a padding row's result.

`row_pieces` also serves the GEMM kernels' epilogues, which store a tile's rows straight into
sorted order (mosaic_gpu_ws.py). Shared memory is plain row-major here (no swizzle or 8-row
tiling), so that a piece may start at any row.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu


def row_pieces(count: jax.Array, limit: int) -> Iterator[tuple[int, jax.Array | int, jax.Array]]:
    """(rows, first row, present) for the pieces that cover rows [0, count) of a block of
    `limit` rows (a power of two; 0 <= count <= limit): the whole block when count == limit,
    else one piece per set bit of count, largest first (first row: the bits above it)."""
    if limit & (limit - 1):
        raise ValueError(f"a block of {limit} rows: a power of two is needed")
    yield limit, 0, count >= limit
    size = limit // 2
    while size:
        yield size, count & ~(2 * size - 1), (count & size) != 0
        size //= 2


def for_each_piece(count: jax.Array, limit: int,
                   copy: Callable[[int, int, jax.Array | int], None]) -> None:
    """copy(i, rows, first_row) under pl.when for each present piece (i: the piece's index,
    0 for the whole block)."""
    for i, (size, first, present) in enumerate(row_pieces(count, limit)):
        pl.when(present)(functools.partial(copy, i, size, first))


def piece_count(limit: int) -> int:
    """How many pieces row_pieces names for a block of `limit` rows (whole + one per bit)."""
    return limit.bit_length()


@functools.partial(jax.jit, static_argnames=("tiles", "block_m", "block_k"))
def copy_to_tiles(rows: jax.Array, tile_first_row: jax.Array, tile_rows: jax.Array, *,
                  tiles: int, block_m: int, block_k: int = 256) -> jax.Array:
    """rows [M, K] sorted by group -> [tiles * block_m, K]: tile t's first tile_rows[t] rows
    are rows[tile_first_row[t]:][:tile_rows[t]]; the rest of each tile is left unwritten."""
    k = rows.shape[1]
    block_k = min(block_k, k)
    if k % block_k:
        raise ValueError(f"K={k} must be a multiple of {block_k}")

    def body(first_ref, count_ref, rows_ref, out_ref, smem, barriers):
        tile, cols = lax.axis_index("tile"), pl.ds(lax.axis_index("col") * block_k, block_k)
        first, count = first_ref[tile], count_ref[tile]

        def load(i, size, at):
            plgpu.copy_gmem_to_smem(rows_ref.at[pl.ds(first + at, size), cols],
                                    smem.at[pl.ds(at, size)], barriers.at[i])

        def wait(i, size, at):
            plgpu.barrier_wait(barriers.at[i])

        for_each_piece(count, block_m, load)
        for_each_piece(count, block_m, wait)

        @pl.when(count > 0)
        def _():
            plgpu.copy_smem_to_gmem(smem, out_ref.at[pl.ds(tile * block_m, block_m), cols])
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    return plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct((tiles * block_m, k), rows.dtype),
        grid=(tiles, k // block_k), grid_names=("tile", "col"), kernel_name="rows_to_tiles",
        scratch_types=[plgpu.SMEM((block_m, block_k), rows.dtype),
                       plgpu.Barrier(num_barriers=piece_count(block_m))],
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    )(tile_first_row, tile_rows, rows)
