"""Frozen model configuration of DeepSeek-V4.1 (`model_type: deepseek_v41` / `deepseek_v41_text`).

A separate dataclass, not an extension of `ModelConfig`: V4.1 is a different network (per-layer
compress ratios 0 / 1 / 2 / 4 with KV shared from a few source layers, a two-level indexer,
Engram memory, no hash-routed layers, no overlapped CSA / HCA compressors, single-pass mHC), so
most of ModelConfig's fields (layer kinds, CSA / HCA rates, MLP kinds) have no meaning here and a
subclass would carry them as traps. What V4.1 shares with V4 (YaRN, the FP8 storage format) is
reused as the same small frozen types. Parsing config.json: config/hf_v41.py.

Layer roles (`layer_role`), from `compress_ratios`, `kv_source_layer_ids`,
`index_source_layer_ids`, `candidate_source_layer_id`:
* ratio 0: window-only;
* a KV source owns the compressor of its group (the layers after it, up to the next source, with
  the same ratio, attend its compressed entries);
* an index source runs the indexer (a KV source's indexer also makes the keys; a later one
  "reindexes" against its group's keys); other compressed layers reuse the latest selection;
* the candidate source also publishes the block mask every later index source scores inside.
"""

from __future__ import annotations

import dataclasses

from deepinfer_jax.config.model import (
    ConfigError,
    QuantConfig,
    YarnConfig,
    check_shared_fields,
    need,
)


@dataclasses.dataclass(frozen=True)
class EngramConfig:
    """Hashed n-gram memory on `layer_ids` (section 6 of the architecture notes)."""

    layer_ids: tuple[int, ...]
    num_embeddings: tuple[int, ...]      # table rows per engram layer (the sum of its 24 primes)
    vocab_size: int                      # primes are drawn above vocab_size - 1
    max_ngram_size: int                  # n-grams 2..max_ngram_size are hashed
    n_heads: int
    head_dim: int
    pad_id: int                          # token whose compressed id stands in past a DEAD token
    compressed_vocab_size: int           # size of the tokenizer-derived token map's image

    def __post_init__(self):
        def need(cond: bool, field: str, why: str):
            if not cond:
                raise ConfigError(f"engram_{field}: {why}")

        need(len(self.num_embeddings) == len(self.layer_ids), "num_embeddings",
             f"has {len(self.num_embeddings)} entries for {len(self.layer_ids)} engram layers")
        need(len(set(self.layer_ids)) == len(self.layer_ids), "layer_ids",
             f"repeats a layer: {list(self.layer_ids)}")
        need(self.max_ngram_size >= 2, "max_ngram_size", f"must be >= 2, got {self.max_ngram_size}")
        for name in ("vocab_size", "n_heads", "head_dim", "compressed_vocab_size"):
            need(getattr(self, name) > 0, name, f"must be > 0, got {getattr(self, name)}")

    @property
    def n_columns(self) -> int:
        """Rows gathered per token and layer: one per (n-gram size, head)."""
        return (self.max_ngram_size - 1) * self.n_heads


@dataclasses.dataclass(frozen=True)
class DSparkConfig:
    """The DSpark drafter's config fields, parsed and checked only: no public reference code
    implements the drafter (its `mtp.*` tensors are ignored)."""

    num_layers: int                      # num_nextn_predict_layers
    block_size: int
    noise_token_id: int
    target_layer_ids: tuple[int, ...]
    markov_rank: int
    n_routed_experts: int
    num_experts_per_tok: int

    def __post_init__(self):
        for name in ("block_size", "markov_rank", "n_routed_experts", "num_experts_per_tok"):
            need(getattr(self, name) > 0, f"dspark_{name}", f"must be > 0, got {getattr(self, name)}")
        need(self.num_layers >= 0, "num_nextn_predict_layers", "must be >= 0")
        need(self.num_experts_per_tok <= self.n_routed_experts, "dspark_num_experts_per_tok",
             f"{self.num_experts_per_tok} > dspark_n_routed_experts={self.n_routed_experts}")


