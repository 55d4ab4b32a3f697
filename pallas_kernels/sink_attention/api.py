"""Sink attention dispatch: the Mosaic GPU kernel or the jnp reference, same contract.

`sink_attention(q, rows, visible, sinks)` is reference.sink_attention's contract. On the
kernel path the rows are padded to whole blocks (padding invisible) and the heads to
multiples of the kernel's 64 (padding heads are dropped after), and the mask becomes an
additive bias. Shapes or dtypes the kernel does not take go to the reference.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp

from pallas_kernels.common import gpu_interpret, implementation
from pallas_kernels.sink_attention import reference
from pallas_kernels.sink_attention.mosaic_gpu import HEADS, SMEM_BYTES, AttentionConfig, combine_splits
from pallas_kernels.sink_attention.mosaic_gpu import sink_attention as kernel

# Its tests pass on the H200 (bench/results/gpu-tests.md), but in device time it beats the
# XLA path only at 64 decode tokens and is slower at 1-16 (kernels-attention-gpu.md): the
# reference stays the default on GPU until a config (e.g. num_splits) is ahead everywhere.
VALIDATED_ON_GPU = False


def default_config(tokens: int) -> AttentionConfig:
    """Few tokens (decode): 64 output dims per program, so that a small batch still spreads
    over the SMs (each program re-reads its token's rows, from L2 after the first); many
    tokens: 128, halving the repeated score computation. Neither changes a row's sums."""
    return AttentionConfig(block_d=64 if tokens < 64 else 128)


def kernel_fits(q: jax.Array, rows: jax.Array, config: AttentionConfig) -> bool:
    return (q.dtype == rows.dtype and q.dtype in (jnp.bfloat16, jnp.float16)
            and q.shape[-1] % config.block_d == 0 and q.shape[-1] % 64 == 0
            and config.smem_bytes(q.shape[-1]) <= SMEM_BYTES)


def kernel_runs(q: jax.Array, rows: jax.Array, impl: str | None = None) -> bool:
    """Whether sink_attention takes the kernel path for these operands."""
    impl = impl or implementation(VALIDATED_ON_GPU, "sink_attention")
    return impl != "reference" and kernel_fits(q, rows, default_config(q.shape[0]))


def sink_attention(q: jax.Array, rows: jax.Array, visible: jax.Array, sinks: jax.Array, *,
                   impl: str | None = None, config: AttentionConfig | None = None) -> jax.Array:
    """q [T, H, hd], rows [T, R, hd], visible bool[T, R], sinks f32[H] -> [T, H, hd]."""
    impl = impl or implementation(VALIDATED_ON_GPU, "sink_attention")
    config = config or default_config(q.shape[0])
    if impl == "reference" or not kernel_fits(q, rows, config):
        return reference.sink_attention(q, rows, visible, sinks)
    heads, num_rows = q.shape[1], rows.shape[1]
    pad_rows, pad_heads = -num_rows % config.row_multiple, -heads % HEADS
    rows = jnp.pad(rows, ((0, 0), (0, pad_rows), (0, 0)))
    bias = jnp.where(jnp.pad(visible, ((0, 0), (0, pad_rows))), 0.0, -jnp.inf)
    q = jnp.pad(q, ((0, 0), (0, pad_heads), (0, 0)))
    sinks = jnp.pad(sinks.astype(jnp.float32), (0, pad_heads))
    with gpu_interpret() if impl == "interpret" else contextlib.nullcontext():
        out = [kernel(q[:, g: g + HEADS], rows, bias.astype(jnp.float32), sinks[g: g + HEADS],
                      config=config)
               for g in range(0, heads + pad_heads, HEADS)]     # one launch per 64 heads
    if config.num_splits > 1:
        out = [combine_splits(*partial).astype(q.dtype) for partial in out]
    return jnp.concatenate(out, axis=1)[:, :heads]
