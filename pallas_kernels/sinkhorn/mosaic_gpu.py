"""The Sinkhorn normalisation as one Mosaic GPU kernel (SM90; plain vector arithmetic).

Entry-major layout: the input is [hc * hc, T], one row per matrix entry, so that a program's
block of 128 tokens is hc * hc vectors and every step of the iteration is an elementwise op
between them (the entries' sums are adds in index order, as in the reference). All
iterations run in registers, as a loop inside the kernel: one launch for the whole
normalisation, where XLA runs about one kernel per iteration (19 x 2 per layer, a large share
of a small batch's launches).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

TOKENS_PER_PROGRAM = 128      # one warpgroup's worth of lanes per vector


@functools.partial(jax.jit, static_argnames=("hc", "iters", "eps"))
def sinkhorn_entry_major(logits: jax.Array, *, hc: int, iters: int, eps: float) -> jax.Array:
    """logits f32[hc * hc, T] (entry i * hc + j of token t at [i * hc + j, t]; T a multiple
    of TOKENS_PER_PROGRAM) -> the normalised matrices, same layout. Jitted: a step calls it
    twice per layer with one shape, and jax lowers a jitted callee once per module."""
    entries, tokens = logits.shape
    if entries != hc * hc or tokens % TOKENS_PER_PROGRAM:
        raise ValueError(f"expected [{hc * hc}, a multiple of {TOKENS_PER_PROGRAM}], "
                         f"got {logits.shape}")
    tb = TOKENS_PER_PROGRAM
    add = functools.partial(functools.reduce, jnp.add)

    def normalise(c):                         # c[i][j]: f32[tb] vectors
        rows = []
        for row in c:                         # row softmax, + eps
            peak = functools.reduce(jnp.maximum, row)
            e = [jnp.exp(v - peak) for v in row]
            total = add(e)
            rows.append([v / total + eps for v in e])

        def columns(c):
            sums = [add([c[i][j] for i in range(hc)]) + eps for j in range(hc)]
            return [[c[i][j] / sums[j] for j in range(hc)] for i in range(hc)]

        def row_then_column(_, flat):        # the loop carries the hc * hc vectors flat
            c = [flat[i * hc: (i + 1) * hc] for i in range(hc)]
            c = columns([[v / (add(row) + eps) for v in row] for row in c])
            return tuple(v for row in c for v in row)

        # A loop in the kernel, not Python unrolling: the same instructions per iteration, and
        # Mosaic's layout inference sees one iteration (unrolled, it lowers every iteration:
        # seconds a call, docs/performance-log.md).
        flat = lax.fori_loop(0, iters - 1, row_then_column,
                             tuple(v for row in columns(rows) for v in row))
        return [list(flat[i * hc: (i + 1) * hc]) for i in range(hc)]

    def body(logits_gmem, out_gmem, in_smem, out_smem, barrier):
        block = pl.ds(lax.axis_index("block") * tb, tb)
        plgpu.copy_gmem_to_smem(logits_gmem.at[:, block], in_smem, barrier.at[0])
        plgpu.barrier_wait(barrier.at[0])
        c = normalise([[in_smem[i * hc + j] for j in range(hc)] for i in range(hc)])
        for i in range(hc):
            for j in range(hc):
                out_smem[i * hc + j] = c[i][j]
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_smem, out_gmem.at[:, block])
        plgpu.wait_smem_to_gmem(0)

    return plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct(logits.shape, jnp.float32),
        grid=(tokens // tb,), grid_names=("block",), kernel_name="mhc_sinkhorn",
        scratch_types=[plgpu.SMEM((entries, tb), jnp.float32),
                       plgpu.SMEM((entries, tb), jnp.float32), plgpu.Barrier(num_barriers=1)],
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    )(logits)
