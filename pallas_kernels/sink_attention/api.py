"""Sink attention dispatch: the Mosaic GPU kernel or the jnp reference, same contract.

`sink_attention(q, rows, visible, sinks)` is reference.sink_attention's contract. On the
kernel path the rows are padded to whole blocks (padding invisible) and the heads to
multiples of the kernel's 64 (padding heads are dropped after), and the mask becomes an
additive bias. Shapes or dtypes the kernel does not take go to the reference.
"""

from __future__ import annotations

import contextlib
import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels.common import gpu_interpret, implementation, overridden
from pallas_kernels.sink_attention import mosaic_gpu, mosaic_gpu_ws, reference
from pallas_kernels.sink_attention.mosaic_gpu import HEADS, SMEM_BYTES, AttentionConfig
from pallas_kernels.sink_attention.mosaic_gpu_ws import WarpSpecializedConfig

Config = AttentionConfig | WarpSpecializedConfig

# On the H200 (kernels-attention-gpu-quick.md) the warp-specialised kernel runs an 8k-token
# prefill chunk's CSA attention in 1.9-2.0 ms against XLA's 4.4 ms; in decode it wins at batch 64 on
# the CSA layers' 640 rows and loses on the HCA layers' 160 and at batch 16 (XLA's fused path:
# 0.015 ms), and the kernel path concatenates a token's window and compressed rows, which the
# jnp path does not. So the model takes it for prefill-sized batches (MIN_TOKENS up); an env
# override (DEEPINFER_KERNELS, DEEPINFER_KERNEL_SINK_ATTENTION) takes it at every size.
VALIDATED_ON_GPU = True
MIN_TOKENS = 512


def default_config(tokens: int) -> WarpSpecializedConfig:
    """One program per token, all 512 dims (rows read once). Splitting a token's rows over
    programs (num_splits) helps only mid-sized decode batches (64 tokens: 0.032 ms with 2
    ranges against 0.036) and would make a token's sums depend on the config chosen for its
    batch, so it stays an explicit config."""
    return WarpSpecializedConfig()


def kernel_fits(q: jax.Array, rows: jax.Array, config: Config) -> bool:
    return (q.dtype == rows.dtype and q.dtype in (jnp.bfloat16, jnp.float16)
            and q.shape[-1] % config.columns == 0 and q.shape[-1] % 64 == 0
            and config.smem_bytes(q.shape[-1]) <= SMEM_BYTES)


def kernel_runs(q: jax.Array, rows: jax.Array, impl: str | None = None, *,
                invariant: bool = False) -> bool:
    """Whether the model's attention takes the kernel path for these operands. By default
    from MIN_TOKENS query tokens up, and never in batch-invariant mode, where the path must
    not follow the batch's size (the reference runs there, row tile by row tile)."""
    if impl is None:
        impl = implementation(VALIDATED_ON_GPU, "sink_attention")
        if not overridden("sink_attention") and (invariant or q.shape[0] < MIN_TOKENS):
            return False
    return impl != "reference" and kernel_fits(q, rows, default_config(q.shape[0]))


def sink_attention(q: jax.Array, rows: jax.Array, visible: jax.Array, sinks: jax.Array, *,
                   impl: str | None = None, config: Config | None = None) -> jax.Array:
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
    if impl == "interpret" and isinstance(config, WarpSpecializedConfig):
        config = dataclasses.replace(config, in_place=False)     # (see the field)
    kernel, combine = ((mosaic_gpu.sink_attention, mosaic_gpu.combine_splits)
                       if isinstance(config, AttentionConfig)
                       else (mosaic_gpu_ws.sink_attention, mosaic_gpu_ws.combine_splits))
    with gpu_interpret() if impl == "interpret" else contextlib.nullcontext():
        out = [kernel(q[:, g: g + HEADS], rows, bias.astype(jnp.float32), sinks[g: g + HEADS],
                      config=config)
               for g in range(0, heads + pad_heads, HEADS)]     # one launch per 64 heads
    if config.num_splits > 1:
        out = [combine(*partial).astype(q.dtype) for partial in out]
    return jnp.concatenate(out, axis=1)[:, :heads]
