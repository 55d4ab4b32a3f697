"""One LLM, two backends: `LLM(model, backend="ascend")` in .venv-ascend, where jax is not
installed (the LLM's loop and the shared scheduler over the torch step), against
`LLM(model)` (the JAX engine on the CPU) on the shipped trained model: greedy tokens equal
over 64 tokens with continuous batching (seven prompts of different lengths, four slots,
chunked prefill) and grammar-constrained requests and a stop string among them, with the
same text; the typed start-up errors of
`LLM(...)` for what Ascend lacks, with the backend chosen by the argument or by
DEEPINFER_BACKEND. One subprocess for the module (tests/ascend/torch_generate.py)."""

from __future__ import annotations

import json
import re
import urllib.request

import numpy as np
import pytest

import deepinfer_jax
from deepinfer_jax import SamplingParams
from deepinfer_jax.api.cli import main
from deepinfer_jax.config.errors import EngineConfigError
from deepinfer_jax.host.tokenizer import TextTokenizer
from tests.ascend.ascend_env import ascend_server, needs_ascend_env, run_in_ascend_env
from tests.conftest import REPO

pytestmark = needs_ascend_env

SHIPPED = REPO / "models" / "deepinfer-tiny-v4"
ENGINE = dict(max_num_seqs=4, max_model_len=320, max_num_batched_tokens=64,
              token_buckets=(64,))
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "count": {"type": "integer", "minimum": 0}},
          "required": ["name", "count"], "additionalProperties": False}
REGEX = r"[a-z]{3,6}-[0-9]{2}"


def prompts_and_sampling() -> tuple[list[list[int]], list[dict]]:
    tok = TextTokenizer.from_model_dir(SHIPPED)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(2, 500, size=n).tolist() for n in (150, 23, 90, 170)]
    prompts += [tok.encode(t) for t in ("config = ", "def answer():\n    return ", "x = ")]
    free = {"max_tokens": 64, "ignore_eos": True}
    sampling = [free] * 4 + [{"max_tokens": 64, "json_schema": SCHEMA},
                             {"max_tokens": 64, "regex": REGEX},
                             {"max_tokens": 64, "stop": ["\n"], "ignore_eos": True}]
    return prompts, sampling


@pytest.fixture(scope="module")
def both(tmp_path_factory):
    """-> (the JAX LLM's tokens per prompt, the Ascend side's result.json, the JAX LLM's
    [text, finish reason, stop reason] per prompt)."""
    prompts, sampling = prompts_and_sampling()
    llm = deepinfer_jax.LLM(SHIPPED, dtype=np.float32, show_progress=False, **ENGINE)
    outputs = llm.generate(prompts, [SamplingParams(**kw) for kw in sampling], use_tqdm=False)
    sc = llm.step_config
    directory = tmp_path_factory.mktemp("ascend_llm")
    (directory / "case.json").write_text(json.dumps({
        "checkpoint": str(SHIPPED), "rounds": [prompts], "max_tokens": 64,
        "sampling": sampling, "startup_checks": True,
        "engine": {**ENGINE, "token_buckets": list(ENGINE["token_buckets"])}}))
    run_in_ascend_env("tests/ascend/torch_generate.py", str(directory))
    result = json.loads((directory / "result.json").read_text())
    # both resolved the same shapes from ENGINE (EngineConfig.resolve), so they see the same plans
    assert result["shapes"] == [sc.page_size, sc.num_pages, list(sc.token_buckets)]
    assert result["vocab_size"] == llm.model.config.vocab_size     # LLM.model.config on both
    texts = [[o.outputs[0].text, str(o.outputs[0].finish_reason), o.outputs[0].stop_reason]
             for o in outputs]
    return [list(o.outputs[0].token_ids) for o in outputs], result, texts


