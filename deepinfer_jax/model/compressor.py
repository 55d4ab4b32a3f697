"""Time-axis KV compression: every `m` tokens pool into one row (CSA and HCA layers, indexer).

Per token the compressor projects `A_t = x W_kv` and `B_t = x W_gate + ape[t mod m]` (float32).
A row pools, per channel, `sum softmax(B) * A` over its slots:
* no overlap (HCA): the m tokens of block w;
* overlap (CSA, indexer): 2m slots, the first halves `A^a, B^a` of block w-1's tokens and the
  second halves `A^b, B^b` of block w's tokens (block -1 contributes nothing).
The pooled row is RMS-normalised and roped (compress rope) at position m*w, its block's first
token. Row w exists once token m*w + m - 1 has been seen; query t may use rows w < (t+1) // m.

`pool_rows` is shared by the full-sequence forward and the engine's incremental path.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from deepinfer_jax.config.compute import ComputeConfig
from deepinfer_jax.model.invariant import f32_linear, ordered_softmax, ordered_sum
from deepinfer_jax.model.norms import rms_norm
from deepinfer_jax.model.params import CompressorParams
from deepinfer_jax.model.rope import apply_rope, cos_sin


def project(x: jax.Array, p: CompressorParams, compute: ComputeConfig
            ) -> tuple[jax.Array, jax.Array]:
    """x [..., D] -> (kv, score) f32[..., c*d]; the score still lacks the block-position bias."""
    return f32_linear(x, p.wkv, compute), f32_linear(x, p.wgate, compute)


def pool_rows(kv: jax.Array, score: jax.Array, *, overlap: bool,
              prev_kv: jax.Array | None = None, prev_score: jax.Array | None = None,
              invariant: bool = False) -> jax.Array:
    """Pool whole blocks.

    kv, score: f32[..., nw, m, c*d] (score includes `ape`); for overlap, prev_kv/prev_score
    f32[..., m, d] are the first halves of the block before block 0 (None: no such block).
    Returns f32[..., nw, d].
    """
    softmax = (lambda x: ordered_softmax(x, -2)) if invariant else (
        lambda x: jax.nn.softmax(x, axis=-2))
    total = (lambda x: ordered_sum(x, -2)) if invariant else (lambda x: jnp.sum(x, axis=-2))
    if not overlap:
        return total(softmax(score) * kv)
    d = kv.shape[-1] // 2
    first_kv, second_kv = kv[..., :d], kv[..., d:]
    first_sc, second_sc = score[..., :d], score[..., d:]
    lead = kv.shape[:-3]
    m = kv.shape[-2]
    if prev_kv is None:
        prev_kv = jnp.zeros((*lead, m, d), jnp.float32)
        prev_score = jnp.full((*lead, m, d), -jnp.inf, jnp.float32)
    # Block w's earlier slots are block w-1's first halves: shift by one block.
    shifted_kv = jnp.concatenate([prev_kv[..., None, :, :], first_kv[..., :-1, :, :]], axis=-3)
    shifted_sc = jnp.concatenate([prev_score[..., None, :, :], first_sc[..., :-1, :, :]], axis=-3)
    slots_kv = jnp.concatenate([shifted_kv, second_kv], axis=-2)      # [..., nw, 2m, d]
    slots_sc = jnp.concatenate([shifted_sc, second_sc], axis=-2)
    return total(softmax(slots_sc) * slots_kv)


def finish_rows(pooled: jax.Array, norm: jax.Array, row_positions: jax.Array, freqs: np.ndarray,
                eps: float, dtype, invariant: bool = False) -> jax.Array:
    """Normalise and rope pooled rows f32[..., n, d] at their first-token positions i32[..., n]
    (invariant: the norm's sum in a fixed order, norms.rms_norm's `ordered`)."""
    rows = rms_norm(pooled, norm, eps, ordered=invariant)
    cos, sin = cos_sin(row_positions, freqs)
    return apply_rope(rows, cos, sin).astype(dtype)


def compress_sequence(x: jax.Array, p: CompressorParams, *, rate: int, overlap: bool,
                      freqs: np.ndarray, eps: float, compute: ComputeConfig) -> jax.Array:
    """All complete blocks of a sequence that starts at position 0.

    x [B, S, D] -> rows [B, S // rate, d] (dtype of x); a trailing partial block is dropped.
    """
    batch, seq, _ = x.shape
    n_rows = seq // rate
    d = p.norm.shape[0]
    if n_rows == 0:
        return jnp.zeros((batch, 0, d), x.dtype)
    kv, score = project(x[:, : n_rows * rate], p, compute)
    kv = kv.reshape(batch, n_rows, rate, -1)
    score = score.reshape(batch, n_rows, rate, -1) + p.ape
    pooled = pool_rows(kv, score, overlap=overlap)
    positions = jnp.arange(n_rows, dtype=jnp.int32) * rate
    return finish_rows(pooled, p.norm, positions, freqs, eps, x.dtype)
