"""The server with its engine in a process of its own (api/server/engine_process.py), driven by
the official client: the same outputs as `LLM.generate`, bad input a 400 naming its
parameter, a client that goes away freeing its pages at once, /metrics following the engine
in the other process, a start-up failure an error (not a hang), and an engine that dies
failing its requests with a 500 while /health says so.

One engine process serves the module (a spawned process compiles the tiny model once; its
options are the `served` fixture's, whose `LLM.generate` outputs are the reference). The
last test kills it."""

from __future__ import annotations

import functools
import os
import signal
import time
import urllib.error
import urllib.request

import openai
import pytest

from deepinfer_jax.api.llm import LLM
from deepinfer_jax.api.server.engine_process import EngineProcess, EngineStartError
from tests.api.conftest import CHAT, MODEL, PROMPTS, SCHEMA, SERVED_OPTIONS, running_server
from tests.api.server_process import wait_until
from tests.api.test_server_errors import COMPLETION_CASES, _bad
from tests.api.test_server_lifecycle import (
    _assert_counted_one_request,
    _long_request,
    _metrics,
    _moved,
    _value,
)


@pytest.fixture(scope="module")
def remote():
    # the served fixture's LLM options: its reference outputs are this engine's too
    engine = EngineProcess(functools.partial(LLM, **SERVED_OPTIONS),
                           start_timeout_s=600)
    with running_server(engine) as (app, base_url):
        client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0,
                               timeout=60)
        yield engine, client, base_url
    assert engine.process.exitcode is not None      # stopped with the server: no orphan


def test_outputs_equal_llm_generate(remote, served):
    _, client, _ = remote
    ref = served.reference
    out = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=10, temperature=0)
    assert out.choices[0].text == ref["greedy0"].outputs[0].text
    out = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=12,
                                    temperature=1.0, seed=7, n=2)
    assert [c.text for c in out.choices] == [c.text for c in ref["seeded"].outputs]
    out = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=6, temperature=0,
                                    logprobs=3)
    expected = [lp[t].logprob for lp, t in zip(ref["logprobs"].outputs[0].logprobs,
                                               ref["logprobs"].outputs[0].token_ids)]
    assert out.choices[0].logprobs.token_logprobs == expected
    stream = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=40,
                                       temperature=0, stream=True,
                                       stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert "".join(c.text for chunk in chunks for c in chunk.choices) == \
        ref["long"].outputs[0].text
    assert chunks[-1].usage.completion_tokens == 40
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=40,
                                          temperature=0, response_format={
                                              "type": "json_schema", "json_schema": {
                                                  "name": "x", "schema": SCHEMA}})
    assert chat.choices[0].message.content == ref["chat_json"].outputs[0].text


def test_bad_requests_are_400s_naming_their_parameter(remote):
    _, client, _ = remote
    for fields, param, code in COMPLETION_CASES:
        request = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=0) | fields
        for stream in (False, True):
            e = _bad(lambda: client.completions.create(**request, stream=stream))
            assert (e.body["param"], e.body["code"]) == (param, code), (fields, e.body)


def test_a_stream_closed_mid_way_frees_its_pages_at_once(remote):
    _, client, base_url = remote
    before = _metrics(base_url)
    stream = client.completions.create(**_long_request(), stream=True)
    for _, _ in zip(range(3), stream):
        pass
    during = _metrics(base_url)
    assert _value(during, "deepinfer_cache_pages_used") > 0
    assert _value(during, "deepinfer_num_requests_running") == 1
    stream.close()
    after = wait_until(lambda: (m := _metrics(base_url)) and _value(
        m, "deepinfer_requests_aborted_total") > _value(
        before, "deepinfer_requests_aborted_total") and m)
    assert _value(after, "deepinfer_cache_pages_used") == 0
    assert _value(after, "deepinfer_num_requests_running") == 0


def test_metrics_follow_the_engine_in_its_process(remote, served):
    _, client, base_url = remote
    before = _metrics(base_url)
    out = client.completions.create(model=MODEL, prompt=PROMPTS[4], max_tokens=10,
                                    temperature=0, extra_body={"ignore_eos": True})
    after = _metrics(base_url)

    _assert_counted_one_request(before, after, out.usage, 10)
    assert _moved(before, after, "deepinfer_engine_steps_total") >= 10
    num_pages = served.llm.step_config.num_pages
    assert _value(after, "deepinfer_cache_pages_total") == num_pages
    assert _value(after, "deepinfer_cache_pages_free") == num_pages


def test_an_engine_that_cannot_start_is_an_error_not_a_hang():
    start = time.monotonic()
    with pytest.raises(EngineStartError, match="no config.json at /no/such/model"):
        EngineProcess(functools.partial(LLM, "/no/such/model"), start_timeout_s=120)
    assert time.monotonic() - start < 120


def test_an_engine_process_that_dies_fails_requests_and_health(remote):
    """(Last: it kills the module's engine.)"""
    engine, client, base_url = remote
    os.kill(engine.process.pid, signal.SIGKILL)
    wait_until(lambda: not engine.alive)
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(base_url + "/health", timeout=10)
    assert info.value.code == 503
    with pytest.raises(openai.InternalServerError):
        client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4)
