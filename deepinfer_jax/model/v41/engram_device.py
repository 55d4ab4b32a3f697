"""DeepSeek-V4.1's Engram row ids computed inside the step, equal to `engram_hash.hash_ids`.

Why on the device: the host can hash only the tokens it has read, so a host-hashing engine
must read each step's sampled tokens before it plans the next one. Hashing the step's own
resolved tokens (placeholders included) lets the asynchronous loop serve V4.1 wherever the
tables are device weights (EngineConfig.engram_tables="device").

How, in 32-bit integers (jax runs without int64):
* every product `c * m` the hash XORs is read from `products` u32[V, L_e, n, 2], its high and
  low words, built once on the host (`engram_hash.product_words`); XOR works word by word;
* the reduction of the 64-bit value modulo a prime p runs in uint32: `hi mod p`, then the low
  word fed in chunks of b bits, r <- (r << b | chunk) mod p, with b the widest chunk for which
  `p << b` fits 32 bits (primes below 2^31);
* a value with its top bit set is negative in numpy's int64, whose `%` floors:
  x mod p = (U mod p - 2^64 mod p) mod p for the unsigned U. (The reference's multipliers keep
  every product below 2^63, so this arises only for ids past the compressed vocabulary.)

Shapes: T plan tokens, n = max_ngram_size look-back slots (slot 0 the token itself), L_e
Engram layers, C = (n - 1) x heads columns.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from deepinfer_jax.config.v41 import EngramConfig
from deepinfer_jax.model.v41.engram_hash import DEAD, hash_tables

Array = jax.Array


@functools.lru_cache(maxsize=8)
def _constants(cfg: EngramConfig) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """(primes u32[L_e, n-1, heads], 2^64 mod each prime u32[same], offsets i32[L_e, C], the
    chunk width b), from the config alone."""
    tables = hash_tables(cfg)
    primes = tables.primes
    if primes.max() >= 2**31 or tables.offsets.max() + primes.max() >= 2**31:
        raise ValueError(f"Engram tables of {cfg.num_embeddings} rows need more than 31 bits")
    wrap = np.array([pow(2, 64, int(p)) for p in primes.reshape(-1)]).reshape(primes.shape)
    chunk = 32 - int(primes.max()).bit_length()
    return (primes.astype(np.uint32), wrap.astype(np.uint32), tables.offsets.astype(np.int32),
            chunk)


def _mod(hi: Array, lo: Array, primes: np.ndarray, wrap: np.ndarray, chunk: int) -> Array:
    """The int64 value with words (hi, lo) u32[...] modulo each prime u32[heads] (numpy's
    floored `%`) -> u32[..., heads]."""
    p = jnp.asarray(primes)
    hi, lo = hi[..., None], lo[..., None]
    r = hi % p
    done = 0
    while done < 32:                 # static: ceil(32 / chunk) steps
        b = min(chunk, 32 - done)
        piece = (lo >> (32 - done - b)) & jnp.uint32((1 << b) - 1)
        r = ((r << b) | piece) % p
        done += b
    negative = hi >= jnp.uint32(2**31)
    return jnp.where(negative, (r + (p - jnp.asarray(wrap))) % p, r)


def hash_ids(look_back: Array, products: Array, cfg: EngramConfig) -> Array:
    """look_back i32[T, n] (slot k: the token k before, DEAD where none) -> row ids
    i32[T, L_e, C] into each Engram layer's table, as `engram_hash.hash_ids`: once a slot is
    DEAD, it and every longer one read the pad token's products."""
    primes, wrap, offsets, chunk = _constants(cfg)
    n = cfg.max_ngram_size
    blocked = jax.lax.cummax((look_back == DEAD).astype(jnp.int32), axis=1) > 0
    tokens = jnp.where(blocked, cfg.pad_id, look_back)
    words = products[tokens, :, jnp.arange(n)]              # u32[T, n, L_e, 2]
    hi, lo = words[:, 0, :, 0], words[:, 0, :, 1]           # the running XOR, [T, L_e]
    columns = []
    for i in range(1, n):
        hi, lo = hi ^ words[:, i, :, 0], lo ^ words[:, i, :, 1]
        columns.append(_mod(hi, lo, primes[:, i - 1], wrap[:, i - 1], chunk))
    return jnp.concatenate(columns, axis=-1).astype(jnp.int32) + jnp.asarray(offsets)


def plan_look_back(token_ids: Array, plan, before: Array) -> Array:
    """Each plan token's look-back i32[T, n]: the tokens before it in its row's span
    (token_ids, resolved), then the row's `before` i32[N, n-1] (the tokens before the span,
    the last one last; DEAD before position 0). Padding tokens read some row's: their ids
    are in range and unused."""
    back = before.shape[1]
    n_rows, t = plan.seq_slot.shape[0], token_ids.shape[0]
    row = jnp.minimum(plan.token_seq, n_rows - 1)
    index = jnp.arange(t)
    in_span = index - plan.seq_offset[row]                   # the token's place in its span
    slots = [token_ids]
    for k in range(1, back + 1):
        earlier = token_ids[jnp.maximum(index - k, 0)]
        before_span = before[row, jnp.clip(back - k + in_span, 0, back - 1)]
        slots.append(jnp.where(in_span >= k, earlier, before_span))
    return jnp.stack(slots, axis=1)
