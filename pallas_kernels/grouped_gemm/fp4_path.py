"""The kernel path of the grouped GEMM and the expert MLP on FP4 weights (mosaic_gpu_fp4.py).

The kernel works on transposed operands: activations come in as x^T [K, tiled rows], results
go out as out^T [N, tiled rows]. This module moves rows in and out of that form with jnp (a
scatter into tiles and a transpose of the few activation rows; the weights are never
touched), and chains the expert MLP's two GEMMs in it: the gate/up kernel's out^T [I, tiled
rows] is the down kernel's x^T. On codes in the checkpoint's rows, K comes in the kernel's
nibble order (a gather of x^T's rows, and of the hidden rows between the GEMMs); on codes
in the engine's stored tiles, re-paired at load (fp4_layout.halves), in its own order.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import fp4_layout, quantized
from pallas_kernels.common import NotSupported, kernel_mode
from pallas_kernels.grouped_gemm import layout
from pallas_kernels.grouped_gemm.mosaic_gpu_fp4 import K_GRANULE, Fp4Config, nibble_order, tiled_fp4_matmul_t

KERNEL_DTYPES = (jnp.bfloat16,)


def default_config(num_rows: int, interpret: bool = False, op: str = "gate_up",
                   n_out: int = 128) -> Fp4Config:
    """Decode-sized batches: 16-token tiles (a hit expert usually has one or two rows);
    prefill-sized: 64-token tiles, fewer re-reads and re-dequantizations of each expert.
    Compiled: the PTX dequantization, 128-input steps 4 deep (two or more programs share an
    SM); the down projection's output rows in blocks of 128 (kernels-moe-fp4-sweep-gpu.md);
    at decode sizes each step's scales ride the K pipeline with its codes
    (kernels-fp4-probe2-gpu.md; bit-identical to staging them whole).
    Interpreted: the jnp form of the same bits."""
    if num_rows >= 4096:
        return Fp4Config(block_m=64, block_n=64, block_k=256, max_concurrent_steps=4,
                         a_in_registers=not interpret, dequant="bits" if interpret else "bits_ptx")
    wide = op == "down" and n_out % 128 == 0
    return Fp4Config(block_m=16, block_n=128 if wide else 64, block_k=128,
                     max_concurrent_steps=4, a_in_registers=not interpret,
                     dequant="bits" if interpret else "bits_ptx", scales_in_pipeline=True)


# The tiles the engine stores each FP4 stack in where the kernel runs (weights/fp4_tiles.py):
# one (block_n, block_k) per stack that decode's 16-token and prefill's 64-token tiles both
# read, faster than the row order's defaults at both (kernels-fp4-probe6-gpu-h100.md). Words
# where compiled (their dequantization is PTX); interpreted, the same tiles in bytes.
STORED_TILES = {"gate_up": (64, 128), "down": (128, 128)}


def stored_tile(w: quantized.Fp4Blocks, op: str, interpret: bool) -> quantized.Fp4Tile | None:
    """The tile the engine holds FP4 stack w (row order) in for `op` ("gate_up", "down");
    None where the kernel cannot read w so (its K not a multiple of the kernel's granule, or
    sizes the tile does not divide): w then stays in rows."""
    tile = quantized.Fp4Tile(*STORED_TILES[op], words=not interpret)
    k, n = w.shape[-2:]
    if k % K_GRANULE or k % tile.block_k or n % tile.block_n:
        return None
    return tile


# Persistent programs an SM at decode sizes (Fp4Config.programs_per_sm; 0: a program a pair,
# empty tiles' programs included). bench/depth_slope.py --fp4-programs-per-sm sets it per
# engine for its A/B; nothing else writes it.
DECODE_PROGRAMS_PER_SM = 0


def tiled_config(w: quantized.Fp4Blocks, num_rows: int, interpret: bool) -> Fp4Config:
    """The kernel's config for codes held in a tile order (`quantized.fp4_tile`): its tile's
    rows and inputs a step, tile-major; word codes with one wgmma a step where compiled."""
    tile = quantized.fp4_tile(w)
    if tile.words and interpret:
        raise NotSupported("FP4 kernel: word-ordered codes are read by the compiled kernel only")
    decode = num_rows < 4096
    return Fp4Config(block_m=16 if decode else 64, block_n=tile.block_n,
                     block_k=tile.block_k, max_concurrent_steps=4, a_in_registers=not interpret,
                     dequant="bits" if interpret else "bits_ptx", scales_in_pipeline=True,
                     tile_major=True, word_codes=fp4_layout.STORED_WORD_GROUPS * tile.words,
                     wgmma_per_step=tile.words,
                     programs_per_sm=DECODE_PROGRAMS_PER_SM if decode else 0)


def _config(w: quantized.Fp4Blocks, num_rows: int, interpret: bool, op: str,
            n_out: int, given: Fp4Config | None) -> Fp4Config:
    """The given config, or the default for w's code order; a config that reads another
    order than w's is refused."""
    tile = quantized.fp4_tile(w)
    if given is None:
        return (default_config(num_rows, interpret, op, n_out) if tile is None
                else tiled_config(w, num_rows, interpret))
    reads = None if not given.tile_major else quantized.Fp4Tile(
        given.block_n, given.block_k, given.word_codes > 0)
    if given.word_codes not in (0, fp4_layout.STORED_WORD_GROUPS) and tile is not None:
        reads = "another word order"
    if reads != tile:
        raise ValueError(f"FP4 kernel config reads codes as {reads}, the weights hold {tile}")
    return given


