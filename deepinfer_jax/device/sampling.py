"""Token selection on the device: penalties, grammar masks, temperature, top-k/top-p/min-p,
seeded sampling and logprobs, branch-free per row and vectorised over the batch.

Each row's random stream is `fold_in(fold_in(key(seed), position))`, the position being the
one of the token that is sampled from: a seeded request draws the same token whatever it is
batched with and however its prompt was chunked. Greedy rows (temperature 0) take the argmax
of the processed logits. Logprobs are those of the model's raw distribution (before
penalties, masks and temperature), as vLLM reports by default.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from deepinfer_jax.device.chunked_top_k import chunked_top_k

Array = jax.Array


@struct.dataclass
class SamplingRows:
    """Per-row sampling controls (device view of the plan's sampling arrays)."""

    temperature: Array          # f32[N]   0 = greedy
    top_k: Array                # i32[N]   <= 0: off
    top_p: Array                # f32[N]   1: off
    min_p: Array                # f32[N]   0: off
    repetition_penalty: Array   # f32[N]   1: off (prompt and output tokens)
    presence_penalty: Array     # f32[N]   0: off (output tokens)
    frequency_penalty: Array    # f32[N]   0: off (output tokens)
    seed: Array                 # u32[N]
    position: Array             # i32[N]   position of the token whose logits are sampled
    allowed: Array              # i32[N, ceil(V/32)]  bitmask of allowed tokens (grammar, min_tokens)


@struct.dataclass
class SampleOutput:
    tokens: Array               # i32[N]
    logprob: Array              # f32[N]      the chosen token's raw logprob
    top_ids: Array              # i32[N, L]
    top_logprobs: Array         # f32[N, L]


def unpack_bitmask(bits: Array, vocab: int) -> Array:
    """i32[N, W] -> bool[N, vocab]: bit j of word w allows token 32 w + j."""
    shifts = jnp.arange(32, dtype=jnp.uint32)
    words = bits.astype(jnp.uint32)[:, :, None]
    return ((words >> shifts) & 1).astype(bool).reshape(bits.shape[0], -1)[:, :vocab]


def apply_penalties(logits: Array, rows: SamplingRows, prompt_mask: Array,
                    output_counts: Array) -> Array:
    """vLLM's penalties. prompt_mask bool[N, V], output_counts i32[N, V]."""
    seen = prompt_mask | (output_counts > 0)
    rep = rows.repetition_penalty[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - rows.frequency_penalty[:, None] * output_counts
    return logits - rows.presence_penalty[:, None] * (output_counts > 0)


def scale_by_temperature(logits: Array, rows: SamplingRows) -> Array:
    """The sampled rows' logits / temperature: filter_logits with every filter off."""
    return logits / jnp.where(rows.temperature > 0, rows.temperature, 1.0)[:, None]


def filter_logits(logits: Array, rows: SamplingRows) -> Array:
    """Temperature, then top-k, then top-p (on the distribution top-k left, renormalised),
    then min-p (tokens below min_p x the top probability), as -inf masks; each optional."""
    scaled = scale_by_temperature(logits, rows)
    order = jnp.argsort(-scaled, axis=-1, stable=True)                     # [N, V] best first
    probs = jax.nn.softmax(jnp.take_along_axis(scaled, order, axis=-1), axis=-1)
    rank = jnp.arange(logits.shape[-1])
    keep = jnp.where(rows.top_k[:, None] > 0, rank < rows.top_k[:, None], True)
    in_top_k = jnp.where(keep, probs, 0.0)
    in_top_k = in_top_k / jnp.sum(in_top_k, axis=-1, keepdims=True)
    before = jnp.cumsum(in_top_k, axis=-1) - in_top_k     # mass of the better-ranked tokens
    keep &= before < rows.top_p[:, None]
    keep &= probs >= rows.min_p[:, None] * probs[:, :1]
    keep = keep.at[:, 0].set(True)                       # the best token always survives
    # a row with every filter off keeps all (top-p 1 could otherwise drop the tail's last
    # tokens where the float cumsum reaches 1): the same as scale_by_temperature, so a row's
    # draw does not depend on whether a neighbour made the batch truncate
    keep |= ~row_truncates(rows.temperature, rows.top_k, rows.top_p, rows.min_p)[:, None]
    kept = jnp.zeros_like(keep).at[jnp.arange(keep.shape[0])[:, None], order].set(
        keep, unique_indices=True)                       # `order` is a permutation per row
    return jnp.where(kept, scaled, -jnp.inf)


def process_logits(logits: Array, rows: SamplingRows, prompt_mask: Array,
                   output_counts: Array) -> Array:
    """Penalties, then the token bitmask: the logits greedy rows take the argmax of."""
    processed = apply_penalties(logits, rows, prompt_mask, output_counts)
    return jnp.where(unpack_bitmask(rows.allowed, logits.shape[-1]), processed, -jnp.inf)


def row_keys(rows: SamplingRows, purpose: int = 0) -> Array:
    """One key per row from (seed, position[, purpose]): purpose 0 samples a token; the
    speculative verifier uses 1 (accept or not) and 2 (resample after a rejection)."""
    keys = jax.vmap(lambda s, p: jax.random.fold_in(jax.random.key(s), p))(rows.seed, rows.position)
    return keys if purpose == 0 else jax.vmap(lambda k: jax.random.fold_in(k, purpose))(keys)


def token_logprobs(logits: Array, tokens: Array, num_logprobs: int) -> SampleOutput:
    """Raw logprobs of the chosen tokens and the top alternatives."""
    raw = jax.nn.log_softmax(logits, axis=-1)
    top_logprobs, top_ids = chunked_top_k(raw, num_logprobs)
    chosen = jnp.take_along_axis(raw, tokens[:, None], axis=-1)[:, 0]
    return SampleOutput(tokens, chosen, top_ids.astype(jnp.int32), top_logprobs)


def row_truncates(temperature, top_k, top_p, min_p):
    """Which rows sample with top-k, top-p or min-p on (jnp or numpy rows): the ones the sort
    over the vocabulary is for."""
    return (temperature > 0) & ((top_k > 0) | (top_p < 1) | (min_p > 0))


def truncates(rows: SamplingRows) -> Array:
    return jnp.any(row_truncates(rows.temperature, rows.top_k, rows.top_p, rows.min_p))


def host_truncates(temperature, top_k, top_p, min_p) -> bool:
    """`truncates` asked of the host's plan: the host picks the compiled sampler with it."""
    return bool(np.any(row_truncates(temperature, top_k, top_p, min_p)))


def sampling_logits(processed: Array, rows: SamplingRows, truncation: bool | None) -> Array:
    """The logits sampled rows draw from (greedy rows ignore them). `truncation` True or False
    is the host's choice compiled in (a variant per choice, so nothing branches on the device);
    None decides on the device with a real branch, which only the CPU formulation asks for
    (device/branch.py says why a GPU must not)."""
    if truncation is None:
        return jax.lax.cond(jnp.any(truncates(rows)), filter_logits, scale_by_temperature,
                            processed, rows)
    return (filter_logits if truncation else scale_by_temperature)(processed, rows)


def sample(logits: Array, rows: SamplingRows, prompt_mask: Array, output_counts: Array,
           num_logprobs: int, truncation: bool | None = None) -> SampleOutput:
    """logits f32[N, V] -> one token per row (plus logprobs)."""
    processed = process_logits(logits, rows, prompt_mask, output_counts)
    greedy = jnp.argmax(processed, axis=-1)
    drawn = jax.vmap(jax.random.categorical)(row_keys(rows),
                                              sampling_logits(processed, rows, truncation))
    tokens = jnp.where(rows.temperature > 0, drawn, greedy).astype(jnp.int32)
    return token_logprobs(logits, tokens, num_logprobs)
