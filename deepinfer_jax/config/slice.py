"""A model config cut to a few layers: the benchmarks' V4-Flash slices (bench/lib/models.py)
and `--load-format dummy --dummy-layers N` (api/dummy.py) build the same model from it. Each
layer keeps the config's real dimensions, so a slice's per-layer figures scale to the full
model."""

from __future__ import annotations

from deepinfer_jax.config.model import AttentionKind, MlpKind, ModelConfig

# The slice's attention kinds, repeated: the two compressed kinds that most of V4's layers use.
SLICE_KINDS = (AttentionKind.CSA, AttentionKind.HCA)


def slice_config(cfg: ModelConfig, layers: int) -> ModelConfig:
    """`cfg` cut to `layers` layers (CSA, HCA, CSA, ...), routed MoE in each, no MTP layers,
    unquantized."""
    if layers < 1:
        raise ValueError(f"a slice needs at least one layer, got {layers}")
    kinds = tuple((SLICE_KINDS * layers)[:layers])
    return cfg.replace(num_layers=layers, layer_types=kinds, mlp_types=(MlpKind.MOE,) * layers,
                       num_mtp_layers=0, quantization=None)
