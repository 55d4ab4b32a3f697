"""The paged state of DeepSeek-V4.1, a pytree updated by pure functions (paged_forward.py).

Per layer:
* `window`: per slot, a ring of the last `sliding_window` roped K=V latents (row = position
  mod W), stored as the reference quantizes them: FP8 e4m3 codes + ue8m0 scales per 32
  channels (kv_format.Fp8Rows).
* KV sources only: `entries`, the group's compressed entries (roped, FP4 e2m1 codes + e4m3
  scales per 16 channels), in pages of `page_size // ratio` rows addressed through each
  sequence's block table like V4's `rows` (flat pool: page p holds rows p*rpp .. p*rpp+rpp-1).
  The layers of the group after the source (its Reuse / Reindex consumers) own no pages: they
  read the source's pool, so one page of a sequence holds the entries of all its group's layers.
* index sources that are KV sources: `index_keys`, the indexer keys (FP4 codes + ue8m0 scales
  per 32 channels) in the same rows of the same pages.
* KV sources with ratio > 1: `tail`, per slot a ring (position mod R >= ratio) of the projected
  tokens (kv and gate logits, float32) of the open group, so a group split across steps closes
  with all its tokens. At ratio 1 each token closes its own entry and needs no tail.
Per slot, `last_tokens`, `prompt_mask` and `output_counts` mean what they mean in V4's
StateCache (model/state.py), so the device step's bookkeeping can serve both models.
What it costs: config/memory_v41.py (checked against this pytree in the tests).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from deepinfer_jax.config.memory_v41 import ENTRY_BLOCK, KEY_BLOCK, WINDOW_BLOCK
from deepinfer_jax.config.step import StepConfig
from deepinfer_jax.config.v41 import V41Config
from deepinfer_jax.model.v41.kv_format import Fp4Rows, Fp8Rows, zeros_fp4, zeros_fp8

Array = jax.Array

__all__ = ["ENTRY_BLOCK", "KEY_BLOCK", "WINDOW_BLOCK", "GroupTail", "V41LayerState", "V41State",
           "check_formats", "init_v41_state"]


@struct.dataclass
class GroupTail:
    kv: Array        # f32[slots, R, hd]  projected tokens of the open group, by position mod R
    gate: Array      # f32[slots, R, hd]  their pooling logits (R = ratio + spec spare rows)


@struct.dataclass
class V41LayerState:
    window: Fp8Rows                 # [slots, W, hd]
    entries: Fp4Rows | None         # [pages * rows_per_page(ratio), hd]   KV sources
    index_keys: Fp4Rows | None      # [pages * rows_per_page(ratio), Id]   index + KV sources
    tail: GroupTail | None          # KV sources with ratio > 1


@struct.dataclass
class V41State:
    layers: tuple[V41LayerState, ...]
    last_tokens: Array      # i32[slots]     each slot's most recently sampled token
    prompt_mask: Array      # bool[slots, V] tokens of the prompt (repetition penalty)
    output_counts: Array    # i32[slots, V]  generated-token counts (presence/frequency penalty)


def check_formats(cfg: V41Config) -> None:
    """The stored formats need whole quantization blocks (the reference leaves a width that is
    not a multiple unquantized, which only toy configs meet)."""
    for name, width, block in (("head_dim", cfg.head_dim, WINDOW_BLOCK),
                               ("head_dim", cfg.head_dim, ENTRY_BLOCK),
                               ("index_head_dim", cfg.index_head_dim, KEY_BLOCK)):
        if width % block:
            raise ValueError(f"paged V4.1 state: {name}={width} is not a multiple of the "
                             f"quantization block {block}")


def init_v41_state(cfg: V41Config, step_cfg: StepConfig, dtype=jnp.float32) -> V41State:
    """Zeroed state. The window and page formats are the reference's and fixed; `dtype` is the
    open-group tails' (float32, the default, keeps the reference's pooling numerics). With
    speculation the rings hold `spec_tokens` spare rows, as V4's (model/state.py)."""
    check_formats(cfg)
    slots, hd, spare = step_cfg.max_num_seqs, cfg.head_dim, step_cfg.spec_tokens
    layers = []
    for i, ratio in enumerate(cfg.compress_ratios):
        window = zeros_fp8((slots, cfg.sliding_window + spare, hd), WINDOW_BLOCK)
        entries = keys = tail = None
        if cfg.is_kv_source(i):
            if step_cfg.page_size % ratio:
                raise ValueError(f"page_size {step_cfg.page_size} is not a multiple of layer "
                                 f"{i}'s compress ratio {ratio}")
            n_rows = step_cfg.num_pages * step_cfg.rows_per_page(ratio)
            entries = zeros_fp4((n_rows, hd), ENTRY_BLOCK, e4m3_scales=True)
            if cfg.is_index_source(i):
                keys = zeros_fp4((n_rows, cfg.index_head_dim), KEY_BLOCK, e4m3_scales=False)
            if ratio > 1:
                # Two buffers: the state is donated, and a buffer may be donated only once.
                tail = GroupTail(kv=jnp.zeros((slots, ratio + spare, hd), dtype),
                                 gate=jnp.zeros((slots, ratio + spare, hd), dtype))
        layers.append(V41LayerState(window=window, entries=entries, index_keys=keys, tail=tail))
    return V41State(tuple(layers), last_tokens=jnp.zeros((slots,), jnp.int32),
                    prompt_mask=jnp.zeros((slots, cfg.vocab_size), bool),
                    output_counts=jnp.zeros((slots, cfg.vocab_size), jnp.int32))
