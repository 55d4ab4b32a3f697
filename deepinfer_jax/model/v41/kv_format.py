"""The storage formats of V4.1's paged state: the values the reference fake-quantizes, kept as
their codes and block scales, so that decoding gives back exactly the fake-quantized float32
values (`fake_quant.py`) and the cache costs what the released model's cache costs.

* `Fp8Rows` (window K=V): e4m3 codes, one ue8m0 scale (a biased power-of-two exponent, uint8)
  per 32 channels: 1 + 1/32 bytes per value.
* `Fp4Rows` (compressed entries, indexer keys): e2m1 codes, one per uint8 (bit 3 the sign,
  bits 0-2 the magnitude's index into the e2m1 grid; unpacked, two per byte is a later memory
  step), and per block either an e4m3 scale (compressed entries, block 16) or a ue8m0 exponent
  (indexer keys, block 32): the scale's dtype says which.

Exactness: every decoded value is a code times a scale, both with few mantissa bits, so the
float32 product is exact and equals the reference's `q * scale`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from deepinfer_jax.model.v41.fake_quant import (
    _FP4_GRID,
    FP4_MAX,
    FP8_MAX,
    fp4_scales,
    pow2_ceil,
    round_e2m1,
    round_e4m3,
)

Array = jax.Array


@struct.dataclass
class Fp8Rows:
    codes: Array     # float8_e4m3fn[..., d]
    exps: Array      # uint8[..., d / 32]   scale = 2^(exp - 127)


@struct.dataclass
class Fp4Rows:
    codes: Array     # uint8[..., d]        sign << 3 | e2m1 grid index
    scales: Array    # float8_e4m3fn[..., d / 16] (e4m3 scales) or uint8[..., d / 32] (ue8m0)


def _exponent(scale: Array) -> Array:
    """A power-of-two float32 scale -> its biased exponent (ue8m0)."""
    return ((jax.lax.bitcast_convert_type(scale, jnp.int32) >> 23) & 0xFF).astype(jnp.uint8)


def _from_exponent(exps: Array) -> Array:
    return jax.lax.bitcast_convert_type(exps.astype(jnp.int32) << 23, jnp.float32)


def _blocks(x: Array, n_blocks: int) -> Array:
    return x.astype(jnp.float32).reshape(*x.shape[:-1], n_blocks, x.shape[-1] // n_blocks)


def encode_fp8(x: Array, block: int = 32) -> Fp8Rows:
    """[..., d] -> the codes of fake_quant.fake_quant_fp8(x, block)."""
    b = _blocks(x, x.shape[-1] // block)
    amax = jnp.maximum(jnp.abs(b).max(-1, keepdims=True), 1e-4)
    scale = pow2_ceil(amax * (1.0 / FP8_MAX))
    codes = round_e4m3(jnp.clip(b / scale, -FP8_MAX, FP8_MAX)).astype(jnp.float8_e4m3fn)
    return Fp8Rows(codes=codes.reshape(x.shape), exps=_exponent(scale[..., 0]))


def decode_fp8(rows: Fp8Rows) -> Array:
    b = _blocks(rows.codes, rows.exps.shape[-1])
    return (b * _from_exponent(rows.exps)[..., None]).reshape(rows.codes.shape)


def encode_fp4(x: Array, block: int, e4m3_scales: bool) -> Fp4Rows:
    """[..., d] -> the codes of fake_quant.fake_quant_fp4(x, block, e4m3_scales)."""
    b = _blocks(x, x.shape[-1] // block)
    scale = fp4_scales(b, e4m3_scales)
    stored = scale.astype(jnp.float8_e4m3fn) if e4m3_scales else _exponent(scale)
    q = round_e2m1(jnp.clip(b / scale, -FP4_MAX, FP4_MAX))
    index = jnp.argmax(jnp.abs(q)[..., None] == jnp.array(_FP4_GRID, jnp.float32), axis=-1)
    codes = (index | (jnp.signbit(q).astype(jnp.int32) << 3)).astype(jnp.uint8)
    return Fp4Rows(codes=codes.reshape(x.shape), scales=stored[..., 0])


def decode_fp4(rows: Fp4Rows) -> Array:
    grid = jnp.array(_FP4_GRID, jnp.float32)
    codes = rows.codes.astype(jnp.int32)
    values = jnp.where(codes & 8, -1.0, 1.0) * grid[codes & 7]
    if rows.scales.dtype == jnp.uint8:
        scale = _from_exponent(rows.scales)
    else:
        scale = rows.scales.astype(jnp.float32)
    b = _blocks(values, rows.scales.shape[-1])
    return (b * scale[..., None]).reshape(rows.codes.shape)


def zeros_fp8(shape: tuple[int, ...], block: int = 32) -> Fp8Rows:
    return Fp8Rows(codes=jnp.zeros(shape, jnp.float8_e4m3fn),
                   exps=jnp.zeros((*shape[:-1], shape[-1] // block), jnp.uint8))


def zeros_fp4(shape: tuple[int, ...], block: int, e4m3_scales: bool) -> Fp4Rows:
    scale_dtype = jnp.float8_e4m3fn if e4m3_scales else jnp.uint8
    return Fp4Rows(codes=jnp.zeros(shape, jnp.uint8),
                   scales=jnp.zeros((*shape[:-1], shape[-1] // block), scale_dtype))


def gather(rows, index: Array):
    """Rows of a pool (any of the formats, leading axis the row) at `index` (any shape)."""
    return jax.tree.map(lambda a: a[index], rows)


def scatter(rows, dest: Array, new, unique: bool):
    """Write `new` rows at `dest` (out-of-range: dropped) into a pool of the same format."""
    return jax.tree.map(lambda a, v: a.at[dest].set(v.astype(a.dtype), mode="drop",
                                                    unique_indices=unique), rows, new)
