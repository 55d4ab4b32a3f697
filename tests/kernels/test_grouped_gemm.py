"""The grouped GEMM kernel against its jnp reference, in GPU interpret mode on the CPU (the
same tests run the compiled kernel on a GPU), plus the reference against a float64 numpy
computation and the kernel's lowering for CUDA."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pallas_kernels.common import abstract_gpu, on_hopper_or_newer
from pallas_kernels.grouped_gemm import api, invariant, layout, mosaic_gpu_persistent, reference
from pallas_kernels.grouped_gemm.mosaic_gpu import TileConfig, tiled_group_matmul
from pallas_kernels.grouped_gemm.mosaic_gpu_ws import WarpSpecializedConfig
from pallas_kernels.grouped_gemm.mosaic_gpu_ws import tiled_group_matmul as tiled_group_matmul_ws

KERNEL = "mosaic_gpu" if on_hopper_or_newer() else "interpret"
K, N = 128, 256
SIZES = {                                   # rows per group
    "balanced": [40, 40, 40, 40],
    "empty experts": [0, 70, 0, 0, 3, 0, 0, 1, 0],
    "one hot expert": [0, 0, 150, 0],
    "one token": [0, 1, 0],
    "one group": [77],
}


def problem(sizes, fp8: bool, seed: int = 0):
    rng = np.random.default_rng(seed)
    sizes = jnp.asarray(sizes, jnp.int32)
    lhs = jnp.asarray(rng.standard_normal((int(sizes.sum()), K)), jnp.bfloat16)
    weights = rng.standard_normal((len(sizes), K, N)) / 8
    if not fp8:
        return lhs, jnp.asarray(weights, jnp.bfloat16), sizes, None
    scale = rng.uniform(0.01, 0.05, (len(sizes), K // 128, N // 128)).astype(np.float32)
    full = np.repeat(np.repeat(scale, 128, 1), 128, 2)
    codes = (weights / full).astype(ml_dtypes.float8_e4m3fn)
    return lhs, jnp.asarray(codes), sizes, jnp.asarray(scale)


def bitwise_operands(rng, x_shape, w_shape):
    """Operands for the tests that compare rows bitwise. On a GPU: random normals, so that
    the question is wgmma's real rounding order. In interpret mode each tile's product is an
    XLA CPU dot, whose rounding may itself depend on the tile's shape on some CPUs (AMD EPYC:
    one element in 50k differed between 64- and 16-column tiles); there small integers (over
    8 for w), whose sums are exact in any order, so that the test checks the kernel's own
    structure (which rows, K ranges and partial sums meet) and not XLA's CPU dot."""
    if KERNEL != "interpret":
        return (jnp.asarray(rng.standard_normal(x_shape), jnp.bfloat16),
                jnp.asarray(rng.standard_normal(w_shape) / 8, jnp.bfloat16))
    return (jnp.asarray(rng.integers(-4, 5, x_shape), jnp.bfloat16),
            jnp.asarray(rng.integers(-4, 5, w_shape) / 8, jnp.bfloat16))


def close(out, ref):
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert out.shape == ref.shape
    np.testing.assert_allclose(out, ref, rtol=2e-2, atol=2e-2 * max(np.abs(ref).max(), 1e-3))


@pytest.mark.parametrize("case", SIZES)
@pytest.mark.parametrize("swiglu", [None, 7.0])
def test_kernel_matches_reference_bf16(case, swiglu):
    lhs, rhs, sizes, _ = problem(SIZES[case], fp8=False)
    ref = reference.grouped_matmul(lhs, rhs, sizes, swiglu_limit=swiglu)
    close(api.grouped_matmul(lhs, rhs, sizes, swiglu_limit=swiglu, impl=KERNEL), ref)


WS = WarpSpecializedConfig(block_n=64)
# Tiles whose second 64-row half is all padding (its consumer skips) or holds one row.
WS_SIZES = SIZES | {"halves at the edge": [64, 65, 0, 129, 128]}


