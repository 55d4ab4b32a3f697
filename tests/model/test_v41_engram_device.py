"""The step's Engram hash (model/v41/engram_device.py, 32-bit words) against the host's int64
numpy hash (engram_hash.hash_ids, itself tested against the reference): on both fixtures'
padded prompts (the reference's `engram_hash_ids`), at the released sizes (primes above
16M, 24-bit, so the modulo runs in 8-bit chunks), and with products that wrap past 2^63
(numpy's floored `%` of a negative int64)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from deepinfer_jax.config.hf import read_model_config
from deepinfer_jax.config.v41 import EngramConfig
from deepinfer_jax.model.v41 import engram_device, engram_hash
from tests.model.v41_oracle import FIXTURES

DEAD = engram_hash.DEAD

# the released model's Engram (section 6 of the architecture notes; the row counts are its)
RELEASED = EngramConfig(layer_ids=(1, 14), num_embeddings=(384_006_168, 384_016_682),
                        vocab_size=16_000_000, max_ngram_size=4, n_heads=8, head_dim=256,
                        pad_id=2, compressed_vocab_size=99_092)


@functools.partial(jax.jit, static_argnums=2)
def _device_ids(look_back, products, cfg):
    return engram_device.hash_ids(look_back, products, cfg)


def _look_back(tokens: np.ndarray, live: np.ndarray, n: int) -> np.ndarray:
    """i32[B, S, n]: slot k the token k before (DEAD where not live or before the start)."""
    marked = np.where(live, tokens, DEAD)
    out = np.full((*tokens.shape, n), DEAD, np.int64)
    for k in range(n):
        out[:, k:, k] = marked[:, : tokens.shape[1] - k]
    return out


def _compare(cfg: EngramConfig, token_map: np.ndarray, tokens: np.ndarray, live: np.ndarray):
    tables = engram_hash.hash_tables(cfg)
    want = engram_hash.hash_ids(tokens, live, token_map, cfg, tables)
    look_back = _look_back(tokens, live, cfg.max_ngram_size)
    got = _device_ids(jnp.asarray(look_back.reshape(-1, cfg.max_ngram_size), jnp.int32),
                      jnp.asarray(engram_hash.product_words(token_map, tables)), cfg)
    np.testing.assert_array_equal(np.asarray(got).reshape(want.shape), want)
    return want


@pytest.mark.skipif(not FIXTURES[0].exists(), reason="no V4.1 oracle fixtures")
@pytest.mark.parametrize("folder", FIXTURES, ids=["a", "b"])
def test_the_fixtures_reference_ids(folder):
    cfg = read_model_config(folder).engram
    ref = np.load(folder / "reference.npz")
    got = _compare(cfg, ref["engram_token_map"], ref["input_ids"],
                   ref["attention_mask"].astype(bool))
    np.testing.assert_array_equal(got, ref["engram_hash_ids"])


def test_released_sizes():
    assert engram_hash.hash_tables(RELEASED).primes.reshape(2, -1).sum(1).tolist() == list(
        RELEASED.num_embeddings)
    rng = np.random.default_rng(0)
    token_map = rng.integers(0, RELEASED.compressed_vocab_size, 129_280)
    tokens = rng.integers(0, 129_280, (8, 64))
    live = np.ones(tokens.shape, bool)
    live[:3, :5] = False                           # left padding
    live[4, 30] = False                            # a DEAD token inside a sequence
    ids = _compare(RELEASED, token_map, tokens, live)
    assert (ids >= 2**24).any()                    # past 24 bits: every chunk matters


def test_products_past_2_to_63_wrap_as_numpy_int64():
    rng = np.random.default_rng(1)
    # compressed ids far beyond the map's bound: their products wrap to negative int64
    token_map = rng.integers(0, 2**62, 1000)
    tokens = rng.integers(0, 1000, (4, 32))
    tables = engram_hash.hash_tables(RELEASED)
    negative = 0
    for k in range(RELEASED.max_ngram_size):
        negative += (token_map[:, None] * tables.multipliers[:, k] < 0).sum()
    assert negative > 0
    _compare(RELEASED, token_map, tokens, np.ones(tokens.shape, bool))
