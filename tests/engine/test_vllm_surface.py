"""vLLM's surface (issue 31): RequestOutput.outputs[i], n and best_of, prompt_logprobs,
include_stop_str_in_output, skip_special_tokens, chat() and streams closed early."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from tokenizers import Tokenizer

from deepinfer_jax import FinishReason, InvalidRequestError, SamplingParams
from deepinfer_jax.host.chat import ChatTemplate

pytestmark = pytest.mark.oracle


def test_outputs0_is_the_completion(llm, workload):
    i = 4
    params = SamplingParams(max_tokens=workload.max_new[i], ignore_eos=True, logprobs=2)
    [out] = llm.generate([workload.prompts[i]], params, use_tqdm=False)
    [c] = out.outputs
    assert c.index == 0 and c.token_ids == workload.expected[i] == out.token_ids
    assert c.finish_reason == "length" and c.finish_reason is FinishReason.LENGTH and c.finished()
    assert c.stop_reason is None
    assert len(c.logprobs) == len(c.token_ids)
    for token, entry, raw in zip(c.token_ids, c.logprobs, out.logprobs, strict=True):
        assert entry[token].logprob == raw.logprob
        top = [t for t, _ in raw.top]
        assert list(entry)[:1] == [token] and set(entry) == {token, *top}
        assert [entry[t].rank for t in top] == [1, 2] and entry[top[0]].logprob >= entry[top[1]].logprob
    assert c.cumulative_logprob == pytest.approx(sum(e.logprob for e in out.logprobs))
    assert c.text is None and out.prompt_logprobs is None   # no tokenizer, none asked


def _completions(out):
    return [tuple(c.token_ids) for c in out.outputs]


def test_n_with_a_seed_is_reproducible_and_the_completions_differ(llm, workload):
    prompt = workload.prompts[2]
    params = SamplingParams(n=3, seed=1234, temperature=1.0, max_tokens=8, ignore_eos=True)
    [a] = llm.generate([prompt], params, use_tqdm=False)
    [b] = llm.generate([prompt], params, use_tqdm=False)
    assert _completions(a) == _completions(b)
    assert len(set(_completions(a))) == 3
    assert [c.index for c in a.outputs] == [0, 1, 2] and a.token_ids == a.outputs[0].token_ids
    # the i-th completion is the request seeded seed + i (vLLM's rule)
    alone = llm.generate([prompt] * 3, [SamplingParams(seed=1234 + i, temperature=1.0, max_tokens=8,
                                                       ignore_eos=True) for i in range(3)],
                         use_tqdm=False)
    assert _completions(a) == [tuple(o.token_ids) for o in alone]


def test_best_of_keeps_the_n_most_likely(llm, workload):
    prompt = workload.prompts[6]
    sampling = dict(seed=99, temperature=1.0, max_tokens=6, ignore_eos=True)
    [all4] = llm.generate([prompt], SamplingParams(n=4, logprobs=0, **sampling), use_tqdm=False)
    [best] = llm.generate([prompt], SamplingParams(n=2, best_of=4, **sampling), use_tqdm=False)
    ranked = sorted(all4.outputs, key=lambda c: -c.cumulative_logprob)
    assert len(set(_completions(all4))) > 2
    assert _completions(best) == [tuple(c.token_ids) for c in ranked[:2]]
    assert [c.index for c in best.outputs] == [0, 1]
    assert best.outputs[0].cumulative_logprob >= best.outputs[1].cumulative_logprob
    assert best.outputs[0].logprobs is None            # ranked by them, not asked to show them


def test_bad_n_and_best_of_fail_alone(llm):
    outs = llm.generate([[3, 4]] * 3, [SamplingParams(n=0), SamplingParams(n=3, best_of=2),
                                       SamplingParams(max_tokens=2)], use_tqdm=False)
    assert "n must be" in str(outs[0].error) and "best_of" in str(outs[1].error)
    assert isinstance(outs[0].error, InvalidRequestError) and outs[0].outputs[0].finish_reason == "error"
    assert outs[2].error is None and len(outs[2].token_ids) == 2
    deltas = list(llm.stream([[3, 4]], SamplingParams(n=1, best_of=2)))
    assert len(deltas) == 1 and "cannot stream" in str(deltas[0].error)


# Logprobs of one forward computed two ways (the reference forward's float32 log_softmax, and
# host/outputs.py's float64 normalisation of the same logits): 3e-7 apart on this prompt.
PROMPT_LOGPROB_TOL = 1e-5
# The engine's step (paged, chunked) against the reference forward, float32 on both sides: the
# same numerics up to summation order, 5e-7 apart on this prompt.
ENGINE_VS_REFERENCE_TOL = 1e-4


def test_prompt_logprobs_are_the_reference_forwards(llm, model, workload):
    prompt = workload.prompts[0][:50]
    [out] = llm.generate([prompt], SamplingParams(prompt_logprobs=3, logprobs=0, max_tokens=1),
                         use_tqdm=False)
    reference = np.asarray(jax.nn.log_softmax(model.logits(prompt)[0], axis=-1))
    lps = out.prompt_logprobs
    assert len(lps) == len(prompt) and lps[0] is None
    for j in range(1, len(prompt)):
        row, token = reference[j - 1], prompt[j]
        assert lps[j][token].logprob == pytest.approx(row[token], abs=PROMPT_LOGPROB_TOL)
        assert lps[j][token].rank == 1 + int((row > row[token]).sum())
        top = [t for t, lp in lps[j].items() if lp.rank is not None and lp.rank <= 3]
        assert sorted(top) == sorted(np.argsort(-row)[:3].tolist()), j
    # the choice of the reference forward is sound: the engine's own logprob of its first
    # token equals the reference's at the prompt's last position
    token = out.token_ids[0]
    last = np.asarray(jax.nn.log_softmax(model.logits(prompt)[0, -1]))
    assert out.outputs[0].logprobs[0][token].logprob == pytest.approx(last[token],
                                                                       abs=ENGINE_VS_REFERENCE_TOL)


def test_include_stop_str_in_output(text_llm, model_dir):
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    prompt = "def fibonacci(n):"
    free = SamplingParams(max_tokens=16, ignore_eos=True)
    [full] = text_llm.generate(prompt, free, use_tqdm=False)
    stop = full.text[6:9]
    at = full.text.find(stop)
    [cut, kept] = text_llm.generate([prompt] * 2, [
        SamplingParams(max_tokens=16, ignore_eos=True, stop=stop),
        SamplingParams(max_tokens=16, ignore_eos=True, stop=stop, include_stop_str_in_output=True)],
        use_tqdm=False)
    assert cut.outputs[0].text == full.text[:at] and kept.outputs[0].text == full.text[:at + len(stop)]
    assert cut.outputs[0].stop_reason == stop == kept.outputs[0].stop_reason
    assert cut.finish_reason == "stop" == kept.finish_reason
    streamed = "".join(d.text for d in text_llm.stream(prompt, SamplingParams(
        max_tokens=16, ignore_eos=True, stop=stop, include_stop_str_in_output=True)))
    assert streamed == kept.text
    # a stop token's text, left out unless included
    ids = full.token_ids
    j = next(j for j in range(2, len(ids)) if ids[j] not in ids[:j] and tok.decode(ids[j:j + 1]))
    [cut, kept] = text_llm.generate([prompt] * 2, [
        SamplingParams(max_tokens=16, ignore_eos=True, stop_token_ids=[ids[j]]),
        SamplingParams(max_tokens=16, ignore_eos=True, stop_token_ids=[ids[j]],
                       include_stop_str_in_output=True)], use_tqdm=False)
    assert cut.token_ids == kept.token_ids == ids[:j + 1]
    assert cut.text == tok.decode(ids[:j]) and kept.text == tok.decode(ids[:j + 1])
    assert cut.outputs[0].stop_reason == ids[j]
    streamed = "".join(d.text for d in text_llm.stream(prompt, SamplingParams(
        max_tokens=16, ignore_eos=True, stop_token_ids=[ids[j]])))
    assert streamed == cut.text


def test_skip_special_tokens(text_llm, model_dir, workload):
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    i = 18        # this prompt's greedy continuation holds token 0, the tokenizer's <bos>
    params = dict(max_tokens=workload.max_new[i], ignore_eos=True, logprobs=0)
    [skip, keep] = text_llm.generate([workload.prompts[i]] * 2, [
        SamplingParams(**params), SamplingParams(**params, skip_special_tokens=False)], use_tqdm=False)
    ids = skip.token_ids
    assert 0 in ids and keep.token_ids == ids
    assert "<bos>" not in skip.text and skip.text == tok.decode(ids)
    assert "<bos>" in keep.text and keep.text == tok.decode(ids, skip_special_tokens=False)
    streamed = "".join(d.text for d in text_llm.stream(
        [workload.prompts[i]], SamplingParams(**params, skip_special_tokens=False)))
    assert streamed == keep.text
    # each logprob entry carries its token's own text, special tokens included
    entry = skip.outputs[0].logprobs[ids.index(0)]
    assert entry[0].decoded_token == "<bos>"
    assert skip.outputs[0].logprobs[0][ids[0]].decoded_token == tok.decode([ids[0]])


def test_chat_applies_the_models_template(text_llm, model_dir):
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    messages = [{"role": "system", "content": "Answer in code."},
                {"role": "user", "content": "def fibonacci(n):"}]
    rendered = "<bos># system: Answer in code.\n# user: def fibonacci(n):\n# assistant:\n"
    assert text_llm.chat_template.render(messages) == rendered
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    [reply, again] = text_llm.chat([messages, messages], params, use_tqdm=False)
    expected = tok.encode(rendered, add_special_tokens=False).ids
    assert reply.prompt_token_ids == expected and expected.count(0) == 1 and expected[0] == 0
    [by_ids] = text_llm.generate([expected], params, use_tqdm=False)
    assert reply.outputs[0].token_ids == by_ids.token_ids == again.token_ids
    assert reply.outputs[0].text == tok.decode(by_ids.token_ids)


def test_the_shipped_model_has_a_chat_template():
    from tests.conftest import REPO

    shipped = REPO / "models" / "deepinfer-tiny-v4"
    template = ChatTemplate.from_model_dir(shipped)
    messages = [{"role": "user", "content": "Write a function."}]
    assert template.render(messages) == "<|bos|># user: Write a function.\n# assistant:\n"
    assert template.render(messages, add_generation_prompt=False) == "<|bos|># user: Write a function.\n"
    tok = Tokenizer.from_file(str(shipped / "tokenizer.json"))
    ids = tok.encode(template.render(messages), add_special_tokens=False).ids
    assert ids[0] == tok.token_to_id("<|bos|>") and ids.count(ids[0]) == 1


def _free_pages(llm):
    return llm.engine.scheduler.kv_cache.num_free_pages


def test_a_stream_closed_early_frees_its_pages_at_once(llm, workload):
    prompts = [workload.prompts[i] for i in (1, 3)]
    params = SamplingParams(max_tokens=200, ignore_eos=True)
    total = llm.step_config.num_pages
    stream = llm.stream(prompts, params)
    for delta in stream:
        if delta.token_ids:
            break
    assert _free_pages(llm) < total            # the generator is still open: still running
    stream.close()
    assert _free_pages(llm) == total and not llm.engine.scheduler.has_work()
    for delta in llm.stream(prompts, params):  # a for loop's own generator, dropped on break
        if delta.token_ids:
            break
    assert _free_pages(llm) == total and not llm.engine.scheduler.has_work()
    # the engine carries on: later requests are unaffected
    [out] = llm.generate([workload.prompts[5]], SamplingParams(max_tokens=workload.max_new[5],
                                                                ignore_eos=True), use_tqdm=False)
    assert out.token_ids == workload.expected[5]
