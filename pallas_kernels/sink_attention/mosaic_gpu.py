"""Decode / verify sink attention as a Mosaic GPU kernel (SM90: TMA pipeline + wgmma).

One program per (query token, block of `block_d` output dims). The token's 64 heads are the
wgmma M dimension (DeepSeek-V4's heads all share one K=V head, so they read each row once
together). The program keeps q [H, hd] in shared memory and streams the token's rows through
a TMA pipeline in blocks of `block_r`: scores S = q @ rows^T over the full head dim, the mask
as an additive bias (0 or -inf), an online softmax whose running max starts at the head's
sink logit (and its running sum at exp(0) = 1, the sink's own term), and P @ V for its
`block_d` output dims, V being that column slice of the row block already in shared memory
(the slice is static: one branch per column block). P goes through shared memory: wgmma can
take it from registers on the GPU, but interpret mode (CI) cannot. Splitting the 512 output
dims across programs keeps the f32 accumulator in one warpgroup's registers; each program
recomputes S (cheap: decode is bound by reading rows, and repeated reads of a row hit L2).
Each token's rows are summed in one fixed order, whatever the batch: batch-invariant.

With `num_splits` > 1 (flash-decoding), a token's rows are cut into that many contiguous
ranges, each its own program, so that a small batch still fills the SMs: each program returns
its unnormalised sum with its running max and sum, and `combine_splits` merges them (the sink
joins the first range). The split is a fixed config, not chosen from the batch, so it keeps
a token's sums independent of the batch too.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

HEADS = 64     # the wgmma M: the heads of one token
SMEM_BYTES = 232448   # per program (block) on SM90, as Mosaic GPU reports it


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    block_r: int = 64             # rows per pipeline step (P @ V's K: a multiple of 64)
    block_d: int = 128            # output dims per program
    max_concurrent_steps: int = 2
    num_splits: int = 1           # row ranges per token, each its own program

    @property
    def row_multiple(self) -> int:
        return self.block_r * self.num_splits

    @property
    def row_block_multiple(self) -> int:     # P @ V's K: a P tile's 128-byte swizzled rows
        return 64

    def smem_bytes(self, head_dim: int, dtype_bytes: int = 2) -> int:
        """Shared memory a program uses: q, P, the output tile (f32 when split: partial
        sums), and the row and bias blocks in flight."""
        out_bytes = dtype_bytes if self.num_splits == 1 else 4
        return (HEADS * head_dim * dtype_bytes + HEADS * self.block_r * dtype_bytes
                + HEADS * self.block_d * out_bytes
                + self.max_concurrent_steps * self.block_r * (head_dim * dtype_bytes + 4))

    @property
    def columns(self) -> int:       # output dims per program
        return self.block_d

    def check(self, heads: int, rows: int, head_dim: int) -> None:
        check_operands(self, heads, rows, head_dim)


def check_operands(config, heads: int, rows: int, head_dim: int) -> None:
    """What either kernel's config needs of its operands: the program fits an SM90's shared
    memory, 64 heads (the wgmma M), whole row blocks per range and whole column blocks."""
    if config.smem_bytes(head_dim) > SMEM_BYTES:
        raise ValueError(f"{config} needs {config.smem_bytes(head_dim)} bytes of shared "
                         f"memory, more than the {SMEM_BYTES} an SM90 program has")
    if heads != HEADS:
        raise ValueError(f"the kernel computes {HEADS} heads per token, got {heads}")
    if (config.block_r % config.row_block_multiple or rows % config.row_multiple
            or head_dim % config.columns or head_dim % 64):
        raise ValueError(f"rows={rows} and head_dim={head_dim} must be multiples of "
                         f"{config.row_multiple} and {config.columns}")


# A running max no score reaches, for the ranges without the sink: finite, so that a range
# whose rows are all invisible (scores -inf) rescales by exp(0) instead of exp(-inf + inf).
NO_PEAK = -1e30


def range_starts(sink_logits: jax.Array, splits: int) -> jax.Array:
    """Each row range's starting (running max, running sum) f32[splits, 2, H]: the first
    range holds the sink's term (max at its logit, sum exp(0) = 1), the others start empty."""
    heads = sink_logits.shape[0]
    return jnp.stack([jnp.full((splits, heads), NO_PEAK, jnp.float32).at[0].set(sink_logits),
                      jnp.zeros((splits, heads), jnp.float32).at[0].set(1.0)], axis=1)


def online_softmax(s: jax.Array, bias: jax.Array, scale: float, peak: jax.Array,
                   total: jax.Array, exp=jnp.exp):
    """One row block's step of the online softmax: raw scores s f32[H, R] and the additive
    mask bias f32[R] (0 or -inf), the running max and sum f32[H] -> (p f32[H, R] relative to
    the new max, alpha f32[H] the old sums' rescale factor, the new max, the new sum). `exp`
    is the base the scale and the maxima are in (jnp.exp2 with log2(e) folded in)."""
    s = s * scale + lax.broadcast_in_dim(bias, s.shape, [1])
    new_peak = jnp.maximum(peak, s.max(axis=1))
    alpha = exp(peak - new_peak)
    p = exp(s - lax.broadcast_in_dim(new_peak, s.shape, [0]))
    return p, alpha, new_peak, total * alpha + p.sum(axis=1)


