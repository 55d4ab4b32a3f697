"""The paged state cache of DeepSeek-V4, a pytree updated by pure functions (donated in the step).

Per layer (see docs/state_cache.md for the layout and how rollback and replay use it):
* `window`: per slot, a ring of the last `sliding_window` raw K=V rows (slot = position mod W);
* CSA/HCA: `rows`, the compressed rows, in pages of `page_size // m` rows addressed through
  each sequence's block table (the pool is stored flat: page p holds rows p*rpp .. p*rpp+rpp-1);
* CSA: `index_keys`, the indexer's compressed keys, in the same pages;
* `tail` / `index_tail`: per slot, a ring of the compressor's projected tokens (kv and pooling
  logit) for the open block and, with overlap, the block before it (R = 2m, else m).
Per slot, `last_tokens` keeps the token the slot sampled last, so that the next step can read
it on the device before the host has seen it (asynchronous scheduling); `prompt_mask` and
`output_counts` record which tokens the sequence fed so far, for the sampling penalties.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from deepinfer_jax.config.model import AttentionKind, ModelConfig
from deepinfer_jax.config.step import StepConfig

Array = jax.Array


@struct.dataclass
class CompressorTail:
    kv: Array       # f32[slots, R, c*d]  projected tokens, ring by position mod R
    score: Array    # f32[slots, R, c*d]  their pooling logits (position bias included)


@struct.dataclass
class LayerState:
    window: Array                       # [slots, W, hd]
    rows: Array | None                  # [pages * rows_per_page, hd]
    tail: CompressorTail | None
    index_keys: Array | None            # [pages * rows_per_page, Id]
    index_tail: CompressorTail | None


@struct.dataclass
class SpecCarry:
    """What each slot's last speculative step leaves for its next one, so that the
    asynchronous loop can launch that step before the host has read how many drafts were
    accepted (device/spec_carry.py): the next step's positions shift by `accepted`, it feeds
    `last_tokens` (the bonus token) and then `drafts`, and verifies `num_drafts` of them."""

    accepted: Array         # i32[slots]     drafts the slot's last speculative step accepted
    drafts: Array           # i32[slots, k]  the drafts it proposed for the next step
    num_drafts: Array       # i32[slots]     how many of them are meant (confidence, cap)


@struct.dataclass
class StateCache:
    layers: tuple[LayerState, ...]
    mtp: LayerState | None  # the MTP block's window ring (speculative decoding only)
    last_tokens: Array      # i32[slots]     each slot's most recently sampled token
    prompt_mask: Array      # bool[slots, V] tokens of the prompt (repetition penalty)
    output_counts: Array    # i32[slots, V]  generated-token counts (presence/frequency penalty)
    # i32[L, E] routed (token, expert) pairs per layer and expert since start-up: the expert
    # load balancer's measure (parallel/eplb.py); None without it
    expert_load: Array | None = None
    spec_carry: SpecCarry | None = None     # with speculation (spec_tokens > 0)


def _tail(slots: int, rate: int, overlap: bool, dim: int, spare: int) -> CompressorTail:
    ring, width = (2 * rate, 2 * dim) if overlap else (rate, dim)
    ring += spare
    # Two separate buffers: the state is donated, and a buffer may be donated only once.
    return CompressorTail(kv=jnp.zeros((slots, ring, width), jnp.float32),
                          score=jnp.zeros((slots, ring, width), jnp.float32))


def init_state(cfg: ModelConfig, step_cfg: StepConfig, dtype) -> StateCache:
    """Zeroed state. With speculation every ring holds `spec_tokens` spare rows: a rejected
    draft's row then lands where it overwrites nothing a committed token still needs."""
    slots, spare = step_cfg.max_num_seqs, step_cfg.spec_tokens
    layers = []
    for kind in cfg.layer_types:
        window = jnp.zeros((slots, cfg.sliding_window + spare, cfg.head_dim), dtype)
        rows = tail = index_keys = index_tail = None
        if kind is not AttentionKind.SLIDING:
            rate = cfg.compress_rate(kind)
            n_rows = step_cfg.num_pages * step_cfg.rows_per_page(rate)
            rows = jnp.zeros((n_rows, cfg.head_dim), dtype)
            tail = _tail(slots, rate, kind is AttentionKind.CSA, cfg.head_dim, spare)
        if kind is AttentionKind.CSA:
            index_keys = jnp.zeros((n_rows, cfg.index_head_dim), dtype)
            index_tail = _tail(slots, rate, True, cfg.index_head_dim, spare)
        layers.append(LayerState(window, rows, tail, index_keys, index_tail))
    mtp = None
    if spare:   # the MTP block's own window (it is a window-only layer)
        mtp = LayerState(jnp.zeros((slots, cfg.sliding_window + spare, cfg.head_dim), dtype),
                         None, None, None, None)
    load = (jnp.zeros((cfg.num_layers, cfg.n_routed_experts), jnp.int32)
            if step_cfg.compute.parallel.eplb is not None else None)
    carry = (SpecCarry(jnp.zeros((slots,), jnp.int32), jnp.zeros((slots, spare), jnp.int32),
                       jnp.zeros((slots,), jnp.int32)) if spare else None)
    return StateCache(tuple(layers), mtp=mtp, last_tokens=jnp.zeros((slots,), jnp.int32),
                      prompt_mask=jnp.zeros((slots, cfg.vocab_size), bool),
                      output_counts=jnp.zeros((slots, cfg.vocab_size), jnp.int32),
                      expert_load=load, spec_carry=carry)


def state_bytes(state: StateCache) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))
