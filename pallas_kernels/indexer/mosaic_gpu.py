"""The lightning indexer's scores as a Mosaic GPU kernel (SM90: TMA pipeline + wgmma).

One program per (query token, range of `range_rows` key rows): the token's 64 heads'
queries [64, d] and head weights stay in shared memory while its sequence's compressed keys
in that range stream through a TMA pipeline in blocks of `block_r` rows. Per block one wgmma
gives the block's dots with every head, keys as the M side ([block_r, d] @ q^T [d, 64], f32
accumulators), and the epilogue folds the heads in registers: relu, times the head's weight,
summed over the 64 columns -> `block_r` scores, kept in shared memory until the range is
done. Nothing [T, 64, R]-sized ever reaches memory, and the keys are read per sequence (from
L2 after the first of its tokens), not gathered per token. The ranges give a decode batch's
few tokens enough programs to spread over the SMs.

Each token's scores come from its own program with a fixed order of sums (K inside the
wgmma, heads across the accumulator's columns), whatever else is in the batch:
batch-invariant.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

HEADS = 64      # the wgmma N: one token's indexer heads


@dataclasses.dataclass(frozen=True)
class IndexerConfig:
    block_r: int = 128            # key rows per pipeline step (the wgmma M: a multiple of 64)
    range_rows: int = 1024        # key rows per program (a multiple of block_r)
    max_concurrent_steps: int = 2

    def row_multiple(self, rows: int) -> int:
        """What the key rows are padded to: whole ranges, or whole blocks when fewer."""
        return self.range_rows if rows > self.range_rows else self.block_r

    def check(self, heads: int, rows: int, head_dim: int) -> None:
        if heads != HEADS:
            raise ValueError(f"the kernel scores {HEADS} heads per token, got {heads}")
        if self.block_r % 64 or self.range_rows % self.block_r:
            raise ValueError(f"block_r a multiple of 64, range_rows of block_r ({self})")
        if rows % self.row_multiple(rows) or head_dim % 64:
            raise ValueError(f"rows={rows} must be a multiple of {self.row_multiple(rows)} "
                             f"and head_dim={head_dim} of 64")


# Jitted: every CSA layer calls it with the same shapes, lowered once per step.
@functools.partial(jax.jit, static_argnames=("config",))
def indexer_scores(q: jax.Array, keys: jax.Array, weights: jax.Array, token_seq: jax.Array,
                   *, config: IndexerConfig = IndexerConfig()) -> jax.Array:
    """q [T, 64, d] bf16, keys [N, R, d] bf16, weights f32[T, 64], token_seq i32[T] (-1:
    padding) -> f32[T, R]: sum_h w[t, h] relu(q[t, h] . keys[seq[t], r]) / sqrt(d). Padding
    tokens' rows are left unwritten."""
    tokens, heads, head_dim = q.shape
    rows = keys.shape[1]
    config.check(heads, rows, head_dim)
    br, span = config.block_r, min(config.range_rows, rows)
    scale = head_dim ** -0.5

    def body(seq_ref, q_ref, keys_ref, w_ref, out_ref, q_smem, w_smem, out_smem, barriers):
        token, part = lax.axis_index("token"), lax.axis_index("range")
        seq = seq_ref[token]

        @pl.when(seq >= 0)
        def _():
            plgpu.copy_gmem_to_smem(q_ref.at[token], q_smem, barriers.at[0])
            plgpu.copy_gmem_to_smem(w_ref.at[token], w_smem, barriers.at[1])
            plgpu.barrier_wait(barriers.at[0])
            plgpu.barrier_wait(barriers.at[1])

            def step(index, k_smem):
                (block,) = index

                def dots(acc_ref):
                    plgpu.wgmma(acc_ref, k_smem, q_smem.T)
                    return acc_ref[...]

                s = pl.run_scoped(dots, plgpu.ACC((br, heads)))                # [br, 64]
                w = lax.broadcast_in_dim(w_smem[...] * scale, (br, heads), [1])
                out_smem.at[pl.ds(block * br, br)][...] = (jnp.maximum(s, 0.0) * w).sum(axis=1)

            first = part * (span // br)
            plgpu.emit_pipeline(
                step, grid=(span // br,),
                in_specs=[plgpu.BlockSpec((br, head_dim), lambda r: (first + r, 0))],
                max_concurrent_steps=config.max_concurrent_steps)(keys_ref.at[seq])
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(out_smem, out_ref.at[token, pl.ds(part * span, span)])
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    kernel = plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct((tokens, rows), jnp.float32),
        grid=(tokens, rows // span), grid_names=("token", "range"),
        kernel_name=f"indexer_scores_r{span}",   # a profile's name for it
        scratch_types=[plgpu.SMEM((heads, head_dim), q.dtype),
                       plgpu.SMEM((heads,), jnp.float32),
                       plgpu.SMEM((span,), jnp.float32),
                       plgpu.Barrier(num_barriers=2)],
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup))
    return kernel(token_seq, q, keys, weights)
