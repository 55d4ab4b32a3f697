"""E2M1 codes -> bf16 weights inside the FP4 kernel (mosaic_gpu_fp4.py), three formulations of
the same bits.

Each takes one scale group of a weight tile, u8[rows, 16] packed bytes (the low nibble an even
input, the high nibble an odd one), and returns the bf16 weights of its 16 even and 16 odd
inputs, bit for bit `quantized.dequantize`'s:

* "convert": a code becomes the E4M3 byte whose value is E2M1(c) * 2**-6, then E4M3 -> f16 ->
  f32, times 64 * scale in f32, rounded to bf16 (every step exact). About ten instructions a
  weight: the kernel is ALU-bound at decode on it.
* "bits": a code's bf16 bits built with integer ops, E2M1(c) * 2**-125 exactly (magnitude m:
  (m << 6) + 0x80 for m >= 2, the subnormal m = 1 as 0x80, sign at bit 15), then one bf16
  product with 2**(scale byte - 2). No operand is subnormal (XLA's CPU flushes those: the
  interpret mode runs this form). Needs scale bytes <= 129 (scales <= 4, weights <= 24) for
  the factor to be a bf16 number.
* "bits_ptx": the magnitude bits placed at bf16's exponent/mantissa boundary, (m << 6), are
  E2M1(c) * 2**-126 for every m (0.5 lands on bf16's subnormal 2**-127 with the same mantissa
  bit), times 2**(scale byte - 1) (bytes <= 128) with `mul.rn.bf16x2`, which keeps
  subnormals (PTX has no flush for bf16); on whole 32-bit registers in inline PTX (compiled
  kernels only: interpret mode cannot run it): per register of two packed bytes, one `prmt` spreads
  them to the two 16-bit halves, four shift/mask steps build each bf16x2 pair and one
  `mul.rn.bf16x2` scales it, about 2.75 instructions a weight.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.fp4_layout import word_major  # noqa: F401  (the codes' word order)

FORMULATIONS = ("convert", "bits", "bits_ptx")

# $2: a register holding two packed bytes (b0, b1: bytes 0 and 1, or 2 and 3: the `prmt`
# selector says which); $3: the bf16x2 multiplier (the same in both halves).
# t = b0 | b1 << 16; even = bf16x2 of the low nibbles, odd = of the high nibbles, each scaled.
# lop3 0xF8 = a | (b & c).
_PTX = """{
.reg .b32 t, a, b;
prmt.b32 t, $2, 0, SELECTOR;
shl.b32 a, t, 6;
and.b32 a, a, 0x01C001C0;
shl.b32 b, t, 12;
lop3.b32 a, a, b, 0x80008000, 0xF8;
mul.rn.bf16x2 $0, a, $3;
shl.b32 a, t, 2;
and.b32 a, a, 0x01C001C0;
shl.b32 b, t, 8;
lop3.b32 a, a, b, 0x80008000, 0xF8;
mul.rn.bf16x2 $1, a, $3;
}"""
LOW_PAIR, HIGH_PAIR = "0x4140", "0x4342"      # t from bytes 0 and 1, or from bytes 2 and 3


def factor_dtype(formulation: str):
    return jnp.float32 if formulation == "convert" else jnp.bfloat16


def scale_factor(scale_bytes: jax.Array, formulation: str, dtype=None) -> jax.Array:
    """E8M0 bytes -> the factor each formulation multiplies by: 64 * 2**(byte - 127)
    ("convert", f32), 2**(byte - 2) ("bits"), 2**(byte - 1) ("bits_ptx"), both bf16; built
    from bits (f32 and bf16 share their exponent field), exact powers of two."""
    offset = {"convert": 6, "bits": 125, "bits_ptx": 126}[formulation]
    if (dtype or factor_dtype(formulation)) == jnp.float32:
        return lax.bitcast_convert_type((scale_bytes.astype(jnp.uint32) + offset) << 23,
                                        jnp.float32)
    return lax.bitcast_convert_type((scale_bytes.astype(jnp.uint16) + offset) << 7, jnp.bfloat16)


def dequantize_group(packed16: jax.Array, factor: jax.Array,
                     formulation: str) -> tuple[jax.Array, jax.Array]:
    """u8[rows, 16] packed bytes of one scale group and its rows' factors (`scale_factor`,
    [rows] in `factor_dtype`) -> the bf16[rows, 16] weights of the group's even and odd inputs."""
    factor = lax.broadcast_in_dim(factor, packed16.shape, (0,))
    if formulation == "convert":
        return _convert(packed16.astype(jnp.uint16), factor)
    if formulation == "bits":
        return _bits(packed16.astype(jnp.uint16), factor)
    if formulation == "bits_ptx":
        return _bits_ptx(packed16, factor)
    raise ValueError(f"FP4 dequantization: {formulation!r}, expected one of {FORMULATIONS}")


