"""The paged state cache in torch tensors, the layout of deepinfer_jax/model/state.py:
per layer a window ring per slot, the compressed rows and the indexer's keys in the page
pool, the compressor tails per slot; per slot the last sampled token and the penalty
bookkeeping. The torch step updates it in place and returns it."""

from __future__ import annotations

import dataclasses

import torch

from deepinfer_jax.config.model import AttentionKind, ModelConfig
from deepinfer_jax.config.step import StepConfig


@dataclasses.dataclass
class CompressorTail:
    kv: torch.Tensor       # f32[slots, R, c*d]  projected tokens, ring by position mod R
    score: torch.Tensor    # f32[slots, R, c*d]  their pooling logits (position bias included)


@dataclasses.dataclass
class LayerState:
    window: torch.Tensor                     # [slots, W + spare, hd]
    rows: torch.Tensor | None                # [pages * rows_per_page, hd]
    tail: CompressorTail | None
    index_keys: torch.Tensor | None          # [pages * rows_per_page, Id]
    index_tail: CompressorTail | None


@dataclasses.dataclass
class StateCache:
    layers: list[LayerState]
    mtp: LayerState | None         # the MTP block's window ring (speculative decoding only)
    last_tokens: torch.Tensor      # int64[slots]
    prompt_mask: torch.Tensor      # bool[slots, V]
    output_counts: torch.Tensor    # int64[slots, V]


def _tail(slots: int, rate: int, overlap: bool, dim: int, spare: int,
          device: torch.device) -> CompressorTail:
    ring, width = (2 * rate, 2 * dim) if overlap else (rate, dim)
    return CompressorTail(kv=torch.zeros((slots, ring + spare, width), device=device),
                          score=torch.zeros((slots, ring + spare, width), device=device))


def init_state(cfg: ModelConfig, step_cfg: StepConfig, device: torch.device,
               dtype: torch.dtype = torch.float32) -> StateCache:
    """Zeroed state; with speculation every ring holds `spec_tokens` spare rows."""
    slots, spare = step_cfg.max_num_seqs, step_cfg.spec_tokens
    layers = []
    for kind in cfg.layer_types:
        window = torch.zeros((slots, cfg.sliding_window + spare, cfg.head_dim), dtype=dtype,
                             device=device)
        rows = tail = index_keys = index_tail = None
        if kind is not AttentionKind.SLIDING:
            rate = cfg.compress_rate(kind)
            n_rows = step_cfg.num_pages * step_cfg.rows_per_page(rate)
            rows = torch.zeros((n_rows, cfg.head_dim), dtype=dtype, device=device)
            tail = _tail(slots, rate, kind is AttentionKind.CSA, cfg.head_dim, spare, device)
        if kind is AttentionKind.CSA:
            index_keys = torch.zeros((n_rows, cfg.index_head_dim), dtype=dtype, device=device)
            index_tail = _tail(slots, rate, True, cfg.index_head_dim, spare, device)
        layers.append(LayerState(window, rows, tail, index_keys, index_tail))
    mtp = None
    if spare:   # the MTP block's own window (a window-only layer)
        mtp = LayerState(torch.zeros((slots, cfg.sliding_window + spare, cfg.head_dim),
                                     dtype=dtype, device=device), None, None, None, None)
    return StateCache(layers, mtp, last_tokens=torch.zeros(slots, dtype=torch.int64, device=device),
                      prompt_mask=torch.zeros((slots, cfg.vocab_size), dtype=torch.bool,
                                              device=device),
                      output_counts=torch.zeros((slots, cfg.vocab_size), dtype=torch.int64,
                                                device=device))
