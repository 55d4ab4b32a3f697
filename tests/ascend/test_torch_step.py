"""The Ascend backend's torch step (ascend_backend/step.py) on torch's CPU device, against
the JAX engine's step and the Hugging Face oracle, in float32.

The two oracle prompts of tiny-mixed (320 tokens: sliding, CSA and HCA layers, hash and
routed MoE) run as one ragged batch: chunked prefill (64 tokens a row a step, so chunks
split compressor blocks and the window), then greedy decode steps over the paged state, the
sequences in slots and pages out of order. One row decodes with penalties on, and its
decode tokens come as placeholders (-1) the step resolves from its own last sample. The
same plans go through the JAX step here and through the torch step in .venv-ascend
(tests/ascend/torch_replay.py): every token's logits, and the step outputs, must agree.
"""

from __future__ import annotations

import dataclasses
import functools
import json

import jax
import numpy as np
import pytest

import deepinfer_jax.device  # noqa: F401  (registers BatchPlan as a pytree)
from deepinfer_jax.config.compute import ComputeConfig
from deepinfer_jax.config.step import StepConfig
from deepinfer_jax.device.step import resolve_placeholders, step
from deepinfer_jax.host.decision import ScheduleDecision, ScheduledSeq
from deepinfer_jax.host.plan_builder import build_plan
from deepinfer_jax.host.request import Request, SamplingParams
from deepinfer_jax.model.family import model_family
from deepinfer_jax.model.reference_forward import project_logits
from tests.ascend.ascend_env import needs_ascend_env, run_in_ascend_env
from tests.ascend.jax_side import flat_params
from tests.conftest import oracle_case

pytestmark = [needs_ascend_env, pytest.mark.oracle]

CHUNK, BUCKET, PAGE, BLOCKS, DECODE, LOGPROBS = 64, 128, 64, 6, 6, 5
SLOTS, PAGES = (2, 0), ((7, 1, 10, 4, 2, 11), (3, 8, 0, 5, 9, 6))
STEP = dict(max_num_seqs=4, max_model_len=PAGE * BLOCKS, page_size=PAGE,
            num_pages=2 * BLOCKS, max_blocks_per_seq=BLOCKS, max_num_batched_tokens=BUCKET,
            token_buckets=[BUCKET], max_logprobs=LOGPROBS, vocab_size=512)


def _plans(prompts, sampling, step_fn):
    """Schedules the prompts chunk by chunk, then DECODE greedy steps; step_fn(plan) ->
    StepOutput decides each sampled token. -> the plans fed."""
    reqs = [Request(str(r), p, s, r) for r, (p, s) in enumerate(zip(prompts, sampling))]
    computed, plans = [0, 0], []
    while any(len(r.generated) < DECODE for r in reqs):
        seqs = []
        for r, req in enumerate(reqs):
            n = min(CHUNK, len(req.tokens) - computed[r])
            seqs.append(ScheduledSeq(req, computed[r], n, samples=computed[r] + n == len(req.tokens),
                                     slot=SLOTS[r], pages=list(PAGES[r])))
        plan = build_plan(ScheduleDecision(tuple(seqs)), BUCKET, step_cfg())
        if reqs[1].generated:       # row 1's fed token: the step's own last sample
            ids = plan.token_ids.copy()
            ids[plan.seq_offset[1]] = -1
            plan = dataclasses.replace(plan, token_ids=ids)
        out = step_fn(plan)
        plans.append(plan)
        for r, seq in enumerate(seqs):
            computed[r] += seq.num_tokens
            if seq.samples:
                reqs[r].generated.append(int(out.next_tokens[r]))
    return plans


