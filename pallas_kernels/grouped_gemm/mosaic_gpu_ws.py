"""The grouped GEMM, warp-specialised (SM90): a producer warpgroup and two consumer warpgroups.

Same contract as mosaic_gpu.tiled_group_matmul (bf16 weights only). A program computes a tile
of 128 rows (one group, as laid out by layout.py) by `block_n` columns (each SwiGLU half): a
memory warpgroup streams the rows' K blocks and the group's weight blocks through shared
memory, and each of two compute warpgroups runs wgmma on its 64 rows of the tile, with one
accumulator per half. Doubling the rows that share each weight block halves the weight bytes
per FLOP of the one-warpgroup kernel, and the producer keeps copies in flight while both
consumers compute: the structure of jax's Hopper matmul example, applied to expert tiles.

A group's last tile is partly padding (a V4-Flash prefill's experts get ~192 rows each: a
full tile and a half one). A consumer whose 64 rows are all padding (`tile_rows`) skips its
wgmmas and its store, so the other has the tensor cores to itself: the work follows the
rows in 64-row steps while full tiles still share each weight block between 128 rows.

The sum over K runs in the same order for every row, so a row's result does not depend on
the batch here either. On the H200 a V4-Flash 8k-token prefill's gate/up GEMM runs faster
here than on the one-warpgroup kernel, and faster still with the padding skip; the expert
MLP gains again with the rows moved by TMA instead of XLA's layout (`sorted_rows` below and
mosaic_gpu_rows.py). Figures: docs/performance-log.md.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.grouped_gemm.mosaic_gpu import epilogue, kernel_name
from pallas_kernels.grouped_gemm.mosaic_gpu_rows import for_each_piece

WG_ROWS = 64          # rows per consumer warpgroup (the wgmma M)
CONSUMERS = 2


@dataclasses.dataclass(frozen=True)
class WarpSpecializedConfig:
    block_n: int = 128            # output columns per program (per SwiGLU half)
    block_k: int = 64
    max_concurrent_steps: int = 3

    @property
    def block_m(self) -> int:     # the tile rows layout.py must use
        return WG_ROWS * CONSUMERS

    def check(self, k: int, n_out: int, fp8: bool) -> None:
        if fp8:
            raise ValueError("the warp-specialised kernel takes bf16 weights only")
        if self.block_n % 16 or not 0 < self.block_n <= 256:   # see TileConfig.check
            raise ValueError(f"wgmma: 0 < block_n <= 256, a multiple of 16 ({self})")
        if k % self.block_k or n_out % self.block_n:
            raise ValueError(f"K={k} and N={n_out} must be multiples of {self.block_k} and "
                             f"{self.block_n}")


# Jitted: the model calls it per layer with the same shapes, and jax lowers a jitted callee
# once per module (Mosaic GPU lowering is ~0.1-0.5 s a kernel).
@functools.partial(jax.jit, static_argnames=("swiglu_limit", "config", "sorted_rows"))
def tiled_group_matmul(lhs: jax.Array, rhs: jax.Array, tile_group: jax.Array,
                       tile_rows: jax.Array | None = None, tile_first_row: jax.Array | None = None,
                       *, swiglu_limit: float | None = None,
                       config: WarpSpecializedConfig = WarpSpecializedConfig(),
                       sorted_rows: int | None = None) -> jax.Array:
    """lhs [T * 128, K] (tile t belongs to group tile_group[t]; -1: unused; its first
    tile_rows[t] rows are the group's, default all), rhs [G, K, N] -> [T * 128, N] ([.., N/2]
    with the SwiGLU epilogue: rhs holds gate | up). Rows of a 64-row half that is all padding
    stay unwritten.

    sorted_rows=M (with tile_first_row, layout.TileLayout's): the result is [M, N] in sorted
    order instead, each tile's rows stored straight to rows tile_first_row[t]:, in row pieces
    (mosaic_gpu_rows.py) so that no store reaches past its group; rows in no tile stay
    unwritten. This saves the gather out of the tiles (layout.from_tiles)."""
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    rows, k = lhs.shape
    n = rhs.shape[2]
    n_out = n // 2 if swiglu_limit is not None else n
    config.check(k, n_out, fp8=False)
    halves = 2 if swiglu_limit is not None else 1

    if tile_rows is None:
        tile_rows = jnp.full(tile_group.shape, bm, jnp.int32)
    if (sorted_rows is None) != (tile_first_row is None):
        raise ValueError("sorted_rows and tile_first_row go together")
    first_rows = () if sorted_rows is None else (tile_first_row,)

    def body(tile_group_ref, tile_rows_ref, *refs):
        *first_ref, lhs_ref, rhs_ref, out_ref = refs
        tile, col = lax.axis_index("tile"), lax.axis_index("col")
        group = tile_group_ref[tile]
        wg = lax.axis_index("wg")
        my_rows = pl.ds(wg * WG_ROWS, WG_ROWS)
        mine_to_compute = tile_rows_ref[tile] > wg * WG_ROWS   # (consumers only ask)
        operands = (lhs_ref.at[pl.ds(tile * bm, bm)], *[rhs_ref.at[jnp.maximum(group, 0)]] * halves)

        def pipeline(mma, compute_context):
            specs = [plgpu.BlockSpec((bm, bk), lambda kk: (0, kk), delay_release=1)]
            specs += [plgpu.BlockSpec((bk, bn), functools.partial(
                lambda kk, half: (kk, col + half * (n_out // bn)), half=half), delay_release=1)
                for half in range(halves)]
            return plgpu.emit_pipeline_warp_specialized(
                mma, grid=(k // bk,), memory_registers=40, in_specs=specs, wg_axis="wg",
                num_compute_wgs=CONSUMERS, max_concurrent_steps=config.max_concurrent_steps,
                compute_context=compute_context)

        def mma(_, lhs_smem, *refs):
            *rhs_smems, accs = refs

            @pl.when(mine_to_compute)     # (all padding: the slots are released untouched)
            def _():
                for acc, w in zip(accs, rhs_smems, strict=True):
                    plgpu.wgmma(acc, lhs_smem.at[my_rows], w)
            plgpu.wgmma_wait(halves)      # retire the previous step's (its slots refill next)
            return accs

        # Shared memory of a multi-warpgroup kernel is allocated for all warpgroups at once:
        # the pipeline's buffers (sized with a placeholder body) and one output tile per
        # consumer.
        ignore = lambda *_, **__: None  # noqa: E731
        @functools.partial(
            pl.run_scoped, allocations=pipeline(ignore, ignore).get_allocations(*operands),
            out_smem=plgpu.SMEM((CONSUMERS, WG_ROWS, bn), out_ref.dtype), collective_axes="wg")
        def scope(allocations, out_smem):
            def compute_context(eval_pipeline):
                def accumulate(*accs):
                    accs = eval_pipeline(accs)

                    @pl.when(mine_to_compute)
                    def _():
                        result = epilogue(tuple(acc[...] for acc in accs), swiglu_limit)
                        mine = out_smem.at[wg]
                        mine[...] = result.astype(out_smem.dtype)
                        plgpu.commit_smem()
                        cols = pl.ds(col * bn, bn)
                        if sorted_rows is None:
                            plgpu.copy_smem_to_gmem(mine, out_ref.at[
                                pl.ds(tile * bm + wg * WG_ROWS, WG_ROWS), cols])
                        else:
                            start = first_ref[0][tile] + wg * WG_ROWS
                            count = jnp.clip(tile_rows_ref[tile] - wg * WG_ROWS, 0, WG_ROWS)

                            def store(_, size, at):
                                plgpu.copy_smem_to_gmem(mine.at[pl.ds(at, size)],
                                                        out_ref.at[pl.ds(start + at, size), cols])
                            for_each_piece(count, WG_ROWS, store)
                        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

                pl.run_scoped(accumulate, *[plgpu.ACC((WG_ROWS, bn)) for _ in range(halves)])

            @pl.when(group >= 0)
            def _():
                pipeline(mma, compute_context)(*operands, allocations=allocations)

    out_rows = rows if sorted_rows is None else sorted_rows
    kernel = plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct((out_rows, n_out), lhs.dtype),
        grid=(rows // bm, n_out // bn), grid_names=("tile", "col"),
        kernel_name=kernel_name("grouped_gemm_ws", config, k, n_out, swiglu_limit, False)
        + "_sorted_out" * (sorted_rows is not None),
        num_threads=CONSUMERS + 1, thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup))
    return kernel(tile_group, tile_rows, *first_rows, lhs, rhs)
