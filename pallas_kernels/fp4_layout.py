"""Orders of FP4 codes in memory: the checkpoint's rows, and the FP4 kernel's tiles and words.

The checkpoint stores a routed expert's codes row by row, `u8[..., N, K/2]` (two E2M1 codes a
byte along K). The FP4 grouped GEMM (grouped_gemm/mosaic_gpu_fp4.py) reads a program's weight
rows `block_k` inputs a step; it is faster when

* each step's `[block_n, block_k/2]` bytes are one contiguous piece (`to_tiles`: tile-major,
  `[..., N/block_n, K/block_k, block_n, block_k/2]`), one TMA copy instead of block_n rows
  K/2 bytes apart; and
* within a row, the bytes of every 4 scale groups are reordered into 32-bit words
  (`word_major`) so that one 16-byte shared-memory load gives a thread the bytes of 4 groups
  that the u8 layout gives it in eight 2-byte loads;
* within a scale group, the nibbles are re-paired (`halves`): the kernel reads a group's 16
  low nibbles as its first 16 inputs and the 16 high ones as the rest. The checkpoint pairs
  inputs 2j and 2j + 1 in byte j, so its activations must come permuted (`nibble_order`,
  a gather of every activation row each call); with byte j holding inputs j and j + 16 they
  come in their own order.

All are permutations of the same codes (no value changes, no size change), undone exactly by
`from_tiles`, `word_bytes` and `pairs`. The engine lays its FP4 stacks out so once, at load
(deepinfer_jax/weights/fp4_tiles.py); `quantized.Fp4Blocks` holds either order.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

# scale groups per 32-bit-word load (the kernel's `word_codes`) in the engine's stored order
STORED_WORD_GROUPS = 4


def word_major(packed: jax.Array, vector: int = 2) -> jax.Array:
    """u8[..., K/2] packed codes -> u32[..., K/8], the bytes of every `vector` scale groups
    (16 * vector bytes) reordered so that a `WORD_LAYOUTS[vector]` load of the words
    (fp4_dequant.py) gives each thread, in one register of `vector` words, the 4 bytes of each
    group it holds as a u8 WGMMA-layout load (bytes 2q, 2q + 1, 8 + 2q, 9 + 2q of the group
    for the thread's column quad q): one 8- or 16-byte shared-memory load where the bytes take
    2 * vector 2-byte ones. Word vector * q + e, byte 2t + p of a piece is group e's byte
    8t + 2q + p (little-endian words)."""
    *lead, half_k = packed.shape
    if half_k % (16 * vector):
        raise ValueError(f"word-major codes: K/2 = {half_k} bytes, not a multiple of "
                         f"{16 * vector}")
    pieces = packed.reshape(*lead, half_k // (16 * vector), vector, 2, 4, 2)   # [.., e, t, q, p]
    reordered = jnp.moveaxis(pieces, -2, -4)                                   # [.., q, e, t, p]
    return lax.bitcast_convert_type(reordered.reshape(*lead, half_k // 4, 4), jnp.uint32)


def word_bytes(words: jax.Array, vector: int) -> jax.Array:
    """`word_major(packed, vector)` -> packed: u32[..., K/8] -> u8[..., K/2]."""
    *lead, quarter = words.shape
    pieces = lax.bitcast_convert_type(words, jnp.uint8).reshape(
        *lead, quarter // (4 * vector), 4, vector, 2, 2)                       # [.., q, e, t, p]
    return jnp.moveaxis(pieces, -4, -2).reshape(*lead, 4 * quarter)


def halves(packed: jax.Array) -> jax.Array:
    """u8[..., K/2] codes paired as the checkpoint pairs them (byte j of a 32-input scale
    group: inputs 2j low, 2j + 1 high) -> byte j holding inputs j (low) and j + 16 (high)."""
    *lead, half_k = packed.shape
    group = packed.reshape(*lead, half_k // 16, 16)
    codes = jnp.stack([group & 0x0F, group >> 4], axis=-1).reshape(*lead, half_k // 16, 32)
    return (codes[..., :16] | (codes[..., 16:] << 4)).reshape(*lead, half_k)


def pairs(packed: jax.Array) -> jax.Array:
    """`halves`' inverse: byte j holding inputs j and j + 16 -> inputs 2j and 2j + 1."""
    *lead, half_k = packed.shape
    group = packed.reshape(*lead, half_k // 16, 16)
    codes = jnp.concatenate([group & 0x0F, group >> 4], axis=-1)          # inputs 0..31
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).reshape(*lead, half_k)


def to_tiles(packed: jax.Array, block_n: int, block_k: int) -> jax.Array:
    """Codes [..., N, W] (u8 bytes, W = K/2, or u32 words, W = K/8) -> [..., N/block_n,
    K/block_k, block_n, block_k * W/K]: row block r's step s one contiguous piece."""
    *lead, n, width = packed.shape
    per = 2 if packed.dtype == jnp.uint8 else 8          # codes an element holds
    if n % block_n or (width * per) % block_k:
        raise ValueError(f"FP4 tiles of {block_n} x {block_k}: codes {packed.shape} "
                         f"({width * per} inputs a row)")
    tiles = packed.reshape(*lead, n // block_n, block_n, width * per // block_k, block_k // per)
    return jnp.swapaxes(tiles, -3, -2)


def from_tiles(tiled: jax.Array) -> jax.Array:
    """`to_tiles`' inverse: [..., N/bn, K/bk, bn, w] -> [..., N, K/bk * w]."""
    *lead, row_blocks, steps, block_n, width = tiled.shape
    return jnp.swapaxes(tiled, -3, -2).reshape(*lead, row_blocks * block_n, steps * width)