@functools.cache
def step_cfg() -> StepConfig:
    return StepConfig(**{**STEP, "token_buckets": tuple(STEP["token_buckets"])},
                      speculative=None, compute=ComputeConfig())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """-> (oracle case, plans, JAX per step (logits f32[T, V], StepOutput), torch per step)."""
    case = oracle_case("tiny-mixed")
    cfg, params = case.model.config, case.model.params
    sc = step_cfg()

    @jax.jit
    def jax_step(params, state, plan):
        # every token's logits (from the state before the step), then the engine's step
        token_ids = resolve_placeholders(plan.token_ids, plan, state.last_tokens)
        _, final = model_family(cfg).forward(params, state, plan, token_ids, cfg, sc)
        logits = project_logits(final, params.hc_head, params.norm, params.head, cfg, sc.compute)
        state, out = step(params, state, plan, cfg=cfg, step_cfg=sc, truncation=False)
        return state, out, logits

    state = model_family(cfg).init_state(cfg, sc, np.float32)
    results = []

    def run(plan):
        nonlocal state
        state, out, logits = jax_step(params, state, plan)
        out = jax.tree.map(np.asarray, out)
        results.append((np.asarray(logits), out))
        return out

    ref = case.reference
    prompts = [ref["input_ids"][r].tolist() for r in range(2)]
    sampling = [SamplingParams(logprobs=LOGPROBS),
                SamplingParams(logprobs=LOGPROBS, repetition_penalty=1.3, presence_penalty=0.5)]
    plans = _plans(prompts, sampling, run)
    work = tmp_path_factory.mktemp("ascend")
    np.savez(work / "params.npz", **flat_params(params))
    for i, plan in enumerate(plans):
        np.savez(work / f"plan_{i}.npz", **dataclasses.asdict(plan))
    (work / "case.json").write_text(json.dumps(
        {"config": str(case.checkpoint / "config.json"), "step": STEP, "steps": len(plans)}))
    run_in_ascend_env("tests/ascend/torch_replay.py", str(work))
    torch_out = [dict(np.load(work / f"out_{i}.npz")) for i in range(len(plans))]
    return case, plans, results, torch_out


def test_every_token_logits_match_the_jax_step(runs):
    _, plans, jax_runs, torch_runs = runs
    assert len(plans) == -(-320 // CHUNK) + DECODE - 1
    for i, (plan, (logits, _), ours) in enumerate(zip(plans, jax_runs, torch_runs, strict=True)):
        real = plan.token_seq < plan.seq_slot.shape[0]
        diff = np.abs(ours["logits"][real] - logits[real]).max()
        assert diff <= 1e-4, f"step {i}: max |torch - jax| = {diff:.2e}"


def test_step_outputs_match_the_jax_step(runs):
    _, plans, jax_runs, torch_runs = runs
    assert sum(int(plan.seq_samples.sum()) for plan in plans) == 2 * DECODE
    for i, (plan, (_, out), ours) in enumerate(zip(plans, jax_runs, torch_runs, strict=True)):
        rows = plan.seq_samples
        np.testing.assert_array_equal(ours["next_tokens"][rows], out.next_tokens[rows],
                                      err_msg=f"step {i}")
        np.testing.assert_array_equal(ours["top_ids"][rows], out.top_ids[rows])
        np.testing.assert_allclose(ours["logprob"][rows], out.logprob[rows], atol=1e-4)
        np.testing.assert_allclose(ours["top_logprobs"][rows], out.top_logprobs[rows], atol=1e-4)


def test_prompt_logits_match_hf(runs):
    """The prefill steps' logits at every prompt position against the oracle's (the measure
    of tests/model/test_hf_parity.py: max |diff| / max |logit| per position)."""
    case, plans, _, torch_runs = runs
    ref = case.reference["logits"]                                          # [2, 320, V]
    ours = np.zeros_like(ref)
    for plan, out in zip(plans, torch_runs):
        for row in range(2):
            n, start = plan.seq_len[row], plan.seq_start[row]
            span = slice(plan.seq_offset[row], plan.seq_offset[row] + n)
            keep = start + np.arange(n) < ref.shape[1]
            ours[row, (start + np.arange(n))[keep]] = out["logits"][span][keep]
    err = np.abs(ours - ref).max(axis=-1) / np.abs(ref).max()
    worst = np.unravel_index(err.argmax(), err.shape)
    assert err.max() <= 1e-4, f"max |diff| / max |logit| = {err.max():.2e} at (row, pos) {worst}"
