"""bench/lib/engine_loop.step_until_decoding, the benches' wait for a whole decoding batch:
it returns with every request running and 2 tokens in, and it raises, rather than spinning
for good, when a request finishes before the last one joins (two H200 runs of overlap.py
spun until their time limits that way)."""

from __future__ import annotations

import pytest

import deepinfer_jax
from bench.lib.engine_loop import abort_all, step_until_decoding
from deepinfer_jax import SamplingParams
from tests.engine.test_speculative import TINY

# a 16-token budget: each 40-token prompt takes 3 steps to prefill, one after another
SHAPES = dict(max_num_seqs=4, max_model_len=128, max_num_batched_tokens=16, token_buckets=(16,),
              page_size=32, show_progress=False)


@pytest.fixture(scope="module")
def engine():
    return deepinfer_jax.LLM(TINY, **SHAPES).engine


def add_batch(engine, max_tokens: int) -> None:
    for i in range(4):
        engine.add_request(f"{max_tokens}-{i}", [5 + i] * 40,
                           SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def test_returns_with_the_whole_batch_decoding(engine):
    add_batch(engine, max_tokens=64)
    step_until_decoding(engine, 4, settle=0)
    running = engine.scheduler.running
    assert len(running) == 4 and all(len(r.generated) >= 2 for r in running)
    abort_all(engine)


def test_raises_when_a_request_finishes_before_the_last_joins(engine, monkeypatch):
    # the first request's 2 tokens come long before the fourth prompt's 3 prefill steps end
    add_batch(engine, max_tokens=2)
    step, calls = engine.step, []

    def bounded():         # a wait that spins fails here, not at the suite's timeout
        calls.append(1)
        assert len(calls) < 100, "still waiting after 100 steps"
        return step()
    monkeypatch.setattr(engine, "step", bounded)
    with pytest.raises(RuntimeError, match="finished before all 4 were decoding"):
        step_until_decoding(engine, 4)
    monkeypatch.undo()
    abort_all(engine)


def test_waits_for_requests_whose_grammar_is_compiling(engine):
    """Constrained requests join the scheduler only once their grammar has compiled (in the
    background): until then the wait counts them rather than taking them for finished
    (bench/structured.py's constrained rows raised so)."""
    schema = {"type": "array", "items": {"type": "string"}, "minItems": 20}
    for i in range(4):
        engine.add_request(f"g{i}", [5 + i] * 8,
                           SamplingParams(max_tokens=64, json_schema=schema, temperature=1.0))
    step_until_decoding(engine, 4, settle=0)
    assert len(engine.scheduler.running) == 4
    abort_all(engine)
