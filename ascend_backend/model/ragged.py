"""Ragged-batch plumbing (deepinfer_jax/model/ragged.py): per-token views of the plan, and
the gathers and scatters between the flat batch and the state cache.

One gather serves a token's rows of this step and older ones: `cat([flat, ring])` indexed
by `i` (a token of this step) or `T + slot * R + position mod R` (the slot's ring). Indices
out of range mark padding: gathers clamp them (the caller masks what they read), scatters
drop them, as the JAX step's `mode="drop"`."""

from __future__ import annotations

import dataclasses

import torch

from deepinfer_jax.contract import BatchPlan


@dataclasses.dataclass
class TokenContext:
    positions: torch.Tensor     # int[T]
    valid: torch.Tensor         # bool[T]  a real token (not padding)
    seq: torch.Tensor           # int[T]   batch row, clamped into range for padding
    slot: torch.Tensor          # int[T]   state slot of the token's sequence
    start: torch.Tensor         # int[T]   first position of the sequence in this step
    end: torch.Tensor           # int[T]   one past its last position in this step
    block_table: torch.Tensor   # int[N, max_blocks]
    window_from: torch.Tensor   # int[T]   window rows below it are not visible (replay)
    rows_from: torch.Tensor     # int[T]   positions below it write no rows or tails


def token_context(plan: BatchPlan) -> TokenContext:
    """The plan's arrays (torch tensors) seen per token."""
    n = plan.seq_slot.shape[0]
    valid = plan.token_seq < n
    seq = plan.token_seq.clamp(max=n - 1)
    start = plan.seq_start[seq]
    return TokenContext(positions=plan.positions, valid=valid, seq=seq, slot=plan.seq_slot[seq],
                        start=start, end=start + plan.seq_len[seq], block_table=plan.block_table,
                        window_from=plan.window_from[seq], rows_from=plan.rows_from[seq])


def gather(source: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """source[index] along the first axis, indices clamped into range (padding's)."""
    return source[index.clamp(0, source.shape[0] - 1)]


def scatter(target: torch.Tensor, index: torch.Tensor, values: torch.Tensor) -> None:
    """target[index] = values along the first axis, in place; out-of-range indices dropped."""
    keep = (index >= 0) & (index < target.shape[0])
    target[index[keep]] = values[keep].to(target.dtype)


def ring_or_flat_index(ctx: TokenContext, flat_index: torch.Tensor, positions: torch.Tensor,
                       ring: int, num_tokens: int, token: torch.Tensor) -> torch.Tensor:
    """Where the row of `positions` (of token `token`'s sequence) lives: this step's flat
    batch (`flat_index`) or the slot's ring of size `ring` (offset by num_tokens)."""
    in_step = positions >= ctx.start[token][..., None]
    ring_index = num_tokens + ctx.slot[token][..., None] * ring + positions % ring
    return torch.where(in_step, flat_index, ring_index)


def window_keys(kv: torch.Tensor, window: torch.Tensor, ctx: TokenContext, width: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's raw window: kv [T, hd] of this step, ring [slots, R >= width, hd] ->
    (keys [T, width, hd], visible bool[T, width]); column j is the row at distance j."""
    num_tokens, ring = kv.shape[0], window.shape[1]
    dist = torch.arange(width, device=kv.device)
    positions = ctx.positions[:, None] - dist
    token = torch.arange(num_tokens, device=kv.device)
    index = ring_or_flat_index(ctx, token[:, None] - dist, positions, ring, num_tokens, token)
    source = torch.cat([kv, window.reshape(-1, kv.shape[-1]).to(kv.dtype)])
    visible = (positions >= ctx.window_from[:, None]) & ctx.valid[:, None]
    return gather(source, index), visible


def write_ring(ring: torch.Tensor, values: torch.Tensor, ctx: TokenContext) -> None:
    """In place: each token's row at `slot, position mod R` if it is among the last R
    positions of its sequence in this step; ring [slots, R, X], values [T, X]."""
    slots, size = ring.shape[:2]
    keep = ctx.valid & (ctx.positions >= ctx.end - size)
    dest = torch.where(keep, ctx.slot * size + ctx.positions % size, slots * size)
    scatter(ring.view(slots * size, -1), dest, values)


def row_index(block_table: torch.Tensor, seq: torch.Tensor, rows: torch.Tensor, rate: int,
              page_size: int) -> torch.Tensor:
    """Flat index into a page pool of compressed row `rows` (broadcast with seq)."""
    rows_per_page = page_size // rate
    block = (rows * rate) // page_size
    page = block_table[seq, block.clamp(max=block_table.shape[1] - 1)]
    return page * rows_per_page + rows % rows_per_page
