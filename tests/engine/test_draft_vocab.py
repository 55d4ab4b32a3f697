"""The MTP block's draft token map (speculative_config.draft_token_map): the map file's
checks, a typed error before anything compiles, and tools/draft_token_map.py's ranking. That
speculation with a map keeps the outputs and drafts only mapped tokens:
test_speculative_shipped.py (the trained model, whose drafts get accepted)."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

import deepinfer_jax
from deepinfer_jax.config.errors import EngineConfigError
from deepinfer_jax.engine import core
from deepinfer_jax.engine.draft_vocab import read_token_map
from tests.conftest import REPO

sys.path.insert(0, str(REPO / "tools"))

TINY = REPO / "models" / "deepinfer-tiny-v4"


def test_a_json_list_and_an_npy_array_are_read_as_int32_ids(tmp_path):
    (tmp_path / "map.json").write_text(json.dumps([5, 0, 17]))
    np.save(tmp_path / "map.npy", np.array([9, 3], np.int64))
    ids = read_token_map(str(tmp_path / "map.json"), 32)
    assert ids.dtype == np.int32 and ids.tolist() == [5, 0, 17]      # the file's order kept
    assert read_token_map(str(tmp_path / "map.npy"), 32).tolist() == [9, 3]


@pytest.mark.parametrize("content, problem", [
    ([], "non-empty list of integer token ids"),
    ([1.5, 2.0], "non-empty list of integer token ids"),
    ([[1, 2], [3, 4]], "non-empty list of integer token ids"),
    ([3, 32], r"ids must be in \[0, 32\), found 3\.\.32"),
    ([-1, 4], r"ids must be in \[0, 32\), found -1\.\.4"),
    ([7, 2, 7], "token 7 is listed 2 times"),
])
def test_a_bad_map_is_refused_naming_what_is_wrong(tmp_path, content, problem):
    path = tmp_path / "map.json"
    path.write_text(json.dumps(content))
    with pytest.raises(EngineConfigError, match=problem):
        read_token_map(str(path), 32)


def test_an_unreadable_map_is_refused(tmp_path):
    with pytest.raises(EngineConfigError, match="cannot be read"):
        read_token_map(str(tmp_path / "missing.json"), 32)
    (tmp_path / "broken.json").write_text("[1, 2")
    with pytest.raises(EngineConfigError, match="cannot be read"):
        read_token_map(str(tmp_path / "broken.json"), 32)


def test_the_engine_refuses_a_bad_map_before_compiling(tmp_path, monkeypatch):
    path = tmp_path / "map.json"
    path.write_text(json.dumps([0, 1, 6144]))             # the tiny model's vocabulary is 6144

    def no_compile(*args, **kwargs):
        raise AssertionError("a step compiled before the map was checked")

    monkeypatch.setattr(core, "compile_steps", no_compile)
    with pytest.raises(EngineConfigError, match=r"ids must be in \[0, 6144\)"):
        deepinfer_jax.LLM(TINY, speculative_config={"num_speculative_tokens": 2,
                                                    "draft_token_map": str(path)},
                          max_num_seqs=2, max_model_len=256, max_num_batched_tokens=16,
                          show_progress=False)


def test_the_tool_ranks_by_count_then_by_id():
    from draft_token_map import most_frequent

    tokens = np.array([4, 1, 4, 2, 2, 4, 0, 3, 3])        # counts: 4 x3, 2 x2, 3 x2, 0 x1, 1 x1
    assert most_frequent(tokens, 6, 4) == [4, 2, 3, 0]
    assert most_frequent(tokens, 6, 6) == [4, 2, 3, 0, 1, 5]


def test_the_cli_flag_reaches_the_speculative_config(monkeypatch, capsys):
    from deepinfer_jax.api import cli, llm

    made = []

    def recording_llm(model=None, **options):
        made.append(options)
        raise RuntimeError("recorded")

    monkeypatch.setattr(llm, "LLM", recording_llm)
    assert cli.main(["generate", "--prompt", "x", "--speculative-tokens", "2",
                     "--speculative-token-map", "map.json"]) == 1
    assert made[0]["speculative_config"] == {"method": "mtp", "num_speculative_tokens": 2,
                                             "draft_token_map": "map.json"}
    assert cli.main(["generate", "--prompt", "x", "--speculative-token-map", "map.json"]) == 1
    assert "--speculative-token-map goes with --speculative-tokens" in capsys.readouterr().err
    assert len(made) == 1


def test_the_lm_eval_option_reaches_the_speculative_config():
    from deepinfer_jax.api.eval_options import parse_model_args

    a = parse_model_args({"speculative_tokens": "2", "speculative_token_map": "map.json"})
    assert a.engine["speculative_config"] == {"num_speculative_tokens": 2,
                                              "draft_token_map": "map.json"}
