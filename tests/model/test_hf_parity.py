"""The cache-free forward against Hugging Face `DeepseekV4ForCausalLM` (transformers 5.23.0).

Three tiny random configs (tests/oracle/build.py) together cover sliding, CSA and HCA layers,
hash and routed MoE with a random tid2eid table and selection bias, the sqrtsoftplus and
sigmoid routers, YaRN on the compress rope, modern and legacy config fields, and prompts of
300-600 tokens: longer than the window, with more compressed rows than index_topk.
"""

from __future__ import annotations

import numpy as np
import pytest

from deepinfer_jax.config.model import AttentionKind, MlpKind, ScoringFunc
from tests.conftest import ORACLE_CASES, oracle_case

pytestmark = pytest.mark.oracle


def _relative_error_per_position(ours: np.ndarray, ref: np.ndarray) -> np.ndarray:
    return np.abs(ours - ref).max(axis=-1) / np.abs(ref).max()


def test_logits_match_hf_at_every_position(case):
    ref = case.reference
    ours = case.model.logits(ref["input_ids"])
    assert ours.shape == ref["logits"].shape and ours.dtype == np.float32
    err = _relative_error_per_position(ours, ref["logits"])
    worst = np.unravel_index(err.argmax(), err.shape)
    assert err.max() <= 1e-4, f"max |diff| / max |logit| = {err.max():.2e} at (batch, pos) {worst}"


def test_greedy_continuation_matches_hf_generate(case):
    ref = case.reference
    tokens = [int(t) for t in ref["greedy_prompt"]]
    for _ in range(len(ref["greedy_tokens"])):
        tokens.append(int(case.model.logits(tokens)[0, -1].argmax()))
    generated = tokens[len(ref["greedy_prompt"]):]
    assert generated == ref["greedy_tokens"].tolist()


def test_mtp_block_matches_hf_layer_composition(case):
    ref = case.reference
    ours = case.model.mtp_logits(ref["input_ids"][:1])
    assert ours.shape == ref["mtp_logits"].shape
    err = _relative_error_per_position(ours, ref["mtp_logits"])
    assert err.max() <= 1e-4


def test_sequences_long_enough_for_window_and_topk(case):
    """Guard on the fixtures themselves: the cases must exercise what they claim to."""
    cfg = case.model.config
    seq = case.reference["input_ids"].shape[1]
    assert seq >= 300 and seq > cfg.sliding_window
    if AttentionKind.CSA in cfg.layer_types:
        assert seq // cfg.compress_rate_csa > cfg.index_topk
    if AttentionKind.HCA in cfg.layer_types:
        assert seq // cfg.compress_rate_hca >= 2


def test_cases_cover_the_architecture():
    cfgs = [oracle_case(name).model.config for name in ORACLE_CASES]
    assert {k for c in cfgs for k in c.layer_types} == set(AttentionKind)
    assert {k for c in cfgs for k in c.mlp_types} == set(MlpKind)
    assert {c.scoring_func for c in cfgs} >= {ScoringFunc.SQRTSOFTPLUS, ScoringFunc.SIGMOID}
    assert any(c.compress_yarn is not None for c in cfgs)
    assert all(len(oracle_case(n).model.params.mtp) == 1 for n in ORACLE_CASES)
