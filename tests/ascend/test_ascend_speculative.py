"""MTP speculative decoding on the Ascend backend (ascend_backend/speculative.py, in
.venv-ascend) against the JAX engine's, through both engines (tests/ascend/jax_side.py
runs them). A file of its own so that it runs on another test worker."""

from __future__ import annotations

import numpy as np

import deepinfer_jax
from deepinfer_jax.host.tokenizer import TextTokenizer
from tests.ascend.ascend_env import needs_ascend_env
from tests.ascend.jax_side import both_engines
from tests.conftest import REPO

pytestmark = needs_ascend_env

SHIPPED = REPO / "models" / "deepinfer-tiny-v4"


def test_mtp_speculation_matches_the_jax_engine(tmp_path):
    """Both engines speculate with the shipped trained model's MTP block (whose drafts get
    accepted; up to 3 a step, by confidence): the same tokens, and the same drafts verified
    and accepted (the torch verify and draft decide as the JAX step's)."""
    tok = TextTokenizer.from_model_dir(SHIPPED)
    prompts = [tok.encode(t) for t in ("import os\n\n\ndef walk(top):",
                                       "class Point:\n    def __init__(self, x, y):",
                                       "for line in open(path):")]
    model = deepinfer_jax.load(SHIPPED, dtype=np.float32)
    # one token bucket: three rows of a token and three drafts fit in 16
    expected, result, llm = both_engines(tmp_path, SHIPPED, model, [prompts],
                                         speculative_config={"num_speculative_tokens": 3},
                                         max_num_batched_tokens=16, token_buckets=(16,))
    assert result["tokens"] == expected
    theirs = llm.spec_metrics
    assert theirs.accepted > 0
    assert result["spec"] == [theirs.steps, theirs.drafted, theirs.accepted]
