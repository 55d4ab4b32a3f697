"""Structured output on the Ascend backend: the host's grammar matchers (host/grammar.py,
llguidance) fill the plan's token bitmask and the torch step applies it. On the shipped
trained model (it has a tokenizer), greedy constrained requests (a JSON schema, regexes)
beside an unconstrained one: the same tokens as the JAX engine, and outputs that hold."""

from __future__ import annotations

import json
import re

import numpy as np

import deepinfer_jax
from deepinfer_jax.host.tokenizer import TextTokenizer
from tests.ascend.ascend_env import needs_ascend_env
from tests.ascend.jax_side import both_engines
from tests.conftest import REPO

pytestmark = needs_ascend_env

SHIPPED = REPO / "models" / "deepinfer-tiny-v4"
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "count": {"type": "integer", "minimum": 0}},
          "required": ["name", "count"], "additionalProperties": False}
REGEXES = [r"[a-z]{3,6}-[0-9]{2}", r"(yes|no|maybe)!"]


def test_constrained_greedy_outputs_match_the_jax_engine(tmp_path):
    tok = TextTokenizer.from_model_dir(SHIPPED)
    prompts = [tok.encode(t) for t in ("config = ", "def answer():\n    return ",
                                       "# is it done?", "import os\n")]
    sampling = [{"max_tokens": 40, "json_schema": SCHEMA},
                {"max_tokens": 20, "regex": REGEXES[0]}, {"max_tokens": 20, "regex": REGEXES[1]},
                {"max_tokens": 24}]
    model = deepinfer_jax.load(SHIPPED, dtype=np.float32)
    expected, result, _ = both_engines(tmp_path, SHIPPED, model, [prompts], sampling=sampling,
                                       tokenizer=SHIPPED, max_num_batched_tokens=16,
                                       token_buckets=(16,))
    assert all(expected)           # every request ran (a grammar error would leave it empty)
    assert result["tokens"] == expected
    texts = [tok.decode(tokens) for tokens in result["tokens"]]      # (EOS skipped)
    data = json.loads(texts[0])
    assert set(data) == {"name", "count"} and data["count"] >= 0
    assert re.fullmatch(REGEXES[0], texts[1]) and re.fullmatch(REGEXES[1], texts[2])
