"""The host's Engram row ids for a plan (engine/engram_rows.py): each row's chunk hashed with its
sequence's look-back equals the hash of the whole sequence at those positions, and equals the
reference's `engram_hash_ids` on the fixture's prompts; a token the host has not seen is an
error, never a silent hash of -1."""

from __future__ import annotations

import numpy as np
import pytest

from deepinfer_jax.config.compute import ComputeConfig
from deepinfer_jax.config.hf import read_model_config
from deepinfer_jax.config.step import StepConfig
from deepinfer_jax.engine.engram_rows import EngramRows
from deepinfer_jax.host.decision import ScheduleDecision, ScheduledSeq
from deepinfer_jax.host.plan_builder import build_plan
from deepinfer_jax.host.request import PLACEHOLDER, Request, SamplingParams
from deepinfer_jax.model.v41 import engram_hash
from tests.model.v41_oracle import FIXTURES

pytestmark = pytest.mark.skipif(not FIXTURES[0].exists(), reason="no V4.1 oracle fixtures")


def _setup(folder):
    cfg = read_model_config(folder)
    ref = np.load(folder / "reference.npz")
    shape = (len(cfg.engram.layer_ids), cfg.engram.n_columns)
    step_cfg = StepConfig(max_num_seqs=4, max_model_len=128, page_size=16, num_pages=32,
                          max_blocks_per_seq=8, max_num_batched_tokens=32, token_buckets=(32,),
                          max_logprobs=0, vocab_size=cfg.vocab_size, speculative=None,
                          compute=ComputeConfig(), engram_shape=shape)
    return cfg, ref, step_cfg, EngramRows(cfg.engram, ref["engram_token_map"])


@pytest.mark.parametrize("folder", FIXTURES, ids=["a", "b"])
def test_chunks_hash_as_the_whole_sequence(folder):
    cfg, ref, step_cfg, rows = _setup(folder)
    prompts = [ref["input_ids"][r, -n:].tolist() for r, n in enumerate(ref["lengths"])]
    reqs = [Request(str(r), p, SamplingParams(), r) for r, p in enumerate(prompts)]
    # rows at the start, in the middle (look-back in an earlier step) and near the end
    seqs = (ScheduledSeq(reqs[0], 0, 7, True, 0, [0]),
            ScheduledSeq(reqs[1], 1, 11, False, 1, [1, 2]),
            ScheduledSeq(reqs[2], 60, 10, True, 2, [3, 4, 5, 6, 7]))
    plan = build_plan(ScheduleDecision(seqs), 32, step_cfg)
    rows.fill(plan, ScheduleDecision(seqs))
    for row, seq in enumerate(seqs):
        r = int(seq.request.request_id)
        span = slice(plan.seq_offset[row], plan.seq_offset[row] + seq.num_tokens)
        positions = slice(seq.start, seq.start + seq.num_tokens)
        want = ref["engram_hash_ids"][r, -len(prompts[r]):][positions]
        np.testing.assert_array_equal(plan.engram_ids[span], want)
        whole = engram_hash.hash_ids(np.array([prompts[r]]), np.ones((1, len(prompts[r])), bool),
                                     ref["engram_token_map"], cfg.engram, rows.tables)[0]
        np.testing.assert_array_equal(plan.engram_ids[span], whole[positions])


def test_an_unseen_token_is_an_error():
    cfg, ref, step_cfg, rows = _setup(FIXTURES[0])
    req = Request("0", [3, 4, 5], SamplingParams(), 0)
    req.generated.append(PLACEHOLDER)
    seqs = (ScheduledSeq(req, 3, 1, True, 0, [0]),)
    plan = build_plan(ScheduleDecision(seqs), 32, step_cfg)
    with pytest.raises(RuntimeError, match="asynchronous scheduling"):
        rows.fill(plan, ScheduleDecision(seqs))
