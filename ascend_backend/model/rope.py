"""Interleaved partial RoPE on the trailing rope channels (deepinfer_jax/model/rope.py).

The frequency tables are computed in numpy exactly as the JAX model computes them; that
module imports jax, which the Ascend backend's environment does not have, so the few lines
of the table are repeated here (tests/ascend compares both steps' logits, which catches a
drift)."""

from __future__ import annotations

import math

import numpy as np
import torch

from deepinfer_jax.config.model import AttentionKind, ModelConfig, YarnConfig


def inv_freq(rope_dim: int, theta: float, yarn: YarnConfig | None) -> np.ndarray:
    """f32[rope_dim // 2] angular frequencies, YaRN-interpolated where configured."""
    exponents = np.arange(0, rope_dim, 2, dtype=np.float32) / np.float32(rope_dim)
    pos_freqs = np.power(np.float32(theta), exponents)
    extrapolation = np.float32(1.0) / pos_freqs
    if yarn is None:
        return extrapolation
    interpolation = np.float32(1.0) / (np.float32(yarn.factor) * pos_freqs)

    def correction_dim(rotations: float) -> float:
        return (rope_dim * math.log(yarn.original_max_position_embeddings
                                    / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(yarn.beta_fast), correction_dim(yarn.beta_slow)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rope_dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(rope_dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    return (interpolation * ramp + extrapolation * (1 - ramp)).astype(np.float32)


def layer_inv_freq(cfg: ModelConfig, kind: AttentionKind) -> np.ndarray:
    if kind is AttentionKind.SLIDING:
        return inv_freq(cfg.rope_head_dim, cfg.rope_theta, None)
    return inv_freq(cfg.rope_head_dim, cfg.compress_rope_theta, cfg.compress_yarn)


def cos_sin(positions: torch.Tensor, freqs: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """positions int[...] -> (cos, sin) f32[..., rope_dim // 2]."""
    angles = positions.float()[..., None] * torch.as_tensor(freqs, device=positions.device)
    return torch.cos(angles), torch.sin(angles)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *,
               inverse: bool = False) -> torch.Tensor:
    """Rotate the trailing 2 * cos.shape[-1] channels of x [..., d] (pairs 2i, 2i+1)."""
    half = cos.shape[-1]
    nope, rope = x[..., : x.shape[-1] - 2 * half], x[..., x.shape[-1] - 2 * half:]
    pairs = rope.float().reshape(*rope.shape[:-1], half, 2)
    a, b = pairs[..., 0], pairs[..., 1]
    if inverse:
        sin = -sin
    rotated = torch.stack([a * cos - b * sin, b * cos + a * sin], dim=-1)
    return torch.cat([nope, rotated.reshape(rope.shape).to(x.dtype)], dim=-1)
