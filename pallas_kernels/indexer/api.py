"""Indexer scores: the implementation table ("mosaic_gpu", "interpret", "reference").

`indexer_scores(q, keys, weights, token_seq, implementation=...)` is reference.indexer_scores's
contract: each token scores its own sequence's compressed keys. The kernel multiplies in the
keys' dtype (bf16: the queries are rounded to it, as the HF model's are); the reference in
the queries' dtype. On the kernel path the key rows are padded to the kernel's ranges (zero
keys, their scores cut off after) and padding tokens' scores set to 0 (the kernel leaves them
unwritten).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.common import NotSupported, dispatch, in_row_tiles, kernel_mode
from pallas_kernels.indexer import reference
from pallas_kernels.indexer.mosaic_gpu import HEADS, IndexerConfig
from pallas_kernels.indexer.mosaic_gpu import indexer_scores as kernel


def default_config(tokens: int) -> IndexerConfig:
    """Few tokens (decode): 256-row ranges, so that a small batch still has a few programs per
    SM (64 tokens x 4k context: 256 programs, not 64); many: 1024-row ranges, fewer reloads
    of each token's queries. The block (block_r) stays, so a score's sums do not change."""
    return IndexerConfig(range_rows=256 if tokens < 512 else 1024)


def indexer_scores(q: jax.Array, keys: jax.Array, weights: jax.Array, token_seq: jax.Array, *,
                   implementation: str | tuple[str, ...] = "reference",
                   config: IndexerConfig | None = None, row_tile: int | None = None
                   ) -> jax.Array:
    """q [T, H, d], keys [N, R, d], weights f32[T, H], token_seq i32[T] (-1: padding) ->
    f32[T, R]. row_tile: the reference scores the tokens in tiles of this many, one after
    the other, its heads summed in a fixed order (batch-invariant mode); the kernel scores
    each token in its own program."""
    return dispatch("indexer", _TABLE, implementation, q, keys, weights, token_seq,
                    config=config, row_tile=row_tile)


def _reference(q, keys, weights, token_seq, *, config, row_tile):
    if row_tile is None:
        return reference.indexer_scores(q, keys, weights, token_seq)
    return in_row_tiles(lambda q, w, s: reference.indexer_scores(q, keys, w, s,
                                                                 ordered_heads=True),
                        row_tile, q, weights, token_seq)


def _kernel(q, keys, weights, token_seq, *, config, row_tile, interpret: bool):
    if keys.dtype != jnp.bfloat16 or q.shape[1] != HEADS or q.shape[-1] % 64:
        raise NotSupported(f"q {q.dtype}{q.shape}, keys {keys.dtype} (the kernel takes bf16 "
                           f"keys, {HEADS} heads, dims a multiple of 64)")
    q = q.astype(keys.dtype)
    config = config or default_config(q.shape[0])
    rows = keys.shape[1]
    pad = -rows % config.row_multiple(rows)
    keys = jnp.pad(keys, ((0, 0), (0, pad), (0, 0)))
    with kernel_mode(interpret):
        out = kernel(q, keys, weights.astype(jnp.float32), token_seq.astype(jnp.int32),
                     config=config)
    return jnp.where((token_seq >= 0)[:, None], out[:, :rows], 0.0)


_TABLE = {
    "mosaic_gpu": functools.partial(_kernel, interpret=False),
    "interpret": functools.partial(_kernel, interpret=True),
    "reference": _reference,
}
