"""The Engram hash against the reference's arrays in both V4.1 fixtures: the config-derived
primes / offsets / multipliers, the tokenizer-derived token map, and the row ids of the
padded prompts (pads DEAD); the look-back across calls gives the one-call ids."""

from __future__ import annotations

import numpy as np
import pytest
from tokenizers import Tokenizer

from deepinfer_jax.config.hf import read_model_config
from deepinfer_jax.model.v41 import engram_hash
from tests.conftest import V41_ORACLE_DIR

FIXTURES = [V41_ORACLE_DIR / f"deepseek-v41-tiny-{x}" for x in "ab"]
pytestmark = pytest.mark.skipif(not FIXTURES[0].exists(), reason="no V4.1 oracle fixtures")


@pytest.fixture(params=FIXTURES, ids=["a", "b"])
def case(request):
    folder = request.param
    cfg = read_model_config(folder).engram
    return cfg, np.load(folder / "reference.npz"), folder


def test_tables_match_the_reference(case):
    cfg, ref, _ = case
    tables = engram_hash.hash_tables(cfg)
    np.testing.assert_array_equal(tables.primes, ref["engram_primes"])
    np.testing.assert_array_equal(tables.offsets, ref["engram_offsets"])
    np.testing.assert_array_equal(tables.multipliers, ref["engram_multipliers"])
    # Each layer's table is its primes back to back: the config's row counts.
    assert tuple(tables.primes.reshape(len(cfg.layer_ids), -1).sum(1)) == cfg.num_embeddings


def test_token_map_from_the_tokenizer(case):
    cfg, ref, folder = case
    token_map, size = engram_hash.compressed_token_map(Tokenizer.from_file(str(folder / "tokenizer.json")))
    assert size == cfg.compressed_vocab_size
    np.testing.assert_array_equal(token_map, ref["engram_token_map"])


def test_hash_ids_match_the_reference(case):
    cfg, ref, _ = case
    tables = engram_hash.hash_tables(cfg)
    live = ref["attention_mask"].astype(bool)
    ids = engram_hash.hash_ids(ref["input_ids"], live, ref["engram_token_map"], cfg, tables)
    np.testing.assert_array_equal(ids, ref["engram_hash_ids"])
    narrow = engram_hash.hash_ids(ref["input_ids"].astype(np.int32), live,
                                  ref["engram_token_map"].astype(np.int32), cfg, tables)
    np.testing.assert_array_equal(narrow, ids)          # int32 inputs must not wrap early
    assert (ids >= 0).all() and (ids < np.array(cfg.num_embeddings)[:, None]).all()


def test_look_back_across_calls(case):
    cfg, ref, _ = case
    tables, token_map = engram_hash.hash_tables(cfg), ref["engram_token_map"]
    tokens, live = ref["input_ids"], ref["attention_mask"].astype(bool)
    cut, back = 40, cfg.max_ngram_size - 1
    first = engram_hash.hash_ids(tokens[:, :cut], live[:, :cut], token_map, cfg, tables)
    history = np.where(live[:, cut - back:cut], token_map[tokens[:, cut - back:cut]], -1)
    second = engram_hash.hash_ids(tokens[:, cut:], live[:, cut:], token_map, cfg, tables, history)
    np.testing.assert_array_equal(np.concatenate([first, second], 1), ref["engram_hash_ids"])
