"""Weights: safetensors checkpoints (plain, FP8 and FP4) and random initialisation."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp

from deepinfer_jax.config.model import ModelConfig
from deepinfer_jax.model.params import ModelParams
from deepinfer_jax.weights.builder import build_params
from deepinfer_jax.weights.random_source import RandomSource
from deepinfer_jax.weights.safetensors_io import Checkpoint
from deepinfer_jax.weights.sources import CheckpointError, CheckpointSource

__all__ = ["CheckpointError", "load_params", "random_params"]


def load_params(path: str | Path, cfg: ModelConfig, dtype=jnp.bfloat16,
                keep_quantized: bool = True) -> ModelParams:
    """Read a checkpoint directory onto the device, a layer at a time; raises CheckpointError
    listing every missing, unexpected, mis-shaped or undecodable tensor.

    keep_quantized: FP8 and FP4 weights stay in their formats (pallas_kernels/quantized.py);
    False dequantizes them to `dtype` (about 4x the bytes for FP4 experts)."""
    source = CheckpointSource(Checkpoint(path), cfg, dtype, keep_quantized)
    params = build_params(cfg, source)
    source.finish()
    return params


def random_params(cfg: ModelConfig, key: jax.Array | int = 0, dtype=jnp.bfloat16,
                  release_formats: bool = False,
                  shardings: Callable[[ModelParams], ModelParams] | None = None) -> ModelParams:
    """Random weights with the checkpoint's shapes, drawn on the device (benchmarks);
    release_formats: in the release's FP8 / FP4 formats where it has them.

    shardings: a function from the abstract parameters to a sharding per leaf (parallel/mesh.py
    `param_shardings` on the engine's mesh): each device then draws only its own shards, so a
    model larger than one device's memory (V4-Flash over 8 GPUs) is never whole on one. The
    values do not depend on it (jax's threefry is partitionable)."""
    if isinstance(key, int):
        key = jax.random.key(key)
    dtype = jnp.dtype(dtype)
    draw = functools.partial(_draw, cfg=cfg, dtype=dtype, release_formats=release_formats)
    if shardings is None:
        return draw(key)        # tensor by tensor, each shape's draw compiled once
    return jax.jit(draw, out_shardings=shardings(jax.eval_shape(draw, key)))(key)


def _draw(key: jax.Array, cfg: ModelConfig, dtype, release_formats: bool) -> ModelParams:
    return build_params(cfg, RandomSource(cfg, key, dtype, release_formats))
