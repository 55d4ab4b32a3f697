"""ModelConfig from and to Hugging Face `config.json` (model_type: deepseek_v4).

Two spellings of the same architecture exist in the wild and both are accepted:

* modern (transformers >= 5.x): `layer_types`, `mlp_layer_types`, `compress_rates`,
  `rope_parameters = {"main": {...}, "compress": {...}}`, `partial_rotary_factor`;
* the release's legacy fields: `compress_ratios` (one 0/4/128 per layer, plus the MTP block),
  `num_hash_layers`, `qk_rope_head_dim`, `rope_scaling` (YaRN, applied to compressed layers).

When both spellings are present they must agree; a disagreement names the fields. Writing uses
the modern spelling.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from deepinfer_jax.config.hf_fields import field_value, parse_rope, shared_fields
from deepinfer_jax.config.hf_v41 import V41_MODEL_TYPES, parse_v41_config
from deepinfer_jax.config.model import (
    AttentionKind,
    ConfigError,
    MlpKind,
    ModelConfig,
    ScoringFunc,
)
from deepinfer_jax.config.v41 import V41Config


# ---- writing ------------------------------------------------------------------------------
def to_hf_dict(cfg: ModelConfig) -> dict[str, Any]:
    """The modern transformers spelling (what `save_pretrained` writes)."""
    compress = {"rope_type": "default", "rope_theta": cfg.compress_rope_theta}
    if cfg.compress_yarn is not None:
        y = cfg.compress_yarn
        compress = {**compress, "rope_type": "yarn", "factor": y.factor,
                    "original_max_position_embeddings": y.original_max_position_embeddings,
                    "beta_fast": y.beta_fast, "beta_slow": y.beta_slow,
                    "truncate": y.truncate, "attention_factor": 1.0}
    out = {
        "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": 1, "head_dim": cfg.head_dim,
        "partial_rotary_factor": cfg.rope_head_dim / cfg.head_dim,
        "q_lora_rank": cfg.q_lora_rank, "o_groups": cfg.o_groups,
        "o_lora_rank": cfg.o_lora_rank, "sliding_window": cfg.sliding_window,
        "layer_types": [k.value for k in cfg.layer_types],
        "mlp_layer_types": [k.value for k in cfg.mlp_types],
        "compress_rates": {AttentionKind.CSA.value: cfg.compress_rate_csa,
                           AttentionKind.HCA.value: cfg.compress_rate_hca},
        "rope_theta": cfg.rope_theta, "compress_rope_theta": cfg.compress_rope_theta,
        "rope_parameters": {"main": {"rope_type": "default", "rope_theta": cfg.rope_theta},
                            "compress": compress},
        "index_n_heads": cfg.index_n_heads, "index_head_dim": cfg.index_head_dim,
        "index_topk": cfg.index_topk, "hc_mult": cfg.hc_mult,
        "hc_sinkhorn_iters": cfg.hc_sinkhorn_iters, "hc_eps": cfg.hc_eps,
        "n_routed_experts": cfg.n_routed_experts, "n_shared_experts": cfg.n_shared_experts,
        "num_experts_per_tok": cfg.num_experts_per_tok,
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "scoring_func": cfg.scoring_func.value, "norm_topk_prob": cfg.norm_topk_prob,
        "routed_scaling_factor": cfg.routed_scaling_factor, "swiglu_limit": cfg.swiglu_limit,
        "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": cfg.max_position_embeddings,
        "num_nextn_predict_layers": cfg.num_mtp_layers,
        "tie_word_embeddings": cfg.tie_word_embeddings, "bos_token_id": cfg.bos_token_id,
        "eos_token_id": list(cfg.eos_token_ids) if len(cfg.eos_token_ids) != 1
        else cfg.eos_token_ids[0],
    }
    if cfg.quantization is not None:
        q = cfg.quantization
        out["quantization_config"] = {"quant_method": "fp8", "fmt": q.fmt,
                                      "scale_fmt": q.scale_fmt,
                                      "weight_block_size": list(q.weight_block_size)}
    return out


# ---- parsing ------------------------------------------------------------------------------
_RATIO_TO_KIND = {0: AttentionKind.SLIDING, 4: AttentionKind.CSA, 128: AttentionKind.HCA}
_DEFAULT_RATES = {AttentionKind.CSA: 4, AttentionKind.HCA: 128}




def parse_hf_config(raw: dict[str, Any]) -> ModelConfig:
    model_type = raw.get("model_type")
    if model_type != "deepseek_v4":
        raise ConfigError(f"model_type: expected 'deepseek_v4', got {model_type!r}")
    n = int(field_value(raw, "num_hidden_layers"))
    head_dim = int(field_value(raw, "head_dim"))
    if int(raw.get("num_key_value_heads", 1)) != 1:
        raise ConfigError("num_key_value_heads: DeepSeek-V4 shares one K=V head; got "
                          f"{raw['num_key_value_heads']}")
    if raw.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"hidden_act: only 'silu' is supported, got {raw['hidden_act']!r}")
    for flag in ("attention_bias", "mlp_bias"):
        if raw.get(flag):
            raise ConfigError(f"{flag}: DeepSeek-V4 has no biases")

    rates = _parse_compress_rates(raw)
    layer_types = _parse_layer_types(raw, n, rates)
    mlp_types = _parse_mlp_types(raw, n)
    rope_head_dim = _parse_rope_head_dim(raw, head_dim)
    rope_theta, compress_theta, yarn = parse_rope(raw)
    try:
        scoring = ScoringFunc(raw.get("scoring_func", "sqrtsoftplus"))
    except ValueError:
        raise ConfigError(f"scoring_func: expected one of {[s.value for s in ScoringFunc]}, "
                          f"got {raw.get('scoring_func')!r}") from None

    return ModelConfig(
        **shared_fields(raw),
        num_layers=n,
        head_dim=head_dim,
        rope_head_dim=rope_head_dim,
        layer_types=layer_types,
        mlp_types=mlp_types,
        compress_rate_csa=rates[AttentionKind.CSA],
        compress_rate_hca=rates[AttentionKind.HCA],
        rope_theta=rope_theta,
        compress_rope_theta=compress_theta,
        compress_yarn=yarn,
        scoring_func=scoring,
        num_mtp_layers=int(field_value(raw, "num_nextn_predict_layers", 0)),
    )




def _parse_compress_rates(raw: dict) -> dict[AttentionKind, int]:
    rates = dict(_DEFAULT_RATES)
    modern = raw.get("compress_rates")
    if modern is not None:
        if not isinstance(modern, dict):
            raise ConfigError("compress_rates: expected a mapping from layer type to rate")
        for key, value in modern.items():
            try:
                rates[AttentionKind(key)] = int(value)
            except ValueError:
                raise ConfigError(f"compress_rates: unknown layer type {key!r}") from None
    for legacy, kind in (("compress_rate_csa", AttentionKind.CSA),
                         ("compress_rate_hca", AttentionKind.HCA)):
        if raw.get(legacy) is not None:
            rates[kind] = int(raw[legacy])
    return rates


def _parse_layer_types(raw: dict, n: int, rates) -> tuple[AttentionKind, ...]:
    modern = raw.get("layer_types")
    legacy = raw.get("compress_ratios")
    from_modern = from_legacy = None
    if modern is not None:
        try:
            from_modern = tuple(AttentionKind(t) for t in modern[:n])
        except ValueError as e:
            raise ConfigError(f"layer_types: {e}") from None
        if len(modern) != n:
            raise ConfigError(f"layer_types: has {len(modern)} entries for num_hidden_layers={n}")
    if legacy is not None:
        # The release lists one ratio per layer plus one per MTP block (window-only).
        if len(legacy) < n:
            raise ConfigError(f"compress_ratios: has {len(legacy)} entries for {n} layers")
        bad = [r for r in legacy if r not in _RATIO_TO_KIND]
        if bad:
            raise ConfigError(f"compress_ratios: entries must be 0, 4 or 128, got {bad}")
        from_legacy = tuple(_RATIO_TO_KIND[r] for r in legacy[:n])
        if any(r != 0 for r in legacy[n:]):
            raise ConfigError("compress_ratios: the MTP entries must be 0 (window-only)")
    if from_modern is not None and from_legacy is not None and from_modern != from_legacy:
        raise ConfigError("layer_types and compress_ratios disagree: "
                          f"{[k.value for k in from_modern]} vs {legacy[:n]}")
    if from_modern is not None:
        return from_modern
    if from_legacy is not None:
        for kind in set(from_legacy) - {AttentionKind.SLIDING}:
            if rates[kind] != _DEFAULT_RATES[kind]:
                # A legacy ratio list names the ratio itself; a custom rate would silently change it.
                raise ConfigError(f"compress_ratios and compress_rates disagree for {kind.value}")
        return from_legacy
    raise ConfigError("layer_types: required (or the legacy compress_ratios)")


def _parse_mlp_types(raw: dict, n: int) -> tuple[MlpKind, ...]:
    modern = raw.get("mlp_layer_types")
    legacy = raw.get("num_hash_layers")
    from_legacy = None
    if legacy is not None:
        h = int(legacy)
        from_legacy = tuple(MlpKind.HASH_MOE if i < h else MlpKind.MOE for i in range(n))
    if modern is not None:
        if len(modern) != n:
            raise ConfigError(f"mlp_layer_types: has {len(modern)} entries for num_hidden_layers={n}")
        try:
            types = tuple(MlpKind(t) for t in modern)
        except ValueError as e:
            raise ConfigError(f"mlp_layer_types: {e}") from None
        if from_legacy is not None and types != from_legacy:
            raise ConfigError(f"mlp_layer_types and num_hash_layers={legacy} disagree")
        return types
    if from_legacy is not None:
        return from_legacy
    # transformers' default: three hash layers, then routed MoE.
    return tuple(MlpKind.HASH_MOE if i < 3 else MlpKind.MOE for i in range(n))


def _parse_rope_head_dim(raw: dict, head_dim: int) -> int:
    legacy = raw.get("qk_rope_head_dim")
    factor = raw.get("partial_rotary_factor")
    from_factor = None if factor is None else int(head_dim * float(factor))
    if legacy is not None and from_factor is not None and int(legacy) != from_factor:
        raise ConfigError(f"qk_rope_head_dim={legacy} and partial_rotary_factor={factor} "
                          f"(x head_dim {head_dim} = {from_factor}) disagree")
    if legacy is not None:
        return int(legacy)
    if from_factor is not None:
        return from_factor
    return 64  # transformers' default: 64 of 512








def read_model_config(path: str | Path) -> ModelConfig | V41Config:
    """A checkpoint directory's config.json (or that file itself) -> ModelConfig, or a
    V41Config for `deepseek_v41` / `deepseek_v41_text` (config/hf_v41.py)."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"no config.json at {path}") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON at line {e.lineno}, column {e.colno}: "
                          f"{e.msg}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text (byte {e.start}): expected a JSON "
                          f"object") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a JSON object, got {type(raw).__name__}")
    try:
        if raw.get("model_type") in V41_MODEL_TYPES:
            return parse_v41_config(raw)
        return parse_hf_config(raw)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None
    except (TypeError, ValueError, KeyError) as e:   # a field of the wrong type or form
        raise ConfigError(f"{path}: {type(e).__name__}: {e}") from None


def read_served_model_config(path: str | Path) -> ModelConfig:
    """read_model_config for the `Model` API and the V4-only commands (`deepinfer plan`,
    `convert`): a V4.1 config is refused by name rather than failing later on a missing field.
    The engine (`LLM`) reads either family with read_model_config."""
    cfg = read_model_config(path)
    if isinstance(cfg, V41Config):
        raise ConfigError(f"{path}: DeepSeek-V4.1 is served by the engine (LLM(path)) and has a "
                          f"cache-free reference forward (deepinfer_jax.load_v41), but the "
                          f"Model API and this command do not take it yet (issue 36)")
    return cfg
