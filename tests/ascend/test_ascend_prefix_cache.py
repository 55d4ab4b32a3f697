"""Prefix caching on the Ascend backend (ascend_backend/snapshots.py, in .venv-ascend) against
the JAX engine's, through both engines (tests/ascend/jax_side.py runs them)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.ascend.ascend_env import needs_ascend_env
from tests.ascend.jax_side import both_engines
from tests.conftest import oracle_case

pytestmark = [needs_ascend_env, pytest.mark.oracle]


def test_prefix_cache_hits_match_the_jax_engine(tmp_path):
    """Prefix caching on both engines: prompts sharing a 150-token prefix over two generate
    calls (the second one's prompts hit the first's cached blocks, one of them a whole prompt
    again): the same tokens, and the same cache hits and hit tokens (the snapshots restored
    into the slots give the steps the same state as computing the prefix)."""
    case = oracle_case("tiny-mixed")
    rng = np.random.default_rng(9)
    base = rng.integers(2, 512, size=150).tolist()
    prompts = [base + rng.integers(2, 512, size=int(n)).tolist() for n in (20, 45, 70)]
    rounds = [prompts[:2], [prompts[2], prompts[0]]]
    expected, result, llm = both_engines(tmp_path, case.checkpoint, case.model, rounds,
                                         enable_prefix_caching=True, num_pages=24)
    assert result["tokens"] == expected
    stats = llm.engine.scheduler.kv_cache.prefix_stats()
    assert stats.hits >= 2 and stats.hit_tokens >= 2 * 128
    assert result["prefix"] == [stats.hits, stats.hit_tokens]
