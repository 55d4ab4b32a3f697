"""The release's quantised weight formats, decoded on the host with numpy.

* FP8: E4M3 codes `[out, in]` with one E8M0 (power-of-two) scale per 128x128 tile,
  `scale[ceil(out/128), ceil(in/128)]`; W = code * scale[r // 128, c // 128].
* FP4 (routed experts): E2M1 codes packed two per int8 along the input axis (low nibble =
  even column), one E8M0 scale per 32 inputs, `scale[out, in/32]`.
E8M0 byte b means 2**(b - 127); 255 is NaN. Scales stored as float32 (Flash-Base) are used as is.

The quantisers here write the same formats (power-of-two scales, round to nearest); tests and
tools use them to make quantised checkpoints.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np

FP8_MAX = 448.0
FP4_GROUP = 32
# E2M1 magnitudes by 3-bit code; bit 3 is the sign.
_FP4_MAGNITUDES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)
FP4_VALUES = np.concatenate([_FP4_MAGNITUDES, -_FP4_MAGNITUDES])   # f32[16] by 4-bit code


class QuantFormatError(ValueError):
    pass


def scale_to_float(scale: np.ndarray) -> np.ndarray:
    if scale.dtype == np.uint8:
        scale = scale.view(ml_dtypes.float8_e8m0fnu)
    return np.asarray(scale).astype(np.float32)


def dequant_fp8(codes: np.ndarray, scale: np.ndarray, block: tuple[int, int] = (128, 128)) -> np.ndarray:
    """E4M3 codes [out, in] with per-tile scales -> f32[out, in]."""
    out_dim, in_dim = codes.shape
    bo, bi = block
    expected = (math.ceil(out_dim / bo), math.ceil(in_dim / bi))
    if tuple(scale.shape) != expected:
        raise QuantFormatError(f"FP8 scale shape {tuple(scale.shape)} does not tile a "
                               f"{codes.shape} weight in {block} blocks (expected {expected})")
    full = np.repeat(np.repeat(scale_to_float(scale), bo, axis=0), bi, axis=1)
    return codes.astype(np.float32) * full[:out_dim, :in_dim]


def unpack_fp4(packed: np.ndarray) -> np.ndarray:
    """int8/uint8 [out, in/2] -> f32[out, in] E2M1 values (low nibble first)."""
    raw = packed.view(np.uint8)
    codes = np.stack([raw & 0x0F, raw >> 4], axis=-1).reshape(raw.shape[0], -1)
    return FP4_VALUES[codes]


def dequant_fp4(packed: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """Packed E2M1 [out, in/2] with E8M0 scales [out, in/32] -> f32[out, in]."""
    values = unpack_fp4(packed)
    out_dim, in_dim = values.shape
    if tuple(scale.shape) != (out_dim, in_dim // FP4_GROUP) or in_dim % FP4_GROUP:
        raise QuantFormatError(f"FP4 scale shape {tuple(scale.shape)} does not match a "
                               f"[{out_dim}, {in_dim}] weight in groups of {FP4_GROUP}")
    return values * np.repeat(scale_to_float(scale), FP4_GROUP, axis=1)


def _pow2_scale(amax: np.ndarray, top: float) -> np.ndarray:
    """Smallest power of two s with amax / s <= top (as E8M0)."""
    exponent = np.ceil(np.log2(np.maximum(amax, 1e-30) / top))
    return np.exp2(np.clip(exponent, -127, 127)).astype(np.float32)


def quantize_fp8(w: np.ndarray, block: tuple[int, int] = (128, 128)) -> tuple[np.ndarray, np.ndarray]:
    """f32[out, in] -> (E4M3 codes [out, in], E8M0 scales [ceil(out/bo), ceil(in/bi)])."""
    out_dim, in_dim = w.shape
    bo, bi = block
    rows, cols = math.ceil(out_dim / bo), math.ceil(in_dim / bi)
    padded = np.zeros((rows * bo, cols * bi), np.float32)
    padded[:out_dim, :in_dim] = w
    tiles = np.abs(padded.reshape(rows, bo, cols, bi)).max(axis=(1, 3))
    scale = _pow2_scale(tiles, FP8_MAX)
    full = np.repeat(np.repeat(scale, bo, axis=0), bi, axis=1)[:out_dim, :in_dim]
    codes = (w / full).astype(ml_dtypes.float8_e4m3fn)
    return codes, scale.astype(ml_dtypes.float8_e8m0fnu)


def quantize_fp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """f32[out, in] -> (packed int8 [out, in/2], E8M0 scales [out, in/32]); round to nearest."""
    out_dim, in_dim = w.shape
    if in_dim % FP4_GROUP:
        raise QuantFormatError(f"FP4 needs the input dim to be a multiple of {FP4_GROUP}")
    groups = w.reshape(out_dim, in_dim // FP4_GROUP, FP4_GROUP)
    scale = _pow2_scale(np.abs(groups).max(axis=-1), 6.0)
    scaled = (groups / scale[..., None]).reshape(out_dim, in_dim)
    magnitude_code = np.abs(np.abs(scaled)[..., None] - _FP4_MAGNITUDES).argmin(-1).astype(np.uint8)
    codes = magnitude_code | np.where(scaled < 0, 8, 0).astype(np.uint8)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8).view(np.int8)
    return packed, scale.astype(ml_dtypes.float8_e8m0fnu)
