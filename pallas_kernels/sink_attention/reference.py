"""Sink attention over gathered rows, in plain jnp: the CPU path and the kernel's oracle.

Each query token t has its own rows (the engine gathers them: the sliding-window ring plus
the compressed rows it may see) that serve as keys and values (DeepSeek-V4's shared K=V
head), a visibility mask over them, and one softmax per head that also holds that head's
sink logit (a zero value vector):

    out[t, h] = sum_r p[t, h, r] * rows[t, r],
    p[t, h, :] = softmax over {q[t, h] . rows[t, r] / sqrt(hd) : r visible} and sinks[h]

The rows may come in several sets (the window's, then the compressed ones): one softmax over
all of them, without concatenating them (that would write every token's rows once more).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def sink_attention(q: jax.Array, rows: jax.Array | tuple[jax.Array, ...],
                   visible: jax.Array | tuple[jax.Array, ...], sinks: jax.Array) -> jax.Array:
    """q [T, H, hd], rows [T, R, hd] or row sets [T, R_i, hd], visible bool[T, R] (one per
    set), sinks f32[H] -> [T, H, hd]. The max and the sum run over every set and the sink;
    the sets' weighted rows are added in set order."""
    rows, visible = as_sets(rows), as_sets(visible)
    scale = q.shape[-1] ** -0.5
    logits = [jnp.where(v[:, None, :], jnp.einsum("thd,trd->thr", q, r,
                                                  preferred_element_type=jnp.float32) * scale,
                        -jnp.inf) for r, v in zip(rows, visible, strict=True)]
    peak = functools.reduce(jnp.maximum, [jnp.max(x, axis=-1) for x in logits], sinks)
    probs = [jnp.exp(x - peak[..., None]) for x in logits]                   # peak: [T, H]
    denom = functools.reduce(jnp.add, [jnp.sum(p, axis=-1) for p in probs],
                             jnp.exp(sinks - peak))
    out = functools.reduce(jnp.add, [
        jnp.einsum("thr,trd->thd", p.astype(r.dtype), r, preferred_element_type=jnp.float32)
        for p, r in zip(probs, rows, strict=True)])
    return (out / denom[..., None]).astype(q.dtype)


def as_sets(x: jax.Array | tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
    return x if isinstance(x, tuple) else (x,)
