"""Sinkhorn dispatch: the Mosaic GPU kernel or the jnp reference, same contract.

`sinkhorn(comb_logits, iters, eps)` is reference.sinkhorn's contract ([..., hc, hc] float32).
On the kernel path the tokens are flattened, padded to whole programs and laid out entry-major
(mosaic_gpu.py); XLA fuses those transposes with the producer and consumer.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp

from pallas_kernels.common import gpu_interpret, implementation
from pallas_kernels.sinkhorn import reference
from pallas_kernels.sinkhorn.mosaic_gpu import TOKENS_PER_PROGRAM, sinkhorn_entry_major

# The unrolled kernel matched the float64 formula on the H200 (tests/kernels/test_sinkhorn.py,
# gpu-tests.md) and took 41% off the tiny model's batch-1 decode step there
# (step-profile-gpu.md), but took ~9 s to lower per call (twice per layer per step variant).
# Its loop form lowers in 0.5 s, is the same arithmetic, and passed the same tests on the H200
# (2026-11-30, gpu-tests.md). DEEPINFER_KERNEL_SINKHORN=reference turns it off.
VALIDATED_ON_GPU = True


def kernel_runs(comb_logits: jax.Array, impl: str | None = None) -> bool:
    impl = impl or implementation(VALIDATED_ON_GPU, "sinkhorn")
    return impl != "reference" and comb_logits.dtype == jnp.float32


def sinkhorn(comb_logits: jax.Array, iters: int, eps: float, *,
             impl: str | None = None) -> jax.Array:
    """f32[..., hc, hc] -> near doubly-stochastic (reference.sinkhorn)."""
    impl = impl or implementation(VALIDATED_ON_GPU, "sinkhorn")
    if not kernel_runs(comb_logits, impl):
        return reference.sinkhorn(comb_logits, iters, eps)
    *batch, hc, _ = comb_logits.shape
    flat = comb_logits.reshape(-1, hc * hc)
    pad = -flat.shape[0] % TOKENS_PER_PROGRAM
    entry_major = jnp.pad(flat, ((0, pad), (0, 0))).T
    with gpu_interpret() if impl == "interpret" else contextlib.nullcontext():
        out = sinkhorn_entry_major(entry_major, hc=hc, iters=iters, eps=eps)
    return out.T[: flat.shape[0]].reshape(*batch, hc, hc)
