"""Ragged-batch plumbing for the engine's step: per-token views of the plan, and the gathers
and scatters between the flat batch and the state cache.

Sources are concatenated so that one gather serves both: `concat([flat, ring])` with index
`i` (a token of this step) or `T + slot * R + position mod R` (an older token in the ring).
Out-of-range indices mark padding: gathers from them are masked by the caller, scatters to
them are dropped (`mode="drop"`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from pallas_kernels import common

Array = jax.Array


@struct.dataclass
class TokenContext:
    positions: Array     # i32[T]
    valid: Array         # bool[T]  a real token (not padding)
    seq: Array           # i32[T]   batch row, clamped into range for padding
    slot: Array          # i32[T]   state slot of the token's sequence
    start: Array         # i32[T]   first position of the sequence in this step
    end: Array           # i32[T]   one past its last position in this step
    block_table: Array   # i32[N, max_blocks]
    # a bounded prefix replay (BatchPlan.window_from / rows_from) per token; None: 0
    window_from: Array | None = None   # i32[T]  window rows below it are not visible
    rows_from: Array | None = None     # i32[T]  positions below it write no rows or tails
    # the GPU formulation (ComputeConfig.launch_bound): index arrays settled before use
    launch_bound: bool = struct.field(pytree_node=False, default=False)


def settled(launch_bound: bool, *indices: Array):
    """Index arrays computed once before the wide gathers or scatters that use them, in the
    GPU formulation (pallas_kernels.common.settled: XLA's GPU fusion would recompute an
    index's arithmetic for every element it moves); as they are elsewhere."""
    if not launch_bound:
        return indices[0] if len(indices) == 1 else indices
    return common.settled(*indices)


def token_context(plan, launch_bound: bool) -> TokenContext:
    n = plan.seq_slot.shape[0]
    valid = plan.token_seq < n
    seq = jnp.minimum(plan.token_seq, n - 1)
    start = plan.seq_start[seq]
    return TokenContext(positions=plan.positions, valid=valid, seq=seq,
                        slot=plan.seq_slot[seq], start=start,
                        end=start + plan.seq_len[seq], block_table=plan.block_table,
                        window_from=plan.window_from[seq], rows_from=plan.rows_from[seq],
                        launch_bound=launch_bound)


def ring_or_flat_index(ctx: TokenContext, flat_index: Array, positions: Array, ring: int,
                       num_tokens: int, token: Array) -> Array:
    """Where the row of `positions` (of the sequence of token `token`) lives: in this step's
    flat batch (`flat_index`) or in the slot's ring of size `ring` (offset by num_tokens)."""
    in_step = positions >= ctx.start[token][..., None]
    ring_index = num_tokens + ctx.slot[token][..., None] * ring + positions % ring
    return jnp.where(in_step, flat_index, ring_index)


def window_keys(kv: Array, window: Array, ctx: TokenContext, width: int) -> tuple[Array, Array]:
    """Each token's raw window of `width` rows: kv [T, hd] of this step, window ring
    [slots, R >= width, hd] -> (keys [T, width, hd], visible bool[T, width]); column j is the
    row at distance j."""
    num_tokens, ring = kv.shape[0], window.shape[1]
    dist = jnp.arange(width)
    positions = ctx.positions[:, None] - dist                               # [T, W]
    token = jnp.arange(num_tokens)
    index = settled(ctx.launch_bound, ring_or_flat_index(ctx, token[:, None] - dist, positions,
                                                         ring, num_tokens, token))
    source = jnp.concatenate([kv, window.reshape(-1, kv.shape[-1])])
    floor = 0 if ctx.window_from is None else ctx.window_from[:, None]
    visible = (positions >= floor) & ctx.valid[:, None]
    return source[index], visible


def write_ring(ring: Array, values: Array, ctx: TokenContext, order_free: bool) -> Array:
    """Store each token's row at `slot, position mod R` if it is among the last R positions of
    its sequence in this step; ring [slots, R, X], values [T, X].

    order_free (batch-invariant mode): declare the indices unique, which they are (a sequence's
    kept positions are R consecutive ones, distinct mod R; the rest are dropped). Under XLA's
    deterministic ops a scatter that may repeat an index runs as a serial loop over its
    updates (tests/engine/test_gpu_step_structure.py). The default mode runs without those
    ops and declares nothing; timed alone on the H200 these writes cost the same either way
    (docs/performance-log.md)."""
    slots, size = ring.shape[:2]
    keep = ctx.valid & (ctx.positions >= ctx.end - size)
    dest = settled(ctx.launch_bound,
                   jnp.where(keep, ctx.slot * size + ctx.positions % size, slots * size))
    flat = ring.reshape(slots * size, -1).at[dest].set(values.astype(ring.dtype), mode="drop",
                                                        unique_indices=order_free)
    return flat.reshape(ring.shape)


def row_index(block_table: Array, seq: Array, rows: Array, rate: int, page_size: int) -> Array:
    """Flat index into a page pool of compressed row `rows` (any shape, broadcast with seq)."""
    rows_per_page = page_size // rate
    block = (rows * rate) // page_size
    page = block_table[seq, jnp.minimum(block, block_table.shape[1] - 1)]
    return page * rows_per_page + rows % rows_per_page
