"""`deepinfer_jax.load(path)`: a model for notebooks and tests, with the cache-free forward.

`Model.logits(token_ids)` runs the full-sequence reference forward (no state cache), the oracle
the engine is tested against. Sequences are right-padded to a multiple of `pad_to` tokens so
that growing a sequence one token at a time does not recompile at every length (causality
makes the padding invisible to the real positions).

`convert(checkpoint, out)` writes a checkpoint once as a store (weights/orbax_store.py) that
`load(out, mesh=...)` restores straight into a device mesh.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from deepinfer_jax.config.compute import ComputeConfig
from deepinfer_jax.config.hf import read_served_model_config
from deepinfer_jax.config.model import ModelConfig
from deepinfer_jax.config.options import resolve_compute
from deepinfer_jax.engine.devices import local_device_facts
from deepinfer_jax.model import mtp, reference_forward
from deepinfer_jax.model.params import ModelParams
from deepinfer_jax.model.precision import matmul_precision
from deepinfer_jax.parallel.mesh import param_shardings, split_axes
from deepinfer_jax.weights import load_params, orbax_store


@functools.partial(jax.jit, static_argnames=("cfg", "compute"))
def _logits(params: ModelParams, token_ids: jax.Array, cfg: ModelConfig,
            compute: ComputeConfig) -> jax.Array:
    return reference_forward.logits(params, token_ids, cfg, compute)


@functools.partial(jax.jit, static_argnames=("cfg", "compute"))
def _mtp_logits(params: ModelParams, token_ids: jax.Array, cfg: ModelConfig,
                compute: ComputeConfig) -> jax.Array:
    with matmul_precision(params.embed.dtype):
        return mtp.mtp_logits(params, token_ids, cfg, compute)


def _as_batch(token_ids, vocab_size: int) -> np.ndarray:
    ids = np.asarray(token_ids)
    if ids.ndim == 1:
        ids = ids[None]
    if ids.ndim != 2 or ids.shape[1] == 0:
        raise ValueError(f"token_ids must be [S] or [B, S] with S > 0, got shape {ids.shape}")
    if not np.issubdtype(ids.dtype, np.integer):
        raise TypeError(f"token_ids must be integers, got {ids.dtype}")
    if ids.min() < 0 or ids.max() >= vocab_size:
        raise ValueError(f"token ids must lie in [0, {vocab_size})")
    return ids.astype(np.int32)


@dataclasses.dataclass(frozen=True)
class Model:
    config: ModelConfig
    params: ModelParams
    pad_to: int = 128
    # how the forward computes; None: the local device's defaults (config/options.py)
    compute: ComputeConfig | None = None

    def __post_init__(self):
        if self.compute is None:
            object.__setattr__(self, "compute", resolve_compute(local_device_facts()))

    def _padded(self, token_ids) -> tuple[np.ndarray, int]:
        ids = _as_batch(token_ids, self.config.vocab_size)
        seq = ids.shape[1]
        target = -(-seq // self.pad_to) * self.pad_to
        return np.pad(ids, ((0, 0), (0, target - seq))), seq

    def logits(self, token_ids) -> np.ndarray:
        """token_ids [S] or [B, S] -> float32 logits [B, S, V] (full forward, no cache)."""
        ids, seq = self._padded(token_ids)
        return np.asarray(_logits(self.params, jnp.asarray(ids), self.config,
                                  self.compute))[:, :seq]

    def mtp_logits(self, token_ids) -> np.ndarray:
        """The MTP block's drafts: [B, S-1, V], row t predicts token t+2 from tokens <= t+1."""
        if not self.params.mtp:
            raise ValueError("this checkpoint has no MTP weights")
        ids, seq = self._padded(token_ids)
        return np.asarray(_mtp_logits(self.params, jnp.asarray(ids), self.config,
                                      self.compute))[:, : seq - 1]


_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def checkpoint_dtype(path: str | Path):
    """The compute dtype a checkpoint asks for (`dtype` / `torch_dtype`), bfloat16 if unset."""
    raw = json.loads((Path(path) / "config.json").read_text())
    name = raw.get("dtype") or raw.get("torch_dtype") or "bfloat16"
    return _DTYPES.get(str(name).removeprefix("torch."), jnp.bfloat16)


WEIGHT_FORMATS = ("quantized", "bf16")


def load(path: str | Path, dtype=None, weights: str = "quantized", mesh: Mesh | None = None) -> Model:
    """Load a DeepSeek-V4 checkpoint directory: config.json with safetensors, or a store
    written by `convert` (`deepinfer convert`).

    dtype: the compute dtype of the projections (norms, mHC and other small parameters stay
    float32); None takes the checkpoint's own (`dtype` in config.json, or the dtype a store
    was converted at), else bfloat16.
    weights: "quantized" keeps FP8/FP4 tensors as stored (the GEMMs dequantize as they read);
    "bf16" dequantizes them to `dtype` at load time.
    mesh: a store is restored straight into the mesh's shardings (parallel/mesh.py), each
    device reading only its shards; a safetensors checkpoint loads onto one device whatever
    the mesh (the engine then places it).
    """
    if weights not in WEIGHT_FORMATS:
        raise ValueError(f"weights must be one of {WEIGHT_FORMATS}, got {weights!r}")
    cfg = read_served_model_config(path)
    keep_quantized = weights == "quantized"
    if orbax_store.is_store(path):
        shardings = None if mesh is None else functools.partial(param_shardings, mesh=mesh)
        return Model(config=cfg, params=orbax_store.restore(path, cfg, dtype, keep_quantized,
                                                            shardings))
    dtype = checkpoint_dtype(path) if dtype is None else dtype
    return Model(config=cfg, params=load_params(path, cfg, dtype, keep_quantized=keep_quantized))


def convert(checkpoint: str | Path, out: str | Path, dtype=None,
            weights: str = "quantized") -> Path:
    """Read a checkpoint once (checked, in the model's layout, as `load` gives it) and write
    it to `out` as a store that `load` restores straight into a device mesh, chunked so that
    each device reads only its shards (weights/orbax_store.py)."""
    params = load(checkpoint, dtype, weights).params
    return orbax_store.save(params, checkpoint, out, split_axes(params))
