"""The notebook API `load(...).logits`: causality under padding, input checks, RoPE tables."""

from __future__ import annotations

import math

import numpy as np
import pytest

from deepinfer_jax.config.model import YarnConfig
from deepinfer_jax.model.rope import inv_freq


def test_prefixes_do_not_depend_on_later_tokens_or_padding(mixed_case):
    """Causality: the logits of a prefix equal the prefix of the logits, also across the
    padding bucket boundary (pad_to = 128) and across compressed-block boundaries."""
    model = mixed_case.model
    ids = mixed_case.reference["input_ids"][0]
    full = model.logits(ids)[0]
    for n in (1, 5, 127, 128, 129, 200):
        np.testing.assert_allclose(model.logits(ids[:n])[0], full[:n], rtol=2e-5,
                                   atol=2e-5 * np.abs(full).max())


def test_batch_rows_are_independent(mixed_case):
    model = mixed_case.model
    ids = mixed_case.reference["input_ids"]
    both = model.logits(ids)
    np.testing.assert_allclose(model.logits(ids[1]), both[1:], rtol=2e-5, atol=2e-5 * np.abs(both).max())


@pytest.mark.parametrize("bad, error", [
    ([], ValueError), ([[]], ValueError), ([1, 2, 10**6], ValueError), ([1, -1], ValueError),
    ([1.5, 2.0], TypeError), (np.zeros((1, 2, 3), np.int32), ValueError),
])
def test_bad_token_ids_raise(mixed_case, bad, error):
    with pytest.raises(error):
        mixed_case.model.logits(bad)


def test_yarn_table_for_v4_flash_by_hand():
    """V4-Flash compress rope: base 160000, 64 rope dims, factor 16 over 65536 original
    positions, beta 32/1: the ramp runs from pair 15 to pair 25 (floor/ceil of the
    correction dims), keeping high frequencies and dividing low ones by 16."""
    yarn = YarnConfig(factor=16, original_max_position_embeddings=65536, beta_fast=32, beta_slow=1)
    got = inv_freq(64, 160000.0, yarn)
    base = 160000.0 ** (-np.arange(0, 64, 2) / 64)
    low = math.floor(64 * math.log(65536 / (32 * 2 * math.pi)) / (2 * math.log(160000)))
    high = math.ceil(64 * math.log(65536 / (1 * 2 * math.pi)) / (2 * math.log(160000)))
    assert (low, high) == (15, 25)
    np.testing.assert_allclose(got[:16], base[:16], rtol=1e-6)          # ramp 0 up to pair 15
    np.testing.assert_allclose(got[25:], base[25:] / 16, rtol=1e-6)     # ramp 1 from pair 25
    ramp = (20 - low) / (high - low)
    np.testing.assert_allclose(got[20], base[20] / 16 * ramp + base[20] * (1 - ramp), rtol=1e-6)