def _convert(p: jax.Array, factor: jax.Array) -> tuple[jax.Array, jax.Array]:
    def value(e4m3_bits):
        e4m3 = lax.bitcast_convert_type(e4m3_bits.astype(jnp.uint8), jnp.float8_e4m3fn)
        return (e4m3.astype(jnp.float16).astype(jnp.float32) * factor).astype(jnp.bfloat16)

    low = ((p & 0x07) << 2) | ((p & 0x08) << 4)
    high = ((p >> 2) & 0x1C) | (p & 0x80)
    return value(low), value(high)


def _bits(p: jax.Array, factor: jax.Array) -> tuple[jax.Array, jax.Array]:
    def value(code):                                     # u16 codes 0..15
        magnitude, sign = code & 7, (code & 8) << 12
        bf16_bits = jnp.where(magnitude > 1, (magnitude << 6) + 0x80, magnitude << 7) | sign
        return lax.bitcast_convert_type(bf16_bits, jnp.bfloat16) * factor

    return value(p & 0x0F), value(p >> 4)


def dequantize_step(packed: jax.Array, factors: list[jax.Array]) -> jax.Array:
    """u8[rows, 16 * G] packed bytes of G scale groups and each group's row factors ("bits_ptx"
    `scale_factor`s, G arrays of [rows]) -> bf16[rows, 32 * G]: group j's 16 even inputs at
    columns [32j, 32j + 16), its 16 odd ones after them (the kernel's nibble order). "bits_ptx"
    only (compiled kernels): one array, so that one wgmma call takes a whole pipeline step."""
    rows, width = packed.shape
    out = plgpu.ShapeDtypeStruct((rows, 2 * width), jnp.bfloat16, layout=plgpu.Layout.WGMMA)
    wide = [lax.broadcast_in_dim(f, (rows, 16), (0,)) for f in factors]

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA,) * (1 + len(wide)), return_type=out)
    def step(ctx, packed, *factors):
        del ctx
        from jax.experimental import mosaic
        # WGMMA-layout registers are indexed [row tile, 8-column tile, ...]: a group's 16 bytes
        # are column tiles 2j and 2j + 1, its 32 weights column tiles 4j .. 4j + 3.
        regs = packed.registers
        weights = np.empty((regs.shape[0], 2 * regs.shape[1], *regs.shape[2:]), dtype=object)
        for index, reg in np.ndenumerate(regs):
            group, tile = divmod(index[1], 2)
            even, odd = _ptx_pair(reg, factors[group].registers[(index[0], tile, *index[2:])])
            weights[(index[0], 4 * group + tile, *index[2:])] = even
            weights[(index[0], 4 * group + 2 + tile, *index[2:])] = odd
        return mosaic.gpu.FragmentedArray(_registers=weights, _layout=packed.layout,
                                          _is_signed=None)

    return step(plgpu.layout_cast(packed, plgpu.Layout.WGMMA),
                *[plgpu.layout_cast(f, plgpu.Layout.WGMMA) for f in wide])


def _ptx_pair(two_bytes_reg, factor_reg):
    """Two packed bytes (a register of the u8 WGMMA layout) and their bf16x2 factor -> the
    bf16x2 registers of their low nibbles and of their high nibbles."""
    from jax.experimental.mosaic.gpu import utils
    from jaxlib.mlir import ir
    from jaxlib.mlir.dialects import arith

    i16, i32 = ir.IntegerType.get_signless(16), ir.IntegerType.get_signless(32)
    return _ptx_word_pair(arith.extui(i32, utils.bitcast(two_bytes_reg, i16)), LOW_PAIR,
                          factor_reg)


