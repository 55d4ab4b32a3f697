"""The grouped GEMM on persistent programs (SM90), warp-specialised; the dense GEMM for large
batches is its one-group case, with K ranges chained bit-exactly.

`tiled_group_matmul`: the grouped GEMM's contract (mosaic_gpu_ws.py), SwiGLU epilogue
included. `matmul(x, w, carry)`: x [M, K] @ w [K, N] over K rows [k_start, k_start + k_size),
plus carry f32 [M, N] when given, -> [M, N] in out_dtype; M a multiple of 128.

One program per SM loops over the 128 x block_n output tiles, in bands of `snake_width` row
tiles (`plgpu.planar_snake`), so the programs running at once share rows and columns in L2.
In each, a producer warpgroup streams the K blocks of the rows and of the tile's group's
weight through shared memory while two consumer warpgroups accumulate 64 rows x block_n each
with wgmma (a consumer whose rows are all padding skips). A consumer stores its result in
store_n-column pieces through two shared-memory slots: a piece's copy to global memory runs
while the next piece is converted, and the tile's last copies while the next tile's main loop
runs (the producer is already streaming it).

Batch-invariant mode splits K into S ranges fixed by the weight's shape (invariant.py,
`invariant_split_k`) and adds the ranges' float32 partial sums first to last. Here
`config.ranges` of them are summed apart in one call, an accumulator each, and a call's
epilogue adds the float32 sum of the ranges of the calls before it (`carry`): the same
additions in the same order as the one-warpgroup kernel's partials summed after it, so the
same bits. Within a range a row's sum is wgmma's over 64-wide K steps in order, as in the
other kernels, whatever the tile.

Why this form: on the H200 jax's own example of it (jax.experimental.pallas.ops.gpu.
hopper_matmul_mgpu) comes near the bf16 matmul ceiling at 4096 and 8192 rows where the
per-tile kernels of this folder do not, and so does this kernel with K whole. On the experts
(`PersistentConfig` in api.py's configs) it is an option, not the default (kernels alone on
the H200): ahead of the warp-specialised kernel where every tile is full (V4-Flash's GEMMs
on 256-row groups) but behind it on a prefill's routing, whose experts end in a half tile: a
half tile takes its program as long as a full one, and programs take fixed turns where the
per-tile kernel's programs are scheduled as SMs free up. Figures: docs/performance-log.md.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.grouped_gemm.mosaic_gpu import epilogue

WG_ROWS = 64          # rows per consumer warpgroup (the wgmma M)
CONSUMERS = 2


@dataclasses.dataclass(frozen=True)
class PersistentConfig:
    block_n: int = 256            # output columns per tile (each consumer: 64 rows x block_n)
    block_k: int = 64
    max_concurrent_steps: int = 4
    snake_width: int = 4          # row tiles per band of the tile order
    store_n: int = 64             # output columns per epilogue piece
    programs: int = 0             # 0: one per SM
    ranges: int = 1               # K ranges per call, one accumulator each (see matmul)

    @property
    def block_m(self) -> int:
        return WG_ROWS * CONSUMERS

    def check(self, k: int, n_out: int, fp8: bool = False, splits: int = 1) -> None:
        """K (in `splits` ranges) and N against the tiles (api.kernel_fits' contract); M is
        padded to whole tiles by the caller."""
        if fp8:
            raise ValueError("the persistent dense kernel takes bf16 weights only")
        if self.block_n % 16 or not 0 < self.block_n <= 256 or self.block_n % self.store_n:
            raise ValueError(f"wgmma: 0 < block_n <= 256, a multiple of 16 and of store_n "
                             f"({self})")
        if self.ranges * self.block_n > 256:    # accumulators: 64 x block_n f32 per range
            raise ValueError(f"{self.ranges} accumulators of 64 x {self.block_n} overflow the "
                             f"registers (ranges x block_n <= 256)")
        if splits % self.ranges:
            raise ValueError(f"{splits} K ranges are not whole calls of {self.ranges}")
        if k % (splits * self.block_k) or n_out % self.block_n:
            raise ValueError(f"K={k} in {splits} ranges and N={n_out} must be multiples of "
                             f"{self.block_k} and {self.block_n}")


def streaming_multiprocessors() -> int:
    """Programs of a persistent kernel: the GPU's SMs (132 on the H200). Elsewhere (interpret
    mode on the CPU, lowering for CUDA on a CPU) a few, so that each program loops."""
    device = jax.devices()[0]
    return device.core_count if device.platform == "gpu" else 4


def matmul(x: jax.Array, w: jax.Array, carry: jax.Array | None = None, *, k_start: int = 0,
           k_size: int | None = None, out_dtype=None,
           config: PersistentConfig = PersistentConfig()) -> jax.Array:
    """x [M, K], w [K, N], carry f32[M, N] or None -> carry + x[:, ks] @ w[ks] in out_dtype
    (default x's), ks = k_start : k_start + k_size (default all of K), summed in float32.

    With config.ranges = R > 1, ks is R equal ranges summed apart in R accumulators and added
    first to last in the epilogue (after the carry): R ranges of the split without a float32
    round trip through memory between them. (The grouped kernel on one group.)"""
    if x.shape[0] % config.block_m:
        raise ValueError(f"M={x.shape[0]} must be a multiple of {config.block_m} (pad it: "
                         "chained_matmul)")
    tiles = x.shape[0] // config.block_m
    return tiled_group_matmul(x, w[None], jnp.zeros((tiles,), jnp.int32), carry=carry,
                              k_start=k_start, k_size=k_size, out_dtype=out_dtype, config=config)


# Jitted: the model calls it per layer with the same shapes (one lowering per module).
@functools.partial(jax.jit, static_argnames=("swiglu_limit", "k_start", "k_size", "out_dtype",
                                             "config"))
def tiled_group_matmul(lhs: jax.Array, rhs: jax.Array, tile_group: jax.Array,
                       tile_rows: jax.Array | None = None, carry: jax.Array | None = None, *,
                       swiglu_limit: float | None = None, k_start: int = 0,
                       k_size: int | None = None, out_dtype=None,
                       config: PersistentConfig = PersistentConfig()) -> jax.Array:
    """The grouped GEMM's contract (mosaic_gpu_ws.tiled_group_matmul) on persistent programs:
    lhs [T * 128, K] (tile t of group tile_group[t], -1: unused; its first tile_rows[t] rows
    the group's), rhs [G, K, N] (gate | up with the SwiGLU epilogue) -> [T * 128, N or N/2] in
    out_dtype; a 64-row half of a tile that is all padding is neither computed nor written.
    carry / k_start / k_size / config.ranges: see `matmul` (no SwiGLU with them)."""
    rows, k = lhs.shape
    n = rhs.shape[2]
    n_out = n // 2 if swiglu_limit is not None else n
    halves = 2 if swiglu_limit is not None else 1
    k_size = k - k_start if k_size is None else k_size
    out_dtype = jnp.dtype(out_dtype or lhs.dtype)
    config.check(k_size, n_out, splits=config.ranges)
    if swiglu_limit is not None and (carry is not None or config.ranges > 1 or k_size != k):
        raise ValueError("the SwiGLU epilogue needs whole sums: no carry, K ranges or K slice")
    if halves * config.ranges * config.block_n > 256:     # accumulators, as in check()
        raise ValueError(f"{halves} x {config.ranges} accumulators of 64 x {config.block_n} "
                         "overflow the registers")
    if rows % config.block_m:
        raise ValueError(f"{rows} rows are not whole tiles of {config.block_m}")
    bm, bn, bk, store_n = config.block_m, config.block_n, config.block_k, config.store_n
    row_tiles, col_blocks = rows // bm, n_out // bn
    programs = min(config.programs or streaming_multiprocessors(), row_tiles * col_blocks)
    if tile_rows is None:
        tile_rows = jnp.full(tile_group.shape, bm, jnp.int32)

    def body(tile_group_ref, tile_rows_ref, lhs_ref, rhs_ref, *refs):
        carry_ref, out_ref = (refs if carry is not None else (None, *refs))
        wg = lax.axis_index("wg")

        def pipeline(mma, compute_context, col_block):
            specs = [plgpu.BlockSpec((bm, bk), lambda kk: (0, kk), delay_release=1)]
            specs += [plgpu.BlockSpec((bk, bn), functools.partial(
                lambda kk, half: (kk, col_block + half * col_blocks), half=half),
                delay_release=1) for half in range(halves)]
            return plgpu.emit_pipeline_warp_specialized(
                mma, grid=(k_size // bk,), memory_registers=40, in_specs=specs, wg_axis="wg",
                num_compute_wgs=CONSUMERS, max_concurrent_steps=config.max_concurrent_steps,
                compute_context=compute_context)

        def operands(row_tile, group):
            return (lhs_ref.at[pl.ds(row_tile * bm, bm), pl.ds(k_start, k_size)],
                    *[rhs_ref.at[group, pl.ds(k_start, k_size)]] * halves)

        steps_per_range = k_size // bk // config.ranges

        # Shared memory of a multi-warpgroup kernel is allocated for all warpgroups at once:
        # the pipeline's buffers (sized with a placeholder body), each consumer's two output
        # slots and, with a carry, its carry piece and that copy's barrier.
        ignore = lambda *_, **__: None  # noqa: E731
        scratch = dict(allocations=pipeline(ignore, ignore, 0).get_allocations(*operands(0, 0)),
                       out_smem=plgpu.SMEM((CONSUMERS, 2, WG_ROWS, store_n), out_dtype))
        if carry is not None:
            scratch |= dict(carry_smem=plgpu.SMEM((CONSUMERS, WG_ROWS, store_n), jnp.float32),
                            carry_barrier=plgpu.Barrier(num_barriers=CONSUMERS))

        @functools.partial(pl.run_scoped, **scratch, collective_axes="wg")
        def scope(allocations, out_smem, carry_smem=None, carry_barrier=None):
            @plgpu.nd_loop((row_tiles * col_blocks,), collective_axes="program")
            def _(loop):
                row_tile, col_block = plgpu.planar_snake(loop.index[0], (row_tiles, col_blocks),
                                                         0, config.snake_width)
                group = tile_group_ref[row_tile]
                mine = tile_rows_ref[row_tile] > wg * WG_ROWS    # (consumers only ask)
                my_rows = pl.ds(row_tile * bm + wg * WG_ROWS, WG_ROWS)

                def mma(index, lhs_smem, *refs):
                    *w_smems, accs = refs          # accs: per K range, per half
                    rows_smem = lhs_smem.at[pl.ds(wg * WG_ROWS, WG_ROWS)]

                    @pl.when(mine)                 # (all padding: the slots are released)
                    def _():
                        for r in range(config.ranges):     # the step's range's accumulators
                            @pl.when(index[0] // steps_per_range == r)
                            def _():
                                for acc, w in zip(accs[r * halves:(r + 1) * halves], w_smems,
                                                  strict=True):
                                    plgpu.wgmma(acc, rows_smem, w)
                    plgpu.wgmma_wait(halves)       # retire the previous step's (slots refill)
                    return accs

                def compute_context(eval_pipeline):
                    def store(*accs):
                        sums = [acc[...] for acc in eval_pipeline(accs)]

                        @pl.when(mine)
                        def _():
                            # the previous tile's last copies may still read the slots
                            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                            for piece in range(bn // store_n):
                                cols = pl.ds(col_block * bn + piece * store_n, store_n)
                                part = [s[:, piece * store_n:(piece + 1) * store_n] for s in sums]
                                slot = out_smem.at[wg, piece % 2]
                                values = piece_values(part, cols)
                                plgpu.wait_smem_to_gmem(1, wait_read_only=True)  # its last copy
                                slot[...] = values.astype(out_dtype)
                                plgpu.commit_smem()
                                plgpu.copy_smem_to_gmem(slot, out_ref.at[my_rows, cols])

                    pl.run_scoped(store, *[plgpu.ACC((WG_ROWS, bn))
                                           for _ in range(config.ranges * halves)])

                def piece_values(part, cols):
                    if swiglu_limit is not None:
                        return epilogue(tuple(part), swiglu_limit)
                    if carry_ref is not None:
                        plgpu.copy_gmem_to_smem(carry_ref.at[my_rows, cols], carry_smem.at[wg],
                                                carry_barrier.at[wg])
                        plgpu.barrier_wait(carry_barrier.at[wg])
                        part = [carry_smem.at[wg][...], *part]
                    values = part[0]
                    for term in part[1:]:                 # first to last
                        values = values + term
                    return values

                @pl.when(group >= 0)
                def _():
                    pipeline(mma, compute_context, col_block)(
                        *operands(row_tile, jnp.maximum(group, 0)), allocations=allocations)

            plgpu.wait_smem_to_gmem(0, wait_read_only=True)   # before the slots go

    kernel = plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct((rows, n_out), out_dtype),
        grid=(programs,), grid_names=("program",), num_threads=CONSUMERS + 1, thread_name="wg",
        kernel_name=f"gemm_persistent_{bm}x{bn}x{bk}_k{k_size}_n{n_out}"
                    f"{f'_{config.ranges}ranges' if config.ranges > 1 else ''}"
                    f"{'_carry' if carry is not None else ''}"
                    f"{'_swiglu' if swiglu_limit is not None else ''}_{out_dtype.name}",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup))
    inputs = (tile_group, tile_rows, lhs, rhs) + ((carry,) if carry is not None else ())
    return kernel(*inputs)


def chained_matmul(x: jax.Array, w: jax.Array, *, splits: int = 1, out_dtype=None,
                   config: PersistentConfig = PersistentConfig()) -> jax.Array:
    """x [M, K] @ w [K, N] -> [M, N] in out_dtype (default x's): K in `splits` equal ranges,
    config.ranges of them per call, every call adding the float32 sum of the ranges before it
    (the split-K kernel's bits, see the module doc). M is padded to whole tiles here."""
    rows, k = x.shape
    config.check(k, w.shape[1], splits=splits)
    padded = jnp.pad(x, ((0, -rows % config.block_m), (0, 0)))
    calls = splits // config.ranges
    k_size = k // calls
    total = None
    for call in range(calls):
        last = call == calls - 1
        total = matmul(padded, w, total, k_start=call * k_size, k_size=k_size,
                       out_dtype=(out_dtype or x.dtype) if last else jnp.float32, config=config)
    return total[:rows]
