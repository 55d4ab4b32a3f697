"""Sampling through the engine: seeded determinism whatever the batch, chunking or loop;
logprobs, penalties, min_tokens and validation."""

from __future__ import annotations

import chex
import numpy as np
import pytest

import deepinfer_jax
from deepinfer_jax import FinishReason, InvalidRequestError, SamplingParams
from tests.engine.conftest import ENGINE

pytestmark = pytest.mark.oracle

SEEDED = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.95, top_k=50, seed=1234,
                        ignore_eos=True)


def others(workload, n):
    """n other requests: random-seeded sampling and greedy, long and short prompts."""
    return [(workload.prompts[i % 32], SamplingParams(max_tokens=5 + i % 7, temperature=float(i % 2),
                                                       ignore_eos=True)) for i in range(n)]


def run(llm, target_prompt, params, company):
    prompts = [p for p, _ in company[: len(company) // 2]] + [target_prompt] + \
        [p for p, _ in company[len(company) // 2:]]
    sampling = [s for _, s in company[: len(company) // 2]] + [params] + \
        [s for _, s in company[len(company) // 2:]]
    outputs = llm.generate(prompts, sampling, use_tqdm=False)
    return outputs[len(company) // 2].token_ids


def test_seeded_request_is_independent_of_batch_chunks_and_loop(llm, model, workload):
    prompt = workload.prompts[5]          # a long prompt: chunked differently below
    alone = run(llm, prompt, SEEDED, [])
    assert run(llm, prompt, SEEDED, others(workload, 8)) == alone
    assert run(llm, prompt, SEEDED, others(workload, 32)) == alone
    small_chunks = deepinfer_jax.LLM(model, **{**ENGINE, "max_num_batched_tokens": 16})
    assert run(small_chunks, prompt, SEEDED, others(workload, 8)) == alone
    sync = deepinfer_jax.LLM(model, **{**ENGINE, "async_scheduling": False})
    assert run(sync, prompt, SEEDED, others(workload, 8)) == alone
    different_seed = run(llm, prompt, SamplingParams(**{**SEEDED.__dict__, "seed": 99}), [])
    assert different_seed != alone
    # greedy among the same company: HF's greedy output for this prompt alone (9 tokens)
    hf = workload.expected[5]
    assert len(hf) >= 8
    greedy = run(llm, prompt, SamplingParams(max_tokens=len(hf), ignore_eos=True), others(workload, 8))
    chex.assert_trees_all_equal(greedy, hf)


def test_unseeded_requests_draw_from_the_engine_seed(model, workload):
    params = SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True)
    a = deepinfer_jax.LLM(model, **{**ENGINE, "seed": 7}).generate(workload.prompts[:3], params,
                                                                   use_tqdm=False)
    b = deepinfer_jax.LLM(model, **{**ENGINE, "seed": 7}).generate(workload.prompts[:3], params,
                                                                   use_tqdm=False)
    c = deepinfer_jax.LLM(model, **{**ENGINE, "seed": 8}).generate(workload.prompts[:3], params,
                                                                   use_tqdm=False)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [o.token_ids for o in a] != [o.token_ids for o in c]


def test_logprobs_are_the_reference_models(llm, model, workload):
    prompt = workload.prompts[9]
    [out] = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0.8, seed=3,
                                                  logprobs=4, ignore_eos=True), use_tqdm=False)
    assert len(out.logprobs) == 6
    logits = model.logits(prompt + out.token_ids)[0, len(prompt) - 1: -1]
    chex.assert_shape(logits, (6, model.config.vocab_size))
    ref = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - logits.max(-1, keepdims=True)
    chex.assert_trees_all_equal([lp.token_id for lp in out.logprobs], out.token_ids)
    chex.assert_trees_all_close(np.array([lp.logprob for lp in out.logprobs]),
                                ref[np.arange(6), out.token_ids], atol=1e-4, rtol=0)
    best = np.argsort(-ref, axis=-1)[:, :4]
    chex.assert_trees_all_equal(np.array([[t for t, _ in lp.top] for lp in out.logprobs]), best)
    chex.assert_trees_all_close(np.array([[v for _, v in lp.top] for lp in out.logprobs]),
                                np.take_along_axis(ref, best, axis=-1), atol=1e-4, rtol=0)


def test_penalties_change_the_output_and_reset_with_the_slot(llm, workload):
    prompt = workload.prompts[2]
    base = SamplingParams(max_tokens=24, ignore_eos=True)
    plain = llm.generate([prompt], base, use_tqdm=False)[0].token_ids
    penalized = SamplingParams(max_tokens=24, ignore_eos=True, repetition_penalty=1.8,
                               presence_penalty=1.5, frequency_penalty=1.0)
    first = llm.generate([prompt], penalized, use_tqdm=False)[0].token_ids
    assert first != plain
    # presence + frequency penalties discourage repeats within the output
    assert len(set(first)) >= len(set(plain))
    llm.generate(workload.prompts[:8], SamplingParams(max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert llm.generate([prompt], penalized, use_tqdm=False)[0].token_ids == first


def test_min_tokens_holds_back_eos_and_stop_tokens(llm, workload):
    prompt = workload.prompts[4]
    greedy = llm.generate([prompt], SamplingParams(max_tokens=6, ignore_eos=True),
                          use_tqdm=False)[0].token_ids
    stop_first = SamplingParams(max_tokens=6, stop_token_ids=[greedy[0]], ignore_eos=True)
    assert llm.generate([prompt], stop_first, use_tqdm=False)[0].token_ids == greedy[:1]
    held = SamplingParams(max_tokens=6, stop_token_ids=[greedy[0]], min_tokens=3, ignore_eos=True)
    out = llm.generate([prompt], held, use_tqdm=False)[0]
    assert len(out.token_ids) >= 3 and greedy[0] not in out.token_ids[:3]


@pytest.mark.parametrize("bad, words", [
    (dict(temperature=-1.0), "temperature"), (dict(top_p=0.0), "top_p"), (dict(min_p=1.5), "min_p"),
    (dict(top_k=-2), "top_k"), (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(presence_penalty=3.0), "presence_penalty"), (dict(logprobs=10**6), "logprobs"),
    (dict(min_tokens=50, max_tokens=4), "min_tokens"), (dict(seed=-1), "seed"),
    (dict(stop=["x"]), "tokenizer"), (dict(regex="a+"), "tokenizer"),
])
def test_bad_sampling_values_fail_the_request(llm, bad, words):
    [out] = llm.generate([[3, 4, 5]], SamplingParams(**bad), use_tqdm=False)
    assert out.finish_reason is FinishReason.ERROR and isinstance(out.error, InvalidRequestError)
    assert words in str(out.error)
