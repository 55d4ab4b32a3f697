"""The server's outputs, read with the official openai client, equal LLM.generate's for the
same requests: completions and chat, whole and streamed, seeds, logprobs, stop strings,
structured output, and many clients at once."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest

from tests.api.conftest import CHAT, MODEL, PROMPTS, SCHEMA, STORY


def test_greedy_completion_equals_generate(served):
    ref = served.reference["greedy0"]
    out = served.client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=10,
                                           temperature=0)
    [choice] = out.choices
    assert choice.text == ref.outputs[0].text and choice.text
    assert choice.finish_reason == ref.outputs[0].finish_reason.value
    assert out.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert out.usage.completion_tokens == len(ref.outputs[0].token_ids)
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    # token ids as the prompt: the same request
    ids = served.client.completions.create(model=MODEL, prompt=ref.prompt_token_ids,
                                           max_tokens=10, temperature=0)
    assert ids.choices[0].text == choice.text


def test_several_prompts_in_one_request_come_back_in_order(served):
    out = served.client.completions.create(model=MODEL, prompt=[PROMPTS[2], PROMPTS[0]],
                                           max_tokens=10, temperature=0)
    assert [c.index for c in out.choices] == [0, 1]
    assert [c.text for c in out.choices] == [served.reference[f"greedy{i}"].outputs[0].text
                                             for i in (2, 0)]
    assert out.usage.prompt_tokens == sum(len(served.reference[f"greedy{i}"].prompt_token_ids)
                                          for i in (2, 0))


def test_the_model_s_generation_config_is_the_default(served):
    """No temperature given: the shipped model's generation_config.json (do_sample false)."""
    out = served.client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=10)
    assert out.choices[0].text == served.reference["greedy0"].outputs[0].text


def _stream_text(stream) -> tuple[dict[int, str], dict[int, str], object]:
    texts, reasons, usage = {}, {}, None
    for chunk in stream:
        if chunk.usage is not None:
            assert chunk.choices == []
            usage = chunk.usage
        for c in chunk.choices:
            piece = c.text if hasattr(c, "text") else c.delta.content
            texts[c.index] = texts.get(c.index, "") + (piece or "")
            if c.finish_reason is not None:
                reasons[c.index] = c.finish_reason
    return texts, reasons, usage


def test_streamed_chunks_add_up_to_the_text_and_the_usage_is_right(served):
    ref = served.reference["long"]
    stream = served.client.completions.create(
        model=MODEL, prompt=PROMPTS[1], max_tokens=40, temperature=0, stream=True,
        extra_body={"ignore_eos": True}, stream_options={"include_usage": True})
    texts, reasons, usage = _stream_text(stream)
    assert texts == {0: ref.outputs[0].text} and reasons == {0: "length"}
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(ref.prompt_token_ids), 40)
    # without include_usage: no usage chunk
    _, _, none = _stream_text(served.client.completions.create(
        model=MODEL, prompt=PROMPTS[1], max_tokens=5, temperature=0, stream=True))
    assert none is None


def test_stop_strings_cut_the_text_whole_or_streamed(served):
    ref = served.reference["stop"].outputs[0]
    assert ref.finish_reason.value == "stop" and ref.stop_reason == "time, time"
    whole = served.client.completions.create(model=MODEL, prompt=STORY, max_tokens=12,
                                             temperature=0, stop="time, time")
    assert whole.choices[0].text == ref.text and whole.choices[0].finish_reason == "stop"
    texts, reasons, _ = _stream_text(served.client.completions.create(
        model=MODEL, prompt=STORY, max_tokens=12, temperature=0, stop=["time, time"], stream=True))
    assert texts == {0: ref.text} and reasons == {0: "stop"}


def test_chat_equals_llm_chat_whole_and_streamed(served):
    ref = served.reference["chat"].outputs[0]
    out = served.client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=10,
                                                temperature=0)
    assert out.choices[0].message.content == ref.text and out.choices[0].message.role == "assistant"
    assert out.usage.prompt_tokens == len(served.reference["chat"].prompt_token_ids)
    # max_completion_tokens is max_tokens's newer name
    newer = served.client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0,
                                                  max_completion_tokens=10)
    assert newer.choices[0].message.content == ref.text
    stream = served.client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=10, temperature=0, stream=True,
        stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref.text
    assert chunks[-1].usage.completion_tokens == len(ref.token_ids)


