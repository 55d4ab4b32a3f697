"""Indexer-score dispatch: the Mosaic GPU kernel or the jnp reference, same contract.

`indexer_scores(q, keys, weights, token_seq)` is reference.indexer_scores's contract: each
token scores its own sequence's compressed keys. On the kernel path the key rows are padded
to the kernel's ranges (zero keys, their scores cut off after) and padding tokens' scores
set to 0 (the kernel leaves them unwritten). Shapes or dtypes the kernel does not take go to
the reference.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp

from pallas_kernels.common import gpu_interpret, implementation
from pallas_kernels.indexer import reference
from pallas_kernels.indexer.mosaic_gpu import HEADS, IndexerConfig
from pallas_kernels.indexer.mosaic_gpu import indexer_scores as kernel

# tests/kernels/test_indexer.py passed on the H200 (2026-11-30) and the kernel path ran 1.3-4.5x
# faster than the XLA path with the same top-k (bench/results/kernels-indexer-gpu.md): the
# default on SM90+ GPUs since. DEEPINFER_KERNEL_INDEXER=reference asks for the XLA path.
VALIDATED_ON_GPU = True


def default_config(tokens: int) -> IndexerConfig:
    """Few tokens (decode): 256-row ranges, so that a small batch still has a few programs per
    SM (64 tokens x 4k context: 256 programs, not 64); many: 1024-row ranges, fewer reloads
    of each token's queries. The block (block_r) stays, so a score's sums do not change."""
    return IndexerConfig(range_rows=256 if tokens < 512 else 1024)


def kernel_fits(q: jax.Array, keys: jax.Array) -> bool:
    return (q.dtype == keys.dtype == jnp.bfloat16 and q.shape[1] == HEADS
            and q.shape[-1] % 64 == 0)


def kernel_runs(q: jax.Array, keys: jax.Array, impl: str | None = None) -> bool:
    """Whether indexer_scores takes the kernel path for these operands."""
    impl = impl or implementation(VALIDATED_ON_GPU, "indexer")
    return impl != "reference" and kernel_fits(q, keys)


def indexer_scores(q: jax.Array, keys: jax.Array, weights: jax.Array, token_seq: jax.Array, *,
                   impl: str | None = None, config: IndexerConfig | None = None) -> jax.Array:
    """q [T, H, d], keys [N, R, d], weights f32[T, H], token_seq i32[T] (-1: padding) ->
    f32[T, R]."""
    impl = impl or implementation(VALIDATED_ON_GPU, "indexer")
    if not kernel_runs(q, keys, impl):
        return reference.indexer_scores(q, keys, weights, token_seq)
    config = config or default_config(q.shape[0])
    rows = keys.shape[1]
    pad = -rows % config.row_multiple(rows)
    keys = jnp.pad(keys, ((0, 0), (0, pad), (0, 0)))
    with gpu_interpret() if impl == "interpret" else contextlib.nullcontext():
        out = kernel(q, keys, weights.astype(jnp.float32), token_seq.astype(jnp.int32),
                     config=config)
    return jnp.where((token_seq >= 0)[:, None], out[:, :rows], 0.0)
