"""Each bad request fails alone, with a typed error that names the problem, and the good
requests of the same batch finish with the outputs they have without it (the HF oracle's
greedy continuations of each prompt alone). One shared engine (conftest's `llm`)."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

import deepinfer_jax
from deepinfer_jax import FinishReason, InvalidRequestError, SamplingParams
from tests.engine.conftest import ENGINE

pytestmark = pytest.mark.oracle

GOOD = (14, 17)          # the workload's two shortest requests (prompt + output)
INF, NAN = float("inf"), float("nan")
BAD = [
    (dict(temperature=INF), "temperature must be finite"),
    (dict(temperature=NAN), "temperature"),
    (dict(repetition_penalty=INF), "repetition_penalty must be finite"),
    (dict(top_p=NAN), "top_p"),
    (dict(min_p=1.5), "min_p"),
    (dict(presence_penalty=-INF), "presence_penalty"),
    (dict(frequency_penalty=NAN), "frequency_penalty"),
    (dict(top_k=-5), "top_k"),
    (dict(logprobs=10**4), "logprobs must be in [0, 20]"),
    (dict(seed=-3), "seed"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"),
    # the prompt is 4 tokens: 640 - 4 fit, one more does not
    (dict(max_tokens=637), "prompt of 4 tokens + max_tokens 637 exceeds max_model_len=640: "
                           "ask for at most 636 tokens"),
]


def run_with(llm, workload, bad_prompt, bad_params):
    prompts = [workload.prompts[GOOD[0]], bad_prompt, workload.prompts[GOOD[1]]]
    params = [SamplingParams(max_tokens=workload.max_new[GOOD[0]], ignore_eos=True), bad_params,
              SamplingParams(max_tokens=workload.max_new[GOOD[1]], ignore_eos=True)]
    return llm.generate(prompts, params, use_tqdm=False)


def assert_fails_alone(outputs, workload, named):
    bad = outputs[1]
    assert bad.finished and bad.finish_reason is FinishReason.ERROR and bad.token_ids == []
    assert isinstance(bad.error, InvalidRequestError) and named in str(bad.error), bad.error
    for out, i in zip((outputs[0], outputs[2]), GOOD):
        assert out.error is None and out.token_ids == workload.expected[i]


@pytest.mark.parametrize("options, named", BAD, ids=lambda x: repr(x)[:30])
def test_bad_sampling_value_fails_alone(llm, workload, options, named):
    assert_fails_alone(run_with(llm, workload, [5, 6, 7, 8], SamplingParams(**options)),
                       workload, named)


def test_max_tokens_that_fit_exactly_are_served(llm):
    [out] = llm.generate([[5 + i % 400 for i in range(630)]], SamplingParams(max_tokens=10, ignore_eos=True),
                         use_tqdm=False)
    assert out.error is None and len(out.token_ids) == 10


@pytest.fixture(scope="module")
def text_llm(tmp_path_factory, model):
    """The shared engine's model and shapes with a small byte-level BPE tokenizer that fits
    the model's 512-token vocabulary. (Whether it reuses `llm`'s compiled steps depends on
    tests/conftest.py's per-file release of the memo; test_engine_api.py tests the sharing.)"""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["def f(x):\n    return x + 1\n"] * 10, trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    directory = tmp_path_factory.mktemp("tokenizer")
    tok.save(str(directory / "tokenizer.json"))
    return deepinfer_jax.LLM(model, tokenizer=directory, **ENGINE)


def test_lone_surrogate_in_a_prompt_fails_alone(text_llm, workload):
    outputs = run_with(text_llm, workload, "def f(x):\ud800", SamplingParams(max_tokens=4))
    assert_fails_alone(outputs, workload, "prompt is not valid Unicode text: surrogates not "
                                          "allowed ('\\ud800' at index 9)")


def test_lone_surrogate_in_a_stop_string_fails_alone(text_llm, workload):
    outputs = run_with(text_llm, workload, "def f(x):", SamplingParams(stop=["\udc80"]))
    assert_fails_alone(outputs, workload, "stop string '\\udc80' is not valid Unicode text")
