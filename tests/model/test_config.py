"""ModelConfig parsing: the release's config, modern and legacy spellings, clear errors."""

from __future__ import annotations

import json

import pytest

from deepinfer_jax.config.hf import parse_hf_config
from deepinfer_jax.config.model import (
    AttentionKind,
    ConfigError,
    MlpKind,
    ScoringFunc,
    YarnConfig,
)
from tests.conftest import REPO

FLASH = json.loads((REPO / "configs" / "deepseek-v4-flash.json").read_text())
LEGACY = json.loads((REPO / "configs" / "tiny" / "tiny-legacy.json").read_text())


def test_v4_flash_release_config():
    cfg = parse_hf_config(FLASH)
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.head_dim) == (43, 4096, 64, 512)
    assert cfg.rope_head_dim == 64 and cfg.nope_head_dim == 448
    # layers 0, 1 window-only; then CSA on even and HCA on odd layers; the MTP entry dropped.
    assert cfg.layer_types[:2] == (AttentionKind.SLIDING,) * 2
    assert all(cfg.layer_types[i] is AttentionKind.CSA for i in range(2, 43, 2))
    assert all(cfg.layer_types[i] is AttentionKind.HCA for i in range(3, 43, 2))
    assert cfg.mlp_types[:3] == (MlpKind.HASH_MOE,) * 3 and set(cfg.mlp_types[3:]) == {MlpKind.MOE}
    assert (cfg.compress_rate_csa, cfg.compress_rate_hca) == (4, 128)
    assert cfg.compress_yarn == YarnConfig(factor=16.0, original_max_position_embeddings=65536,
                                           beta_fast=32.0, beta_slow=1.0)
    assert cfg.scoring_func is ScoringFunc.SQRTSOFTPLUS and cfg.routed_scaling_factor == 1.5
    assert cfg.quantization.weight_block_size == (128, 128)
    assert cfg.num_mtp_layers == 1 and cfg.eos_token_ids == (1,)


def _modern_twin(legacy: dict) -> dict:
    kinds = {0: "sliding_attention", 4: "compressed_sparse_attention",
             128: "heavily_compressed_attention"}
    n = legacy["num_hidden_layers"]
    modern = {k: v for k, v in legacy.items()
              if k not in ("compress_ratios", "num_hash_layers", "qk_rope_head_dim", "rope_scaling")}
    modern["layer_types"] = [kinds[r] for r in legacy["compress_ratios"][:n]]
    modern["mlp_layer_types"] = ["hash_moe" if i < legacy["num_hash_layers"] else "moe"
                                 for i in range(n)]
    modern["partial_rotary_factor"] = legacy["qk_rope_head_dim"] / legacy["head_dim"]
    yarn = {**legacy["rope_scaling"], "rope_type": "yarn", "rope_theta": legacy["compress_rope_theta"]}
    modern["rope_parameters"] = {"main": {"rope_type": "default", "rope_theta": legacy["rope_theta"]},
                                 "compress": yarn}
    return modern


def test_legacy_and_modern_spellings_agree():
    assert parse_hf_config(LEGACY) == parse_hf_config(_modern_twin(LEGACY))


def test_flat_rope_parameters_as_saved_by_older_transformers():
    flat = {k: v for k, v in LEGACY.items() if k != "rope_scaling"}
    flat["rope_parameters"] = {**LEGACY["rope_scaling"], "rope_type": "yarn"}
    assert parse_hf_config(flat) == parse_hf_config(LEGACY)


@pytest.mark.parametrize("change, field", [
    ({"model_type": "deepseek_v3"}, "model_type"),
    ({"layer_types": ["sliding_attention"] * 4}, "layer_types"),           # vs compress_ratios
    ({"compress_ratios": [0, 4, 64, 4, 0]}, "compress_ratios"),
    ({"mlp_layer_types": ["moe"] * 4}, "num_hash_layers"),                  # vs num_hash_layers=1
    ({"partial_rotary_factor": 0.25}, "qk_rope_head_dim"),                  # 8 vs 16
    ({"qk_rope_head_dim": 15}, "qk_rope_head_dim"),
    ({"o_groups": 3}, "o_groups"),
    ({"num_key_value_heads": 2}, "num_key_value_heads"),
    ({"scoring_func": "relu"}, "scoring_func"),
    ({"rope_scaling": {"type": "longrope", "factor": 2}}, "rope_type"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
    ({"num_hidden_layers": 6}, "compress_ratios"),
])
def test_bad_configs_name_the_field(change, field):
    with pytest.raises(ConfigError, match=field):
        parse_hf_config({**LEGACY, **change})


def test_missing_required_field_is_named():
    broken = {k: v for k, v in LEGACY.items() if k != "index_topk"}
    with pytest.raises(ConfigError, match="index_topk"):
        parse_hf_config(broken)


def test_config_is_hashable_and_frozen():
    cfg = parse_hf_config(LEGACY)
    assert hash(cfg) == hash(parse_hf_config(LEGACY))
    with pytest.raises(Exception):
        cfg.hidden_size = 1