def _ptx_word_pair(word, selector: str, factor_reg):
    """A 32-bit register, which of its byte pairs (LOW_PAIR, HIGH_PAIR) and their bf16x2
    factor -> the bf16x2 registers of the pair's low nibbles and of its high nibbles."""
    from jax.experimental.mosaic.gpu import utils
    from jaxlib.mlir import ir

    i32 = ir.IntegerType.get_signless(32)
    pair = ir.VectorType.get((2,), ir.BF16Type.get())
    lo, hi = utils.inline_ptx(_PTX.replace("SELECTOR", selector), word,
                              utils.bitcast(factor_reg, i32), result_types=(i32, i32))
    return utils.bitcast(lo, pair), utils.bitcast(hi, pair)


# Words a thread loads at once -> the u32 layout that gives them to it: 2 words (8 bytes, two
# scale groups) in the WGMMA layout, 4 (16 bytes, four groups) in its 8-bit variant, whose
# rows are the WGMMA layout's and whose column quads are 16 elements wide.
WORD_LAYOUTS = {2: plgpu.Layout.WGMMA, 4: plgpu.Layout.WGMMA_8BIT}


def dequantize_words(words: jax.Array, factors: list[jax.Array], vector: int) -> jax.Array:
    """u32[rows, 4 * G] `word_major(vector)` codes of G scale groups (G a multiple of vector)
    and each group's row factors ("bits_ptx" `scale_factor`s, G arrays of [rows]) ->
    bf16[rows, 32 * G] in the kernel's nibble order, as `dequantize_step` gives from the same
    groups' bytes. "bits_ptx" only (compiled kernels)."""
    rows, width = words.shape
    out = plgpu.ShapeDtypeStruct((rows, 8 * width), jnp.bfloat16, layout=plgpu.Layout.WGMMA)
    wide = [lax.broadcast_in_dim(f, (rows, 16), (0,)) for f in factors]

    @plgpu.inline_mgpu(arg_types=(WORD_LAYOUTS[vector],) + (plgpu.Layout.WGMMA,) * len(wide),
                       return_type=out)
    def step(ctx, words, *factors):
        del ctx
        from jax.experimental import mosaic
        from jaxlib.mlir.dialects import vector as vector_ops
        # A word register at column tile c holds groups vector * c + e (element e); in each
        # word, bytes 0-1 are the group's first u8 column tile, bytes 2-3 its second. Both
        # layouts index registers [row tile, column tile, ...] with the same trailing dims.
        regs = words.registers
        weights = np.empty((regs.shape[0], 4 * vector * regs.shape[1], *regs.shape[2:]),
                           dtype=object)
        for index, reg in np.ndenumerate(regs):
            for element in range(vector):
                group = vector * index[1] + element
                word = vector_ops.extract(reg, [], [element])
                for tile, selector in enumerate((LOW_PAIR, HIGH_PAIR)):
                    factor = factors[group].registers[(index[0], tile, *index[2:])]
                    even, odd = _ptx_word_pair(word, selector, factor)
                    weights[(index[0], 4 * group + tile, *index[2:])] = even
                    weights[(index[0], 4 * group + 2 + tile, *index[2:])] = odd
        return mosaic.gpu.FragmentedArray(_registers=weights, _layout=factors[0].layout,
                                          _is_signed=None)

    return step(plgpu.layout_cast(words, WORD_LAYOUTS[vector]),
                *[plgpu.layout_cast(f, plgpu.Layout.WGMMA) for f in wide])


def _bits_ptx(packed16: jax.Array, factor: jax.Array) -> tuple[jax.Array, jax.Array]:
    out = plgpu.ShapeDtypeStruct(packed16.shape, jnp.bfloat16, layout=plgpu.Layout.WGMMA)

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, plgpu.Layout.WGMMA),
                       return_type=(out, out))
    def halves(ctx, packed, factors):
        del ctx
        from jax.experimental import mosaic
        even, odd = np.empty_like(packed.registers), np.empty_like(packed.registers)
        for index, reg in np.ndenumerate(packed.registers):
            even[index], odd[index] = _ptx_pair(reg, factors.registers[index])
        array = mosaic.gpu.FragmentedArray
        return (array(_registers=even, _layout=packed.layout, _is_signed=None),
                array(_registers=odd, _layout=packed.layout, _is_signed=None))

    return halves(plgpu.layout_cast(packed16, plgpu.Layout.WGMMA),
                  plgpu.layout_cast(factor, plgpu.Layout.WGMMA))
