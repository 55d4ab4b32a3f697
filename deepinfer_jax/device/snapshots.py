"""Snapshots of a slot's rings for the prefix cache: copy a slot out, copy it back in.

A snapshot holds what a sequence keeps per slot besides its pages, at a block end, as compact
as exactness allows (device/snapshot_layout.py): every layer's window ring, the overlapping
compressors' (CSA, its indexer) last closed block's first halves, and with speculative
decoding the MTP block's window ring. Restoring one also rebuilds the slot's penalty counters
from the sequence's tokens, since a cached block may have been a prompt for one request and
generated text for another. Both copies are pure functions of fixed shapes (`width` copies
per call, padded with out-of-range ids that are dropped), compiled once at start-up.

Without windows (a bounded prefix replay rebuilds them, config/prefix_replay.py) a snapshot
keeps only the compressors' closed halves. DeepSeek-V4.1's state (V41State) is copied as its
slot holds it: each layer's FP8 window ring as stored and its open-group tail; without
windows, nothing (snapshot_layout.live_rings says why).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from deepinfer_jax.device.snapshot_layout import SnapshotRings, live_rings, pack, pool_shapes, unpack
from deepinfer_jax.model.state import StateCache

SlotRings = SnapshotRings     # the pool's pytree (snapshot_layout.py documents its leaves)
slot_rings = live_rings       # the state's arrays a save reads


def init_pool(state: StateCache, count: int, windows: bool = True, *, spare: int) -> SlotRings:
    """`count` zeroed snapshots; spare = the state's speculative spare rows per ring
    (StepConfig.spec_tokens)."""
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype),
                        pool_shapes(state, count, spare, windows))


def save(rings, pool: SlotRings, slots: jax.Array, snapshots: jax.Array,
         ends: jax.Array) -> SlotRings:
    """pool[snapshots[i]] = the snapshot of rings[slots[i]] at block end ends[i]."""
    leaves = jax.tree.leaves(rings)       # none: a bounded replay on a model without CSA
    slots = jnp.minimum(slots, leaves[0].shape[0] - 1) if leaves else slots
    packed = pack(rings, pool, slots, ends)
    return jax.tree.map(lambda p, r: p.at[snapshots].set(r, mode="drop", unique_indices=True),
                        pool, packed)


def restore(state: StateCache, pool: SlotRings, snapshots: jax.Array, slots: jax.Array,
            tokens: jax.Array, prompt_len: jax.Array, ends: jax.Array) -> StateCache:
    """state[slots[i]] = pool[snapshots[i]] taken at block end ends[i], and the penalty
    counters of slots[i] recounted from tokens[i] (i32[L], -1 padded; positions >=
    prompt_len[i] are generated tokens)."""
    packed = jax.tree.map(lambda p: p[jnp.minimum(snapshots, p.shape[0] - 1)], pool)
    state = unpack(state, packed, slots, ends)
    n_slots = state.last_tokens.shape[0]
    prompt_mask = state.prompt_mask.at[slots].set(False, mode="drop", unique_indices=True)
    counts = state.output_counts.at[slots].set(0, mode="drop", unique_indices=True)
    generated = jnp.arange(tokens.shape[1])[None, :] >= prompt_len[:, None]
    real = tokens >= 0
    row_slot = jnp.broadcast_to(slots[:, None], tokens.shape)
    ids = jnp.maximum(tokens, 0)
    prompt_mask = prompt_mask.at[jnp.where(real & ~generated, row_slot, n_slots), ids].max(
        True, mode="drop")
    counts = counts.at[jnp.where(real & generated, row_slot, n_slots), ids].add(1, mode="drop")
    return dataclasses.replace(state, prompt_mask=prompt_mask, output_counts=counts)


def compile_copies(state: StateCache, pool: SlotRings, width: int, max_len: int,
                   windows: bool = True):
    """(save, restore) compiled for `width` copies per call; save donates the pool, restore
    the state."""
    ids = jax.ShapeDtypeStruct((width,), jnp.int32)
    tokens = jax.ShapeDtypeStruct((width, max_len), jnp.int32)
    save_c = jax.jit(save, donate_argnums=(1,)).lower(slot_rings(state, windows), pool, ids,
                                                      ids, ids).compile()
    restore_c = jax.jit(restore, donate_argnums=(0,)).lower(
        state, pool, ids, ids, tokens, ids, ids).compile()
    return save_c, restore_c
