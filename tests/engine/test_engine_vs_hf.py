"""The engine's greedy outputs against Hugging Face `generate`, request by request.

32 requests submitted together (prompts of 1..600 tokens, 1..24 new tokens) on the tiny-mixed
model (sliding, CSA and HCA layers): every output must equal HF's greedy output for that
prompt alone -- with the default engine, with a page pool small enough to force preemption,
and with a chunked-prefill budget so small that long prompts span dozens of steps.
"""

from __future__ import annotations

import pytest

import deepinfer_jax
from bench.lib.admission import admit_first_chunks
from deepinfer_jax import FinishReason, SamplingParams
from tests.engine.conftest import ENGINE

pytestmark = pytest.mark.oracle


def sampling(workload, stops: dict[int, int] | None = None) -> list[SamplingParams]:
    stops = stops or {}
    return [SamplingParams(max_tokens=n, ignore_eos=True,
                           stop_token_ids=[stops[i]] if i in stops else [])
            for i, n in enumerate(workload.max_new)]


def check_outputs(outputs, workload, stops: dict[int, int] | None = None):
    stops = stops or {}
    assert len(outputs) == len(workload.prompts)
    for i, (out, want) in enumerate(zip(outputs, workload.expected)):
        assert out.error is None, out.error
        if i in stops:
            want = want[: want.index(stops[i]) + 1]
            assert out.finish_reason is FinishReason.STOP
        else:
            assert out.finish_reason is FinishReason.LENGTH
        assert out.token_ids == want, f"request {i} (prompt of {len(workload.prompts[i])} tokens)"


def test_32_mixed_requests_match_hf(llm, workload):
    # a few requests stop on a token that HF's output contains half-way
    stops = {i: w[len(w) // 2] for i, w in enumerate(workload.expected) if len(w) >= 4}
    stops = dict(list(stops.items())[:4])
    outputs = llm.generate(workload.prompts, sampling(workload, stops), use_tqdm=False)
    check_outputs(outputs, workload, stops)
    assert sorted(len(p) for p in workload.prompts)[0] == 1
    assert max(len(p) for p in workload.prompts) >= 600


@pytest.mark.parametrize("first_chunk_admission", [True, False])
def test_preemption_loses_nothing(model, workload, first_chunk_admission):
    # 640 tokens need 10 pages of 64; 14 pages cannot hold the batch. Admitted whenever their
    # first chunk fits, requests get preempted, recomputed later, and still produce HF's
    # tokens; admitted only while the cache holds them to their ends, none is preempted.
    llm = deepinfer_jax.LLM(model, **{**ENGINE, "num_pages": 14})
    if first_chunk_admission:
        admit_first_chunks(llm)
    outputs = llm.generate(workload.prompts, sampling(workload), use_tqdm=False)
    assert (llm.engine.scheduler.num_preemptions > 0) == first_chunk_admission
    check_outputs(outputs, workload)


def test_small_chunk_budget_spreads_prompts_over_many_steps(model, workload):
    llm = deepinfer_jax.LLM(model, **{**ENGINE, "max_num_batched_tokens": 16})
    outputs = llm.generate(workload.prompts, sampling(workload), use_tqdm=False)
    check_outputs(outputs, workload)
    # 9.6k prompt tokens at 16 per step
    assert llm.engine.num_steps >= sum(len(p) for p in workload.prompts) // 16