def test_greedy_tokens_equal_the_jax_backend_with_batching_and_grammars(both):
    expected, result, texts = both
    assert result["errors"] == [None] * 7
    assert [len(t) for t in expected[:4]] == [64] * 4
    assert result["tokens"] == expected
    assert result["text"] == texts
    assert texts[6][1:] == ["FinishReason.STOP", "\n"] and len(expected[6]) < 64
    assert not result["jax_imported"]         # the LLM ran where jax is not even installed
    tok = TextTokenizer.from_model_dir(SHIPPED)
    data = json.loads(tok.decode(result["tokens"][4]))
    assert set(data) == {"name", "count"}
    assert re.fullmatch(REGEX, tok.decode(result["tokens"][5]))


def test_batch_invariant_mode_fails_in_llm_start_up_on_ascend(both):
    checks = both[1]["startup"]
    for how in ("argument", "environment"):        # backend="ascend", DEEPINFER_BACKEND=ascend
        kind, feature, platform, message = checks[how]
        assert (kind, feature, platform) == ("UnsupportedFeatureError", "batch_invariant",
                                             "ascend"), how
        assert "batch_invariant is not supported on ascend" in message
    # neither: the JAX backend, which .venv-ascend does not have, refused by name
    kind, _, _, message = checks["none"]
    assert kind == "EngineConfigError"
    assert "backend 'jax' needs jax, which is not installed here" in message


def test_the_ascend_backend_where_torch_is_missing_is_a_typed_error(monkeypatch):
    """The engine's environment has no torch: asking for Ascend names what is missing."""
    pytest.importorskip("jax")
    try:
        import torch  # noqa: F401
        pytest.skip("torch is installed in this environment")
    except ImportError:
        pass
    with pytest.raises(EngineConfigError, match="backend 'ascend' needs torch"):
        deepinfer_jax.LLM(SHIPPED, backend="ascend", **ENGINE)
    monkeypatch.setenv("DEEPINFER_BACKEND", "tpu")
    with pytest.raises(EngineConfigError, match="unknown backend 'tpu'"):
        deepinfer_jax.LLM(SHIPPED, **ENGINE)


# a combination (the CLI and server x the Ascend backend): each in CI's tier on its own
@pytest.mark.slow
def test_the_cli_and_the_server_on_the_ascend_backend(capsys):
    """`deepinfer generate` and `deepinfer serve` with DEEPINFER_BACKEND=ascend in .venv-ascend
    (no jax) give the JAX engine's greedy continuations (the JAX CLI's, in this process),
    float32 on both sides: the JAX default for the shipped model is its checkpoint's bf16."""
    prompts = ["def answer():\n    return ", "config = "]
    args = ["--max-tokens", "24", "--ignore-eos", "--temperature", "0", "--dtype", "float32"]
    asked = [arg for prompt in prompts for arg in ("--prompt", prompt)]
    assert main(["generate", *asked, *args]) == 0
    jax_lines = _completions(capsys.readouterr().out)
    assert len(jax_lines) == 2
    ascend_lines = _completions(run_in_ascend_env("-m", "deepinfer_jax.api.cli", "generate",
                                                  *asked, *args, DEEPINFER_BACKEND="ascend"))
    assert ascend_lines == jax_lines
    # the OpenAI server: its engine process on the Ascend backend
    with ascend_server("--dtype", "float32", DEEPINFER_BACKEND="ascend") as url:
        body = json.dumps({"model": "deepinfer-tiny-v4", "prompt": prompts, "max_tokens": 24,
                           "temperature": 0, "ignore_eos": True}).encode()
        request = urllib.request.Request(url + "/v1/completions", body,
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as response:
            choices = sorted(json.load(response)["choices"], key=lambda c: c["index"])
    served = [f"[{c['index']}] ({c['finish_reason']}) {c['text']!r}" for c in choices]
    assert served == jax_lines


def _completions(stdout: str) -> list[str]:
    """The CLI's result lines: `[i] (finish reason) 'text'`."""
    return [line for line in stdout.splitlines() if re.match(r"\[\d+\] \(", line)]
