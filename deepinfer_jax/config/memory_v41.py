"""What DeepSeek-V4.1's paged state costs (model/v41/state.py), as V4's `memory.py` counts
V4's: per page across the layers, and per slot. Pure Python: no jax. The formats are the
reference's quantized ones, so the byte counts do not depend on the compute dtype:

* per page: each KV source's `page_size // ratio` compressed entries (FP4 codes, one byte per
  channel while unpacked, plus one e4m3 scale per 16 channels) and, at an index source, as
  many indexer keys (one byte per channel plus one ue8m0 scale per 32); consumer layers
  share their source's pages and add nothing;
* per slot: every layer's window ring (`sliding_window + spare` rows of e4m3 codes plus one
  ue8m0 scale per 32 channels), each ratio > 1 source's two open-group rings (float32 kv and
  gate logits, `ratio + spare` rows), the sampler's vocabulary rows and last token.

tests/model/test_v41_state.py checks these against `init_v41_state`'s real pytree. The Engram
tables are weights, not state: they are not counted here.
"""

from __future__ import annotations

from deepinfer_jax.config.step import StepConfig
from deepinfer_jax.config.v41 import V41Config

WINDOW_BLOCK = 32      # FP8 window K=V: channels per ue8m0 scale
ENTRY_BLOCK = 16       # FP4 compressed entries: channels per e4m3 scale
KEY_BLOCK = 32         # FP4 indexer keys: channels per ue8m0 scale
_CODE, _F32, _I32 = 1, 4, 4


def entry_bytes(cfg: V41Config) -> int:
    """One compressed entry: FP4 codes (a byte each) and its e4m3 block scales."""
    return cfg.head_dim * _CODE + cfg.head_dim // ENTRY_BLOCK


def index_key_bytes(cfg: V41Config) -> int:
    return cfg.index_head_dim * _CODE + cfg.index_head_dim // KEY_BLOCK


def window_row_bytes(cfg: V41Config) -> int:
    return cfg.head_dim * _CODE + cfg.head_dim // WINDOW_BLOCK


def v41_page_bytes(cfg: V41Config, page_size: int) -> int:
    """Bytes one page holds across all layers (only KV sources own pages)."""
    total = 0
    for i in cfg.kv_source_layer_ids:
        rows = page_size // cfg.compress_ratios[i]
        total += rows * entry_bytes(cfg)
        if cfg.is_index_source(i):
            total += rows * index_key_bytes(cfg)
    return total


def v41_snapshot_bytes(cfg: V41Config, spec_tokens: int = 0, tail_bytes: int = _F32) -> int:
    """One slot's rings, what a prefix-cache snapshot holds: every layer's window ring and each
    ratio > 1 source's open-group tails."""
    total = cfg.num_layers * (cfg.sliding_window + spec_tokens) * window_row_bytes(cfg)
    for i in cfg.kv_source_layer_ids:
        ratio = cfg.compress_ratios[i]
        if ratio > 1:
            total += 2 * (ratio + spec_tokens) * cfg.head_dim * tail_bytes
    return total


def v41_slot_bytes(cfg: V41Config, spec_tokens: int = 0, tail_bytes: int = _F32) -> int:
    """One slot's state: its rings (v41_snapshot_bytes), last token, prompt mask, counts."""
    return (v41_snapshot_bytes(cfg, spec_tokens, tail_bytes) + _I32
            + cfg.vocab_size * (1 + _I32))


def v41_cache_bytes(cfg: V41Config, step_cfg: StepConfig, tail_bytes: int = _F32) -> int:
    """The whole paged state for `step_cfg`'s shapes (the prefix cache's snapshots, which are
    not in the state's pytree, are counted by config/family.py)."""
    return (step_cfg.num_pages * v41_page_bytes(cfg, step_cfg.page_size)
            + step_cfg.max_num_seqs * v41_slot_bytes(cfg, step_cfg.spec_tokens, tail_bytes))
