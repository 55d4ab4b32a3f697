"""precision.rounded_to: the cast pair's values (ml_dtypes' bfloat16 cast, round-to-nearest-even)
without a conversion chain a GPU compile would drop."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from deepinfer_jax.model.precision import rounded_to


def test_bfloat16_rounding_equals_the_cast_bit_for_bit():
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.standard_normal(50000) * 10.0 ** rng.integers(-40, 38, 50000),
                        [3.4e38, 1e-45, -0.0, 1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8]]).astype(np.float32)
    want = x.astype(ml_dtypes.bfloat16).astype(np.float32)
    got = np.asarray(jax.jit(rounded_to, static_argnums=1)(x, jnp.bfloat16))
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def test_no_conversion_chain_and_float32_is_the_identity():
    x = jnp.linspace(-3, 3, 64, dtype=jnp.float32)
    assert "bf16" not in str(jax.make_jaxpr(lambda v: rounded_to(v, jnp.bfloat16))(x))
    assert rounded_to(x, jnp.float32) is x


def test_formats_of_another_exponent_range_are_refused():
    with pytest.raises(ValueError, match="float16"):
        rounded_to(jnp.zeros(4), jnp.float16)
