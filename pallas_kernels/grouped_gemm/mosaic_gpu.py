"""The grouped GEMM as a Mosaic GPU kernel (SM90: TMA pipeline + wgmma).

One program per (tile, column block): a tile is `block_m` rows of one group (layout.py pads
groups to whole tiles), so the program streams that group's weight columns once through a
K pipeline (TMA into shared memory, `max_concurrent_steps` deep) and accumulates in f32
registers with wgmma, one step's wgmma left in flight while the next step's copies land.
Epilogues run on the accumulators: the clamped SwiGLU (gate and up column blocks accumulated
side by side, so the intermediate never goes to memory). FP8 weights are dequantized tile by
tile (E4M3 -> bf16 times the 128 x 128 block's scale, staged in shared memory: wgmma has no
bf16 x e4m3 form).

On the H200, decode-sized batches stream the expert weights near the copy bandwidth;
prefill-sized bf16 ones run faster on the warp-specialised kernel (mosaic_gpu_ws.py, their
default; figures: docs/performance-log.md). FP8 weights and the batch-invariant dense GEMM
below the persistent kernel's batch sizes (invariant.py) stay on this one.

Batch invariance: a row's result depends on its own row and its group's weights only, and
the K blocks are always summed in the same order (split_k: ranges summed apart, the caller
adding the partials in order, never a split chosen by M), so it is the same whatever
other rows are in the batch; with one group this is the batch-invariant dense GEMM.
An SM100 (tcgen05/TMEM) variant belongs in its own file, selected by compute capability.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

SCALE_BLOCK = 128


@dataclasses.dataclass(frozen=True)
class TileConfig:
    block_m: int = 64             # rows per tile (the wgmma M)
    block_n: int = 128            # output columns per program
    block_k: int = 64             # K per pipeline step
    max_concurrent_steps: int = 4
    split_k: int = 1              # K ranges summed by separate programs (f32 partials out)
    group_tiles: int = 0          # programs ordered by groups of this many row tiles (0: by tile)
    # FP8: the group's whole scale grid [K/128, N/128] copied into shared memory when a program
    # starts, so that a step reads its block's scale there, not from global memory in the
    # step's critical path (before its dequantization can begin).
    scales_in_smem: bool = False

    def check(self, k: int, n_out: int, fp8: bool, swiglu: bool = False) -> None:
        # block_n: 16-bit operands in shared memory take 32-byte swizzle tiles at the least:
        # 8 columns fail Mosaic GPU's layout inference (seen on the H200: a tiny router's 8).
        if self.block_m % 64 or self.block_n % 16 or not 0 < self.block_n <= 256:
            raise ValueError(f"wgmma tiles: block_m a multiple of 64, block_n of 16, <= 256 "
                             f"({self})")
        if self.max_concurrent_steps < 2:
            raise ValueError("the pipeline keeps one step's wgmma in flight: at least 2 steps")
        if k % (self.block_k * self.split_k) or n_out % self.block_n:
            raise ValueError(f"K={k} and N={n_out} must be multiples of "
                             f"{self.block_k} x {self.split_k} and {self.block_n}")
        if self.split_k > 1 and swiglu:
            raise ValueError("split K: no epilogue (the sums are partial)")
        if fp8 and (SCALE_BLOCK % self.block_k or SCALE_BLOCK % self.block_n):
            raise ValueError("with FP8 weights a tile must lie inside one 128 x 128 scale block")
        if fp8 and self.scales_in_smem and not scale_grid_fits(k, n_out * (1 + swiglu)):
            raise ValueError(f"scales_in_smem: a scale row of N={n_out} takes whole 16-byte "
                             f"pieces and the grid at most {MAX_SCALE_SMEM} bytes")


# TMA copies rows of whole 16-byte pieces (4 f32 scales: N % 512), and the grid shares the SM's
# shared memory with the pipeline (V4-Flash's largest, wq_b's and wo_b's: 8 KB).
MAX_SCALE_SMEM = 16 * 1024


def scale_grid_fits(k: int, n: int) -> bool:
    return n % (4 * SCALE_BLOCK) == 0 and 4 * (-(-k // SCALE_BLOCK)) * (n // SCALE_BLOCK) \
        <= MAX_SCALE_SMEM


def kernel_name(kind: str, config, k: int, n_out: int, swiglu_limit: float | None,
                fp8: bool) -> str:
    """The compiled kernel's symbol, so that a profile tells the GEMMs of a step apart:
    e.g. grouped_gemm_64x128x64_k4096_n1024 (tile rows x columns x K step, then the shape)."""
    tile = f"{config.block_m}x{config.block_n}x{config.block_k}"
    splits, grouped = getattr(config, "split_k", 1), getattr(config, "group_tiles", 0)
    return "_".join([kind, tile, f"k{k}", f"n{n_out}"] + [f"split{splits}"] * (splits > 1)
                    + [f"by{grouped}tiles"] * (grouped > 0)
                    + ["swiglu"] * (swiglu_limit is not None) + ["fp8"] * fp8
                    + ["smem_scales"] * (fp8 and getattr(config, "scales_in_smem", False)))


def program_grid(tiles: int, columns: int, splits: int, group_tiles: int) -> tuple[int, ...]:
    return (tiles, columns, splits) if not group_tiles else (tiles * columns, splits)


def program_tile_and_column(tiles: int, columns: int, group_tiles: int):
    """This program's (row tile, column block). Programs run roughly in the grid's order,
    the last axis fastest: by row tile, each sweeping every column block, so a weight wider
    than the L2 cache is read again from memory for every row tile (so, on the H200, the
    dense GEMM's wq_b at M = 256 runs well behind XLA's dot: docs/performance-log.md). With
    group_tiles = G the programs sweep the column blocks for G row tiles at a time, the G
    programs of one column block adjacent: the weight block is read once for all G, and the
    G input tiles stay in L2 across the sweep."""
    if not group_tiles:
        return lax.axis_index("tile"), lax.axis_index("col")
    program, per_group = lax.axis_index("program"), group_tiles * columns
    group = program // per_group
    first = group * group_tiles
    size = jnp.minimum(group_tiles, tiles - first)      # the last group may be short
    within = program - group * per_group
    return first + within % size, within // size


def epilogue(accs: tuple[jax.Array, ...], swiglu_limit: float | None) -> jax.Array:
    """The f32 accumulators -> the tile's result: the accumulator itself, or the clamped
    SwiGLU of the gate and up accumulators, silu(min(gate, L)) * clip(up, -L, L) (L = 0: no
    clamp), in the elementwise ops Mosaic GPU lowers."""
    if swiglu_limit is None:
        (result,) = accs
        return result
    gate, up = accs
    if swiglu_limit > 0:
        gate = jnp.minimum(gate, swiglu_limit)
        up = jnp.minimum(jnp.maximum(up, -swiglu_limit), swiglu_limit)
    return gate / (1.0 + jnp.exp(-gate)) * up


def stage_fp8(w_smem, scale: jax.Array, staging) -> None:
    """One step's FP8 tile -> its bf16 weights in `staging`, in shared memory for the wgmma:
    E4M3 -> f32, times the block's f32 scale, rounded once (`quantized.dequantize`'s order)."""
    staging[...] = (w_smem[...].astype(jnp.float32) * scale).astype(staging.dtype)
    plgpu.commit_smem()


# Jitted: the model calls it per layer with the same shapes, and jax lowers a jitted callee
# once per module (Mosaic GPU lowering is ~0.1-0.5 s a kernel).
@functools.partial(jax.jit, static_argnames=("swiglu_limit", "config", "out_dtype"))
def tiled_group_matmul(lhs: jax.Array, rhs: jax.Array, tile_group: jax.Array,
                       rhs_scale: jax.Array | None = None, *, swiglu_limit: float | None = None,
                       config: TileConfig = TileConfig(), out_dtype=None) -> jax.Array:
    """lhs [T * block_m, K] (tile t belongs to group tile_group[t]; -1: unused), rhs [G, K, N]
    (bf16, or FP8 E4M3 with rhs_scale f32[G, K/128, N/128]) -> [T * block_m, N] in out_dtype
    (default: lhs's dtype) ([.., N/2] with the SwiGLU epilogue: rhs holds gate | up). Unused tiles stay
    unwritten. With config.split_k = S > 1: f32[S, T * block_m, N], the sums over each of S
    consecutive K ranges (the caller adds them, in a fixed order for batch invariance)."""
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    rows, k = lhs.shape
    n = rhs.shape[2]
    n_out = n // 2 if swiglu_limit is not None else n
    fp8 = rhs_scale is not None
    config.check(k, n_out, fp8, swiglu_limit is not None)
    splits, steps = config.split_k, k // (bk * config.split_k)   # K steps per program
    halves = 2 if swiglu_limit is not None else 1     # gate and up column blocks

    scales_in_smem = fp8 and config.scales_in_smem

    def body(tile_group_ref, lhs_ref, rhs_ref, *refs, dequantized=None, scale_smem=None,
             scale_bar=None):
        scale_ref, out_ref = refs if fp8 else (None, *refs)
        tile, col = program_tile_and_column(rows // bm, n_out // bn, config.group_tiles)
        first = lax.axis_index("split") * steps if splits > 1 else 0     # of its K steps
        group = tile_group_ref[tile]

        def block_scale(kb, nb):
            return scale_smem[kb, nb] if scales_in_smem else scale_ref[group, kb, nb]

        def accumulate(*accs):
            def step(index, lhs_smem, *rhs_smems):
                (kk,) = index
                for half, (acc, w) in enumerate(zip(accs, rhs_smems, strict=True)):
                    if fp8:   # staging alternates between two slots, see the wait below
                        scale = block_scale(((first + kk) * bk) // SCALE_BLOCK,
                                            (col * bn + half * n_out) // SCALE_BLOCK)
                        staging = dequantized.at[kk % 2, half]
                        stage_fp8(w, scale, staging)
                        w = staging
                    plgpu.wgmma(acc, lhs_smem, w)
                # Keep this step's wgmmas in flight but retire the previous step's: its
                # shared-memory slot (and FP8 staging slot) is refilled next (delay_release=1).
                plgpu.wgmma_wait(halves)

            specs = [plgpu.BlockSpec((bm, bk), lambda kk: (tile, first + kk), delay_release=1)]
            specs += [plgpu.BlockSpec((bk, bn), functools.partial(
                lambda kk, half: (first + kk, col + half * (n_out // bn)), half=half),
                delay_release=1) for half in range(halves)]
            plgpu.emit_pipeline(step, grid=(steps,), in_specs=specs,
                                max_concurrent_steps=config.max_concurrent_steps)(
                lhs_ref, *[rhs_ref.at[group]] * halves)
            return tuple(acc[...] for acc in accs)

        @pl.when(group >= 0)
        def _():
            if scales_in_smem:
                plgpu.copy_gmem_to_smem(scale_ref.at[group], scale_smem, scale_bar.at[0])
                plgpu.barrier_wait(scale_bar.at[0])
            result = epilogue(pl.run_scoped(accumulate, *[plgpu.ACC((bm, bn))
                                                          for _ in range(halves)]), swiglu_limit)

            @functools.partial(pl.run_scoped, out_smem=plgpu.SMEM((bm, bn), out_ref.dtype))
            def store(out_smem):
                out_smem[...] = result.astype(out_smem.dtype)
                plgpu.commit_smem()
                dest = out_ref.at[lax.axis_index("split")] if splits > 1 else out_ref
                plgpu.copy_smem_to_gmem(out_smem, dest.at[pl.ds(tile * bm, bm),
                                                          pl.ds(col * bn, bn)])
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    scratch = {}
    if fp8:
        scratch["dequantized"] = plgpu.SMEM((2, halves, bk, bn), lhs.dtype)
    if scales_in_smem:
        scratch["scale_smem"] = plgpu.SMEM(rhs_scale.shape[1:], jnp.float32)
        scratch["scale_bar"] = plgpu.Barrier(num_barriers=1)
    out_type = (jax.ShapeDtypeStruct((rows, n_out), out_dtype or lhs.dtype) if splits == 1 else
                jax.ShapeDtypeStruct((splits, rows, n_out), jnp.float32))
    kernel = plgpu.kernel(
        body, out_type=out_type, scratch_types=scratch,
        grid=program_grid(rows // bm, n_out // bn, splits, config.group_tiles),
        grid_names=("tile", "col", "split") if not config.group_tiles else ("program", "split"),
        kernel_name=kernel_name("grouped_gemm", config, k, n_out, swiglu_limit, fp8),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup))
    return kernel(tile_group, lhs, rhs, *((rhs_scale,) if fp8 else ()))
