"""Snapshots of a slot's rings for the prefix cache: copy a slot out, copy it back in.

A snapshot holds what a sequence keeps per slot besides its pages: every layer's window ring
and compressor tails, and with speculative decoding the MTP block's window ring
(`SlotRings`). Restoring one also rebuilds the slot's penalty counters from the sequence's
tokens, since a cached block may have been a prompt for one request and generated text for
another. Both copies are pure functions of fixed shapes (`width` copies per call, padded with
out-of-range ids that are dropped), compiled once at start-up.

Without windows (a bounded prefix replay rebuilds them, config/prefix_replay.py) a snapshot
keeps only the overlapping compressors' tails (CSA and its indexer): at a block end, where
snapshots are taken, a compressor without overlap has an empty open block, and its ring holds
nothing a later row reads.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from deepinfer_jax.model.state import StateCache
from deepinfer_jax.model.v41.state import V41State

# (per layer: (window [S, W, hd], tail CompressorTail | None, index_tail CompressorTail | None),
#  the MTP block's window [S, W', hd] or None), S = slots in the state, snapshots in the pool.
# DeepSeek-V4.1 (V41State): per layer (window Fp8Rows [S, W, hd] as stored, the KV source's
# open-group tail GroupTail | None, None), and None: what its slot holds besides the pages.
SlotRings = tuple


def slot_rings(state: StateCache | V41State, windows: bool = True) -> SlotRings:
    if isinstance(state, V41State):    # exact snapshots only (EngineConfig refuses a replay)
        return tuple((ls.window, ls.tail, None) for ls in state.layers), None
    if not windows:   # None leaves: nothing kept, nothing restored
        return (tuple((None, ls.tail if ls.index_tail is not None else None, ls.index_tail)
                      for ls in state.layers), None)
    return (tuple((ls.window, ls.tail, ls.index_tail) for ls in state.layers),
            None if state.mtp is None else state.mtp.window)


def init_pool(state: StateCache, count: int, windows: bool = True) -> SlotRings:
    return jax.tree.map(lambda a: jnp.zeros((count, *a.shape[1:]), a.dtype),
                        slot_rings(state, windows))


def save(rings: SlotRings, pool: SlotRings, slots: jax.Array, snapshots: jax.Array) -> SlotRings:
    """pool[snapshots[i]] = rings[slots[i]]."""
    return jax.tree.map(lambda p, r: p.at[snapshots].set(r[jnp.minimum(slots, r.shape[0] - 1)],
                                                         mode="drop", unique_indices=True),
                        pool, rings)


def restore(state: StateCache, pool: SlotRings, snapshots: jax.Array, slots: jax.Array,
            tokens: jax.Array, prompt_len: jax.Array) -> StateCache:
    """state[slots[i]] = pool[snapshots[i]], and the penalty counters of slots[i] recounted
    from tokens[i] (i32[L], -1 padded; positions >= prompt_len[i] are generated tokens)."""
    windows = pool[1] is not None or any(w is not None for w, _, _ in pool[0])
    rings, mtp_window = jax.tree.map(
        lambda r, p: r.at[slots].set(p[jnp.minimum(snapshots, p.shape[0] - 1)], mode="drop",
                                     unique_indices=True),
        slot_rings(state, windows), pool)
    layers = tuple(dataclasses.replace(ls, **{k: v for k, v in zip(
                       ("window", "tail", "index_tail"), ring, strict=True) if v is not None})
                   for ls, ring in zip(state.layers, rings, strict=True))
    # V4.1's state has no MTP block (and the family refuses speculation)
    mtp = {} if isinstance(state, V41State) else {"mtp": (
        state.mtp if state.mtp is None or mtp_window is None
        else dataclasses.replace(state.mtp, window=mtp_window))}
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
    return dataclasses.replace(state, layers=layers, prompt_mask=prompt_mask,
                               output_counts=counts, **mtp)


def compile_copies(state: StateCache, pool: SlotRings, width: int, max_len: int,
                   windows: bool = True):
    """(save, restore) compiled for `width` copies per call; save donates the pool, restore
    the state."""
    ids = jax.ShapeDtypeStruct((width,), jnp.int32)
    tokens = jax.ShapeDtypeStruct((width, max_len), jnp.int32)
    save_c = jax.jit(save, donate_argnums=(1,)).lower(slot_rings(state, windows), pool, ids,
                                                      ids).compile()
    restore_c = jax.jit(restore, donate_argnums=(0,)).lower(
        state, pool, ids, ids, tokens, ids).compile()
    return save_c, restore_c
