"""The LLM API: bad input fails one request only, misuse raises, streaming, aborts, and no
compilation after start-up."""

from __future__ import annotations

import jax
import pytest

import deepinfer_jax
from deepinfer_jax import FinishReason, InvalidRequestError, SamplingParams

pytestmark = pytest.mark.oracle


def test_bad_requests_fail_alone(llm, workload):
    good = [workload.prompts[i] for i in (3, 7)]
    prompts = [good[0], [], list(range(700)), [5, 2, 10**6, 3], good[1], [4, 5], [4, 5], [4, 5]]
    params = [SamplingParams(max_tokens=workload.max_new[3], ignore_eos=True), SamplingParams(),
              SamplingParams(), SamplingParams(),
              SamplingParams(max_tokens=workload.max_new[7], ignore_eos=True),
              {"max_tokens": 0}, {"max_tokens": 3, "bogus_option": 1},
              SamplingParams(stop_token_ids=[10**6])]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for i in (1, 2, 3, 5, 6, 7):
        assert outputs[i].finish_reason is FinishReason.ERROR, i
        assert isinstance(outputs[i].error, InvalidRequestError), i
        assert outputs[i].token_ids == []
    for expected_error, i in (("empty prompt", 1), ("max_model_len", 2), ("vocabulary", 3),
                              ("max_tokens", 5), ("bogus_option", 6), ("stop_token_ids", 7)):
        assert expected_error in str(outputs[i].error)
    assert outputs[0].token_ids == workload.expected[3] and outputs[0].error is None
    assert outputs[4].token_ids == workload.expected[7] and outputs[4].error is None


@pytest.mark.parametrize("call", [
    lambda llm: llm.generate(123),
    lambda llm: llm.generate([[1, 2], 3.5]),
    lambda llm: llm.generate([[1, 2]], "greedy"),
    lambda llm: llm.generate([[1, 2]], [SamplingParams(), SamplingParams()]),
    lambda llm: SamplingParams(max_tokens="8"),
    lambda llm: SamplingParams(ignore_eos=1),
])
def test_api_misuse_raises_at_once(llm, call):
    with pytest.raises((TypeError, ValueError)):
        call(llm)


def test_unknown_engine_option_raises(model):
    with pytest.raises(TypeError, match="bogus"):
        deepinfer_jax.LLM(model, bogus=1)


def test_stream_deltas_add_up_to_the_full_output(llm, workload):
    idx = [0, 5, 9]
    prompts = [workload.prompts[i] for i in idx]
    params = [SamplingParams(max_tokens=workload.max_new[i], ignore_eos=True) for i in idx]
    got = {k: [] for k in range(len(idx))}
    finished = set()
    for delta in llm.stream(prompts, params):
        assert delta.index not in finished
        got[delta.index] += delta.token_ids
        if delta.finished:
            finished.add(delta.index)
            assert delta.finish_reason is FinishReason.LENGTH
    assert finished == set(got)
    assert [got[k] for k in range(len(idx))] == [workload.expected[i] for i in idx]


def test_abort_one_request_while_streaming(llm, workload):
    prompts = [workload.prompts[i] for i in (1, 2)]
    params = [SamplingParams(max_tokens=200, ignore_eos=True),
              SamplingParams(max_tokens=workload.max_new[2], ignore_eos=True)]
    stream = llm.stream(prompts, params)
    reasons, tokens = {}, {0: [], 1: []}
    for delta in stream:
        tokens[delta.index] += delta.token_ids
        if delta.index == 0 and delta.token_ids and 0 not in reasons:
            assert llm.abort(delta.request_id)
        if delta.finished:
            reasons[delta.index] = delta.finish_reason
    assert reasons == {0: FinishReason.ABORT, 1: FinishReason.LENGTH}
    assert tokens[1] == workload.expected[2]
    assert len(tokens[0]) < 200
    assert not llm.engine.has_unfinished()
    assert llm.engine.scheduler.kv_cache.num_free_pages == llm.step_config.num_pages


def test_no_compilation_after_startup(llm, workload):
    events = []

    def listener(name, *args, **kwargs):
        if name.startswith("/jax/core/compile"):
            events.append(name)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        prompts = workload.prompts[:12]
        params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in workload.max_new[:12]]
        outputs = llm.generate(prompts, params, use_tqdm=False)    # prefill, mixed and decode
        list(llm.stream([[3, 4, 5]], SamplingParams(max_tokens=5)))
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert [o.token_ids for o in outputs] == workload.expected[:12]
    assert events == []


def test_engines_of_equal_shapes_share_their_compiled_steps(llm, model):
    """A second engine whose steps would trace the same (the host-only options differ) reuses
    the first one's executables; one whose trace would differ does not."""
    from deepinfer_jax.engine.compile import _trace_key
    from tests.engine.conftest import ENGINE

    # Two fresh engines: the session's `llm` may predate tests/conftest.py's per-file release
    # of the memo, so it is not the one a new engine would find.
    first = deepinfer_jax.LLM(model, **{**ENGINE, "seed": 7})
    again = deepinfer_jax.LLM(model, **{**ENGINE, "seed": 11, "async_scheduling": False})
    shared = first.engine.steps.by_key
    assert shared.keys() == again.engine.steps.by_key.keys()
    assert all(again.engine.steps.by_key[key] is step for key, step in shared.items())
    core = llm.engine

    def key(step_cfg=core.step_cfg, state=core.state):
        return _trace_key(core.params, state, core.cfg, step_cfg, False)

    assert key() == key(step_cfg=again.engine.step_cfg)
    assert key() != key(step_cfg=deepinfer_jax.EngineConfig(
        **{**ENGINE, "max_logprobs": 3}).resolve(model.config))        # read by the step
    assert key() != key(state=jax.tree.map(lambda x: x.astype("float16"), core.state))
    assert key() != key(step_cfg=deepinfer_jax.EngineConfig(
        **{**ENGINE, "step_formulation": "gpu"}).resolve(model.config))  # another program
