"""V4.1's QAT fake quantization against independent numpy round trips (ml_dtypes' e4m3 and
e2m1 casts, both round-to-nearest-even), the e2m1 tie rule, and the unblockable-shape rule."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from deepinfer_jax.model.v41.fake_quant import (
    fake_quant_fp4,
    fake_quant_fp8,
    pow2_ceil,
    round_e2m1,
    round_e4m3,
)


def _sample(shape, seed=0):
    rng = np.random.default_rng(seed)
    # Mixed magnitudes, so blocks take very different scales (and some hit the clamps).
    return (rng.standard_normal(shape) * np.exp2(rng.integers(-12, 8, shape[:-1] + (1,)))
            ).astype(np.float32)


def _pow2_ceil(t):
    return np.exp2(np.ceil(np.log2(t))).astype(np.float32)


def test_pow2_ceil_is_exact():
    t = np.array([1.0, 1.5, 0.75, 2.0**-20, 3.0 * 2.0**-30, 448.0, 1e-4 / 448], np.float32)
    np.testing.assert_array_equal(pow2_ceil(jnp.asarray(t)), _pow2_ceil(t.astype(np.float64)))


def test_fp8_matches_a_numpy_round_trip():
    x = _sample((5, 7, 64))
    b = x.reshape(5, 7, 2, 32)
    scale = _pow2_ceil(np.maximum(np.abs(b).max(-1, keepdims=True), 1e-4) / 448.0)
    want = ((b / scale).astype(ml_dtypes.float8_e4m3fn).astype(np.float32) * scale).reshape(x.shape)
    np.testing.assert_array_equal(fake_quant_fp8(jnp.asarray(x)), want)


def test_e4m3_rounding_equals_the_float8_cast():
    """Every finite e4m3fn value, the midpoints between neighbours (ties to even), a float32
    step either side of them, and random values: bit for bit ml_dtypes' cast."""
    codes = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    grid = np.unique(codes[np.isfinite(codes)])
    mids = (grid[1:] + grid[:-1]) / 2
    rng = np.random.default_rng(0)
    x = np.concatenate([grid, mids, np.nextafter(mids, np.inf), np.nextafter(mids, -np.inf),
                        rng.uniform(-448, 448, 20000), rng.standard_normal(20000) * 0.01,
                        [0.0, -0.0]]).astype(np.float32)
    want = x.astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(jax.jit(round_e4m3)(x)).view(np.uint32),
                                  want.view(np.uint32))


@pytest.mark.parametrize("quantize", [fake_quant_fp8, lambda x: fake_quant_fp4(x, 32),
                                      lambda x: fake_quant_fp4(x, 16, e4m3_scales=True)],
                         ids=["fp8", "fp4 ue8m0", "fp4 e4m3"])
def test_the_rounding_is_no_float8_round_trip(quantize):
    """A GPU compile drops a chain of float conversions (f32 -> e4m3 -> f32 is f32 there): the
    fake quantization must round in float32 arithmetic, with no float8 value in between."""
    jaxpr = str(jax.make_jaxpr(quantize)(jnp.zeros((4, 64), jnp.float32)))
    assert "f8" not in jaxpr, jaxpr


def test_e2m1_rounding_ties_to_even():
    q = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -5.0, 0.26, 2.49, 6.0, 0.0],
                 np.float32)
    want = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -0.0, -4.0, 0.5, 2.0, 6.0, 0.0]
    np.testing.assert_array_equal(round_e2m1(jnp.asarray(q)), np.array(want, np.float32))
    r = np.random.default_rng(1).uniform(-6, 6, 4096).astype(np.float32)
    np.testing.assert_array_equal(round_e2m1(jnp.asarray(r)),
                                  r.astype(ml_dtypes.float4_e2m1fn).astype(np.float32))


@pytest.mark.parametrize("block, e4m3", [(16, True), (32, False)])
def test_fp4_matches_a_numpy_round_trip(block, e4m3):
    x = _sample((3, 9, 64), seed=block)
    b = x.reshape(3, 9, 64 // block, block)
    amax = np.abs(b).max(-1, keepdims=True)
    if e4m3:
        scale = (np.maximum(amax, 6 * 2.0**-9) / 6).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    else:
        scale = _pow2_ceil(np.maximum(amax, 6 * 2.0**-126) / 6)
    q = np.clip(b / scale, -6, 6).astype(ml_dtypes.float4_e2m1fn).astype(np.float32)
    got = fake_quant_fp4(jnp.asarray(x), block, e4m3_scales=e4m3)
    np.testing.assert_array_equal(got, (q * scale).reshape(x.shape))


def test_unblockable_widths_pass_through():
    x = jnp.asarray(_sample((2, 48)))   # 48: a multiple of 16, not of 32
    assert fake_quant_fp8(x) is x and fake_quant_fp4(x, 32) is x and fake_quant_fp4(x, 16) is not x
