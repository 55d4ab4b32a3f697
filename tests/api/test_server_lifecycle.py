"""Clients that go away free their requests' pages at once; /metrics parses and its numbers
follow the requests; /health and /v1/models; `deepinfer serve` from the command line."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import urllib.error
import urllib.request

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.api.conftest import MODEL, PROMPTS, REPO_ROOT, SERVED_OPTIONS, free_port
from tests.api.server_process import connect_when_up, wait_until
from tests.conftest import subprocess_pythonpath


def _metrics(base_url: str) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(base_url + "/metrics", timeout=10) as response:
        text = response.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _value(metrics, name: str, **labels) -> float:
    return metrics.get((name, tuple(sorted(labels.items()))), 0.0)


def _moved(before, after, name: str, **labels) -> float:
    return _value(after, name, **labels) - _value(before, name, **labels)


def _assert_counted_one_request(before, after, usage, tokens: int) -> None:
    """One completion of `tokens` tokens (its usage as the response reports it), finished by
    its length, moved the token, success and latency counters by exactly that much."""
    assert _moved(before, after, "deepinfer_generation_tokens_total") == usage.completion_tokens == tokens
    assert _moved(before, after, "deepinfer_prompt_tokens_total") == usage.prompt_tokens
    assert _moved(before, after, "deepinfer_request_success_total", finished_reason="length") == 1
    assert _moved(before, after, "deepinfer_time_to_first_token_seconds_count") == 1
    assert _moved(before, after, "deepinfer_inter_token_latency_seconds_count") == tokens - 1


def _long_request(**extra) -> dict:
    return dict(model=MODEL, prompt=PROMPTS[2], max_tokens=400, temperature=0,
                extra_body={"ignore_eos": True}, **extra)


def test_a_stream_closed_mid_way_frees_its_pages_at_once(served):
    before = _metrics(served.base_url)
    stream = served.client.completions.create(**_long_request(), stream=True)
    chunks = iter(stream)
    for _ in range(3):
        assert next(chunks).choices[0].text is not None
    during = _metrics(served.base_url)
    assert _value(during, "deepinfer_num_requests_running") == 1
    assert _value(during, "deepinfer_cache_pages_used") > 0
    stream.close()
    after = wait_until(lambda: (m := _metrics(served.base_url)) and _value(
        m, "deepinfer_requests_aborted_total") > _value(before, "deepinfer_requests_aborted_total")
        and m)
    assert _value(after, "deepinfer_cache_pages_used") == 0
    assert _value(after, "deepinfer_num_requests_running") == 0
    assert not served.engine.has_unfinished()
    # far fewer tokens were made than asked for
    made = (_value(after, "deepinfer_generation_tokens_total")
            - _value(before, "deepinfer_generation_tokens_total"))
    assert 3 <= made < 400
    # and the server carries on
    out = served.client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=10,
                                           temperature=0)
    assert out.choices[0].text == served.reference["greedy0"].outputs[0].text


def test_a_client_that_times_out_aborts_its_request(served):
    before = _value(_metrics(served.base_url), "deepinfer_requests_aborted_total")
    body = json.dumps(dict(model=MODEL, prompt=PROMPTS[3], max_tokens=400, ignore_eos=True)).encode()
    request = urllib.request.Request(served.base_url + "/v1/completions", body,
                                     {"Content-Type": "application/json"})
    try:
        urllib.request.urlopen(request, timeout=1.0)
        raise AssertionError("400 tokens came back within a second")
    except (TimeoutError, socket.timeout, urllib.error.URLError):
        pass
    after = wait_until(lambda: (m := _metrics(served.base_url)) and _value(
        m, "deepinfer_requests_aborted_total") > before and m)
    assert _value(after, "deepinfer_cache_pages_used") == 0
    assert not served.engine.has_unfinished()


def test_metrics_parse_and_follow_the_requests(served):
    before = _metrics(served.base_url)
    out = served.client.completions.create(model=MODEL, prompt=PROMPTS[4], max_tokens=10,
                                           temperature=0, extra_body={"ignore_eos": True})
    try:
        served.client.completions.create(model="nope", prompt="a", max_tokens=2)
    except openai.BadRequestError:
        pass
    after = _metrics(served.base_url)

    _assert_counted_one_request(before, after, out.usage, 10)
    assert _moved(before, after, "deepinfer_e2e_request_latency_seconds_count") == 1
    assert _moved(before, after, "deepinfer_e2e_request_latency_seconds_sum") > 0
    assert _moved(before, after, "deepinfer_request_errors_total", kind="model_not_found") == 1
    assert _moved(before, after, "deepinfer_engine_steps_total") >= 10
    assert _value(after, "deepinfer_cache_pages_total") == served.llm.step_config.num_pages
    assert _value(after, "deepinfer_cache_pages_free") == served.llm.step_config.num_pages
    assert _value(after, "deepinfer_num_requests_waiting") == 0
    for name in ("deepinfer_prefix_cache_hits_total", "deepinfer_spec_decode_accepted_tokens_total"):
        assert (name, ()) in after


def test_health_and_models(served):
    with urllib.request.urlopen(served.base_url + "/health", timeout=10) as response:
        assert response.status == 200 and json.loads(response.read()) == {"status": "ok"}
    [model] = served.client.models.list().data
    assert model.id == MODEL and model.owned_by == "deepinfer"
    with pytest.raises(urllib.error.HTTPError) as info:       # no such route: OpenAI's shape
        urllib.request.urlopen(served.base_url + "/v1/embeddings", timeout=10)
    assert info.value.code == 404
    assert json.loads(info.value.read())["error"]["type"] == "invalid_request_error"


def _children(pid: int) -> list[int]:
    return [int(c) for task in os.listdir(f"/proc/{pid}/task")
            for c in open(f"/proc/{pid}/task/{task}/children").read().split()]


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_deepinfer_serve_from_the_command_line():
    """The CLI's own server: up, answering, and stopped by SIGINT, its engine process (the
    default) with it."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": subprocess_pythonpath(), "JAX_PLATFORMS": "cpu"}
    process = subprocess.Popen(
        [sys.executable, "-m", "deepinfer_jax.api.cli", "serve", "--port", str(port),
         "--served-model-name", "tiny", "--log-level", "warning", "--batch-invariant"],
        cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        client, [model] = connect_when_up(process, port, timeout_s=120, request_timeout_s=30)
        assert model.id == "tiny"
        out = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=4)
        assert out.usage.completion_tokens == 4 and out.choices[0].text
        engines = _children(process.pid)
        assert engines                           # the engine runs in a process of its own
    finally:
        process.send_signal(2)
        assert process.wait(30) == 0
    # no orphan left behind (multiprocessing's helper, if any, ends on its pipe's EOF: a moment)
    wait_until(lambda: not any(_running(pid) for pid in engines), timeout_s=10)


