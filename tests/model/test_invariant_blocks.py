"""The batch-invariant building blocks: ordered sums and softmax against float64 numpy, and
their per-row results bitwise independent of how many rows surround them (bf16 inputs, where
the order of additions shows)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from deepinfer_jax.config.compute import ComputeConfig
from deepinfer_jax.model.invariant import ordered_softmax, ordered_sum, per_row_tiles


@pytest.mark.parametrize("n", [1, 2, 3, 4, 7, 8, 128])
def test_ordered_sum_is_the_sum(n):
    x = np.random.default_rng(n).standard_normal((5, n, 3))
    np.testing.assert_allclose(np.asarray(ordered_sum(jnp.asarray(x, jnp.float32), 1)),
                               x.sum(1), rtol=1e-5, atol=1e-5)


def test_hand_computed_order():
    """[2**24, 1, 1, 1] in float32 (2**24 + 1 rounds back to 2**24): the tree adds x0 + x2 and
    x1 + x3 first, [2**24, 2], then 2**24 + 2, which is exact; left to right would lose
    every 1 and give 2**24."""
    big = float(2 ** 24)
    assert float(ordered_sum(jnp.asarray([big, 1.0, 1.0, 1.0], jnp.float32), 0)) == big + 2
    # odd length: [1, 1, 1] -> [1 + 1, 1] -> 3; [big, 1, 1] -> [big + 1 = big, 1] -> big
    assert float(ordered_sum(jnp.asarray([1.0, 1.0, 1.0], jnp.float32), 0)) == 3.0
    assert float(ordered_sum(jnp.asarray([big, 1.0, 1.0], jnp.float32), 0)) == big


def test_rows_do_not_depend_on_the_batch():
    x = jnp.asarray(np.random.default_rng(0).standard_normal((64, 128, 16)), jnp.bfloat16)
    full_sum, full_softmax = ordered_sum(x, 1), ordered_softmax(x.astype(jnp.float32), 1)
    for m in (1, 3, 17):
        np.testing.assert_array_equal(np.asarray(ordered_sum(x[:m], 1), np.float32),
                                      np.asarray(full_sum[:m], np.float32))
        np.testing.assert_array_equal(np.asarray(ordered_softmax(x[:m].astype(jnp.float32), 1)),
                                      np.asarray(full_softmax[:m]))
    w = jnp.asarray(np.random.default_rng(1).standard_normal((16, 32)), jnp.bfloat16)
    tiled = per_row_tiles(lambda t: t @ w, x[:, 0], tile=8)
    for m in (1, 5, 9):
        np.testing.assert_array_equal(np.asarray(per_row_tiles(lambda t: t @ w, x[:m, 0], tile=8)),
                                      np.asarray(tiled[:m]))


@pytest.mark.parametrize("invariant", [False, True])
def test_float32_linears_ask_for_float32_products(invariant):
    """A float32 linear (mHC's projection) lowers, for a GPU too, with HIGHEST precision: a
    GPU's default for float32 operands is TF32, which rounds them to 10-bit mantissas. bf16
    operands keep the default (their products are exact either way)."""
    import jax

    from deepinfer_jax.model.invariant import linear

    def lowered(dtype):
        x, w = jnp.ones((16, 64), dtype), jnp.ones((64, 24), dtype)
        return jax.jit(lambda a, b: linear(a, b, ComputeConfig(batch_invariant=invariant))
                       ).lower(x, w).as_text()

    assert "HIGHEST" in lowered(jnp.float32)
    assert "HIGHEST" not in lowered(jnp.bfloat16)


def float_sums(jaxpr) -> list[str]:
    """The float reduce_sum equations (operand -> result types) of a jaxpr and its
    sub-jaxprs (Pallas kernels' bodies left out: a kernel's sums are its own, fixed by its
    tiles)."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "reduce_sum" and jnp.issubdtype(eqn.outvars[0].aval.dtype,
                                                                jnp.floating):
            found.append(f"{eqn.invars[0].aval} -> {eqn.outvars[0].aval}")
        if eqn.primitive.name == "pallas_call":
            continue
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    found += float_sums(inner)
    return found