@dataclasses.dataclass(frozen=True)
class V41Config:
    vocab_size: int
    hidden_size: int
    num_layers: int                      # backbone layers (the drafter's are not counted)
    num_heads: int
    head_dim: int
    rope_head_dim: int                   # RoPE on the last `rope_head_dim` channels
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    compress_ratios: tuple[int, ...]     # per backbone layer: 0 window-only, else tokens per entry
    kv_source_layer_ids: tuple[int, ...]
    index_source_layer_ids: tuple[int, ...]
    candidate_source_layer_id: int | None
    candidate_topk_blocks: int
    candidate_block_size: int
    rope_theta: float                    # "main" rope: window-only layers
    compress_rope_theta: float           # "compress" rope: compressed layers, compressor, indexer
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
    gate_temp: float
    norm_topk_prob: bool
    routed_scaling_factor: float
    swiglu_limit: float
    rms_norm_eps: float
    max_position_embeddings: int
    engram: EngramConfig | None
    dspark: DSparkConfig
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = (1,)
    pad_token_id: int | None = None
    quantization: QuantConfig | None = None

    def __post_init__(self):
        n = self.num_layers
        check_shared_fields(self, ("candidate_topk_blocks", "candidate_block_size"))
        need(len(self.compress_ratios) == n, "compress_ratios",
             f"has {len(self.compress_ratios)} backbone entries for num_hidden_layers={n}")
        need(all(r >= 0 for r in self.compress_ratios), "compress_ratios",
             f"entries must be >= 0, got {list(self.compress_ratios)}")
        need(self.gate_temp > 0, "gate_temp", f"must be > 0, got {self.gate_temp}")
        self._check_sources()
        if self.engram is not None:
            bad = [i for i in self.engram.layer_ids if not 0 <= i < n]
            need(not bad, "engram_layer_ids", f"{bad} outside the {n} backbone layers")
        bad = [i for i in self.dspark.target_layer_ids if not 0 <= i < n]
        need(not bad, "dspark_target_layer_ids", f"{bad} outside the {n} backbone layers")

    def _check_sources(self):
        n, ratios = self.num_layers, self.compress_ratios
        for field in ("kv_source_layer_ids", "index_source_layer_ids"):
            ids = getattr(self, field)
            need(list(ids) == sorted(set(ids)), field, f"must be increasing, got {list(ids)}")
            bad = [i for i in ids if not (0 <= i < n and ratios[i] > 0)]
            need(not bad, field, f"{bad} are not compressed backbone layers "
                 f"(compress_ratios {list(ratios)})")
        for i in range(n):
            if ratios[i] > 0:
                src = self.kv_source(i)
                need(src is not None and ratios[src] == ratios[i], "kv_source_layer_ids",
                     f"layer {i} (ratio {ratios[i]}) has no KV source of its ratio at or before it")
        for i in self.index_source_layer_ids:
            need(self.kv_source(i) in self.index_source_layer_ids, "index_source_layer_ids",
                 f"layer {i}'s KV source {self.kv_source(i)} must be an index source too "
                 f"(only it can make the indexer keys)")
        c = self.candidate_source_layer_id
        if c is not None:
            need(c in self.index_source_layer_ids, "candidate_source_layer_id",
                 f"{c} is not an index source {list(self.index_source_layer_ids)}")

    # ---- derived values -------------------------------------------------------------------
    def kv_source(self, layer: int) -> int | None:
        """The KV source whose compressed entries `layer` attends (None: window-only)."""
        if self.compress_ratios[layer] == 0:
            return None
        earlier = [s for s in self.kv_source_layer_ids if s <= layer]
        return earlier[-1] if earlier else None

    def is_kv_source(self, layer: int) -> bool:
        return layer in self.kv_source_layer_ids

    def is_index_source(self, layer: int) -> bool:
        return layer in self.index_source_layer_ids

    def uses_candidates(self, layer: int) -> bool:
        """An index source after the candidate source scores only inside its blocks."""
        c = self.candidate_source_layer_id
        return self.is_index_source(layer) and c is not None and c < layer

    def has_engram(self, layer: int) -> bool:
        return self.engram is not None and layer in self.engram.layer_ids

    @property
    def fp8_block(self) -> tuple[int, int]:
        """The (out, in) tile of one FP8 weight scale: the config's `weight_block_size`, else
        the release's 32 x 32 (the architecture notes, section 8; V4's is 128 x 128)."""
        return self.quantization.weight_block_size if self.quantization else (32, 32)

    @property
    def shared_intermediate_size(self) -> int:
        return self.n_shared_experts * self.moe_intermediate_size

    def replace(self, **changes) -> "V41Config":
        return dataclasses.replace(self, **changes)
