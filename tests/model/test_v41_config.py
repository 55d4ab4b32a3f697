"""V41Config: both oracle configs parse into the roles the oracle README lists; defaults for the
source lists; clear errors for what the engine cannot honour; V4 configs unaffected."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deepinfer_jax.config.hf import read_model_config
from deepinfer_jax.config.hf_v41 import parse_v41_config
from deepinfer_jax.config.model import ConfigError, ModelConfig, YarnConfig
from deepinfer_jax.config.v41 import V41Config
from tests.conftest import REPO, V41_ORACLE_DIR

A = V41_ORACLE_DIR / "deepseek-v41-tiny-a"
B = V41_ORACLE_DIR / "deepseek-v41-tiny-b"
pytestmark = pytest.mark.skipif(not A.exists(), reason="no V4.1 oracle fixtures")


def _raw(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())


def test_fixture_a_roles():
    cfg = read_model_config(A)
    assert isinstance(cfg, V41Config)
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.head_dim) == (6, 64, 4, 64)
    assert cfg.rope_head_dim == 16 and cfg.compress_yarn is None
    assert cfg.compress_ratios == (0, 2, 2, 1, 1, 1)          # the draft entry dropped
    assert [cfg.kv_source(i) for i in range(6)] == [None, 1, 1, 3, 3, 3]
    assert [cfg.is_index_source(i) for i in range(6)] == [False, True, False, True, False, True]
    assert [cfg.uses_candidates(i) for i in range(6)] == [False] * 5 + [True]
    assert cfg.candidate_source_layer_id == 3
    assert cfg.engram.layer_ids == (1, 4) and cfg.engram.n_columns == 4
    assert [cfg.has_engram(i) for i in range(6)] == [False, True, False, False, True, False]
    assert cfg.dspark.num_layers == 1 and cfg.eos_token_ids == ()


def test_fixture_b_roles_and_yarn():
    cfg = read_model_config(B / "config.json")
    assert cfg.compress_ratios == (0, 4, 4, 1, 1)
    assert [cfg.kv_source(i) for i in range(5)] == [None, 1, 1, 3, 3]
    assert cfg.rope_head_dim == 32
    assert cfg.compress_yarn == YarnConfig(factor=16.0, original_max_position_embeddings=64)
    assert cfg.engram.layer_ids == (2,) and cfg.engram.n_columns == 6


def test_source_defaults_follow_the_ratio_runs():
    raw = _raw(A)
    for name in ("kv_source_layer_ids", "index_source_layer_ids", "candidate_source_layer_id",
                 "layer_types"):
        del raw[name]
    cfg = parse_v41_config(raw)
    assert cfg.kv_source_layer_ids == (1, 3) and cfg.index_source_layer_ids == (1, 3)
    assert cfg.candidate_source_layer_id == 3


def test_composite_config_reads_its_text_backbone():
    raw = {"model_type": "deepseek_v41", "text_config": _raw(A), "vision_config": {}}
    assert parse_v41_config(raw) == read_model_config(A)


@pytest.mark.parametrize("change, message", [
    ({"num_key_value_heads": 2}, "num_key_value_heads"),
    ({"scoring_func": "softmax"}, "scoring_func"),
    ({"topk_method": "greedy"}, "topk_method"),
    ({"attention_bias": True}, "attention_bias"),
    ({"num_hash_layers": 3}, "hash-routed"),
    ({"compress_ratios": [0, 2, 2, 1, 1, 1, 4]}, "draft-layer entries"),
    ({"compress_ratios": [0, 2, 2, 1, 1]}, "compress_ratios"),
    ({"kv_source_layer_ids": [1]}, "no KV source of its ratio"),
    ({"kv_source_layer_ids": [3, 1]}, "increasing"),
    ({"index_source_layer_ids": [1, 5]}, "must be an index source too"),
    ({"candidate_source_layer_id": 2}, "candidate_source_layer_id"),
    ({"layer_types": ["sliding_attention"] * 6}, "layer_types"),
    ({"engram_num_embeddings": [290]}, "engram_num_embeddings"),
    ({"qk_rope_head_dim": 32}, "rope dimensions disagree"),
    ({"dspark_target_layer_ids": [2, 6]}, "dspark_target_layer_ids"),
    ({"dspark_num_experts_per_tok": 5}, "dspark_num_experts_per_tok"),
    ({"dspark_block_size": 0}, "dspark_block_size"),
    ({"rope_parameters": {"main": {"rope_type": "yarn", "rope_theta": 1.0},
                          "compress": {"rope_theta": 1.0}}}, "rope_parameters.main"),
])
def test_clear_errors(change, message):
    with pytest.raises(ConfigError, match=message):
        parse_v41_config({**_raw(A), **change})


def test_errors_name_the_file(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**_raw(A), "num_key_value_heads": 2}))
    with pytest.raises(ConfigError, match=r"config\.json: num_key_value_heads"):
        read_model_config(tmp_path)


def test_v4_configs_unchanged():
    cfg = read_model_config(REPO / "configs" / "deepseek-v4-flash.json")
    assert isinstance(cfg, ModelConfig) and cfg.num_layers == 43


def test_the_model_api_refuses_v41_by_name():
    from deepinfer_jax.api.model import load

    with pytest.raises(ConfigError, match="do not take it yet"):
        load(A)
