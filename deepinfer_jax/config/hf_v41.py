"""V41Config from a Hugging Face `config.json` (`deepseek_v41_text`, or the composite
`deepseek_v41` whose text backbone sits under `text_config`).

Derived fields the reference materialises on save (`layer_types`, `rope_parameters`) are checked
against the primary ones rather than trusted; missing source lists get the reference's
defaults (KV sources: the first layer of each run of equal non-zero ratios; index sources: the
KV sources; candidate source: the last KV source). Fields this engine cannot honour are refused
by name.
"""

from __future__ import annotations

from typing import Any

from deepinfer_jax.config.hf_fields import field_value, parse_rope, shared_fields
from deepinfer_jax.config.model import ConfigError
from deepinfer_jax.config.v41 import DSparkConfig, EngramConfig, V41Config

V41_MODEL_TYPES = ("deepseek_v41", "deepseek_v41_text")

_SHARED = "shared_compressed_attention"
_SLIDING = "sliding_attention"


def parse_v41_config(raw: dict[str, Any]) -> V41Config:
    model_type = raw.get("model_type")
    if model_type not in V41_MODEL_TYPES:
        raise ConfigError(f"model_type: expected one of {V41_MODEL_TYPES}, got {model_type!r}")
    if model_type == "deepseek_v41" and isinstance(raw.get("text_config"), dict):
        raw = raw["text_config"]      # the composite config: only the text backbone is served
    _refuse_unsupported(raw)
    n = int(field_value(raw, "num_hidden_layers"))
    head_dim = int(field_value(raw, "head_dim"))
    n_draft = int(field_value(raw, "num_nextn_predict_layers", 0))
    ratios = _parse_ratios(raw, n, n_draft)
    kv_sources = tuple(int(i) for i in raw.get("kv_source_layer_ids") or _default_sources(ratios))
    index_sources = tuple(int(i) for i in raw.get("index_source_layer_ids") or kv_sources)
    candidate = raw.get("candidate_source_layer_id")
    if candidate is None:
        candidate = kv_sources[-1] if kv_sources else None
    elif int(candidate) < 0:
        candidate = None              # the reference's "no two-level top-k"
    rope_theta, compress_theta, yarn = parse_rope(raw)
    cfg = V41Config(
        **shared_fields(raw),
        num_layers=n,
        head_dim=head_dim,
        rope_head_dim=_parse_rope_head_dim(raw, head_dim),
        compress_ratios=ratios,
        kv_source_layer_ids=kv_sources,
        index_source_layer_ids=index_sources,
        candidate_source_layer_id=None if candidate is None else int(candidate),
        candidate_topk_blocks=int(field_value(raw, "candidate_topk_blocks", 2048)),
        candidate_block_size=int(field_value(raw, "candidate_block_size", 8)),
        rope_theta=rope_theta,
        compress_rope_theta=compress_theta,
        compress_yarn=yarn,
        gate_temp=float(field_value(raw, "gate_temp", 1.0)),
        engram=_parse_engram(raw),
        dspark=_parse_dspark(raw, n_draft),
        pad_token_id=raw.get("pad_token_id"),
    )
    _check_layer_types(raw, n, kv_sources)    # after the roles themselves were checked
    return cfg


def _refuse_unsupported(raw: dict) -> None:
    """Fields whose other values the reference defines but this engine does not implement."""
    expected = {"num_key_value_heads": 1, "hidden_act": "silu", "scoring_func": "sqrtsoftplus",
                "topk_method": "noaux_tc"}
    for name, value in expected.items():
        if raw.get(name) is not None and raw[name] != value:
            raise ConfigError(f"{name}: DeepSeek-V4.1 is implemented for {value!r} only, "
                              f"got {raw[name]!r}")
    for flag in ("attention_bias", "mlp_bias"):
        if raw.get(flag):
            raise ConfigError(f"{flag}: DeepSeek-V4.1 has no biases")
    if raw.get("mlp_layer_types") is not None or raw.get("num_hash_layers"):
        raise ConfigError("mlp_layer_types / num_hash_layers: V4.1 has no hash-routed MoE layers")


