"""What a prefix-cache snapshot keeps of a slot's rings, and how it is packed and unpacked.

Snapshots are taken only at block ends (host/kv_cache.snapshot_saves: a row whose step ended
on a block boundary, without drafts), and a block is a multiple of every compress rate. With
`end` the tokens the snapshot covers (a multiple of every m), a later token reads of the rings:

* a window ring: its last rows (model dtype in the state already): kept whole, ring order.
  Its order follows `end` modulo the ring, and shapes are fixed, so keeping only W-1 of its
  W + spare rows would save a row or a few per layer at the cost of a position gather;
* a compressor without overlap (HCA): nothing. Its open block is empty at `end`, and the next
  row it closes (at end + m - 1) pools only tokens still to come;
* an overlapping compressor (CSA, its indexer): the first halves (columns :d of kv and score)
  of the block just closed, positions end - m .. end - 1: the next row pools them with its own
  block's second halves (model/compressor.pool_rows, paged_compressor.close_rows); the rows
  after it pool only tokens still to come. Kept: those m rows of d columns in position order,
  f32[m, d] each for kv and score, a quarter of the ring's (2m + spare) x 2d when spare = 0.

The tails stay float32: kv is a float32 sum of bf16 products (model/invariant.f32_linear) and
the score that plus the float32 block-position bias; neither is a bf16 value in general, and
a bf16 copy would change the rows the next token closes.

Restoring writes the kept rows back at their ring positions (end - m + j mod R) and zeros in
the rest of the tail ring, which no later row reads before the sequence writes it; so a
restored slot computes what the cold run's slot computes, bit for bit.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from deepinfer_jax.model.state import CompressorTail, StateCache
from deepinfer_jax.model.v41.kv_format import Fp8Rows
from deepinfer_jax.model.v41.state import V41State

Array = jax.Array

# names this layout in the KV tiers' namespace (engine/tier_copies.py): change it with the layout
SNAPSHOT_LAYOUT = "windows+closed-halves/1"


@struct.dataclass
class ClosedHalves:
    """An overlapping compressor's tail at a block end, S = snapshots (or copies in flight)."""

    kv: Array       # f32[S, m, d]  the last closed block's first halves, in position order
    score: Array    # f32[S, m, d]  their pooling logits (position bias included)


# per layer (window [S, W + spare, hd] | None, tail, index_tail: ClosedHalves | None), and the
# MTP block's window [S, W + spare, hd] or None
SnapshotRings = tuple
# the same of the live state: per layer (window | None, tail, index_tail: CompressorTail |
# None, only the overlapping compressors'), the MTP window | None; S = the state's slots
LiveRings = tuple


def live_rings(state: StateCache | V41State, windows: bool = True) -> LiveRings:
    """The state's arrays a snapshot reads (without windows: a bounded prefix replay rebuilds
    them, config/prefix_replay.py). V4.1: per layer (window Fp8Rows, tail GroupTail | None,
    None), copied whole; without windows nothing: its groups do not overlap, so at a block end
    (a multiple of every ratio) the open group is empty and no later entry pools a token of
    the prefix from the tail."""
    if isinstance(state, V41State):
        return tuple((ls.window, ls.tail, None) if windows else (None, None, None)
                     for ls in state.layers), None
    layers = tuple((ls.window if windows else None,
                    ls.tail if ls.index_tail is not None else None,   # CSA: overlapping
                    ls.index_tail) for ls in state.layers)
    mtp = None if state.mtp is None or not windows else state.mtp.window
    return layers, mtp


