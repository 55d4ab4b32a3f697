"""Bad inputs get typed errors that name what is wrong: engine defaults that follow the model,
sampling values out of range or not finite, broken config.json and tokenizer.json, a prompt
that is not valid Unicode. (Request-level errors in a running batch: tests/engine/
test_bad_requests.py; checkpoints: tests/weights/test_bad_checkpoints.py.)"""

from __future__ import annotations

import json
import math

import pytest

from deepinfer_jax.config.engine import DEFAULT_MAX_MODEL_LEN, EngineConfig, EngineConfigError
from deepinfer_jax.config.hf import read_model_config
from deepinfer_jax.config.model import ConfigError
from deepinfer_jax.host.request import InvalidRequestError, SamplingParams
from deepinfer_jax.host.tokenizer import TextTokenizer, TokenizerError
from tests.conftest import REPO

CFG = read_model_config(REPO / "configs" / "tiny" / "tiny-mixed.json")
SHIPPED = REPO / "models" / "deepinfer-tiny-v4"


# ---- engine defaults derived from the model -----------------------------------------------
@pytest.mark.parametrize("model_len, expected", [(1024, 1024), (2048, 2048),
                                                 (1 << 20, DEFAULT_MAX_MODEL_LEN)])
def test_default_max_model_len_follows_the_model(model_len, expected):
    step = EngineConfig().resolve(CFG.replace(max_position_embeddings=model_len))
    assert step.max_model_len == expected
    # the page pool follows: every slot can reach the context
    assert step.max_blocks_per_seq == math.ceil(expected / step.page_size)
    assert step.num_pages == step.max_blocks_per_seq * step.max_num_seqs


def test_explicit_max_model_len_beyond_the_model_is_an_error():
    small = CFG.replace(max_position_embeddings=2048)
    assert EngineConfig(max_model_len=2048).resolve(small).max_model_len == 2048
    with pytest.raises(EngineConfigError, match="max_model_len 4096 exceeds the model's "
                                                "max_position_embeddings 2048"):
        EngineConfig(max_model_len=4096).resolve(small)
    with pytest.raises(EngineConfigError, match="max_model_len must be > 0"):
        EngineConfig(max_model_len=0)


# ---- sampling values ----------------------------------------------------------------------
INF, NAN = float("inf"), float("nan")
BAD_SAMPLING = [
    (dict(temperature=INF), "temperature"), (dict(temperature=NAN), "temperature"),
    (dict(temperature=-0.5), "temperature"),
    (dict(top_p=0.0), "top_p"), (dict(top_p=NAN), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(min_p=-0.1), "min_p"), (dict(min_p=NAN), "min_p"), (dict(min_p=INF), "min_p"),
    (dict(top_k=-2), "top_k"),
    (dict(repetition_penalty=INF), "repetition_penalty"),
    (dict(repetition_penalty=NAN), "repetition_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(presence_penalty=INF), "presence_penalty"),
    (dict(presence_penalty=NAN), "presence_penalty"),
    (dict(frequency_penalty=-INF), "frequency_penalty"),
    (dict(frequency_penalty=NAN), "frequency_penalty"),
    (dict(logprobs=21), "logprobs"), (dict(logprobs=-1), "logprobs"),
    (dict(seed=-1), "seed"), (dict(seed=2**32), "seed"),
    (dict(max_tokens=0), "max_tokens"), (dict(min_tokens=5, max_tokens=4), "min_tokens"),
    (dict(stop=["ok", ""]), "stop strings must not be empty"),
    (dict(stop=["a\ud800b"]), "stop string"),
    (dict(stop_token_ids=[512]), "stop_token_ids"),
]


@pytest.mark.parametrize("options, named", BAD_SAMPLING, ids=lambda x: repr(x)[:40])
def test_each_bad_sampling_value_is_named(options, named):
    problems = SamplingParams(**options).problems(512, 20, has_tokenizer=True)
    assert len(problems) == 1 and named in problems[0], problems


def test_good_sampling_values_pass():
    params = SamplingParams(temperature=1e6, top_p=1.0, min_p=1.0, top_k=-1,
                            repetition_penalty=1e-3, presence_penalty=-2, frequency_penalty=2,
                            logprobs=20, seed=2**32 - 1, stop=["é", "\U0001F600"])
    assert params.problems(512, 20, has_tokenizer=True) == []


@pytest.mark.parametrize("options", [dict(seed=1.5), dict(seed="1"), dict(temperature="0"),
                                     dict(stop=[3]), dict(stop_token_ids=["a"])])
def test_wrong_types_raise_at_once(options):
    with pytest.raises(TypeError):
        SamplingParams(**options)


# ---- config.json --------------------------------------------------------------------------
def test_broken_config_json_names_the_file_and_line(tmp_path):
    text = json.dumps(json.loads((SHIPPED / "config.json").read_text()), indent=2)
    lines = text.splitlines()
    lines[3] = lines[3].rstrip(",")           # a missing comma after line 4
    (tmp_path / "config.json").write_text("\n".join(lines))
    with pytest.raises(ConfigError) as err:
        read_model_config(tmp_path)
    message = str(err.value)
    assert str(tmp_path / "config.json") in message and "not valid JSON at line 5" in message


@pytest.mark.parametrize("content, expected", [
    ("", "not valid JSON at line 1"),
    ("[1, 2]", "expected a JSON object, got list"),
    ('{"model_type": "llama"}', "model_type: expected 'deepseek_v4'"),
])
def test_config_errors_name_the_file(tmp_path, content, expected):
    (tmp_path / "config.json").write_text(content)
    with pytest.raises(ConfigError) as err:
        read_model_config(tmp_path)
    assert str(tmp_path / "config.json") in str(err.value) and expected in str(err.value)


def test_config_field_of_the_wrong_type_names_the_file(tmp_path):
    raw = json.loads((SHIPPED / "config.json").read_text())
    raw["hidden_size"] = "wide"
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="config.json"):
        read_model_config(tmp_path)


# ---- tokenizer.json and text prompts ------------------------------------------------------
@pytest.mark.parametrize("content", ['{"version": "1.0", "model": ', "{}", ""])
def test_broken_tokenizer_json_names_the_file(tmp_path, content):
    (tmp_path / "tokenizer.json").write_text(content)
    with pytest.raises(TokenizerError) as err:
        TextTokenizer.from_model_dir(tmp_path)
    assert str(tmp_path / "tokenizer.json") in str(err.value)


def test_lone_surrogate_in_a_prompt_is_an_invalid_request():
    tok = TextTokenizer.from_model_dir(SHIPPED)
    assert tok.encode("def f(x):") == tok.encode("def f(x):")
    with pytest.raises(InvalidRequestError, match=r"not valid Unicode.*'\\ud800' at index 4"):
        tok.encode("def \ud800f(x):")


@pytest.mark.parametrize("budget, kept", [(32, (16, 32)), (40, (16, 32, 64)), (128, (16, 32, 64, 128))])
def test_buckets_no_step_can_reach_are_dropped(budget, kept):
    """A step feeds at most max_num_batched_tokens (the scheduler's budget, drafts included;
    a step past the largest bucket would raise in host/buckets.py), so buckets past the first
    that holds it would be compiled for nothing; too few buckets is still an error."""
    config = EngineConfig(max_num_batched_tokens=budget, token_buckets=(128, 16, 64, 32))
    assert config.token_buckets == kept
    with pytest.raises(EngineConfigError, match="reach max_num_batched_tokens"):
        EngineConfig(max_num_batched_tokens=256, token_buckets=(16, 128))
