"""Sink attention: the implementation table ("mosaic_gpu", "interpret", "reference").

`sink_attention(q, rows, visible, sinks, implementation=...)` is reference.sink_attention's
contract (row sets, one softmax over all of them). The kernels take the sets concatenated,
the rows padded to whole blocks (padding invisible) and the heads to multiples of the
kernel's 64 (padding heads dropped after), the mask as an additive bias; they raise
NotSupported for dtypes or head dims they do not take, and for batches under `min_tokens`
query tokens (the caller's size policy: config/options.py).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from pallas_kernels.common import NotSupported, dispatch, in_row_tiles, kernel_mode
from pallas_kernels.sink_attention import mosaic_gpu, mosaic_gpu_ws, reference
from pallas_kernels.sink_attention.mosaic_gpu import HEADS, SMEM_BYTES, AttentionConfig
from pallas_kernels.sink_attention.mosaic_gpu_ws import WarpSpecializedConfig

Config = AttentionConfig | WarpSpecializedConfig


def default_config(tokens: int) -> WarpSpecializedConfig:
    """One program per token, all 512 dims (rows read once). Splitting a token's rows over
    programs (num_splits) helps only mid-sized decode batches and would make a token's sums
    depend on the config chosen for its batch, so it stays an explicit config."""
    return WarpSpecializedConfig()


def kernel_fits(q: jax.Array, rows: jax.Array, config: Config) -> bool:
    return (q.dtype == rows.dtype and q.dtype in (jnp.bfloat16, jnp.float16)
            and q.shape[-1] % config.columns == 0 and q.shape[-1] % 64 == 0
            and config.smem_bytes(q.shape[-1]) <= SMEM_BYTES)


def sink_attention(q: jax.Array, rows: jax.Array | tuple[jax.Array, ...],
                   visible: jax.Array | tuple[jax.Array, ...], sinks: jax.Array, *,
                   implementation: str | tuple[str, ...] = "reference",
                   config: Config | None = None, min_tokens: int = 0,
                   row_tile: int | None = None) -> jax.Array:
    """q [T, H, hd], rows [T, R, hd] or a tuple of row sets, visible bool[T, R] (or one per
    set), sinks f32[H] -> [T, H, hd]. row_tile: the reference computes the tokens in tiles of
    this many, one after the other (batch-invariant mode); the kernels run a program per
    token anyway."""
    rows, visible = reference.as_sets(rows), reference.as_sets(visible)
    return dispatch("sink_attention", _TABLE, implementation, q, rows, visible, sinks,
                    config=config, min_tokens=min_tokens, row_tile=row_tile)


def _reference(q, rows, visible, sinks, *, config, min_tokens, row_tile):
    if row_tile is None:
        return reference.sink_attention(q, rows, visible, sinks)
    return in_row_tiles(lambda q, r, v: reference.sink_attention(q, r, v, sinks), row_tile,
                         q, rows, visible)


def _kernel(q, rows, visible, sinks, *, config, min_tokens, row_tile, interpret: bool):
    if q.shape[0] < min_tokens:
        raise NotSupported(f"{q.shape[0]} query tokens, fewer than min_tokens={min_tokens}")
    rows, visible = jnp.concatenate(rows, axis=1), jnp.concatenate(visible, axis=1)
    config = config or default_config(q.shape[0])
    if not kernel_fits(q, rows, config):
        raise NotSupported(f"q {q.dtype}{q.shape}, rows {rows.dtype}")
    heads, num_rows = q.shape[1], rows.shape[1]
    pad_rows, pad_heads = -num_rows % config.row_multiple, -heads % HEADS
    rows = jnp.pad(rows, ((0, 0), (0, pad_rows), (0, 0)))
    bias = jnp.where(jnp.pad(visible, ((0, 0), (0, pad_rows))), 0.0, -jnp.inf)
    q = jnp.pad(q, ((0, 0), (0, pad_heads), (0, 0)))
    sinks = jnp.pad(sinks.astype(jnp.float32), (0, pad_heads))
    if interpret and isinstance(config, WarpSpecializedConfig):
        config = dataclasses.replace(config, in_place=False)     # (see the field)
    kernel, combine = ((mosaic_gpu.sink_attention, mosaic_gpu.combine_splits)
                       if isinstance(config, AttentionConfig)
                       else (mosaic_gpu_ws.sink_attention, mosaic_gpu_ws.combine_splits))
    with kernel_mode(interpret):
        out = [kernel(q[:, g: g + HEADS], rows, bias.astype(jnp.float32), sinks[g: g + HEADS],
                      config=config)
               for g in range(0, heads + pad_heads, HEADS)]     # one launch per 64 heads
    if config.num_splits > 1:
        out = [combine(*partial).astype(q.dtype) for partial in out]
    return jnp.concatenate(out, axis=1)[:, :heads]


_TABLE = {
    "mosaic_gpu": functools.partial(_kernel, interpret=False),
    "interpret": functools.partial(_kernel, interpret=True),
    "reference": _reference,
}
