"""The grouped GEMM on FP4 weights as a Mosaic GPU kernel (SM90), dequantizing as it reads.

Weights stay as stored (`quantized.Fp4Blocks`: E2M1 codes packed two a byte along K, `[G, N,
K/2]`, one E8M0 scale byte per 32 inputs of a row, group-major `[G, K/32, N]`), so the kernel computes the
transposed product out^T = W x^T: the weight rows are wgmma's M side (64 per instruction), the
tokens of one tile its N side (`block_m`, 8 to 256), and the packed bytes go from shared memory
into registers, where they become wgmma's A operand:

* each code becomes its bf16 weight exactly, bit for bit `quantized.dequantize`'s (the
  formulations, and their limits on scale bytes, are fp4_dequant.py's);
* the low nibbles of a row's 16 bytes of one scale group are 16 even inputs, the high nibbles
  the 16 odd ones: the activations come in "nibble order" (`nibble_order`: in every group of
  32 inputs the even ones first, then the odd ones), so each half-group is one K=16 wgmma with
  one scale per row;
* the scales of a program's rows are staged in shared memory once per program, 16 groups a
  piece ([16, rows]: group-major, as Fp4Blocks keeps them); a group's scales are one
  shared-memory row, loaded along the weight rows and broadcast along K.

Interpret mode (the CPU) has no register-A wgmma: there (`Fp4Config.a_in_registers=False`) the
same bf16 operand is staged in shared memory first, which the compiled kernel can also do.

One program per (row tile, block of `block_n` weight rows), or persistent programs looping
over the used tiles' pairs (`Fp4Config.programs_per_sm`); the K loop is a TMA pipeline over
`block_k` inputs a step. SwiGLU: the gate rows' and the up rows' accumulators side by side
(`w13` stores gate rows first). Only the hit experts' bytes are read; no bf16 copy of a weight
is ever written to memory. A row's result depends on its own tokens column and its expert only,
summed in a fixed K order: batch-invariant.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import fp4_layout
from pallas_kernels.grouped_gemm import fp4_dequant
from pallas_kernels.grouped_gemm.mosaic_gpu import epilogue
from pallas_kernels.grouped_gemm.mosaic_gpu_persistent import streaming_multiprocessors

GROUP = 32                 # inputs per scale byte
CHUNK = 16                 # scale bytes per TMA row piece (TMA's 16-byte minimum)
X_SWIZZLE = 32             # bytes: wgmma's K step is then 16 bf16 rows of x^T, one half-group
# K must be a multiple of this (scale rows staged in 16-byte pieces): the loaders zero-pad
# FP4 expert stacks whose intermediate size is not (deepinfer_jax/weights/fp4_pad.py).
K_GRANULE = CHUNK * GROUP


@dataclasses.dataclass(frozen=True)
class Fp4Config:
    block_m: int = 16              # tokens per tile (wgmma N)
    block_n: int = 64              # weight rows per program (wgmma M; a multiple of 64)
    block_k: int = 256             # inputs per pipeline step
    max_concurrent_steps: int = 4
    a_in_registers: bool = True    # False: the dequantized operand goes through shared memory
    dequant: str = "convert"       # fp4_dequant.FORMULATIONS ("bits_ptx": compiled only)
    # Independent accumulators per weight half, each K16 wgmma i going to chain i % k_chains,
    # summed in chain order at the end: at 16-token tiles a wgmma does little work, and one
    # chain of them waits out every wgmma's latency in turn.
    k_chains: int = 1
    # Each step's scales fetched by the K pipeline with its codes ([K/32 per step, rows]),
    # instead of a program's whole scale rows staged before its first step: no serial
    # round trip ahead of the pipeline, and less shared memory a program.
    scales_in_pipeline: bool = False
    # The codes come tile-major (`tile_major`): each program step's [block_n, block_k/2] bytes
    # one contiguous piece of memory, instead of block_n rows of block_k/2 bytes strided by K/2.
    tile_major: bool = False
    # Bytes of the codes' shared-memory swizzle (0: none): unswizzled, the rows of a step's
    # tile are 64-256 bytes apart, and the eight rows a warp loads at once share their banks.
    codes_swizzle: int = 0
    # A step's weights of a half dequantized as one [block_n, block_k] operand and multiplied
    # by one wgmma call: one fence and one commit a half and step instead of one per 16 inputs,
    # and the groups' dequantization free to interleave ("bits_ptx" in registers only).
    wgmma_per_step: bool = False
    # The codes come as 32-bit words (`fp4_dequant.word_major(word_codes)`), each thread's
    # bytes of word_codes scale groups one shared-memory load of word_codes words where u8
    # codes take 2 * word_codes 2-byte ones (0: u8 codes; 2 or 4; "bits_ptx" in registers
    # only; block_k a multiple of 32 * word_codes).
    word_codes: int = 0
    # Persistent programs, this many per SM (0: one program per pair of a row tile and a block
    # of weight rows). Each loops over the pairs of the used tiles only: a decode bucket pads
    # its rows to tiles that mostly hold none (1 token of a 16-token bucket: 6 of 96 used), and
    # one program per pair launches those empty programs too. Pipelined scales only.
    programs_per_sm: int = 0

    def check(self, k: int, n_out: int) -> None:
        if self.block_m % 8 or not 8 <= self.block_m <= 256:
            raise ValueError(f"block_m: a multiple of 8 up to 256 ({self})")
        if self.block_n % 64 or n_out % self.block_n:
            raise ValueError(f"block_n a multiple of 64 dividing N={n_out} ({self})")
        if self.block_k % GROUP or CHUNK * GROUP % self.block_k or k % self.block_k:
            raise ValueError(f"block_k a multiple of 32 dividing 512 and K={k} ({self})")
        if k % K_GRANULE:
            raise ValueError(f"K={k}: scale rows are staged in 16-byte pieces "
                             f"(K % {K_GRANULE})")
        if self.max_concurrent_steps < 2:
            raise ValueError("at least 2 pipeline steps")
        if self.k_chains not in (1, 2, 4):
            raise ValueError(f"k_chains: 1, 2 or 4 ({self})")
        if self.codes_swizzle not in (0, 32, 64, 128) or self.block_k // 2 % max(self.codes_swizzle, 1):
            raise ValueError(f"codes_swizzle: 0, 32, 64 or 128 bytes dividing block_k/2 ({self})")
        if self.wgmma_per_step and (self.dequant != "bits_ptx" or not self.a_in_registers
                                    or self.k_chains != 1):
            raise ValueError(f"wgmma_per_step: bits_ptx in registers, one chain ({self})")
        if self.word_codes not in (0, *fp4_dequant.WORD_LAYOUTS) or self.word_codes and (
                self.dequant != "bits_ptx" or not self.a_in_registers
                or self.block_k % (GROUP * self.word_codes) or self.codes_swizzle):
            raise ValueError(f"word_codes: 0, 2 or 4; bits_ptx in registers, block_k a "
                             f"multiple of 32 * word_codes, codes unswizzled ({self})")
        if self.programs_per_sm < 0 or self.programs_per_sm and not self.scales_in_pipeline:
            raise ValueError(f"programs_per_sm: 0, or persistent programs with the scales in "
                             f"the pipeline ({self})")
        if self.dequant not in fp4_dequant.FORMULATIONS:
            raise ValueError(f"dequant: one of {fp4_dequant.FORMULATIONS} ({self})")


def nibble_order(k: int) -> np.ndarray:
    """The input order the kernel reads activations in: position p holds input perm[p]
    (in each group of 32, the 16 even inputs, then the 16 odd ones)."""
    within = np.concatenate([np.arange(0, GROUP, 2), np.arange(1, GROUP, 2)])
    return (np.arange(0, k, GROUP)[:, None] + within[None, :]).reshape(-1)


def kernel_name(config: Fp4Config, k: int, n_out: int, swiglu: bool) -> str:
    c = config
    return "_".join(["grouped_gemm_fp4", f"{c.block_n}x{c.block_m}x{c.block_k}",
                     f"k{k}", f"n{n_out}"] + ["swiglu"] * swiglu
                    + ["smem_a"] * (not c.a_in_registers) + ["pipelined_scales"] * c.scales_in_pipeline
                    + [f"chains{c.k_chains}"] * (c.k_chains > 1) + ["tile_major"] * c.tile_major
                    + [f"swizzle{c.codes_swizzle}"] * (c.codes_swizzle > 0)
                    + ["step_wgmma"] * c.wgmma_per_step + [f"words{c.word_codes}"] * (c.word_codes > 0)
                    + [f"persistent{c.programs_per_sm}"] * (c.programs_per_sm > 0))


def inputs_per_element(packed: jax.Array) -> int:
    """Codes a stored element holds: 2 in a byte, 8 in a `word_major` word."""
    return 8 if packed.dtype == jnp.uint32 else 2


def tile_major(packed: jax.Array, block_n: int, block_k: int) -> jax.Array:
    """u8[G, N, K/2] -> u8[G, (N/block_n) * (K/block_k) * block_n, block_k/2]: row block r's
    step s is rows [(r * K/block_k + s) * block_n, +block_n), one contiguous piece (and the
    same of u32[G, N, K/8] word-major codes); fp4_layout.to_tiles with its tile axes merged."""
    return fp4_layout.to_tiles(packed, block_n, block_k).reshape(packed.shape[0], -1,
                                                                 block_k // inputs_per_element(packed))


@functools.partial(jax.jit, static_argnames=("swiglu_limit", "config", "out_dtype"))
def tiled_fp4_matmul_t(x_t: jax.Array, packed: jax.Array, scale: jax.Array,
                       tile_group: jax.Array, *, swiglu_limit: float | None = None,
                       config: Fp4Config = Fp4Config(), out_dtype=jnp.bfloat16) -> jax.Array:
    """x_t bf16[K, T * block_m] (columns = tiled rows, K in `nibble_order`; tile t belongs to
    group tile_group[t], -1: unused), packed u8[G, N, K/2] (`tile_major` form if the config
    says so; u32[G, N, K/8] `fp4_dequant.word_major` words with `word_codes` > 0), scale
    u8[G, K/32, N] ->
    out_t [N_out, T * block_m] (N_out = N, or N/2 with the SwiGLU epilogue: rows [0, N/2) of
    the weight are the gate, the rest the up projection). Unused tiles' columns stay unwritten.
    The used tiles come first (as layout.tile_layout lays them out): persistent programs
    count them and stop there."""
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    k, cols = x_t.shape
    n = scale.shape[-1]
    halves = 2 if swiglu_limit is not None else 1
    n_out = n // halves
    config.check(k, n_out)
    if (packed.dtype == jnp.uint32) != (config.word_codes > 0):
        raise ValueError(f"codes {packed.dtype}: word_codes={config.word_codes} reads "
                         f"{'u32 words' if config.word_codes else 'u8 bytes'}")
    per = inputs_per_element(packed)
    steps, chunks = k // bk, k // (GROUP * CHUNK)
    groups_per_step = bk // GROUP
    x_transforms = (plgpu.TilingTransform((8, X_SWIZZLE // 2)), plgpu.SwizzleTransform(X_SWIZZLE))
    a_transforms = (plgpu.TilingTransform((8, 16)), plgpu.SwizzleTransform(32))
    pipelined = config.scales_in_pipeline
    sw = config.codes_swizzle
    w_transforms = (plgpu.TilingTransform((8, sw)), plgpu.SwizzleTransform(sw)) if sw else ()
    if not pipelined:
        scale = scale.reshape(scale.shape[0], chunks, CHUNK, n)      # [G, chunks, 16, N]

    def body(tile_group_ref, x_ref, packed_ref, scale_ref, out_ref, scale_smem=None,
             scale_bars=None, staging=None):
        pair(lax.axis_index("tile"), lax.axis_index("col"), tile_group_ref, x_ref, packed_ref,
             scale_ref, out_ref, scale_smem, scale_bars, staging)

    def persistent_body(tile_group_ref, used_tiles_ref, x_ref, packed_ref, scale_ref, out_ref,
                        staging=None):
        # the used tiles come first (layout.tile_layout): the loop covers their pairs only
        @plgpu.nd_loop((used_tiles_ref[0], n_out // bn), collective_axes="program")
        def _(loop):
            tile, col = loop.index
            pair(tile, col, tile_group_ref, x_ref, packed_ref, scale_ref, out_ref, None, None,
                 staging)

    def pair(tile, col, tile_group_ref, x_ref, packed_ref, scale_ref, out_ref, scale_smem,
             scale_bars, staging):
        """One row tile's product with one block of bn weight rows (of each half)."""
        group = tile_group_ref[tile]

        def weight_rows(half):            # the block of weight rows a half reads, in blocks
            return col + half * (n_out // bn)

        @pl.when(group >= 0)
        def _():
            for half in range(halves * (not pipelined)):
                rows = pl.ds((col + half * (n_out // bn)) * bn, bn)
                for c in range(chunks):
                    plgpu.copy_gmem_to_smem(scale_ref.at[group, c, :, rows],
                                            scale_smem.at[half, c], scale_bars.at[half * chunks + c])
            for half in range(halves * (not pipelined)):
                for c in range(chunks):
                    plgpu.barrier_wait(scale_bars.at[half * chunks + c])

            chains = config.k_chains

            def accumulate(*flat_accs):
                accs = [flat_accs[h * chains:(h + 1) * chains] for h in range(halves)]

                def step(index, x_smem, *smems):
                    (kk,) = index
                    first = kk * groups_per_step            # the step's first scale group
                    for half, chain_accs in enumerate(accs):
                        w = plgpu.load(smems[half], layout=fp4_dequant.WORD_LAYOUTS.get(
                            config.word_codes, plgpu.Layout.WGMMA))
                        if pipelined:                       # [groups_per_step, bn]
                            chunk_ref, row = smems[halves + half], 0
                        else:                               # [16, bn], from the step's first
                            chunk_ref = scale_smem.at[half, first // CHUNK]
                            row = first % CHUNK
                        factors = [fp4_dequant.scale_factor(
                            plgpu.load(chunk_ref.at[row + j], (),
                                       layout=plgpu.Layout.WGMMA.reduce(1)), config.dequant)
                            for j in range(groups_per_step)]
                        if config.word_codes:
                            a_step = fp4_dequant.dequantize_words(w, factors, config.word_codes)
                        elif config.wgmma_per_step:
                            a_step = fp4_dequant.dequantize_step(w, factors)
                        if config.wgmma_per_step:
                            plgpu.wgmma(chain_accs[0], a_step, x_smem)
                            continue
                        for j, factor in enumerate(factors):
                            both = ((a_step[:, GROUP * j:GROUP * j + 16],
                                     a_step[:, GROUP * j + 16:GROUP * (j + 1)])
                                    if config.word_codes else
                                    fp4_dequant.dequantize_group(w[:, 16 * j:16 * (j + 1)],
                                                                 factor, config.dequant))
                            for parity, a in enumerate(both):
                                if staging is not None:
                                    slot = staging.at[parity]
                                    slot[...] = a
                                    plgpu.commit_smem()
                                    a = slot
                                acc = chain_accs[(2 * j + parity) % chains]
                                plgpu.wgmma(acc, a, x_smem.at[pl.ds(GROUP * j + 16 * parity, 16)])
                            if staging is not None:
                                plgpu.wgmma_wait(0)     # the slots are rewritten next group
                    plgpu.wgmma_wait(0)     # the step's slots are released when it returns

                specs = [plgpu.BlockSpec((bk, bm), lambda kk: (kk, tile), transforms=x_transforms)]
                if config.tile_major:
                    specs += [plgpu.BlockSpec((bn, bk // per), functools.partial(
                        lambda kk, half: (weight_rows(half) * steps + kk, 0), half=half),
                        transforms=w_transforms) for half in range(halves)]
                else:
                    specs += [plgpu.BlockSpec((bn, bk // per), functools.partial(
                        lambda kk, half: (weight_rows(half), kk), half=half),
                        transforms=w_transforms) for half in range(halves)]
                inputs = [x_ref, *[packed_ref.at[group]] * halves]
                if pipelined:
                    specs += [plgpu.BlockSpec((groups_per_step, bn), functools.partial(
                        lambda kk, half: (kk, weight_rows(half)), half=half))
                        for half in range(halves)]
                    inputs += [scale_ref.at[group]] * halves
                plgpu.emit_pipeline(step, grid=(steps,), in_specs=specs,
                                    max_concurrent_steps=config.max_concurrent_steps)(*inputs)
                return tuple(functools.reduce(lambda total, acc: total + acc[...], chain[1:],
                                              chain[0][...]) for chain in accs)

            result = epilogue(pl.run_scoped(accumulate, *[plgpu.ACC((bn, bm))
                                                          for _ in range(halves * chains)]),
                              swiglu_limit)

            @functools.partial(pl.run_scoped, out_smem=plgpu.SMEM((bn, bm), out_dtype))
            def store(out_smem):
                out_smem[...] = result.astype(out_dtype)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(out_smem, out_ref.at[pl.ds(col * bn, bn),
                                                             pl.ds(tile * bm, bm)])
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    scratch = {} if pipelined else {
        "scale_smem": plgpu.SMEM((halves, chunks, CHUNK, bn), jnp.uint8),
        "scale_bars": plgpu.Barrier(num_barriers=halves * chunks)}
    if not config.a_in_registers:
        scratch["staging"] = plgpu.SMEM((2, bn, 16), jnp.bfloat16, transforms=a_transforms)
    name = kernel_name(config, k, n_out, swiglu_limit is not None)
    out_type = jax.ShapeDtypeStruct((n_out, cols), out_dtype)
    if not config.programs_per_sm:
        kernel = plgpu.kernel(body, out_type=out_type, scratch_types=scratch,
                              grid=(cols // bm, n_out // bn), grid_names=("tile", "col"),
                              kernel_name=name)
        return kernel(tile_group, x_t, packed, scale)
    pairs = cols // bm * (n_out // bn)
    programs = min(pairs, config.programs_per_sm * streaming_multiprocessors())
    kernel = plgpu.kernel(persistent_body, out_type=out_type, scratch_types=scratch,
                          grid=(programs,), grid_names=("program",), kernel_name=name)
    used_tiles = jnp.sum(tile_group >= 0, dtype=jnp.int32).reshape(1)
    return kernel(tile_group, used_tiles, x_t, packed, scale)