def _parse_ratios(raw: dict, n: int, n_draft: int) -> tuple[int, ...]:
    ratios = raw.get("compress_ratios")
    if ratios is None:
        raise ConfigError("compress_ratios: required (one ratio per backbone layer)")
    ratios = [int(r) for r in ratios]
    if len(ratios) not in (n, n + n_draft):
        raise ConfigError(f"compress_ratios: has {len(ratios)} entries for {n} layers "
                          f"(+ {n_draft} draft layers)")
    if any(r != 0 for r in ratios[n:]):
        raise ConfigError(f"compress_ratios: the draft-layer entries must be 0 (window-only), "
                          f"got {ratios[n:]}")
    return tuple(ratios[:n])


def _default_sources(ratios: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(i for i, r in enumerate(ratios) if r > 0 and (i == 0 or ratios[i - 1] != r))


def _check_layer_types(raw: dict, n: int, kv_sources: tuple[int, ...]) -> None:
    """`layer_types` is derived (KV sources own a compressed cache layer); it must agree."""
    given = raw.get("layer_types")
    if given is None:
        return
    derived = [_SHARED if i in kv_sources else _SLIDING for i in range(n)]
    if list(given) != derived:
        raise ConfigError(f"layer_types {list(given)} disagree with kv_source_layer_ids "
                          f"{list(kv_sources)} (expected {derived})")


def _parse_rope_head_dim(raw: dict, head_dim: int) -> int:
    found = {}
    if raw.get("qk_rope_head_dim") is not None:
        found["qk_rope_head_dim"] = int(raw["qk_rope_head_dim"])
    params = raw.get("rope_parameters") or {}
    for kind in ("main", "compress"):
        factor = (params.get(kind) or {}).get("partial_rotary_factor")
        if factor is not None:
            found[f"rope_parameters.{kind}.partial_rotary_factor"] = round(head_dim * float(factor))
    if raw.get("partial_rotary_factor") is not None:
        found["partial_rotary_factor"] = round(head_dim * float(raw["partial_rotary_factor"]))
    if len(set(found.values())) > 1:
        raise ConfigError(f"rope dimensions disagree (head_dim {head_dim}): {found}")
    return next(iter(found.values())) if found else 64


def _parse_engram(raw: dict) -> EngramConfig | None:
    layer_ids = tuple(int(i) for i in raw.get("engram_layer_ids") or ())
    if not layer_ids:
        return None
    return EngramConfig(
        layer_ids=layer_ids,
        num_embeddings=tuple(int(r) for r in field_value(raw, "engram_num_embeddings")),
        vocab_size=int(field_value(raw, "engram_vocab_size")),
        max_ngram_size=int(field_value(raw, "engram_max_ngram_size")),
        n_heads=int(field_value(raw, "engram_n_heads")),
        head_dim=int(field_value(raw, "engram_head_dim")),
        pad_id=int(field_value(raw, "engram_pad_id", 2)),
        compressed_vocab_size=int(field_value(raw, "engram_compressed_vocab_size")),
    )


def _parse_dspark(raw: dict, n_draft: int) -> DSparkConfig:
    return DSparkConfig(
        num_layers=n_draft,
        block_size=int(field_value(raw, "dspark_block_size", 5)),
        noise_token_id=int(field_value(raw, "dspark_noise_token_id", 128799)),
        target_layer_ids=tuple(int(i) for i in field_value(raw, "dspark_target_layer_ids", ())),
        markov_rank=int(field_value(raw, "dspark_markov_rank", 256)),
        n_routed_experts=int(field_value(raw, "dspark_n_routed_experts", 128)),
        num_experts_per_tok=int(field_value(raw, "dspark_num_experts_per_tok", 3)),
    )

