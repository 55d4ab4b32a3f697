"""`deepinfer_jax.load_v41`: the fixture checkpoints with their tokenizers give the
reference's logits (left-padded batch, dead slots appended) and greedy tokens."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

import deepinfer_jax
from deepinfer_jax.config.model import ConfigError
from tests.model.v41_oracle import FIXTURES

pytestmark = pytest.mark.skipif(not FIXTURES[0].exists(), reason="no V4.1 oracle fixtures")


def test_logits_and_greedy_tokens():
    folder = FIXTURES[1]
    model = deepinfer_jax.load_v41(folder)
    ref = np.load(folder / "reference.npz")
    live = ref["attention_mask"].astype(bool)
    np.testing.assert_array_equal(model.token_map, ref["engram_token_map"])
    logits = model.logits(ref["input_ids"], live)
    assert np.abs(logits - ref["logits"])[live].max() < 1e-4
    np.testing.assert_array_equal(model.greedy(ref["input_ids"], 4, live), ref["gen_tokens"][:, :4])


def test_the_tokenizer_must_match_the_config(tmp_path):
    folder = FIXTURES[0]
    for name in ("model.safetensors", "tokenizer.json"):
        shutil.copy(folder / name, tmp_path / name)
    raw = json.loads((folder / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**raw, "engram_compressed_vocab_size": 385}))
    with pytest.raises(ConfigError, match="384 compressed ids"):
        deepinfer_jax.load_v41(tmp_path)
    (tmp_path / "tokenizer.json").unlink()
    with pytest.raises(ConfigError, match="tokenizer.json"):
        deepinfer_jax.load_v41(tmp_path)
