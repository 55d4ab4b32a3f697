"""The released checkpoint's weight formats as the kernels read them on the device.

DeepSeek-V4 ships its dense projections in FP8 and its routed experts in FP4. The device keeps
them so (about 4x fewer bytes than bf16 for the experts); the GEMMs dequantize as they read.

* `Fp8Blocks`: E4M3 codes in the model's `[in, out]` layout (`x @ w`), one float32 scale per
  128 x 128 block (DeepSeek-V4; V4.1's release uses 32 x 32 blocks: the block is a power of two
  read back from the codes' and scales' shapes, `fp8_block`; the GEMM kernels take 128 only,
  `kernel_blocks`). The checkpoint stores `[out, in]` codes and E8M0 scales; `fp8_from_checkpoint`
  transposes both once at load time (a byte copy, no rounding) and decodes the scales
  (exact: E8M0 is a power of two).
* `Fp4Blocks`: E2M1 codes packed two per byte along the input axis (low nibble = even input
  index), `[out, in/2]` as stored, with one E8M0 scale byte per 32 inputs of a row, kept
  group-major `[in/32, out]` (the checkpoint's `[out, in/32]` transposed once at load, so a
  scale group's bytes for consecutive output rows are contiguous: the FP4 kernel reads each
  as one shared-memory row); routed experts stack them `[E, out, in/2]`, `[E, in/32, out]`.
  Where the FP4 kernel runs, the engine holds the codes in its tile order instead (the same
  codes permuted once at load, fp4_layout.py: re-paired `halves` within each scale group,
  then `[..., out/bn, in/bk, bn, bk/2]` bytes or `[..., out/bn, in/bk, bn, bk/8]` u32
  words); `fp4_tile` says which, `fp4_rows` undoes it.

`dequantize` is the plain-jnp meaning of both: the CPU path's first step and the kernels'
test oracle.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from pallas_kernels import fp4_layout

FP8_BLOCK = 128
FP4_GROUP = 32
# E2M1 values by 4-bit code (bit 3: sign; bits 2-1: exponent, bias 1; bit 0: mantissa).
_FP4_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
FP4_VALUES = np.array(_FP4_MAGNITUDES + tuple(-m for m in _FP4_MAGNITUDES), np.float32)


class Fp8Blocks(NamedTuple):
    codes: jax.Array    # f8_e4m3fn[..., K, N]
    scale: jax.Array    # f32[..., ceil(K/bk), ceil(N/bn)]   bk, bn: 128 (V4) or 32 (V4.1)

    @property
    def shape(self) -> tuple[int, ...]:
        """The dequantized weight's shape."""
        return tuple(self.codes.shape)


class Fp4Blocks(NamedTuple):
    packed: jax.Array   # u8[..., N, K/2]   two E2M1 codes a byte, low nibble = even k
                        # or tiled: u8[..., N/bn, K/bk, bn, bk/2] / u32[..., N/bn, K/bk, bn, bk/8]
    scale: jax.Array    # u8[..., K/32, N]  E8M0 bits: 2 ** (byte - 127), group-major

    @property
    def shape(self) -> tuple[int, ...]:
        """The dequantized weight's shape in the model's layout: [..., K, N]."""
        *lead, k_groups, n = self.scale.shape
        return (*lead, FP4_GROUP * k_groups, n)


class Fp4Tile(NamedTuple):
    """The FP4 kernel's tile order of a stack's codes (fp4_layout.py; within each scale group
    the nibbles `halves`-paired, so the kernel takes its activations in their own order)."""
    block_n: int        # weight rows a tile
    block_k: int        # inputs a tile
    words: bool         # u32 words in fp4_layout.word_major order (else u8 bytes)


Quantized = Fp8Blocks | Fp4Blocks


def is_quantized(w) -> bool:
    return isinstance(w, (Fp8Blocks, Fp4Blocks))


