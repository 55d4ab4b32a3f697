"""Weights: safetensors checkpoints (plain, FP8 and FP4) and random initialisation."""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp

from deepinfer_jax.config.model import ModelConfig
from deepinfer_jax.model.params import ModelParams
from deepinfer_jax.weights.builder import build_params
from deepinfer_jax.weights.safetensors_io import Checkpoint
from deepinfer_jax.weights.sources import CheckpointError, CheckpointSource, RandomSource

__all__ = ["CheckpointError", "load_params", "random_params"]


def load_params(path: str | Path, cfg: ModelConfig, dtype=jnp.bfloat16) -> ModelParams:
    """Read a checkpoint directory into device arrays; raises CheckpointError listing every
    missing, unexpected, mis-shaped or undecodable tensor."""
    source = CheckpointSource(Checkpoint(path), cfg, dtype)
    host_params = build_params(cfg, source)
    source.finish()
    return jax.device_put(host_params)


def random_params(cfg: ModelConfig, key: jax.Array | int = 0, dtype=jnp.bfloat16) -> ModelParams:
    """Random weights with the checkpoint's shapes, drawn on the device (benchmarks)."""
    if isinstance(key, int):
        key = jax.random.key(key)
    return _random_params(key, cfg, jnp.dtype(dtype))


@functools.partial(jax.jit, static_argnames=("cfg", "dtype"))
def _random_params(key: jax.Array, cfg: ModelConfig, dtype) -> ModelParams:
    return build_params(cfg, RandomSource(cfg, key, dtype))
