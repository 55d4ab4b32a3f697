"""sink_attention_parts: one softmax over several key sets equals sink_attention over their
concatenation (the step's window rows + compressed rows, never concatenated)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from deepinfer_jax.config.compute import ComputeConfig
from deepinfer_jax.model.attention import sink_attention, sink_attention_parts

JNP = ComputeConfig()


@pytest.mark.parametrize("visible_case", ["mixed", "first_part_hidden", "nothing_visible"])
def test_parts_equal_the_concatenation(visible_case):
    rng = np.random.default_rng(0)
    tokens, heads, hd, sizes = 6, 4, 16, (5, 9)
    q = jnp.asarray(rng.normal(size=(tokens, heads, hd)), jnp.float32)
    keys = tuple(jnp.asarray(rng.normal(size=(tokens, n, hd)) * 2, jnp.float32) for n in sizes)
    visible = [rng.random((tokens, n)) < 0.6 for n in sizes]
    if visible_case == "first_part_hidden":
        visible[0][:] = False
    if visible_case == "nothing_visible":       # only the sink: a zero output
        visible = [np.zeros_like(v) for v in visible]
    visible = tuple(jnp.asarray(v) for v in visible)
    sinks = jnp.asarray(rng.normal(size=heads), jnp.float32)
    whole = sink_attention(q[:, None], jnp.concatenate(keys, 1),
                           jnp.concatenate(visible, 1)[:, None], sinks, JNP)[:, 0]
    parts = jax.jit(sink_attention_parts, static_argnums=4)(q, keys, visible, sinks, JNP)
    np.testing.assert_allclose(np.asarray(parts), np.asarray(whole), rtol=2e-6, atol=2e-6)
    if visible_case == "nothing_visible":
        assert not np.any(np.asarray(parts))


def test_one_part_is_sink_attention():
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.normal(size=(3, 2, 8)), jnp.bfloat16)
    k = jnp.asarray(rng.normal(size=(3, 7, 8)), jnp.bfloat16)
    v = jnp.asarray(rng.random((3, 7)) < 0.5)
    sinks = jnp.zeros(2, jnp.float32)
    np.testing.assert_array_equal(np.asarray(sink_attention_parts(q, (k,), (v,), sinks, JNP)),
                                  np.asarray(sink_attention(q[:, None], k, v[:, None], sinks,
                                                             JNP)[:, 0]))