def _pow2_at_least(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def fp8_block(w: Fp8Blocks) -> tuple[int, int]:
    """The (K, N) block of an Fp8Blocks from its shapes. A power-of-two block b gives a grid
    of r = ceil(K/b) rows, so b/2 < ceil(K/r) <= b where r > 1: b is the power of two at
    least ceil(K/r) (r = 1: one block spans K, and that power of two is as good)."""
    (k, n), (rk, rn) = w.codes.shape[-2:], w.scale.shape[-2:]
    return _pow2_at_least(-(-k // rk)), _pow2_at_least(-(-n // rn))


def kernel_blocks(w: Fp8Blocks) -> bool:
    """Whether the scale grid is the 128 x 128 one the FP8 GEMM kernels read."""
    k, n = w.codes.shape[-2:]
    return tuple(w.scale.shape[-2:]) == (-(-k // FP8_BLOCK), -(-n // FP8_BLOCK))


def nbytes(w) -> int:
    """Bytes the weight holds on the device (codes and scales)."""
    return sum(int(leaf.size) * leaf.dtype.itemsize for leaf in jax.tree.leaves(w))


def fp4_tile(w: Fp4Blocks) -> Fp4Tile | None:
    """The tile order w's codes are in; None: the checkpoint's rows."""
    if w.packed.ndim == w.scale.ndim:
        return None
    words = w.packed.dtype == jnp.uint32
    *_, block_n, width = w.packed.shape
    return Fp4Tile(block_n, width * (8 if words else 2), words)


def fp4_tiled(w: Fp4Blocks, tile: Fp4Tile) -> Fp4Blocks:
    """w (in the checkpoint's rows) with its codes in `tile`'s order (jnp; scales unchanged)."""
    if fp4_tile(w) is not None:
        raise ValueError(f"FP4 codes already tiled ({fp4_tile(w)})")
    packed = fp4_layout.halves(w.packed)
    if tile.words:
        packed = fp4_layout.word_major(packed, fp4_layout.STORED_WORD_GROUPS)
    return Fp4Blocks(fp4_layout.to_tiles(packed, tile.block_n, tile.block_k), w.scale)


def fp4_rows(w: Fp4Blocks) -> Fp4Blocks:
    """w with its codes in the checkpoint's rows, u8[..., N, K/2] (w itself if they are)."""
    tile = fp4_tile(w)
    if tile is None:
        return w
    packed = fp4_layout.from_tiles(w.packed)
    if tile.words:
        packed = fp4_layout.word_bytes(packed, fp4_layout.STORED_WORD_GROUPS)
    return Fp4Blocks(fp4_layout.pairs(packed), w.scale)


# ---- from the checkpoint's arrays (numpy, at load time) ---------------------------------

def e8m0_to_float(scale: np.ndarray) -> np.ndarray:
    if scale.dtype == np.uint8:
        scale = scale.view(ml_dtypes.float8_e8m0fnu)
    return np.asarray(scale).astype(np.float32)


def e8m0_bits(scale: np.ndarray) -> np.ndarray:
    """E8M0 scales as their bytes; float32 scales (Flash-Base) must be powers of two."""
    if scale.dtype in (np.uint8, np.dtype(ml_dtypes.float8_e8m0fnu)):
        return np.ascontiguousarray(scale).view(np.uint8)
    mantissa, exponent = np.frexp(scale.astype(np.float32))
    if np.any(mantissa != 0.5):
        raise ValueError("FP4 scales must be powers of two (E8M0)")
    return (exponent.astype(np.int32) - 1 + 127).astype(np.uint8)


def fp8_from_checkpoint(codes: np.ndarray, scale: np.ndarray) -> Fp8Blocks:
    """Stored E4M3 codes [out, in] and scales [ceil(out/bo), ceil(in/bi)] -> Fp8Blocks
    in [in, out] (numpy arrays; the caller places them)."""
    return Fp8Blocks(np.ascontiguousarray(codes.view(ml_dtypes.float8_e4m3fn).T),
                     np.ascontiguousarray(e8m0_to_float(scale).T))


def fp4_from_checkpoint(packed: np.ndarray, scale: np.ndarray) -> Fp4Blocks:
    """Stored packed E2M1 [..., out, in/2] (int8 or uint8) and scales [..., out, in/32] ->
    Fp4Blocks (the scales transposed to [..., in/32, out]; numpy arrays)."""
    return Fp4Blocks(np.ascontiguousarray(packed).view(np.uint8),
                     np.ascontiguousarray(np.swapaxes(e8m0_bits(scale), -1, -2)))


# ---- the meaning (jnp) ------------------------------------------------------------------

def _fp8_dequantize(w: Fp8Blocks, dtype) -> jax.Array:
    k, n = w.codes.shape[-2:]
    bk, bn = fp8_block(w)
    full = jnp.repeat(jnp.repeat(w.scale, bk, axis=-2), bn, axis=-1)
    return (w.codes.astype(jnp.float32) * full[..., :k, :n]).astype(dtype)


def fp4_codes(packed: jax.Array) -> jax.Array:
    """u8[..., N, K/2] -> u8[..., N, K] 4-bit codes (low nibble first)."""
    codes = jnp.stack([packed & 0x0F, packed >> 4], axis=-1)
    return codes.reshape(*packed.shape[:-1], 2 * packed.shape[-1])


def _fp4_dequantize(w: Fp4Blocks, dtype) -> jax.Array:
    w = fp4_rows(w)
    values = jnp.swapaxes(jnp.asarray(FP4_VALUES)[fp4_codes(w.packed)], -1, -2)  # f32[..., K, N]
    scale = jax.lax.bitcast_convert_type(w.scale.astype(jnp.uint32) << 23, jnp.float32)
    return (values * jnp.repeat(scale, FP4_GROUP, axis=-2)).astype(dtype)


def dequantize(w, dtype=jnp.bfloat16) -> jax.Array:
    """The weight in the model's [..., K, N] layout as `dtype` (a plain array passes)."""
    if isinstance(w, Fp8Blocks):
        return _fp8_dequantize(w, dtype)
    if isinstance(w, Fp4Blocks):
        return _fp4_dequantize(w, dtype)
    return w


def dequantize_tree(tree, dtype=jnp.bfloat16):
    """Every quantized weight in a pytree dequantized (the rest as it is)."""
    return jax.tree.map(lambda w: dequantize(w, dtype) if is_quantized(w) else w, tree,
                        is_leaf=is_quantized)
