"""The model families the engine serves (DeepSeek-V4, DeepSeek-V4.1) and the pure-Python facts
its options and memory plan need about each: the compress rates a page must hold whole, what
the paged state costs, the Engram row ids a plan carries, and the engine features not built
for the family yet (refused at start-up by name, never run half-way). The device side of the
same table (state init, forward, logits) is `model/family.py`. No jax.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from deepinfer_jax.config import memory, memory_v41
from deepinfer_jax.config.model import ModelConfig
from deepinfer_jax.config.step import StepConfig
from deepinfer_jax.config.v41 import V41Config

_F32 = 4


@dataclasses.dataclass(frozen=True)
class FamilyFacts:
    name: str                                                   # as errors name it
    config_type: type
    page_rates: Callable[[Any], tuple[int, ...]]                # compress rates (> 0) in use
    page_bytes: Callable[[Any, int, int], int]                  # (cfg, page_size, dtype bytes)
    fixed_cache_bytes: Callable[[Any, StepConfig, int], int]    # slots (+ snapshots)
    activation_estimate: Callable[[Any, StepConfig], int]
    engram_shape: Callable[[Any], tuple[int, int]]              # (L_e, C) per plan token
    # why this model cannot draft for speculative decoding, None when it has an MTP block
    no_mtp_reason: Callable[[Any], str | None]


def _v4_rates(cfg: ModelConfig) -> tuple[int, ...]:
    return tuple(sorted({cfg.compress_rate(k) for k in cfg.layer_types} - {0}))


def _v41_fixed_cache_bytes(cfg: V41Config, step_cfg: StepConfig, dtype_bytes: int) -> int:
    # the open-group tails are float32 whatever the compute dtype (model/family.py); the
    # prefix cache's snapshots hold the same rings (device/snapshots.py), none with a bounded
    # replay (device/snapshot_layout.live_rings)
    snapshot = (0 if step_cfg.bounded_replay
                else memory_v41.v41_snapshot_bytes(cfg, step_cfg.spec_tokens))
    return (step_cfg.max_num_seqs * memory_v41.v41_slot_bytes(cfg, step_cfg.spec_tokens)
            + step_cfg.num_snapshots * snapshot)


def _v41_activation_estimate(cfg: V41Config, step_cfg: StepConfig) -> int:
    """As V4's (config/memory.py activation_estimate), with V4.1's terms: per token the mHC
    streams, queries and output, the window and top-k entries gathered (f32, decoded from
    their FP8 / FP4 codes), attention logits, the indexer's scores over every entry, the routed
    experts and the Engram rows (f32); per sampled row the sampler's vocabulary rows; and with
    host tables the plan's gathered rows, an input of the step."""
    t = max(step_cfg.token_buckets)
    n = step_cfg.seq_bucket(t)
    hd, keys = cfg.head_dim, cfg.sliding_window + cfg.index_topk
    rates = [r for r in cfg.compress_ratios if r > 0] or [1]
    engram = 0 if cfg.engram is None else cfg.engram.n_columns * cfg.engram.head_dim
    per_token = (3 * cfg.hc_mult * cfg.hidden_size + 2 * cfg.num_heads * hd + keys * hd
                 + cfg.num_heads * keys + cfg.index_n_heads * step_cfg.max_model_len // min(rates)
                 + cfg.num_experts_per_tok * (3 * cfg.moe_intermediate_size + cfg.hidden_size)
                 + engram) * _F32
    return (t * per_token + n * 3 * cfg.vocab_size * _F32
            + memory_v41.engram_rows_bytes(step_cfg))


def _v4_no_mtp_reason(cfg: ModelConfig) -> str | None:
    return None if cfg.num_mtp_layers > 0 else (
        "speculative decoding with MTP needs a model with an MTP block "
        "(num_nextn_predict_layers > 0)")


def _v41_no_mtp_reason(cfg: V41Config) -> str:
    """V4.1 has no V4-style MTP block to reuse: its `num_nextn_predict_layers` draft layers
    are the DSpark drafter, which transformers' main-branch V4.1 describes only by config
    fields (configuration_deepseek_v41.py: "DSpark: MTP-style draft layers with Markov and
    confidence heads, semi-autoregressive block drafting"; the drafter reads the attention
    input, the mean over the hc streams, of `dspark_target_layer_ids`, fills a block's
    non-anchor positions with `dspark_noise_token_id`, and has its own MoE of
    `dspark_n_routed_experts`), and whose `mtp.*` tensors that implementation ignores on load
    (`_keys_to_ignore_on_load_unexpected`; the oracle README's "Not included: DSpark
    drafter"). No public code gives its forward or its tensors' shapes, so there is nothing
    to draft with: refused by name rather than guessed."""
    d = cfg.dspark
    if d.num_layers == 0:
        return ("speculative decoding is not supported for DeepSeek-V4.1: the model has no "
                "draft layers (num_nextn_predict_layers = 0)")
    return (f"speculative decoding is not supported for DeepSeek-V4.1: its "
            f"{d.num_layers} draft layer(s) (num_nextn_predict_layers) are the DSpark drafter "
            f"(blocks of {d.block_size} drafts, Markov and confidence heads, reading layers "
            f"{list(d.target_layer_ids)}), not V4's MTP block, and no public reference "
            f"implements it (transformers ignores its mtp.* tensors); turn speculation off "
            f"to serve this model")


def _v41_engram_shape(cfg: V41Config) -> tuple[int, int]:
    return (0, 0) if cfg.engram is None else (len(cfg.engram.layer_ids), cfg.engram.n_columns)


V4 = FamilyFacts(
    name="DeepSeek-V4", config_type=ModelConfig, page_rates=_v4_rates,
    page_bytes=memory.page_bytes, fixed_cache_bytes=memory.fixed_cache_bytes,
    activation_estimate=memory.activation_estimate, engram_shape=lambda cfg: (0, 0),
    no_mtp_reason=_v4_no_mtp_reason)

V41 = FamilyFacts(
    name="DeepSeek-V4.1", config_type=V41Config,
    page_rates=lambda cfg: tuple(sorted(set(cfg.compress_ratios) - {0})),
    page_bytes=lambda cfg, page_size, dtype_bytes: memory_v41.v41_page_bytes(cfg, page_size),
    fixed_cache_bytes=_v41_fixed_cache_bytes, activation_estimate=_v41_activation_estimate,
    engram_shape=_v41_engram_shape, no_mtp_reason=_v41_no_mtp_reason)

FAMILIES = (V4, V41)


def facts_of(cfg) -> FamilyFacts:
    for family in FAMILIES:
        if isinstance(cfg, family.config_type):
            return family
    raise TypeError(f"not a model config the engine serves: {type(cfg).__name__}")
