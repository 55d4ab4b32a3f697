"""Random DeepSeek-V4.1 weights drawn on the device, for benchmarks at the real dimensions.

A stand-in for the checkpoint reader (weights/v41_reader.py) that the V4.1 builder
(weights/v41.py `_build`) calls for each tensor by name and shape: the same pytree as a
loaded checkpoint, every weight random. With release_formats the tensors the release
quantizes come in its formats (FP8 E4M3 dense projections with one power-of-two scale per
32 x 32 block, FP4 E2M1 routed experts with one E8M0 scale per 32 inputs); the rest in
`dtype`. The Engram tables are numpy arrays in host memory (the engine's default
engram_tables="host"). Values are scaled to keep activations O(1): projections ~ N(0, 1/in),
norms 1, biases and sinks 0.
"""

from __future__ import annotations

import re
import zlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from deepinfer_jax.config.v41 import V41Config
from deepinfer_jax.model.v41.params import V41ModelParams
from deepinfer_jax.weights.random_source import random_bytes
from deepinfer_jax.weights.v41 import _build
from pallas_kernels.quantized import FP4_GROUP, Fp4Blocks, Fp8Blocks

# The tensors the release stores in FP8 (the architecture notes, section 8).
_RELEASED_FP8 = re.compile(r"\.self_attn\.(q_a_proj|q_b_proj|kv_proj|o_a_proj|o_b_proj)\.weight$"
                           r"|\.shared_experts\.\w+\.weight$|\.engram\.wkv\.weight$")
_ONES = re.compile(r"(norm|layernorm)\.weight$|\.(q_weight|k_weight|scale)$")
_ZEROS = re.compile(r"(bias|bias_vl|sinks|\.base)$")


class RandomReader:
    """The methods of V41Reader that `_build` calls, answered with random tensors."""

    def __init__(self, cfg: V41Config, seed: int, dtype, release_formats: bool):
        self.key, self.dtype = jax.random.key(seed), jnp.dtype(dtype)
        self.keep_quantized, self.block = release_formats, tuple(cfg.fp8_block)

    def _key(self, name: str) -> jax.Array:
        return jax.random.fold_in(self.key, zlib.crc32(name.encode()) & 0x7FFFFFFF)

    def has(self, name: str) -> bool:
        """Answers the builder's one question: per-expert (native) names, so that the routed
        experts come through `experts`."""
        return name.endswith("experts.0.w1.weight")

    def get(self, name: str, shape: tuple[int, ...], f32: bool = False) -> jax.Array:
        dtype = jnp.float32 if f32 else self.dtype
        if _ONES.search(name):
            return jnp.ones(shape, dtype)
        if _ZEROS.search(name):
            return jnp.zeros(shape, dtype)
        scale = shape[-1] ** -0.5 if len(shape) > 1 else 0.02
        return (jax.random.normal(self._key(name), shape, jnp.float32) * scale).astype(dtype)

    def projection(self, name: str, shape: tuple[int, int]):
        """`[out, in]` -> the model's `[in, out]`: Fp8Blocks where the release keeps FP8."""
        if not (self.keep_quantized and _RELEASED_FP8.search(name)):
            return self.get(name, shape).T
        out_dim, in_dim = shape
        bo, bi = self.block
        codes = jax.random.normal(self._key(name), (in_dim, out_dim), jnp.float32)
        grid = (-(-in_dim // bi), -(-out_dim // bo))
        scale = jnp.full(grid, 2.0 ** -round(np.log2(in_dim) / 2), jnp.float32)
        return Fp8Blocks(codes.astype(jnp.float8_e4m3fn), scale)

    def experts(self, names: list[list[str]], shape: tuple[int, int]):
        """Each expert's `[out, in]` tensors of names[j] joined along out, stacked: Fp4Blocks
        [E, J*out, in/2] (scales [E, in/32, J*out]) in the release's format, else [E, in,
        J*out]."""
        n, parts = len(names[0]), len(names)
        out_dim, in_dim = shape
        key = self._key(names[0][0])
        if not self.keep_quantized:
            w = jax.random.normal(key, (n, in_dim, parts * out_dim), jnp.float32)
            return (w * in_dim ** -0.5).astype(self.dtype)
        packed = random_bytes(key, (n, parts * out_dim, in_dim // 2))
        # E2M1 codes average |v| ~ 2.6: one scale 2^e with 2.6 * 2^e ~ in^-1/2
        e = round(-np.log2(in_dim) / 2 - 1.4)
        scale = jnp.full((n, in_dim // FP4_GROUP, parts * out_dim), 127 + e, jnp.uint8)
        return Fp4Blocks(packed, scale)

    def table(self, name: str, shape: tuple[int, int]) -> np.ndarray:
        """An Engram table, random in host memory: int8 draws in chunks of rows (fast, and no
        float32 copy of a table of billions of values)."""
        rng = np.random.default_rng(zlib.crc32(name.encode()))
        dtype = ml_dtypes.bfloat16 if self.dtype == jnp.bfloat16 else np.dtype(self.dtype)
        out = np.empty(shape, dtype)
        for start in range(0, shape[0], 1 << 20):
            rows = rng.integers(-64, 64, (min(1 << 20, shape[0] - start), shape[1]), np.int8)
            out[start:start + rows.shape[0]] = rows.astype(np.float32) / 64
        return out


def random_v41_params(cfg: V41Config, seed: int = 0, dtype=jnp.bfloat16,
                      release_formats: bool = True, fp4_k_granule: int = 1) -> V41ModelParams:
    """Random V41ModelParams, on the device but for the Engram tables (host numpy).
    fp4_k_granule: as the loader's (load_v41_params)."""
    params = _build(cfg, RandomReader(cfg, seed, dtype, release_formats), fp4_k_granule)
    tables = params.engram_tables
    params = jax.device_put(params.replace(engram_tables=()))
    return params.replace(engram_tables=tables)
