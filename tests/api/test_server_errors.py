"""Bad input gets a 400 in OpenAI's error shape naming the parameter, read by the official
client, while a good request running at the same time completes unharmed."""

from __future__ import annotations

import threading
import urllib.error
import urllib.request

import openai
import pytest

from deepinfer_jax.api.llm import LLM
from tests.api.conftest import CHAT, MODEL, PROMPTS, SERVED_OPTIONS, running_server

COMPLETION_CASES = [       # (request fields, the param named, its code)
    (dict(model="no-such-model"), "model", "model_not_found"),
    (dict(temperature=-1.0), "temperature", None),
    (dict(top_p=2.0), "top_p", None),
    (dict(max_tokens=0), "max_tokens", None),
    (dict(n=0), "n", None),
    (dict(logprobs=50), "logprobs", None),
    (dict(seed=-3), "seed", None),
    (dict(prompt=[5] * 600), "prompt", "context_length_exceeded"),
    (dict(max_tokens=1000), "prompt", "context_length_exceeded"),
    (dict(extra_body={"guided_regex": "(["}), "guided_regex", "invalid_grammar"),
    (dict(extra_body={"guided_json": "{not json"}), "guided_json", "invalid_grammar"),
    (dict(extra_body={"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}}}),
     "response_format", "invalid_grammar"),
    (dict(extra_body={"top_k": "many"}), "top_k", None),
    (dict(extra_body={"no_such_field": 1}), "no_such_field", None),
]
STREAM_ONLY_CASES = [       # best_of > n picks among finished completions: it cannot stream
    (dict(n=1, best_of=2, temperature=1.0), "best_of", None),
]


def _bad(call) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as info:
        call()
    e = info.value
    assert e.status_code == 400 and set(e.body) == {"message", "type", "param", "code"}
    assert e.body["type"] == "invalid_request_error" and e.message
    return e


def _stream_long_into(served, good: dict) -> None:
    """A 40-token streamed completion running beside the bad requests: its text in good."""
    stream = served.client.completions.create(
        model=MODEL, prompt=PROMPTS[1], max_tokens=40, temperature=0, stream=True,
        extra_body={"ignore_eos": True})
    good["text"] = "".join(c.text for chunk in stream for c in chunk.choices)


def test_bad_requests_name_their_parameter_while_a_good_one_runs(served):
    ref = served.reference["long"].outputs[0]
    good = {}

    thread = threading.Thread(target=_stream_long_into, args=(served, good))
    thread.start()
    for fields, param, code in COMPLETION_CASES:
        request = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=0) | fields
        for stream in (False, True):
            e = _bad(lambda: served.client.completions.create(**request, stream=stream))
            assert (e.body["param"], e.body["code"]) == (param, code), (fields, e.body)
    for fields, param, code in STREAM_ONLY_CASES:
        request = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=8) | fields
        e = _bad(lambda: served.client.completions.create(**request, stream=True))
        assert (e.body["param"], e.body["code"]) == (param, code), (fields, e.body)
    thread.join(60)
    assert good["text"] == ref.text
    assert not served.engine.has_unfinished()


CHAT_CASES = [
    (dict(max_completion_tokens=0), "max_completion_tokens", None),
    (dict(max_tokens=0), "max_tokens", None),
    (dict(logprobs=True, top_logprobs=50), "top_logprobs", None),
    (dict(top_logprobs=2), "top_logprobs", None),
    (dict(messages=[{"role": "user", "content": "word " * 600}]), "messages",
     "context_length_exceeded"),
    (dict(messages=[]), "messages", None),
    # the tiny model's template takes no options (DeepSeek-V4's format takes "thinking")
    (dict(extra_body={"chat_template_kwargs": {"thinking": True}}), "chat_template_kwargs", None),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
     "response_format", None),
]


def test_chat_bad_requests_name_their_parameter(served):
    for fields, param, code in CHAT_CASES:
        request = dict(model=MODEL, messages=CHAT, max_tokens=4) | fields
        e = _bad(lambda: served.client.chat.completions.create(**request))
        assert (e.body["param"], e.body["code"]) == (param, code), (fields, e.body)
    # and the server still serves
    out = served.client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=10,
                                                temperature=0)
    assert out.choices[0].message.content == served.reference["chat"].outputs[0].text


