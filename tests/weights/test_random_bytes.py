"""The random FP4 codes' draw (weights/random_source.py `random_bytes`): uniform bytes whose
temporaries stay a small multiple of the result. jax.random.bits in uint8 held 16x the result
on the CPU, and on the H200 ran a V4.1 slice's expert stacks out of memory; XLA's own memory
analysis of the compiled draw is the reference here."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from deepinfer_jax.weights.random_source import random_bytes

SHAPE = (8, 512, 1024)      # 4 MiB


def _temporaries(draw) -> int:
    return jax.jit(draw).lower(jax.random.key(0)).compile().memory_analysis().temp_size_in_bytes


def test_the_draw_holds_a_few_times_its_result_not_sixteen():
    result = int(np.prod(SHAPE))
    ours = _temporaries(lambda key: random_bytes(key, SHAPE))
    bytewise = _temporaries(lambda key: jax.random.bits(key, SHAPE, jnp.uint8))
    assert ours <= 4 * result
    if jax.default_backend() == "cpu":      # XLA's GPU draw fuses jax.random.bits' bytes
        assert 4 * result < bytewise


def test_the_bytes_are_uniform_and_keyed():
    a = np.asarray(random_bytes(jax.random.key(1), SHAPE))
    assert a.dtype == np.uint8 and a.shape == SHAPE
    counts = np.bincount(a.reshape(-1), minlength=256)
    expected = a.size / 256
    assert np.abs(counts - expected).max() < 6 * expected ** 0.5     # every value, evenly
    assert not np.array_equal(a, np.asarray(random_bytes(jax.random.key(2), SHAPE)))
    odd = random_bytes(jax.random.key(1), (3, 5))           # not whole words: bytewise draw
    assert odd.shape == (3, 5) and odd.dtype == jnp.uint8
