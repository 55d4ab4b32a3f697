"""The compressor inside the engine's step: close the rows this step completes, page them.

A token at position p closes row w = (p + 1) / m - 1 when (p + 1) % m == 0. The row pools
the projected tokens of its block (and, with overlap, the block before), which live either in
this step's flat batch or in the slot's tail ring. New rows are written into the page pool
*before* attention reads it: a row is only visible to positions >= its closing token, and a
row written by a token that is later rolled back is never visible and gets overwritten.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from deepinfer_jax.model.compressor import finish_rows, pool_rows
from deepinfer_jax.model.params import CompressorParams
from deepinfer_jax.model.ragged import (
    TokenContext,
    ring_or_flat_index,
    row_index,
    settled,
    write_ring,
)
from deepinfer_jax.model.state import CompressorTail

Array = jax.Array


def close_rows(kv: Array, score: Array, p: CompressorParams, tail: CompressorTail, pool: Array,
               ctx: TokenContext, *, rate: int, overlap: bool, freqs: np.ndarray, eps: float,
               page_size: int, max_new_rows: int, rowwise: Callable, invariant: bool
               ) -> tuple[Array, CompressorTail]:
    """kv, score f32[T, c*d]: this step's projected tokens (score with the position bias).
    Returns the pool with this step's rows written and the tail ring with this step's tokens.
    Tokens of a bounded prefix replay (below ctx.rows_from) close no rows and write no tail:
    their rows are cached, and the restored tail holds the cached tokens the next row pools."""
    if ctx.rows_from is not None:
        ctx = dataclasses.replace(ctx, valid=ctx.valid & (ctx.positions >= ctx.rows_from),
                                  start=jnp.maximum(ctx.start, ctx.rows_from))
    num_tokens = kv.shape[0]
    closing = ctx.valid & ((ctx.positions + 1) % rate == 0)
    (closer,) = jnp.nonzero(closing, size=max_new_rows, fill_value=num_tokens)
    real = closer < num_tokens
    closer = jnp.minimum(closer, num_tokens - 1)
    closer_pos = ctx.positions[closer]
    row = (closer_pos + 1) // rate - 1                                      # [n]
    span = 2 * rate if overlap else rate
    first = row * rate - (rate if overlap else 0)
    positions = first[:, None] + jnp.arange(span)                           # [n, span]
    ring = tail.kv.shape[1]
    flat_index = closer[:, None] - (closer_pos[:, None] - positions)
    index = settled(ctx.launch_bound, ring_or_flat_index(ctx, flat_index, positions, ring,
                                                         num_tokens, closer))
    exists = (positions >= 0)[..., None]
    g_kv = jnp.where(exists, jnp.concatenate([kv, tail.kv.reshape(-1, kv.shape[-1])])[index], 0.0)
    g_score = jnp.where(exists, jnp.concatenate([score, tail.score.reshape(
        -1, score.shape[-1])])[index], -jnp.inf)

    def pool_and_finish(g_kv, g_score, row):                              # per new row
        if overlap:
            d = g_kv.shape[-1] // 2
            pooled = pool_rows(g_kv[:, None, rate:], g_score[:, None, rate:], overlap=True,
                               prev_kv=g_kv[:, :rate, :d], prev_score=g_score[:, :rate, :d],
                               invariant=invariant)
        else:
            pooled = pool_rows(g_kv[:, None], g_score[:, None], overlap=False, invariant=invariant)
        return finish_rows(pooled[:, 0], p.norm, row * rate, freqs, eps, pool.dtype,
                           invariant=invariant)

    rows = rowwise(pool_and_finish, g_kv, g_score, row)
    dest = settled(ctx.launch_bound,
                   row_index(ctx.block_table, ctx.seq[closer], row, rate, page_size))
    # unique (each closed row has its own page row) declared in batch-invariant mode only,
    # as for ragged.write_ring
    pool = pool.at[jnp.where(real, dest, pool.shape[0])].set(rows, mode="drop",
                                                             unique_indices=invariant)
    tail = CompressorTail(kv=write_ring(tail.kv, kv, ctx, invariant),
                          score=write_ring(tail.score, score, ctx, invariant))
    return pool, tail


def visible_rows(pool: Array, ctx: TokenContext, *, rate: int, page_size: int,
                 max_rows: int) -> tuple[Array, Array]:
    """All rows each token may see (HCA): (rows [T, max_rows, d], visible bool[T, max_rows])."""
    rows = jnp.arange(max_rows)
    index = settled(ctx.launch_bound,
                    row_index(ctx.block_table, ctx.seq[:, None], rows, rate, page_size))
    return pool[index], row_visibility(ctx, rate=rate, max_rows=max_rows)


def row_visibility(ctx: TokenContext, *, rate: int, max_rows: int) -> Array:
    """Which of its sequence's rows each token may see: bool[T, max_rows] (row w closes at
    token m*w + m - 1)."""
    return (jnp.arange(max_rows) < (ctx.positions[:, None] + 1) // rate) & ctx.valid[:, None]


def sequence_rows(pool: Array, block_table: Array, *, rate: int, page_size: int,
                  max_rows: int, launch_bound: bool) -> Array:
    """Every row of each batch row's sequence, once per sequence (not per token):
    [N, max_rows, d]. What the indexer kernel scores each token against."""
    rows = jnp.arange(max_rows)
    index = settled(launch_bound, row_index(block_table, jnp.arange(block_table.shape[0])[:, None],
                                            rows, rate, page_size))
    return pool[index]