# The persistent kernel on groups: programs loop over the (tile, column) pairs (3 of them here)
WS_PERSISTENT = mosaic_gpu_persistent.PersistentConfig(block_n=64, programs=3)


@pytest.mark.parametrize("case", WS_SIZES)
@pytest.mark.parametrize("swiglu", [None, 7.0])
@pytest.mark.parametrize("config", [WS, WS_PERSISTENT], ids=["per tile", "persistent"])
def test_warp_specialized_kernel_matches_reference(case, swiglu, config):
    lhs, rhs, sizes, _ = problem(WS_SIZES[case], fp8=False)
    ref = reference.grouped_matmul(lhs, rhs, sizes, swiglu_limit=swiglu)
    close(api.grouped_matmul(lhs, rhs, sizes, swiglu_limit=swiglu, impl=KERNEL, config=config),
          ref)


def test_persistent_expert_mlp_matches_the_reference_chain():
    rng = np.random.default_rng(13)
    sizes = jnp.asarray(WS_SIZES["halves at the edge"], jnp.int32)
    x = jnp.asarray(rng.standard_normal((int(sizes.sum()), K)), jnp.bfloat16)
    w13 = jnp.asarray(rng.standard_normal((len(sizes), K, N)) / 8, jnp.bfloat16)
    w2 = jnp.asarray(rng.standard_normal((len(sizes), N // 2, K)) / 8, jnp.bfloat16)
    close(api.expert_mlp(x, w13, w2, sizes, 7.0, impl=KERNEL,
                         configs=(WS_PERSISTENT, dataclasses.replace(WS_PERSISTENT, block_n=128))),
          api.expert_mlp(x, w13, w2, sizes, 7.0, impl="reference"))


def test_warp_specialized_expert_mlp_and_dense_invariance():
    rng = np.random.default_rng(8)
    sizes = jnp.asarray(SIZES["one hot expert"], jnp.int32)
    x = jnp.asarray(rng.standard_normal((int(sizes.sum()), K)), jnp.bfloat16)
    w13 = jnp.asarray(rng.standard_normal((len(sizes), K, N)) / 8, jnp.bfloat16)
    w2 = jnp.asarray(rng.standard_normal((len(sizes), N // 2, K)) / 8, jnp.bfloat16)
    close(api.expert_mlp(x, w13, w2, sizes, 7.0, impl=KERNEL, configs=(WS, WS)),
          api.expert_mlp(x, w13, w2, sizes, 7.0, impl="reference"))
    full = np.asarray(invariant.matmul(x, w13[0], impl=KERNEL, config=WS), np.float32)
    for m in (1, 3, 64):
        np.testing.assert_array_equal(
            np.asarray(invariant.matmul(x[:m], w13[0], impl=KERNEL, config=WS), np.float32), full[:m])


@pytest.mark.parametrize("rows", [100, 5000])
def test_default_configs_small_and_large_batches(rows):
    """The decode-sized and prefill-sized default tiles (api.default_config) on one problem."""
    rng = np.random.default_rng(rows)
    sizes = jnp.asarray(np.bincount(rng.integers(0, 6, rows), minlength=6), jnp.int32)
    lhs = jnp.asarray(rng.standard_normal((rows, K)), jnp.bfloat16)
    rhs = jnp.asarray(rng.standard_normal((6, K, N)) / 8, jnp.bfloat16)
    assert api.default_config(rows, N // 2, swiglu=True).block_m == (64 if rows < 4096 else 128)
    ref = reference.grouped_matmul(lhs, rhs, sizes, swiglu_limit=7.0)
    close(api.grouped_matmul(lhs, rhs, sizes, swiglu_limit=7.0, impl=KERNEL), ref)


@pytest.mark.parametrize("case", ["balanced", "empty experts"])
@pytest.mark.parametrize("swiglu", [None, 0.0])
def test_kernel_matches_reference_fp8_block_scales(case, swiglu):
    lhs, rhs, sizes, scale = problem(SIZES[case], fp8=True)
    ref = reference.grouped_matmul(lhs, rhs, sizes, rhs_scale=scale, swiglu_limit=swiglu)
    out = api.grouped_matmul(lhs, rhs, sizes, rhs_scale=scale, swiglu_limit=swiglu, impl=KERNEL,
                             config=TileConfig(block_n=128))
    close(out, ref)


def test_expert_mlp_matches_reference_chain():
    rng = np.random.default_rng(7)
    sizes = jnp.asarray(SIZES["empty experts"], jnp.int32)
    x = jnp.asarray(rng.standard_normal((int(sizes.sum()), K)), jnp.bfloat16)
    w13 = jnp.asarray(rng.standard_normal((len(sizes), K, N)) / 8, jnp.bfloat16)
    w2 = jnp.asarray(rng.standard_normal((len(sizes), N // 2, K)) / 8, jnp.bfloat16)
    ref = api.expert_mlp(x, w13, w2, sizes, 7.0, impl="reference")
    close(api.expert_mlp(x, w13, w2, sizes, 7.0, impl=KERNEL), ref)


@pytest.mark.parametrize("impl", [KERNEL, "reference"])
def test_expert_mlp_gathers_its_rows_and_orders_its_result(impl):
    """source_rows / out_order (the routed experts' tokens in, pairs out): the same bits as
    gathering the sorted rows first and reordering the result after."""
    rng = np.random.default_rng(8)
    sizes = jnp.asarray(SIZES["empty experts"], jnp.int32)
    rows = int(sizes.sum())
    tokens = jnp.asarray(rng.standard_normal((rows // 2 + 1, K)), jnp.bfloat16)
    source_rows = jnp.asarray(rng.integers(0, tokens.shape[0], rows), jnp.int32)
    out_order = jnp.asarray(rng.permutation(rows), jnp.int32)
    w13 = jnp.asarray(rng.standard_normal((len(sizes), K, N)) / 8, jnp.bfloat16)
    w2 = jnp.asarray(rng.standard_normal((len(sizes), N // 2, K)) / 8, jnp.bfloat16)
    sorted_first = api.expert_mlp(tokens[source_rows], w13, w2, sizes, 7.0, impl=impl)
    np.testing.assert_array_equal(
        np.asarray(api.expert_mlp(tokens, w13, w2, sizes, 7.0, impl=impl, source_rows=source_rows,
                                  out_order=out_order), np.float32),
        np.asarray(sorted_first[out_order], np.float32))


def test_a_rows_result_does_not_depend_on_its_groups_size():
    """What batch-invariant MoE needs: the same (row, expert) pair gives the same bits
    whether the expert got one row or many."""
    lhs, rhs, sizes, _ = problem(SIZES["one hot expert"], fp8=False)
    many = np.asarray(api.grouped_matmul(lhs, rhs, sizes, swiglu_limit=7.0, impl=KERNEL),
                      np.float32)
    one = api.grouped_matmul(lhs[:1], rhs, jnp.asarray([0, 0, 1, 0], jnp.int32),
                             swiglu_limit=7.0, impl=KERNEL)
    np.testing.assert_array_equal(np.asarray(one, np.float32), many[:1])


def test_unfit_shapes_take_the_reference_path():
    assert not api.kernel_runs(8, 96, 40, impl="mosaic_gpu")       # K not a multiple of 64
    assert api.kernel_runs(8, 128, 128, impl="mosaic_gpu")
    assert not api.kernel_runs(8, 128, 128, impl="reference")
    lhs = jnp.ones((5, 96), jnp.bfloat16)
    rhs = jnp.ones((2, 96, 40), jnp.bfloat16)
    out = api.grouped_matmul(lhs, rhs, jnp.asarray([2, 3], jnp.int32), impl="mosaic_gpu")
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.full((5, 40), 96.0))


def test_reference_against_float64():
    lhs, rhs, sizes, scale = problem(SIZES["empty experts"], fp8=True, seed=3)
    f64 = lambda a: np.asarray(a, np.float64)  # noqa: E731
    weights = f64(rhs) * np.repeat(np.repeat(f64(scale), 128, 1), 128, 2)
    weights = f64(weights.astype(ml_dtypes.bfloat16))   # the reference dequantizes to bf16
    groups = np.repeat(np.arange(len(sizes)), np.asarray(sizes))
    gate_up = np.einsum("mk,mkn->mn", f64(lhs), weights[groups])
    gate, up = np.minimum(gate_up[:, : N // 2], 7.0), np.clip(gate_up[:, N // 2:], -7.0, 7.0)
    expected = gate / (1 + np.exp(-gate)) * up
    out = reference.grouped_matmul(lhs, rhs, sizes, rhs_scale=scale, swiglu_limit=7.0)
    np.testing.assert_allclose(f64(out), expected, rtol=1e-2, atol=1e-2 * np.abs(expected).max())


def test_tile_layout_gives_every_row_one_slot_in_its_groups_tile():
    sizes = jnp.asarray([0, 70, 0, 3, 130, 1], jnp.int32)
    bm = 64
    tiles = layout.tile_layout(sizes, int(sizes.sum()), bm)
    padded, groups = np.asarray(tiles.padded_row), np.asarray(tiles.tile_group)
    assert len(set(padded.tolist())) == len(padded)
    row_group = np.repeat(np.arange(len(sizes)), np.asarray(sizes))
    assert (groups[padded // bm] == row_group).all()
    assert len(groups) == layout.max_tiles(int(sizes.sum()), len(sizes), bm)
    used = -(-np.asarray(sizes) // bm)
    assert (groups[: used.sum()] >= 0).all() and (groups[used.sum():] == -1).all()
    # Each tile's row count, by hand: 70 -> 64 + 6, 3, 130 -> 64 + 64 + 2, 1, unused 0s.
    expected_rows = [64, 6, 3, 64, 64, 2, 1] + [0] * (len(groups) - 7)
    assert np.asarray(tiles.tile_rows).tolist() == expected_rows


def test_rows_past_the_groups_total_are_in_no_tile():
    """ragged_dot's rows in no group (the MoE's padding pairs, sorted last): no tile slot, so
    they neither take a tile nor overwrite a group's row; the rows in groups keep their slots."""
    sizes = jnp.asarray([0, 70, 0, 3], jnp.int32)
    bm, total = 64, 73
    alone = layout.tile_layout(sizes, total, bm)
    with_extra = layout.tile_layout(sizes, total + 40, bm)
    tiles = with_extra.tile_group.shape[0]
    padded = np.asarray(with_extra.padded_row)
    np.testing.assert_array_equal(padded[:total], np.asarray(alone.padded_row))
    assert (padded[total:] >= tiles * bm).all()
    assert (np.asarray(with_extra.tile_group)[:2] == [1, 1]).all()
    assert int((np.asarray(with_extra.tile_group) >= 0).sum()) == 3        # 70 -> 2 tiles, 3 -> 1


def test_expert_mlp_rows_in_groups_ignore_rows_past_the_total():
    """The kernel path's rows in groups are those of the reference (which gives the rows past
    the total zeros; the kernel leaves them undefined), however many rows follow."""
    rng = np.random.default_rng(9)
    sizes = jnp.asarray(SIZES["empty experts"], jnp.int32)
    total = int(sizes.sum())
    x = jnp.asarray(rng.standard_normal((total + 30, K)), jnp.bfloat16)
    w13 = jnp.asarray(rng.standard_normal((len(sizes), K, N)) / 8, jnp.bfloat16)
    w2 = jnp.asarray(rng.standard_normal((len(sizes), N // 2, K)) / 8, jnp.bfloat16)
    ref = api.expert_mlp(x[:total], w13, w2, sizes, 7.0, impl="reference")
    close(api.expert_mlp(x, w13, w2, sizes, 7.0, impl=KERNEL)[:total], ref)
    np.testing.assert_array_equal(
        np.asarray(api.expert_mlp(x, w13, w2, sizes, 7.0, impl="reference")[total:]), 0)


def test_dense_gemm_rows_do_not_depend_on_the_number_of_rows():
    rng = np.random.default_rng(5)
    x, w = bitwise_operands(rng, (1000, K), (K, N))
    full = np.asarray(invariant.matmul(x, w, impl=KERNEL), np.float32)
    close(full, invariant.matmul(x, w, impl="reference"))
    for m in (1, 3, 64):
        np.testing.assert_array_equal(np.asarray(invariant.matmul(x[:m], w, impl=KERNEL), np.float32),
                                      full[:m])


PERSISTENT = mosaic_gpu_persistent.PersistentConfig(block_n=128, store_n=64, programs=3)   # (loops)


@pytest.mark.parametrize("splits, ranges", [(1, 1), (2, 1), (2, 2), (4, 1), (4, 2)])
def test_persistent_dense_gemm_gives_the_split_k_kernels_bits(splits, ranges):
    """The persistent kernel sums the K ranges apart (`ranges` per call in accumulators of
    their own, the calls chained, each adding the ranges before it): the same bits as the
    one-warpgroup kernel's per-range partials summed after it, so a large batch on it gets
    the rows a small batch gets from the other (M = 200: padded tiles)."""
    rng = np.random.default_rng(11)
    x, w = bitwise_operands(rng, (200, 4 * K), (4 * K, N))
    per_tile = invariant.matmul(x, w, impl=KERNEL, config=TileConfig(64, 128, split_k=splits))
    config = dataclasses.replace(PERSISTENT, ranges=ranges)
    with api.kernel_mode(KERNEL):
        chained = mosaic_gpu_persistent.chained_matmul(x, w, splits=splits, config=config)
    np.testing.assert_array_equal(np.asarray(chained, np.float32),
                                  np.asarray(per_tile, np.float32))
    close(chained, invariant.matmul(x, w, impl="reference"))


def test_large_batches_take_the_persistent_kernel_with_the_weights_k_ranges(monkeypatch):
    monkeypatch.setattr(invariant, "SPLIT_K_ON_GPU", True)
    for k, n in ((4096, 4096), (4096, 1024), (1024, 32768)):
        small = invariant.dense_invariant_config(64, n, k)
        large = invariant.dense_invariant_config(8192, n, k)
        assert isinstance(small, TileConfig) and isinstance(large, mosaic_gpu_persistent.PersistentConfig)
        assert small.split_k == invariant.invariant_split_k(k, n)
        large.check(k, n, splits=small.split_k)
    # and through invariant.matmul: the rows of a large batch's config are the small one's
    rng = np.random.default_rng(12)
    x, w = bitwise_operands(rng, (130, 4 * K), (4 * K, N))
    monkeypatch.setattr(invariant, "MIN_SPLIT_K", 128)       # (K = 512 splits at this size)
    monkeypatch.setattr(invariant, "SPLIT_PROGRAMS", 4)
    assert invariant.invariant_split_k(4 * K, N) == 2
    big = np.asarray(invariant.matmul(x, w, impl=KERNEL, config=PERSISTENT), np.float32)
    np.testing.assert_array_equal(np.asarray(invariant.matmul(x[:3], w, impl=KERNEL), np.float32),
                                  big[:3])


@pytest.mark.parametrize("block_n, swiglu", [(64, 10.0), (128, 10.0), (256, None)])
def test_persistent_grouped_kernel_lowers_for_cuda(block_n, swiglu):
    """V4-Flash's expert GEMMs (gate/up 4096 -> 2 x 2048 with the SwiGLU, down 2048 -> 4096)
    in the configs the bench sweeps (shared memory and registers checked at lowering)."""
    k, n = (4096, 4096) if swiglu else (2048, 4096)
    config = mosaic_gpu_persistent.PersistentConfig(block_n=block_n)
    fn = jax.jit(functools.partial(mosaic_gpu_persistent.tiled_group_matmul, swiglu_limit=swiglu,
                                   config=config))
    tiles = jnp.zeros((400,), jnp.int32)
    with abstract_gpu():
        exported = jax.export.export(fn, platforms=["cuda"])(
            jnp.zeros((400 * 128, k), jnp.bfloat16), jnp.zeros((256, k, n), jnp.bfloat16), tiles,
            tiles)
    assert "mosaic_gpu" in exported.mlir_module()


@pytest.mark.parametrize("splits", [1, 2, 4])
def test_persistent_dense_kernel_lowers_for_cuda(splits):
    """At V4-Flash's 4096 x 4096 with the configs the engine picks (shared memory is checked
    at lowering)."""
    config = invariant.persistent_config(4096, splits)
    x = jnp.zeros((8192, 4096), jnp.bfloat16)
    w = jnp.zeros((4096, 4096), jnp.bfloat16)
    fn = jax.jit(functools.partial(mosaic_gpu_persistent.chained_matmul, splits=splits, config=config))
    with abstract_gpu():
        exported = jax.export.export(fn, platforms=["cuda"])(x, w)
    assert exported.mlir_module().count("mosaic_gpu") >= splits // config.ranges


SPLIT = TileConfig(block_m=64, block_n=128, split_k=4)     # K = 4 x 128: ranges of 2 steps
GROUPED = TileConfig(block_m=64, block_n=64, split_k=4, group_tiles=3)   # 4 tiles: 3 + 1


def test_split_k_rows_do_not_depend_on_the_number_of_rows():
    """K summed in 4 ranges by separate programs, the partials added after: a row's result is
    the same for M = 1, 3, 64 as inside 200 rows, and is the product."""
    rng = np.random.default_rng(6)
    x, w = bitwise_operands(rng, (200, 4 * K), (4 * K, N))
    full = np.asarray(invariant.matmul(x, w, impl=KERNEL, config=SPLIT), np.float32)
    close(full, np.asarray(x, np.float64) @ np.asarray(w, np.float64))
    for m in (1, 3, 64):
        np.testing.assert_array_equal(
            np.asarray(invariant.matmul(x[:m], w, impl=KERNEL, config=SPLIT), np.float32), full[:m])
    # programs in groups of row tiles (the last group short): every (tile, column) once
    np.testing.assert_array_equal(
        np.asarray(invariant.matmul(x, w, impl=KERNEL, config=GROUPED), np.float32), full)


def test_split_k_follows_the_weight_shape_only(monkeypatch):
    monkeypatch.setattr(invariant, "SPLIT_K_ON_GPU", True)
    assert invariant.invariant_split_k(4096, 512) == 8        # 4 column tiles: K in ranges of 512
    assert invariant.invariant_split_k(4096, 64) == 8         # one 64-column tile
    assert invariant.invariant_split_k(8192, 4096) == 2       # 32 column tiles
    assert invariant.invariant_split_k(4096, 24) == 1         # no 64-column tile
    assert invariant.invariant_split_k(1024, 32768) == 1      # 256 column tiles fill the SMs
    for rows in (1, 64, 256):
        config = invariant.dense_invariant_config(rows, 1024, 4096)
        assert config.split_k == 8 and api.kernel_fits(4096, 1024, config, False)
    large = invariant.dense_invariant_config(5000, 1024, 4096)   # the persistent kernel's chain
    assert isinstance(large, mosaic_gpu_persistent.PersistentConfig)
    large.check(4096, 1024, splits=8)
    with pytest.raises(ValueError, match="split K"):
        SPLIT.check(4 * K, N, fp8=False, swiglu=True)


@pytest.mark.parametrize("config", [SPLIT, GROUPED, TileConfig(128, 128, 64, 6, split_k=4,
                                                                 group_tiles=8)],
                         ids=["split", "split-grouped-tiles", "split-128-rows"])
def test_split_k_kernel_lowers_for_cuda(config):
    x = jnp.zeros((128, 4 * K), jnp.bfloat16)
    w = jnp.zeros((1, 4 * K, N), jnp.bfloat16)
    fn = jax.jit(functools.partial(tiled_group_matmul, config=config))
    with abstract_gpu():
        exported = jax.export.export(fn, platforms=["cuda"])(x, w, jnp.zeros((2,), jnp.int32))
    assert "mosaic_gpu" in exported.mlir_module()
    assert exported.out_avals[0].shape == (4, 128, N)


def test_warp_specialized_kernel_lowers_for_cuda():
    lhs, rhs, sizes, _ = problem(SIZES["balanced"], fp8=False)
    tiles = layout.tile_layout(sizes, lhs.shape[0], WS.block_m)
    fn = jax.jit(functools.partial(tiled_group_matmul_ws, swiglu_limit=7.0, config=WS))
    with abstract_gpu():
        exported = jax.export.export(fn, platforms=["cuda"])(
            layout.to_tiles(lhs, tiles, WS.block_m), rhs, tiles.tile_group, tiles.tile_rows)
    assert "mosaic_gpu" in exported.mlir_module()


@pytest.mark.parametrize("fp8", [False, True])
def test_kernel_lowers_for_cuda(fp8):
    """Mosaic GPU's own checks (layouts, tiling, shared memory) run at lowering."""
    lhs, rhs, sizes, scale = problem(SIZES["balanced"], fp8=fp8)
    tiles = layout.tile_layout(sizes, lhs.shape[0], 64)
    fn = jax.jit(functools.partial(tiled_group_matmul, swiglu_limit=7.0))
    with abstract_gpu():
        exported = jax.export.export(fn, platforms=["cuda"])(
            layout.to_tiles(lhs, tiles, 64), rhs, tiles.tile_group, scale)
    assert "mosaic_gpu" in exported.mlir_module()


@pytest.mark.parametrize("case", SIZES)
def test_dense_fallback_equals_ragged_dot(case):
    """The jnp path's dense formulation (used off the CPU for small products) against a
    float64 numpy loop over the groups, with padding rows past the groups' total."""
    lhs, rhs, sizes, _ = problem(SIZES[case], fp8=False)
    lhs = jnp.concatenate([lhs, jnp.ones((5, K), lhs.dtype)])            # 5 rows in no group
    got = jax.jit(functools.partial(reference.grouped_matmul, dense=True))(lhs, rhs, sizes)
    x, w = np.asarray(lhs, np.float64), np.asarray(rhs, np.float64)
    want, start = np.zeros((lhs.shape[0], N)), 0
    for g, size in enumerate(np.asarray(sizes)):
        want[start: start + size] = x[start: start + size] @ w[g]
        start += size
    close(got, want)
    assert not np.asarray(got[-5:], np.float32).any()


# What invariant.TILE_SHAPE_FREE_ON_GPU rests on: on the H200 (where it is the real question, wgmma's
# per-element sums) and in interpret mode. The SwiGLU epilogue is elementwise, so the plain
# product is the whole question; block_k stays 64 in every config.
TILE_SHAPES = [TileConfig(block_m=64, block_n=128), TileConfig(block_m=128, block_n=128),
               TileConfig(block_m=64, block_n=64), TileConfig(block_m=64, block_n=16),
               TileConfig(block_m=128, block_n=64),
               WarpSpecializedConfig(block_n=128), WarpSpecializedConfig(block_n=256),
               mosaic_gpu_persistent.PersistentConfig(block_n=128, programs=3)]


def test_rows_do_not_depend_on_the_tile_shape():
    rng = np.random.default_rng(9)
    x, w = bitwise_operands(rng, (130, 4 * K), (4 * K, N))
    outs = [np.asarray(invariant.matmul(x, w, impl=KERNEL, config=c), np.float32) for c in TILE_SHAPES]
    close(outs[0], invariant.matmul(x, w, impl="reference"))
    for config, out in zip(TILE_SHAPES[1:], outs[1:]):
        np.testing.assert_array_equal(out, outs[0], err_msg=str(config))


def test_invariant_configs_follow_the_batch_only_once_the_tile_shape_is_free(monkeypatch):
    dim, inter = 4096, 2048
    monkeypatch.setattr(invariant, "TILE_SHAPE_FREE_ON_GPU", False)
    for rows in (1, 64, 5000):
        assert invariant.expert_invariant_configs(rows, dim, inter) == \
            invariant.expert_invariant_configs(1, dim, inter)
        assert invariant.dense_invariant_config(rows, 512) == invariant.dense_invariant_config(1, 512)
    monkeypatch.setattr(invariant, "TILE_SHAPE_FREE_ON_GPU", True)
    small = invariant.dense_invariant_config(64, 512)               # a decode batch's 4096 -> 512
    assert small.block_n == 16 and api.kernel_fits(4096, 512, small, False)
    wide = invariant.dense_invariant_config(64, 32768)              # already 256 programs at 128
    assert wide.block_n == 128
    assert invariant.dense_invariant_config(8192, 512) == api.default_config(
        invariant.LARGE_BATCH, 512, warp_specialized=False)
    assert invariant.expert_invariant_configs(5000, dim, inter)[0].block_m == 128
    assert not api.kernel_runs(64, 4096, 24, config=invariant.dense_invariant_config(64, 24),
                               dtype=jnp.float32)          # mHC's: float32, not a wgmma type
    # 8 columns (a tiny model's router): Mosaic GPU finds no shared-memory tiling for them
    assert not api.kernel_fits(4096, 8, invariant.dense_invariant_config(64, 8, 4096), False)
    assert not api.kernel_fits(4096, 8, api.default_config(64, 8), False)


def test_batched_matmul_is_each_groups_product_and_row_invariant():
    """G equal-size groups in one launch (the attention's grouped output projection): each
    group's rows are its own product, and a row's result does not depend on M."""
    rng = np.random.default_rng(7)
    x, w = bitwise_operands(rng, (3, 70, K), (3, K, N))
    full = np.asarray(invariant.batched_matmul(x, w, impl=KERNEL), np.float32)
    close(full, np.einsum("gmk,gkn->gmn", np.asarray(x, np.float64), np.asarray(w, np.float64)))
    for m in (1, 5):
        np.testing.assert_array_equal(
            np.asarray(invariant.batched_matmul(x[:, :m], w, impl=KERNEL), np.float32), full[:, :m])


@pytest.mark.parametrize("config", [TileConfig(block_m=64, block_n=128), SPLIT],
                         ids=["whole-k", "split-k"])
def test_dense_gemm_float32_out_keeps_the_float32_sum(config):
    """out_dtype=float32 (the compressor's and router's projections of bf16 values): the
    float32 sums come out unrounded, so they match a float64 product to float32's rounding of
    a K-term sum, far inside bf16's; and a row's result still does not depend on M."""
    rng = np.random.default_rng(8)
    x = jnp.asarray(rng.standard_normal((130, 4 * K)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((4 * K, N)) / 8, jnp.bfloat16)
    out = invariant.matmul(x, w, impl=KERNEL, config=config, out_dtype=jnp.float32)
    assert out.dtype == jnp.float32
    want = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    np.testing.assert_allclose(np.asarray(out), want, rtol=0, atol=1e-4 * np.abs(want).max())
    np.testing.assert_array_equal(
        np.asarray(invariant.matmul(x[:3], w, impl=KERNEL, config=config, out_dtype=jnp.float32)),
        np.asarray(out)[:3])
