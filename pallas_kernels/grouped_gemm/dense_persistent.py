"""The dense GEMM for large batches (SM90): persistent programs, warp-specialised, K ranges chained.

`matmul(x, w, carry)`: x [M, K] @ w [K, N] over K rows [k_start, k_start + k_size), plus
carry f32 [M, N] when given, -> [M, N] in out_dtype; M a multiple of 128.

One program per SM loops over the 128 x block_n output tiles, in bands of `snake_width` row
tiles (`plgpu.planar_snake`), so the programs running at once share rows and columns in L2.
In each, a producer warpgroup streams the K blocks of x and w through shared memory while two
consumer warpgroups accumulate 64 rows x block_n each with wgmma. A consumer stores its
result in store_n-column pieces through two shared-memory slots: a piece's copy to global
memory runs while the next piece is converted, and the tile's last copies while the next
tile's main loop runs (the producer is already streaming it).

Batch-invariant mode splits K into S ranges fixed by the weight's shape (invariant.py,
`invariant_split_k`) and adds the ranges' float32 partial sums first to last. Here range s is
one call, whose epilogue adds the float32 sum of the ranges before it (`carry`) to its own:
the same additions in the same order as the one-warpgroup kernel's partials summed after it,
so the same bits, without S partials written and read back. Within a range a row's sum is
wgmma's over 64-wide K steps in order, as in the other kernels, whatever the tile.

Why this form: on the H200 jax's own example of it (jax.experimental.pallas.ops.gpu.
hopper_matmul_mgpu) reached 88-91% of the bf16 matmul ceiling at 4096 and 8192 rows, where
the per-tile kernels of this folder reached 56-66% (bench/results/kernels-dense-gpu.md).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

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


# Jitted: the model calls it per layer with the same shapes (one lowering per module).
@functools.partial(jax.jit, static_argnames=("k_start", "k_size", "out_dtype", "config"))
def matmul(x: jax.Array, w: jax.Array, carry: jax.Array | None = None, *, k_start: int = 0,
           k_size: int | None = None, out_dtype=None,
           config: PersistentConfig = PersistentConfig()) -> jax.Array:
    """x [M, K], w [K, N], carry f32[M, N] or None -> carry + x[:, ks] @ w[ks] in out_dtype
    (default x's), ks = k_start : k_start + k_size (default all of K), summed in float32.

    With config.ranges = R > 1, ks is R equal ranges summed apart in R accumulators and added
    first to last in the epilogue (after the carry): R ranges of the split without a float32
    round trip through memory between them."""
    m, k = x.shape
    n = w.shape[1]
    k_size = k - k_start if k_size is None else k_size
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    config.check(k_size, n, splits=config.ranges)
    if m % config.block_m:
        raise ValueError(f"M={m} must be a multiple of {config.block_m} (pad it: chained_matmul)")
    bm, bn, bk, store_n = config.block_m, config.block_n, config.block_k, config.store_n
    row_tiles, col_blocks = m // bm, n // bn
    programs = min(config.programs or streaming_multiprocessors(), row_tiles * col_blocks)

    def body(x_ref, w_ref, *refs):
        carry_ref, out_ref = (refs if carry is not None else (None, *refs))
        wg = lax.axis_index("wg")

        def pipeline(mma, compute_context):
            return plgpu.emit_pipeline_warp_specialized(
                mma, grid=(k_size // bk,), memory_registers=40,
                in_specs=[plgpu.BlockSpec((bm, bk), lambda kk: (0, kk), delay_release=1),
                          plgpu.BlockSpec((bk, bn), lambda kk: (kk, 0), delay_release=1)],
                wg_axis="wg", num_compute_wgs=CONSUMERS,
                max_concurrent_steps=config.max_concurrent_steps, compute_context=compute_context)

        def operands(row_tile, col_block):
            return (x_ref.at[pl.ds(row_tile * bm, bm), pl.ds(k_start, k_size)],
                    w_ref.at[pl.ds(k_start, k_size), pl.ds(col_block * bn, bn)])

        steps_per_range = k_size // bk // config.ranges

        def mma(index, x_smem, w_smem, accs):
            mine = x_smem.at[pl.ds(wg * WG_ROWS, WG_ROWS)]
            for r, acc in enumerate(accs):       # the step's range's accumulator
                @pl.when(index[0] // steps_per_range == r)
                def _():
                    plgpu.wgmma(acc, mine, w_smem)
            plgpu.wgmma_wait(1)           # retire the previous step's (its slots refill next)
            return accs

        # Shared memory of a multi-warpgroup kernel is allocated for all warpgroups at once:
        # the pipeline's buffers (sized with a placeholder body), each consumer's two output
        # slots and, with a carry, its carry piece and that copy's barrier.
        ignore = lambda *_, **__: None  # noqa: E731
        scratch = dict(allocations=pipeline(ignore, ignore).get_allocations(*operands(0, 0)),
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
                my_rows = pl.ds(row_tile * bm + wg * WG_ROWS, WG_ROWS)

                def compute_context(eval_pipeline):
                    def store(*accs):
                        sums = [acc[...] for acc in eval_pipeline(accs)]
                        # the previous tile's last copies may still read the slots
                        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                        for piece in range(bn // store_n):
                            cols = pl.ds(col_block * bn + piece * store_n, store_n)
                            parts = [part[:, piece * store_n:(piece + 1) * store_n]
                                     for part in sums]
                            if carry_ref is not None:
                                plgpu.copy_gmem_to_smem(carry_ref.at[my_rows, cols],
                                                        carry_smem.at[wg], carry_barrier.at[wg])
                                plgpu.barrier_wait(carry_barrier.at[wg])
                                parts.insert(0, carry_smem.at[wg][...])
                            values = parts[0]
                            for part in parts[1:]:           # first to last
                                values = values + part
                            slot = out_smem.at[wg, piece % 2]
                            plgpu.wait_smem_to_gmem(1, wait_read_only=True)   # its last copy
                            slot[...] = values.astype(out_dtype)
                            plgpu.commit_smem()
                            plgpu.copy_smem_to_gmem(slot, out_ref.at[my_rows, cols])

                    pl.run_scoped(store, *[plgpu.ACC((WG_ROWS, bn)) for _ in range(config.ranges)])

                pipeline(mma, compute_context)(*operands(row_tile, col_block),
                                               allocations=allocations)

            plgpu.wait_smem_to_gmem(0, wait_read_only=True)   # before the slots go

    kernel = plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct((m, n), out_dtype),
        grid=(programs,), grid_names=("program",), num_threads=CONSUMERS + 1, thread_name="wg",
        kernel_name=f"dense_persistent_{bm}x{bn}x{bk}_k{k_size}_n{n}"
                    f"{f'_{config.ranges}ranges' if config.ranges > 1 else ''}"
                    f"{'_carry' if carry is not None else ''}_{out_dtype.name}",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup))
    return kernel(x, w) if carry is None else kernel(x, w, carry)


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
