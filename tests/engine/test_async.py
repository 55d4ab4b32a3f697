"""Asynchronous scheduling (the default): same tokens as the synchronous loop, no implicit
host-device transfers in the loop."""

from __future__ import annotations

import jax
import pytest

import deepinfer_jax
from bench.lib.admission import admit_first_chunks
from deepinfer_jax import FinishReason, SamplingParams
from tests.engine.conftest import ENGINE
from tests.engine.test_engine_vs_hf import check_outputs, sampling

pytestmark = pytest.mark.oracle


@pytest.fixture(scope="module")
def sync_llm(model):
    return deepinfer_jax.LLM(model, **{**ENGINE, "async_scheduling": False})


def test_sync_loop_gives_the_same_tokens(llm, sync_llm, workload):
    assert llm.host_options.async_scheduling and not sync_llm.host_options.async_scheduling
    params = sampling(workload)
    async_out = llm.generate(workload.prompts, params, use_tqdm=False)
    sync_out = sync_llm.generate(workload.prompts, params, use_tqdm=False)
    assert [o.token_ids for o in async_out] == [o.token_ids for o in sync_out]
    check_outputs(async_out, workload)


def test_async_loop_without_the_launch_thread(model, llm, workload):
    """launch_thread=False: the asynchronous loop launches each step from its own thread (the
    A/B for the launcher thread on a GPU); same tokens."""
    inline = deepinfer_jax.LLM(model, **{**ENGINE, "launch_thread": False})
    assert inline.host_options.async_scheduling and inline.engine._launcher._pool is None
    assert llm.engine._launcher._pool is not None
    params = sampling(workload)
    outputs = inline.generate(workload.prompts, params, use_tqdm=False)
    assert [o.token_ids for o in outputs] == [
        o.token_ids for o in llm.generate(workload.prompts, params, use_tqdm=False)]
    check_outputs(outputs, workload)
    # switched back and forth between steps, with a step in flight: still the same tokens
    request = inline.engine.add_request("again", list(workload.prompts[0]), params[0])
    inline.engine.step()
    inline.engine.set_launch_thread(True)
    inline.engine.step()
    inline.engine.set_launch_thread(False)
    while inline.engine.has_unfinished():
        inline.engine.step()
    assert list(request.generated) == outputs[0].token_ids


def test_preemption_in_the_synchronous_loop(model, workload):
    # (the asynchronous loop's, the default, is test_engine_vs_hf.py's preemption test)
    llm = deepinfer_jax.LLM(model, **{**ENGINE, "num_pages": 14, "async_scheduling": False})
    admit_first_chunks(llm)          # admission that overcommits the cache, so that it preempts
    outputs = llm.generate(workload.prompts, sampling(workload), use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    check_outputs(outputs, workload)


@pytest.mark.parametrize("which", ["async", "sync"])
def test_aborts_in_both_loops(llm, sync_llm, workload, which):
    engine = llm if which == "async" else sync_llm
    idx = [0, 4, 8, 12]
    prompts = [workload.prompts[i] for i in idx]
    params = [SamplingParams(max_tokens=workload.max_new[i], ignore_eos=True) for i in idx]
    got, reasons = {k: [] for k in range(4)}, {}
    for delta in engine.stream(prompts, params):
        got[delta.index] += delta.token_ids
        if delta.index in (1, 3) and delta.token_ids and delta.index not in reasons:
            engine.abort(delta.request_id)
        if delta.finished:
            reasons[delta.index] = delta.finish_reason
    for k, i in enumerate(idx):
        if k in (1, 3) and workload.max_new[i] > len(got[k]):
            assert reasons[k] is FinishReason.ABORT
        assert got[k] == workload.expected[i][: len(got[k])]
        if k in (0, 2):
            assert got[k] == workload.expected[i] and reasons[k] is FinishReason.LENGTH
    assert engine.engine.scheduler.kv_cache.num_free_pages == engine.step_config.num_pages


def test_the_loop_makes_no_implicit_transfers(llm, workload):
    params = sampling(workload)
    with jax.transfer_guard("disallow"):
        outputs = llm.generate(workload.prompts[:10], params[:10], use_tqdm=False)
        deltas = list(llm.stream(workload.prompts[10:12], params[10:12]))
    assert [o.token_ids for o in outputs] == workload.expected[:10]
    assert sum(len(d.token_ids) for d in deltas) == sum(workload.max_new[10:12])
