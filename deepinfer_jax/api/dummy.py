"""`load_format="dummy"` (vLLM's name): a model with random weights built from its config
alone, no checkpoint read. A GPU machine without the weights (or without a network) can then
serve and benchmark a model of the real dimensions:

    deepinfer serve deepseek-v4-flash --load-format dummy --dummy-layers 4   # bench/e2e.py's slice
    LLM("path/with/config.json", load_format="dummy")

The weights are drawn on the device (weights.random_params) from a fixed seed: two processes
given the same config, layers and dtype build the same model, so a server and an offline
`LLM.generate` compare on the same numbers. The model's tokenizer is the config directory's
tokenizer.json where there is one; a bare config has none, and then prompts are token ids and
outputs have no text (api/server answers text prompts with a 400 that says so)."""

from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp

from deepinfer_jax.api.model import Model
from deepinfer_jax.config.hf import read_served_model_config
from deepinfer_jax.config.model import ModelConfig
from deepinfer_jax.config.slice import slice_config
from deepinfer_jax.weights import random_params

LOAD_FORMATS = ("auto", "dummy")
_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def config_file(path: str | Path) -> Path:
    """A model directory's config.json, or the config file itself."""
    path = Path(path)
    return path / "config.json" if path.is_dir() else path


def dummy_config(path: str | Path, weights: str = "quantized",
                 layers: int | None = None) -> ModelConfig:
    """The config dummy_model draws for: the config at `path` (a directory or a config.json
    file), cut to `layers` layers first where asked (config/slice.py: CSA, HCA alternating,
    routed MoE in each, no MTP, unquantized); weights "bf16" drops its quantization."""
    cfg = read_served_model_config(config_file(path))
    if layers is not None:
        cfg = slice_config(cfg, layers)
    if weights != "quantized" or cfg.quantization is None:
        cfg = cfg.replace(quantization=None)
    return cfg


def dummy_model(path: str | Path, dtype=None, weights: str = "quantized",
                layers: int | None = None, seed: int = 0, shardings=None) -> Model:
    """Random weights for dummy_config(path, weights, layers). dtype: the projections' dtype
    (None: the config's `dtype` / `torch_dtype`, else bfloat16). weights: "quantized" draws a
    quantized config's FP8 / FP4 tensors in the release's formats, "bf16" draws them in
    `dtype`. shardings: the abstract parameters -> their shardings on the engine's mesh, each
    device drawing only its own (weights.random_params); None: on the default device."""
    cfg = dummy_config(path, weights, layers)
    dtype = _config_dtype(path) if dtype is None else dtype
    return Model(config=cfg, params=random_params(cfg, seed, dtype,
                                                  release_formats=cfg.quantization is not None,
                                                  shardings=shardings))


def _config_dtype(path: str | Path):
    raw = json.loads(config_file(path).read_text())
    name = str(raw.get("dtype") or raw.get("torch_dtype") or "bfloat16").removeprefix("torch.")
    return _DTYPES.get(name, jnp.bfloat16)
