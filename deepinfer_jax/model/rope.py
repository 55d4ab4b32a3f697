"""Interleaved partial RoPE on the trailing `rope_head_dim` channels of a vector.

Channel pairs (2i, 2i+1) of the rope slice form one complex number rotated by `p * w_i`.
Two frequency tables exist: "main" (theta 10000, sliding-only layers and MTP) and "compress"
(theta 160000 with YaRN, for CSA/HCA layers, their compressed rows and the indexer).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from deepinfer_jax.config.model import AttentionKind, ModelConfig, YarnConfig


def inv_freq(rope_dim: int, theta: float, yarn: YarnConfig | None) -> np.ndarray:
    """f32[rope_dim // 2] angular frequencies (float32 throughout, like the reference)."""
    exponents = np.arange(0, rope_dim, 2, dtype=np.float32) / np.float32(rope_dim)
    pos_freqs = np.power(np.float32(theta), exponents)
    extrapolation = np.float32(1.0) / pos_freqs
    if yarn is None:
        return extrapolation
    interpolation = np.float32(1.0) / (np.float32(yarn.factor) * pos_freqs)

    def correction_dim(rotations: float) -> float:
        return (rope_dim * math.log(yarn.original_max_position_embeddings / (rotations * 2 * math.pi))
                ) / (2 * math.log(theta))

    low, high = correction_dim(yarn.beta_fast), correction_dim(yarn.beta_slow)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rope_dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = np.clip((np.arange(rope_dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    # ramp = 0: keep the original frequency (high frequencies); ramp = 1: interpolate by `factor`.
    return (interpolation * ramp + extrapolation * (1 - ramp)).astype(np.float32)


def layer_inv_freq(cfg: ModelConfig, kind: AttentionKind) -> np.ndarray:
    if kind is AttentionKind.SLIDING:
        return inv_freq(cfg.rope_head_dim, cfg.rope_theta, None)
    return inv_freq(cfg.rope_head_dim, cfg.compress_rope_theta, cfg.compress_yarn)


def cos_sin(positions: jax.Array, freqs: np.ndarray) -> tuple[jax.Array, jax.Array]:
    """positions i32[...] -> (cos, sin) f32[..., rope_dim // 2]."""
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(freqs)
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array, *, inverse: bool = False) -> jax.Array:
    """Rotate the trailing `2 * cos.shape[-1]` channels of x [..., d]; cos/sin broadcast to
    x's leading axes ([..., rope_dim // 2]). `inverse` applies the conjugate rotation."""
    half = cos.shape[-1]
    nope, rope = x[..., : x.shape[-1] - 2 * half], x[..., x.shape[-1] - 2 * half:]
    pairs = rope.astype(jnp.float32).reshape(*rope.shape[:-1], half, 2)
    a, b = pairs[..., 0], pairs[..., 1]
    if inverse:
        sin = -sin
    rotated = jnp.stack([a * cos - b * sin, b * cos + a * sin], axis=-1)
    rotated = rotated.reshape(rope.shape).astype(x.dtype)
    return jnp.concatenate([nope, rotated], axis=-1)
