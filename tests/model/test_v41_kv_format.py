"""The paged V4.1 state's storage formats decode to exactly the reference's fake-quantized
values (model/v41/kv_format.py against model/v41/fake_quant.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from deepinfer_jax.model.v41 import fake_quant, kv_format


def _values() -> jax.Array:
    """Rows over many magnitudes (block scales from tiny to large), one all-zero row."""
    x = jax.random.normal(jax.random.PRNGKey(0), (64, 64))
    x = x * jnp.exp2(jnp.arange(64, dtype=jnp.float32)[:, None] / 4 - 12)
    return x.at[0].set(0.0)


def test_fp8_codes_decode_to_the_fake_quantized_values():
    x = _values()
    rows = kv_format.encode_fp8(x)
    assert rows.codes.dtype == jnp.float8_e4m3fn and rows.exps.shape == (64, 2)
    np.testing.assert_array_equal(kv_format.decode_fp8(rows), fake_quant.fake_quant_fp8(x))


@pytest.mark.parametrize("block,e4m3", [(16, True), (32, False)])
def test_fp4_codes_decode_to_the_fake_quantized_values(block, e4m3):
    x = _values()
    rows = kv_format.encode_fp4(x, block, e4m3)
    assert rows.codes.dtype == jnp.uint8 and int(rows.codes.max()) < 16
    assert rows.scales.dtype == (jnp.float8_e4m3fn if e4m3 else jnp.uint8)
    np.testing.assert_array_equal(kv_format.decode_fp4(rows),
                                  fake_quant.fake_quant_fp4(x, block, e4m3_scales=e4m3))


def test_pool_gather_and_scatter_keep_the_format():
    pool = kv_format.zeros_fp4((8, 32), 16, e4m3_scales=True)
    new = kv_format.encode_fp4(_values()[40:42, :32], 16, True)
    pool = kv_format.scatter(pool, jnp.array([5, 8]), new, False)       # row 8: dropped
    got = kv_format.gather(pool, jnp.array([5]))
    np.testing.assert_array_equal(kv_format.decode_fp4(got), kv_format.decode_fp4(new)[:1])
    assert not np.asarray(kv_format.decode_fp4(pool))[[0, 1, 2, 3, 4, 6, 7]].any()