@pytest.mark.parametrize("invariant", [True, False])
def test_the_head_sums_in_a_fixed_order_in_batch_invariant_mode(invariant):
    """The sampled rows' head (hc head, final norm) runs over the step's sequences. Over the
    whole batch XLA split its sums by the row count, [8, 256] in [8, 8] partials on an 8-slot
    engine and [32, 256] at once on a 32-slot one (their HLO, session 50); its row tiles
    (invariant.per_sequence) keep one shape per tile, and in batch-invariant mode its sums
    are ordered sums besides, which no merging of tiles can regroup: no float reduction is
    left. The default mode keeps jnp's reductions (the control)."""
    import jax

    import deepinfer_jax
    from deepinfer_jax.config.engine import EngineConfig
    from deepinfer_jax.model.invariant import per_sequence
    from deepinfer_jax.model.reference_forward import project_logits
    from tests.conftest import REPO

    model = deepinfer_jax.load(REPO / "models" / "deepinfer-tiny-v4")
    cfg, params = model.config, model.params
    compute = EngineConfig(max_num_seqs=8, max_model_len=128, max_num_batched_tokens=16,
                           step_formulation="gpu", batch_invariant=invariant
                           ).resolve(cfg).compute
    streams = jnp.zeros((8, cfg.hc_mult, cfg.hidden_size), params.embed.dtype)
    jaxpr = jax.make_jaxpr(lambda s: project_logits(
        s, params.hc_head, params.norm, params.head, cfg, compute,
        rows=per_sequence(compute)))(streams).jaxpr
    sums = float_sums(jaxpr)
    if invariant:
        assert sums == []
    else:
        assert len(sums) >= 2                   # the hc head's norm and the final norm


def test_unrolled_tiles_are_sealed_copies():
    """invariant.unrolled_row_tiles: each tile's program between optimization barriers, so
    that XLA cannot merge the copies back into one computation over every row; the rows are
    fn's on the whole batch."""
    import jax

    from deepinfer_jax.model.invariant import unrolled_row_tiles

    x = jnp.asarray(np.random.default_rng(3).standard_normal((20, 16)), jnp.float32)

    def fn(rows):
        return jnp.tanh(rows) * 2.0

    text = jax.jit(lambda v: unrolled_row_tiles(fn, v, tile=8)).lower(x).as_text()
    assert text.count("stablehlo.optimization_barrier") == 2 * 3          # 3 tiles of 8 rows
    np.testing.assert_array_equal(np.asarray(unrolled_row_tiles(fn, x, tile=8)),
                                  np.asarray(fn(x)))


def test_row_tiles_are_sealed_where_launches_are_dear():
    """invariant.rowwise in the GPU formulation: each tile's program between optimization
    barriers (rows that fit one tile make a loop of one trip, which XLA removes and would
    fuse with the padding around it); the CPU formulation's tiles are unsealed. The rows are
    fn's on the whole batch either way."""
    import jax

    from deepinfer_jax.model.invariant import rowwise

    x = jnp.asarray(np.random.default_rng(4).standard_normal((5, 16)), jnp.float32)

    def fn(rows):                  # exact in float32 whatever the compiler fuses: rows are rows
        return rows * 2.0 + 1.0

    for formulation, barriers in (("gpu", 2), ("cpu", 0)):
        tiles = rowwise(ComputeConfig(formulation=formulation, batch_invariant=True,
                                      invariant_tile=8))
        text = jax.jit(lambda v, tiles=tiles: tiles(fn, v)).lower(x).as_text()
        assert text.count("stablehlo.optimization_barrier") == barriers     # in and out
        np.testing.assert_array_equal(np.asarray(tiles(fn, x)), np.asarray(fn(x)))