def test_same_seed_same_text_and_n_completions_as_generate(served):
    ref = served.reference["seeded"]
    kwargs = dict(model=MODEL, prompt=STORY, max_tokens=12, temperature=1.0, seed=7, n=2)
    a = served.client.completions.create(**kwargs)
    b = served.client.completions.create(**kwargs)
    texts = [c.text for c in sorted(a.choices, key=lambda c: c.index)]
    assert texts == [c.text for c in ref.outputs]
    assert texts == [c.text for c in sorted(b.choices, key=lambda c: c.index)]
    assert texts[0] != texts[1]
    streamed, _, _ = _stream_text(served.client.completions.create(**kwargs, stream=True))
    assert [streamed[0], streamed[1]] == texts


def test_best_of_returns_generate_s_most_likely_completions(served):
    ref = served.reference["best_of"]
    out = served.client.completions.create(model=MODEL, prompt=STORY, max_tokens=8,
                                           temperature=1.0, seed=3, n=2, best_of=4)
    assert [c.text for c in sorted(out.choices, key=lambda c: c.index)] == [
        c.text for c in ref.outputs]
    assert out.usage.completion_tokens == sum(len(c.token_ids) for c in ref.outputs)


def test_logprobs_equal_generate_s(served):
    ref = served.reference["logprobs"].outputs[0]
    out = served.client.completions.create(model=MODEL, prompt=STORY, max_tokens=6,
                                           temperature=0, logprobs=3)
    lp = out.choices[0].logprobs
    assert lp.token_logprobs == [entry[t].logprob for entry, t in zip(ref.logprobs, ref.token_ids,
                                                                      strict=True)]
    assert "".join(lp.tokens) == ref.text
    assert lp.text_offset[0] == 0 and len(lp.top_logprobs) == 6
    assert all(len(top) >= 3 for top in lp.top_logprobs)
    chat = served.client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4,
                                                 temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(t.top_logprobs) == 2 for t in content)
    for t in content:       # the top alternatives are ranked, and greedy picks the best
        assert t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob
        assert t.logprob == pytest.approx(t.top_logprobs[0].logprob)
    stream = served.client.completions.create(model=MODEL, prompt=STORY, max_tokens=6,
                                              temperature=0, logprobs=3, stream=True)
    streamed = [x for chunk in stream for c in chunk.choices if c.logprobs
                for x in c.logprobs.token_logprobs]
    assert streamed == lp.token_logprobs


def test_structured_output_equals_generate_and_follows_the_schema(served):
    fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}}
    for ref, text, reason in (
            (served.reference["json"].outputs[0],
             *_text_and_reason(served.client.completions.create(
                 model=MODEL, prompt=STORY, max_tokens=40, temperature=0,
                 extra_body={"response_format": fmt}))),
            (served.reference["chat_json"].outputs[0],
             *_text_and_reason(served.client.chat.completions.create(
                 model=MODEL, messages=CHAT, max_tokens=40, temperature=0, response_format=fmt)))):
        assert text == ref.text and reason == "stop"
        jsonschema.validate(json.loads(text), SCHEMA)
    # vLLM's extension names the same constraint
    guided = served.client.completions.create(model=MODEL, prompt=STORY, max_tokens=40,
                                              temperature=0, extra_body={"guided_json": SCHEMA})
    assert guided.choices[0].text == served.reference["json"].outputs[0].text
    regex = served.client.completions.create(model=MODEL, prompt=STORY, max_tokens=8,
                                             temperature=0, extra_body={"guided_regex": "[0-9]{3}"})
    assert len(regex.choices[0].text) == 3 and regex.choices[0].text.isdigit()
    obj = served.client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=30,
                                                temperature=0,
                                                response_format={"type": "json_object"})
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content), dict)
    else:       # cut by max_tokens: still the start of an object
        assert obj.choices[0].message.content.lstrip().startswith("{")


def _text_and_reason(out) -> tuple[str, str]:
    c = out.choices[0]
    return (c.text if hasattr(c, "text") else c.message.content), c.finish_reason


def test_concurrent_clients_all_get_their_own_outputs(served):
    """8 clients at once on a batch of 4 slots: they join the running batch and queue."""
    def one(i: int) -> str:
        stream = i % 2 == 1
        kwargs = dict(model=MODEL, prompt=PROMPTS[i], max_tokens=10, temperature=0)
        if stream:
            return _stream_text(served.client.completions.create(**kwargs, stream=True))[0][0]
        return served.client.completions.create(**kwargs).choices[0].text

    with ThreadPoolExecutor(8) as pool:
        texts = list(pool.map(one, range(8)))
    assert texts == [served.reference[f"greedy{i}"].outputs[0].text for i in range(8)]
    assert len(set(texts)) > 1
