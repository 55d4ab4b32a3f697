"""FP8 / FP4 / E8M0 decoding against values computed by hand from the bit layouts."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

from deepinfer_jax.weights import quant


def e4m3_by_hand(byte: int) -> float:
    """OCP E4M3 (fn): 1 sign, 4 exponent (bias 7), 3 mantissa bits; S.1111.111 is NaN."""
    sign = -1.0 if byte & 0x80 else 1.0
    exp, mant = (byte >> 3) & 0xF, byte & 0x7
    if exp == 0xF and mant == 0x7:
        return math.nan
    if exp == 0:
        return sign * (mant / 8) * 2.0 ** -6
    return sign * (1 + mant / 8) * 2.0 ** (exp - 7)


def e8m0_by_hand(byte: int) -> float:
    return math.nan if byte == 255 else 2.0 ** (byte - 127)


def e2m1_by_hand(code: int) -> float:
    sign = -1.0 if code & 0x8 else 1.0
    exp, mant = (code >> 1) & 0x3, code & 0x1
    return sign * (mant * 0.5 if exp == 0 else (1 + mant / 2) * 2.0 ** (exp - 1))


def fp8_codes(bytes_: np.ndarray) -> np.ndarray:
    return np.asarray(bytes_, np.uint8).view(ml_dtypes.float8_e4m3fn)


def e8m0(bytes_: np.ndarray) -> np.ndarray:
    return np.asarray(bytes_, np.uint8).view(ml_dtypes.float8_e8m0fnu)


@pytest.mark.parametrize("byte, value", [
    (0x38, 1.0), (0x7E, 448.0), (0xFE, -448.0), (0x01, 2.0 ** -9), (0x08, 2.0 ** -6),
    (0x07, 7 * 2.0 ** -9), (0xB8, -1.0), (0x3C, 1.5), (0x00, 0.0),
])
def test_e4m3_known_codes(byte, value):
    assert e4m3_by_hand(byte) == value
    got = quant.dequant_fp8(fp8_codes([[byte]]), e8m0([[127]]), (128, 128))
    assert got[0, 0] == value


def test_every_e4m3_code_decodes_as_its_bit_layout():
    codes = np.arange(256, dtype=np.uint8).reshape(16, 16)
    got = quant.dequant_fp8(fp8_codes(codes), e8m0([[127]]), (128, 128))
    want = np.vectorize(e4m3_by_hand)(codes)
    np.testing.assert_array_equal(got, want.astype(np.float32))  # NaNs at 0x7F, 0xFF compare equal


@pytest.mark.parametrize("scale_byte", [0, 1, 100, 126, 127, 128, 200, 254, 255])
def test_e8m0_scale_edges(scale_byte):
    """byte 0 is 2**-127 (smallest), 254 is 2**127, 255 is NaN."""
    got = quant.dequant_fp8(fp8_codes([[0x38, 0xB0]]), e8m0([[scale_byte]]), (128, 128))
    expected = e8m0_by_hand(scale_byte)
    np.testing.assert_array_equal(got, np.float32([[expected, -0.5 * expected]]))


def test_float32_scales_are_used_as_is():
    got = quant.dequant_fp8(fp8_codes([[0x38]]), np.float32([[0.3]]), (128, 128))
    assert got[0, 0] == np.float32(0.3)


def test_fp8_block_scales_tile_with_partial_edges():
    rng = np.random.default_rng(0)
    codes = rng.integers(0, 0x7E, size=(200, 300), dtype=np.uint8)   # finite positive codes
    scale = rng.integers(120, 135, size=(2, 3), dtype=np.uint8)     # ceil(200/128), ceil(300/128)
    got = quant.dequant_fp8(fp8_codes(codes), e8m0(scale), (128, 128))
    want = np.empty((200, 300))
    for r in range(200):
        for c in range(300):
            want[r, c] = e4m3_by_hand(int(codes[r, c])) * e8m0_by_hand(int(scale[r // 128, c // 128]))
    np.testing.assert_array_equal(got, want.astype(np.float32))


def test_fp8_rejects_a_scale_that_does_not_tile_the_weight():
    with pytest.raises(quant.QuantFormatError, match="scale shape"):
        quant.dequant_fp8(fp8_codes(np.zeros((200, 300))), e8m0(np.zeros((1, 3))), (128, 128))


def test_every_e2m1_code_and_the_nibble_order():
    # byte b holds element 2j in its low nibble and element 2j+1 in its high nibble
    packed = np.array([[(hi << 4) | lo for lo in range(16) for hi in range(16)]], np.uint8)
    values = quant.unpack_fp4(packed.view(np.int8))
    lows, highs = values[0, 0::2], values[0, 1::2]
    np.testing.assert_array_equal(lows, [e2m1_by_hand(lo) for lo in range(16) for _ in range(16)])
    np.testing.assert_array_equal(highs, [e2m1_by_hand(hi) for _ in range(16) for hi in range(16)])


def test_fp4_scales_apply_per_32_inputs():
    packed = np.full((2, 32), 0x22, np.uint8).view(np.int8)          # every element is 1.0
    scale = e8m0([[127, 129], [126, 0]])                              # 1, 4 | 0.5, 2**-127
    got = quant.dequant_fp4(packed, scale)
    want = np.repeat(np.array([[1.0, 4.0], [0.5, 2.0 ** -127]]), 32, axis=1)
    np.testing.assert_array_equal(got, want.astype(np.float32))


def test_fp4_rejects_a_scale_of_the_wrong_shape():
    with pytest.raises(quant.QuantFormatError):
        quant.dequant_fp4(np.zeros((2, 32), np.int8), e8m0(np.zeros((2, 1))))


def test_quantizers_round_trip_within_format_precision():
    rng = np.random.default_rng(1)
    w = rng.standard_normal((160, 256)).astype(np.float32) * 3
    codes, scale = quant.quantize_fp8(w)
    back = quant.dequant_fp8(codes, scale)
    # E4M3 keeps 3 mantissa bits: relative error <= 2**-4, and half a subnormal step
    # (2**-10 of the tile's scale) for elements far below the tile's maximum.
    tile_scale = np.repeat(np.repeat(scale.astype(np.float32), 128, 0), 128, 1)[:160, :256]
    assert np.all(np.abs(back - w) <= np.abs(w) * 2.0 ** -4 + tile_scale * 2.0 ** -10)
    packed, scale4 = quant.quantize_fp4(w)
    back4 = quant.dequant_fp4(packed, scale4)
    step = np.repeat(scale4.astype(np.float32), 32, axis=1)           # grid spacing <= 1 scaled unit
    assert np.all(np.abs(back4 - w) <= step + 1e-6)
    # values on the grid are fixed points of the round trip
    assert np.array_equal(quant.dequant_fp4(*quant.quantize_fp4(back4)), back4)


@pytest.mark.parametrize("block", [32, 128])
@pytest.mark.parametrize("shape", [(100, 70), (64, 256), (300, 40), (20, 20)])
def test_fp8_blocks_of_any_power_of_two_tile_dequantize_element_by_element(block, shape):
    """pallas_kernels' Fp8Blocks reads its tile (V4's 128, V4.1's 32) back from the codes' and
    scales' shapes, partial edge tiles included; the FP8 kernels' guard accepts the 128 grid
    only (or a single tile, where the two agree)."""
    import jax.numpy as jnp

    from pallas_kernels.quantized import dequantize, fp8_block, fp8_from_checkpoint, kernel_blocks

    rng = np.random.default_rng(block + shape[0])
    out_dim, in_dim = shape
    grid = (-(-out_dim // block), -(-in_dim // block))
    codes = rng.normal(size=shape).astype(ml_dtypes.float8_e4m3fn)
    scale = (rng.integers(120, 134, size=grid).astype(np.uint8)).view(ml_dtypes.float8_e8m0fnu)
    w = fp8_from_checkpoint(codes, scale)                       # [in, out]
    got = np.asarray(dequantize(w, jnp.float32))
    want = np.array([[float(codes[o, i]) * 2.0 ** (int(scale.view(np.uint8)[o // block, i // block])
                                                   - 127) for o in range(out_dim)]
                     for i in range(in_dim)], np.float32)
    np.testing.assert_array_equal(got, want)
    # in the [in, out] layout; an axis of one tile spans it with any power of two as large
    for derived, tiles, size in zip(fp8_block(w), grid[::-1], shape[::-1], strict=True):
        assert derived == block or tiles == 1 and derived >= size
    single = grid == (1, 1)
    assert kernel_blocks(w) == (block == 128 or single and max(shape) <= 128)