def test_serve_refuses_what_it_cannot_serve(capsys):
    from deepinfer_jax.api import cli

    assert cli.main(["serve", "--coordinator-address", "127.0.0.1:1", "--num-processes", "2"]) == 2
    assert "cannot be served yet" in capsys.readouterr().err
    assert cli.main(["serve", "models/a", "--model", "models/b"]) == 2
    assert "give the model once" in capsys.readouterr().err


def test_prefix_cache_hits_show_in_the_metrics(served):
    """A server with prefix caching (its steps are the fixture's, from the cache): the same
    long prompt twice is one hit of its whole blocks, and the output does not change."""
    from deepinfer_jax.api.llm import LLM
    from tests.api.conftest import running_server

    prompt = "Once upon a time there was a fox. " * 8
    expected = served.client.completions.create(model=MODEL, prompt=prompt, max_tokens=8,
                                                temperature=0).choices[0].text
    llm = LLM(**SERVED_OPTIONS, enable_prefix_caching=True)
    with running_server(llm) as (app, base_url):
        client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0,
                               timeout=30)
        texts = []
        for _ in range(2):
            texts.append(client.completions.create(model=MODEL, prompt=prompt, max_tokens=8,
                                                   temperature=0).choices[0].text)
        m = _metrics(base_url)
    assert texts == [expected, expected]
    assert _value(m, "deepinfer_prefix_cache_queries_total") == 2
    assert _value(m, "deepinfer_prefix_cache_hits_total") == 1
    assert _value(m, "deepinfer_prefix_cache_hit_tokens_total") >= 32


# a combination (MTP speculation x the metrics): the acceptance counters in test_speculative*.py
@pytest.mark.slow
def test_speculative_acceptance_shows_in_the_metrics(served):
    """A server with MTP speculation gives the plain server's greedy text, and /metrics counts
    the drafts it verified and accepted (the shipped model's MTP block drafts well)."""
    from deepinfer_jax.api.llm import LLM
    from tests.api.conftest import running_server

    request = dict(model=MODEL, prompt=PROMPTS[1], max_tokens=20, temperature=0)
    expected = served.client.completions.create(**request).choices[0].text
    # one token bucket (16): half the compile of a cold start
    llm = LLM(max_num_seqs=4, max_num_batched_tokens=16, batch_invariant=True,
              speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    with running_server(llm) as (app, base_url):
        client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0,
                               timeout=60)
        assert client.completions.create(**request).choices[0].text == expected
        m = _metrics(base_url)
    drafted = _value(m, "deepinfer_spec_decode_draft_tokens_total")
    accepted = _value(m, "deepinfer_spec_decode_accepted_tokens_total")
    assert 0 < accepted <= drafted


def test_engine_in_process_serves_the_engine_on_a_thread(served, monkeypatch):
    """`--engine-in-process` builds the LLM in the server's process and serves it from a
    thread (the default spawns an engine process: test_engine_process.py)."""
    import uvicorn

    from deepinfer_jax.api import cli, cli_llm
    from deepinfer_jax.api.server.engine_thread import EngineThread

    apps = []
    monkeypatch.setattr(cli_llm, "make_llm", lambda args, **options: served.llm)
    monkeypatch.setattr(uvicorn, "run", lambda app, **options: apps.append(app))
    monkeypatch.setattr(sys, "setswitchinterval", lambda s: None)     # (this test process's)
    assert cli.main(["serve", "--engine-in-process", "--log-level", "warning"]) == 0
    [app] = apps
    assert isinstance(app.state.engine, EngineThread) and app.state.engine.llm is served.llm