def combine_splits(acc: jax.Array, stats: jax.Array) -> jax.Array:
    """Per-range results -> attention: acc f32[S, T, H, hd] (unnormalised), stats
    f32[S, T, 2, H] (running max, running sum) -> f32[T, H, hd]. Ranges are merged in index
    order, the same for every batch."""
    peak, total = stats[:, :, 0], stats[:, :, 1]
    weight = jnp.exp(peak - jnp.max(peak, axis=0))                          # [S, T, H]
    out = jnp.sum(weight[..., None] * acc, axis=0)
    return out / jnp.sum(weight * total, axis=0)[..., None]


# Jitted: the model calls it per layer with the same shapes, and jax lowers a jitted callee
# once per module (Mosaic GPU lowering is ~0.1-0.5 s a kernel).
@functools.partial(jax.jit, static_argnames=("config",))
def sink_attention(q: jax.Array, rows: jax.Array, bias: jax.Array, sinks: jax.Array, *,
                   config: AttentionConfig = AttentionConfig()) -> jax.Array:
    """q [T, 64, hd], rows [T, R, hd] (bf16), bias f32[T, R] (0 visible, -inf not),
    sinks f32[64] -> [T, 64, hd] in q's dtype; with config.num_splits = S > 1 the ranges'
    partial results instead: (acc f32[S, T, 64, hd], stats f32[S, T, 2, 64]) for
    combine_splits."""
    tokens, heads, head_dim = q.shape
    num_rows = rows.shape[1]
    config.check(heads, num_rows, head_dim)
    br, bd, splits = config.block_r, config.block_d, config.num_splits
    range_blocks = num_rows // br // splits
    scale = head_dim ** -0.5
    start = range_starts(sinks, splits)

    def body(q_ref, rows_ref, bias_ref, start_ref, *refs):
        *out_refs, q_smem, start_smem, p_smem, out_smem, stats_smem, barriers = refs
        token, dcol = lax.axis_index("token"), lax.axis_index("dcol")
        split = lax.axis_index("split")
        plgpu.copy_gmem_to_smem(q_ref.at[token], q_smem, barriers.at[0])
        plgpu.copy_gmem_to_smem(start_ref.at[split], start_smem, barriers.at[1])
        plgpu.barrier_wait(barriers.at[0])
        plgpu.barrier_wait(barriers.at[1])

        def attend(dims: slice):
            """The whole row loop for output dims `dims` (static: V is that column slice of
            the row block already in shared memory for S)."""
            def step(_, k_smem, bias_smem, carry):
                acc, peak, total = carry

                def scores(s_ref):
                    plgpu.wgmma(s_ref, q_smem, k_smem.T)
                    return s_ref[...]

                p, alpha, new_peak, total = online_softmax(
                    pl.run_scoped(scores, plgpu.ACC((heads, br))), bias_smem[...], scale,
                    peak, total)

                # P goes through shared memory (wgmma could take it from registers, GPU
                # interpret mode cannot), then this block's P @ V joins the rescaled sum.
                p_smem[...] = p.astype(p_smem.dtype)
                plgpu.commit_smem()

                def weighted_rows(pv_ref):
                    plgpu.wgmma(pv_ref, p_smem, k_smem.at[:, dims])
                    return pv_ref[...]

                pv = pl.run_scoped(weighted_rows, plgpu.ACC((heads, bd)))
                acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0]) + pv
                return acc, new_peak, total

            # The running max starts at the sink logit and the running sum at its term, 1
            # (in the first range; the others start empty).
            init = (jnp.zeros((heads, bd), jnp.float32), start_smem.at[0][...],
                    start_smem.at[1][...])
            first = split * range_blocks
            specs = [plgpu.BlockSpec((br, head_dim), lambda r: (first + r, 0)),
                     plgpu.BlockSpec((br,), lambda r: (first + r,))]
            acc, peak, total = plgpu.emit_pipeline(
                step, grid=(range_blocks,), in_specs=specs, init_carry=init,
                max_concurrent_steps=config.max_concurrent_steps)(
                rows_ref.at[token], bias_ref.at[token])
            if splits == 1:
                out_smem[...] = (acc / lax.broadcast_in_dim(total, acc.shape, [0])).astype(
                    out_smem.dtype)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(out_smem, out_refs[0].at[token, :, dims])
            else:
                out_smem[...] = acc
                if dims.start == 0:           # every column block has the same statistics
                    stats_smem.at[0][...] = peak
                    stats_smem.at[1][...] = total
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(out_smem, out_refs[0].at[split, token, :, dims])
                if dims.start == 0:
                    plgpu.copy_smem_to_gmem(stats_smem, out_refs[1].at[split, token])
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

        for c in range(head_dim // bd):      # one static column slice per program
            pl.when(dcol == c)(functools.partial(attend, slice(c * bd, (c + 1) * bd)))

    if splits == 1:
        out_type = jax.ShapeDtypeStruct(q.shape, q.dtype)
    else:
        out_type = (jax.ShapeDtypeStruct((splits, *q.shape), jnp.float32),
                    jax.ShapeDtypeStruct((splits, tokens, 2, heads), jnp.float32))
    kernel = plgpu.kernel(
        body, out_type=out_type,
        grid=(tokens, head_dim // bd, splits), grid_names=("token", "dcol", "split"),
        kernel_name=f"sink_attention_d{bd}_s{splits}",   # a profile's name for it
        scratch_types=[plgpu.SMEM((heads, head_dim), q.dtype),
                       plgpu.SMEM((2, heads), jnp.float32),
                       plgpu.SMEM((heads, br), q.dtype),
                       plgpu.SMEM((heads, bd), q.dtype if splits == 1 else jnp.float32),
                       plgpu.SMEM((2, heads), jnp.float32),
                       plgpu.Barrier(num_barriers=2)],
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup))
    return kernel(q, rows, bias, start)


