"""Text prompts through a model directory's tokenizer.json, and the `deepinfer` command."""

from __future__ import annotations

import re

import pytest
from tokenizers import Tokenizer

import deepinfer_jax
from deepinfer_jax import SamplingParams
from deepinfer_jax.api.cli import main as cli_main
from tests.engine.conftest import ENGINE

pytestmark = pytest.mark.oracle
# ENGINE's options as flags: the CLI's engines then share the file's compiled steps
CLI_ENGINE = ["--max-num-seqs", "8", "--max-model-len", "640", "--max-num-batched-tokens", "128",
              "--token-buckets", "16", "128"]

def test_string_prompt_end_to_end(model_dir):
    llm = deepinfer_jax.LLM(model_dir, **ENGINE)
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    prompt = "def fibonacci(n):"
    [out, by_ids] = llm.generate([prompt, tok.encode(prompt).ids],
                                 SamplingParams(max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert out.prompt_token_ids[0] == 0 and out.prompt_token_ids == tok.encode(prompt).ids
    assert out.token_ids == by_ids.token_ids and len(out.token_ids) == 12
    assert out.text == tok.decode(out.token_ids) and isinstance(out.text, str)
    assert out.metrics.time_to_first_token is not None and out.metrics.finished_time is not None
    streamed = "".join(d.text for d in llm.stream(prompt, SamplingParams(max_tokens=12, ignore_eos=True)))
    assert streamed == out.text


def test_text_prompt_without_tokenizer_fails_alone(llm):
    [text, ids] = llm.generate(["hello", [3, 4]], SamplingParams(max_tokens=2), use_tqdm=False)
    assert isinstance(text.error, deepinfer_jax.InvalidRequestError) and "tokenizer" in str(text.error)
    assert ids.error is None and len(ids.token_ids) == 2


def test_cli_generate_and_bench(model_dir, capsys):
    engine = ["--model", str(model_dir), *CLI_ENGINE]
    assert cli_main(["generate", *engine, "--prompt", "class Point:", "--prompt-ids", "5,6,7",
                     "--max-tokens", "4", "--ignore-eos"]) == 0
    out = capsys.readouterr().out
    assert "[0] (length) '" in out and "[1] (length)" in out
    assert cli_main(["bench", *engine, "--num-prompts", "4", "--input-len", "20",
                     "--output-len", "3"]) == 0
    assert '"requests_per_s"' in capsys.readouterr().out


def test_cli_sampling_and_structured_flags_reach_the_request(model_dir, capsys):
    """The CLI's sampling flags become the request's SamplingParams: two seeded completions
    of a regex, the same as the API gives for those parameters, and a bad value fails that
    request with a non-zero exit."""
    engine = ["--model", str(model_dir), *CLI_ENGINE]
    flags = ["--temperature", "1.0", "--seed", "7", "--n", "2", "--regex", "[0-9]{3}",
             "--max-tokens", "8"]
    assert cli_main(["generate", *engine, "--prompt", "x = ", *flags]) == 0
    lines = capsys.readouterr().out.splitlines()
    shown = [line for line in lines if line.startswith("[0.")]
    llm = deepinfer_jax.LLM(model_dir, **ENGINE)
    [expected] = llm.generate(["x = "], SamplingParams(temperature=1.0, seed=7, n=2,
                                                       regex="[0-9]{3}", max_tokens=8),
                              use_tqdm=False)
    assert shown == [f"[0.{c.index}] ({c.finish_reason.value}) {c.text!r}"
                     for c in expected.outputs]
    assert all(re.fullmatch("[0-9]{3}", c.text) for c in expected.outputs)
    assert cli_main(["generate", *engine, "--prompt", "x", "--temperature", "-1"]) == 1
    assert "temperature" in capsys.readouterr().err
