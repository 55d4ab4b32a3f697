"""Hugging Face `config.json` fields that DeepSeek-V4 (config/hf.py) and V4.1 (config/hf_v41.py)
spell alike: required / defaulted lookups, the fields both configs share, the two ropes (with
the compressed branch's YaRN) and the FP8 quantization block."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from deepinfer_jax.config.model import ConfigError, QuantConfig, YarnConfig


def field_value(raw: dict, name: str, default=dataclasses.MISSING):
    if name in raw and raw[name] is not None:
        return raw[name]
    if default is dataclasses.MISSING:
        raise ConfigError(f"{name}: required field is missing")
    return default


def shared_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """The fields V4's ModelConfig and V4.1's V41Config share, spelled and defaulted alike."""
    eos = raw.get("eos_token_id", 1)
    return dict(
        vocab_size=int(field_value(raw, "vocab_size")),
        hidden_size=int(field_value(raw, "hidden_size")),
        num_heads=int(field_value(raw, "num_attention_heads")),
        q_lora_rank=int(field_value(raw, "q_lora_rank")),
        o_groups=int(field_value(raw, "o_groups")),
        o_lora_rank=int(field_value(raw, "o_lora_rank")),
        sliding_window=int(field_value(raw, "sliding_window")),
        index_n_heads=int(field_value(raw, "index_n_heads")),
        index_head_dim=int(field_value(raw, "index_head_dim")),
        index_topk=int(field_value(raw, "index_topk")),
        hc_mult=int(field_value(raw, "hc_mult", 4)),
        hc_sinkhorn_iters=int(field_value(raw, "hc_sinkhorn_iters", 20)),
        hc_eps=float(field_value(raw, "hc_eps", 1e-6)),
        n_routed_experts=int(field_value(raw, "n_routed_experts")),
        n_shared_experts=int(field_value(raw, "n_shared_experts", 1)),
        num_experts_per_tok=int(field_value(raw, "num_experts_per_tok")),
        moe_intermediate_size=int(field_value(raw, "moe_intermediate_size")),
        norm_topk_prob=bool(field_value(raw, "norm_topk_prob", True)),
        routed_scaling_factor=float(field_value(raw, "routed_scaling_factor", 1.0)),
        swiglu_limit=float(field_value(raw, "swiglu_limit", 0.0)),
        rms_norm_eps=float(field_value(raw, "rms_norm_eps", 1e-6)),
        max_position_embeddings=int(field_value(raw, "max_position_embeddings")),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=(tuple(eos) if isinstance(eos, list)
                       else () if eos is None else (int(eos),)),
        quantization=parse_quant(raw.get("quantization_config")),
    )


def parse_rope(raw: dict) -> tuple[float, float, YarnConfig | None]:
    rope_theta = float(raw.get("rope_theta", 10000.0))
    compress_theta = float(raw.get("compress_rope_theta", 160000.0))
    params = raw.get("rope_parameters") or {}
    if isinstance(params.get("main"), dict) and isinstance(params.get("compress"), dict):
        rope_theta = float(params["main"].get("rope_theta", rope_theta))
        main_type = params["main"].get("rope_type", params["main"].get("type", "default"))
        if main_type != "default":
            raise ConfigError(f"rope_parameters.main.rope_type: only 'default', got {main_type!r}")
        compress = params["compress"]
        compress_theta = float(compress.get("rope_theta", compress_theta))
    else:
        compress = params
    legacy = raw.get("rope_scaling")
    yarn_modern = parse_yarn(compress, "rope_parameters.compress", raw)
    yarn_legacy = parse_yarn(legacy or {}, "rope_scaling", raw)
    if yarn_modern and yarn_legacy and yarn_modern != yarn_legacy:
        raise ConfigError("rope_parameters.compress and rope_scaling disagree")
    return rope_theta, compress_theta, yarn_modern or yarn_legacy


def parse_yarn(d: dict, where: str, raw: dict) -> YarnConfig | None:
    rope_type = d.get("rope_type", d.get("type", "default"))
    if rope_type in ("default", None):
        return None
    if rope_type != "yarn":
        raise ConfigError(f"{where}.rope_type: only 'default' or 'yarn', got {rope_type!r}")
    attention_factor = d.get("attention_factor", 1.0)
    if attention_factor is not None and not math.isclose(float(attention_factor), 1.0):
        raise ConfigError(f"{where}.attention_factor: V4 uses no YaRN mscale, got {attention_factor}")
    original = d.get("original_max_position_embeddings", raw.get("max_position_embeddings"))
    factor = d.get("factor")
    if factor is None:
        factor = raw["max_position_embeddings"] / original
    return YarnConfig(
        factor=float(factor),
        original_max_position_embeddings=int(original),
        beta_fast=float(d.get("beta_fast") or 32.0),
        beta_slow=float(d.get("beta_slow") or 1.0),
        truncate=bool(d.get("truncate", True)),
    )


def parse_quant(q: dict | None) -> QuantConfig | None:
    if not q:
        return None
    method = q.get("quant_method", "fp8")
    if method != "fp8":
        raise ConfigError(f"quantization_config.quant_method: only 'fp8', got {method!r}")
    block = tuple(q.get("weight_block_size", (128, 128)))
    if len(block) != 2:
        raise ConfigError(f"quantization_config.weight_block_size: expected 2 ints, got {block}")
    return QuantConfig(fmt=q.get("fmt", "e4m3"), scale_fmt=q.get("scale_fmt", "ue8m0"),
                       weight_block_size=(int(block[0]), int(block[1])))
