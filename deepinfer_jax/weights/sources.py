"""Tensor sources for the param builder: a checked checkpoint reader and a random generator."""

from __future__ import annotations

import re
import zlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from deepinfer_jax.config.model import ModelConfig
from deepinfer_jax.weights import quant
from deepinfer_jax.weights.builder import Role
from deepinfer_jax.weights.safetensors_io import Checkpoint

_F32_ROLES = {Role.NORM, Role.MIX, Role.ZEROS, Role.ONES}

# transformers' `save_pretrained` writes the official names except for these few.
_HF_RENAMES = {
    "embed_tokens.weight": "embed.weight",
    "lm_head.weight": "head.weight",
    "hc_head.hc_fn": "hc_head_fn",
    "hc_head.hc_base": "hc_head_base",
    "hc_head.hc_scale": "hc_head_scale",
}
_HF_KV_NORM = re.compile(r"^((?:layers|mtp)\.\d+\.attn\.)norm\.weight$")


def official_name(key: str) -> str:
    """Map a checkpoint key to the official DeepSeek name."""
    if key.startswith("model."):
        key = key[len("model."):]
    key = _HF_RENAMES.get(key, key)
    return _HF_KV_NORM.sub(r"\1kv_norm.weight", key)


class CheckpointError(ValueError):
    """A checkpoint that does not match its config: lists every offending tensor."""


# What a tensor may be stored as without a .scale: floats (cast to the compute dtype or
# float32) and, for the hash tables, integers.
_FLOAT_KINDS = frozenset({"F16", "BF16", "F32", "F64"})
_INT_KINDS = frozenset({"I8", "U8", "I16", "U16", "I32", "U32", "I64", "U64"})


def _all_finite(array: np.ndarray) -> bool:
    """One pass and no temporary the size of the tensor: a float64 sum is finite exactly when
    every value is (|bf16| < 3.4e38, so no finite tensor can overflow it)."""
    return bool(np.isfinite(np.sum(array, dtype=np.float64)))


def _numpy_dtype(dtype) -> np.dtype:
    return np.dtype(ml_dtypes.bfloat16) if jnp.dtype(dtype) == jnp.bfloat16 else np.dtype(dtype)


