"""The Sinkhorn normalisation in plain jnp, as elementwise ops over the small hc axes.

A row softmax, then alternate column and row scaling, each sum over the hc (4) entries
written as adds in index order: no reductions, so XLA fuses neighbouring steps, and the order
is fixed whatever the batch. XLA still splits the 19 iterations into a kernel or so each (a
step's every entry depends on all entries of the one before), which is what the kernel
(mosaic_gpu.py) avoids.
"""

from __future__ import annotations

import functools
import operator

import jax
import jax.numpy as jnp


def fold_over(x: jax.Array, axis: int, op=operator.add) -> jax.Array:
    """Reduce a small static axis with `op` in index order (keepdims), elementwise ops only."""
    parts = [jax.lax.slice_in_dim(x, i, i + 1, axis=axis) for i in range(x.shape[axis])]
    return functools.reduce(op, parts)


def sinkhorn(comb_logits: jax.Array, iters: int, eps: float) -> jax.Array:
    """f32[..., hc, hc] -> near doubly-stochastic: row softmax (+ eps), column normalisation,
    then `iters - 1` times row then column normalisation (each sum + eps)."""
    exp = jnp.exp(comb_logits - fold_over(comb_logits, -1, jnp.maximum))
    comb = exp / fold_over(exp, -1) + eps
    comb = comb / (fold_over(comb, -2) + eps)
    for _ in range(iters - 1):
        comb = comb / (fold_over(comb, -1) + eps)
        comb = comb / (fold_over(comb, -2) + eps)
    return comb


def sinkhorn_loop(comb_logits: jax.Array, iters: int, eps: float) -> jax.Array:
    """The same arithmetic as a loop of reductions: where launches are cheap (the CPU) it
    compiles faster, and there XLA's vectorised elementwise code would give a row other
    last bits in batches of other sizes, which the loop's reductions do not (batch-invariant
    mode off the kernel). On a GPU it runs ~5 launches per iteration."""
    comb = jax.nn.softmax(comb_logits, axis=-1) + eps
    comb = comb / (jnp.sum(comb, axis=-2, keepdims=True) + eps)

    def row_then_column(_, c):
        c = c / (jnp.sum(c, axis=-1, keepdims=True) + eps)
        return c / (jnp.sum(c, axis=-2, keepdims=True) + eps)

    return jax.lax.fori_loop(0, iters - 1, row_then_column, comb)
