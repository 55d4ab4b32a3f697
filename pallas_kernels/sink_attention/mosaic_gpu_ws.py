"""Sink attention, warp-specialised (SM90): one memory and two compute warpgroups.

Same contract as mosaic_gpu.sink_attention. A program is one query token (or one range of its
rows, with `num_splits` > 1) and all 512 output dims: a memory warpgroup streams the token's
rows through shared memory in blocks of 64, and each compute warpgroup owns half of the
output dims (a [64 heads, 256] float32 accumulator, 128 registers a thread).

Scores (`split_scores`, the default): each warpgroup computes S = q @ rows^T for half of the
block's rows ([64, 32], over the full head dim), the two halves' row maxima are exchanged
through shared memory so that both hold the block's running max, and the two halves' P tiles
are exchanged too: each warpgroup then multiplies the whole block's P by its column half of
V. S is computed once (2/3 of the tensor-core work of computing it in both warpgroups, the
other form, kept as split_scores=False), for two meetings of the warpgroups a block. The
online softmax runs in base 2 (the running max starting at the head's sink logit, the running
sum at its term 2^0 = 1); P @ V adds into the rescaled accumulator in place (a separate
product tile spills registers and runs far slower on the prefill below).

So each row is read from HBM once for all heads and all dims, where the one-warpgroup kernel
(mosaic_gpu.py) reads it once per 128-dim column block and recomputes S as often. On the H200
a V4-Flash 8k-token prefill's CSA attention (640 rows a token) takes this kernel less than
half the time of XLA's path or the one-warpgroup kernel, and decode at batch 64 less than
XLA's (figures: docs/performance-log.md). Blocks of 32 rows (3 or 4 in flight) are slower: a
pipeline step costs time besides its work, and shared memory (q, two 64-row blocks) leaves no
room for longer blocks. A program running several tokens back to back (Pallas's pipeline of
pipelines, the next token's rows streaming in under the last one's end) is slower too, its
loop spilling registers. That prefill, its rows gathered per token beforehand, moves 6.5 GB
(rows 5.4, q and output 0.54 each), near the copy ceiling at the kernel's time, so HBM
bounds it; neighbouring tokens share most of their rows (a chunk's window and compressed rows
are ~12 MB), and reading them through indices in the kernel, from L2, is the way past that
(TMA's gather is SM100's; on SM90 a row per copy into the swizzled tile).

The output goes out through q's shared-memory tile once both warpgroups are done with q:
shared memory holds q (64 KiB), two row blocks (128 KiB) and the two P tiles, with no room
left for a separate output tile.

With `num_splits` > 1 each range writes its normalised result (bf16, as the output) with its
running max and sum (float32), and `combine_splits` weighs the ranges (the sink joins the
first). Ranges are fixed by the config, never by the batch: a token's sums run in one order
whatever the batch.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.sink_attention.mosaic_gpu import HEADS, check_operands, online_softmax, range_starts

COMPUTE_WGS = 2
LOG2_E = math.log2(math.e)


@dataclasses.dataclass(frozen=True)
class WarpSpecializedConfig:
    block_r: int = 64             # rows per pipeline step (a multiple of row_block_multiple)
    max_concurrent_steps: int = 2
    num_splits: int = 1           # row ranges per token, each its own program
    # The warpgroups take turns on the tensor cores (one's softmax under the other's wgmmas,
    # as FlashAttention-3 does): within the run-to-run spread on the H200
    # (docs/performance-log.md) and not yet through the whole test grid there, so opt-in.
    ping_pong: bool = False
    # P @ V adds into the rescaled sum in place: no second [64, 256] float32 tile (128
    # registers a thread). GPU interpret mode cannot run an initialised accumulator, so the
    # dispatch turns it off there.
    in_place: bool = True
    # Each warpgroup scores half of a block's rows (S = q @ rows[half]^T, [64, 32]) instead of
    # all of them: the block's scores are computed once, not twice (2/3 of the tensor-core
    # work), at the price of two exchanges through shared memory a block (the row halves'
    # maxima, then their P tiles, which both warpgroups multiply with their V columns).
    split_scores: bool = True

    @property
    def row_multiple(self) -> int:
        return self.block_r * self.num_splits

    @property
    def row_block_multiple(self) -> int:
        """block_r's multiple: P @ V's K (64: a P tile's 128-byte swizzled rows), or with
        split_scores two halves of 16 rows (wgmma's K step)."""
        return 32 if self.split_scores else 64

    def smem_bytes(self, head_dim: int, dtype_bytes: int = 2) -> int:
        """q (also the output tile), the two P tiles, the row and bias blocks in flight and
        the few statistics vectors."""
        return (HEADS * head_dim * dtype_bytes
                + COMPUTE_WGS * HEADS * self.block_r * dtype_bytes     # (split: 2 steps' halves)
                + self.max_concurrent_steps * self.block_r * (head_dim * dtype_bytes + 4)
                + 4 * HEADS * 4
                + (2 + 1) * COMPUTE_WGS * HEADS * 4 * self.split_scores)   # the exchanges

    @property
    def columns(self) -> int:       # output dims per compute warpgroup, times two
        return 64 * COMPUTE_WGS

    def check(self, heads: int, rows: int, head_dim: int) -> None:
        check_operands(self, heads, rows, head_dim)
        if self.split_scores and self.ping_pong:
            raise ValueError("split_scores takes no ping-pong (the warpgroups meet twice a block)")


def combine_splits(out: jax.Array, stats: jax.Array) -> jax.Array:
    """Per-range normalised results -> attention: out [S, T, H, hd], stats f32[S, T, 2, H]
    (running max, running sum) -> f32[T, H, hd]. A range's weight is its share of the
    softmax's denominator; ranges are merged in index order, the same for every batch."""
    peak, total = stats[:, :, 0], stats[:, :, 1]          # (the max in base-2 units)
    weight = jnp.exp2(peak - jnp.max(peak, axis=0)) * total                  # [S, T, H]
    merged = jnp.sum(weight[..., None] * out.astype(jnp.float32), axis=0)
    return merged / jnp.sum(weight, axis=0)[..., None]


# Jitted: the model calls it per layer with the same shapes, and jax lowers a jitted callee
# once per module (Mosaic GPU lowering is ~0.1-0.5 s a kernel).
@functools.partial(jax.jit, static_argnames=("config",))
def sink_attention(q: jax.Array, rows: jax.Array, bias: jax.Array, sinks: jax.Array, *,
                   config: WarpSpecializedConfig = WarpSpecializedConfig()):
    """q [T, 64, hd], rows [T, R, hd] (bf16), bias f32[T, R] (0 visible, -inf not),
    sinks f32[64] -> [T, 64, hd] in q's dtype; with config.num_splits = S > 1 the ranges'
    results instead: (out [S, T, 64, hd], stats f32[S, T, 2, 64]) for combine_splits."""
    tokens, heads, head_dim = q.shape
    num_rows = rows.shape[1]
    config.check(heads, num_rows, head_dim)
    br, splits = config.block_r, config.num_splits
    range_blocks = num_rows // br // splits
    half = head_dim // COMPUTE_WGS
    half_r = br // COMPUTE_WGS        # split_scores: the rows a warpgroup scores
    # Scores in base 2 (exp2 is the hardware's exponential): log2(e) folded into the scale,
    # the running max (and the sink logit it starts at) in base-2 units too.
    scale = head_dim ** -0.5 * LOG2_E
    start = range_starts(sinks * LOG2_E, splits)

    def body(q_ref, rows_ref, bias_ref, start_ref, *out_refs):
        token, split, wg = lax.axis_index("token"), lax.axis_index("split"), lax.axis_index("wg")
        first = split * range_blocks
        operands = (rows_ref.at[token], bias_ref.at[token])

        def pipeline(step, compute_context):
            specs = [plgpu.BlockSpec((br, head_dim), lambda r: (first + r, 0)),
                     plgpu.BlockSpec((br,), lambda r: (first + r,))]
            return plgpu.emit_pipeline_warp_specialized(
                step, grid=(range_blocks,), memory_registers=40, in_specs=specs,
                wg_axis="wg", num_compute_wgs=COMPUTE_WGS,
                max_concurrent_steps=config.max_concurrent_steps,
                compute_context=compute_context)

        ignore = lambda *_, **__: None  # noqa: E731
        @functools.partial(
            pl.run_scoped, allocations=pipeline(ignore, ignore).get_allocations(*operands),
            q_smem=plgpu.SMEM((heads, head_dim), q.dtype),
            # P: each warpgroup's tile of the block, or with split_scores the two row
            # halves' tiles, by step parity
            p_smem=(plgpu.SMEM((2, COMPUTE_WGS, heads, half_r), q.dtype) if config.split_scores
                    else plgpu.SMEM((COMPUTE_WGS, heads, br), q.dtype)),
            start_smem=plgpu.SMEM((2, heads), jnp.float32),
            stats_smem=plgpu.SMEM((2, heads), jnp.float32),
            # split_scores: the row halves' maxima (by step parity), the warpgroups' sums
            peaks_smem=plgpu.SMEM((2, COMPUTE_WGS, heads), jnp.float32),
            totals_smem=plgpu.SMEM((COMPUTE_WGS, heads), jnp.float32),
            barriers=plgpu.Barrier(num_barriers=2),
            syncs=plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=5),
            collective_axes="wg")
        def scope(allocations, q_smem, p_smem, start_smem, stats_smem, peaks_smem, totals_smem,
                  barriers, syncs):
            def exchange(barrier: int, *, for_wgmma: bool):
                """Both warpgroups' shared-memory writes so far are visible to both: to their
                loads through the barrier alone (its arrival releases, its wait acquires), to
                wgmma (the async proxy) after a fence too."""
                if for_wgmma:
                    plgpu.commit_smem()
                plgpu.barrier_arrive(syncs.at[barrier])
                plgpu.barrier_wait(syncs.at[barrier])

            def take_turns():
                """The two warpgroups alternate on the tensor cores (FlashAttention-3's
                ping-pong): one's softmax runs while the other's wgmmas do. A barrier both
                must reach; warpgroup 1 starts one turn behind, warpgroup 0 ends one after."""
                if config.ping_pong:
                    plgpu.barrier_arrive(syncs.at[2])
                    plgpu.barrier_wait(syncs.at[2])

            def step(_, rows_smem, bias_smem, carry):
                acc, peak, total = carry

                def scores(s_ref):
                    plgpu.wgmma(s_ref, q_smem, rows_smem.T)
                    take_turns()       # the other warpgroup's softmax ends; its P @ V goes
                    return s_ref[...]

                p, alpha, new_peak, total = online_softmax(
                    pl.run_scoped(scores, plgpu.ACC((heads, br))), bias_smem[...], scale,
                    peak, total, exp=jnp.exp2)
                # P through shared memory (wgmma could take it from registers on the GPU;
                # interpret mode, which CI runs, cannot).
                mine = p_smem.at[wg]
                mine[...] = p.astype(mine.dtype)
                plgpu.commit_smem()
                take_turns()           # our softmax is done: wait for the tensor cores

                acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                v_half = rows_smem.at[:, pl.ds(wg * half, half)]
                if config.in_place:
                    def accumulate(acc_ref):
                        plgpu.wgmma(acc_ref, mine, v_half)
                    acc = pl.run_state(accumulate)(plgpu.ACC.init(acc))
                else:
                    def weighted_rows(pv_ref):
                        plgpu.wgmma(pv_ref, mine, v_half)
                        return pv_ref[...]
                    acc = acc + pl.run_scoped(weighted_rows, plgpu.ACC((heads, half)))
                return acc, new_peak, total

            def step_split_scores(indices, rows_smem, bias_smem, carry):
                """This warpgroup scores its half of the block's rows; the halves' maxima give
                both warpgroups the block's new running max (so the same rescale alpha), and
                the halves' P tiles, exchanged, multiply each warpgroup's V columns. The sum
                of p each warpgroup keeps is over its own rows (added up at the end).

                Exchanged values sit in the slot of the step's parity: a warpgroup can be at
                most one exchange ahead of the other, so it never overwrites a slot the other
                still reads (the first barrier of step j + 1 waits for the second of j)."""
                acc, peak, total = carry
                slot = indices[0] % 2
                rows_mine = rows_smem.at[pl.ds(wg * half_r, half_r)]

                def scores(s_ref):
                    plgpu.wgmma(s_ref, q_smem, rows_mine.T)
                    return s_ref[...]

                s = pl.run_scoped(scores, plgpu.ACC((heads, half_r)))
                bias = bias_smem[pl.ds(wg * half_r, half_r)]
                s = s * scale + lax.broadcast_in_dim(bias, s.shape, [1])
                peaks_smem.at[slot, wg][...] = s.max(axis=1)
                exchange(2, for_wgmma=False)
                new_peak = jnp.maximum(peak, jnp.maximum(peaks_smem.at[slot, 0][...],
                                                         peaks_smem.at[slot, 1][...]))
                alpha = jnp.exp2(peak - new_peak)
                p = jnp.exp2(s - lax.broadcast_in_dim(new_peak, s.shape, [0]))
                p_smem.at[slot, wg][...] = p.astype(p_smem.dtype)
                exchange(3, for_wgmma=True)

                acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                v_half = rows_smem.at[:, pl.ds(wg * half, half)]

                def weighted_rows(acc_ref):
                    for h in range(COMPUTE_WGS):
                        plgpu.wgmma(acc_ref, p_smem.at[slot, h],
                                    v_half.at[pl.ds(h * half_r, half_r)])

                def product(pv_ref):
                    weighted_rows(pv_ref)
                    return pv_ref[...]
                if config.in_place:
                    acc = pl.run_state(weighted_rows)(plgpu.ACC.init(acc))
                else:
                    acc = acc + pl.run_scoped(product, plgpu.ACC((heads, half)))
                return acc, new_peak, total * alpha + p.sum(axis=1)

            def compute_context(eval_pipeline):
                @pl.when(wg == 0)
                def _():
                    plgpu.copy_gmem_to_smem(q_ref.at[token], q_smem, barriers.at[0])
                    plgpu.copy_gmem_to_smem(start_ref.at[split], start_smem, barriers.at[1])
                plgpu.barrier_wait(barriers.at[0])
                plgpu.barrier_wait(barriers.at[1])
                start_total = start_smem.at[1][...]
                if config.split_scores:      # the sink's term is counted by warpgroup 0 alone
                    start_total = start_total * (wg == 0).astype(jnp.float32)
                init = (jnp.zeros((heads, half), jnp.float32), start_smem.at[0][...], start_total)
                pl.when(wg == 1)(take_turns)
                acc, peak, total = eval_pipeline(init)
                pl.when(wg == 0)(take_turns)
                # Both warpgroups are done reading q: its tile takes the output, each
                # warpgroup writing its half, and goes out in one copy (a column half of a
                # swizzled tile is not contiguous, as a copy needs).
                if config.split_scores:      # each warpgroup summed p over its own rows
                    totals_smem.at[wg][...] = total
                plgpu.barrier_arrive(syncs.at[0])
                plgpu.barrier_wait(syncs.at[0])
                if config.split_scores:
                    total = totals_smem.at[0][...] + totals_smem.at[1][...]
                # A range with no visible row and no sink has total 0 (and acc 0).
                out = acc / lax.broadcast_in_dim(jnp.maximum(total, 1e-30), acc.shape, [0])
                for c in range(COMPUTE_WGS):
                    @pl.when(wg == c)
                    def _():
                        q_smem.at[:, pl.ds(c * half, half)][...] = out.astype(q_smem.dtype)
                plgpu.commit_smem()
                plgpu.barrier_arrive(syncs.at[1])
                plgpu.barrier_wait(syncs.at[1])

                @pl.when(wg == 0)
                def _():
                    if splits == 1:
                        plgpu.copy_smem_to_gmem(q_smem, out_refs[0].at[token])
                    else:              # the warpgroups' statistics are equal
                        stats_smem.at[0][...] = peak
                        stats_smem.at[1][...] = total
                        plgpu.commit_smem()
                        plgpu.copy_smem_to_gmem(q_smem, out_refs[0].at[split, token])
                        plgpu.copy_smem_to_gmem(stats_smem, out_refs[1].at[split, token])
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

            pipeline(step_split_scores if config.split_scores else step,
                     compute_context)(*operands, allocations=allocations)

    if splits == 1:
        out_type = jax.ShapeDtypeStruct(q.shape, q.dtype)
    else:
        out_type = (jax.ShapeDtypeStruct((splits, *q.shape), q.dtype),
                    jax.ShapeDtypeStruct((splits, tokens, 2, heads), jnp.float32))
    kernel = plgpu.kernel(
        body, out_type=out_type, grid=(tokens, splits), grid_names=("token", "split"),
        kernel_name=f"sink_attention_ws_s{splits}",    # a profile's name for it
        num_threads=COMPUTE_WGS + 1, thread_name="wg",
        compiler_params=plgpu.CompilerParams(
            approx_math=True, lowering_semantics=plgpu.LoweringSemantics.Warpgroup))
    return kernel(q, rows, bias, start)
