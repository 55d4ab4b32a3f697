"""The QAT fake quantization that is part of V4.1's numerics (section 8 of the architecture
notes): values are rounded onto the FP8 / FP4 grid and back, in float32, where the reference
rounds them; a last dimension that is not a multiple of the block is left as is (the
reference's rule, which only tiny configs meet).

* window K=V after RoPE: FP8 e4m3, 32-channel blocks, power-of-two (ue8m0) scales;
* compressed KV after RoPE: FP4 e2m1, 16-channel blocks, e4m3 scales;
* indexer keys and queries after RoPE: FP4 e2m1, 32-channel blocks, ue8m0 scales.

Every rounding here is float32 arithmetic onto the grid, never a round trip through a float8
type: XLA's GPU compiler removes chains of float conversions (`simplify-fp-conversions`, on
under its default `xla_allow_excess_precision`), so `x.astype(float8_e4m3fn).astype(float32)`
is x itself there, and V4.1's forward lost its FP8 rounding on an H100 (logits O(1) from the
reference's, 1e-5 with the fake quantization off). A value already on the grid converts to a
float8 type exactly, so a conversion that follows (the cache's stored codes) is safe to drop.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

FP8_MAX = 448.0
FP4_MAX = 6.0
_FP4_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Midpoints between grid values; round-to-nearest-even sends a tie to the even code, i.e. up
# at the odd-code boundaries (0.75, 1.75, 3.5) and down at the others.
_FP4_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_FP4_TIES_UP = (False, True, False, True, False, True, False)


def pow2_ceil(t: jax.Array) -> jax.Array:
    """2^ceil(log2 t) for float32 t > 0, from the IEEE bits (exact, as the reference's)."""
    bits = jax.lax.bitcast_convert_type(t.astype(jnp.float32), jnp.int32)
    exponent = (bits >> 23) & 0xFF
    k = exponent - 127 + ((bits & 0x7FFFFF) != 0).astype(jnp.int32)
    # Built from its exponent bits: XLA's exp2 is not exact for negative k. Every caller
    # clamps t to >= 2^-126, so the result is a normal float.
    return jax.lax.bitcast_convert_type((jnp.clip(k, -126, 127) + 127) << 23, jnp.float32)


def round_e4m3(q: jax.Array) -> jax.Array:
    """float32 values within [-448, 448] -> the nearest e4m3fn value (ties to even), as
    float32: what `q.astype(float8_e4m3fn)` holds, from the IEEE bits. Normals (from 2^-6)
    keep 3 of float32's 23 mantissa bits; below, the grid is the subnormals' 2^-9 steps."""
    magnitude = jnp.abs(q.astype(jnp.float32))
    bits = jax.lax.bitcast_convert_type(magnitude, jnp.uint32)
    dropped = 20                                        # 23 - 3 mantissa bits
    half = (1 << (dropped - 1)) - 1 + ((bits >> dropped) & 1)
    normal = jax.lax.bitcast_convert_type((bits + half) & ~jnp.uint32((1 << dropped) - 1),
                                          jnp.float32)
    subnormal = jnp.round(magnitude * 2.0**9) * 2.0**-9     # jnp.round: ties to even
    rounded = jnp.where(magnitude < 2.0**-6, subnormal, normal)
    return jnp.where(jnp.signbit(q), -rounded, rounded)


def _blocks(x: jax.Array, block: int) -> jax.Array:
    return x.astype(jnp.float32).reshape(*x.shape[:-1], x.shape[-1] // block, block)


def fake_quant_fp8(x: jax.Array, block: int = 32) -> jax.Array:
    """[..., n] -> the same values after an e4m3 round trip with ue8m0 block scales."""
    if x.shape[-1] % block:
        return x
    b = _blocks(x, block)
    amax = jnp.maximum(jnp.abs(b).max(-1, keepdims=True), 1e-4)
    scale = pow2_ceil(amax * (1.0 / FP8_MAX))
    q = round_e4m3(jnp.clip(b / scale, -FP8_MAX, FP8_MAX))
    return (q * scale).reshape(x.shape).astype(x.dtype)


def round_e2m1(q: jax.Array) -> jax.Array:
    """float32 values already within [-6, 6] -> the nearest e2m1 value (ties to even code)."""
    magnitude = jnp.abs(q)
    mids = jnp.array(_FP4_MIDPOINTS, jnp.float32)
    thresholds = jnp.where(jnp.array(_FP4_TIES_UP), mids, jnp.nextafter(mids, jnp.inf))
    code = (magnitude[..., None] >= thresholds).sum(-1)
    value = jnp.array(_FP4_GRID, jnp.float32)[code]
    return jnp.where(jnp.signbit(q), -value, value)


def fake_quant_fp4(x: jax.Array, block: int, e4m3_scales: bool = False) -> jax.Array:
    """[..., n] -> the same values after an e2m1 round trip with per-block scales: e4m3
    (compressed KV, block 16) or ue8m0 (indexer, block 32)."""
    if x.shape[-1] % block:
        return x
    b = _blocks(x, block)
    scale = fp4_scales(b, e4m3_scales)
    q = round_e2m1(jnp.clip(b / scale, -FP4_MAX, FP4_MAX))
    return (q * scale).reshape(x.shape).astype(x.dtype)


def fp4_scales(blocks: jax.Array, e4m3_scales: bool) -> jax.Array:
    """f32[..., n_blocks, block] -> each block's scale f32[..., n_blocks, 1], already on its
    grid (e4m3 or a power of two), so that its stored form round-trips exactly."""
    amax = jnp.abs(blocks).max(-1, keepdims=True)
    if e4m3_scales:
        # (past 448, where the float8 conversion gives NaN, the largest e4m3 value)
        return round_e4m3(jnp.clip(jnp.maximum(amax, FP4_MAX * 2.0**-9) / FP4_MAX, max=FP8_MAX))
    return pow2_ceil(jnp.maximum(amax, FP4_MAX * 2.0**-126) * (1.0 / FP4_MAX))