class CheckpointSource:
    """Reads tensors by official name, dequantises FP8/FP4 weights, checks shapes, and
    remembers what was used so that `finish()` can report missing and unexpected tensors."""

    def __init__(self, ckpt: Checkpoint, cfg: ModelConfig, dtype):
        self.ckpt = ckpt
        self.dtype = _numpy_dtype(dtype)
        self.block = cfg.quantization.weight_block_size if cfg.quantization else (128, 128)
        self.n_experts = cfg.n_routed_experts
        self.by_name: dict[str, str] = {}
        for key in ckpt.keys():
            name = official_name(key)
            if name in self.by_name:
                raise CheckpointError(f"{key} and {self.by_name[name]} name the same tensor {name}")
            self.by_name[name] = key
        self.used: set[str] = set()
        self.missing: list[str] = []
        self.misshaped: list[str] = []
        self.invalid: list[str] = []

    def has_prefix(self, prefix: str) -> bool:
        return any(name.startswith(prefix) for name in self.by_name)

    def tensor(self, name: str, shape: tuple[int, ...], role: Role) -> np.ndarray:
        array = self._read(name, role)
        if array is None:
            return np.zeros(shape, self._dtype(role))
        if array.shape != shape:
            self.misshaped.append(f"{name}: {array.shape}, expected {shape}")
            return np.zeros(shape, self._dtype(role))
        if role is Role.TABLE and (array.min() < 0 or array.max() >= self.n_experts):
            self.invalid.append(f"{name}: expert ids outside [0, {self.n_experts})")
        if role is not Role.TABLE and not _all_finite(array):
            bad = array.size - np.count_nonzero(np.isfinite(array))
            what = "all NaN" if np.isnan(array).all() else f"{bad} of {array.size} values NaN or inf"
            self.invalid.append(f"{name}: {what} (expected finite weights)")
        return array.astype(self._dtype(role))

    def stacked(self, names: list[str], shape: tuple[int, ...], role: Role) -> np.ndarray:
        return np.stack([self.tensor(n, shape, role) for n in names])

    def finish(self) -> None:
        unexpected = sorted(set(self.by_name) - self.used)
        problems = []
        for title, names in (("missing", self.missing), ("mis-shaped", self.misshaped),
                             ("unexpected", unexpected), ("invalid", self.invalid)):
            if names:
                shown = "\n  ".join(names[:40]) + (f"\n  ... and {len(names) - 40} more"
                                                   if len(names) > 40 else "")
                problems.append(f"{len(names)} {title} tensor(s):\n  {shown}")
        if problems:
            raise CheckpointError("checkpoint does not match its config:\n" + "\n".join(problems))

    def _dtype(self, role: Role) -> np.dtype:
        if role is Role.TABLE:
            return np.dtype(np.int32)
        return np.dtype(np.float32) if role in _F32_ROLES else self.dtype

    def _read(self, name: str, role: Role) -> np.ndarray | None:
        key = self.by_name.get(name)
        if key is None:
            self.missing.append(name)
            return None
        self.used.add(name)
        scale_name = name[: -len("weight")] + "scale" if name.endswith(".weight") else None
        scale_key = self.by_name.get(scale_name) if scale_name else None
        kind = self.ckpt.dtype_name(key)
        if scale_key is None:
            if kind.startswith("F8") or kind in ("I8", "U8"):
                self.invalid.append(f"{name}: quantised dtype {kind} without a .scale tensor")
                return None
            expected = _INT_KINDS if role is Role.TABLE else _FLOAT_KINDS
            if kind not in expected:
                self.invalid.append(f"{name}: dtype {kind}, expected one of {sorted(expected)}"
                                    + ("" if role is Role.TABLE else
                                       " (or F8_E4M3 / FP4 in I8 with a .scale tensor)"))
                return None
            return self.ckpt.get(key)
        array = self.ckpt.get(key)
        self.used.add(scale_name)
        scale = self.ckpt.get(scale_key)
        try:
            if kind == "F8_E4M3":
                return quant.dequant_fp8(array, scale, self.block)
            if kind in ("I8", "U8"):
                return quant.dequant_fp4(array, scale)
        except quant.QuantFormatError as e:
            self.invalid.append(f"{name}: {e}")
            return None
        self.invalid.append(f"{name}: a .scale tensor next to a {kind} weight")
        return None


class RandomSource:
    """Random tensors drawn on the default device (for benchmarks at real dimensions).

    Projections ~ N(0, 1/in), embeddings ~ N(0, 1), norms and scales 1, biases 0, hash tables
    random distinct experts. Each tensor's key derives from its name, so the values do not
    depend on build order.
    """

    def __init__(self, cfg: ModelConfig, key: jax.Array, dtype):
        self.cfg, self.key, self.dtype = cfg, key, jnp.dtype(dtype)

    def has_prefix(self, prefix: str) -> bool:
        return True

    def tensor(self, name: str, shape: tuple[int, ...], role: Role) -> jax.Array:
        key = jax.random.fold_in(self.key, zlib.crc32(name.encode()))
        match role:
            case Role.LINEAR:
                return (jax.random.normal(key, shape, jnp.float32) * shape[-1] ** -0.5).astype(self.dtype)
            case Role.EMBED:
                return jax.random.normal(key, shape, jnp.float32).astype(self.dtype)
            case Role.MIX:
                return jax.random.normal(key, shape, jnp.float32) * shape[-1] ** -0.5
            case Role.NORM | Role.ONES:
                return jnp.ones(shape, jnp.float32)
            case Role.ZEROS:
                return jnp.zeros(shape, jnp.float32)
            case Role.TABLE:
                vocab, top_k = shape
                noise = jax.random.uniform(key, (vocab, self.cfg.n_routed_experts))
                return jnp.argsort(noise, axis=-1)[:, :top_k].astype(jnp.int32)
        raise ValueError(role)

    def stacked(self, names: list[str], shape: tuple[int, ...], role: Role) -> jax.Array:
        return self.tensor(names[0] + "#stack", (len(names), *shape), role)
