"""bench/lib/hlo_sources.py: a compiled kernel traced back to the model line that made it."""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp

from bench.lib.hlo_sources import describe


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
    if jax.default_backend() == "cpu":      # a GPU's dot is a cuBLAS call, not in a fusion
        assert any(f"test_hlo_sources.py:{first + 1}" in d and "dot" in d
                   for d in described.values())


def test_a_root_without_source_falls_back_to_its_hero_op():
    # (and the profiler's kernel name, loop_gather_fusion_7, is the instruction's with '_')
    text = "\n".join([
        "HloModule m", "", "FileNames", '1 "/x/model.py"', "", "FunctionNames", '1 "f"', "",
        "FileLocations", "1 {file_name_id=1 function_name_id=1 line=42 end_line=42}", "",
        "StackFrames", "1 {file_location_id=1 parent_frame_id=0}", "",
        "%fused_gather (p0: f32[8,4], p1: s32[3]) -> f32[3,4] {",
        "  %p0 = f32[8,4]{1,0} parameter(0)",
        "  %p1 = s32[3]{0} parameter(1)",
        '  %g = f32[3,4]{1,0} gather(%p0, %p1), metadata={op_name="jit(f)/gather" stack_frame_id=1}',
        "  ROOT %b = f32[3,4]{1,0} bitcast(%g)",
        "}", "",
        "ENTRY %main (a: f32[8,4], i: s32[3]) -> f32[3,4] {",
        "  %a = f32[8,4]{1,0} parameter(0)",
        "  %i = s32[3]{0} parameter(1)",
        "  ROOT %loop_gather_fusion.7 = f32[3,4]{1,0} fusion(%a, %i), kind=kLoop, calls=%fused_gather",
        "}"])
    assert describe(text, ["loop_gather_fusion_7"]) == {
        "loop_gather_fusion_7": "gather -> f32[3,4]{1,0} at model.py:42 (gather)"}


def test_hlo_diff_names_the_sums_whose_rows_follow_the_engine():
    """bench/hlo_diff.py: two compiles of one function, one input's rows 8 and then 32, the
    other's fixed: only the sum over the varying input is reported, at its source line."""
    from bench.hlo_diff import differing

    def sums(fixed, varying):
        return jnp.sum(fixed * fixed, axis=-1), jnp.sum(jnp.exp(varying), axis=-1)

    def compiled(rows: int) -> str:
        return jax.jit(sums).lower(jnp.ones((16, 64)), jnp.ones((rows, 256))).compile().as_text()

    line = inspect.getsourcelines(sums)[1] + 1
    rows = differing(compiled(8), compiled(32))
    assert rows and all(f"test_hlo_sources.py:{line}" in source for _, source, _, _ in rows)
    assert {(a, b) for _, _, a, b in rows} == {(1, 0), (0, 1)}
    assert differing(compiled(8), compiled(8)) == []


def test_hlo_diff_names_the_kernels_grouped_otherwise():
    """bench/hlo_diff.py --fusions: one function compiled with its multiply and add in one
    kernel, then split by an optimization barrier: the kernels of each compile are named by
    their ops' source lines, and a compile against itself differs nowhere."""
    from bench.hlo_diff import differing_fusions

    def product_plus(x, y, z, split):
        p = jnp.exp(x) * y
        if split:
            p = jax.lax.optimization_barrier(p)
        return p + z

    def compiled(split: bool) -> str:
        ones = jnp.ones((64, 64))
        return jax.jit(product_plus, static_argnums=3).lower(ones, ones, ones,
                                                             split).compile().as_text()

    first = inspect.getsourcelines(product_plus)[1]
    mul, add = (f"test_hlo_sources.py:{first + n}" for n in (1, 4))
    kernels = {ops: (a, b) for ops, a, b in differing_fusions(compiled(False), compiled(True))}
    assert kernels[tuple(sorted((f"add@{add}", f"exponential@{mul}", f"multiply@{mul}")))] == (1, 0)
    assert kernels[(f"exponential@{mul}", f"multiply@{mul}")] == (0, 1)
    assert differing_fusions(compiled(True), compiled(True)) == []
