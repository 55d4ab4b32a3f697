"""Batch-invariant building blocks: results per row that do not depend on the batch.

A compiler picks a matmul's algorithm (and its reduction order) from the operand shapes, and
XLA fuses differently as shapes change, so a row's result can change with the number of rows
next to it. In batch-invariant mode every matmul-like op runs over fixed-size row tiles in a
loop: each tile is the same program whatever the batch, and rows never share a reduction.
Elementwise ops and row-wise reductions (norms, softmax, sorting) are already per row.
On a GPU where the Pallas grouped-GEMM kernel runs, `linear` uses its dense form instead
(fixed K tiles; K split only into ranges fixed by the weight's shape: row-invariant by
construction, at tensor-core speed).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import jax
import jax.numpy as jnp

from pallas_kernels.common import launch_bound
from pallas_kernels.grouped_gemm import api as gemm
from pallas_kernels.grouped_gemm import invariant as invariant_gemm


def invariant_tile() -> int:
    """Rows per tile: any fixed size is invariant, as long as it is the same for every run
    compared. 8 on the CPU (little padding for small batches); 64 on GPUs, where each tile is
    one more iteration of launches and re-reads the weights of every matmul it covers (the
    8-row tiles cost 84-91% of the throughput on the H200). DEEPINFER_INVARIANT_TILE
    overrides. A property of the device, not of the step formulation (launch_bound), so that
    both formulations compute the same numbers on one machine."""
    forced = os.environ.get("DEEPINFER_INVARIANT_TILE")
    return int(forced) if forced else default_invariant_tile()


def default_invariant_tile() -> int:
    return 8 if jax.default_backend() == "cpu" else 64


def untiled_segments() -> bool:
    """Whether batch-invariant mode runs the per-token segments whose every op is invariant
    by itself over the whole batch at once rather than tile by tile: their matmuls are
    `linear` (the GEMM kernel, or its own fixed row tiles), the rest elementwise ops and row
    reductions. That relies on XLA computing a row's elementwise ops and reductions the same
    way whatever the number of rows, which a GPU's code does and the CPU's vectorised loops do
    not, so only in the GPU formulation (launch_bound). On the H200 rows stayed bitwise
    invariant this way (test_rows_stay_invariant_on_the_kernels[untiled], 2026-11-30) and the
    mode's chunked 8k prefill gained 3% (batch-invariant-gpu-untiled.md); the default there
    since. DEEPINFER_INVARIANT_UNTILED=0 keeps the row tiles."""
    return launch_bound() and os.environ.get("DEEPINFER_INVARIANT_UNTILED", "1") != "0"


def per_row_tiles(fn: Callable, *args, tile: int | None = None):
    """Apply fn (row-wise: pytrees of [tile, ...] -> pytree of [tile, ...]) to fixed-size tiles
    of the leading axis of every array in `args`, one tile after the other."""
    rows, tile = jax.tree.leaves(args)[0].shape[0], tile or invariant_tile()
    pad = -rows % tile

    def to_tiles(a):
        return jnp.pad(a, [(0, pad)] + [(0, 0)] * (a.ndim - 1)).reshape(-1, tile, *a.shape[1:])

    out = jax.lax.map(lambda t: fn(*t), jax.tree.map(to_tiles, args))
    return jax.tree.map(lambda o: o.reshape(-1, *o.shape[2:])[:rows], out)


def linear(x: jax.Array, w: jax.Array, invariant: bool, out_dtype=None) -> jax.Array:
    """x [..., K] @ w [K, N], the result in out_dtype (default: the operands' type). With
    out_dtype float32 and bf16 operands this is a float32 matmul of them (each product is
    exact in float32, the sum is float32) without converting w first. Float32 operands are
    multiplied in float32: a GPU's default for them is TF32 (10-bit mantissas; the H200's
    profile showed XLA's float32 GEMMs as tf32 kernels), which the reference model, torch with
    TF32 off, does not use. Its only float32 user at size, mHC's 24-column projection, reads
    far more than it computes."""
    precision = jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else None

    def matmul(t):
        return jnp.matmul(t, w, preferred_element_type=out_dtype, precision=precision)

    if not invariant:
        return matmul(x)
    flat = x.reshape(-1, x.shape[-1])
    config = invariant_gemm.dense_invariant_config(flat.shape[0], w.shape[1], w.shape[0])
    if x.dtype == w.dtype and out_dtype in (None, x.dtype, jnp.float32) and gemm.kernel_runs(
            flat.shape[0], w.shape[0], w.shape[1], dtype=x.dtype, config=config):
        return invariant_gemm.matmul(flat, w, config=config, out_dtype=out_dtype).reshape(
            *x.shape[:-1], w.shape[-1])
    return per_row_tiles(matmul, flat).reshape(*x.shape[:-1], w.shape[-1])


def f32_linear(x: jax.Array, w: jax.Array, invariant: bool) -> jax.Array:
    """x @ w in float32 (the compressor's and the router's projections, float32 in the
    reference model). With both in bf16 every product is exact in float32 and the sum is
    float32, so it is the same quantity as the float32 matmul of their values, without a
    float32 copy of w and on a GPU at bf16 tensor-core speed (the batch-invariant mode's GEMM
    kernel instead of a loop of row tiles); otherwise both go to float32."""
    if x.dtype == w.dtype == jnp.bfloat16:
        return linear(x, w, invariant, out_dtype=jnp.float32)
    return linear(x.astype(jnp.float32), w.astype(jnp.float32), invariant)


def grouped_linear(x: jax.Array, w: jax.Array, invariant: bool) -> jax.Array:
    """x [..., G, K] @ w [G, K, N] per group g -> [..., G, N] (the attention's grouped
    low-rank output projection): one batched product, not G of them (G launches on a GPU)."""
    if not invariant:
        return jnp.einsum("...gk,gkn->...gn", x, w)
    groups, k, n = w.shape
    flat = x.reshape(-1, groups, k)
    config = invariant_gemm.dense_invariant_config(flat.shape[0] * groups, n)
    if x.dtype == w.dtype and gemm.kernel_runs(flat.shape[0] * groups, k, n, dtype=x.dtype,
                                               config=config):
        out = invariant_gemm.batched_matmul(flat.swapaxes(0, 1), w, config=config).swapaxes(0, 1)
    else:
        out = per_row_tiles(lambda t: jnp.einsum("tgk,gkn->tgn", t, w), flat)
    return out.reshape(*x.shape[:-1], n)


def ordered_sum(x: jax.Array, axis: int) -> jax.Array:
    """Sum over `axis` in a fixed pairwise tree: element i + element i + n/2, halving until one
    is left (an odd one out joins the next level). The grouping depends on the axis length
    alone, and each level is elementwise adds that no compiler regroups, unlike a reduction,
    which may be split into partial sums following the surrounding shapes. log2(n) steps
    rather than a loop of n (which on a GPU is n launches)."""
    x = jnp.moveaxis(x, axis, 0)
    while x.shape[0] > 1:
        half = x.shape[0] // 2
        paired = x[:half] + x[half: 2 * half]
        x = jnp.concatenate([paired, x[2 * half:]]) if x.shape[0] % 2 else paired
    return x[0]


def ordered_softmax(x: jax.Array, axis: int) -> jax.Array:
    """Softmax over `axis` with an ordered sum (the max is exact in any order)."""
    e = jnp.exp(x - jnp.max(x, axis=axis, keepdims=True))
    return e / jnp.expand_dims(ordered_sum(e, axis), axis)
