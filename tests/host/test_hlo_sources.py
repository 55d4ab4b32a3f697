"""bench/hlo_sources.py: a compiled kernel traced back to the model line that made it."""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp

from bench.hlo_sources import describe


def step(ring, index, rows, w):
    y = jnp.tanh(rows @ w)
    return ring.at[index].set(y, mode="drop"), jnp.sum(y, axis=0)


def test_each_fusion_names_its_op_and_source_line():
    args = jnp.zeros((64, 8)), jnp.arange(16) * 3, jnp.ones((16, 8)), jnp.ones((8, 8))
    text = jax.jit(step).lower(*args).compile().as_text()
    names = [line.split("=")[0].replace("ROOT", "").strip().lstrip("%")
             for line in text.splitlines() if " fusion(" in line and "calls=" in line]
    described = describe(text, names + ["no_such_kernel"])
    assert set(described) == set(names)
    first = inspect.getsourcelines(step)[1]
    scatter = [d for d in described.values() if d.startswith("scatter")]
    assert scatter and all(f"test_hlo_sources.py:{first + 2}" in d for d in scatter)
    assert any(f"test_hlo_sources.py:{first + 1}" in d and "dot" in d for d in described.values())
