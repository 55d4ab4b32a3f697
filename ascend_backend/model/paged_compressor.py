"""The compressor inside the step (deepinfer_jax/model/paged_compressor.py): close the rows
this step completes and page them; which rows each token may see.

A token at position p closes row w = (p + 1) / m - 1 when (p + 1) % m == 0; the row pools
its block's projected tokens (and with overlap the block before), from this step's flat
batch or the slot's tail ring. Rows are written before attention reads the pool: a row is
only visible to positions >= its closing token."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from ascend_backend.model.compressor import finish_rows, pool_closing_rows
from ascend_backend.model.ragged import (
    TokenContext,
    gather,
    ring_or_flat_index,
    row_index,
    scatter,
    write_ring,
)
from ascend_backend.model.state import CompressorTail


def close_rows(kv: torch.Tensor, score: torch.Tensor, p, tail: CompressorTail,
               pool: torch.Tensor, ctx: TokenContext, *, rate: int, overlap: bool,
               freqs: np.ndarray, eps: float, page_size: int) -> None:
    """kv, score f32[T, c*d]: this step's projected tokens (score with the position bias).
    In place: the rows this step closes into `pool`, this step's tokens into the tail ring.
    Tokens of a bounded prefix replay (below rows_from) close no rows and write no tail."""
    ctx = dataclasses.replace(ctx, valid=ctx.valid & (ctx.positions >= ctx.rows_from),
                              start=torch.maximum(ctx.start, ctx.rows_from))
    num_tokens = kv.shape[0]
    closer = torch.nonzero(ctx.valid & ((ctx.positions + 1) % rate == 0)).flatten()   # [n]
    if closer.numel():
        closer_pos = ctx.positions[closer]
        row = (closer_pos + 1) // rate - 1
        span = 2 * rate if overlap else rate
        first = row * rate - (rate if overlap else 0)
        positions = first[:, None] + torch.arange(span, device=kv.device)           # [n, span]
        flat_index = closer[:, None] - (closer_pos[:, None] - positions)
        index = ring_or_flat_index(ctx, flat_index, positions, tail.kv.shape[1], num_tokens,
                                   closer)
        exists = (positions >= 0)[..., None]
        g_kv = gather(torch.cat([kv, tail.kv.reshape(-1, kv.shape[-1])]), index)
        g_score = gather(torch.cat([score, tail.score.reshape(-1, score.shape[-1])]), index)
        g_kv = torch.where(exists, g_kv, 0.0)
        g_score = torch.where(exists, g_score, float("-inf"))
        pooled = pool_closing_rows(g_kv, g_score, rate=rate, overlap=overlap)
        rows = finish_rows(pooled, p.norm, row * rate, freqs, eps, pool.dtype)
        scatter(pool, row_index(ctx.block_table, ctx.seq[closer], row, rate, page_size), rows)
    write_ring(tail.kv, kv, ctx)
    write_ring(tail.score, score, ctx)


def row_visibility(ctx: TokenContext, *, rate: int, max_rows: int) -> torch.Tensor:
    """bool[T, max_rows]: row w closes at token m*w + m - 1."""
    rows = torch.arange(max_rows, device=ctx.positions.device)
    return (rows < (ctx.positions[:, None] + 1) // rate) & ctx.valid[:, None]


def visible_rows(pool: torch.Tensor, ctx: TokenContext, *, rate: int, page_size: int,
                 max_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """All rows each token may see (HCA): (rows [T, max_rows, d], visible bool[T, max_rows])."""
    rows = torch.arange(max_rows, device=pool.device)
    index = row_index(ctx.block_table, ctx.seq[:, None], rows, rate, page_size)
    return gather(pool, index), row_visibility(ctx, rate=rate, max_rows=max_rows)


def sequence_rows(pool: torch.Tensor, block_table: torch.Tensor, *, rate: int, page_size: int,
                  max_rows: int) -> torch.Tensor:
    """Every row of each batch row's sequence, once per sequence: [N, max_rows, d]."""
    rows = torch.arange(max_rows, device=pool.device)
    seqs = torch.arange(block_table.shape[0], device=pool.device)[:, None]
    return gather(pool, row_index(block_table, seqs, rows, rate, page_size))
