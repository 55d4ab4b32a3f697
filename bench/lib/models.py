"""The models the engine benchmarks run: a DeepSeek-V4-Flash slice (its real dimensions, a
few layers, alternating CSA and HCA attention, routed MoE in every layer, random weights: a
GPU holds it and its figures scale to the full model per layer), or a small config file for
CPU runs."""

from __future__ import annotations

from pathlib import Path

from deepinfer_jax.config import slice as slices
from deepinfer_jax.config.hf import read_model_config
from deepinfer_jax.config.model import ModelConfig

REPO = Path(__file__).resolve().parents[2]
V4_FLASH = REPO / "configs" / "deepseek-v4-flash.json"
SMALL_CPU = REPO / "configs" / "bench" / "small-cpu.json"


def slice_config(path: Path, layers: int) -> ModelConfig:
    """The config at `path` cut to `layers` layers (CSA, HCA, CSA, ...), MoE in each, no MTP
    layers, unquantized (deepinfer_jax/config/slice.py: `deepinfer serve --load-format dummy
    --dummy-layers N` builds the same)."""
    return slices.slice_config(read_model_config(path), layers)


def engine_params(params):
    """params with their FP4 experts already in the engine's kernel order for this machine
    (weights/fp4_tiles.py), the row-order arrays freed: an LLM given a Model of these makes
    no copy of them (it copies a Model's row-order stacks, which a deep slice cannot hold
    twice)."""
    from deepinfer_jax.config.options import resolve_compute
    from deepinfer_jax.engine.devices import local_device_facts
    from deepinfer_jax.weights.fp4_tiles import tile_fp4_experts
    order = resolve_compute(local_device_facts()).fp4_expert_order
    return tile_fp4_experts(params, order, owned=True)


def model_config(args) -> ModelConfig:
    """args.v4_flash_layers > 0: that V4-Flash slice; else the config file args.config."""
    if not args.v4_flash_layers:
        return read_model_config(args.config)
    return slice_config(V4_FLASH, args.v4_flash_layers)


def model_label(args, cfg: ModelConfig) -> str:
    """What a result's table says about the model."""
    if args.v4_flash_layers:
        return f"V4-Flash dimensions, {cfg.num_layers} layers"
    path = Path(args.config).resolve()
    return str(path.relative_to(REPO) if path.is_relative_to(REPO) else path)