def test_an_engine_that_fails_answers_500_and_health_says_so():
    """A second server whose engine step raises: the request gets a 500 in OpenAI's shape,
    /health turns 503, and the server process stays up to say so."""
    llm = LLM(**SERVED_OPTIONS)      # the fixture's steps, from the cache

    def broken_step():
        raise RuntimeError("the device fell over")
    llm.engine.step = broken_step
    with running_server(llm) as (app, base_url):
        client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0,
                               timeout=30)
        with pytest.raises(openai.InternalServerError) as info:
            client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4)
        assert info.value.status_code == 500
        assert info.value.body["type"] == "internal_server_error"
        assert "the device fell over" in info.value.body["message"]
        with pytest.raises(urllib.error.HTTPError) as health:
            urllib.request.urlopen(base_url + "/health", timeout=10)
        assert health.value.code == 503


def test_a_request_that_fails_unforeseen_fails_alone(served, monkeypatch):
    """An exception the engine thread did not expect while adding one request answers that
    request with a 500; the engine thread and everyone else carry on."""
    real = served.llm._submit

    def flaky(prompts, params, streaming=False):
        if params.max_tokens == 7:
            raise RuntimeError("unforeseen")
        return real(prompts, params, streaming=streaming)
    monkeypatch.setattr(served.llm, "_submit", flaky)
    with pytest.raises(openai.InternalServerError) as info:
        served.client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=7)
    assert "unforeseen" in info.value.body["message"]
    assert served.app.state.engine.alive
    out = served.client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=10,
                                           temperature=0)
    assert out.choices[0].text == served.reference["greedy0"].outputs[0].text


def test_an_output_that_fails_mid_stream_ends_its_stream_with_an_error_event(served, monkeypatch):
    """A failure while a request's output is put together (here: its final output) ends that
    stream with an error event after the text already sent; the engine carries on."""
    real = served.llm._group_output

    def flaky(group):
        if group.params.max_tokens == 9:
            raise RuntimeError("assembling the output failed")
        return real(group)
    monkeypatch.setattr(served.llm, "_group_output", flaky)
    ref = served.reference["long"].outputs[0].text
    received = ""
    with pytest.raises(openai.APIError) as info:
        for chunk in served.client.completions.create(
                model=MODEL, prompt=PROMPTS[1], max_tokens=9, temperature=0, stream=True,
                extra_body={"ignore_eos": True}):
            received += "".join(c.text for c in chunk.choices)
    assert "assembling the output failed" in str(info.value.body)
    assert received and ref.startswith(received)     # the tokens sent before the failure
    assert served.app.state.engine.alive and not served.engine.has_unfinished()
    out = served.client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=10,
                                           temperature=0)
    assert out.choices[0].text == served.reference["greedy0"].outputs[0].text


def test_a_grammar_that_times_out_is_a_400_naming_it_and_others_are_served(served, monkeypatch):
    """A schema whose compile runs past the server's time limit (a stand-in compiler that takes
    60 s on it, stopped at the 1 s limit in its child process: host/grammar_worker.py) answers
    its request with a 400 naming response_format, while a request running at the same time
    completes unharmed; the next constrained request then compiles in a fresh child."""
    import json
    import re
    import time

    from deepinfer_jax.host import grammar_worker
    from deepinfer_jax.host.grammar import StructuredOutputs
    from tests.host.slow_grammar import slow_compile

    monkeypatch.setattr(grammar_worker, "compile_grammar", slow_compile)
    engine = served.engine
    structured = StructuredOutputs(served.llm.tokenizer.path, engine.cfg.vocab_size,
                                   engine.cfg.eos_token_ids, compile_timeout_s=1.0)
    monkeypatch.setattr(engine, "structured", structured)     # the engine thread is idle
    slow_schema = {"type": "object", "properties": {"slow": {"type": "string"}}}
    ref = served.reference["long"].outputs[0]
    good = {}

    thread = threading.Thread(target=_stream_long_into, args=(served, good))
    try:
        thread.start()
        start = time.monotonic()
        e = _bad(lambda: served.client.completions.create(
            model=MODEL, prompt=PROMPTS[0], max_tokens=8, extra_body={"response_format": {
                "type": "json_schema", "json_schema": {"name": "s", "schema": slow_schema}}}))
        assert (e.body["param"], e.body["code"]) == ("response_format", "invalid_grammar")
        assert "did not compile within 1.0 s" in e.body["message"]
        assert time.monotonic() - start < 30              # stopped at its limit, not waited for
        thread.join(60)
        assert good["text"] == ref.text
        out = served.client.completions.create(
            model=MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=0,
            extra_body={"guided_regex": "[0-9]{2}"})
        assert re.fullmatch("[0-9]{2}", out.choices[0].text), json.dumps(out.model_dump())
        assert served.app.state.engine.alive and not engine.has_unfinished()
    finally:
        thread.join(60)
        structured.close()
