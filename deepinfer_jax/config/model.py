"""Frozen model configuration of the DeepSeek-V4 family (`model_type: deepseek_v4`), with its
checks. Reading and writing Hugging Face `config.json` spellings: config/hf.py
(`read_model_config`, `parse_hf_config`, `to_hf_dict`).
"""

from __future__ import annotations

import dataclasses
import enum


class ConfigError(ValueError):
    """A config.json that does not describe a DeepSeek-V4 model this engine can run."""


class AttentionKind(enum.Enum):
    SLIDING = "sliding_attention"                  # raw window only
    CSA = "compressed_sparse_attention"            # window + overlapped ratio-m rows picked by the indexer
    HCA = "heavily_compressed_attention"           # window + all ratio-m' rows


class MlpKind(enum.Enum):
    HASH_MOE = "hash_moe"     # experts chosen by a frozen token-id table (tid2eid)
    MOE = "moe"               # experts chosen by top-k of score + selection bias


class ScoringFunc(enum.Enum):
    SQRTSOFTPLUS = "sqrtsoftplus"
    SOFTMAX = "softmax"
    SIGMOID = "sigmoid"


@dataclasses.dataclass(frozen=True)
class YarnConfig:
    """YaRN frequency interpolation, applied to the "compress" RoPE only (no attention mscale)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True

    def __post_init__(self):
        if self.factor <= 0:
            raise ConfigError(f"rope_scaling.factor must be > 0, got {self.factor}")
        if self.original_max_position_embeddings <= 0:
            raise ConfigError("rope_scaling.original_max_position_embeddings must be > 0")


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    """The release's FP8 block-quantisation settings (weights are dequantised on load)."""

    fmt: str = "e4m3"
    scale_fmt: str = "ue8m0"
    weight_block_size: tuple[int, int] = (128, 128)


def need(cond: bool, field: str, why: str) -> None:
    if not cond:
        raise ConfigError(f"{field}: {why}")


def check_shared_fields(cfg, positive: tuple[str, ...] = ()) -> None:
    """The checks of the fields ModelConfig and V4.1's V41Config share (plus `positive`, more
    fields that must be > 0)."""
    for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "head_dim",
                 "q_lora_rank", "o_groups", "o_lora_rank", "sliding_window", "hc_mult",
                 "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
                 "index_n_heads", "index_head_dim", "index_topk") + positive:
        need(getattr(cfg, name) > 0, name, f"must be > 0, got {getattr(cfg, name)}")
    need(0 < cfg.rope_head_dim <= cfg.head_dim and cfg.rope_head_dim % 2 == 0,
         "qk_rope_head_dim", f"must be even and in (0, head_dim={cfg.head_dim}], "
         f"got {cfg.rope_head_dim}")
    need(cfg.index_head_dim >= cfg.rope_head_dim, "index_head_dim",
         f"must be >= qk_rope_head_dim={cfg.rope_head_dim} (the indexer ropes that slice)")
    need((cfg.num_heads * cfg.head_dim) % cfg.o_groups == 0, "o_groups",
         f"must divide num_attention_heads * head_dim = {cfg.num_heads * cfg.head_dim}")
    need(cfg.num_heads % cfg.o_groups == 0, "o_groups",
         f"must divide num_attention_heads={cfg.num_heads}")
    need(cfg.num_experts_per_tok <= cfg.n_routed_experts, "num_experts_per_tok",
         f"{cfg.num_experts_per_tok} > n_routed_experts={cfg.n_routed_experts}")
    need(cfg.n_shared_experts >= 0, "n_shared_experts", "must be >= 0")
    need(cfg.hc_sinkhorn_iters >= 1, "hc_sinkhorn_iters", "must be >= 1")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    head_dim: int
    rope_head_dim: int                    # RoPE on the last `rope_head_dim` channels of each head
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    layer_types: tuple[AttentionKind, ...]
    mlp_types: tuple[MlpKind, ...]
    compress_rate_csa: int
    compress_rate_hca: int
    rope_theta: float                     # "main" rope: sliding-only layers and the MTP block
    compress_rope_theta: float            # "compress" rope: CSA/HCA layers, their compressors, indexer
    compress_yarn: YarnConfig | None
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    scoring_func: ScoringFunc
    norm_topk_prob: bool
    routed_scaling_factor: float
    swiglu_limit: float
    rms_norm_eps: float
    max_position_embeddings: int
    num_mtp_layers: int = 1
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 0
    eos_token_ids: tuple[int, ...] = (1,)
    quantization: QuantConfig | None = None

    def __post_init__(self):
        check_shared_fields(self, ("compress_rate_csa", "compress_rate_hca"))
        need(len(self.layer_types) == self.num_layers, "layer_types",
             f"has {len(self.layer_types)} entries for num_hidden_layers={self.num_layers}")
        need(len(self.mlp_types) == self.num_layers, "mlp_layer_types",
             f"has {len(self.mlp_types)} entries for num_hidden_layers={self.num_layers}")
        need(self.num_mtp_layers >= 0, "num_nextn_predict_layers", "must be >= 0")

    # ---- derived values -------------------------------------------------------------------
    @property
    def nope_head_dim(self) -> int:
        return self.head_dim - self.rope_head_dim

    def compress_rate(self, kind: AttentionKind) -> int:
        """Tokens per compressed row (0 for sliding-only layers)."""
        return {AttentionKind.SLIDING: 0, AttentionKind.CSA: self.compress_rate_csa,
                AttentionKind.HCA: self.compress_rate_hca}[kind]

    @property
    def shared_intermediate_size(self) -> int:
        return self.n_shared_experts * self.moe_intermediate_size

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)
