"""Greedy decoding with the cache-free V4.1 forward against the reference's `gen_tokens`, and
each prompt run alone, unpadded, against `logits_single` (both fixtures). Logits agree within
1e-4 up to each prompt's first fake-quantization rounding boundary; past one, two correct
computations may round a value a whole step apart (the fixtures' README: fixture b's own two
cache-free computations part by 0.33), as the paged and engine tests allow too."""

from __future__ import annotations

import numpy as np
import pytest

from tests.model.v41_oracle import FIXTURES, assert_parted_only_after_rounding_boundaries, case, run

pytestmark = pytest.mark.skipif(not FIXTURES[0].exists(), reason="no V4.1 oracle fixtures")


@pytest.mark.parametrize("folder", FIXTURES, ids=["a", "b"])
def test_greedy_continuation_matches_the_reference(folder):
    """Greedy decoding by cache-free forwards of one fixed shape: the prompt left-padded, the
    continuation written after it, the not yet generated slots dead (the compressor skips
    them, attention masks them, the Engram hash treats them as DEAD)."""
    _, _, ref = case(folder)
    prompt_live = ref["attention_mask"].astype(bool)
    b, s = prompt_live.shape
    steps = ref["gen_tokens"].shape[1]
    tokens = np.concatenate([ref["input_ids"], np.zeros((b, steps), np.int64)], axis=1)
    live = np.concatenate([prompt_live, np.zeros((b, steps), bool)], axis=1)
    for t in range(steps):
        logits, _ = run(folder, tokens, live)
        tokens[:, s + t] = np.asarray(logits)[:, s + t - 1].argmax(-1)
        live[:, s + t] = True
    np.testing.assert_array_equal(tokens[:, s:], ref["gen_tokens"])
    np.testing.assert_array_equal(ref["gen_tokens_nocache"], ref["gen_tokens"])
    # The whole prompt + continuation in one forward: the reference's logits_full_nocache.
    logits, _ = run(folder, tokens, live)
    err = np.abs(np.asarray(logits) - ref["logits_full_nocache"]).max(-1)
    # per prompt from its first real token (the rows are left-padded)
    assert_parted_only_after_rounding_boundaries(
        folder, [err[row, s - length:] for row, length in enumerate(ref["lengths"])], 1e-4)


@pytest.mark.parametrize("folder", FIXTURES, ids=["a", "b"])
def test_unpadded_prompts_agree_with_the_padded_batch(folder):
    """Each prompt alone, unpadded, against the reference's `logits_single`."""
    _, _, ref = case(folder)
    errors = []
    for row, length in enumerate(ref["lengths"]):
        tokens = ref["input_ids"][row:row + 1, -length:]
        alone, _ = run(folder, tokens, np.ones_like(tokens, bool))
        errors.append(np.abs(np.asarray(alone)[0] - ref["logits_single"][row, -length:]).max(-1))
    assert_parted_only_after_rounding_boundaries(folder, errors, 1e-4)
