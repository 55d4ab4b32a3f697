"""The param builder's random source: weights with the checkpoint's shapes drawn on the device
(benchmarks at real dimensions), in bf16 or in the release's FP8 / FP4 formats."""

from __future__ import annotations

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
    depend on build order.
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
        # N(0, 1/in) as E4M3 codes N(0, 16^2) (far inside +-448) times a power-of-two scale
        out_dim, in_dim = shape
        codes = (jax.random.normal(self._key(name), (in_dim, out_dim)) * 16)
        grid = (-(-in_dim // quantized.FP8_BLOCK), -(-out_dim // quantized.FP8_BLOCK))
        scale = jnp.full(grid, _power_of_two(in_dim ** -0.5 / 16), jnp.float32)
        return quantized.Fp8Blocks(codes.astype(jnp.float8_e4m3fn), scale)

    def experts(self, names: list[list[str]], shape: tuple[int, int]):
        out_dim, in_dim = shape
        n = len(names[0])
        if not self.release_formats:
            stacks = [self.tensor(column[0] + "#stack", (n, out_dim, in_dim), Role.LINEAR)
                      for column in names]
            return jnp.concatenate(stacks, axis=1).transpose(0, 2, 1)
        # uniform random E2M1 codes (RMS value 2.93) at a scale giving about N(0, 1/in)
        rows = len(names) * out_dim
        packed = random_bytes(self._key(names[0][0] + "#fp4"), (n, rows, in_dim // 2))
        exponent = round(np.log2(in_dim ** -0.5 / 2.93))
        scale = jnp.full((n, in_dim // quantized.FP4_GROUP, rows), 127 + exponent, jnp.uint8)
        return quantized.Fp4Blocks(packed, scale)

    def tensor(self, name: str, shape: tuple[int, ...], role: Role) -> jax.Array:
        key = self._key(name)
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



def _power_of_two(x: float) -> float:
    return float(2.0 ** round(np.log2(x)))
