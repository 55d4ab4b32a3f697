"""Sinkhorn: the implementation table ("mosaic_gpu", "interpret", "reference", "loop").

`sinkhorn(comb_logits, iters, eps, implementation=...)` is reference.sinkhorn's contract
([..., hc, hc] float32). "reference" is the unrolled elementwise form (about a kernel per
iteration on a GPU), "loop" the same arithmetic as a loop of reductions (the CPU's form). On
the kernel path the tokens are flattened, padded to whole programs and laid out entry-major
(mosaic_gpu.py); XLA fuses those transposes with the producer and consumer.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.common import NotSupported, dispatch, kernel_mode
from pallas_kernels.sinkhorn import reference
from pallas_kernels.sinkhorn.mosaic_gpu import TOKENS_PER_PROGRAM, sinkhorn_entry_major


def sinkhorn(comb_logits: jax.Array, iters: int, eps: float, *,
             implementation: str | tuple[str, ...] = "reference") -> jax.Array:
    """f32[..., hc, hc] -> near doubly-stochastic (reference.sinkhorn)."""
    return dispatch("sinkhorn", _TABLE, implementation, comb_logits, iters, eps)

def _kernel(comb_logits: jax.Array, iters: int, eps: float, *, interpret: bool) -> jax.Array:
    if comb_logits.dtype != jnp.float32:
        raise NotSupported(f"{comb_logits.dtype} logits (the kernel takes float32)")
    *batch, hc, _ = comb_logits.shape
    flat = comb_logits.reshape(-1, hc * hc)
    pad = -flat.shape[0] % TOKENS_PER_PROGRAM
    entry_major = jnp.pad(flat, ((0, pad), (0, 0))).T
    with kernel_mode(interpret):
        out = sinkhorn_entry_major(entry_major, hc=hc, iters=iters, eps=eps)
    return out.T[: flat.shape[0]].reshape(*batch, hc, hc)

_TABLE = {
    "mosaic_gpu": functools.partial(_kernel, interpret=False),
    "interpret": functools.partial(_kernel, interpret=True),
    "reference": reference.sinkhorn,
    "loop": reference.sinkhorn_loop,
}
