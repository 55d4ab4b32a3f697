"""Grammar compilation that cannot hurt other requests (host/grammar.py, grammar_worker.py):
limits checked before any work, compiles in a child process that a time limit stops, errors
cached and time-outs not."""

from __future__ import annotations

import json
import time

import pytest

from deepinfer_jax.host import grammar_worker
from deepinfer_jax.host.grammar import (
    MAX_GRAMMAR_CHARS,
    MAX_SCHEMA_DEPTH,
    GrammarError,
    StructuredOutputs,
    grammar_spec,
)
from deepinfer_jax.host.request import FinishReason, SamplingParams
from tests.conftest import REPO
from tests.host.slow_grammar import slow_compile

TOKENIZER = REPO / "models" / "deepinfer-tiny-v4" / "tokenizer.json"


def nested(depth: int) -> dict:
    schema = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def test_limits_fail_before_any_work():
    start = time.perf_counter()
    with pytest.raises(GrammarError, match="nested deeper"):
        grammar_spec(SamplingParams(json_schema=nested(1000)))          # a dict: no recursion
    with pytest.raises(GrammarError, match="nested deeper"):
        grammar_spec(SamplingParams(json_schema='{"a": ' * 5000 + "1" + "}" * 5000))
    shared = {"type": "string"}
    for _ in range(25):          # 2^25 values written out; 25 objects in memory
        shared = {"anyOf": [shared, shared]}
    with pytest.raises(GrammarError, match="more than"):
        grammar_spec(SamplingParams(json_schema=shared))
    with pytest.raises(GrammarError, match="characters"):
        grammar_spec(SamplingParams(regex="a" * (MAX_GRAMMAR_CHARS + 1)))
    assert time.perf_counter() - start < 5
    ok = nested(MAX_SCHEMA_DEPTH // 2 - 1)
    assert grammar_spec(SamplingParams(json_schema=ok)) == ("json", json.dumps(ok, sort_keys=True))


def wait_for(outputs: StructuredOutputs, limit_s: float = 120):
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        finished = outputs.poll(wait_s=0.2)
        if finished:
            return finished
    raise AssertionError("the grammar worker answered nothing")


def test_compiles_in_a_child_and_caches_errors():
    outputs = StructuredOutputs(TOKENIZER, 6144, (1,), compile_timeout_s=60)
    try:
        good, bad = ("regex", "[0-9]{2}"), ("regex", "a(b")
        assert outputs.lookup(good) is StructuredOutputs.PENDING
        assert wait_for(outputs) == [(good, None)]
        matcher = outputs.lookup(good)
        assert matcher.consume_token(outputs.tokenizer.tokenize_str("4")[0]) and not matcher.is_error()
        assert outputs.lookup(bad) is StructuredOutputs.PENDING
        [(spec, error)] = wait_for(outputs)
        assert spec == bad and isinstance(error, GrammarError)
        with pytest.raises(GrammarError):       # cached: fails at once, nothing submitted
            outputs.lookup(bad)
        assert outputs.poll() == []
    finally:
        outputs.close()


def test_a_compile_past_its_limit_is_stopped_and_poisons_nothing(monkeypatch):
    monkeypatch.setattr(grammar_worker, "compile_grammar", slow_compile)
    outputs = StructuredOutputs(TOKENIZER, 6144, (1,), compile_timeout_s=1.0)
    try:
        slow, good = ("regex", "slow[0-9]"), ("regex", "[a-c]{3}")
        assert outputs.lookup(slow) is StructuredOutputs.PENDING
        assert outputs.lookup(good) is StructuredOutputs.PENDING        # queued behind it
        start = time.monotonic()
        [(spec, error)] = wait_for(outputs)
        assert spec == slow and "did not compile within 1.0 s" in str(error)
        assert time.monotonic() - start < 30          # stopped, not waited for (60 s)
        assert wait_for(outputs) == [(good, None)]    # a fresh child compiles the next one
        assert outputs.lookup(slow) is StructuredOutputs.PENDING    # a time-out is not cached
    finally:
        outputs.close()


def test_a_token_the_grammar_refuses_ends_the_request_as_an_error():
    """A grammar dead end (a token the matcher refuses: the mask left nothing to sample) ends
    the request with finish_reason ERROR and the output before that token, which the grammar
    accepts; not a "stop" with text that violates the grammar."""
    from tests.host.test_scheduler import make, request, run_step

    outputs = StructuredOutputs(TOKENIZER, 6144, (1,), compile_timeout_s=60)
    try:
        spec = ("regex", "[0-9]{3}")
        assert outputs.lookup(spec) is StructuredOutputs.PENDING
        assert wait_for(outputs) == [(spec, None)]
        sched = make()
        req = request(0, 3, max_tokens=8)
        req.matcher = outputs.lookup(spec)
        sched.add(req)
        digit, letter = (outputs.tokenizer.tokenize_str(c)[0] for c in "4a")
        run_step(sched, token=digit)                  # the prompt's chunk samples "4"
        run_step(sched, token=letter)                 # refused by the grammar
        assert req.is_complete and req.finish_reason is FinishReason.ERROR
        assert req.generated == [digit] and "allows no token" in str(req.error)
    finally:
        outputs.close()
