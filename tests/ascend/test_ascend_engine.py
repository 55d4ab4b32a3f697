"""The Ascend backend's LLM (in .venv-ascend: its own checkpoint reading, the shared scheduler
driving the torch step) against the JAX engine on the same checkpoint: greedy outputs of 64
tokens equal, with continuous batching (six prompts, four slots), chunked prefill (a 64-token
budget) and admission held back by a small page pool (12 pages: not four of the long
sequences at once); and what it refuses, per request or at start-up. (Prefix caching, MTP
speculation, structured output: test_ascend_prefix_cache.py, _speculative.py, _structured.py.)"""

from __future__ import annotations

import numpy as np
import pytest

from tests.ascend.ascend_env import needs_ascend_env, run_in_ascend_env
from tests.ascend.jax_side import MAX_TOKENS, both_engines
from tests.conftest import V41_ORACLE_DIR, oracle_case

pytestmark = [needs_ascend_env, pytest.mark.oracle]


def test_greedy_outputs_match_the_jax_engine(tmp_path):
    rng = np.random.default_rng(7)
    prompts = [rng.integers(2, 512, size=int(n)).tolist() for n in (150, 23, 200, 90, 170, 41)]
    case = oracle_case("tiny-mixed")
    expected, result, _ = both_engines(tmp_path, case.checkpoint, case.model, [prompts])
    assert all(len(t) == MAX_TOKENS for t in result["tokens"])
    assert result["tokens"] == expected


def test_options_the_ascend_engine_lacks_are_refused_per_request():
    code = (
        "from ascend_backend.engine import AscendEngine, step_config\n"
        "from deepinfer_jax.config.hf import read_model_config\n"
        "from deepinfer_jax.host.request import InvalidRequestError, SamplingParams\n"
        "cfg = read_model_config('configs/tiny/tiny-mixed.json')\n"
        "sc = step_config(cfg, max_num_seqs=2, max_model_len=128, page_size=64, num_pages=4,\n"
        "                 max_num_batched_tokens=16, token_buckets=(16,))\n"
        "engine = AscendEngine(cfg, None, sc)\n"
        "for kw in ({'stop': ('x',)}, {'n': 2}, {'best_of': 2}, {'prompt_logprobs': 1},\n"
        "           {'regex': 'a+'}, {'max_tokens': 0}):\n"
        "    try:\n"
        "        engine.add_request('r', [5, 6], SamplingParams(**kw))\n"
        "        print('accepted', kw)\n"
        "    except InvalidRequestError as err:\n"
        "        print('refused:', err)\n"
        "print(engine.scheduler.has_work())\n")
    lines = run_in_ascend_env("-c", code).splitlines()
    assert len(lines) == 7 and lines[-1] == "False"       # nothing was queued
    for line, name in zip(lines[1:4], ("n", "best_of", "prompt_logprobs")):
        assert line.startswith("refused:")
        assert line.endswith(f"{name} is not supported by the Ascend engine yet")
    # stop strings and a regex without a tokenizer (none given here; with one, stop strings
    # run: test_ascend_llm.py)
    for line in (lines[0], lines[4]):
        assert line == "refused: stop strings and structured output need the model's tokenizer.json"
    assert lines[5].startswith("refused: max_tokens must be > 0")


@pytest.mark.skipif(not (V41_ORACLE_DIR / "deepseek-v41-tiny-a").exists(),
                    reason="no V4.1 fixtures")
def test_a_deepseek_v41_model_fails_at_start_up_on_ascend():
    code = (
        "import sys\n"
        "from ascend_backend.engine import AscendEngine, step_config\n"
        "from deepinfer_jax.config.hf import read_model_config\n"
        "from deepinfer_jax.config.platforms import UnsupportedFeatureError\n"
        "cfg = read_model_config(sys.argv[1])\n"
        "sc = step_config(cfg, max_num_seqs=2, max_model_len=128, page_size=64, num_pages=4,\n"
        "                 max_num_batched_tokens=16, token_buckets=(16,))\n"
        "try:\n"
        "    AscendEngine(cfg, None, sc)\n"
        "except UnsupportedFeatureError as err:\n"
        "    print(type(cfg).__name__, err.feature, err.platform)\n")
    config = V41_ORACLE_DIR / "deepseek-v41-tiny-a" / "config.json"
    assert run_in_ascend_env("-c", code, str(config)).split() == [
        "V41Config", "deepseek_v41", "ascend"]


def test_batch_invariant_mode_fails_at_start_up_on_ascend():
    code = (
        "from ascend_backend.engine import AscendEngine, step_config\n"
        "from deepinfer_jax.config.hf import read_model_config\n"
        "from deepinfer_jax.config.platforms import UnsupportedFeatureError\n"
        "cfg = read_model_config('configs/tiny/tiny-mixed.json')\n"
        "sc = step_config(cfg, max_num_seqs=2, max_model_len=128, page_size=64, num_pages=4,\n"
        "                 max_num_batched_tokens=16, token_buckets=(16,), batch_invariant=True)\n"
        "try:\n"
        "    AscendEngine(cfg, None, sc)\n"
        "except UnsupportedFeatureError as err:\n"
        "    print(type(err).__name__, err.feature, err.platform)\n")
    assert run_in_ascend_env("-c", code).split() == ["UnsupportedFeatureError",
                                                     "batch_invariant", "ascend"]