def _halves_shape(tail: CompressorTail, count: int, spare: int) -> ClosedHalves:
    ring, width = tail.kv.shape[1:]
    m = (ring - spare) // 2              # an overlapping ring holds 2m + spare rows of 2d
    leaf = jax.ShapeDtypeStruct((count, m, width // 2), tail.kv.dtype)
    return ClosedHalves(kv=leaf, score=leaf)


def pool_shapes(state: StateCache, count: int, spare: int, windows: bool = True) -> SnapshotRings:
    """The shapes of `count` snapshots; spare = the state's speculative spare rows per ring."""
    def window(w):
        return None if w is None else jax.ShapeDtypeStruct((count, *w.shape[1:]), w.dtype)

    def halves(t):
        return None if t is None else _halves_shape(t, count, spare)

    layers, mtp = live_rings(state, windows)
    if isinstance(state, V41State):
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct((count, *a.shape[1:]), a.dtype),
                            (layers, mtp))
    return tuple((window(w), halves(t), halves(it)) for w, t, it in layers), window(mtp)


def _open_rows(ends: Array, m: int, ring: int) -> Array:
    """i32[w, m]: the ring rows of positions end - m .. end - 1."""
    return (ends[:, None] - m + jnp.arange(m)) % ring


def _pack_tail(tail: CompressorTail, slots: Array, ends: Array, m: int) -> ClosedHalves:
    rows = _open_rows(ends, m, tail.kv.shape[1])
    d = tail.kv.shape[2] // 2
    return ClosedHalves(kv=tail.kv[slots[:, None], rows, :d],
                        score=tail.score[slots[:, None], rows, :d])


def _unpack_ring(ring_shape: tuple[int, ...], halves: Array, ends: Array) -> Array:
    """[w, R, 2d] rings holding `halves` [w, m, d] at their positions' rows, zeros elsewhere
    (a gather: order-free)."""
    _, m, d = halves.shape
    ring, width = ring_shape
    offset = (jnp.arange(ring)[None, :] - ends[:, None] + m) % ring    # [w, R]: j of each row
    values = jnp.take_along_axis(halves, jnp.minimum(offset, m - 1)[..., None], axis=1)
    values = jnp.where((offset < m)[..., None], values, 0.0)
    return jnp.concatenate([values, jnp.zeros((*values.shape[:2], width - d), values.dtype)], -1)


def pack(live: LiveRings, pool: SnapshotRings, slots: Array, ends: Array) -> SnapshotRings:
    """The snapshots of slots[i] at block end ends[i] (i32[w] each; slots in range), as
    `pool`'s leaves, with a leading [w]."""
    if _is_v41(live):
        return jax.tree.map(lambda a: a[slots], live)
    def layer(lr, pr):
        (window, tail, index_tail), (_, t_pool, it_pool) = lr, pr
        return (None if window is None else window[slots],
                None if t_pool is None else _pack_tail(tail, slots, ends, t_pool.kv.shape[1]),
                None if it_pool is None else _pack_tail(index_tail, slots, ends,
                                                        it_pool.kv.shape[1]))

    layers, mtp = live
    return (tuple(layer(lr, pr) for lr, pr in zip(layers, pool[0], strict=True)),
            None if mtp is None else mtp[slots])


def unpack(state: StateCache, packed: SnapshotRings, slots: Array, ends: Array) -> StateCache:
    """`state` with the snapshots `packed` (leading [w]) written into slots[i] (out-of-range
    slots dropped), restored at block ends ends[i]."""
    def put(ring, value):
        return ring.at[slots].set(value, mode="drop", unique_indices=True)

    if isinstance(state, V41State):      # whole copies (live_rings)
        layers = tuple(dataclasses.replace(ls, window=ls.window if window is None
                                           else jax.tree.map(put, ls.window, window),
                                           tail=ls.tail if tail_ is None
                                           else jax.tree.map(put, ls.tail, tail_))
                       for ls, (window, tail_, _) in zip(state.layers, packed[0], strict=True))
        return dataclasses.replace(state, layers=layers)

    def tail(live: CompressorTail, halves: ClosedHalves | None) -> CompressorTail:
        if halves is None:
            return live
        shape = live.kv.shape[1:]
        return CompressorTail(kv=put(live.kv, _unpack_ring(shape, halves.kv, ends)),
                              score=put(live.score, _unpack_ring(shape, halves.score, ends)))

    layers = tuple(dataclasses.replace(
        ls, window=ls.window if window is None else put(ls.window, window),
        tail=tail(ls.tail, halves), index_tail=tail(ls.index_tail, index_halves))
        for ls, (window, halves, index_halves) in zip(state.layers, packed[0], strict=True))
    mtp = (state.mtp if packed[1] is None
           else dataclasses.replace(state.mtp, window=put(state.mtp.window, packed[1])))
    return dataclasses.replace(state, layers=layers, mtp=mtp)


def _is_v41(live: LiveRings) -> bool:
    """V4.1's live rings hold FP8 windows as stored: live_rings."""
    return any(isinstance(w, Fp8Rows) for w, _, _ in live[0])
