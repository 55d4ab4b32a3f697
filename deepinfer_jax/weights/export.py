"""Write a ModelParams pytree back to an official-layout checkpoint.

No second description of the layout is needed: running the builder over a source that hands
out element *indices* instead of values yields, for every parameter element, the checkpoint
element it came from (the builder only transposes, reshapes and concatenates). Exporting is
then one scatter per parameter leaf.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import jax
import numpy as np

from deepinfer_jax.config.hf import to_hf_dict
from deepinfer_jax.config.model import ModelConfig
from deepinfer_jax.model.params import ModelParams
from deepinfer_jax.weights.builder import Role, build_params
from deepinfer_jax.weights.safetensors_io import save_file
from pallas_kernels.quantized import dequantize_tree


class _IndexSource:
    """Hands out `arange` blocks: element i of the result is global checkpoint element i."""

    def __init__(self, with_mtp: bool):
        self.with_mtp = with_mtp
        self.layout: dict[str, tuple[int, tuple[int, ...], Role]] = {}
        self.size = 0

    def has_prefix(self, prefix: str) -> bool:
        return self.with_mtp or not prefix.startswith("mtp.")

    def tensor(self, name: str, shape: tuple[int, ...], role: Role) -> np.ndarray:
        n = math.prod(shape)
        self.layout[name] = (self.size, shape, role)
        self.size += n
        return np.arange(self.size - n, self.size).reshape(shape)

    dtype = np.dtype(np.int64)

    def projection(self, name: str, shape: tuple[int, int], released_fp8: bool) -> np.ndarray:
        return self.tensor(name, shape, Role.LINEAR).T

    def experts(self, names: list[list[str]], shape: tuple[int, int]) -> np.ndarray:
        stacks = [np.stack([self.tensor(name, shape, Role.LINEAR) for name in column])
                  for column in names]
        return np.concatenate(stacks, axis=1).transpose(0, 2, 1)

    def place(self, tree):
        return tree


def export_tensors(params: ModelParams, cfg: ModelConfig) -> dict[str, np.ndarray]:
    """Official name -> numpy array (projections in the params' dtype, the rest as loaded;
    quantized weights dequantized)."""
    params = dequantize_tree(params, params.embed.dtype)
    src = _IndexSource(with_mtp=bool(params.mtp))
    layout = build_params(cfg, src)
    values = np.zeros(src.size, np.float64)       # exact for f32, bf16 and small int tables
    for ids, leaf in zip(jax.tree.leaves(layout), jax.tree.leaves(params), strict=True):
        values[ids.ravel()] = np.asarray(leaf, np.float64).ravel()
    weight_dtype = np.dtype(params.embed.dtype)
    dtypes = {Role.LINEAR: weight_dtype, Role.EMBED: weight_dtype, Role.TABLE: np.dtype(np.int64)}
    out = {}
    for name, (offset, shape, role) in src.layout.items():
        out[name] = values[offset: offset + math.prod(shape)].reshape(shape).astype(
            dtypes.get(role, np.dtype(np.float32)))
    return out


def save_checkpoint(params: ModelParams, cfg: ModelConfig, directory: str | Path,
                    extra_config: dict | None = None) -> Path:
    """Write `config.json` and `model.safetensors` (official names) into `directory`."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = export_tensors(params, cfg)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    config = {**to_hf_dict(cfg), "dtype": np.dtype(params.embed.dtype).name,
              **(extra_config or {})}
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return directory