def _codes(w: quantized.Fp4Blocks) -> jax.Array:
    """The codes as the kernel takes them: rows [G, N, W], or tiles merged to [G, rows, w]."""
    if quantized.fp4_tile(w) is None:
        return w.packed
    return w.packed.reshape(w.packed.shape[0], -1, w.packed.shape[-1])


def _check(x: jax.Array, w: quantized.Fp4Blocks, n_out: int, config: Fp4Config) -> None:
    if jnp.dtype(x.dtype) not in KERNEL_DTYPES:
        raise NotSupported(f"FP4 kernel: activations {x.dtype}, not bf16")
    try:
        config.check(w.shape[-2], n_out)
    except ValueError as why:
        raise NotSupported(f"FP4 kernel: {why}") from None


def _to_kernel_form(rows: jax.Array, tiles: layout.TileLayout, block_m: int,
                    permuted: bool = True) -> jax.Array:
    """Sorted rows [M, K] -> x^T [K, T * block_m] (padding columns 0), in nibble order for
    weights paired as the checkpoint pairs them (`permuted`); codes held in the engine's
    tiles are re-paired so that the inputs come in their own order (fp4_layout.halves)."""
    x_t = layout.to_tiles(rows, tiles, block_m).T
    return x_t[jnp.asarray(nibble_order(rows.shape[1]))] if permuted else x_t


def _pairs_as_stored(w: quantized.Fp4Blocks) -> bool:
    """Whether w's nibbles pair inputs 2j and 2j + 1 (the checkpoint's rows), so that the
    activations must come in nibble order."""
    return quantized.fp4_tile(w) is None


def kernel_input(rows: jax.Array, group_sizes: jax.Array, block_m: int):
    """Rows sorted by group -> (x^T in the kernel's form, their tile layout)."""
    tiles = layout.tile_layout(group_sizes, rows.shape[0], block_m)
    return _to_kernel_form(rows, tiles, block_m), tiles


def _from_kernel_form(out_t: jax.Array, tiles: layout.TileLayout, order=None) -> jax.Array:
    return layout.from_tiles(out_t.T, tiles, order)


def grouped_matmul(lhs, w: quantized.Fp4Blocks, group_sizes, *, swiglu_limit, config, interpret):
    n_out = w.shape[-1] // (2 if swiglu_limit is not None else 1)
    config = _config(w, lhs.shape[0], interpret,
                     "gate_up" if swiglu_limit is not None else "down", n_out, config)
    _check(lhs, w, n_out, config)
    with kernel_mode(interpret):
        tiles = layout.tile_layout(group_sizes, lhs.shape[0], config.block_m)
        x_t = _to_kernel_form(lhs, tiles, config.block_m, _pairs_as_stored(w))
        out_t = tiled_fp4_matmul_t(x_t, _codes(w),
                                   w.scale, tiles.tile_group, swiglu_limit=swiglu_limit,
                                   config=config, out_dtype=lhs.dtype)
        return _from_kernel_form(out_t, tiles)


def expert_mlp(x, w13, w2, group_sizes, swiglu_limit, *, configs, source_rows, out_order,
               interpret):
    if not (isinstance(w13, quantized.Fp4Blocks) and isinstance(w2, quantized.Fp4Blocks)):
        raise NotSupported("FP4 kernel: both expert weights FP4")
    rows = x.shape[0] if source_rows is None else source_rows.shape[0]
    dim, inter = x.shape[1], w2.shape[-2]
    configs = configs or (None, None)
    up_cfg = _config(w13, rows, interpret, "gate_up", inter, configs[0])
    down_cfg = _config(w2, rows, interpret, "down", w2.shape[-1], configs[1])
    if up_cfg.block_m != down_cfg.block_m:
        raise ValueError("the gate/up and down kernels must tile the same rows")
    _check(x, w13, inter, up_cfg)
    _check(x, w2, dim, down_cfg)
    with kernel_mode(interpret):
        tiles = layout.tile_layout(group_sizes, rows, up_cfg.block_m)
        sorted_x = x if source_rows is None else x[source_rows]
        hidden_t = tiled_fp4_matmul_t(_to_kernel_form(sorted_x, tiles, up_cfg.block_m,
                                                      _pairs_as_stored(w13)),
                                      _codes(w13), w13.scale, tiles.tile_group,
                                      swiglu_limit=swiglu_limit, config=up_cfg,
                                      out_dtype=x.dtype)
        if _pairs_as_stored(w2):
            hidden_t = hidden_t[jnp.asarray(nibble_order(inter))]
        out_t = tiled_fp4_matmul_t(hidden_t, _codes(w2),
                                   w2.scale, tiles.tile_group, config=down_cfg,
                                   out_dtype=x.dtype)
        return _from_kernel_form(out_t, tiles, out_order)
