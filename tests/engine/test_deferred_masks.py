"""Grammar-constrained rows in the asynchronous loop run every step, their masks applied one
step late to the step's kept logits (engine/deferred_masks.py): the same tokens as the
synchronous loop, which masks before it samples (the reference), for constrained rows and
their unconstrained neighbours alike, on the shipped tiny model and its tokenizer."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

import deepinfer_jax
from deepinfer_jax import FinishReason, SamplingParams
from tests.conftest import REPO

MODEL = REPO / "models/deepinfer-tiny-v4"
# one token bucket: the first half compiles once
ENGINE = dict(max_num_seqs=8, max_model_len=256, max_num_batched_tokens=32, token_buckets=(32,),
              page_size=64, show_progress=False)
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 8},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}}}
LIST = {"type": "array", "items": {"type": "string", "maxLength": 6}, "minItems": 1,
        "maxItems": 4}
REGEX = r"[a-z]{3,6}-[0-9]{2}"


@pytest.fixture(scope="module")
def engines():
    async_llm = deepinfer_jax.LLM(MODEL, **ENGINE)
    sync_llm = deepinfer_jax.LLM(MODEL, async_scheduling=False, **ENGINE)
    assert async_llm.engine.deferred is not None and sync_llm.engine.deferred is None
    return async_llm, sync_llm


def decisions_of(llm) -> list:
    """Records each decision the engine's scheduler makes (in order)."""
    made = []
    schedule = llm.engine.scheduler.schedule

    def recording(*args, **kw):
        made.append(schedule(*args, **kw))
        return made[-1]
    llm.engine.scheduler.schedule = recording
    return made


def test_constrained_rows_match_the_synchronous_loop(engines):
    async_llm, sync_llm = engines
    free = SamplingParams(max_tokens=24, temperature=1.0, seed=5, ignore_eos=True)
    params = [SamplingParams(max_tokens=48, temperature=0.0, json_schema=SCHEMA),
              SamplingParams(max_tokens=48, temperature=1.0, seed=3, regex=REGEX),
              free,
              SamplingParams(max_tokens=48, temperature=1.0, seed=7, json_schema=SCHEMA),
              SamplingParams(max_tokens=48, temperature=0.8, top_k=20, seed=11, json_schema=LIST),
              SamplingParams(max_tokens=48, temperature=0.0, regex=r"(yes|no|maybe)!"),
              SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)]
    prompts = ["Output:", "code:", "x = ", "Person:", "tags:", "Answer:", "def f():"]
    made = decisions_of(async_llm)
    got = async_llm.generate(prompts, params, use_tqdm=False)
    want = sync_llm.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.finish_reason for o in got] == [o.finish_reason for o in want]
    for i in (0, 3):
        jsonschema.validate(json.loads(got[i].text), SCHEMA)
    jsonschema.validate(json.loads(got[4].text), LIST)
    assert re.fullmatch(REGEX, got[1].text) and re.fullmatch(r"(yes|no|maybe)!", got[5].text)
    # the constrained rows ended on their grammar (EOS) with a step in flight
    assert all(got[i].finish_reason is FinishReason.STOP for i in (0, 1, 3, 4, 5))
    # each constrained request ran in every step from its first to its last
    for i in (0, 1, 3, 4, 5):
        ran = [any(s.request.request_id == got[i].request_id for s in d.seqs) for d in made]
        first, last = ran.index(True), len(ran) - 1 - ran[::-1].index(True)
        assert all(ran[first: last + 1]), (i, ran)
        # a prefill step, a step per later token, and the one launched before the stop was read
        assert sum(ran) == len(got[i].token_ids) + 1


def test_a_constrained_row_cut_by_max_tokens_and_sampled_rows_alone(engines):
    """A constrained row that stops at max_tokens mid-grammar (its last token booked at
    launch), and seeded constrained rows alone in the batch."""
    async_llm, sync_llm = engines
    params = [SamplingParams(max_tokens=5, temperature=1.0, seed=s, json_schema=SCHEMA)
              for s in range(3)] + [SamplingParams(max_tokens=30, temperature=1.0, seed=9,
                                                   json_schema=LIST)]
    prompts = ["a:", "b:", "c:", "d:"]
    got = async_llm.generate(prompts, params, use_tqdm=False)
    want = sync_llm.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.finish_reason for o in got[:3]] == [FinishReason.LENGTH] * 3
    assert all(len(o.token_ids) == 5 for o in got[:3])


def test_abort_with_a_deferred_step_in_flight(engines):
    """A constrained request aborted while a step samples for it (deferred: launched before
    its previous token was read): its in-flight token is dropped, its neighbour's output is
    the synchronous loop's."""
    async_llm, sync_llm = engines
    engine = async_llm.engine
    keep = SamplingParams(max_tokens=30, temperature=1.0, seed=4, json_schema=LIST)
    drop = SamplingParams(max_tokens=30, temperature=1.0, seed=6, json_schema=SCHEMA)
    prompt = async_llm.tokenizer.encode("tags:")
    engine.add_request("keep", prompt, keep)
    dropped = engine.add_request("drop", async_llm.tokenizer.encode("Person:"), drop)
    kept = None      # "keep" may finish first where its neighbour's grammar compiled late
    for _ in range(200):
        kept = next((r for r in engine.step() if r.request_id == "keep"), kept)
        # a decode step in flight for it, its mask known only after the previous token
        if len(dropped.generated) >= 3 and dropped.has_placeholders:
            break
    else:
        pytest.fail("no step in flight for the request")
    assert engine.abort("drop") is dropped
    while engine.has_unfinished():
        kept = next((r for r in engine.step() if r.request_id == "keep"), kept)
    assert dropped.finish_reason is FinishReason.ABORT and not dropped.has_placeholders
    want = sync_llm.generate([{"prompt_token_ids": prompt}], keep, use_tqdm=False)[0]
    assert kept is not None and kept.generated == want.token_ids
