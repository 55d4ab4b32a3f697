"""The host's Engram row ids for a plan (engine/engram_rows.py): each row's chunk hashed with its
sequence's look-back equals the hash of the whole sequence at those positions, and equals the
reference's `engram_hash_ids` on the fixture's prompts; a token the host has not seen is an
error, never a silent hash of -1. Where the step hashes (device tables), the plan's look-back
and the step's hash (model/v41/engram_device.py) give the host's ids, a token still in flight
included."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import deepinfer_jax.device  # noqa: F401  (registers BatchPlan as a pytree)
from deepinfer_jax.config.compute import ComputeConfig
from deepinfer_jax.config.hf import read_model_config
from deepinfer_jax.config.step import StepConfig
from deepinfer_jax.engine.engram_rows import EngramRows
from deepinfer_jax.host.decision import ScheduleDecision, ScheduledSeq
from deepinfer_jax.host.plan_builder import build_plan
from deepinfer_jax.host.request import PLACEHOLDER, Request, SamplingParams
from deepinfer_jax.model.v41 import engram_device, engram_hash
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


@pytest.mark.parametrize("folder", FIXTURES, ids=["a", "b"])
def test_the_step_hashes_a_plan_as_the_host(folder):
    """Rows at a sequence's start, in its middle and at a decode step whose fed token the host
    has not read (-1 in the plan; the step resolves it before hashing, given here)."""
    cfg, ref, step_cfg, rows = _setup(folder)
    prompts = [ref["input_ids"][r, -n:].tolist() for r, n in enumerate(ref["lengths"])]
    known = [Request(str(r), p, SamplingParams(), r) for r, p in enumerate(prompts)]
    known[2].generated += [11, 12]
    flying = Request("2", prompts[2], SamplingParams(), 2)
    flying.generated += [11, PLACEHOLDER]
    end = len(prompts[2]) + 1

    def seqs(last):
        return (ScheduledSeq(known[0], 0, 7, True, 0, [0]),
                ScheduledSeq(known[1], 1, 11, False, 1, [1, 2]),
                ScheduledSeq(last, end, 1, True, 2, [3, 4, 5, 6, 7]))

    host_plan = build_plan(ScheduleDecision(seqs(known[2])), 32, step_cfg)
    rows.fill(host_plan, ScheduleDecision(seqs(known[2])))
    device_cfg = dataclasses.replace(step_cfg, engram_lookback=cfg.engram.max_ngram_size - 1)
    plan = build_plan(ScheduleDecision(seqs(flying)), 32, device_cfg)
    assert plan.engram_ids.shape == (32, 0, 0) and plan.token_ids[18] == PLACEHOLDER
    np.testing.assert_array_equal(plan.engram_before[0], [-1] * device_cfg.engram_lookback)
    resolved = jnp.asarray(host_plan.token_ids)             # the step's resolved tokens
    products = engram_hash.product_words(ref["engram_token_map"], rows.tables)
    look_back = engram_device.plan_look_back(resolved, jax.tree.map(jnp.asarray, plan),
                                             jnp.asarray(plan.engram_before))
    ids = np.asarray(engram_device.hash_ids(look_back, jnp.asarray(products), cfg.engram))
    fed = 7 + 11 + 1
    np.testing.assert_array_equal(ids[:fed], host_plan.engram_ids[:fed])


def test_a_token_in_flight_before_a_span_is_an_error():
    """Only a span's own first token may be in flight where the step hashes."""
    cfg, _, step_cfg, _ = _setup(FIXTURES[0])
    device_cfg = dataclasses.replace(step_cfg, engram_lookback=cfg.engram.max_ngram_size - 1)
    req = Request("0", [3, 4, 5], SamplingParams(), 0)
    req.generated += [PLACEHOLDER, PLACEHOLDER]
    seqs = (ScheduledSeq(req, 4, 1, True, 0, [0]),)
    with pytest.raises(RuntimeError, match="still in flight"):
        build_plan(ScheduleDecision(seqs), 32, device_cfg)
