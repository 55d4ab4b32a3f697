"""The param builder's random source: weights with the checkpoint's shapes drawn on the device
(benchmarks at real dimensions), in bf16 or in the release's FP8 / FP4 formats."""

from __future__ import annotations

import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np

from deepinfer_jax.config.model import ModelConfig
from deepinfer_jax.weights.builder import Role
from pallas_kernels import quantized


def random_bytes(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """Uniform random uint8 of `shape`, drawn as 32-bit words and bit-cast four bytes a word:
    `jax.random.bits` in uint8 holds 32-bit counters and words for every byte on the way, a
    transient many times larger than this one's (tests/weights/test_random_bytes.py)."""
    *lead, last = shape
    if last % 4:
        return jax.random.bits(key, shape, jnp.uint8)
    words = jax.random.bits(key, (*lead, last // 4), jnp.uint32)
    return jax.lax.bitcast_convert_type(words, jnp.uint8).reshape(shape)


class RandomSource:
    """Random tensors drawn on the default device (for benchmarks at real dimensions).

    Projections ~ N(0, 1/in), embeddings ~ N(0, 1), norms and scales 1, biases 0, hash tables
    random distinct experts. Each tensor's key derives from its name, so the values do not
    depend on build order. Each kind of tensor is one small jitted draw per shape, compiled
    once and called for every layer: one program over the whole model took XLA longer to
    compile the deeper the model (docs/performance-log.md, "Random weights").
    """

    def __init__(self, cfg: ModelConfig, key: jax.Array, dtype, release_formats: bool = False):
        self.cfg, self.key, self.dtype = cfg, key, jnp.dtype(dtype)
        self.release_formats = release_formats

    def has_prefix(self, prefix: str) -> bool:
        return True

    def place(self, tree):
        return tree

    def _key(self, name: str) -> jax.Array:
        return jax.random.fold_in(self.key, zlib.crc32(name.encode()))

    def projection(self, name: str, shape: tuple[int, int], released_fp8: bool):
        if not (self.release_formats and released_fp8):
            return self.tensor(name, shape, Role.LINEAR).T
        out_dim, in_dim = shape
        return _fp8_projection(self._key(name), in_dim, out_dim)

    def experts(self, names: list[list[str]], shape: tuple[int, int]):
        out_dim, in_dim = shape
        n = len(names[0])
        if not self.release_formats:
            keys = jnp.stack([self._key(column[0] + "#stack") for column in names])
            return _bf16_experts(keys, n, out_dim, in_dim, self.dtype)
        return _fp4_experts(self._key(names[0][0] + "#fp4"), n, len(names) * out_dim, in_dim)

    def tensor(self, name: str, shape: tuple[int, ...], role: Role) -> jax.Array:
        key = self._key(name)
        match role:
            case Role.LINEAR:
                return _normal(key, shape, shape[-1] ** -0.5, self.dtype)
            case Role.EMBED:
                return _normal(key, shape, 1.0, self.dtype)
            case Role.MIX:
                return _normal(key, shape, shape[-1] ** -0.5, jnp.dtype(jnp.float32))
            case Role.NORM | Role.ONES:
                return jnp.ones(shape, jnp.float32)
            case Role.ZEROS:
                return jnp.zeros(shape, jnp.float32)
            case Role.TABLE:
                vocab, top_k = shape
                return _hash_table(key, vocab, self.cfg.n_routed_experts, top_k)
        raise ValueError(role)


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _normal(key: jax.Array, shape: tuple[int, ...], scale: float, dtype) -> jax.Array:
    return (jax.random.normal(key, shape, jnp.float32) * scale).astype(dtype)


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4))
def _bf16_experts(keys: jax.Array, n: int, out_dim: int, in_dim: int, dtype) -> jax.Array:
    """[n, in, J*out]: each of the J keys' [n, out, in] stack, joined along out."""
    stacks = [_normal(key, (n, out_dim, in_dim), in_dim ** -0.5, dtype) for key in keys]
    return jnp.concatenate(stacks, axis=1).transpose(0, 2, 1)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _fp8_projection(key: jax.Array, in_dim: int, out_dim: int) -> quantized.Fp8Blocks:
    """N(0, 1/in) as E4M3 codes N(0, 16^2) (far inside +-448) times a power-of-two scale."""
    codes = jax.random.normal(key, (in_dim, out_dim)) * 16
    grid = (-(-in_dim // quantized.FP8_BLOCK), -(-out_dim // quantized.FP8_BLOCK))
    scale = jnp.full(grid, _power_of_two(in_dim ** -0.5 / 16), jnp.float32)
    return quantized.Fp8Blocks(codes.astype(jnp.float8_e4m3fn), scale)


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _fp4_experts(key: jax.Array, n: int, rows: int, in_dim: int) -> quantized.Fp4Blocks:
    """Uniform random E2M1 codes (RMS value 2.93) at a scale giving about N(0, 1/in)."""
    packed = random_bytes(key, (n, rows, in_dim // 2))
    exponent = round(np.log2(in_dim ** -0.5 / 2.93))
    scale = jnp.full((n, in_dim // quantized.FP4_GROUP, rows), 127 + exponent, jnp.uint8)
    return quantized.Fp4Blocks(packed, scale)


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _hash_table(key: jax.Array, vocab: int, n_experts: int, top_k: int) -> jax.Array:
    """Each token's top_k distinct random experts."""
    noise = jax.random.uniform(key, (vocab, n_experts))
    return jnp.argsort(noise, axis=-1)[:, :top_k].astype(jnp.int32)


def _power_of_two(x: float) -> float:
    return float(2.0 ** round(np.log2(x)))
