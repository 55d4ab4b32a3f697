"""Sink attention over gathered rows, in plain jnp: the CPU path and the kernel's oracle.

Each query token t has its own rows (the engine gathers them: the sliding-window ring plus
the compressed rows it may see) that serve as keys and values (DeepSeek-V4's shared K=V
head), a visibility mask over them, and one softmax per head that also holds that head's
sink logit (a zero value vector):

    out[t, h] = sum_r p[t, h, r] * rows[t, r],
    p[t, h, :] = softmax over {q[t, h] . rows[t, r] / sqrt(hd) : r visible} and sinks[h]
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def sink_attention(q: jax.Array, rows: jax.Array, visible: jax.Array,
                   sinks: jax.Array) -> jax.Array:
    """q [T, H, hd], rows [T, R, hd], visible bool[T, R], sinks f32[H] -> [T, H, hd]."""
    scale = q.shape[-1] ** -0.5
    logits = jnp.einsum("thd,trd->thr", q, rows, preferred_element_type=jnp.float32) * scale
    logits = jnp.where(visible[:, None, :], logits, -jnp.inf)
    peak = jnp.maximum(jnp.max(logits, axis=-1), sinks)                   # [T, H]
    probs = jnp.exp(logits - peak[..., None])
    denom = jnp.sum(probs, axis=-1) + jnp.exp(sinks - peak)
    out = jnp.einsum("thr,trd->thd", probs.astype(rows.dtype), rows,
                     preferred_element_type=jnp.float32)
    return (out / denom[..., None]).astype(q.dtype)
